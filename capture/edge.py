"""ASGI plumbing of the sidecar's edge: bodies, headers, JSON, OpenAI-format errors, disconnects, request ids
(the pass-through of the paths that are not captured is `capture.passthrough`).

Raw ASGI rather than Starlette request/response objects: the capture hot path must stay well under a
millisecond, and a streamed answer needs direct control of ``send`` and of the ``receive`` channel (a client
that hangs up is only visible there while the sidecar waits on upstream).
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import msgspec

from capture.upstream import UpstreamResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REQUEST_ID_HEADER = b"x-reprolane-request-id"
# Not forwarded upstream: hop-by-hop, recomputed (length, host), or ours (x-reprolane-*, see forward_headers).
HOP_BY_HOP = frozenset(
    {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length"}
    | {b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"trailer", b"accept-encoding"}
)
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"})
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

    msgspec reads and writes these documents several times faster than ``json.loads`` / ``json.dumps``
    (benchmarks/bench_envelope.py, BENCHMARKS.md), with the same Python values; only the spelling of floats
    differs: the same numbers, and neither side ever got the other's own bytes once a field was added or
    stripped.
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
    out = [(k, v) for k, v in headers.items() if k not in HOP_BY_HOP and not k.startswith(b"x-reprolane-")]
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
