"""The sidecar's ASGI application: routes, and the lifespan that owns the spool, publisher and upstream pool.

`build_app` wires what `capture.cli.serve` (or a test) built: the routes are Starlette's, the handlers on the
hot path are raw ASGI callables of `capture.proxy.CaptureProxy`. Startup opens the spool, starts the publisher
and asks upstream ``/version``; shutdown waits for background recordings, stops the publisher, closes the spool
and the upstream pool, in that order, so nothing accepted is lost on a clean stop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from capture.edge import Receive, Scope, Send
from capture.metrics import CONTENT_TYPE, CaptureMetrics
from capture.proxy import CaptureProxy
from capture.recorder import SpoolLike
from capture.runtime import RuntimeProbe, load_artifacts, load_runtime_file
from capture.settings import CaptureSettings
from capture.upstream import Upstream


class ManagedSpool(SpoolLike, Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...


class Startable(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class _Asgi:
    """Marks a handler as a raw ASGI app for Starlette's router (functions would be wrapped as endpoints)."""

    def __init__(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def build_app(
    settings: CaptureSettings,
    *,
    spool: ManagedSpool,
    metrics: CaptureMetrics | None = None,
    publisher: Startable | None = None,
) -> Starlette:
    """The sidecar app. Reads the manifest and runtime file now, so a bad file fails before serving."""
    metrics = metrics or CaptureMetrics()
    metrics.spool_capacity_bytes.set(settings.spool_max_bytes)
    runtime = RuntimeProbe(load_runtime_file(settings.runtime_path))
    proxy = CaptureProxy(
        settings,
        spool=spool,
        metrics=metrics,
        artifacts=load_artifacts(settings.manifest_path),
        runtime=runtime,
        upstream=Upstream(settings.upstream, timeout_s=settings.upstream_timeout_s),
    )

    async def metrics_endpoint(_: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await spool.open()
        if publisher is not None:
            await publisher.start()
        await proxy.upstream.start()
        await runtime.probe(proxy.upstream)
        try:
            yield
        finally:
            await proxy.drain()
            if publisher is not None:
                await publisher.stop()
            await spool.close()
            await proxy.upstream.close()

    routes: list[Any] = [
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/chat/completions", _Asgi(proxy.endpoint("chat.completions"))),
        Route("/v1/completions", _Asgi(proxy.endpoint("completions"))),
        Route("/{path:path}", _Asgi(proxy.passthrough)),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.proxy = proxy
    app.state.metrics = metrics
    return app
