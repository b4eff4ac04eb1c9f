"""A captured request answered as a stream (``stream: true``): upstream's server-sent events recorded and
stripped one by one as they arrive, and passed on in the spelling upstream used.

Each ``data`` event holding a JSON object (for ``/v1/responses`` and ``/v1/messages``: the one ``data`` line of a
typed event, after its ``event:`` line) is recorded (`OutputCollector.add`) and sent on stripped of the audit fields
(`rewrite_event`); any other event passes unchanged, and upstream's ``data: [DONE]`` is held back until the outcome
is recorded (the Responses and Messages APIs send none: their terminal event, ``response.completed`` or
``message_stop``, is held back in its place). In guaranteed mode a started record is durable before the request goes
upstream (`Forwarder.record_start`: a spool that cannot take it refuses the request with 503), and the stream ends
with ``[DONE]`` (or that terminal event) once the finished envelope is durable too, or, when the spool filled while
the request ran, with an error event instead; a stream upstream ends without ``[DONE]``, or breaks, is recorded as
an error. An error document upstream answers instead of a stream is relayed as it came.
"""

from __future__ import annotations

import asyncio
import json

from capture.errors import SpoolCorruptError, SpoolUnavailableError, UpstreamError, UpstreamTimeoutError
from capture.protocol.audit_fields import Prepared, strip
from capture.protocol.endpoints import ENDPOINTS
from capture.protocol.output import OutputCollector
from capture.protocol.sse import LONGEST_DONE, SSE_DONE, event_end, is_done, sse
from capture.request.assembly import ErrorType
from capture.request.edge import consume_disconnect, decode_json, end_stream, response_headers
from capture.request.forwarding import SPOOL_FULL, Exchange, Forwarder, TimedCall, upstream_said
from capture.request.upstream import UpstreamResponse


async def forward_stream(fw: Forwarder, ex: Exchange) -> int:
    """Forward one streamed captured request and stream its answer; returns the status the client got."""
    ctx, prepared, collector, upstream_body, headers, send, watch, t0 = ex
    rid = ctx.request_id.encode("ascii")
    started = False
    error: tuple[ErrorType, int | None, str] | None = None
    done, last = False, SSE_DONE
    try:
        if fw.guaranteed and (refused := await fw.record_start(ctx, prepared, send)) is not None:
            return refused
        call = fw.call(ctx, upstream_body, headers)
        async with call as resp:
            if resp.status != 200:
                return await _relay_refusal(fw, ex, resp, call)
            collector.note_versions(resp.header, fw.version_headers)
            relayed = response_headers(resp, rid, headers.get(b"x-request-id"))
            await send({"type": "http.response.start", "status": 200, "headers": relayed})
            started = True
            buffer = b""
            async for chunk in resp.chunks():
                buffer += chunk
                while (cut := event_end(buffer)) > 0:
                    event, buffer = buffer[:cut], buffer[cut:]
                    if event == SSE_DONE or (len(event) <= LONGEST_DONE and is_done(event)):
                        done, last = True, event
                        continue
                    out, failure = rewrite_event(event, collector, prepared)
                    if failure is not None:
                        error = upstream_said(prepared, headers, "upstream_error", 200, failure)
                    if ctx.first_token_ms is None and collector.chunks:
                        ctx.first_token_ms = call.elapsed_ms()
                    if collector.ended and not done:  # Responses / Messages: their terminal event is the [DONE]
                        done, last = True, out
                        continue
                    await send({"type": "http.response.body", "body": out, "more_body": True})
    except asyncio.CancelledError:
        if not consume_disconnect(watch):
            raise
        return await fw.client_gone(ctx, prepared, collector, t0)
    except UpstreamError as exc:
        kind: ErrorType = "timeout" if isinstance(exc, UpstreamTimeoutError) else "upstream_error"
        if not started:
            status = 504 if kind == "timeout" else 502
            return await fw.upstream_failed(ctx, prepared, collector, send, kind, status, exc, t0)
        error = (kind, None, f"upstream stream failed: {exc}")
    watch.armed = False
    if error is None and not done:
        error = ("upstream_error", 200, "upstream stream ended without data: [DONE]")
    if fw.guaranteed:
        try:
            await fw.finish(ctx, prepared, collector, error, t0)
        except (SpoolUnavailableError, SpoolCorruptError):
            await end_stream(send, sse(SPOOL_FULL))
            return 503
        await end_stream(send, last if done else b"")
    else:
        await end_stream(send, last if done else b"")
        fw.writer.later(fw.finish(ctx, prepared, collector, error, t0))
    return 200


async def _relay_refusal(fw: Forwarder, ex: Exchange, resp: UpstreamResponse, call: TimedCall) -> int:
    """A stream request upstream answered with an error document: relay it as it is, record it."""
    ctx, prepared, collector, _body, headers, send, watch, t0 = ex
    content = await resp.read()
    ctx.upstream_ms = call.elapsed_ms()  # now: the envelope is recorded before the call ends
    watch.armed = False
    kind: ErrorType = "bad_request" if 400 <= resp.status < 500 else "upstream_error"
    err = upstream_said(prepared, headers, kind, resp.status, content)
    extra = [(b"content-type", resp.header("content-type", "application/json").encode("latin-1"))]
    return await fw.answer(ctx, prepared, collector, err, t0, send, resp.status, content, extra)


def rewrite_event(event: bytes, collector: OutputCollector, prepared: Prepared) -> tuple[bytes, str | None]:
    """Record one SSE event and return it stripped, spelled as it came (other events, and data that is not a
    JSON object, pass unchanged); the second value is upstream's error when the event reports one."""
    protocol = ENDPOINTS[prepared.endpoint]
    parts = protocol.split_event(event)
    if parts is None:
        return event, None
    prefix, data, ending = parts
    try:
        obj, encode = decode_json(data)
    except ValueError:
        return event, None
    if not isinstance(obj, dict):
        return event, None
    failed, said = protocol.read_event(collector, obj)
    if failed:
        return event, f"upstream error in stream: {json.dumps(said)}"  # upstream_said cuts it
    return prefix + encode(strip(obj, prepared)) + ending, None
