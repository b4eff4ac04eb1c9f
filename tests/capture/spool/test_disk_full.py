"""A disk that refuses a write (full, a short write, a failed fsync) costs the spool that batch, never a complete
record, and never a restart: the write is undone and the next append tries again (issue #18, finding 6)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from capture.errors import SpoolFullError, SpoolUnavailableError
from capture.metrics import CaptureMetrics
from capture.spool import Spool
from capture.spool.disk_format import SEGMENT_HEADER
from tests.factories import envelope


def payloads(prefix: str, n: int) -> list[bytes]:
    return [envelope(request_id=f"{prefix}-{i:03d}").canonical() for i in range(n)]


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


async def read_back(directory: Path) -> list[bytes]:
    """Every pending record of the spool in `directory`, as a restarted sidecar finds them."""
    spool = Spool(directory, max_bytes=1 << 26)
    await spool.open()
    try:
        return [e.payload for e in await spool.pending(10_000)]
    finally:
        await spool.close()


@pytest.fixture
def metrics() -> CaptureMetrics:
    return CaptureMetrics()


@pytest.fixture
async def spool(tmp_path: Path, metrics: CaptureMetrics) -> AsyncIterator[Spool]:
    s = Spool(tmp_path / "spool", max_bytes=1 << 26, metrics=metrics)
    await s.open()
    yield s
    await s.close()


def failures(metrics: CaptureMetrics, reason: str) -> float:
    return metrics.value("reprolane_capture_spool_write_failures_total", {"reason": reason})


@pytest.fixture
def disk_full_after(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``fill(n)``: the next ``pwrite`` writes only its first ``n`` bytes (what fits on the disk) and returns n;
    every ``pwrite`` after it raises ENOSPC, until the test calls ``fill(-1)`` (space is back)."""
    real = os.pwrite
    state = {"room": -1}

    def pwrite(fd: int, data: bytes, offset: int) -> int:
        room = state["room"]
        if room < 0:
            return real(fd, data, offset)
        if room == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        state["room"] = 0
        return real(fd, bytes(data[:room]), offset)

    def fill(room: int) -> None:
        state["room"] = room

    monkeypatch.setattr(os, "pwrite", pwrite)
    return fill


async def test_a_short_write_on_a_full_disk_is_undone_and_appends_resume_when_space_returns(
    spool: Spool, metrics: CaptureMetrics, disk_full_after: Callable[[int], None]
) -> None:
    """Before: a short write was taken for corruption and every append was refused until a restart."""
    before = payloads("before", 3)
    for payload in before:
        await spool.append_payload(payload)
    active = segment_files(spool.directory)[-1]
    size = active.stat().st_size

    disk_full_after(1000)  # the batch below gets 1000 bytes on disk, then the disk is full
    results = await asyncio.gather(*(spool.append_payload(p) for p in payloads("lost", 4)), return_exceptions=True)
    assert all(isinstance(r, SpoolFullError) for r in results), results
    assert active.stat().st_size == size  # cut back to the last complete record
    assert failures(metrics, "no_space") == 1
    with pytest.raises(SpoolFullError, match="no space"):  # still full: refused again, not stopped
        await spool.append_payload(b'{"still":"full"}')

    disk_full_after(-1)  # space is back
    after = payloads("after", 2)
    for payload in after:
        await spool.append_payload(payload)
    assert [e.payload for e in await spool.pending(100)] == before + after
    assert spool.depth == 5
    await spool.close()
    assert await read_back(spool.directory) == before + after


async def test_a_failed_fsync_is_undone_and_the_next_append_tries_again(
    spool: Spool, metrics: CaptureMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an EIO stopped every append until a restart."""
    await spool.append_payload(b'{"n":1}')
    size = segment_files(spool.directory)[-1].stat().st_size
    real_fsync, calls = os.fsync, {"n": 0}

    def fsync_fails_once(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_fails_once)
    with pytest.raises(SpoolUnavailableError, match="next append tries again"):
        await spool.append_payload(b'{"n":2}')
    assert segment_files(spool.directory)[-1].stat().st_size == size
    assert failures(metrics, "io_error") == 1
    await spool.append_payload(b'{"n":3}')
    assert [e.payload for e in await spool.pending(10)] == [b'{"n":1}', b'{"n":3}']
    await spool.close()
    assert await read_back(spool.directory) == [b'{"n":1}', b'{"n":3}']


async def test_a_cut_back_the_disk_refuses_is_done_before_the_next_write(
    spool: Spool, monkeypatch: pytest.MonkeyPatch, disk_full_after: Callable[[int], None]
) -> None:
    """A failed write whose partial records could not be cut back: the next write must not land before them
    (before: the truncate's error was ignored, a shorter record was written over the start of the partial ones,
    and the complete old records left behind it made the segment unreadable at the next start)."""
    first = b'{"first":' + b"1" * 200 + b"}"
    await spool.append_payload(first)
    lost = [b'{"lost":' + str(i).encode() * 300 + b"}" for i in range(6)]
    real_ftruncate, calls = os.ftruncate, {"n": 0}

    def ftruncate_fails_once(fd: int, length: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_ftruncate(fd, length)

    monkeypatch.setattr(os, "ftruncate", ftruncate_fails_once)
    disk_full_after(1200)  # three and a half of the six records reach the disk
    results = await asyncio.gather(*(spool.append_payload(p) for p in lost), return_exceptions=True)
    assert all(isinstance(r, SpoolFullError) for r in results), results
    disk_full_after(-1)
    await spool.append_payload(b'{"small":1}')
    await spool.close()
    assert await read_back(spool.directory) == [first, b'{"small":1}']


async def test_a_segment_header_cut_short_by_a_full_disk_is_written_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rolling to a new segment on a full disk: a header written in part was kept, and the next roll wrote
    records after the partial header (the spool could not be opened again)."""
    directory = tmp_path / "spool"
    spool = Spool(directory, max_bytes=1 << 26, segment_bytes=512)
    await spool.open()
    real = os.pwrite
    state = {"cut": True}

    def header_cut_short(fd: int, data: bytes, offset: int) -> int:
        if state["cut"] and bytes(data) == SEGMENT_HEADER:
            state["cut"] = False
            return real(fd, bytes(data[:3]), offset)
        return real(fd, data, offset)

    kept = payloads("roll", 2)
    await spool.append_payload(kept[0])  # fills the first segment past 512 bytes: the next append rolls
    monkeypatch.setattr(os, "pwrite", header_cut_short)
    with pytest.raises(SpoolFullError):
        await spool.append_payload(b'{"refused":1}')
    await spool.append_payload(kept[1])
    await spool.close()
    assert await read_back(directory) == kept


async def test_an_ack_cut_short_by_a_full_disk_keeps_the_ack_log_aligned(
    spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial ack record left every later ack misaligned: after a restart they were all lost (republished)."""
    for payload in payloads("ack", 4):
        await spool.append_payload(payload)
    seqs = [e.seq for e in await spool.pending(10)]
    real_write, state = os.write, {"cut": True}

    def write_cut_short(fd: int, data: bytes) -> int:
        if state["cut"]:
            state["cut"] = False
            return real_write(fd, bytes(data[:7]))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write_cut_short)
    with pytest.raises(OSError, match="short write"):
        await spool.ack(seqs[:1])
    await spool.ack(seqs[:1])  # the publisher acks again
    await spool.ack(seqs[2:3])
    await spool.close()
    assert await read_back(spool.directory) == [payloads("ack", 4)[i] for i in (1, 3)]


async def test_bound_refusals_and_spooled_envelopes_are_counted(tmp_path: Path, metrics: CaptureMetrics) -> None:
    """The dashboards and the ReprolaneSpoolFull alert read these; nothing counted them before."""
    spool = Spool(tmp_path / "spool", max_bytes=2048, metrics=metrics)
    await spool.open()
    try:
        await spool.append_payload(b"x" * 1000)
        with pytest.raises(SpoolFullError):
            await spool.append_payload(b"y" * 1500)
    finally:
        await spool.close()
    assert metrics.value("reprolane_capture_envelopes_spooled_total") == 1
    assert metrics.value("reprolane_capture_spool_full_total") == 1


async def test_a_run_of_failed_writes_logs_once_and_its_end_once(
    spool: Spool, disk_full_after: Callable[[int], None], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="capture.spool")
    disk_full_after(0)
    for i in range(5):
        with pytest.raises(SpoolFullError):
            await spool.append_payload(b'{"i":%d}' % i)
    disk_full_after(-1)
    await spool.append_payload(b'{"ok":1}')
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed" in m and "undone" in m for m in messages) == 1
    assert sum("succeed again after 5 failed batches" in m for m in messages) == 1


def test_a_disk_the_kernel_fills_cuts_a_write_short_and_the_spool_resumes_without_restart(tmp_path: Path) -> None:
    """No patching: the kernel writes what fits under ``RLIMIT_FSIZE`` and refuses the rest, in a process of
    its own (the limit would hold for every file pytest writes)."""
    directory = tmp_path / "spool"
    repo = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-m", "tests.capture.spool.file_size_limit_worker", str(directory), str(20_000)],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split()
    assert "resumed" in lines, done.stdout
    assert "refused" in lines, done.stdout
    refused = int(lines[lines.index("refused") + 1])
    assert refused > 5  # records were written before the limit was reached
    appended = [int(lines[i + 1]) for i, word in enumerate(lines) if word == "appended"]
    assert appended == [*range(refused), *range(refused + 1, refused + 4)]
    found = [json.loads(payload)["n"] for payload in asyncio.run(read_back(directory))]
    assert found == appended
