"""The capture endpoints: ``POST`` on ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and
``/v1/messages``, as raw ASGI.

Every other path (and any other method on these) goes to `capture.request.passthrough.UncapturedPaths`: forwarded
byte for byte and counted (writes there are logged once per path, or refused under ``refuse_uncaptured``).
A captured request runs as:

    authenticate (401: nothing read, sent or recorded; `capture.request.auth`)
    -> read body (413 above max_body_bytes) -> parse (400) -> prepare (audit fields) -> upstream
    -> record + strip each body / SSE chunk -> [guaranteed: envelope durable in the spool] -> release
    -> [best_effort: envelope built and spooled in a tracked background task]

`CaptureProxy` does the first steps and the accounting (in-flight count, metrics, the last-resort 500); the
answer flows are `capture.request.non_streaming` and `capture.request.streaming`, on what they share in
`capture.request.forwarding`; the protocol (audit fields, contract, collection) is `capture.protocol`, the request
headers `capture.request.request_headers`, spooling per mode `capture.request.envelope_writer`, ASGI plumbing
`capture.request.edge`.

In guaranteed mode nothing is served uncaptured: a full spool answers 503 before upstream is asked; if the
spool fills while a request runs, the non-streamed answer becomes a 503 and a stream ends with an error event
instead of ``data: [DONE]``. A watcher on the ASGI ``receive`` channel notices a client that hangs up while
upstream works, cancels the upstream call (so the server stops generating) and records the attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from datetime import UTC, datetime
from typing import Final

from prometheus_client import Counter, Histogram

from capture.errors import UpstreamError
from capture.metrics import CaptureMetrics
from capture.protocol import Endpoint
from capture.protocol.audit_fields import Prepared, prepare
from capture.protocol.output import OutputCollector
from capture.protocol.sampling import BUILTIN_DEFAULTS, SamplingDefaults
from capture.request.assembly import RequestContext
from capture.request.auth import Authenticator, Unauthenticated, authenticated, send_unauthenticated
from capture.request.edge import (
    ASGIApp,
    BadRequest,
    Receive,
    Scope,
    Send,
    Watch,
    decode_request,
    dumps,
    end_stream,
    error_body,
    read_body,
    refuse_unsendable,
    send_json,
    watch_disconnect,
)
from capture.request.envelope_writer import EnvelopeWriter, SpoolLike
from capture.request.forwarding import SPOOL_FULL, Exchange, Forwarder
from capture.request.non_streaming import forward_whole
from capture.request.passthrough import UncapturedPaths
from capture.request.policy import NOT_FLAGGED, ReplayPolicy
from capture.request.request_headers import new_request_id, read_reprolane_headers
from capture.request.runtime import Artifacts, RuntimeProbe
from capture.request.streaming import forward_stream
from capture.request.telemetry import CaptureTelemetry
from capture.request.upstream import Upstream
from capture.settings import CaptureSettings

log = logging.getLogger(__name__)

DETOKENIZE_CONCURRENCY: Final = 8  # /detokenize calls one echoed request makes at once (`CaptureProxy._echo_texts`)


class CaptureProxy:
    """Both capture endpoints and the pass-through, sharing one upstream connection pool."""

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        spool: SpoolLike,
        metrics: CaptureMetrics,
        artifacts: Artifacts,
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
        self.auth = Authenticator.from_settings(settings)
        self._guaranteed = settings.mode == "guaranteed"
        self.writer = EnvelopeWriter(
            guaranteed=self._guaranteed,
            spool=spool,
            metrics=metrics,
            artifacts=artifacts,
            runtime=runtime,
            upstream=upstream,
            sidecar_id=settings.sidecar_id,
            schedule_recorder=settings.schedule_recorder,
            telemetry=CaptureTelemetry.from_settings(settings, metrics),
        )
        forwarder = self.forwarder = Forwarder(
            upstream=upstream,
            writer=self.writer,
            guaranteed=self._guaranteed,
            version_headers=settings.version_headers,
        )
        metrics.in_flight.set_function(lambda: forwarder.in_flight)  # read at scrape time: no lock per request
        self.passthrough = authenticated(UncapturedPaths(settings, upstream=upstream, metrics=metrics), self.auth)
        self._answered_children: dict[tuple[Endpoint, int], Counter] = {}
        self._upstream_children: dict[Endpoint, Histogram] = {}

    def endpoint(self, endpoint: Endpoint) -> ASGIApp:
        """The ASGI app of one capture path: POST is captured, any other method passes through."""

        async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
            if scope.get("method") != "POST":
                await self.passthrough(scope, receive, send)
                return
            await self.capture(endpoint, scope, receive, send)

        return asgi

    async def capture(self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        fw = self.forwarder
        fw.in_flight += 1
        status = 500
        headers = dict(scope["headers"])
        ctx = RequestContext(
            request_id=new_request_id(),
            received_at=datetime.now(UTC),
            tenant=self.settings.default_tenant,
            workflow=None,
            flag=NOT_FLAGGED,
            endpoint=endpoint,
            stream=False,
            in_flight_at_start=fw.in_flight,
            traceparent=self.writer.telemetry.trace_parent(headers),
        )
        try:
            status = await self._capture(ctx, scope, headers, receive, send, t0)
        except Exception as exc:  # a bug of the sidecar's: the client gets a 500, the attempt is still recorded
            log.exception("request %s: the sidecar failed", ctx.request_id)
            status = await self._internal_error(ctx, send, exc, t0)
        finally:
            fw.in_flight -= 1
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
            ctx.in_flight_at_end = self.forwarder.in_flight
            try:
                await self.writer.record_refused(ctx, ("proxy_error", 500, message), t0)
            except Exception:
                log.exception("request %s: its error envelope could not be recorded either", ctx.request_id)
        return 500

    def _answered(self, endpoint: Endpoint, status: int) -> Counter:
        """The ``requests_total`` child of (endpoint, status), looked up once (`labels` is not free per call)."""
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
        try:
            caller = self.auth.authenticate(headers, scope.get("client"))
        except Unauthenticated as exc:
            await send_unauthenticated(send, str(exc), rid)
            return 401
        if caller.credential_header is not None:
            del headers[caller.credential_header]  # the sidecar's key is not upstream's
        body = b""
        try:
            read_reprolane_headers(ctx, headers, self.policy, caller)
            refuse_unsendable(headers.items())
            bounds = self.settings
            body = await read_body(
                headers, receive, bounds.max_body_bytes, bounds.request_body_timeout_s, bounds.request_body_min_rate
            )
            ctx.body_sha256 = hashlib.sha256(body).hexdigest()
            try:
                parsed, encode = decode_request(body)
            except ValueError as exc:
                raise BadRequest(400, f"request body is not valid JSON: {exc}") from None
            if not isinstance(parsed, dict):
                raise BadRequest(400, "request body must be a JSON object")
        except BadRequest as bad:
            await send_json(
                send,
                bad.status,
                error_body(
                    bad.message,
                    type_="permission_error" if bad.status == 403 else "invalid_request_error",
                    code=bad.status,
                    param=bad.param,
                ),
                rid,
            )
            ctx.in_flight_at_end = self.forwarder.in_flight
            await self.writer.record_refused(ctx, ("bad_request", bad.status, bad.message), t0)
            return bad.status

        prepared = prepare(
            ctx.endpoint,
            parsed,
            request_id=ctx.request_id,
            audit_k=self.settings.audit_top_logprobs,
            inject_seed=self.settings.injects_seed,
            defaults=self.sampling_defaults,
        )
        ctx.stream = prepared.stream
        if self._guaranteed and self.spool.bytes >= self.settings.spool_max_bytes:
            await send_json(send, 503, SPOOL_FULL, rid)
            return 503
        if prepared.echo is not None and prepared.echo.pending():
            await self._echo_texts(prepared)
        watch = Watch(task=asyncio.current_task())
        watcher = asyncio.create_task(watch_disconnect(receive, watch))
        try:
            upstream_body = encode(prepared.upstream_body)
            collector = OutputCollector(ctx.endpoint, echo=prepared.echo)
            forward = forward_stream if prepared.stream else forward_whole
            exchange = Exchange(ctx, prepared, collector, upstream_body, headers, send, watch, t0)
            return await forward(self.forwarder, exchange)
        finally:
            watcher.cancel()

    async def _echo_texts(self, prepared: Prepared) -> None:
        """The text upstream echoes for prompts given as token ids (its ``/detokenize``, the same decoding), so
        `capture.protocol.completions.Echo` can put it back; when upstream cannot say, the sidecar does not ask
        for token ids (the client's answer comes first) and this request's envelope has none.

        vLLM's ``/detokenize`` takes one prompt per call: a request of many prompts asks for them
        `DETOKENIZE_CONCURRENCY` at a time (one after the other, its wait grew with every prompt; all at
        once, one request could open hundreds of upstream connections). The first failure stops the rest."""
        echo = prepared.echo
        assert echo is not None
        todo = iter(echo.pending())
        failed = False

        async def worker() -> None:
            nonlocal failed
            for position, ids in todo:  # one iterator shared by the workers: each prompt is asked for once
                if failed:
                    return
                text = await self._detokenize(prepared.model, ids)
                if text is None:
                    failed = True
                    return
                echo.resolve(position, text)

        await asyncio.gather(*(worker() for _ in range(min(DETOKENIZE_CONCURRENCY, len(echo.pending())))))
        if failed:
            prepared.upstream_body.pop("return_token_ids", None)
            echo.abandon()

    async def _detokenize(self, model: str, ids: list[int]) -> str | None:
        try:
            status, answer = await self.upstream.post_json("/detokenize", dumps({"model": model, "tokens": ids}))
        except UpstreamError:
            return None
        text = answer.get("prompt") if isinstance(answer, dict) and status == 200 else None
        return text if isinstance(text, str) else None

    async def drain(self) -> None:
        """Wait for every background recording (shutdown), then export the spans still queued."""
        await self.writer.drain()
        await asyncio.to_thread(self.writer.telemetry.shutdown)
