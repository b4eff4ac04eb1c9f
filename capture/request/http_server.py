"""The sidecar's HTTP server: uvicorn with its parser pinned, and connections bounded so that nobody without a
key can hold the sidecar.

uvicorn's own bounds are not enough: ``limit_concurrency`` counts open connections, so a few thousand that send
nothing (or half a request head) make it answer 503 to everyone, and uvicorn arms no timer until a first
response is complete, so such a connection is held for good. `edge_protocol` wraps uvicorn's protocol class of
the chosen parser instead:

- a connection with no request in progress for ``request_head_timeout_s`` (nothing sent, part of a head, or
  idle after an answer) is closed;
- with an `Admission` (what `uvicorn_config` gives it), every connection is entered in one
  `capture.request.connection_limits.ConnectionTable`: ``max_connections`` in all, ``max_anonymous_per_address`` of one
  address that have presented no valid key; a newcomer closes the oldest anonymous connection in its way, or is
  answered 503 when every connection in its way presented one. A request head that proves its caller
  (`capture.request.auth.Authenticator.vouches_for`, checked as the head is read, before the request's task starts)
  makes its connection one that is never shed;
- ``max_concurrency`` bounds the requests in progress (503 above it, in OpenAI's format); uvicorn's
  ``limit_concurrency`` is not used, since it counts connections too.

Once a head is whole the request is the app's, which bounds the body's arrival itself (`capture.request.edge.read_body`,
408): a caller with a valid key that trickles a body is cut too.

The parser is pinned (``httptools`` by default, a dependency of the package through ``uvicorn[standard]``) so
that the dev install and the image parse request targets alike: h11 hands a target such as
``%2F@host:port/x`` to the app as it came, httptools refuses it (`capture.request.edge.request_target` refuses it
under either).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import uvicorn

from capture.request.auth import Authenticator
from capture.request.connection_limits import ConnectionTable, source_of
from capture.request.edge import error_body, send_json
from capture.settings import CaptureSettings

Parser = Literal["httptools", "h11"]


def protocol_class(parser: Parser) -> type[asyncio.Protocol]:
    """uvicorn's protocol class of `parser` (ImportError when that parser is not installed: never a fallback)."""
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


@dataclass(frozen=True, slots=True)
class Admission:
    """What the connections of one server share: the table of open connections, who vouches for a request head,
    which peers are not capped per address, and the bound on requests in progress."""

    table: ConnectionTable[Any]
    vouches_for: Callable[[dict[bytes, bytes], Any], bool]
    uncapped_peer: Callable[[str], bool]
    max_requests: int

    @classmethod
    def from_settings(cls, settings: CaptureSettings, authenticator: Authenticator) -> Admission:
        return cls(
            ConnectionTable(settings.max_connections, settings.max_anonymous_per_address),
            authenticator.vouches_for,
            authenticator.trusted_peer,
            settings.max_concurrency,
        )


_FULL: Final = error_body(
    "the sidecar holds as many connections as it may, all of callers that presented a valid key: try again",
    type_="service_unavailable",
    code=503,
)
_BUSY: Final = error_body(
    "the sidecar has as many requests in progress as it may: try again", type_="service_unavailable", code=503
)
_FULL_RESPONSE: Final = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(_FULL)
    + _FULL
)


def edge_protocol(parser: Parser, head_timeout_s: float, admission: Admission | None = None) -> type[asyncio.Protocol]:
    """`protocol_class` of `parser`, closing a connection that has had no request in progress for
    `head_timeout_s`, and, with `admission`, admitting connections and requests under its bounds."""
    base: Any = protocol_class(parser)

    class EdgeProtocol(base):  # type: ignore[misc]
        edge_admission: Admission | None = admission  # shared by every connection of the server
        _head_timer: asyncio.TimerHandle | None = None
        _admitted = False
        _vouched = False
        _vetted: object = None  # the last request cycle whose head was looked at
        app: Any  # what uvicorn calls for a request: `_bounded_app` with admission
        _app: Any = None  # uvicorn's app, which `_bounded_app` calls

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if admission is not None:
                self._app, self.app = self.app, self._bounded_app

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if admission is not None and not self._admit(admission):
                return
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            if self._admitted and admission is not None:
                admission.table.close(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if admission is None or cycle is None or cycle is self._vetted or self._vouched or not self._admitted:
                return
            self._vetted = cycle  # a new request head is whole: is it a caller's?
            if admission.vouches_for(dict(cycle.scope["headers"]), self.client):
                self._vouched = True
                admission.table.vouched(self)
            else:
                admission.table.request_started(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if admission is not None and self._admitted and not self._vouched:
                admission.table.request_finished(self)
            self._arm_head_deadline()  # the next request's head has as long as the first one's

        def _admit(self, admission: Admission) -> bool:
            host = self.client[0] if self.client else None
            source = None if host is None or admission.uncapped_peer(host) else source_of(host)
            shed = admission.table.open(self, source)
            if shed is None:  # every connection in the way presented a key: this one waits its turn
                self.transport.write(_FULL_RESPONSE)
                self.transport.close()
                return False
            self._admitted = True
            for other in shed:
                other._shed()
            return True

        def _shed(self) -> None:
            self._admitted = False  # the table forgot it already
            self._disarm_head_deadline()
            if not self.transport.is_closing():
                self.transport.close()

        async def _bounded_app(self, scope: Any, receive: Any, send: Any) -> None:
            if admission is not None and len(self.tasks) > admission.max_requests:
                await send_json(send, 503, _BUSY, None)
                return
            await self._app(scope, receive, send)

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_deadline_passed)

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

    EdgeProtocol.__name__ = EdgeProtocol.__qualname__ = f"Edge{base.__name__}"
    return EdgeProtocol


#: The protocol without admission (the head deadline alone), as tests of the app without the server's caps use it.
head_deadline_protocol = edge_protocol


def uvicorn_config(app: Any, settings: CaptureSettings, authenticator: Authenticator | None = None) -> uvicorn.Config:
    """The server's configuration for `app` under `settings` (`capture.cli.serve` runs it); `authenticator` says
    whose connections are served first (the app's own; built from `settings` when not given)."""
    admission = Admission.from_settings(settings, authenticator or Authenticator.from_settings(settings))
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="auto",
        http=edge_protocol(settings.http_parser, settings.request_head_timeout_s, admission),
        limit_concurrency=None,  # counts connections: `Admission` bounds connections and requests instead
        log_level="warning",
        access_log=False,
        lifespan="on",
        backlog=2048,
        proxy_headers=False,  # the peer's address is the socket's: no X-Forwarded-For moves a caller to another address
    )
