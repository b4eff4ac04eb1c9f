"""One OpenTelemetry span per replay the replayer service publishes (optional, off by default; the settings and
the export are `infra.clients.otel`'s, as for the sidecar's spans in `capture.request.telemetry`).

The span is the verdict beside the request it judges: it is a child of the request's capture span, in the
request's trace, both found from the envelope's request id alone (`infra.clients.otel.request_trace_id`,
`infra.clients.otel.capture_span_id`); nothing else needs storing, and a replay months later still lands in the
request's trace. Its attributes: ``reprolane.replay.verdict``, the levels held, the target and whether it was met,
the first divergence's position, the token match rate, the largest logprob differences, the cause hint, the lane
and its fingerprint, the result id, whether this publication was a fresh replay or a stored result
(``reprolane.replay.outcome``), and, as on the capture span, the envelope id, request id, tenant and the GenAI
request model. No token, text or logprob value of the record or the replay is an attribute.

`ReplayTelemetry.replayed` builds and queues the span (microseconds) and never raises; the export is on the SDK's
thread, bounded, drops counted (`reprolane_replayer_otel_spans_{exported,failed,dropped}_total`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from prometheus_client.registry import CollectorRegistry

from infra.clients.otel import SpanExport, capture_span_id, open_export, request_trace_id
from replayer.settings import ReplayerSettings
from schemas import DivergenceEvent, Envelope

log = logging.getLogger(__name__)


class ReplayTelemetry:
    """The replayer's span export, or nothing (``export`` None: `replayed` returns at once)."""

    def __init__(self, export: SpanExport | None) -> None:
        self.export = export

    @classmethod
    def from_settings(cls, settings: ReplayerSettings, registry: CollectorRegistry | None = None) -> ReplayTelemetry:
        name = f"reprolane-replayer/{settings.group_id}"
        return cls(open_export(settings, name, registry=registry, prefix="reprolane_replayer", what="replay"))

    def replayed(self, envelope: Envelope, event: DivergenceEvent, outcome: str, started: datetime) -> None:
        """The service published `event` for `envelope` (`outcome`: replayed or deduplicated)."""
        if self.export is None:
            return
        try:
            self._span(envelope, event, outcome, started)
        except Exception:  # a bug of ours costs the span, never the replay
            log.exception("otel: span of the replay of %s not exported", envelope.request_id)

    def _span(self, envelope: Envelope, event: DivergenceEvent, outcome: str, started: datetime) -> None:
        from opentelemetry import trace

        assert self.export is not None
        rid = envelope.request_id
        capture = trace.SpanContext(
            request_trace_id(rid), capture_span_id(rid), is_remote=True, trace_flags=trace.TraceFlags(1)
        )
        span = self.export.tracer.start_span(
            f"replay {event.lane}",
            context=trace.set_span_in_context(trace.NonRecordingSpan(capture)),
            kind=trace.SpanKind.INTERNAL,
            attributes=replay_attributes(envelope, event, outcome),
            start_time=int(started.timestamp() * 1_000_000_000),
        )
        if event.verdict == "diverged":
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"diverged: {event.cause_hint}"))
        span.end()

    def shutdown(self) -> None:
        if self.export is not None:
            self.export.shutdown()


def replay_attributes(envelope: Envelope, event: DivergenceEvent, outcome: str) -> dict[str, Any]:
    """The replay span's attributes (see the module docstring): verdict and figures, no content."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as g

    out: dict[str, Any] = {
        g.GEN_AI_REQUEST_MODEL: envelope.model,
        "reprolane.envelope_id": event.envelope_id,
        "reprolane.request_id": event.request_id,
        "reprolane.tenant": event.tenant,
        "reprolane.replay.verdict": event.verdict,
        "reprolane.replay.outcome": outcome,
        "reprolane.replay.result_id": event.result_id(),
        "reprolane.replay.lane": event.lane,
        "reprolane.replay.lane_fingerprint_sha256": event.lane_fingerprint_sha256,
        "reprolane.replay.levels_held": list(event.levels_held),
        "reprolane.replay.target_level": event.target_level,
        "reprolane.replay.target_met": event.target_met,
        "reprolane.replay.token_match_rate": event.token_match_rate,
        "reprolane.replay.recorded_length": event.recorded_length,
        "reprolane.replay.replayed_length": event.replayed_length,
        "reprolane.replay.cause_hint": event.cause_hint,
        "reprolane.replay.replay_ms": event.replay_ms,
    }
    if event.first_divergence is not None:
        out["reprolane.replay.first_divergence_position"] = event.first_divergence.position
    if event.max_abs_logprob_diff is not None:
        out["reprolane.replay.max_abs_logprob_diff"] = event.max_abs_logprob_diff
    if event.semantic_similarity is not None:
        out["reprolane.replay.semantic_similarity"] = event.semantic_similarity
    if event.workflow_id is not None:
        out["reprolane.workflow_id"] = event.workflow_id
    return out
