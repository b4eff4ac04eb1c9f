"""One verdict per request, wherever it is asked, and the service's schedule-lane answers taken (issue 30).

On the real stack: two chat requests of one workflow sent at once through the real sidecar to the stack's vLLM,
which records its schedule; their schedule shipped by the real shipper; a real ``reprolane serve replayer``
(one-at-a-time lane ``remote``, schedule lanes built on demand) consuming from the real Tansu; the real CLI.

- ``replay request --via service`` is answered by the service on the schedule lane it builds for the request
  (on main: refused, "the answer names lane fingerprint …, not the running service's …"), and the service's
  heartbeat then advertises that lane with its fingerprint;
- ``--lane schedule`` is a lane a user may ask for (on main: "--lane must be one of vllm, remote, transformers");
- ``replay workflow`` replays the same steps on the same lane and says the same verdicts (on main: one at a time,
  on the settings' lane, while ``replay request`` took the schedule lane);
- a replay done by the CLI itself (``--via local``) is stored where the console's request page and evidence
  bundles read results (on main: printed, stored nowhere);
- with ``replay_unit=busy_period`` (issue 32) the service's one replay of the requests' busy period stores the
  second request's result too, read from S3 and compared as its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
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
from tests.replayer.schedule.scheduled_stack import chat, record_scheduled, ship_schedules
from tests.replayer.service_harness import Topics, start_replayer_service, worker_environment
from tests.replayer.support import S3Target, write_replay_request_keys

pytestmark = [pytest.mark.stack, pytest.mark.model]

PROMPTS = ("Name three primary colors and explain why.", "Write one sentence about the sea.")
#: The first answer on a schedule lane waits for the service to start that lane's engine (tens of seconds here).
FIRST_ANSWER_TIMEOUT_S = 480


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    settings: ReplayerSettings
    env: dict[str, str]
    envelopes: list[Envelope]
    workflow_id: str
    log: Path


@pytest.fixture(scope="module")
async def served(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Served]:
    tmp = tmp_path_factory.mktemp("one-verdict")
    s3 = S3Target.from_stack(stack)
    topics = await Topics.create(stack.kafka_bootstrap, s3)
    settings = topics.settings(
        lane="remote",
        remote_url=stack.vllm_url,
        served_model_name=stack.model_name,
        model_dir=stack.model_dir,
        replay_request_keys_path=write_replay_request_keys(tmp / "keys.json"),
    )
    workflow_id = f"wf-{uuid.uuid4().hex[:12]}"
    headers = [{"X-Reprolane-Workflow-Id": workflow_id, "X-Reprolane-Step": str(i + 1)} for i in range(len(PROMPTS))]
    envelopes = await record_scheduled(stack, s3, [chat(p, 12) for p in PROMPTS], headers)
    await ship_schedules(stack, settings, envelopes, tmp)
    env = {
        **worker_environment(settings),
        "REPROLANE_RUN_DIR": str(stack.run_dir),
        "HF_HUB_OFFLINE": "1",
        # the stack's vLLM engine runs cores - 1 threads; a schedule lane must run production's count
        "REPROLANE_REPLAYER_VLLM_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) - 1)),
        "REPROLANE_REPLAYER_REPLAY_UNIT": "busy_period",  # issue 32: one replay for the period's two requests
    }
    log = tmp / "replayer.log"
    process = start_replayer_service(env, log)
    try:
        deadline = time.monotonic() + 120
        while await live_service(settings) is None:
            assert process.poll() is None, f"the replayer exited: {log_tail(log)}"
            assert time.monotonic() < deadline, "the replayer service never beat"
            await asyncio.sleep(0.5)
        yield Served(process, settings, env, envelopes, workflow_id, log)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


async def test_the_service_answers_on_its_schedule_lane_and_every_entry_point_says_the_same(served: Served) -> None:
    first, second = served.envelopes
    store = EnvelopeStore.from_settings(served.settings)
    asked = await asyncio.to_thread(
        reprolane, "replay", "request", first.request_id, "--via", "service", "--json",
        "--timeout", str(FIRST_ANSWER_TIMEOUT_S), env=served.env, timeout=900,
    )  # fmt: skip
    assert asked.returncode in (0, 1), f"{asked.stderr[-3000:]}\n{log_tail(served.log)}"
    assert "replayed by the running replayer service on lane schedule" in asked.stderr
    answer: dict[str, Any] = json.loads(asked.stdout)
    event = answer["event"]
    assert (event["request_id"], event["lane"]) == (first.request_id, "schedule")
    assert event["schedule_reproduced"] is not None
    beat = await live_service(served.settings)
    assert beat is not None
    assert beat.lanes is not None
    advertised = {(lane.name, lane.fingerprint_sha256) for lane in beat.lanes}
    assert ("schedule", event["lane_fingerprint_sha256"]) in advertised  # the lane that answered
    assert ("remote", beat.lane_fingerprint_sha256) in advertised  # and the one-at-a-time lane
    # the two requests ran in one busy period: the service replayed it once, and stored the second's result too
    early = store.results(second)
    assert [r.event.lane for r in early] == ["schedule"], "the busy period was not replayed for both requests"
    assert "replayed once for 2 captured requests" in early[0].event.cause_detail

    again = await asyncio.to_thread(
        reprolane, "replay", "request", first.request_id, "--lane", "schedule", "--via", "service", "--json",
        env=served.env, timeout=900,
    )  # fmt: skip
    assert again.returncode == asked.returncode, again.stderr[-3000:]
    assert json.loads(again.stdout) == answer  # the stored result: one verdict

    flow = await asyncio.to_thread(
        reprolane, "replay", "workflow", served.workflow_id, "--json", env=served.env, timeout=900
    )
    assert flow.returncode in (0, 1), flow.stderr[-3000:]
    assert "replaying here instead" not in flow.stderr  # the service answered every step
    steps = json.loads(flow.stdout)["steps"]
    assert [s["request_id"] for s in steps] == [first.request_id, second.request_id]
    assert [s["result"]["event"]["lane"] for s in steps] == ["schedule", "schedule"]
    assert steps[0]["result"] == answer
    verdicts = {}
    for envelope, step in zip(served.envelopes, steps, strict=True):
        results = store.results(envelope)  # what the console's request page and an evidence bundle read
        assert [r.model_dump(mode="json") for r in results] == [step["result"]]
        verdicts[envelope.request_id] = results[0].event.verdict
    assert flow.returncode == (0 if all(s["result"]["event"]["target_met"] for s in steps) else 1)

    second_alone = await asyncio.to_thread(
        reprolane, "replay", "request", second.request_id, "--via", "service", "--json", env=served.env, timeout=900
    )
    assert json.loads(second_alone.stdout)["event"]["verdict"] == verdicts[second.request_id]


async def test_a_replay_done_by_the_cli_itself_is_stored_where_the_console_reads_it(served: Served) -> None:
    _, second = served.envelopes
    store = EnvelopeStore.from_settings(served.settings)
    local = await asyncio.to_thread(
        reprolane, "replay", "request", second.request_id, "--via", "local", "--lane", "remote", "--json",
        env=served.env, timeout=900,
    )  # fmt: skip
    assert local.returncode in (0, 1), local.stderr[-3000:]
    printed: dict[str, Any] = json.loads(local.stdout)
    assert printed["event"]["lane"] == "remote"
    stored = store.get_result(second, printed["event"]["lane_fingerprint_sha256"])
    assert stored is not None
    assert stored.model_dump(mode="json") == printed
    assert printed in [r.model_dump(mode="json") for r in store.results(second)]
