"""``reprolane replay request`` against a running ``reprolane serve replayer``, both real processes on the stack.

The service runs on the remote lane (the stack's vLLM server: a real lane that starts in a second) with its own
uuid topics and consumer group and a replay-request keys file. The CLI, run as a user runs it, finds the service
by its heartbeat and asks it (signed with the same key file); then, with a key the service
does not know, it is refused with the service's reason; with the service stopped it loads a lane of its own and
says why in one line on stderr (the result the service stored on that lane is the answer), and ``--via service``
fails with one line instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from infra.stack.process import log_tail
from infra.stack.state import StackInfo
from replayer.on_demand import live_service
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import Envelope
from tests.cli_process import reprolane
from tests.replayer.service_harness import Topics, start_replayer_service, worker_environment
from tests.replayer.support import (
    S3Target,
    record_from_stack,
    seed_envelope,
    write_replay_request_keys,
)

pytestmark = pytest.mark.stack

MESSAGES = [{"role": "user", "content": "Name three primary colors and explain why."}]


@dataclass
class Served:
    """A ``reprolane serve replayer`` process, the settings it and the CLI share, and the recorded envelope."""

    process: subprocess.Popen[bytes]
    settings: ReplayerSettings
    env: dict[str, str]
    envelope: Envelope
    log: Path


async def wait_for_heartbeat(settings: ReplayerSettings, served: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while await live_service(settings) is None:
        assert served.poll() is None, f"the replayer exited: {log_tail(log)}"
        assert time.monotonic() < deadline, "the replayer service never joined its replay-request group"
        await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
async def served(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    tmp = tmp_path_factory.mktemp("cli-service")
    s3 = S3Target.from_stack(stack)
    topics = await Topics.create(stack.kafka_bootstrap, s3)
    settings = topics.settings(
        lane="remote",
        remote_url=stack.vllm_url,
        served_model_name=stack.model_name,
        replay_request_keys_path=write_replay_request_keys(tmp / "keys.json"),
    )
    envelope = record_from_stack(stack, f"cli-service-{topics.suffix}", MESSAGES, max_tokens=8)
    seed_envelope(s3.client(), s3.bucket, envelope)
    env = {**worker_environment(settings), "REPROLANE_RUN_DIR": str(stack.run_dir)}
    log = tmp / "replayer.log"
    process = start_replayer_service(env, log)
    try:
        await wait_for_heartbeat(settings, process, log)
        yield Served(process, settings, env, envelope, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


async def test_a_request_the_service_refuses_fails_at_once_with_its_reason(served: Served, tmp_path: Path) -> None:
    stranger = write_replay_request_keys(
        tmp_path / "other.json", {"stranger": {"secret": "ab" * 16, "roles": ["replay"]}}
    )
    env = {**served.env, "REPROLANE_REPLAYER_REPLAY_REQUEST_KEYS_PATH": str(stranger)}
    started = time.monotonic()
    refused = await asyncio.to_thread(
        reprolane, "replay", "request", served.envelope.request_id, "--via", "service", env=env
    )
    assert time.monotonic() - started < 60  # the dead letter answers: the 30 s timeout is not waited out
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("reprolane: error: the replayer service refused the request: unauthorised: unknown key id")


async def test_replay_request_asks_the_running_service_and_loads_a_lane_without_one(served: Served) -> None:
    rid = served.envelope.request_id
    store = EnvelopeStore.from_settings(served.settings)

    fast = await asyncio.to_thread(reprolane, "replay", "request", rid, "--json", env=served.env)
    assert fast.returncode in (0, 1), fast.stderr
    assert "replayed by the running replayer service on lane remote" in fast.stderr
    answered = json.loads(fast.stdout)
    (key,) = store.list_results(served.envelope)  # the service stored it; the CLI printed that stored result
    stored = store.get_result(served.envelope, answered["event"]["lane_fingerprint_sha256"])
    assert stored is not None
    assert key.endswith(f"/{stored.event.result_id()}.json")
    assert answered == stored.model_dump(mode="json")
    assert fast.returncode == (0 if stored.event.target_met else 1)

    again = await asyncio.to_thread(reprolane, "replay", "request", rid, "--via", "service", env=served.env)
    assert again.returncode == fast.returncode, again.stderr
    assert again.stdout.startswith(f"Replay of request {rid} (envelope {served.envelope.envelope_id()[:16]}…) on lane")
    assert "replayed by the running replayer service" in again.stderr

    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(served.process.wait, 60) == 0, log_tail(served.log)
    assert await live_service(served.settings) is None  # its last heartbeat said it was stopping

    local = await asyncio.to_thread(reprolane, "replay", "request", rid, "--json", env=served.env)
    assert local.returncode in (0, 1), local.stderr
    (why,) = [line for line in local.stderr.splitlines() if "replaying here instead" in line]  # one line says why
    assert why.startswith("reprolane: not asking the replayer service (no replayer service is running")
    replayed: dict[str, Any] = json.loads(local.stdout)
    assert (replayed["event"]["request_id"], replayed["event"]["lane"]) == (rid, "remote")
    # the lane loaded here is the service's (the same server): the result stored on it is the verdict, not a second
    assert replayed == answered
    assert len(store.list_results(served.envelope)) == 1

    only_service = await asyncio.to_thread(reprolane, "replay", "request", rid, "--via", "service", env=served.env)
    assert only_service.returncode == 2
    assert only_service.stdout == ""
    assert only_service.stderr.startswith(
        "reprolane: error: no replayer service is running (no recent heartbeat of group "
    )
