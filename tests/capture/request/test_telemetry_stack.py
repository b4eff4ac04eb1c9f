"""Issue 20, item 4, on the real parts: ``reprolane serve capture`` (a subprocess) in front of the stack's vLLM
exports one span per captured request to a real OTLP/HTTP receiver (`tests.otlp_receiver`); the replayer service
(Tansu, SeaweedFS, the remote lane replaying on the same vLLM) replays the captured envelope and exports a span
with the verdict, in the request's trace under the capture span; and with the receiver down the clients' answers
are the same and the failed exports are counted.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from capture.spool import Spool
from infra.clients.otel import capture_span_id, request_trace_id
from infra.stack.ports import allocate_ports
from infra.stack.state import StackInfo
from replayer.lanes import make_lane
from replayer.service import ReplayerService
from replayer.store import EnvelopeStore
from schemas import decode_envelope
from tests.capture.request.cli_sidecar import RunningSidecar, cli_sidecar
from tests.otlp_receiver import otlp_receiver
from tests.replayer.service_harness import Topics, events
from tests.replayer.support import S3Target

pytestmark = pytest.mark.stack

CALLER_TRACE, CALLER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
SECRET = "otel-stack-secret-prompt-text"


def _env(stack: StackInfo, **more: str) -> dict[str, str]:
    assert stack.model_dir is not None
    return {"auth_mode": "off", "manifest_path": str(stack.model_dir / "reprolane-manifest.json"), **more}


async def _ask(sidecar: RunningSidecar, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{SECRET}: say hi"}],
        "max_tokens": 4,
        "temperature": 0.0,
        "seed": 11,
    }
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sidecar.port}", timeout=120.0) as client:
        return await client.post("/v1/chat/completions", json=body, headers=headers or {})


async def test_capture_and_replay_spans_reach_a_real_receiver(stack: StackInfo, tmp_path: Path) -> None:
    assert stack.vllm_url is not None
    with otlp_receiver() as receiver:
        async with cli_sidecar(stack.vllm_url, tmp_path, **_env(stack, otel_endpoint=receiver.endpoint)) as sidecar:
            plain = await _ask(sidecar, stack.model_name)
            joined = await _ask(sidecar, stack.model_name, {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
            assert (plain.status_code, joined.status_code) == (200, 200)
            rid = plain.headers["x-reprolane-request-id"]
            joined_rid = joined.headers["x-reprolane-request-id"]
            (span,) = receiver.wait_for({"reprolane.request_id": rid})
            (joined_span,) = receiver.wait_for({"reprolane.request_id": joined_rid})
        spool = Spool(sidecar.spool_dir, max_bytes=1 << 30)
        await spool.open()
        try:
            payloads = {decode_envelope(e.payload).request_id: e.payload for e in await spool.pending(100)}
        finally:
            await spool.close()

        envelope = decode_envelope(payloads[rid])
        a = span.attributes
        assert a["reprolane.envelope_id"] == envelope.envelope_id()
        assert a["reprolane.tenant"] == envelope.tenant
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == stack.model_name
        assert (a["gen_ai.request.seed"], a["gen_ai.request.temperature"], a["gen_ai.request.max_tokens"]) == (
            11, 0.0, 4
        )  # fmt: skip
        assert a["gen_ai.usage.input_tokens"] == len(envelope.prompt.token_ids if envelope.prompt else ())
        assert a["gen_ai.usage.output_tokens"] == len(envelope.outcome.choices[0].token_ids)  # type: ignore[union-attr]
        assert a["gen_ai.response.finish_reasons"] == [envelope.outcome.choices[0].finish_reason]  # type: ignore[union-attr]
        assert a["gen_ai.response.id"].startswith("chatcmpl-")
        assert a["openai.response.system_fingerprint"] == envelope.runtime.system_fingerprint
        assert (span.trace_id, span.span_id) == (f"{request_trace_id(rid):032x}", f"{capture_span_id(rid):016x}")
        assert (joined_span.trace_id, joined_span.parent_span_id) == (CALLER_TRACE, CALLER_SPAN)
        assert SECRET not in repr(receiver.received)

        topics = await Topics.create(stack.kafka_bootstrap, S3Target.from_stack(stack))
        await topics.produce("envelope_topic", payloads[rid], key=rid.encode())
        settings = topics.settings(
            lane="remote",
            remote_url=stack.vllm_url,
            served_model_name=stack.model_name,
            replay_all=True,
            otel_endpoint=receiver.endpoint,
        )
        lane = make_lane(settings)
        try:
            async with ReplayerService(settings, lane, EnvelopeStore.from_settings(settings)):
                (event,) = events(await topics.consume("divergence_topic", 1, timeout_s=120))
        finally:
            lane.close()
        (replay,) = receiver.wait_for({"reprolane.request_id": rid, "reprolane.replay.outcome": "replayed"})
    assert replay.attributes["reprolane.replay.verdict"] == event.verdict
    assert replay.attributes["reprolane.envelope_id"] == envelope.envelope_id()
    assert (replay.trace_id, replay.parent_span_id) == (span.trace_id, span.span_id)  # under the capture span
    assert replay.resource["service.name"] == f"reprolane-replayer/{settings.group_id}"


async def test_a_receiver_that_is_down_leaves_the_answers_as_they_are(stack: StackInfo, tmp_path: Path) -> None:
    assert stack.vllm_url is not None
    (dead_port,) = allocate_ports(1)  # nothing listens there
    env = _env(stack, otel_endpoint=f"http://127.0.0.1:{dead_port}/v1/traces", otel_export_timeout_s="1")
    async with cli_sidecar(stack.vllm_url, tmp_path, **_env(stack)) as reference:
        expected = (await _ask(reference, stack.model_name)).json()["choices"][0]["message"]
    async with cli_sidecar(stack.vllm_url, tmp_path, **env) as sidecar:
        answers = [await _ask(sidecar, stack.model_name) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert all(a.json()["choices"][0]["message"] == expected for a in answers)
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sidecar.port}") as client:
            while True:
                metrics = (await client.get("/metrics")).text
                failed = [
                    line for line in metrics.splitlines() if line.startswith("reprolane_capture_otel_spans_failed")
                ]
                if failed and float(failed[0].split()[-1]) >= 3:
                    break
                assert time.monotonic() < deadline, metrics
                await asyncio.sleep(0.5)
        assert "Traceback" not in sidecar.log_text()
