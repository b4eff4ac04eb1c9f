"""Every path the sidecar does not capture: forwarded to upstream byte for byte, counted, and logged or refused.

The capture endpoints are ``POST`` on ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and
``/v1/messages`` (`capture.protocol.endpoints.ENDPOINTS`); everything else (``GET /v1/models``, ``/health``, ``GET
/v1/responses/{id}``, ``/v1/messages/count_tokens``, ``/inference/v1/generate``, any other method on the capture
paths) goes through `UncapturedPaths`. A read (GET, HEAD, OPTIONS) is forwarded and counted. A write is forwarded,
counted and logged once per path, or, under ``refuse_uncaptured``, answered 403 unless its path is allowed: a
sidecar that must record everything it serves then serves nothing it cannot record. The forwarding itself
(`forward_as_is`) changes nothing but hop-by-hop headers, the request id and a redirect that points at upstream's
own address; a target that is not a plain path (``%2F@host:port/x``, ``//host/x``, ``/..%2F..``) is answered 400
before anything is sent (`capture.request.edge.request_target`, `capture.request.upstream.Upstream.url`).

The request id: upstream gets a fresh id of the sidecar's own as ``X-Request-Id``, never the client's, as on the
captured paths (`capture.request.edge.forward_headers`, docs/SECURITY.md). vLLM names an engine request after that
header (``/inference/v1/generate`` generates), so a client's value there could name an engine request after another
request's id, and the schedule log joins envelopes to engine requests by it. An ``X-Request-Id`` upstream echoes
is given back to the client as the client sent it. No envelope is recorded, so the id names no record.
"""

from __future__ import annotations

import logging
from typing import Final

from capture.errors import UpstreamError, UpstreamTimeoutError
from capture.metrics import CaptureMetrics
from capture.request import edge
from capture.request.edge import ASGIApp, Receive, Scope, Send
from capture.request.request_headers import new_request_id
from capture.request.upstream import Upstream
from capture.settings import CaptureSettings

log = logging.getLogger(__name__)

_READS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_PASS_DROP: Final = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})


class UncapturedPaths:
    """The ASGI app of every path (or method) the sidecar does not capture."""

    def __init__(self, settings: CaptureSettings, *, upstream: Upstream, metrics: CaptureMetrics) -> None:
        self._refuse = settings.refuse_uncaptured
        self._allowed = frozenset(settings.uncaptured_allowed)
        self._forward = forward_as_is(
            upstream, settings.max_body_bytes, settings.request_body_timeout_s, settings.request_body_min_rate
        )
        self._seen = edge.RecentIds(capacity=256)  # write paths already logged
        self._counted = {kind: metrics.uncaptured_total.labels(kind) for kind in ("read", "write", "refused")}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Forwarded as it is, counted; a write is logged once per path, or refused with a 403 under
        ``refuse_uncaptured``."""
        if scope["method"] in _READS:
            self._counted["read"].inc()
            await self._forward(scope, receive, send)
            return
        path = scope["path"]
        if self._refuse and path not in self._allowed:
            self._counted["refused"].inc()
            message = (
                f"{scope['method']} {path} is not captured by the reprolane sidecar, and this sidecar refuses what it "
                "cannot record (refuse_uncaptured); use /v1/chat/completions, /v1/completions, /v1/responses or "
                "/v1/messages"
            )
            await edge.send_json(send, 403, edge.error_body(message, type_="permission_error", code=403), None)
            return
        self._counted["write"].inc()
        if path not in self._seen:
            self._seen.add(path)
            log.warning(
                "%s %s passes through uncaptured (no envelope is recorded for it)",
                edge.loggable(scope["method"]),
                edge.loggable(path),
            )
        await self._forward(scope, receive, send)


def forward_as_is(upstream: Upstream, max_body_bytes: int, body_timeout_s: float, body_min_rate: float) -> ASGIApp:
    """Any other path: forwarded as it is, answered as upstream answers (no envelope); a redirect to upstream's
    own address is pointed back at the sidecar (`_through_sidecar`)."""

    upstream_base = upstream.base_url.encode("latin-1")
    hop_by_hop = edge.HOP_BY_HOP

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        try:
            try:
                url = upstream.url(edge.request_target(scope))  # before the body: nothing goes anywhere else
            except ValueError as exc:
                raise edge.BadRequest(400, str(exc)) from None
            edge.refuse_unsendable(scope["headers"])
            body = await edge.read_body(headers, receive, max_body_bytes, body_timeout_s, body_min_rate)
        except edge.BadRequest as bad:
            await edge.send_json(
                send, bad.status, edge.error_body(bad.message, type_="invalid_request_error", code=bad.status), None
            )
            return
        fwd = [
            (k, v)
            for k, v in scope["headers"]
            if k not in hop_by_hop and not k.startswith(b"x-reprolane-") and k != edge.CLIENT_REQUEST_ID
        ]
        if b"accept-encoding" in headers:
            fwd.append((b"accept-encoding", headers[b"accept-encoding"]))
        fwd.append((edge.CLIENT_REQUEST_ID, new_request_id().encode("ascii")))
        client_id = headers.get(edge.CLIENT_REQUEST_ID)
        started = False
        try:
            async with upstream.request(scope["method"], url, body=body, headers=fwd) as resp:
                out_headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _PASS_DROP]
                if client_id is not None:  # an echo of the sidecar's id: the client gets its own back
                    out_headers = [(k, client_id if k == edge.CLIENT_REQUEST_ID else v) for k, v in out_headers]
                if 300 <= resp.status < 400:
                    out_headers = [
                        (k, _through_sidecar(v, upstream_base, scope, headers) if k == b"location" else v)
                        for k, v in out_headers
                    ]
                await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
                started = True
                async for chunk in resp.chunks():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as exc:
            if started:
                log.warning("pass-through %s failed mid-response: %s", url.raw_path, exc)
                await edge.end_stream(send, b"")
                return
            status = 504 if isinstance(exc, UpstreamTimeoutError) else 502
            await edge.send_json(send, status, edge.error_body(str(exc), type_="upstream_error", code=status), None)

    return app


def _through_sidecar(location: bytes, upstream_base: bytes, scope: Scope, headers: dict[bytes, bytes]) -> bytes:
    """A redirect's Location that names upstream, made to name the sidecar as the client reached it (what nginx's
    ``proxy_redirect default`` does): vLLM answers ``POST /v1/chat/completions/`` with a 307 to its own address,
    and a client that followed that would generate uncaptured."""
    if not location.startswith(upstream_base):
        return location
    rest = location[len(upstream_base) :]
    if rest[:1] not in (b"", b"/", b"?", b"#"):
        return location  # http://host:80 is not http://host:8000
    host = headers.get(b"host")
    if host is None:
        return rest or b"/"
    scheme: str = scope.get("scheme", "http")
    return scheme.encode("ascii") + b"://" + host + rest
