"""The capture endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions``, as raw ASGI.

Every other path (and any other method on these two) goes through `capture.edge.passthrough` byte for byte,
counted (writes there are logged once per path, or refused under ``refuse_uncaptured``: `CaptureProxy.passthrough`).
ASGI plumbing lives in `capture.edge`, envelope assembly in `capture.recording`, spooling per mode in
`capture.recorder`, the upstream client in `capture.upstream`. A captured request runs as:

    read body (413 above max_body_bytes) -> parse (400) -> prepare (audit fields) -> upstream
    -> record + strip each body / SSE chunk -> [guaranteed: envelope durable in the spool] -> release
    -> [best_effort: envelope built and spooled in a tracked background task]

In guaranteed mode nothing is served uncaptured: a full spool answers 503 before upstream is asked; if the
spool fills while a request runs, the non-streamed answer becomes a 503 and a stream ends with an error event
instead of ``data: [DONE]``. A watcher on the ASGI ``receive`` channel notices a client that hangs up while
upstream works, cancels the upstream call (so the server stops generating) and records the attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any, Final

from prometheus_client import Counter, Histogram

from capture.assembly import Failure
from capture.edge import (
    SSE_DONE,
    ASGIApp,
    BadRequest,
    Receive,
    RecentIds,
    Scope,
    Send,
    Watch,
    consume_disconnect,
    decode_json,
    dumps,
    end_stream,
    error_body,
    forward_headers,
    passthrough,
    read_body,
    response_headers,
    send_json,
    sse,
    watch_disconnect,
)
from capture.errors import SpoolFullError, UpstreamError, UpstreamTimeoutError
from capture.metrics import CaptureMetrics
from capture.policy import NOT_FLAGGED, ReplayPolicy
from capture.recorder import EnvelopeRecorder, SpoolLike
from capture.recording import (
    BUILTIN_DEFAULTS,
    Endpoint,
    ErrorType,
    OutputCollector,
    Prepared,
    RequestContext,
    SamplingDefaults,
    prepare,
    strip,
)
from capture.runtime import RuntimeProbe
from capture.settings import CaptureSettings
from capture.upstream import Upstream, UpstreamResponse
from schemas import ArtifactHashes, WorkflowRef
from schemas.envelope import is_valid_request_id

log = logging.getLogger(__name__)


_READS: Final = frozenset({"GET", "HEAD", "OPTIONS"})


class CaptureProxy:
    """Both capture endpoints and the pass-through, sharing one upstream connection pool."""

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        spool: SpoolLike,
        metrics: CaptureMetrics,
        artifacts: ArtifactHashes,
        runtime: RuntimeProbe,
        upstream: Upstream,
        sampling_defaults: SamplingDefaults = BUILTIN_DEFAULTS,
    ) -> None:
        self.settings = settings
        self.sampling_defaults = sampling_defaults
        self.spool = spool
        self.metrics = metrics
        self.upstream = upstream
        self.policy = ReplayPolicy(flag_tenants=settings.flag_tenants, sample_rate=settings.sample_rate)
        self.recent_ids = RecentIds()
        self.in_flight = 0
        metrics.in_flight.set_function(lambda: self.in_flight)  # read at scrape time: no lock per request
        self._guaranteed = settings.mode == "guaranteed"
        self.recorder = EnvelopeRecorder(
            guaranteed=self._guaranteed,
            spool=spool,
            metrics=metrics,
            artifacts=artifacts,
            runtime=runtime,
            upstream=upstream,
            sidecar_id=settings.sidecar_id,
        )
        self._forward = passthrough(upstream, settings.max_body_bytes)
        self._uncaptured_allowed = frozenset(settings.uncaptured_allowed)
        self._uncaptured_seen = RecentIds(capacity=256)  # write paths already logged
        self._uncaptured = {kind: metrics.uncaptured_total.labels(kind) for kind in ("read", "write", "refused")}
        self._answered_children: dict[tuple[Endpoint, int], Counter] = {}
        self._upstream_children: dict[Endpoint, Histogram] = {}

    # ------------------------------------------------------------------ everything else

    async def passthrough(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A path (or method) the sidecar does not capture: forwarded as it is (`capture.edge.passthrough`),
        counted; a write is logged once per path, or refused with a 403 under ``refuse_uncaptured``."""
        if scope["method"] in _READS:
            self._uncaptured["read"].inc()
            await self._forward(scope, receive, send)
            return
        path = scope["path"]
        if self.settings.refuse_uncaptured and path not in self._uncaptured_allowed:
            self._uncaptured["refused"].inc()
            message = (
                f"{scope['method']} {path} is not captured by the reprolane sidecar, and this sidecar refuses what it "
                "cannot record (refuse_uncaptured); use /v1/chat/completions or /v1/completions"
            )
            await send_json(send, 403, error_body(message, type_="permission_error", code=403), None)
            return
        self._uncaptured["write"].inc()
        if path not in self._uncaptured_seen:
            self._uncaptured_seen.add(path)
            log.warning("%s %s passes through uncaptured (no envelope is recorded for it)", scope["method"], path)
        await self._forward(scope, receive, send)

    # ------------------------------------------------------------------ capture endpoints

    def endpoint(self, endpoint: Endpoint) -> ASGIApp:
        async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("method") != "POST":
                await self.passthrough(scope, receive, send)
                return
            await self.capture(endpoint, scope, receive, send)

        return asgi

    async def capture(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        self.in_flight += 1
        status = 500
        headers = dict(scope["headers"])
        ctx = RequestContext(
            request_id=self._request_id(headers.get(b"x-request-id")),
            received_at=datetime.now(UTC),
            tenant=self.settings.default_tenant,
            workflow=None,
            flag=NOT_FLAGGED,
            endpoint=endpoint,
            stream=False,
            in_flight_at_start=self.in_flight,
        )
        try:
            status = await self._capture(ctx, scope, headers, receive, send, t0)
        except Exception as exc:  # a bug of the sidecar's: the client gets a 500, the attempt is still recorded
            log.exception("request %s: the sidecar failed", ctx.request_id)
            status = await self._internal_error(ctx, send, exc, t0)
        finally:
            self.in_flight -= 1
            self._answered(endpoint, status).inc()
            total = time.perf_counter() - t0
            self.metrics.added_latency_seconds.observe(max(total - ctx.upstream_ms / 1000.0, 0.0))
            if ctx.upstream_ms:
                self._upstream_time(endpoint).observe(ctx.upstream_ms / 1000.0)

    async def _internal_error(self, ctx: RequestContext, send: Send, exc: Exception, t0: float) -> int:
        """After an unexpected exception: a 500 in OpenAI's format if the answer has not started (a stream that
        has just ends), and a ``proxy_error`` envelope unless this request's was already handed over."""
        message = f"reprolane capture sidecar failed: {type(exc).__name__}: {exc}"
        try:
            await send_json(send, 500, error_body(message, type_="internal_error", code=500), ctx.request_id.encode())
        except Exception:  # the response had started: the ASGI server refuses a second start
            with contextlib.suppress(Exception):
                await end_stream(send, b"")
        if not ctx.recorded:
            ctx.in_flight_at_end = self.in_flight
            try:
                await self.recorder.record_refused(ctx, ("proxy_error", 500, message), t0)
            except Exception:
                log.exception("request %s: its error envelope could not be recorded either", ctx.request_id)
        return 500

    def _answered(self, endpoint: Endpoint, status: int) -> Counter:
        """The ``requests_total`` child of (endpoint, status), looked up once (`labels` costs ~1.5 us a call)."""
        child = self._answered_children.get((endpoint, status))
        if child is None:
            child = self._answered_children[(endpoint, status)] = self.metrics.requests_total.labels(
                endpoint, str(status)
            )
        return child

    def _upstream_time(self, endpoint: Endpoint) -> Histogram:
        child = self._upstream_children.get(endpoint)
        if child is None:
            child = self._upstream_children[endpoint] = self.metrics.upstream_seconds.labels(endpoint)
        return child

    async def _capture(
        self, ctx: RequestContext, scope: Scope, headers: dict[bytes, bytes], receive: Receive, send: Send, t0: float
    ) -> int:
        rid = ctx.request_id.encode("ascii")
        body = b""
        try:
            self._read_reprolane_headers(ctx, headers)
            body = await read_body(headers, receive, self.settings.max_body_bytes)
            ctx.body_sha256 = hashlib.sha256(body).hexdigest()
            try:
                parsed, encode = decode_json(body)
            except ValueError as exc:
                raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise BadRequest(400, "request body must be a JSON object")
        except BadRequest as bad:
            await send_json(
                send,
                bad.status,
                error_body(bad.message, type_="invalid_request_error", code=bad.status, param=bad.param),
                rid,
            )
            ctx.in_flight_at_end = self.in_flight
            await self.recorder.record_refused(ctx, ("bad_request", bad.status, bad.message), t0)
            return bad.status

        prepared = prepare(
            ctx.endpoint,
            parsed,
            request_id=ctx.request_id,
            audit_k=self.settings.audit_top_logprobs,
            inject_seed=self.settings.inject_seed,
            defaults=self.sampling_defaults,
        )
        ctx.stream = prepared.stream
        if self._guaranteed and self.spool.bytes >= self.settings.spool_max_bytes:
            await send_json(send, 503, _SPOOL_FULL, rid)
            return 503
        if prepared.echo is not None and prepared.echo.pending():
            await self._echo_texts(prepared)
        watch = Watch(task=asyncio.current_task())
        watcher = asyncio.create_task(watch_disconnect(receive, watch))
        try:
            upstream_body = encode(prepared.upstream_body)
            if prepared.stream:
                return await self._stream(ctx, prepared, upstream_body, headers, send, watch, t0)
            return await self._unary(ctx, prepared, upstream_body, headers, send, watch, t0)
        finally:
            watcher.cancel()

    async def _echo_texts(self, prepared: Prepared) -> None:
        """The text upstream echoes for prompts given as token ids (its ``/detokenize``, the same decoding), so
        `capture.recording.Echo` can put it back; when upstream cannot say, the sidecar does not ask for token
        ids (the client's answer comes first) and this request's envelope has none."""
        echo = prepared.echo
        assert echo is not None
        for position, ids in echo.pending():
            doc = {"model": prepared.model, "tokens": ids}
            try:
                status, answer = await self.upstream.post_json("/detokenize", dumps(doc))
            except UpstreamError:
                status, answer = 0, None
            text = answer.get("prompt") if isinstance(answer, dict) and status == 200 else None
            if not isinstance(text, str):
                prepared.upstream_body.pop("return_token_ids", None)
                echo.abandon()
                return
            echo.resolve(position, text)

    async def _unary(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        upstream_body: bytes,
        headers: dict[bytes, bytes],
        send: Send,
        watch: Watch,
        t0: float,
    ) -> int:
        rid = ctx.request_id.encode("ascii")
        collector = OutputCollector(ctx.endpoint, echo=prepared.echo)
        t_up = time.perf_counter()
        try:
            try:
                async with self.upstream.request(
                    "POST", _PATHS[ctx.endpoint], body=upstream_body, headers=forward_headers(headers)
                ) as resp:
                    content = await resp.read()
                    collector.note_versions(resp.header, self.settings.version_headers)
            finally:
                ctx.upstream_ms = (time.perf_counter() - t_up) * 1000.0
        except asyncio.CancelledError:
            if not consume_disconnect(watch):
                raise
            await self._finish(ctx, prepared, collector, ("client_disconnect", None, "client disconnected"), t0)
            return 499
        except UpstreamTimeoutError as exc:
            return await self._upstream_failed(ctx, prepared, collector, send, "timeout", 504, exc, t0)
        except UpstreamError as exc:
            return await self._upstream_failed(ctx, prepared, collector, send, "upstream_error", 502, exc, t0)
        watch.armed = False

        if resp.status != 200:
            kind: ErrorType = "bad_request" if 400 <= resp.status < 500 else "upstream_error"
            message = content[:2000].decode("utf-8", "replace")
            error: Failure | None = (kind, resp.status, message)
            out = content
        else:
            error = None
            try:
                # Recorded right away, while the answer is in the CPU's caches: collecting it after the answer
                # was sent (off the client's wait) measured ~15% more CPU per request, not less.
                answer, encode = decode_json(content)
                collector.add(answer)
                out = encode(strip(answer, prepared))
            except (ValueError, AttributeError, TypeError) as exc:
                error, out = ("upstream_error", 200, f"upstream answered unparsable JSON: {exc}"), content
        extra = [(b"content-type", resp.header("content-type", "application/json").encode("latin-1"))]
        if self._guaranteed:
            try:
                await self._finish(ctx, prepared, collector, error, t0)
            except SpoolFullError:
                await send_json(send, 503, _SPOOL_FULL, rid)
                return 503
            await send_json(send, resp.status, out, rid, extra)
        else:
            await send_json(send, resp.status, out, rid, extra)
            self.recorder.later(self._finish(ctx, prepared, collector, error, t0))
        return resp.status

    async def _stream(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        upstream_body: bytes,
        headers: dict[bytes, bytes],
        send: Send,
        watch: Watch,
        t0: float,
    ) -> int:
        rid = ctx.request_id.encode("ascii")
        collector = OutputCollector(ctx.endpoint, echo=prepared.echo)
        t_up = time.perf_counter()
        started = False
        error: tuple[ErrorType, int | None, str] | None = None
        done, last = False, SSE_DONE
        try:
            try:
                async with self.upstream.request(
                    "POST", _PATHS[ctx.endpoint], body=upstream_body, headers=forward_headers(headers)
                ) as resp:
                    if resp.status != 200:
                        return await self._stream_refused(ctx, prepared, collector, resp, send, watch, t0, t_up)
                    collector.note_versions(resp.header, self.settings.version_headers)
                    await send({"type": "http.response.start", "status": 200, "headers": response_headers(resp, rid)})
                    started = True
                    buffer = b""
                    async for chunk in resp.chunks():
                        buffer += chunk
                        while (cut := _event_end(buffer)) > 0:
                            event, buffer = buffer[:cut], buffer[cut:]
                            if event == SSE_DONE or (len(event) <= _LONGEST_DONE and _is_done(event)):
                                done, last = True, event
                                continue
                            out, failure = _rewrite_event(event, collector, prepared)
                            if failure is not None:
                                error = ("upstream_error", 200, failure)
                            if ctx.first_token_ms is None and collector.chunks:
                                ctx.first_token_ms = (time.perf_counter() - t_up) * 1000.0
                            await send({"type": "http.response.body", "body": out, "more_body": True})
            finally:
                ctx.upstream_ms = (time.perf_counter() - t_up) * 1000.0
        except asyncio.CancelledError:
            if not consume_disconnect(watch):
                raise
            await self._finish(ctx, prepared, collector, ("client_disconnect", None, "client disconnected"), t0)
            return 499
        except UpstreamError as exc:
            kind: ErrorType = "timeout" if isinstance(exc, UpstreamTimeoutError) else "upstream_error"
            if not started:
                status = 504 if kind == "timeout" else 502
                return await self._upstream_failed(ctx, prepared, collector, send, kind, status, exc, t0)
            error = (kind, None, f"upstream stream failed: {exc}")
        watch.armed = False
        if error is None and not done:
            error = ("upstream_error", 200, "upstream stream ended without data: [DONE]")
        if self._guaranteed:
            try:
                await self._finish(ctx, prepared, collector, error, t0)
            except SpoolFullError:
                await end_stream(send, sse(_SPOOL_FULL))
                return 503
            await end_stream(send, last if done else b"")
        else:
            await end_stream(send, last if done else b"")
            self.recorder.later(self._finish(ctx, prepared, collector, error, t0))
        return 200

    async def _stream_refused(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        collector: OutputCollector,
        resp: UpstreamResponse,
        send: Send,
        watch: Watch,
        t0: float,
        t_up: float,
    ) -> int:
        """A stream request upstream answered with an error document: relay it as it is, record it."""
        content = await resp.read()
        ctx.upstream_ms = (time.perf_counter() - t_up) * 1000.0
        watch.armed = False
        kind: ErrorType = "bad_request" if 400 <= resp.status < 500 else "upstream_error"
        err = (kind, resp.status, content[:2000].decode("utf-8", "replace"))
        extra = [(b"content-type", resp.header("content-type", "application/json").encode("latin-1"))]
        rid = ctx.request_id.encode("ascii")
        if self._guaranteed:
            await self._finish(ctx, prepared, collector, err, t0)
            await send_json(send, resp.status, content, rid, extra)
        else:
            await send_json(send, resp.status, content, rid, extra)
            self.recorder.later(self._finish(ctx, prepared, collector, err, t0))
        return resp.status

    async def _upstream_failed(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        collector: OutputCollector,
        send: Send,
        kind: ErrorType,
        status: int,
        exc: Exception,
        t0: float,
    ) -> int:
        message = str(exc)
        rid = ctx.request_id.encode("ascii")
        body = error_body(message, type_="upstream_error", code=status)
        if self._guaranteed:
            await self._finish(ctx, prepared, collector, (kind, None, message), t0)
            await send_json(send, status, body, rid)
        else:
            await send_json(send, status, body, rid)
            self.recorder.later(self._finish(ctx, prepared, collector, (kind, None, message), t0))
        return status

    def _finish(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        collector: OutputCollector,
        error: Failure | None,
        t0: float,
    ) -> Coroutine[Any, Any, None]:
        """The recording of this request (await it, or hand it to ``recorder.later``); notes in-flight now."""
        ctx.in_flight_at_end = self.in_flight
        ctx.recorded = True
        return self.recorder.finish(ctx, prepared, collector, error, t0)

    async def drain(self) -> None:
        await self.recorder.drain()

    # ------------------------------------------------------------------ request parts

    def _request_id(self, supplied: bytes | None) -> str:
        if supplied is not None:
            value = supplied.decode("latin-1")
            if is_valid_request_id(value) and value not in self.recent_ids:
                self.recent_ids.add(value)
                return value
        value = f"rl-{os.urandom(16).hex()}"  # 128 random bits, as a uuid4's hex but a quarter of its cost
        self.recent_ids.add(value)
        return value

    def _read_reprolane_headers(self, ctx: RequestContext, headers: dict[bytes, bytes]) -> None:
        tenant = headers.get(b"x-reprolane-tenant")
        if tenant is not None:
            value = tenant.decode("latin-1")
            if not is_valid_request_id(value):
                raise BadRequest(
                    400, "X-Reprolane-Tenant must match [A-Za-z0-9][A-Za-z0-9._:-]{0,127}", "X-Reprolane-Tenant"
                )
            ctx.tenant = value
        workflow = headers.get(b"x-reprolane-workflow-id")
        step = headers.get(b"x-reprolane-step")
        if workflow is not None:
            wf = workflow.decode("latin-1")
            if not is_valid_request_id(wf):
                raise BadRequest(400, "X-Reprolane-Workflow-Id is not a valid id", "X-Reprolane-Workflow-Id")
            try:
                n = int(step) if step is not None else 0
            except ValueError:
                n = -1
            if n < 0:
                raise BadRequest(400, "X-Reprolane-Step must be an integer >= 0", "X-Reprolane-Step")
            ctx.workflow = WorkflowRef(workflow_id=wf, step=n)
        flag = headers.get(b"x-reprolane-flag")
        ctx.flag = self.policy.decide(
            request_id=ctx.request_id, tenant=ctx.tenant, flag_header=None if flag is None else flag.decode("latin-1")
        )


_PATHS: dict[Endpoint, str] = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


_SPOOL_FULL = error_body(
    "the audit spool is full: the sidecar does not serve requests it cannot record (guaranteed mode)",
    type_="service_unavailable",
    code=503,
)


def _event_end(buffer: bytes) -> int:
    """Where the first complete SSE event in ``buffer`` ends (after its blank line), or -1. SSE ends lines with
    LF (vLLM), CRLF (sse-starlette, behind many OpenAI-compatible servers) or CR; JSON data holds none of them."""
    cut = buffer.find(b"\n\n")
    if cut >= 0 and buffer.find(b"\r", 0, cut) < 0:
        return cut + 2
    found = _EVENT_END.search(buffer)
    return -1 if found is None else found.end()


_EVENT_END: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def _split_data(event: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(prefix, data, ending) of a one-line ``data`` event, spelled as upstream spelled it (``data:`` with or
    without its optional space); None for any other event."""
    if not event.startswith(b"data:"):
        return None
    body = event.rstrip(b"\r\n")
    start = 6 if body[5:6] == b" " else 5
    data = body[start:]
    if b"\n" in data or b"\r" in data:
        return None  # several lines: not one JSON document
    return body[:start], data, event[len(body) :]


_LONGEST_DONE: Final = len(b"data: [DONE]\r\n\r\n")


def _is_done(event: bytes) -> bool:
    parts = _split_data(event)
    return parts is not None and parts[1] == b"[DONE]"


def _rewrite_event(event: bytes, collector: OutputCollector, prepared: Prepared) -> tuple[bytes, str | None]:
    """Record one SSE event and return it stripped, spelled as it came (other events, and data that is not a
    JSON object, pass unchanged)."""
    parts = _split_data(event)
    if parts is None:
        return event, None
    prefix, data, ending = parts
    try:
        obj, encode = decode_json(data)
    except ValueError:
        return event, None
    if not isinstance(obj, dict):
        return event, None
    if "error" in obj and "choices" not in obj:
        return event, f"upstream error in stream: {json.dumps(obj['error'])[:2000]}"
    collector.add(obj)
    return prefix + encode(strip(obj, prepared)) + ending, None
