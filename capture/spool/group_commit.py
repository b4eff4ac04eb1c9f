"""The spool's writer: appends queued by many requests, written by one task in one ``write`` + one ``fsync``.

An append returns only after its record's bytes *and* their file's growth are fsynced (invariant 1 of
`capture.spool`). Which appends share a write: by default those that arrive while the loop keeps adding to the
queue (at most ``group_commit_ms``), so a lone appender does not wait; with ``linger_ms`` (best_effort, where no
client waits for the spool) every ``linger_ms`` after the first, which spares the CPU an fsync per envelope at
a steady moderate load (BENCHMARKS.md); under a full load both form large batches.

A write the disk refuses (a full disk, a short write, a failed fsync) is undone: the active segment is cut back
to its last complete record (truncate + fsync; if even that fails, again before the next write, so no record
is ever written after a partial one), the batch is refused (`SpoolFullError` when the disk has no space,
`SpoolUnavailableError` otherwise), ``spool_write_failures_total{reason}`` counts it and the next batch tries
again: the spool recovers by itself when space returns. Only an error that is not the disk's (a bug) stops all
appends (`SpoolCorruptError`) rather than risk a record that is not where the index says.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from capture.errors import SpoolCorruptError, SpoolFullError, SpoolUnavailableError
from capture.spool.accounting import SpoolBound
from capture.spool.disk_format import encode_record
from capture.spool.segments import SegmentLog

if TYPE_CHECKING:
    from capture.metrics import CaptureMetrics

log = logging.getLogger(__name__)

_MAX_BATCH = 4096
_RECORD_OVERHEAD = len(encode_record(0, b""))  # length, CRC and seq of one record


@dataclass
class PendingAppend:
    """One append waiting for its write: the payload and the future its appender awaits."""

    payload: bytes
    future: asyncio.Future[None]
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = _RECORD_OVERHEAD + len(self.payload)  # = len(encode_record(seq, payload)), without a CRC pass


class GroupCommitWriter:
    """The one task that writes a spool's appends, in batches (start it once the spool is open)."""

    def __init__(
        self,
        segments: SegmentLog,
        bound: SpoolBound,
        has_pending: asyncio.Event,
        *,
        group_commit_s: float,
        linger_s: float,
        metrics: CaptureMetrics | None = None,
    ) -> None:
        self._segments = segments
        self._bound = bound
        self._has_pending = has_pending
        self.group_commit_s = group_commit_s
        #: > 0: the writer waits this long after a batch's first append before writing it.
        self.linger_s = linger_s
        #: Called after every fsync of a segment (tests count group commits with it).
        self.on_fsync: Callable[[], None] | None = None
        self.fsync_count = 0
        self.failed: BaseException | None = None  # set when a write failed for a bug's sake: appends are refused
        self.queue: asyncio.Queue[PendingAppend] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._metrics = metrics
        self._failing = 0  # failed batches since the last write that succeeded

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._write_loop(), name="spool-writer")

    async def stop(self) -> bool:
        """Write what is queued, then end the task; False when it was not running."""
        task, self._task = self._task, None
        if task is None:
            return False
        self.queue.put_nowait(PendingAppend(b"", asyncio.get_running_loop().create_future()))  # wake-up sentinel
        await task
        return True

    async def _write_loop(self) -> None:
        while True:
            first = await self.queue.get()
            batch = [first]
            if self.linger_s > 0 and first.payload:  # (an empty payload is stop()'s wake-up: no waiting)
                await asyncio.sleep(self.linger_s)
            elif self.group_commit_s > 0:
                await self._gather_window()
            while len(batch) < _MAX_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            items = [p for p in batch if p.payload]
            stop = len(items) != len(batch)
            if items:
                await self._commit(items)
            if stop and self.queue.empty():
                return

    async def _gather_window(self) -> None:
        """Let appends that are about to arrive join this fsync: yield to the loop while the queue keeps growing,
        at most `group_commit_s`. A lone appender pays one loop turn, not the whole window (a fixed sleep
        measured slower at every concurrency here: appends queued during an fsync already share the next)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.group_commit_s
        size = self.queue.qsize()
        while loop.time() < deadline:
            await asyncio.sleep(0)
            grown = self.queue.qsize()
            if grown == size:
                return
            size = grown

    async def _commit(self, items: list[PendingAppend]) -> None:
        segments, bound = self._segments, self._bound
        directory = segments.directory
        size = sum(p.size for p in items)
        bound.reserved -= size
        if self.failed is not None:
            for p in items:
                _settle(p.future, SpoolCorruptError(f"spool {directory} stopped accepting appends"))
            return
        first_seq = segments.next_seq
        segments.next_seq += len(items)
        try:
            if segments.needs_cut_back:
                await self._cut_back()
            if segments.active_segment().size >= segments.segment_bytes:
                await segments.roll(first_seq)
            seg = segments.active_segment()
            assert segments.active_fd is not None
            offsets = await asyncio.to_thread(
                segments.write_sync, segments.active_fd, seg.size, first_seq, [p.payload for p in items]
            )
        except OSError as exc:  # the disk: undo the write, refuse this batch, let the next one try again
            segments.next_seq = first_seq
            await self._undo(exc, len(items))
            refusal = _refusal(directory, exc)
            for p in items:
                _settle(p.future, refusal)
            return
        except Exception as exc:  # a bug: stop rather than risk a record that is not where the index says
            segments.next_seq = first_seq
            self.failed = exc
            log.exception("spool %s: write of %d records failed; appends stopped", directory, len(items))
            for p in items:
                _settle(p.future, SpoolCorruptError(f"spool {directory}: write failed, appends stopped: {exc!r}"))
            return
        if self._failing:
            log.info("spool %s: writes succeed again after %d failed batches", directory, self._failing)
            self._failing = 0
        bound.bytes += segments.add_batch(seg, first_seq, offsets, [p.size for p in items])
        self.fsync_count += 1
        if self.on_fsync is not None:
            self.on_fsync()
        if self._metrics is not None:
            self._metrics.envelopes_spooled_total.inc(len(items))
        bound.grew(len(segments.index))
        self._has_pending.set()
        for p in items:
            _settle(p.future, None)

    async def _cut_back(self) -> None:
        """Cut the active segment back to its last complete record (raises OSError when the disk refuses)."""
        segments = self._segments
        assert segments.active_fd is not None
        await asyncio.to_thread(segments.cut_back_sync, segments.active_fd, segments.active_segment().size)
        segments.needs_cut_back = False

    async def _undo(self, exc: OSError, records: int) -> None:
        """After a failed write: cut the active segment back (or mark it to be cut back before the next write),
        count the failure, and log the first of a run of them."""
        segments = self._segments
        try:
            await self._cut_back()
        except OSError as cut_exc:
            segments.needs_cut_back = True
            log.error(
                "spool %s: cutting a failed write back failed too (%s); retried before the next write",
                segments.directory,
                cut_exc,
            )
        if self._metrics is not None:
            self._metrics.spool_write_failures_total.labels(_reason(exc)).inc()
        if not self._failing:
            log.error(
                "spool %s: write of %d records failed (%s); undone, those appends are refused and the next ones "
                "try again",
                segments.directory,
                records,
                exc,
            )
        self._failing += 1


_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def _reason(exc: OSError) -> str:
    return "no_space" if exc.errno in _NO_SPACE else "io_error"


def _refusal(directory: Path, exc: OSError) -> SpoolUnavailableError:
    if exc.errno in _NO_SPACE:
        return SpoolFullError(f"spool {directory}: no space left on device ({exc}); the next append tries again")
    return SpoolUnavailableError(f"spool {directory}: write failed ({exc}); undone, the next append tries again")


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
