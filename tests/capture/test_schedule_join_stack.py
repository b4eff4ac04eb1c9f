"""The schedule join end to end against a real vLLM (issue 22): the stack's own launcher starts a private vLLM that
records its schedule (a stand-in recorder, `tests.schedule_recorder_standin`, in place of the real one), the
sidecar forwards its request ids, the shipper ships the log to the real SeaweedFS and Tansu, and each envelope's
schedule read back through the index is its own request's: two requests sent at once with each other's
X-Request-Id, and a completions request, each map to the engine request vLLM made of them.

One private vLLM (about a minute on two cores): the session's stack's vLLM runs without the recorder flag."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture.app import build_app
from capture.metrics import CaptureMetrics
from capture.schedule.shipper import Shipper
from capture.schedule.shipper_settings import ShipperSettings
from capture.settings import CaptureSettings
from infra import servers
from infra.errors import StackError
from infra.stack import LocalStack
from infra.stack_env import stack_defaults
from infra.state import StackInfo
from replayer.schedule_store import ScheduleStore
from replayer.settings import ReplayerSettings
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import serve

pytestmark = [pytest.mark.stack, pytest.mark.model]

STANDIN = "tests.schedule_recorder_standin.RecordingScheduler"


@pytest.fixture(scope="module")
def recording_vllm(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """A private vLLM launched by `infra.stack` with the recorder flag (the stand-in's class), as the session
    stack's info with that vLLM and run dir (a stack of vLLM alone has no S3 or Kafka of its own)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(servers, "RECORDER_CLASS", STANDIN)
    private = LocalStack(tmp_path_factory.mktemp("recording-vllm"), kafka_storage="memory")
    try:
        with contextlib.suppress(StackError):  # up() started vLLM, then found no S3/Kafka to describe
            private.up(["vllm"])
        (status,) = private.status()
        assert status.health == "ready", status.log_tail
        yield stack.model_copy(update={"run_dir": private.run_dir, "vllm_url": status.url})
    finally:
        private.down()
        patch.undo()


def _fields(env: dict[str, str], prefix: str) -> dict[str, Any]:
    """A service's settings fields from the stack's defaults (what `reprolane` would read from the environment)."""
    return {k.removeprefix(prefix).lower(): v for k, v in env.items() if k.startswith(prefix)}


async def test_each_envelope_finds_its_own_engine_request(stack: StackInfo, recording_vllm: StackInfo) -> None:
    run_dir = recording_vllm.run_dir
    defaults = stack_defaults(recording_vllm)
    assert defaults["REPROLANE_CAPTURE_SCHEDULE_RECORDER"] == servers.RECORDER_NAME
    schedule_dir = Path(defaults["REPROLANE_SHIPPER_SCHEDULE_DIR"])
    assert schedule_dir == servers.schedule_dir(run_dir)
    assert recording_vllm.vllm_url is not None

    spool = FakeSpool()
    settings = CaptureSettings(
        upstream=recording_vllm.vllm_url, spool_max_bytes=1 << 20, schedule_recorder=servers.RECORDER_NAME
    )
    app = build_app(settings, spool=spool, metrics=CaptureMetrics())
    model = recording_vllm.model_name
    messages = [{"role": "user", "content": "Name a colour."}]
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        chat = {"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}
        a, b, c = await asyncio.gather(
            client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "client-b"}),
            client.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "client-a"}),
            client.post("/v1/completions", json={"model": model, "prompt": "Red, green and", "max_tokens": 4}),
        )
    assert [r.status_code for r in (a, b, c)] == [200, 200, 200], [r.text for r in (a, b, c)]
    envelopes = {e.request_id: e for e in spool.envelopes}
    assert len(envelopes) == 3

    shipper = Shipper(ShipperSettings(**_fields(defaults, "REPROLANE_SHIPPER_"), retention_days=0))
    try:
        assert await shipper.ship_pending() > 0
    finally:
        await shipper.close()
    assert shipper.quarantined == 0

    store = ScheduleStore.from_settings(ReplayerSettings(**_fields(defaults, "REPROLANE_REPLAYER_")))
    engines = set()
    for rid, env in envelopes.items():
        window = store.records_for(env)
        (arrival,) = window.arrivals
        prefix = "chatcmpl" if env.endpoint == "chat.completions" else "cmpl"
        suffix = "" if env.endpoint == "chat.completions" else "-0"
        assert arrival.external_request_id == f"{prefix}-{rid}{suffix}"
        assert arrival.engine_request_id.startswith(f"{prefix}-{rid}{suffix}-")
        assert env.prompt is not None
        assert arrival.num_prompt_tokens == len(env.prompt.token_ids)  # vLLM's request, not a neighbour's
        assert any(arrival.engine_request_id in {s.engine_request_id for s in st.scheduled} for st in window.steps)
        engines.add(arrival.engine_id)
    assert len(engines) == 1
    assert {e.client_request_id for e in envelopes.values()} == {"client-a", "client-b", None}
