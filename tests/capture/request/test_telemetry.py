"""OpenTelemetry export of the sidecar (issue 20, item 4), against the fake upstream, into a real OTLP/HTTP
receiver (`tests.otlp_receiver`): one span per captured request with the GenAI attributes and reprolane's ids; a
caller's ``traceparent`` joins its trace; off by default; no content; a receiver that is down costs the client
nothing and the failures are counted; a full queue drops and counts."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capture.request.telemetry import trace_parent
from infra.clients.otel import OtelFields, capture_span_id, export_config, request_trace_id
from infra.stack.ports import allocate_ports
from tests.capture.fake_upstream import FINGERPRINT
from tests.capture.support import CHAT, MODEL, only, sidecar
from tests.otlp_receiver import otlp_grpc_receiver, otlp_receiver

REPO = Path(__file__).resolve().parents[3]
SECRET_PROMPT = "the-prompt-text-must-not-leave-4711"


async def test_one_span_per_captured_request_with_genai_attributes_and_ids() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": SECRET_PROMPT}], "seed": 7, "temperature": 0.5}
    with otlp_receiver() as receiver:
        async with sidecar(otel_endpoint=receiver.endpoint) as (client, _, spool, metrics):
            resp = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Request-Id": "client-1", "X-Reprolane-Tenant": "acme"}
            )
            assert resp.status_code == 200
            rid = resp.headers["x-reprolane-request-id"]
            (span,) = receiver.wait_for({"reprolane.request_id": rid})
            env = only(spool)
        a = span.attributes
        assert a["reprolane.envelope_id"] == env.envelope_id() == hashlib.sha256(env.canonical()).hexdigest()
        assert (a["reprolane.tenant"], a["reprolane.client_request_id"]) == ("acme", "client-1")
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == MODEL
        assert a["gen_ai.response.model"] == MODEL
        assert a["gen_ai.request.seed"] == 7
        assert a["gen_ai.request.temperature"] == 0.5
        assert a["gen_ai.request.max_tokens"] == 3
        assert a["gen_ai.usage.input_tokens"] == 5
        assert a["gen_ai.usage.output_tokens"] == 3
        assert a["gen_ai.response.finish_reasons"] == ["stop"]
        assert a["gen_ai.response.id"] == "chatcmpl-1"
        assert a["openai.response.system_fingerprint"] == FINGERPRINT
        assert span.name == f"chat {MODEL}"
        assert span.trace_id == f"{request_trace_id(rid):032x}" == rid.removeprefix("rl-")
        assert span.span_id == f"{capture_span_id(rid):016x}"
        assert span.parent_span_id == ""
        assert span.resource["service.name"] == "reprolane-capture/capture-0"
        assert SECRET_PROMPT not in json.dumps(a)
        assert metrics.value("reprolane_capture_otel_spans_exported_total") >= 1


async def test_a_callers_traceparent_makes_the_span_its_child_and_links_the_request_trace() -> None:
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with otlp_receiver() as receiver:
        async with sidecar(otel_endpoint=receiver.endpoint) as (client, *_):
            resp = await client.post(
                "/v1/chat/completions", json=CHAT, headers={"traceparent": f"00-{caller_trace}-{caller_span}-00"}
            )
            rid = resp.headers["x-reprolane-request-id"]
            (span,) = receiver.wait_for({"reprolane.request_id": rid})
    assert (span.trace_id, span.parent_span_id) == (caller_trace, caller_span)  # sampled although the caller's not
    assert span.links == [(f"{request_trace_id(rid):032x}", f"{capture_span_id(rid):016x}")]


async def test_spans_over_grpc() -> None:
    with otlp_grpc_receiver() as receiver:
        async with sidecar(otel_endpoint=receiver.endpoint, otel_protocol="grpc") as (client, *_):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            rid = resp.headers["x-reprolane-request-id"]
            (span,) = receiver.wait_for({"reprolane.request_id": rid})
    assert span.attributes["gen_ai.request.model"] == MODEL


@pytest.mark.parametrize(
    "header",
    [
        b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        b"\xff" * 55,
        b"",
    ],
)
def test_an_invalid_traceparent_is_ignored(header: bytes) -> None:
    assert trace_parent({b"traceparent": header}) is None


async def test_refused_requests_have_an_error_span_and_the_refusal_still_answers() -> None:
    with otlp_receiver() as receiver:
        async with sidecar(otel_endpoint=receiver.endpoint) as (client, *_):
            resp = await client.post("/v1/chat/completions", content=b"{not json")
            assert resp.status_code == 400
            rid = resp.headers["x-reprolane-request-id"]
            (span,) = receiver.wait_for({"reprolane.request_id": rid})
    assert span.attributes["error.type"] == "bad_request"
    assert span.attributes["http.response.status_code"] == 400
    assert span.status_code == 2  # STATUS_CODE_ERROR


async def test_off_by_default_and_with_the_standard_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert export_config(OtelFields()) is None
    async with sidecar() as (_, _, _, metrics):
        assert b"otel" not in metrics.render()
    with otlp_receiver() as receiver:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
        async with sidecar() as (client, *_):
            rid = (await client.post("/v1/chat/completions", json=CHAT)).headers["x-reprolane-request-id"]
            receiver.wait_for({"reprolane.request_id": rid})
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert export_config(OtelFields()) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    config = export_config(OtelFields())
    assert config is not None
    assert config.protocol == "grpc"


async def test_a_receiver_that_is_down_costs_the_client_nothing_and_is_counted() -> None:
    (port,) = allocate_ports(1)  # nothing listens there
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    async with sidecar(otel_endpoint=endpoint, otel_export_timeout_s=1.0) as (client, _, spool, metrics):
        for _ in range(3):
            resp = await client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
    # the sidecar's shutdown flushed the queue: every span was tried, and failed
    assert len(spool.envelopes) == 3
    assert metrics.value("reprolane_capture_otel_spans_failed_total") == 3
    assert metrics.value("reprolane_capture_otel_spans_exported_total") == 0


async def test_a_full_queue_drops_new_spans_and_counts_them() -> None:
    (port,) = allocate_ports(1)
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    # Nothing listens there: the first export retries for its whole deadline, long enough on a loaded machine for
    # the other requests, sent together, to end while it holds the queue's one place.
    async with sidecar(otel_endpoint=endpoint, otel_queue_size=1, otel_export_timeout_s=3.0) as (client, *rest):
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT) for _ in range(4)))
        assert [a.status_code for a in answers] == [200] * 4
    metrics = rest[-1]
    dropped = metrics.value("reprolane_capture_otel_spans_dropped_total")
    failed = metrics.value("reprolane_capture_otel_spans_failed_total")
    assert dropped >= 1
    assert dropped + failed == 4


def test_the_sdk_is_not_imported_by_a_service_that_does_not_export() -> None:
    code = (
        "import sys\n"
        "from capture.settings import CaptureSettings\n"
        "from capture.request.telemetry import CaptureTelemetry\n"
        "import capture.request.app, replayer.service\n"
        "assert not CaptureTelemetry.from_settings(CaptureSettings(upstream='http://x', auth_mode='off')).enabled\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)}, capture_output=True)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.strip() == b"[]"
