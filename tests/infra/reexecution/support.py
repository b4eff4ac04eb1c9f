"""Re-executable evidence made on the session stack, as the operator makes it, for the tests that re-execute it.

Requests go through the real sidecar to the stack's recording vLLM (`record_and_ship`); their envelopes are
published by the real publisher with the Merkle log, and their schedule shipped by the real shipper (which logs each
segment in its engine's schedule log), both into one bucket of the test's own (`evidence_bucket`), as one audit
bucket holds both where reprolane is deployed. Then, in child processes as the operator runs them, ``reprolane
audit checkpoint`` signs the day's log and the engine's schedule log (`checkpoint`) and ``reprolane audit evidence
export ID --reexecutable`` writes a bundle (`export_reexecutable`).
`offline_env` is the regulator's environment: no S3, no Kafka, no stack.

Used by test_reexecute_stack.py (the whole story) and tests/infra/cli/test_json_output.py (one bundle, for
``reexecute --json``).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from pathlib import Path

import httpx

from infra.stack.buckets import s3_client
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo
from schemas import Envelope
from schemas.layout import capture_day
from tests.capture.audit.evidence.test_export_stack import cli_env, publish_settings
from tests.capture.audit.support import publish_through_s3
from tests.capture.fake_upstream import serve
from tests.cli_process import reprolane
from tests.replayer.schedule.scheduled_stack import chat, ship_schedules, stack_replayer_settings, stack_sidecar
from tests.replayer.schedule.test_lane_model import model_dir
from tests.replayer.schedule.test_replay_stack import _spooled

#: Sends requests through the sidecar (a client on it) and returns their request ids, in groups of its choosing.
Send = Callable[[httpx.AsyncClient], Awaitable[Sequence[Sequence[str]]]]


async def ask(client: httpx.AsyncClient, prompt: str, headers: dict[str, str] | None = None) -> str:
    """One greedy chat request of 12 tokens through the sidecar; the request id it recorded."""
    reply = await client.post("/v1/chat/completions", json=chat(prompt, 12), headers=headers)
    assert reply.status_code == 200, reply.text
    return reply.headers["x-reprolane-request-id"]


def evidence_bucket(stack: StackInfo) -> str:
    """A new bucket with Object Lock in the stack's S3, for one test's envelopes and schedules; its name."""
    name = f"reprolane-test-reexec-{uuid.uuid4().hex[:8]}"
    s3_client(stack.s3_endpoint, stack.s3_credentials).create_bucket(Bucket=name, ObjectLockEnabledForBucket=True)
    return name


async def record_and_ship(stack: StackInfo, tmp_path: Path, send: Send, bucket: str) -> list[list[Envelope]]:
    """`send`'s requests, through the real sidecar to the stack's recording vLLM: their envelopes published with the
    Merkle log into `bucket` (`evidence_bucket`) and their schedule windows shipped there; the envelopes in `send`'s
    groups."""
    app, spool = stack_sidecar(stack)
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        groups = await send(client)
    envelopes = await _spooled(spool, [rid for group in groups for rid in group])
    await publish_through_s3(publish_settings(stack, tmp_path / "spool", bucket), envelopes, tmp_path / "spool")
    settings = stack_replayer_settings(stack).model_copy(update={"s3_bucket": bucket})
    await ship_schedules(stack, settings, envelopes, tmp_path / "ship")
    by_id = {e.request_id: e for e in envelopes}
    return [[by_id[rid] for rid in group] for group in groups]


def operator_env(stack: StackInfo, private: bytes, bucket: str) -> dict[str, str]:
    """The operator's environment: the audit side and the replayer's schedule store on `bucket`, signing with
    `private`, and the model directory."""
    return {
        **cli_env(stack, private, bucket),
        **{k: v for k, v in stack_defaults(stack).items() if k.startswith("REPROLANE_REPLAYER_")},
        "REPROLANE_REPLAYER_S3_BUCKET": bucket,
        "REPROLANE_REPLAYER_MODEL_DIR": str(model_dir()),
    }


def checkpoint(captured_at: datetime, env: dict[str, str]) -> None:
    """``reprolane audit checkpoint``: the log of the day of `captured_at` and the engine's schedule log signed."""
    signed = reprolane("audit", "checkpoint", env=env)
    assert f"{capture_day(captured_at)}: checkpoint size" in signed.stdout, signed.stdout + signed.stderr
    assert re.search(r"schedules/engine=\S+: checkpoint size", signed.stdout), signed.stdout


def export_reexecutable(request_id: str, path: Path, env: dict[str, str]) -> str:
    """``reprolane audit evidence export ID --reexecutable -o PATH``; the key fingerprint it says to pin."""
    done = reprolane("audit", "evidence", "export", request_id, "-o", str(path), "--reexecutable", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "re-executable" in done.stdout
    return done.stdout.rsplit("--key-fingerprint ", 1)[1].strip()


def offline_env(tmp_path: Path) -> dict[str, str]:
    """An environment naming no S3, no Kafka, no stack: S3 endpoints that refuse, an empty run dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_")}
    (tmp_path / "no-stack").mkdir(exist_ok=True)
    env["REPROLANE_RUN_DIR"] = str(tmp_path / "no-stack")
    env["REPROLANE_AUDIT_S3_ENDPOINT"] = env["REPROLANE_REPLAYER_S3_ENDPOINT"] = "http://127.0.0.1:9"
    return env
