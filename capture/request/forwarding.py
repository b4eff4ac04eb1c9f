"""What the two answer flows of a captured request share: the upstream call, and the outcome recorded in the
capture mode's order.

A captured request is answered by `capture.request.non_streaming.forward_whole` or
`capture.request.streaming.forward_stream`; both call upstream through `Forwarder.call` (which records the call's time
in the request's ``upstream_ms`` however it ends) and end with the outcome recorded by the `EnvelopeWriter`:

- ``guaranteed``: the envelope is durable in the spool before the answer is released (`Forwarder.finish` is
  awaited first); a spool that filled while the request ran turns the answer into a refusal. A stream, whose
  answer is relayed as it comes, first makes a started record durable (`Forwarder.record_start`), before
  upstream is asked: a spool that cannot take it refuses the request with 503.
- ``best_effort``: the answer is released first and its recording runs in the background (``writer.later``).

`Forwarder.in_flight` counts the requests passing through the sidecar (`capture.request.proxy.CaptureProxy` counts
them in and out); each envelope records it when its request ends.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any, Final, NamedTuple

from capture.errors import SpoolCorruptError, SpoolFullError, SpoolUnavailableError
from capture.protocol.audit_fields import Prepared
from capture.protocol.credentials import credential_values, scrub
from capture.protocol.endpoints import ENDPOINTS
from capture.protocol.output import OutputCollector
from capture.request.assembly import ErrorType, Failure, RequestContext
from capture.request.edge import Send, Watch, error_body, forward_headers, send_json
from capture.request.envelope_writer import EnvelopeWriter
from capture.request.upstream import Upstream, UpstreamCall, UpstreamResponse

SPOOL_FULL: Final = error_body(
    "the audit spool is full: the sidecar does not serve requests it cannot record (guaranteed mode)",
    type_="service_unavailable",
    code=503,
)
SPOOL_UNAVAILABLE: Final = error_body(
    "the audit spool cannot record this request now (its disk refuses writes): the sidecar does not serve requests "
    "it cannot record (guaranteed mode)",
    type_="service_unavailable",
    code=503,
)
_CLIENT_GONE: Final[Failure] = ("client_disconnect", None, "client disconnected")
_ERROR_CHARS: Final = 2000  # of an upstream error document, recorded
_SCRUBBED_CHARS: Final = 4 * _ERROR_CHARS  # scrubbed before the cut, so no secret is cut in two


def upstream_said(
    prepared: Prepared, headers: dict[bytes, bytes], kind: ErrorType, status: int | None, text: bytes | str
) -> Failure:
    """The failure an envelope records of an error upstream answered: its text's start, with the request's
    credentials scrubbed out (`capture.protocol.credentials.scrub`): a validation error may quote the request,
    and a secret the envelope never records must not come back in through upstream's words."""
    if isinstance(text, bytes):
        text = text[:_SCRUBBED_CHARS].decode("utf-8", "replace")
    secrets = credential_values(prepared.upstream_body, headers)
    text = scrub(text[:_SCRUBBED_CHARS], secrets) if secrets else text
    return kind, status, text[:_ERROR_CHARS]


class Exchange(NamedTuple):
    """One captured request on its way through an answer flow (`capture.request.non_streaming.forward_whole`,
    `capture.request.streaming.forward_stream`): what both take besides the `Forwarder`."""

    ctx: RequestContext
    prepared: Prepared
    collector: OutputCollector
    upstream_body: bytes  # the request as upstream gets it (audit fields added)
    headers: dict[bytes, bytes]  # the client's request headers
    send: Send
    watch: Watch  # the client-disconnect watch (`capture.request.edge.watch_disconnect`)
    t0: float  # when the request arrived (perf_counter)


class TimedCall:
    """`Forwarder.call`'s context manager: the upstream call, its time written to the request's ``upstream_ms``
    when it ends, whether it ended well, failed to connect, timed out or was cancelled (the client hung up)."""

    __slots__ = ("_call", "_ctx", "started")

    def __init__(self, call: UpstreamCall, ctx: RequestContext) -> None:
        self._call = call
        self._ctx = ctx
        self.started = 0.0  # perf_counter when the request went upstream

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    async def __aenter__(self) -> UpstreamResponse:
        self.started = time.perf_counter()
        try:
            return await self._call.__aenter__()
        except BaseException:
            self._ctx.upstream_ms = self.elapsed_ms()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self._call.__aexit__(*exc_info)
        finally:
            self._ctx.upstream_ms = self.elapsed_ms()


class Forwarder:
    """Sends captured requests upstream and records each outcome in the capture mode's order."""

    def __init__(
        self, *, upstream: Upstream, writer: EnvelopeWriter, guaranteed: bool, version_headers: tuple[str, ...]
    ) -> None:
        self.upstream = upstream
        self.writer = writer
        self.guaranteed = guaranteed
        self.version_headers = version_headers  # response headers an envelope keeps (`OutputCollector.note_versions`)
        self.in_flight = 0

    def call(self, ctx: RequestContext, upstream_body: bytes, headers: dict[bytes, bytes]) -> TimedCall:
        """The upstream request of a captured one: ``async with forwarder.call(...) as resp``; it sets
        ``ctx.upstream_ms`` when it ends. Upstream gets the sidecar's request id as ``X-Request-Id``."""
        forwarded = forward_headers(headers, ctx.request_id.encode("ascii"))
        call = self.upstream.request("POST", ENDPOINTS[ctx.endpoint].path, body=upstream_body, headers=forwarded)
        return TimedCall(call, ctx)

    def finish(
        self, ctx: RequestContext, prepared: Prepared, collector: OutputCollector, error: Failure | None, t0: float
    ) -> Coroutine[Any, Any, None]:
        """The recording of this request (await it, or hand it to ``writer.later``); notes in-flight now."""
        ctx.in_flight_at_end = self.in_flight
        ctx.recorded = True
        return self.writer.finish(ctx, prepared, collector, error, t0)

    async def record_start(self, ctx: RequestContext, prepared: Prepared, send: Send) -> int | None:
        """Guaranteed mode, before a stream goes upstream: make its started record durable (None once it is), or
        answer 503 when the spool cannot take it (full, failed, read-only, disk full) and return 503: the
        request never reaches upstream, and nothing of an answer is relayed unrecorded."""
        try:
            await self.writer.record_started(ctx, prepared, self.in_flight)
        except (SpoolUnavailableError, SpoolCorruptError) as exc:
            body = SPOOL_FULL if isinstance(exc, SpoolFullError) else SPOOL_UNAVAILABLE
            await send_json(send, 503, body, ctx.request_id.encode("ascii"))
            return 503
        return None

    async def client_gone(self, ctx: RequestContext, prepared: Prepared, collector: OutputCollector, t0: float) -> int:
        """The client hung up while upstream worked (the upstream call is cancelled): record the attempt, 499."""
        await self.finish(ctx, prepared, collector, _CLIENT_GONE, t0)
        return 499

    async def answer(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        collector: OutputCollector,
        error: Failure | None,
        t0: float,
        send: Send,
        status: int,
        body: bytes,
        extra: list[tuple[bytes, bytes]] | None = None,
        *,
        refuse_when_full: bool = False,
    ) -> int:
        """Answer `body` with `status` and record the outcome, in the mode's order; returns the status sent.

        In guaranteed mode a spool that cannot take the envelope by now (full, or its disk refused the write)
        raises `SpoolUnavailableError`, or, with `refuse_when_full`, answers 503 instead (the non-streamed
        answer: nothing of it has been sent yet).
        """
        rid = ctx.request_id.encode("ascii")
        if self.guaranteed:
            try:
                await self.finish(ctx, prepared, collector, error, t0)
            except SpoolUnavailableError:
                if not refuse_when_full:
                    raise
                await send_json(send, 503, SPOOL_FULL, rid)
                return 503
            await send_json(send, status, body, rid, extra)
        else:
            await send_json(send, status, body, rid, extra)
            self.writer.later(self.finish(ctx, prepared, collector, error, t0))
        return status

    async def upstream_failed(
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
        """Upstream failed (``kind``: unreachable, broken or timed out) before the answer started: `status`."""
        message = str(exc)
        body = error_body(message, type_="upstream_error", code=status)
        return await self.answer(ctx, prepared, collector, (kind, None, message), t0, send, status, body)
