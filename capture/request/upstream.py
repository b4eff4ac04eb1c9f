"""The sidecar's client for the inference server: one pooled aiohttp session, errors translated here.

Why aiohttp and not httpx: on the hot path the upstream call *is* the sidecar's overhead. On the sequential
benchmark (small chat requests to a local ASGI upstream, uvloop) httpx.AsyncClient took far longer per call
than aiohttp, too long for the 1 ms p50 added-latency budget on its own; aiosonic, which advertises itself as
faster, spent more CPU per call than aiohttp with many calls in flight (BENCHMARKS.md has the figures).

Callers never see an aiohttp exception: connection failures become `UpstreamError`, read timeouts
`UpstreamTimeoutError`. No cookie jar: the one session serves all clients. Responses are not decompressed
(pass-through forwards bytes and Content-Encoding as they are; capture requests ask for ``identity``).
Cancelling a caller closes its connection, which is how an abandoned generation is aborted upstream.

Every request goes to upstream's own scheme, host and port, whatever its target says (`Upstream.url`): the URL is
built from its parts, never by pasting a target after the base URL, and a target that would name anything else
is refused before a connection is made.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Final

import aiohttp
from yarl import URL

from capture.errors import CaptureError, UpstreamError, UpstreamTimeoutError

HeaderList = Sequence[tuple[bytes, bytes]]
POOL_LIMIT = 512  # connections; sized for hundreds of concurrent generations through one sidecar
# A target as `capture.request.edge.request_target` quotes it: an origin-form path and query of URL characters only.
_QUOTED_TARGET: Final = re.compile(r"/(?!/)[A-Za-z0-9\-._~!$&'()*+,;=:@%/?]*")
_URL_CACHE_LIMIT: Final = 64  # the sidecar's own few targets (the capture paths, /tokenize, ...)


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
        self._base = URL(self.base_url)
        if not self._base.absolute or self._base.scheme not in ("http", "https"):
            raise CaptureError(f"upstream must be an http(s) URL, not {base_url!r}")
        self._urls: dict[str, URL] = {}
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

    def url(self, target: str) -> URL:
        """The URL of `target` (a quoted origin-form path and query, as `capture.request.edge.request_target` makes
        them) on upstream: its base URL's path, then the target's. ValueError when `target` is not such a path, or the
        URL would name another scheme, host or port than upstream's."""
        if _QUOTED_TARGET.fullmatch(target) is None:
            raise ValueError(f"not a quoted path of upstream's: {target!r}")
        base = self._base
        path, _, query = target.partition("?")
        url = URL.build(
            scheme=base.scheme,
            user=base.raw_user,
            password=base.raw_password,
            host=base.host_subcomponent or "",
            port=base.explicit_port,
            path=base.raw_path.rstrip("/") + path,
            query_string=query,
            encoded=True,
        )
        if (url.scheme, url.host, url.port) != (base.scheme, base.host, base.port):
            raise ValueError(f"target {target!r} would leave upstream {self.base_url}")
        return url

    def _own_url(self, target: str) -> URL:
        url = self.url(target)
        if len(self._urls) < _URL_CACHE_LIMIT:
            self._urls[target] = url
        return url

    def request(
        self,
        method: str,
        target: str | URL,
        *,
        body: bytes = b"",
        headers: HeaderList = (),
        timeout_s: float | None = None,
    ) -> UpstreamCall:
        """One request: ``async with upstream.request(...) as resp`` (headers received inside the block).

        `target` is one of the sidecar's own paths (``/v1/completions``, ``/tokenize``: their URLs are built once),
        or a URL `url` made of a client's target. ValueError for a path that is not upstream's, before anything
        is sent."""
        if self._session is None:
            raise UpstreamError("upstream client is not started")
        url = target if isinstance(target, URL) else self._urls.get(target) or self._own_url(target)
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        return UpstreamCall(
            # A redirect is the client's to follow (or not), through the sidecar:
            # `capture.request.passthrough.forward_as_is` points its Location back at the sidecar.
            self._session.request(method, url, data=body or None, headers=hdrs, timeout=timeout, allow_redirects=False)
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
