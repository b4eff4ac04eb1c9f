"""The replayer service's OpenTelemetry span (issue 20, item 4): one per published verdict, into a real OTLP/HTTP
receiver, a child of the request's capture span in the request's trace (both derived from the request id), with
the verdict and reprolane's ids and no content; off by default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faststream.kafka import TestKafkaBroker

from infra.clients.otel import capture_span_id, request_trace_id
from tests.otlp_receiver import otlp_receiver
from tests.replayer.support import S3Target, moto_s3
from tests.replayer.test_service import build, greedy


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Target]:
    with moto_s3() as target:
        yield target


async def test_a_replay_span_carries_the_verdict_under_the_capture_span(s3: S3Target) -> None:
    with otlp_receiver() as receiver:
        h = build(s3, otel_endpoint=receiver.endpoint)
        same, diverged = greedy(11, h.lane), greedy(12, h.lane, diverge_at=1)
        async with TestKafkaBroker(h.service.broker):
            await h.send(same.canonical())
            await h.send(diverged.canonical())
            await h.send(same.canonical())  # redelivered: the stored result is published again
        await h.service.stop()  # flushes the spans
        spans = receiver.wait_for(count=3)
    by_request = {(s.attributes["reprolane.request_id"], s.attributes["reprolane.replay.outcome"]): s for s in spans}
    first = by_request[(same.request_id, "replayed")]
    assert (first.trace_id, first.parent_span_id) == (
        f"{request_trace_id(same.request_id):032x}",
        f"{capture_span_id(same.request_id):016x}",
    )
    assert first.name == "replay fake"
    a = first.attributes
    assert (a["reprolane.replay.verdict"], a["reprolane.replay.target_met"]) == ("bitwise", True)
    assert a["reprolane.envelope_id"] == same.envelope_id()
    assert a["reprolane.tenant"] == same.tenant
    assert a["gen_ai.request.model"] == same.model
    assert by_request[(same.request_id, "deduplicated")].attributes["reprolane.replay.verdict"] == "bitwise"
    bad = by_request[(diverged.request_id, "replayed")]
    assert bad.attributes["reprolane.replay.verdict"] == "diverged"
    assert bad.attributes["reprolane.replay.first_divergence_position"] == 1
    assert bad.status_code == 2
    assert h.metrics.value("reprolane_replayer_otel_spans_exported_total") == 3


async def test_no_export_without_an_endpoint(s3: S3Target, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    h = build(s3)
    assert h.service.telemetry.export is None
    assert h.metrics.registry.get_sample_value("reprolane_replayer_otel_spans_exported_total") is None
