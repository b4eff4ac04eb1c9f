"""ASGI plumbing of the sidecar's edge: bodies, headers, JSON, OpenAI-format errors, disconnects, request ids
(the pass-through of the paths that are not captured is `capture.request.passthrough`).

What a client sends is bounded here before anything else reads it: a body's size (413) and the time it may
take to arrive (408), a request's nesting depth (`decode_request`, 400), the request target forwarded upstream
(`request_target`, 400), and what of a path may reach the log (`loggable`). The connection itself (heads on a
deadline, connections per address and in all, requests in progress) is bounded by the server,
`capture.request.http_server`.

Raw ASGI rather than Starlette request/response objects: the capture hot path must stay well under a
millisecond, and a streamed answer needs direct control of ``send`` and of the ``receive`` channel (a client
that hangs up is only visible there while the sidecar waits on upstream).
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote_from_bytes, unquote_to_bytes

import msgspec

from capture.request.upstream import UpstreamResponse

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
#: The client's own request id: never forwarded upstream, where the sidecar's id takes its place on every path
#: (`forward_headers`; `capture.request.passthrough` for the paths it does not capture).
CLIENT_REQUEST_ID: Final = b"x-request-id"
_RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"})
_JSON_SEP = (",", ":")
_BODY_UNREAD: Final = frozenset({408, 413})


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
    accepts (the standard library's message: the client's 400 quotes it), and for one nested past the
    interpreter's recursion limit (both decoders recurse; a RecursionError would be the sidecar's 500).
    """
    try:
        return _DECODER.decode(raw), _ENCODER.encode
    except msgspec.DecodeError:
        pass
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None
    try:
        return json.loads(raw), dumps
    except RecursionError:
        raise ValueError(_TOO_DEEP) from None


MAX_REQUEST_DEPTH: Final = 128  # nesting of arrays and objects a request may use (JSON schemas nest, not deeper)
_TOO_DEEP: Final = "nested too deeply"


def decode_request(raw: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """`decode_json` of a client's body, and ValueError when it nests arrays and objects deeper than
    `MAX_REQUEST_DEPTH`: what the sidecar walks of a request (the sampling contract's extra fields, the
    credential filter) must not recurse without bound, and no OpenAI request nests that deep."""
    doc, encode = decode_json(raw)
    if raw.count(b"[") + raw.count(b"{") > MAX_REQUEST_DEPTH and _deeper_than(doc, MAX_REQUEST_DEPTH):
        raise ValueError(f"nested deeper than {MAX_REQUEST_DEPTH} levels of arrays and objects")
    return doc, encode


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether `doc` holds an array or object `limit` levels inside its outermost one (walked without recursion)."""
    todo: list[tuple[Any, int]] = [(doc, 1)]
    while todo:
        node, depth = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                todo.append((child, depth + 1))
    return False


# C0 and C1 controls, DEL, and the bidirectional overrides and isolates (text that reorders what follows it).
_UNPRINTABLE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def loggable(text: str) -> str:
    """`text` (a path, a header value: the client's) as it may be written to the log: a control character, an
    ANSI escape or a line break would forge log lines or drive the operator's terminal, so each is written as
    its escape (``\\x1b``, ``\\x0a``), and a backslash as two, so the escapes cannot be forged either."""
    if text.isprintable() and "\\" not in text:
        return text
    return _UNPRINTABLE.sub(_escape, text.replace("\\", "\\\\"))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def error_body(message: str, *, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    """An OpenAI-format error document."""
    return dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


async def read_body(
    headers: dict[bytes, bytes], receive: Receive, limit: int, timeout_s: float, min_rate: float
) -> bytes:
    """The whole request body; `BadRequest` 413 past `limit` (a declared length is checked before reading), 408
    when it has not arrived whole in time: `timeout_s`, plus a second for every `min_rate` bytes received so far.
    A client that sends a byte now and then holds no request of the sidecar's much past `timeout_s`, whoever it
    is (a caller with a valid key too), and a large body on an honest link earns the time it needs (at most
    ``limit / min_rate`` more)."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"request body of {int(declared)} bytes exceeds the limit of {limit} bytes")
    loop = asyncio.get_running_loop()
    start = loop.time() + timeout_s
    try:
        async with asyncio.timeout_at(start) as deadline:
            return await _read_whole(receive, limit, lambda size: deadline.reschedule(start + size / min_rate))
    except TimeoutError:
        raise BadRequest(
            408, f"the request body did not arrive within {timeout_s:g} s plus a second per {min_rate:g} bytes"
        ) from None


async def _read_whole(receive: Receive, limit: int, received: Callable[[int], None]) -> bytes:
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
        received(size)


# What a forwarded target may hold unescaped: RFC 3986's pchar and "/", plus "%" so that the escapes a client
# sent reach upstream as it sent them (``%2F`` stays one segment); everything else is escaped.
_PATH_SAFE: Final = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE: Final = _PATH_SAFE + "?"
_BAD_ESCAPE: Final = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_DOT_SEGMENT: Final = re.compile(rb"(?:^|[/\\])\.{1,2}(?:[/\\]|$)")


def request_target(scope: Scope) -> str:
    """The target to ask upstream for (path and query, quoted), from what the client sent; `BadRequest` 400 for
    a target that is not a plain path.

    The raw target is the client's: uvicorn's h11 parser hands over ``%2F@10.0.0.5:9000/x`` as it came, and
    appended to upstream's base URL that names another host (the sidecar as an open proxy). So the target must
    begin with one ``/``; its decoded form (what upstream reads) must not begin with ``//`` or ``/\\`` nor
    hold a ``.`` or ``..`` segment (``/..%2F..`` climbs out of a base path's prefix); and it is re-quoted, so
    no byte that could end the path (``#``, a backslash, a space) reaches the URL unescaped.
    `capture.request.upstream.Upstream.url` then checks that the URL names upstream's own scheme, host and port.
    """
    raw: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    if not raw.startswith(b"/") or raw.startswith(b"//"):
        raise BadRequest(400, "the request target must be a path that begins with a single '/'")
    if _BAD_ESCAPE.search(raw):
        raise BadRequest(400, "the request target holds a '%' that is not a percent-escape")
    decoded = unquote_to_bytes(raw)
    if decoded.startswith((b"//", b"/\\")) or _DOT_SEGMENT.search(decoded):
        raise BadRequest(400, "the request target must not begin with '//' or '/\\' nor hold '.' or '..' segments")
    target = quote_from_bytes(raw, safe=_PATH_SAFE)
    query: bytes = scope.get("query_string") or b""
    if query:
        if _BAD_ESCAPE.search(query):
            raise BadRequest(400, "the query string holds a '%' that is not a percent-escape")
        target += "?" + quote_from_bytes(query, safe=_QUERY_SAFE)
    return target


# What RFC 9110 forbids in a field value, and aiohttp refuses to send (a ValueError, the sidecar's 500): h11 hands
# such values (an ESC, a DEL) over as they came.
_UNSENDABLE_VALUE: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def refuse_unsendable(headers: Iterable[tuple[bytes, bytes]]) -> None:
    """`BadRequest` 400 when a header that may be forwarded upstream (any but ours: the pass-through forwards
    even ``Accept-Encoding`` as it came) holds a control character; its name is said, not its value (a secret?)."""
    for name, value in headers:
        if _UNSENDABLE_VALUE.search(value) and not name.startswith(b"x-reprolane-"):
            raise BadRequest(400, f"header {loggable(name.decode('latin-1'))} holds a control character")


def forward_headers(headers: dict[bytes, bytes], request_id: bytes) -> list[tuple[bytes, bytes]]:
    """Client headers for a captured request upstream: secrets forwarded (never recorded), ours removed, and
    ``X-Request-Id`` set to the sidecar's own `request_id` in place of the client's.

    vLLM names the engine request after ``X-Request-Id`` (``chatcmpl-<id>``), which is how an envelope finds its
    schedule (`schemas.schedule_delivery`). The client's value is recorded as ``client_request_id`` and stays
    here: forwarded, it would name the engine request after a value the client chose, that two clients (or two
    retries) may share, and the join would pick the wrong request.
    """
    out = [
        (k, v)
        for k, v in headers.items()
        if k not in HOP_BY_HOP and not k.startswith(b"x-reprolane-") and k != CLIENT_REQUEST_ID
    ]
    out.append((b"accept-encoding", b"identity"))
    out.append((CLIENT_REQUEST_ID, request_id))
    return out


def response_headers(
    resp: UpstreamResponse, rid: bytes, client_request_id: bytes | None = None
) -> list[tuple[bytes, bytes]]:
    """Upstream's response headers for the client. An ``X-Request-Id`` upstream echoes (vLLM with
    ``--enable-request-id-headers``) is the sidecar's id (`forward_headers`): the client gets its own back."""
    out = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() not in _RESPONSE_DROP]
    if client_request_id is not None:
        out = [(k, client_request_id if k == CLIENT_REQUEST_ID else v) for k, v in out]
    out.append((REQUEST_ID_HEADER, rid))
    return out


async def send_json(
    send: Send, status: int, body: bytes, rid: bytes | None, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A complete non-streamed answer (``extra`` replaces the default JSON content type). A 408 or 413 closes the
    connection: the rest of that request's body is never read, so the connection cannot carry another."""
    headers = extra or [(b"content-type", b"application/json")]
    headers = [*headers, (b"content-length", str(len(body)).encode("ascii"))]
    if status in _BODY_UNREAD:
        headers.append((b"connection", b"close"))
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
