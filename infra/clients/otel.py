"""OpenTelemetry span export, written once for the sidecar and the replayer service (optional, off by default).

Observability teams run OTLP pipelines (Phoenix, Langfuse, Datadog, a Collector); with an endpoint configured,
each captured request becomes one span there (`capture.request.telemetry`) and each replay one more
(`replayer.telemetry`).
This module is how those spans leave the process; what they say is the two telemetry modules' business.
The ``opentelemetry`` packages (the ``otel`` extra) are imported here and in those two modules only, and only
when export is on: a service without an endpoint never loads them.

When it is on (`export_config`):

- the endpoint is the service's ``otel_endpoint`` setting (``REPROLANE_CAPTURE_OTEL_ENDPOINT``,
  ``REPROLANE_REPLAYER_OTEL_ENDPOINT``), else the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the exporter then reads every other ``OTEL_EXPORTER_OTLP_*`` variable itself:
  headers, certificates, compression); neither set, or ``OTEL_SDK_DISABLED=true``: no export;
- the protocol is ``otel_protocol``, else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``,
  else ``http/protobuf`` (the standard default); ``grpc`` takes the gRPC exporter.

Never in the client's way (`SpanExport`): a finished span is handed to the SDK's `BatchSpanProcessor`, whose
thread exports in batches; the queue is bounded (``otel_queue_size``) and a span that finds it full is dropped and
counted (``dropped``), never waited for; an export that fails (receiver down, refused) is counted (``failed``)
after the exporter's own bounded retries, on that thread. The counts are read by each service's metrics.

Trace ids (`request_trace_id`, `capture_span_id`): the sidecar's request id is ``rl-`` and 128 random bits, so the
request's trace id is those bits and its capture span's id a hash of the request id. The replayer knows the
request id from the envelope and so finds both without anything else being stored: its replay span is a child of
the capture span, in the same trace (see `capture.request.telemetry` for a client that sent its own ``traceparent``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

OtlpProtocol = Literal["http/protobuf", "grpc"]
_REQUEST_ID_BITS: Final = re.compile(r"rl-([0-9a-f]{32})")


class OtelFields(BaseModel):
    """The export settings every service shares (inherited like `infra.clients.connection`'s fields, under each
    service's own environment prefix)."""

    otel_endpoint: str | None = Field(
        default=None,
        max_length=2048,
        description="OTLP endpoint for spans (http/protobuf: http://host:4318/v1/traces; grpc: http://host:4317); "
        "unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, and neither: no export",
    )
    otel_protocol: OtlpProtocol | None = Field(
        default=None,
        description="http/protobuf or grpc; unset: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else http/protobuf",
    )
    otel_queue_size: int = Field(
        default=2048, ge=1, le=1_000_000, description="spans waiting for export; a span beyond it is dropped"
    )
    otel_export_timeout_s: float = Field(default=5.0, gt=0.0, le=60.0, description="one export's deadline")


@dataclass(frozen=True, slots=True)
class ExportConfig:
    """Where and how spans go; ``endpoint`` None: the exporter reads the standard variables itself."""

    endpoint: str | None
    protocol: OtlpProtocol
    queue_size: int
    timeout_s: float


def export_config(fields: OtelFields, environ: Mapping[str, str] = os.environ) -> ExportConfig | None:
    """The export this service does, or None when it does none (the default)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    standard = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if fields.otel_endpoint is None and not standard:
        return None
    protocol = fields.otel_protocol
    if protocol is None:
        named = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        protocol = "grpc" if named == "grpc" else "http/protobuf"
    return ExportConfig(fields.otel_endpoint, protocol, fields.otel_queue_size, fields.otel_export_timeout_s)


def request_trace_id(request_id: str) -> int:
    """The trace id of a request: the 128 random bits of a sidecar request id (``rl-<32 hex>``), else (an id of
    another shape) the first 128 bits of its sha256. Never 0 (an invalid trace id)."""
    match = _REQUEST_ID_BITS.fullmatch(request_id)
    value = int(match.group(1), 16) if match else int.from_bytes(_digest(b"trace", request_id)[:16], "big")
    return value or 1


def capture_span_id(request_id: str) -> int:
    """The span id of a request's capture span: 64 bits of a hash of its request id (never 0)."""
    return int.from_bytes(_digest(b"capture-span", request_id)[:8], "big") or 1


def _digest(purpose: bytes, request_id: str) -> bytes:
    return hashlib.sha256(b"reprolane.otel\0" + purpose + b"\0" + request_id.encode("utf-8")).digest()


class SpanExport:
    """One service's tracer, exporter and bounded queue (see the module docstring); `shutdown` flushes what is
    queued, within the export deadline."""

    def __init__(self, config: ExportConfig, service_name: str, *, exporter: SpanExporter | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self.config = config
        self._lock = threading.Lock()
        self._queued = 0  # handed to the batch processor and not yet taken by an export
        self.dropped = 0
        self.failed = 0
        self.exported = 0
        counted = _counting_exporter(self, exporter if exporter is not None else _exporter(config))
        # Every captured request is recorded: a caller's "not sampled" flag does not drop the audit span.
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), sampler=ALWAYS_ON, id_generator=_ids()
        )
        self.provider.add_span_processor(_bounded_processor(self, counted))
        self.tracer: Tracer = self.provider.get_tracer("reprolane")

    def admit(self) -> bool:
        """Take a place in the queue for one span, or count it dropped (the queue is full)."""
        with self._lock:
            if self._queued >= self.config.queue_size:
                self.dropped += 1
                return False
            self._queued += 1
            return True

    def taken(self, count: int, ok: bool) -> None:
        """An export took `count` spans off the queue (`ok`: the receiver acknowledged them)."""
        with self._lock:
            self._queued = max(self._queued - count, 0)
            if ok:
                self.exported += count
            else:
                self.failed += count

    def flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        self.provider.shutdown()


class ExportCounts(Collector):
    """``<prefix>_otel_spans_{exported,failed,dropped}_total`` of one `SpanExport`, read at scrape time (register
    it on the service's Prometheus registry)."""

    def __init__(self, export: SpanExport, prefix: str) -> None:
        self.export = export
        self.prefix = prefix

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, value, doc in (
            ("exported", self.export.exported, "Spans the OTLP receiver acknowledged"),
            ("failed", self.export.failed, "Spans whose export failed (receiver down or refusing), after retries"),
            ("dropped", self.export.dropped, "Spans dropped because the export queue was full"),
        ):
            yield CounterMetricFamily(f"{self.prefix}_otel_spans_{name}", doc, value=value)


def open_export(
    fields: OtelFields, service_name: str, *, registry: CollectorRegistry | None, prefix: str, what: str
) -> SpanExport | None:
    """The service's export per its settings (None: off), its counts registered on `registry` under `prefix`."""
    config = export_config(fields)
    if config is None:
        return None
    export = SpanExport(config, service_name)
    if registry is not None:
        registry.register(ExportCounts(export, prefix))
    log.info("otel: exporting one span per %s (%s, %s)", what, config.protocol, config.endpoint or "from OTEL_*")
    return export


def _exporter(config: ExportConfig) -> SpanExporter:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.endpoint, timeout=config.timeout_s)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=config.endpoint, timeout=config.timeout_s)


def _counting_exporter(export: SpanExport, inner: SpanExporter) -> SpanExporter:
    """`inner`, telling `export` what each batch became (an exception of the exporter is a failed batch)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Counting(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            try:
                result = inner.export(spans)
            except Exception as exc:  # the exporter's own error: counted, never raised into the SDK's thread
                log.warning("otel: export of %d spans failed: %s: %s", len(spans), type(exc).__name__, exc)
                result = SpanExportResult.FAILURE
            export.taken(len(spans), result == SpanExportResult.SUCCESS)
            return result

        def shutdown(self) -> None:
            inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(inner.force_flush(timeout_millis))

    return Counting()


def _bounded_processor(export: SpanExport, exporter: SpanExporter) -> Any:
    """The SDK's batch processor behind our own admission count: the SDK's full queue would drop its *oldest*
    span, silently for us; ours refuses the new one and counts it."""
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    size = export.config.queue_size
    batch = BatchSpanProcessor(
        exporter,
        max_queue_size=size + 1,  # never full by its own count: ours refuses first
        max_export_batch_size=min(512, size),
        export_timeout_millis=export.config.timeout_s * 1000,
    )

    class Bounded(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            if export.admit():
                batch.on_end(span)

        def shutdown(self) -> None:
            batch.shutdown()  # type: ignore[no-untyped-call]

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return batch.force_flush(timeout_millis)

    return Bounded()


def _ids() -> Any:
    """Random ids, except where `with_ids` names the next span's trace id and span id."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

    random_ids = RandomIdGenerator()

    class Chosen(IdGenerator):
        def generate_span_id(self) -> int:
            chosen = _NEXT.span_id
            return chosen if chosen else random_ids.generate_span_id()

        def generate_trace_id(self) -> int:
            chosen = _NEXT.trace_id
            return chosen if chosen else random_ids.generate_trace_id()

    return Chosen()


class _NextIds(threading.local):
    trace_id: int = 0
    span_id: int = 0


_NEXT: Final = _NextIds()


def start_span_with_ids(
    tracer: Tracer, name: str, *, trace_id: int, span_id: int, **kwargs: Any
) -> Any:  # an opentelemetry.trace.Span
    """``tracer.start_span(name, **kwargs)`` whose span gets `span_id`, and `trace_id` when it has no parent
    (with a parent, the trace is the parent's). Only for `SpanExport`'s tracers (their id generator reads these)."""
    _NEXT.trace_id, _NEXT.span_id = trace_id, span_id
    try:
        return tracer.start_span(name, **kwargs)
    finally:
        _NEXT.trace_id, _NEXT.span_id = 0, 0


__all__ = [
    "ExportConfig",
    "ExportCounts",
    "OtelFields",
    "OtlpProtocol",
    "SpanExport",
    "capture_span_id",
    "export_config",
    "open_export",
    "request_trace_id",
    "start_span_with_ids",
]
