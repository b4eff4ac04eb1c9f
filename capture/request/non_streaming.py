"""A captured request answered as one body (``stream`` not set): upstream's answer read whole, recorded,
stripped of the audit fields and released.

The answer is recorded as soon as it is read, while it is still in the CPU's caches (collecting it after the
answer was sent, off the client's wait, cost more CPU per request, not less: BENCHMARKS.md). An answer that is
not a JSON object, or upstream's own error document, is relayed as it came and recorded as an error; a client
that hangs up while upstream works cancels the upstream call (`capture.request.edge.watch_disconnect`).
"""

from __future__ import annotations

import asyncio

from capture.errors import UpstreamError, UpstreamTimeoutError
from capture.protocol.audit_fields import strip
from capture.request.assembly import ErrorType, Failure
from capture.request.edge import consume_disconnect, decode_json
from capture.request.forwarding import Exchange, Forwarder, upstream_said


async def forward_whole(fw: Forwarder, ex: Exchange) -> int:
    """Forward one non-streamed captured request and answer it; returns the status the client got."""
    ctx, prepared, collector, upstream_body, headers, send, watch, t0 = ex
    try:
        async with fw.call(ctx, upstream_body, headers) as resp:
            content = await resp.read()
            collector.note_versions(resp.header, fw.version_headers)
    except asyncio.CancelledError:
        if not consume_disconnect(watch):
            raise
        return await fw.client_gone(ctx, prepared, collector, t0)
    except UpstreamTimeoutError as exc:
        return await fw.upstream_failed(ctx, prepared, collector, send, "timeout", 504, exc, t0)
    except UpstreamError as exc:
        return await fw.upstream_failed(ctx, prepared, collector, send, "upstream_error", 502, exc, t0)
    watch.armed = False

    if resp.status != 200:
        kind: ErrorType = "bad_request" if 400 <= resp.status < 500 else "upstream_error"
        error: Failure | None = upstream_said(prepared, headers, kind, resp.status, content)
        out = content
    else:
        error = None
        try:
            answer, encode = decode_json(content)
            collector.add(answer)
            out = encode(strip(answer, prepared))
        except (ValueError, AttributeError, TypeError) as exc:
            error, out = ("upstream_error", 200, f"upstream answered unparsable JSON: {exc}"), content
    extra = [(b"content-type", resp.header("content-type", "application/json").encode("latin-1"))]
    return await fw.answer(ctx, prepared, collector, error, t0, send, resp.status, out, extra, refuse_when_full=True)
