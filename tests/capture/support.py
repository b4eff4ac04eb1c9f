"""The sidecar under test: its app served on a loopback socket in front of a fake vLLM-shaped upstream; and
`drained`, the publisher tests' wait for a real spool to empty."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.settings import CaptureSettings
from capture.spool import Spool
from schemas import CapturedError, Envelope
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import FakeUpstream, serve

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@contextlib.asynccontextmanager
async def sidecar(
    spool: FakeSpool | None = None, upstream: FakeUpstream | None = None, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeUpstream, FakeSpool, CaptureMetrics]]:
    """A client of a sidecar built from `overrides` (settings), its upstream, its spool and its metrics."""
    upstream = upstream or FakeUpstream()
    spool = spool or FakeSpool()
    metrics = CaptureMetrics()
    async with serve(upstream.app(), graceful_s=0.5) as up_url:
        settings = CaptureSettings(upstream=up_url, spool_max_bytes=1 << 20, **overrides)
        app = build_app(settings, spool=spool, metrics=metrics)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            yield client, upstream, spool, metrics
    assert spool.opened
    assert spool.closed


def upstream_calls(upstream: FakeUpstream, path: str) -> list[dict[str, Any]]:
    """The JSON bodies upstream received on `path`, in order."""
    return [s.body or {} for s in upstream.seen if s.path == path]


def only(spool: FakeSpool) -> Envelope:
    """The one envelope in `spool` (fails when there is not exactly one)."""
    assert len(spool.envelopes) == 1, spool.envelopes
    return spool.envelopes[0]


def finished(spool: FakeSpool) -> Envelope:
    """The finished envelope of a guaranteed stream, the one request in `spool`: its started record (outcome
    ``incomplete``, the same request id) was spooled first, before the request went upstream."""
    assert len(spool.envelopes) == 2, spool.envelopes
    started, done = spool.envelopes
    assert isinstance(started.outcome, CapturedError)
    assert started.outcome.error_type == "incomplete"
    assert started.request_id == done.request_id
    assert not (isinstance(done.outcome, CapturedError) and done.outcome.error_type == "incomplete")
    return done


async def drained(spool: Spool, within_s: float = 15.0) -> None:
    """Wait until the publisher has acknowledged every record of `spool`; fail after `within_s`."""
    deadline = asyncio.get_running_loop().time() + within_s
    while spool.depth:
        assert asyncio.get_running_loop().time() < deadline, f"spool not drained: {spool.depth} pending"
        await asyncio.sleep(0.02)
