"""What the edge fuzz tests send and how they judge an answer: hypothesis strategies of whole HTTP requests (method,
target, headers, body and its encoding, as raw bytes) and the checks every answer must pass.

The requests are raw bytes on a socket, not a client library's: a library would refuse most of what a hostile
client sends (control characters in a path, duplicate headers, a body that is not what its Content-Type says).
Keys are placeholders (``{bank}``, ``{attacker}``, ``{reader}``) filled in when a request is sent, so that the
strategies are the same whichever key file a sidecar reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from dataclasses import dataclass
from typing import Any, Final

from hypothesis import strategies as st

from tests.capture.request.cli_sidecar import HOST

CAPTURED: Final = ("/v1/chat/completions", "/v1/completions")
UVICORN_REFUSAL: Final = b"Invalid HTTP request received."
KEY_PLACEHOLDERS: Final = ("{bank}", "{attacker}", "{reader}")


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    target: bytes
    headers: tuple[tuple[str, bytes], ...]
    body: bytes
    chunked: bool

    def __repr__(self) -> str:  # hypothesis prints a failing example: long values shortened
        heads = ", ".join(f"({n!r}, {_short(v)})" for n, v in self.headers)
        return (
            f"FuzzRequest({self.method!r}, {_short(self.target)}, ({heads}), {_short(self.body)}, "
            f"chunked={self.chunked})"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis's printer of the failing example
        printer.text(repr(self))

    def wire(self, keys: dict[str, str]) -> bytes:
        """The request's bytes, each key placeholder replaced by its key."""
        lines = [self.method.encode("ascii") + b" " + self.target + b" HTTP/1.1", b"Host: sidecar"]
        for name, value in self.headers:
            for placeholder, key in keys.items():
                value = value.replace(placeholder.encode("ascii"), key.encode("ascii"))
            lines.append(name.encode("ascii") + b": " + value)
        if self.chunked:
            lines.append(b"Transfer-Encoding: chunked")
            body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in _pieces(self.body) if p) + b"0\r\n\r\n"
        else:
            lines.append(b"Content-Length: " + str(len(self.body)).encode("ascii"))
            body = self.body
        lines.append(b"Connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _short(raw: bytes, keep: int = 200) -> str:
    return repr(raw) if len(raw) <= keep else f"{raw[:keep]!r} + ... ({len(raw)} bytes)"


def _pieces(body: bytes, size: int = 700) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


# --- targets --------------------------------------------------------------------------------------------------------

_FRAGMENTS = st.sampled_from([
    "v1", "chat", "completions", "models", "tokenize", "detokenize", "responses", "health", "x",
    "/", "//", ".", "..", "%2F", "%2f", "%2e", "%2E%2E", "%00", "%0a", "%zz", "%", "%25", "@", ":", "\\", "%5C",
    "?", "?a=1&b=%zz", "#frag", ";", "~", "é", "\u202e", "\x00", "\x01", "\x1b[31m", "\x7f", "\t", " ", "%C3%A9",
])  # fmt: skip
_PREFIXES = st.sampled_from(["/", "/", "/", "//", "%2F@127.0.0.1:9/", "@127.0.0.1:9/", "\\\\", "/\\", "http://h/", ""])


@st.composite
def targets(draw: st.DrawFn) -> bytes:
    """A request target: a capture path (perhaps with a query or an escape), a pass-through path, or hostile."""
    kind = draw(st.sampled_from(["captured", "captured", "captured", "captured", "known", "built", "long"]))
    if kind == "captured":
        path = draw(st.sampled_from([*CAPTURED * 3, "/v1/chat%2Fcompletions", "/v1/completions/", "/v1//completions"]))
        query = draw(st.sampled_from(["", "", "?stream=true", "?a=%zz", "?x=" + "q" * 300]))
        return (path + query).encode("utf-8")
    if kind == "known":
        known = ["/v1/models", "/health", "/v1/responses", "/tokenize", "/version", "/metrics"]
        return draw(st.sampled_from(known)).encode("ascii")
    if kind == "long":
        return b"/" + b"a" * draw(st.integers(1000, 9000))
    parts = draw(st.lists(st.one_of(_FRAGMENTS, _FRAGMENTS, st.text(max_size=6)), max_size=10))
    text = draw(_PREFIXES) + "".join(parts)
    return text.replace("\r", "").replace("\n", "").replace(" ", "%20").encode("utf-8", "surrogatepass") or b"/"


# --- headers --------------------------------------------------------------------------------------------------------

_HEADER_NAMES = st.sampled_from([
    "X-Reprolane-Tenant", "X-Reprolane-Flag", "X-Reprolane-Workflow-Id", "X-Reprolane-Step", "X-Reprolane-Key",
    "X-Reprolane-Whatever", "X-Request-Id", "Authorization", "Content-Type", "Content-Encoding", "Accept-Encoding",
    "Cookie", "X-Forwarded-For", "Proxy-Authorization", "TE", "Keep-Alive",
])  # fmt: skip
_TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.!#$&'*+^`|~"
_VALUES = st.sampled_from([
    "acme-bank", "attacker", "default", "anonymous", "1", "true", "yes", "0", "-1", "9" * 1000, "loan-4711",
    "a" * 129, "a" * 128, "Bearer {bank}", "Bearer {attacker}", "Bearer {reader}", "{bank}", "{attacker}",
    "{reader}", "Bearer rlk_bank-1_wrongsecret", "Bearer rlk_", "rlk_bank-1_", "Bearer sk-upstream",
    "Basic Zm9vOmJhcg==", "bearer {bank}", "Bearer  {bank} ", "application/json", "application/json; charset=utf-16",
    "text/plain",
    "multipart/form-data; boundary=x", "gzip", "deflate", "br", "identity", "gzip, br", "chunked", "ünïcödé",
    "\x1b[2J", "a\tb", "\x00", "\x7f", "", " ",
])  # fmt: skip


@st.composite
def header_values(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    if kind < 6:
        return draw(_VALUES).encode("utf-8")
    if kind < 9:
        return draw(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200)).encode("ascii")
    raw = draw(st.binary(max_size=300))  # controls and bytes above 0x7f: a parser refuses most of these
    return raw.replace(b"\r", b"").replace(b"\n", b"")


#: The caller's credential: a key of the key file (most often, and first: hypothesis starts from the first
#: choice, so that keyed sidecars get past authentication), none, one of no role, or one that is not a key.
_CREDENTIALS = st.sampled_from([
    (("Authorization", b"Bearer {bank}"),), (), (("Authorization", b"Bearer {bank}"),),
    (("X-Reprolane-Key", b"{bank}"),), (("Authorization", b"Bearer {attacker}"),),
    (("Authorization", b"Bearer {reader}"),), (("Authorization", b"Bearer rlk_bank-1_nope"),),
    (("X-Reprolane-Key", b"{attacker}"), ("Authorization", b"Bearer sk-upstream")),
])  # fmt: skip


#: What the client says its body is: JSON first (vLLM refuses a body without it), then none or another type.
_CONTENT_TYPES = st.sampled_from([
    (("Content-Type", b"application/json"),), (), (("Content-Type", b"text/plain"),),
    (("Content-Type", b"application/json"), ("Content-Encoding", b"gzip")),
])  # fmt: skip
headers = st.lists(
    st.tuples(st.one_of(_HEADER_NAMES, _HEADER_NAMES, st.text(_TOKEN_CHARS, min_size=1, max_size=40)), header_values()),
    max_size=5,
)


# --- bodies ---------------------------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)
json_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip
_fields = st.one_of(json_values, st.sampled_from([0, 1, 2, 5, 20, 21, -1, 0.7, 1.0, True, False, "x", [], {}]))
_MESSAGES = st.one_of(
    st.just([{"role": "user", "content": "Hi"}]),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=40)}
        ),
        min_size=1,
        max_size=3,
    ),
    json_values,
)
_PROMPTS = st.one_of(
    st.just("Hi"),
    st.text(max_size=40),
    st.lists(st.text(max_size=10), min_size=1, max_size=3),
    st.lists(st.integers(0, 50_000), min_size=1, max_size=5),
    st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=3), min_size=1, max_size=3),
    json_values,
)
_SAMPLING = (
    "temperature", "top_p", "top_k", "seed", "max_tokens", "n", "stream", "logprobs", "top_logprobs",
    "stop", "stream_options", "echo", "return_token_ids", "presence_penalty", "logit_bias", "user",
)  # fmt: skip


_VALID: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**31), "n": st.just(1),
    "max_tokens": st.integers(0, 50), "stream": st.booleans(), "logprobs": st.sampled_from([0, 1, 5]),
    "top_logprobs": st.integers(0, 20), "echo": st.just(False), "stream_options": st.just({"include_usage": True}),
}  # fmt: skip


@st.composite
def openai_shaped(draw: st.DrawFn, *, valid: bool = False, chat: bool = True) -> dict[str, Any]:
    """A chat or completions request: the right shape, its fields' values valid (all of them when `valid`: one
    upstream serves) or anything at all."""
    if valid:
        doc: dict[str, Any] = {"model": "fake-model"}
        if chat:
            doc["messages"] = [{"role": "user", "content": draw(st.text(min_size=1, max_size=40))}]
        else:
            doc["prompt"] = draw(st.text(min_size=1, max_size=40))
        for name in draw(st.lists(st.sampled_from(sorted(_VALID)), max_size=5, unique=True)):
            doc[name] = draw(_VALID[name])
        if "messages" in doc and "logprobs" in doc:
            doc["logprobs"] = True
        return doc
    doc = {"model": draw(st.one_of(st.just("fake-model"), json_values))}
    if draw(st.booleans()):
        doc["messages"] = draw(_MESSAGES)
    else:
        doc["prompt"] = draw(_PROMPTS)
    for name in draw(st.lists(st.sampled_from(_SAMPLING), max_size=5, unique=True)):
        doc[name] = draw(st.one_of(_VALID.get(name, st.nothing()), _VALID.get(name, st.nothing()), _fields))
    if draw(st.integers(0, 3)) == 0:
        for name, value in draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)).items():
            doc.setdefault(name, value)
    return doc


def _nested(depth: int, opener: str) -> bytes:
    inner = '"x"'
    for _ in range(depth):
        inner = f"[{inner}]" if opener == "[" else f'{{"a":{inner}}}'
    return inner.encode("ascii")


_CONSTANT_BODIES = st.sampled_from([
    b"", b"{", b"null", b"[]", b"\"str\"", b"{}", b"\xff\xfe\x00", b"\xc3\x28", b"{\"model\":\"\xed\xa0\x80\"}",
    b'{"model":"fake-model","prompt":"\\ud800"}', b'{"model":"fake-model","prompt":"x","temperature":NaN}',
    b'{"model":"fake-model","prompt":"x","max_tokens":Infinity}', b'{"model":"fake-model","prompt":"x","seed":1e999}',
    b'{"model":"fake-model","prompt":"x","n":' + b"9" * 5000 + b"}", b'{"a":1,"a":2}', b"\x00" * 64,
    b'{"model":"fake-model","messages":[{"role":"user","content":"' + b"\\\\" * 3000 + b'"}]}',
])  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn, *, chat: bool = True) -> bytes:
    kind = draw(st.sampled_from([*["valid"] * 4, "shaped", "shaped", "json", "bytes", "constant", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=2000))
    if kind == "constant":
        return draw(_CONSTANT_BODIES)
    if kind == "deep":
        return _nested(draw(st.integers(100, 3000)), draw(st.sampled_from(["[", "{"])))
    doc = draw(openai_shaped(valid=kind == "valid", chat=chat)) if kind in ("valid", "shaped") else draw(json_values)
    text = json.dumps(doc, ensure_ascii=draw(st.booleans()), allow_nan=True)
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-8-sig", "utf-16", "utf-32", "gzip"]))
    if encoding == "gzip":
        return gzip.compress(text.encode("utf-8", "surrogatepass"), mtime=0)
    return text.encode(encoding, "surrogatepass")


@st.composite
def requests(draw: st.DrawFn) -> FuzzRequest:
    method = draw(st.sampled_from([*["POST"] * 8, "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "FOO"]))
    target = draw(targets())
    return FuzzRequest(
        method=method,
        target=target,
        headers=draw(_CREDENTIALS) + draw(_CONTENT_TYPES) + tuple(draw(headers)),
        body=draw(bodies(chat=b"chat" in target)) if method not in ("GET", "HEAD") or draw(st.booleans()) else b"",
        chunked=draw(st.integers(0, 9)) == 0,
    )


# --- the wire and the checks ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.headers!r}, {_short(self.body)})"

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-reprolane-request-id")


async def send_raw(port: int, request: bytes, timeout_s: float = 15.0) -> Answer:
    """Send `request` on a new connection and read its answer to the connection's end (chunked bodies joined)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), raw[:300]
    found: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        found[name.strip().lower()] = value.strip()
    if found.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return Answer(int(lines[0].split()[1]), found, body)


def _dechunk(raw: bytes) -> bytes:
    out, rest = [], raw
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(rest[:size])
        rest = rest[size + 2 :]
    return b"".join(out)


def is_uvicorn_refusal(answer: Answer) -> bool:
    """uvicorn's own plain-text 400 for what its parser cannot read (the app never saw the request)."""
    return (
        answer.status == 400
        and answer.headers.get("content-type", "").startswith("text/plain")
        and answer.body in (UVICORN_REFUSAL, b"")
    )


def assert_openai_error(answer: Answer, method: str) -> None:
    """A non-2xx of the sidecar's own is OpenAI's error document (a HEAD answer has no body to read)."""
    if method == "HEAD" or is_uvicorn_refusal(answer):
        return
    doc = json.loads(answer.body)
    assert isinstance(doc, dict), answer
    error = doc["error"]
    assert isinstance(error["message"], str), answer
    assert isinstance(error["type"], str), answer


@st.composite
def served_requests(draw: st.DrawFn) -> FuzzRequest:
    """A request upstream serves (a capture path, a key, a valid body) with a few of the edge's headers: so that
    a good share of the examples go the whole way, upstream and back, and are recorded."""
    target = draw(st.sampled_from(CAPTURED))
    extra = draw(st.lists(st.tuples(st.sampled_from(["X-Request-Id", "X-Reprolane-Step", "Accept"]), header_values()),
                          max_size=2))  # fmt: skip
    heads = (("Authorization", b"Bearer {bank}"), ("Content-Type", b"application/json"), *extra)
    doc = draw(openai_shaped(valid=True, chat=target == CAPTURED[0]))
    return FuzzRequest("POST", target.encode("ascii"), heads, json.dumps(doc).encode("utf-8"), draw(st.booleans()))


any_requests = st.one_of(requests(), served_requests())
