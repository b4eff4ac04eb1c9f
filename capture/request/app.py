"""The sidecar's ASGI application: routes, and the lifespan that owns the spool, publisher and upstream pool.

`build_app` wires what `capture.cli.serve` (or a test) built. The capture paths (each endpoint's in
`capture.protocol.endpoints.ENDPOINTS`) are dispatched by `CaptureApp` straight to the raw ASGI handlers of
`capture.request.proxy.CaptureProxy`; everything else
(``/metrics``, pass-through, lifespan) goes through a Starlette app: its router and its two always-on middlewares
showed up in the sidecar's CPU profile of the capture paths, where they do nothing useful (BENCHMARKS.md "Capture
sidecar").

Startup opens the spool, starts the publisher, asks upstream ``/version`` and starts the shadow sender (when
``shadow_upstream`` is set, `capture.request.shadow`); shutdown waits for background recordings, lets queued shadows
go out (a few seconds at most), stops the publisher, closes the spool and the upstream pool, in that order, so
nothing accepted is lost on a clean stop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from capture.metrics import CONTENT_TYPE, CaptureMetrics
from capture.protocol.endpoints import ENDPOINTS
from capture.request.edge import Receive, Scope, Send
from capture.request.envelope_writer import SpoolLike
from capture.request.proxy import CaptureProxy
from capture.request.runtime import (
    Artifacts,
    RuntimeProbe,
    load_adapters,
    load_artifacts,
    load_runtime_file,
    load_sampling_defaults,
)
from capture.request.shadow import build_shadow
from capture.request.upstream import Upstream
from capture.settings import CaptureSettings


class ManagedSpool(SpoolLike, Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...


class Startable(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class CaptureApp:
    """The ASGI app: exact-path dispatch of the capture endpoints, Starlette for the rest."""

    def __init__(
        self,
        hot: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]],
        rest: Starlette,
        odd: Callable[[Scope, Receive, Send], Awaitable[None]],
    ) -> None:
        self._hot = hot
        self._odd = odd
        self.rest = rest
        self.state = rest.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._hot.get(scope["path"])
            path = scope["path"]
            if handler is None and (not path.startswith("/") or "\n" in path):
                # A target without a leading "/" (h11 hands ``@host:port/x`` over as it came) matches no route,
                # nor does a path with a line feed inside (``/%0ax``: Starlette's ``{path:path}`` is ``.*``): the
                # pass-through answers them, a 400 in OpenAI's format (`capture.request.edge.request_target`) or
                # upstream's.
                handler = self._odd
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.rest(scope, receive, send)


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
) -> CaptureApp:
    """The sidecar app. Reads the manifest and runtime file and hashes the adapters now, so a bad file fails before
    serving."""
    metrics = metrics or CaptureMetrics()
    metrics.spool_capacity_bytes.set(settings.spool_max_bytes)
    runtime = RuntimeProbe(load_runtime_file(settings.runtime_path))
    proxy = CaptureProxy(
        settings,
        spool=spool,
        metrics=metrics,
        artifacts=Artifacts.of_adapters(load_artifacts(settings.manifest_path), load_adapters(settings.lora_modules)),
        sampling_defaults=load_sampling_defaults(
            settings.manifest_path, settings.upstream_generation_config, settings.upstream_override_generation_config
        ),
        runtime=runtime,
        upstream=Upstream(settings.upstream, timeout_s=settings.upstream_timeout_s),
    )

    shadow = build_shadow(settings, spool=spool, metrics=metrics)
    proxy.writer.shadow = shadow

    async def metrics_endpoint(_: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await spool.open()
        if publisher is not None:
            await publisher.start()
        await proxy.upstream.start()
        await runtime.probe(proxy.upstream)
        if shadow is not None:
            await shadow.start()
        try:
            yield
        finally:
            await proxy.drain()
            if shadow is not None:
                await shadow.stop()
            if publisher is not None:
                await publisher.stop()
            await spool.close()
            await proxy.upstream.close()

    routes: list[Any] = [
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/{path:path}", _Asgi(proxy.passthrough)),
    ]
    rest = Starlette(routes=routes, lifespan=lifespan)
    rest.state.proxy = proxy
    rest.state.metrics = metrics
    hot = {protocol.path: proxy.endpoint(name) for name, protocol in ENDPOINTS.items()}
    return CaptureApp(hot, rest, proxy.passthrough)
