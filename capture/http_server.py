"""The sidecar's HTTP server: uvicorn with its parser pinned, its concurrency bounded and a deadline on heads.

uvicorn bounds what it is told to (``limit_concurrency``: connections or requests in progress, 503 above it;
``timeout_keep_alive``: an idle connection between requests) but nothing bounds a client that opens a
connection and sends half a request head: uvicorn arms no timer until a first response is complete, so such a
connection is held for good, and a few thousand of them exhaust the sidecar's file descriptors and its
``limit_concurrency``. `head_deadline_protocol` wraps uvicorn's protocol class of the chosen parser: a
connection with no request in progress for ``request_head_timeout_s`` (nothing sent, part of a head, or idle
after an answer) is closed. Once the head is whole the request is the app's, which bounds the body's arrival
itself (`capture.edge.read_body`, 408).

The parser is pinned (``httptools`` by default, a dependency of the package through ``uvicorn[standard]``) so
that the dev install and the image parse request targets alike: h11 hands a target such as
``%2F@host:port/x`` to the app as it came, httptools refuses it (`capture.edge.request_target` refuses it
under either).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import uvicorn

from capture.settings import CaptureSettings

Parser = Literal["httptools", "h11"]


def protocol_class(parser: Parser) -> type[asyncio.Protocol]:
    """uvicorn's protocol class of `parser` (ImportError when that parser is not installed: never a fallback)."""
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def head_deadline_protocol(parser: Parser, timeout_s: float) -> type[asyncio.Protocol]:
    """`protocol_class` of `parser`, closing a connection that has had no request in progress for `timeout_s`."""
    base: Any = protocol_class(parser)

    class HeadDeadline(base):  # type: ignore[misc]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()  # the next request's head has as long as the first one's

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_timer = self.loop.call_later(timeout_s, self._head_deadline_passed)

        def _disarm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_deadline_passed(self) -> None:
            self._head_timer = None
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # no request of this connection is in progress
                if not self.transport.is_closing():
                    self.transport.close()

    HeadDeadline.__name__ = HeadDeadline.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadline


def uvicorn_config(app: Any, settings: CaptureSettings) -> uvicorn.Config:
    """The server's configuration for `app` under `settings` (`capture.cli.serve` runs it)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="auto",
        http=head_deadline_protocol(settings.http_parser, settings.request_head_timeout_s),
        limit_concurrency=settings.max_concurrency,
        log_level="warning",
        access_log=False,
        lifespan="on",
        backlog=2048,
        proxy_headers=False,  # the sidecar never reads the client address: no middleware call per request
    )
