"""ASGI plumbing of the sidecar's edge: bodies, headers, OpenAI-format errors, disconnects, request ids, and
the byte-for-byte pass-through of every path that is not captured.

Raw ASGI rather than Starlette request/response objects: the capture hot path must stay well under a
millisecond, and a streamed answer needs direct control of ``send`` and of the ``receive`` channel (a client
that hangs up is only visible there while the sidecar waits on upstream).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import msgspec

from capture.errors import UpstreamError, UpstreamTimeoutError
from capture.upstream import Upstream, UpstreamResponse

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = b"x-reprolane-request-id"
SSE_DONE = b"data: [DONE]\n\n"
# Not forwarded upstream: hop-by-hop, recomputed (length, host), or ours (x-reprolane-*, see forward_headers).
_HOP_BY_HOP = frozenset(
    {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length"}
    | {b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"trailer", b"accept-encoding"}
)
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"})
_PASS_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})
_JSON_SEP = (",", ":")


class BadRequest(Exception):
    """The sidecar itself refuses the request (answered in OpenAI's error format, then recorded)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class RecentIds:
    """A bounded set of recently seen request ids (oldest forgotten first), so memory stays flat."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._order: collections.deque[str] = collections.deque()
        self._seen: set[str] = set()
        self._capacity = capacity

    def __contains__(self, item: str) -> bool:
        return item in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, item: str) -> None:
        if item in self._seen:
            return
        if len(self._order) >= self._capacity:
            self._seen.discard(self._order.popleft())
        self._order.append(item)
        self._seen.add(item)


def dumps(obj: Any) -> bytes:
    """Compact JSON, as vLLM writes it. A string with a lone surrogate (which JSON may spell, ``"\\ud800"``, and
    UTF-8 cannot) is written escaped, as it came."""
    text = json.dumps(obj, separators=_JSON_SEP, ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, separators=_JSON_SEP).encode("ascii")


_DECODER = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()


def decode_json(raw: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """A JSON document (the client's request, upstream's answer) and the encoder to write it on with (the
    request with the audit fields added, upstream; the answer stripped, to the client).

    msgspec reads a 5.6-11 KB answer with logprobs ~3x faster than ``json.loads`` and writes it ~7x faster than
    ``json.dumps``; a 150-byte request ~6x / ~12x (same Python values; only the spelling of floats differs:
    the same numbers, and neither side ever got the other's own bytes once a field was added or stripped).
    What only the standard library reads (NaN, Infinity, a lone surrogate, a number beyond float range, UTF-16)
    is read and written back by it, so it travels on as it came. Raises ValueError for a document neither
    accepts (the standard library's message: the client's 400 quotes it).
    """
    try:
        return _DECODER.decode(raw), _ENCODER.encode
    except msgspec.DecodeError:
        return json.loads(raw), dumps


def error_body(message: str, *, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    """An OpenAI-format error document."""
    return dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


def sse(body: bytes) -> bytes:
    return b"data: " + body + b"\n\n"


async def read_body(headers: dict[bytes, bytes], receive: Receive, limit: int) -> bytes:
    """The whole request body; `BadRequest` 413 past `limit` (a declared length is checked before reading)."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest(400, "client disconnected while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def forward_headers(headers: dict[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """Client headers for a captured request upstream: secrets forwarded (never recorded), ours removed."""
    out = [(k, v) for k, v in headers.items() if k not in _HOP_BY_HOP and not k.startswith(b"x-reprolane-")]
    out.append((b"accept-encoding", b"identity"))
    return out


def response_headers(resp: UpstreamResponse, rid: bytes) -> list[tuple[bytes, bytes]]:
    out = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _RESPONSE_DROP]
    out.append((REQUEST_ID_HEADER, rid))
    return out


async def send_json(
    send: Send, status: int, body: bytes, rid: bytes | None, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A complete non-streamed answer (``extra`` replaces the default JSON content type)."""
    headers = extra or [(b"content-type", b"application/json")]
    headers = [*headers, (b"content-length", str(len(body)).encode("ascii"))]
    if rid is not None:
        headers.append((REQUEST_ID_HEADER, rid))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def end_stream(send: Send, last: bytes) -> None:
    await send({"type": "http.response.body", "body": last, "more_body": False})


@dataclass(slots=True)
class Watch:
    """State shared by a handler and its disconnect watcher; `armed` while a hang-up should cancel it."""

    task: asyncio.Task[Any] | None
    disconnected: bool = False
    armed: bool = True


async def watch_disconnect(receive: Receive, watch: Watch) -> None:
    """Cancel the handler when the client hangs up while the sidecar still waits on upstream."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            watch.disconnected = True
            if watch.armed and watch.task is not None:
                watch.task.cancel()
            return


def consume_disconnect(watch: Watch) -> bool:
    """True (and the cancellation absorbed) when the CancelledError came from the disconnect watcher."""
    if not watch.disconnected:
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    watch.armed = False
    return True


def passthrough(upstream: Upstream, max_body_bytes: int) -> ASGIApp:
    """Any other path: forwarded as it is, answered as upstream answers (no envelope); a redirect to upstream's
    own address is pointed back at the sidecar (`_through_sidecar`)."""

    upstream_base = upstream.base_url.encode("latin-1")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        try:
            body = await read_body(headers, receive, max_body_bytes)
        except BadRequest as bad:
            await send_json(
                send, bad.status, error_body(bad.message, type_="invalid_request_error", code=bad.status), None
            )
            return
        target = (scope.get("raw_path") or scope["path"].encode("utf-8")).decode("latin-1")
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        fwd = [(k, v) for k, v in scope["headers"] if k not in _HOP_BY_HOP and not k.startswith(b"x-reprolane-")]
        if b"accept-encoding" in headers:
            fwd.append((b"accept-encoding", headers[b"accept-encoding"]))
        started = False
        try:
            async with upstream.request(scope["method"], target, body=body, headers=fwd) as resp:
                out_headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _PASS_DROP]
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
                log.warning("pass-through %s failed mid-response: %s", target, exc)
                await end_stream(send, b"")
                return
            status = 504 if isinstance(exc, UpstreamTimeoutError) else 502
            await send_json(send, status, error_body(str(exc), type_="upstream_error", code=status), None)

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
