"""The spool: durable appends with group commit, recovery, torn tails, corruption, the bound, acks."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from capture.errors import SpoolCorruptError, SpoolFullError
from capture.metrics import CaptureMetrics
from capture.spool import Spool
from capture.spool.disk_format import encode_record
from capture.spool.segments import SegmentLog
from schemas import Envelope
from tests.factories import envelope


def envelopes(n: int, prefix: str = "req") -> list[Envelope]:
    return [envelope(request_id=f"{prefix}-{i:05d}") for i in range(n)]


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


@pytest.fixture
def make_spool(tmp_path: Path) -> Callable[..., Spool]:
    def make(**kwargs: object) -> Spool:
        kwargs.setdefault("max_bytes", 64 * 1024 * 1024)
        return Spool(tmp_path / "spool", **kwargs)  # type: ignore[arg-type]

    return make


@pytest.fixture
async def spool(make_spool: Callable[..., Spool]) -> AsyncIterator[Spool]:
    s = make_spool()
    await s.open()
    yield s
    await s.close()


async def test_append_then_recover_round_trip(make_spool: Callable[..., Spool]) -> None:
    items = envelopes(10)
    spool = make_spool()
    await spool.open()
    for env in items:
        await spool.append(env)
    assert spool.depth == 10
    written_bytes = spool.bytes
    await spool.close()

    again = make_spool()
    await again.open()
    try:
        assert again.depth == 10
        assert again.bytes == written_bytes
        entries = await again.pending(100)
        assert [e.seq for e in entries] == list(range(1, 11))
        assert [e.payload for e in entries] == [env.canonical() for env in items]
        assert [e.seq for e in await again.pending(3)] == [1, 2, 3]
    finally:
        await again.close()


async def test_concurrent_appends_share_fsyncs(
    make_spool: Callable[..., Spool], monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = make_spool(group_commit_ms=2.0)
    await spool.open()
    real_fsync = os.fsync
    fsyncs = 0

    def counting_fsync(fd: int) -> None:
        nonlocal fsyncs
        fsyncs += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    try:
        await asyncio.gather(*(spool.append(env) for env in envelopes(100)))
        assert spool.depth == 100
        assert 1 <= spool.writer.fsync_count <= 10, spool.writer.fsync_count
        assert fsyncs <= 10, fsyncs  # real fsync calls, files and directory included
    finally:
        await spool.close()


async def test_linger_writes_spaced_appends_together_and_each_returns_after_the_fsync(
    make_spool: Callable[..., Spool],
) -> None:
    spool = make_spool(linger_ms=300.0)
    await spool.open()
    synced: list[int] = []
    spool.writer.on_fsync = lambda: synced.append(spool.depth)
    try:
        appends = []
        for env in envelopes(10):  # 2 ms apart, as best_effort recordings at ~500 requests/s
            appends.append(asyncio.create_task(spool.append(env)))
            await asyncio.sleep(0.002)
        assert not any(task.done() for task in appends)  # nothing returns before its fsync
        await asyncio.gather(*appends)
        assert synced == [10]  # one write and one fsync for the ten
    finally:
        await spool.close()


async def test_close_writes_what_is_queued_and_an_idle_close_does_not_linger(make_spool: Callable[..., Spool]) -> None:
    loop = asyncio.get_running_loop()
    spool = make_spool(linger_ms=200.0)
    await spool.open()
    started = loop.time()
    await spool.close()  # nothing queued: the close wake-up itself does not wait out the linger
    assert loop.time() - started < 0.15

    spool = make_spool(linger_ms=200.0)
    await spool.open()
    append = asyncio.create_task(spool.append(envelope(request_id="last")))
    await asyncio.sleep(0)
    await spool.close()
    assert append.done()
    assert append.exception() is None
    again = make_spool()
    await again.open()
    try:
        assert [e.payload for e in await again.pending(10)] == [envelope(request_id="last").canonical()]
    finally:
        await again.close()


async def test_append_returns_only_after_fsync(spool: Spool) -> None:
    synced_depths: list[int] = []
    spool.writer.on_fsync = lambda: synced_depths.append(spool.depth)
    await spool.append(envelope(request_id="one"))
    assert synced_depths == [1]


async def test_torn_tail_is_truncated_and_not_served(
    make_spool: Callable[..., Spool], caplog: pytest.LogCaptureFixture
) -> None:
    spool = make_spool()
    await spool.open()
    for env in envelopes(5):
        await spool.append(env)
    await spool.close()
    last = segments(spool.directory)[-1]
    good_size = last.stat().st_size
    with last.open("ab") as fh:  # a crash half-way through writing record 6
        fh.write(encode_record(6, envelope(request_id="torn").canonical())[:-7])

    caplog.set_level(logging.WARNING, logger="capture.spool")
    again = make_spool()
    await again.open()
    try:
        assert again.depth == 5
        assert [e.seq for e in await again.pending(10)] == [1, 2, 3, 4, 5]
        assert last.stat().st_size == good_size
        assert any("torn tail" in r.getMessage() and str(last) in r.getMessage() for r in caplog.records)
        await again.append(envelope(request_id="after"))
        assert [e.seq for e in await again.pending(10)][-1] == 6
    finally:
        await again.close()


async def test_torn_tail_of_zeros_is_truncated(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool()
    await spool.open()
    for env in envelopes(3):
        await spool.append(env)
    await spool.close()
    with segments(spool.directory)[-1].open("ab") as fh:  # file grew, data never reached the disk
        fh.write(b"\0" * 4096)
    again = make_spool()
    await again.open()
    try:
        assert again.depth == 3
    finally:
        await again.close()


async def test_corruption_in_the_middle_names_file_and_offset(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool()
    await spool.open()
    for env in envelopes(5):
        await spool.append(env)
    second = (await spool.pending(5))[1]
    await spool.close()
    seg = segments(spool.directory)[-1]
    data = bytearray(seg.read_bytes())
    first_payload = envelopes(1)[0].canonical()
    record_offset = 8 + len(encode_record(1, first_payload))  # the header, then record 1, then record 2
    assert second.seq == 2
    data[record_offset + 16 + 10] ^= 0xFF  # flip a payload byte of record 2
    seg.write_bytes(bytes(data))

    with pytest.raises(SpoolCorruptError) as info:
        await make_spool().open()
    assert str(seg) in str(info.value)
    assert f"offset {record_offset}" in str(info.value)


async def test_corrupt_tail_of_a_sealed_segment_is_an_error(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool(segment_bytes=2048)
    await spool.open()
    for env in envelopes(12):
        await spool.append(env)
    await spool.close()
    first = segments(spool.directory)[0]
    assert len(segments(spool.directory)) > 2
    data = bytearray(first.read_bytes())
    data[-3] ^= 0xFF  # the last record of a sealed segment: was fsynced, so this is not a torn write
    first.write_bytes(bytes(data))
    with pytest.raises(SpoolCorruptError, match=str(first)):
        await make_spool(segment_bytes=2048).open()


async def test_bound_refuses_appends_and_warns_once(
    make_spool: Callable[..., Spool], caplog: pytest.LogCaptureFixture
) -> None:
    size = len(encode_record(0, envelope(request_id="req-00000").canonical()))
    metrics = CaptureMetrics()
    spool = make_spool(max_bytes=10 * size, warn_ratio=0.5, metrics=metrics)
    caplog.set_level(logging.WARNING, logger="capture.spool")
    await spool.open()
    try:
        for env in envelopes(10):
            await spool.append(env)
        assert spool.bytes == 10 * size
        with pytest.raises(SpoolFullError, match="full"):
            await spool.append(envelope(request_id="req-00010"))
        assert spool.depth == 10
        assert metrics.value("reprolane_capture_spool_depth") == 10
        assert metrics.value("reprolane_capture_spool_bytes") == 10 * size
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "full" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "50%" in warnings[0].getMessage()

        await spool.ack([1, 2])
        await spool.append(envelope(request_id="req-00010"))  # room again
        assert spool.depth == 9
    finally:
        await spool.close()


async def test_concurrent_appends_cannot_overshoot_the_bound(make_spool: Callable[..., Spool]) -> None:
    size = len(encode_record(0, envelope(request_id="req-00000").canonical()))
    spool = make_spool(max_bytes=5 * size)
    await spool.open()
    try:
        results = await asyncio.gather(*(spool.append(env) for env in envelopes(8)), return_exceptions=True)
        assert sum(r is None for r in results) == 5
        assert all(isinstance(r, SpoolFullError) for r in results if r is not None)
        assert spool.bytes <= spool.max_bytes
    finally:
        await spool.close()


async def test_ack_reclaims_whole_segments(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool(segment_bytes=8192)  # ~3 records of ~2.3 KB per segment
    await spool.open()
    try:
        for env in envelopes(20):
            await spool.append(env)
        segs = segments(spool.directory)
        assert len(segs) >= 4
        entries = await spool.pending(100)
        first_segment_seqs = [entries[0].seq]
        await spool.ack(first_segment_seqs)  # one record of a segment holding two or more: nothing reclaimed
        assert segments(spool.directory) == segs
        await spool.ack(e.seq for e in entries)
        assert spool.depth == 0
        assert spool.bytes == 0
        assert segments(spool.directory) == segs[-1:]  # only the active segment is kept
    finally:
        await spool.close()


async def test_restart_after_acks_returns_only_unacked(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool(segment_bytes=4096)
    await spool.open()
    for env in envelopes(10):
        await spool.append(env)
    await spool.ack([1, 2, 3, 4, 7])
    await spool.close()

    again = make_spool(segment_bytes=4096)
    await again.open()
    try:
        assert [e.seq for e in await again.pending(100)] == [5, 6, 8, 9, 10]
        await again.append(envelope(request_id="new"))
        assert [e.seq for e in await again.pending(100)] == [5, 6, 8, 9, 10, 11]
    finally:
        await again.close()


async def test_seqs_are_never_reused_after_everything_was_acked(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool()
    await spool.open()
    for env in envelopes(3):
        await spool.append(env)
    await spool.ack([1, 2, 3])
    await spool.close()
    for _ in range(2):  # twice: a restart with nothing appended in between must keep the position too
        again = make_spool()
        await again.open()
        assert again.depth == 0
        await again.close()
    again = make_spool()
    await again.open()
    try:
        await again.append(envelope(request_id="fresh"))
        assert [e.seq for e in await again.pending(10)] == [4]
    finally:
        await again.close()


async def test_torn_ack_log_tail_only_republishes(make_spool: Callable[..., Spool]) -> None:
    spool = make_spool()
    await spool.open()
    for env in envelopes(4):
        await spool.append(env)
    await spool.ack([1, 2])
    await spool.close()
    with (spool.directory / "acks.log").open("ab") as fh:
        fh.write(b"\x03\0\0\0\0\0\0\0\x03\0")  # half an ack record: a crash during ack
    again = make_spool()
    await again.open()
    try:
        assert [e.seq for e in await again.pending(10)] == [3, 4]
    finally:
        await again.close()


async def test_a_second_owner_is_refused(spool: Spool, make_spool: Callable[..., Spool]) -> None:
    with pytest.raises(SpoolCorruptError, match="held by another process"):
        await make_spool().open()


async def test_disk_full_refuses_the_batch_and_recovers(spool: Spool, monkeypatch: pytest.MonkeyPatch) -> None:
    real_pwrite = os.pwrite

    def full_disk(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(SpoolFullError, match="no space"):
        await spool.append(envelope(request_id="nospace"))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    await spool.append(envelope(request_id="after-space-freed"))
    assert [e.seq for e in await spool.pending(10)] == [1]


async def test_a_bug_in_the_write_stops_appends_instead_of_hanging(
    spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error that is not the disk's stops the spool (a disk's error is undone and retried:
    tests/capture/spool/test_disk_full.py)."""

    def broken_writer(*_args: object) -> list[int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(SegmentLog, "write_sync", staticmethod(broken_writer))
    with pytest.raises(SpoolCorruptError, match="write failed"):
        await spool.append(envelope(request_id="bug"))
    monkeypatch.undo()
    with pytest.raises(SpoolCorruptError, match="stopped accepting appends"):
        await spool.append(envelope(request_id="bug-again"))
    assert spool.depth == 0
