"""Guaranteed mode records a stream before any of it is relayed (issue #18, finding 5).

Before: stream chunks were relayed as they came and the envelope was written at the end, so with a full or
broken spool the whole answer reached the client unrecorded, and a crash mid-stream left no record at all.
Now a *started* record (outcome ``incomplete``) is durable before the request goes upstream; a spool that
cannot take it refuses the request with 503 before upstream sees it; the finished envelope follows at the end
and supersedes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response

from capture.errors import SpoolCorruptError, SpoolFullError, SpoolUnavailableError
from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.settings import CaptureSettings
from capture.spool import Spool
from capture.spool.disk_format import RECORD_HEADER, parse_segment_name, scan_segment
from schemas import CapturedError, CapturedOutput, Envelope
from schemas.envelope import decode_envelope
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import OUTPUT_IDS, FakeUpstream, serve
from tests.capture.support import CHAT, finished, sidecar, upstream_calls

REPO = Path(__file__).resolve().parents[3]
STREAM = {**CHAT, "stream": True}


@dataclass
class GatedUpstream(FakeUpstream):
    """Holds every chat request until `release` is set; `on_arrival` runs the moment one arrives."""

    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    on_arrival: Callable[[], None] | None = None

    async def chat(self, request: Request) -> Response:
        if self.on_arrival is not None:
            self.on_arrival()
        self.arrived.set()
        await self.release.wait()
        return await super().chat(request)


class RefusingSpool(FakeSpool):
    """A spool whose every append raises `error` (full, its disk failed, its writer stopped)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def append_payload(self, payload: bytes) -> None:
        raise self.error


@contextlib.asynccontextmanager
async def real_sidecar(
    spool: Spool, upstream: FakeUpstream, metrics: CaptureMetrics | None = None, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, CaptureMetrics]]:
    """A sidecar on a real `Spool` (its files on disk), in front of `upstream`."""
    metrics = metrics or CaptureMetrics()
    async with serve(upstream.app()) as up_url:
        settings = CaptureSettings(upstream=up_url, spool_max_bytes=1 << 24, **overrides)
        app = build_app(settings, spool=spool, metrics=metrics)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=20.0) as client:
            yield client, metrics


def on_disk(directory: Path) -> list[Envelope]:
    """Every record in the spool's segment files, read from the files themselves (not through the spool)."""
    out: list[Envelope] = []
    for path in sorted(directory.glob("*.seg")):
        first = parse_segment_name(path.name)
        assert first is not None
        data = path.read_bytes()
        for _seq, offset, size in scan_segment(path, first, tolerate_torn_tail=False).records:
            out.append(decode_envelope(data[offset + RECORD_HEADER.size : offset + size]))
    return out


def is_started(env: Envelope) -> bool:
    return isinstance(env.outcome, CapturedError) and env.outcome.error_type == "incomplete"


# ------------------------------------------------------------------ refused before upstream


@pytest.mark.parametrize(
    "error",
    [
        SpoolFullError("fake spool is full"),
        SpoolUnavailableError("fake spool: write failed (read-only file system)"),
        SpoolCorruptError("fake spool stopped accepting appends"),
    ],
    ids=["full", "disk-failed", "writer-stopped"],
)
async def test_a_spool_that_cannot_record_the_stream_refuses_it_with_503_before_upstream(error: Exception) -> None:
    async with sidecar(RefusingSpool(error)) as (client, upstream, spool, _m):
        resp = await client.post("/v1/chat/completions", json=STREAM)
    assert resp.status_code == 503
    assert resp.headers["content-type"].startswith("application/json")  # an OpenAI error, not a stream
    assert resp.json()["error"]["code"] == 503
    assert resp.json()["error"]["type"] == "service_unavailable"
    assert "The capital" not in resp.text
    assert upstream_calls(upstream, "/v1/chat/completions") == []
    assert spool.envelopes == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO], ids=["disk-full", "read-only", "io-error"])
async def test_a_real_spool_whose_disk_refuses_writes_refuses_the_stream_then_serves_once_it_takes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    metrics = CaptureMetrics()
    spool = Spool(tmp_path / "spool", max_bytes=1 << 24, metrics=metrics)
    upstream = FakeUpstream()
    real_pwrite = os.pwrite
    async with real_sidecar(spool, upstream, metrics) as (client, _m):

        def refused(fd: int, data: bytes, offset: int) -> int:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "pwrite", refused)
        resp = await client.post("/v1/chat/completions", json=STREAM)
        assert resp.status_code == 503
        assert "The capital" not in resp.text
        assert upstream_calls(upstream, "/v1/chat/completions") == []
        reason = "no_space" if code == errno.ENOSPC else "io_error"
        assert metrics.value("reprolane_capture_spool_write_failures_total", {"reason": reason}) == 1

        monkeypatch.setattr(os, "pwrite", real_pwrite)  # the disk takes writes again: no restart needed
        async with client.stream("POST", "/v1/chat/completions", json=STREAM) as sresp:
            raw = (await sresp.aread()).decode()
        assert sresp.status_code == 200
        assert raw.rstrip().endswith("data: [DONE]")
    started, done = on_disk(tmp_path / "spool")
    assert is_started(started)
    assert isinstance(done.outcome, CapturedOutput)


# ------------------------------------------------------------------ recorded before relayed


async def test_the_started_record_is_durable_before_upstream_is_asked_and_before_any_byte_is_relayed(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory, max_bytes=1 << 24)
    events: list[tuple[str, int]] = []
    upstream = GatedUpstream()
    upstream.on_arrival = lambda: events.append(("upstream", spool.depth))
    async with real_sidecar(spool, upstream) as (client, _m):
        spool.writer.on_fsync = lambda: events.append(("fsync", spool.depth))
        received: list[bytes] = []

        async def call() -> tuple[int, str]:
            async with client.stream("POST", "/v1/chat/completions", json=STREAM) as resp:
                async for chunk in resp.aiter_bytes():
                    received.append(chunk)
                return resp.status_code, resp.headers["x-reprolane-request-id"]

        task = asyncio.create_task(call())
        try:
            await asyncio.wait_for(upstream.arrived.wait(), 10)
            # Upstream holds the request: no byte of an answer exists, and the request is on disk already.
            held_events, held_on_disk, held_received = list(events), on_disk(directory), list(received)
        finally:
            upstream.release.set()  # (a failed assertion must not leave the server waiting on upstream)
        status, rid = await asyncio.wait_for(task, 10)
        assert not held_received
        assert held_events == [("fsync", 1), ("upstream", 1)]
        (started,) = held_on_disk
        assert is_started(started)
    assert status == 200
    assert b"".join(received).rstrip().endswith(b"data: [DONE]")
    first, done = on_disk(directory)
    assert first == started
    assert started.request_id == done.request_id == rid
    assert started.context.stream is True
    assert started.sampling is not None  # the contract is known before upstream answers...
    assert started.sampling == done.sampling
    assert started.request_body_sha256 == done.request_body_sha256
    assert started.prompt is None  # ...the prompt's token ids are not
    assert not started.replayable
    assert isinstance(done.outcome, CapturedOutput)
    assert list(done.outcome.choices[0].token_ids) == OUTPUT_IDS
    assert done.captured_at > started.captured_at


async def test_a_stream_upstream_refuses_and_a_client_that_hangs_up_each_supersede_their_started_record() -> None:
    body = {**STREAM, "messages": [{"role": "user", "content": "error500"}]}
    async with sidecar() as (client, _, spool, _m):
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 500
    done = finished(spool)
    assert isinstance(done.outcome, CapturedError)
    assert done.outcome.error_type == "upstream_error"
    assert done.outcome.timings.upstream_ms > 0.0  # timed up to the refusal's last byte

    body = {**STREAM, "messages": [{"role": "user", "content": "drip"}]}
    async with sidecar() as (client, _, spool, _m):
        async with client.stream("POST", "/v1/chat/completions", json=body) as sresp:
            async for line in sresp.aiter_lines():
                if line.startswith("data: {"):
                    break
        await spool.wait_for(2)
    done = finished(spool)
    assert isinstance(done.outcome, CapturedError)
    assert done.outcome.error_type == "client_disconnect"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_sidecar_killed_mid_stream_leaves_a_durable_incomplete_record(tmp_path: Path) -> None:
    """The real CLI sidecar, SIGKILLed while it relays a stream: its spool holds the request, marked incomplete."""
    directory, port = tmp_path / "spool", _free_port()
    body = {**STREAM, "messages": [{"role": "user", "content": "drip"}]}
    async with serve(FakeUpstream().app()) as up_url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from infra.cli.root import app; app()",
            "capture",
            "serve",
            "--upstream",
            up_url,
            "--port",
            str(port),
            "--spool-dir",
            str(directory),
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20.0) as client:
                for _ in range(300):
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get("/metrics")).status_code == 200:
                            break
                    await asyncio.sleep(0.1)
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    rid = resp.headers["x-reprolane-request-id"]
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):  # content reached the client: now the crash
                            proc.send_signal(signal.SIGKILL)
                            break
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            await proc.wait()
    spool = Spool(directory, max_bytes=1 << 24)
    await spool.open()
    try:
        records = [decode_envelope(e.payload) for e in await spool.pending(10)]
    finally:
        await spool.close()
    assert [r.request_id for r in records] == [rid]
    assert is_started(records[0])
    assert records[0].is_started_record


# ------------------------------------------------------------------ best_effort and non-streamed: unchanged


async def test_best_effort_streams_record_once_at_the_end_and_serve_when_the_spool_refuses() -> None:
    async with sidecar(mode="best_effort") as (client, _, spool, _m):
        async with client.stream("POST", "/v1/chat/completions", json=STREAM) as resp:
            raw = (await resp.aread()).decode()
        (env,) = await spool.wait_for(1)
    assert raw.rstrip().endswith("data: [DONE]")
    assert len(spool.envelopes) == 1
    assert isinstance(env.outcome, CapturedOutput)

    async with sidecar(FakeSpool(refuse_appends=True), mode="best_effort") as (client, upstream, _s, metrics):
        async with client.stream("POST", "/v1/chat/completions", json=STREAM) as resp:
            raw = (await resp.aread()).decode()
        for _ in range(100):
            if metrics.value("reprolane_capture_envelopes_dropped_total"):
                break
            await asyncio.sleep(0.01)
    assert resp.status_code == 200
    assert "The capital" in "".join(
        c["choices"][0]["delta"].get("content", "")
        for c in (json.loads(e[len("data: ") :]) for e in raw.split("\n\n") if e.startswith("data: {"))
    )
    assert len(upstream_calls(upstream, "/v1/chat/completions")) == 1
    assert metrics.value("reprolane_capture_envelopes_dropped_total") == 1


async def test_a_guaranteed_answer_that_is_not_streamed_is_still_recorded_once() -> None:
    async with sidecar() as (client, _, spool, _m):
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    (env,) = spool.envelopes
    assert isinstance(env.outcome, CapturedOutput)
