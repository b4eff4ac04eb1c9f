"""A real OTLP/HTTP trace receiver for the tests: ``POST /v1/traces`` with an ``ExportTraceServiceRequest``
(protobuf, optionally gzip), decoded with ``opentelemetry-proto``'s generated classes, answered as the OTLP
specification says (200 with an empty ``ExportTraceServiceResponse``).

Why not Arize Phoenix (on PyPI, serves OTLP): it pulls in a web app, a database layer and dozens of packages the
shared environment does not have, and each test would wait for it to start; the tests only need the wire
protocol to be real (the SDK's own exporter, its encoding, its HTTP client), which this is. It binds 127.0.0.1
on a free port and runs in a thread; `received` holds every span as plain data.
"""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    status_code: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    resource: dict[str, Any]


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                out.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        status_code=span.status.code,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        resource=resource,
                    )
                )
    return out


@dataclass
class OtlpReceiver:
    port: int = 0
    received: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    scheme: str = "http"
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        path = "/v1/traces" if self.scheme == "http" else ""
        return f"http://127.0.0.1:{self.port}{path}"

    def spans(self, where: dict[str, Any] | None = None) -> list[ReceivedSpan]:
        """Received spans whose attributes include `where`."""
        wanted = where or {}
        with self._lock:
            return [s for s in self.received if all(s.attributes.get(k) == v for k, v in wanted.items())]

    def wait_for(
        self, where: dict[str, Any] | None = None, count: int = 1, timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.spans(where)
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline, f"{len(found)} of {count} spans {where} arrived: {self.received}"
            time.sleep(0.05)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    state = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or "protobuf" not in self.headers.get("Content-Type", ""):
                self.send_response(404)
                self.end_headers()
                return
            spans = decode(body)
            with state._lock:
                state.requests += 1
                state.received.extend(spans)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def otlp_grpc_receiver() -> Iterator[OtlpReceiver]:
    """The same receiver over OTLP/gRPC (``TraceService/Export``); ``endpoint`` is then ``http://127.0.0.1:<port>``."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    state = OtlpReceiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:
            spans = decode(request.SerializeToString())
            with state._lock:
                state.requests += 1
                state.received.extend(spans)
            return ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    state.port = server.add_insecure_port("127.0.0.1:0")
    state.scheme = "grpc"
    server.start()
    try:
        yield state
    finally:
        server.stop(grace=None)
