"""One OpenTelemetry span per captured request, after its envelope is in the spool (optional, off by default).

The span carries the OpenTelemetry GenAI semantic conventions' attributes, named by the constants of the
installed ``opentelemetry-semantic-conventions`` (`_genai_names`): operation, provider, request and response model,
seed, temperature, top_p, top_k, max_tokens, choice count, stream, usage, finish reasons, response id and the
system fingerprint (under its current name, ``openai.response.system_fingerprint``); and reprolane's own, under
``reprolane.*``: the envelope id (the sha256 of the canonical bytes that were spooled, so the span finds the
stored record), the request id, the client's request id, the tenant, the workflow and step, whether the request
was flagged for replay, the endpoint and the sidecar. Its start is when the request arrived, its end when the
envelope was spooled; an envelope that records an error (refused, upstream failed, client gone) sets the span's
status to error and ``error.type`` to the envelope's error type.

No content: neither the prompt nor the output (nor the stop sequences, which are the client's text) is an
attribute; only ids, numbers and names. A started record (guaranteed streams) has no span: the envelope that
supersedes it has.

The trace: a client's W3C ``traceparent`` header (`trace_parent`, validated here: it is a client's byte string)
makes the capture span a child of the caller's span, in the caller's trace, so the request shows up in the
trace of the agent that made it. Without one the request has its own trace, whose id is the request id's random
bits (`infra.clients.otel.request_trace_id`). The capture span's id is always a hash of the request id
(`infra.clients.otel.capture_span_id`), which is how the replayer's span finds it (`replayer.telemetry`): the
replay span is that span's child in the request's trace. A caller's trace id is not stored in the envelope (the
envelope is the audit record; what a client chose to send as trace context has no place in its identity), so
when the client sent a ``traceparent`` the capture span also links to the request's trace, where the replay
spans are: a backend follows that link from the caller's trace.

Off the client's path: `CaptureTelemetry.captured` schedules the span's building on the event loop's next turn
(`loop.call_soon`) and returns; the span is then queued for the exporter's thread (`infra.clients.otel.SpanExport`:
bounded, drops counted). Nothing here raises into the request flow.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from datetime import UTC, datetime
from typing import Any, Final

from capture.metrics import CaptureMetrics
from capture.request.assembly import STARTED, EnvelopeInputs
from capture.settings import CaptureSettings
from infra.clients.otel import SpanExport, capture_span_id, open_export, request_trace_id, start_span_with_ids

log = logging.getLogger(__name__)

#: ``traceparent`` as W3C Trace Context level 1 writes it (version 00); anything else is ignored.
_TRACEPARENT: Final = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_OPERATION: Final = {"chat.completions": "chat", "completions": "text_completion"}


def trace_parent(headers: dict[bytes, bytes]) -> tuple[int, int, int] | None:
    """The caller's (trace id, span id, flags) from a valid ``traceparent`` header, else None (absent,
    malformed, or an all-zero id: the standard says to ignore such a header)."""
    raw = headers.get(b"traceparent")
    if raw is None or len(raw) != 55:
        return None
    match = _TRACEPARENT.fullmatch(raw)
    if match is None:
        return None
    trace_id, span_id = int(match.group(1), 16), int(match.group(2), 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(match.group(3), 16)


class CaptureTelemetry:
    """The sidecar's span export, or nothing (``enabled`` False: every call returns at once)."""

    def __init__(self, export: SpanExport | None) -> None:
        self.export = export
        self.enabled = export is not None

    @classmethod
    def from_settings(cls, settings: CaptureSettings, metrics: CaptureMetrics | None = None) -> CaptureTelemetry:
        registry = metrics.registry if metrics is not None else None
        name = f"reprolane-capture/{settings.sidecar_id}"
        return cls(open_export(settings, name, registry=registry, prefix="reprolane_capture", what="captured request"))

    def trace_parent(self, headers: dict[bytes, bytes]) -> tuple[int, int, int] | None:
        """The caller's trace context when export is on (`trace_parent`); None otherwise, without looking."""
        return trace_parent(headers) if self.enabled else None

    def captured(self, inputs: EnvelopeInputs, payload: bytes) -> None:
        """The envelope `payload` (canonical bytes) of `inputs` is spooled: its span, built on the next turn."""
        if self.export is None or inputs.error == STARTED:
            return
        ended = datetime.now(UTC)
        try:
            asyncio.get_running_loop().call_soon(self._emit, inputs, payload, ended)
        except RuntimeError:  # no running loop (a synchronous caller): now
            self._emit(inputs, payload, ended)

    def _emit(self, inputs: EnvelopeInputs, payload: bytes, ended: datetime) -> None:
        try:
            self._span(inputs, hashlib.sha256(payload).hexdigest(), ended)
        except Exception:  # a bug of ours costs the span, never the request
            log.exception("otel: span of request %s not exported", inputs.ctx.request_id)

    def _span(self, inputs: EnvelopeInputs, envelope_id: str, ended: datetime) -> None:
        from opentelemetry import trace

        assert self.export is not None
        ctx = inputs.ctx
        rid = ctx.request_id
        own_trace = request_trace_id(rid)
        span_id = capture_span_id(rid)
        parent = None
        links = []
        if ctx.traceparent is not None:
            caller_trace, caller_span, flags = ctx.traceparent
            caller = trace.SpanContext(caller_trace, caller_span, is_remote=True, trace_flags=trace.TraceFlags(flags))
            parent = trace.set_span_in_context(trace.NonRecordingSpan(caller))
            if caller_trace != own_trace:  # the replay spans are in the request's own trace: point there
                links.append(trace.Link(trace.SpanContext(own_trace, span_id, is_remote=True)))
        attributes = capture_attributes(inputs, envelope_id)
        operation = attributes.get(_genai_names()["operation"], "chat")
        span = start_span_with_ids(
            self.export.tracer,
            f"{operation} {inputs.model}",
            trace_id=own_trace,
            span_id=span_id,
            context=parent,
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            links=links,
            start_time=_ns(ctx.received_at),
        )
        if inputs.error is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, inputs.error[2][:256]))
        span.end(end_time=max(_ns(ended), _ns(ctx.received_at)))

    def shutdown(self) -> None:
        """Export what is queued (within the export deadline) and stop the exporter's thread."""
        if self.export is not None:
            self.export.shutdown()


def capture_attributes(inputs: EnvelopeInputs, envelope_id: str) -> dict[str, Any]:
    """The span's attributes for one envelope (see the module docstring): ids, numbers and names, no content."""
    names = _genai_names()
    ctx, collector, sampling = inputs.ctx, inputs.collector, inputs.sampling
    out: dict[str, Any] = {
        names["operation"]: _OPERATION.get(ctx.endpoint, ctx.endpoint),
        names["request_model"]: inputs.model,
        names["stream"]: ctx.stream,
        "reprolane.envelope_id": envelope_id,
        "reprolane.request_id": ctx.request_id,
        "reprolane.tenant": ctx.tenant,
        "reprolane.endpoint": ctx.endpoint,
        "reprolane.flagged": ctx.flag.flagged,
        "reprolane.sidecar_id": inputs.sidecar_id,
    }
    if inputs.runtime.engine != "unknown":
        out[names["provider"]] = inputs.runtime.engine
    if ctx.client_request_id is not None:
        out["reprolane.client_request_id"] = ctx.client_request_id
    if ctx.workflow is not None:
        out["reprolane.workflow_id"] = ctx.workflow.workflow_id
        out["reprolane.workflow_step"] = ctx.workflow.step
    if sampling is not None:
        out[names["temperature"]] = sampling.temperature
        out[names["top_p"]] = sampling.top_p
        if sampling.top_k > 0:
            out[names["top_k"]] = sampling.top_k
        if sampling.max_tokens is not None:
            out[names["max_tokens"]] = sampling.max_tokens
        if sampling.seed is not None:
            out[names["seed"]] = sampling.seed
        if sampling.n != 1:
            out[names["choice_count"]] = sampling.n
        out["reprolane.seed_injected"] = sampling.seed_injected
    fingerprint = inputs.runtime.system_fingerprint
    if fingerprint is not None:
        out[names["system_fingerprint"]] = fingerprint
    if collector is not None:
        if collector.resolved_model is not None:
            out[names["response_model"]] = collector.resolved_model
        if collector.response_id is not None:
            out[names["response_id"]] = collector.response_id
        reasons = [acc.finish_reason for _, acc in sorted(collector.choices.items()) if acc.finish_reason]
        if reasons:
            out[names["finish_reasons"]] = reasons
        usage = collector.usage
        if "prompt_tokens" in usage:
            out[names["input_tokens"]] = usage["prompt_tokens"]
        if "completion_tokens" in usage:
            out[names["output_tokens"]] = usage["completion_tokens"]
    if inputs.error is not None:
        out["error.type"] = inputs.error[0]
        if inputs.error[1] is not None:
            out["http.response.status_code"] = inputs.error[1]
    return out


_NAMES: dict[str, str] = {}


def _genai_names() -> dict[str, str]:
    """The attribute names, from the semantic-conventions package (imported once, on first use)."""
    if not _NAMES:
        from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as g
        from opentelemetry.semconv._incubating.attributes import openai_attributes as o

        _NAMES.update(
            operation=g.GEN_AI_OPERATION_NAME,
            provider=g.GEN_AI_PROVIDER_NAME,
            request_model=g.GEN_AI_REQUEST_MODEL,
            response_model=g.GEN_AI_RESPONSE_MODEL,
            response_id=g.GEN_AI_RESPONSE_ID,
            stream=g.GEN_AI_REQUEST_STREAM,
            temperature=g.GEN_AI_REQUEST_TEMPERATURE,
            top_p=g.GEN_AI_REQUEST_TOP_P,
            top_k=g.GEN_AI_REQUEST_TOP_K,
            max_tokens=g.GEN_AI_REQUEST_MAX_TOKENS,
            seed=g.GEN_AI_REQUEST_SEED,
            choice_count=g.GEN_AI_REQUEST_CHOICE_COUNT,
            finish_reasons=g.GEN_AI_RESPONSE_FINISH_REASONS,
            input_tokens=g.GEN_AI_USAGE_INPUT_TOKENS,
            output_tokens=g.GEN_AI_USAGE_OUTPUT_TOKENS,
            system_fingerprint=o.OPENAI_RESPONSE_SYSTEM_FINGERPRINT,
        )
    return _NAMES


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1_000_000_000)
