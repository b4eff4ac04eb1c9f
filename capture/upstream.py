"""The sidecar's client for the inference server: one pooled aiohttp session, errors translated here.

Why aiohttp and not httpx: on the hot path the upstream call *is* the sidecar's overhead. On the sequential
benchmark (small chat requests to a local ASGI upstream, uvloop) httpx.AsyncClient took far longer per call
than aiohttp, too long for the 1 ms p50 added-latency budget on its own; aiosonic, which advertises itself as
faster, spent more CPU per call than aiohttp with many calls in flight (BENCHMARKS.md has the figures).

Callers never see an aiohttp exception: connection failures become `UpstreamError`, read timeouts
`UpstreamTimeoutError`. No cookie jar: the one session serves all clients. Responses are not decompressed
(pass-through forwards bytes and Content-Encoding as they are; capture requests ask for ``identity``).
Cancelling a caller closes its connection, which is how an abandoned generation is aborted upstream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence

import aiohttp

from capture.errors import UpstreamError, UpstreamTimeoutError

HeaderList = Sequence[tuple[bytes, bytes]]
POOL_LIMIT = 512  # connections; sized for hundreds of concurrent generations through one sidecar


class UpstreamResponse:
    """Status, raw headers and body of one upstream answer (read it or stream it, once)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.raw_headers: tuple[tuple[bytes, bytes], ...] = resp.raw_headers

    def header(self, name: str, default: str) -> str:
        return self._resp.headers.get(name, default)

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc) from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc) from exc


class UpstreamCall:
    """The async context manager of one upstream request (a class rather than ``asynccontextmanager``: on the
    hot path the generator machinery is a noticeable part of the call's own cost)."""

    __slots__ = ("_pending", "_resp")

    def __init__(self, pending: Awaitable[aiohttp.ClientResponse]) -> None:
        self._pending = pending
        self._resp: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> UpstreamResponse:
        try:
            self._resp = await self._pending
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _translate(exc) from exc
        return UpstreamResponse(self._resp)

    async def __aexit__(self, *exc_info: object) -> None:
        resp = self._resp
        if resp is None:
            return
        if resp.content.at_eof():
            resp.release()  # fully read: the connection goes back to the pool
        else:
            resp.close()  # abandoned mid-body (client gone, timeout): drop it so upstream stops generating


class Upstream:
    """A pooled connection to one upstream base URL (start inside the event loop, close at shutdown)."""

    def __init__(self, base_url: str, *, timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        # Per read, like a stream needs: a generation may run for minutes as long as tokens keep coming.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, timeout_s), sock_read=timeout_s)

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=POOL_LIMIT, limit_per_host=POOL_LIMIT, keepalive_timeout=30.0)
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=min(10.0, self.timeout_s), sock_read=self.timeout_s
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=timeout,
                auto_decompress=False,
                # What the client did not send, upstream does not get either: no User-Agent of aiohttp's, no
                # Content-Type guessed for a body that came without one (vLLM refuses those; so must we).
                skip_auto_headers=("User-Agent", "Content-Type"),
                # One session serves every client: a cookie upstream sets for one client must never ride along on
                # another's request. Clients' own Cookie headers and upstream's Set-Cookie pass through untouched.
                cookie_jar=aiohttp.DummyCookieJar(),
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def request(
        self, method: str, target: str, *, body: bytes = b"", headers: HeaderList = (), timeout_s: float | None = None
    ) -> UpstreamCall:
        """One request: ``async with upstream.request(...) as resp`` (headers received inside the block)."""
        if self._session is None:
            raise UpstreamError("upstream client is not started")
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        return UpstreamCall(
            # A redirect is the client's to follow (or not), through the sidecar: `capture.passthrough.forward_as_is`
            # points its Location back at the sidecar.
            self._session.request(
                method, self.base_url + target, data=body or None, headers=hdrs, timeout=timeout, allow_redirects=False
            )
        )

    async def get_json(self, target: str, *, timeout_s: float = 5.0) -> tuple[int, object]:
        """GET a small JSON document (``/version``): status and parsed body (None when not JSON)."""
        async with self.request("GET", target, timeout_s=timeout_s) as resp:
            return resp.status, _json_or_none(await resp.read())

    async def post_json(self, target: str, body: bytes, *, timeout_s: float = 10.0) -> tuple[int, object]:
        """POST a small JSON document (``/tokenize``): status and parsed body (None when not JSON)."""
        async with self.request(
            "POST", target, body=body, headers=[(b"content-type", b"application/json")], timeout_s=timeout_s
        ) as resp:
            return resp.status, _json_or_none(await resp.read())


def _json_or_none(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _translate(exc: BaseException) -> UpstreamError:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UpstreamTimeoutError(f"upstream timed out: {type(exc).__name__}: {exc}")
    return UpstreamError(f"upstream unreachable or broken: {type(exc).__name__}: {exc}")
