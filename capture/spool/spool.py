"""`Spool`: the API of the local spool (its layout and invariants are `capture.spool`'s docstring).

The proxy appends (`append_payload`, awaited until the record is durable); the publisher reads what is pending
(`pending`, `wait_pending`) and acknowledges what Kafka and S3 both hold (`ack`). The work is done by the
parts this class owns: the writer task (`capture.spool.group_commit`), the segments and their index
(`capture.spool.segments`), opening (`capture.spool.recovery`) and the bound (`capture.spool.accounting`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from capture.errors import SpoolCorruptError
from capture.spool.accounting import SpoolBound
from capture.spool.disk_format import to_ranges
from capture.spool.group_commit import GroupCommitWriter, PendingAppend
from capture.spool.recovery import SpoolEntry, read_entries, recover
from capture.spool.segments import DEFAULT_SEGMENT_BYTES, SegmentLog

if TYPE_CHECKING:
    from capture.metrics import CaptureMetrics
    from schemas import Envelope

log = logging.getLogger(__name__)

_Bytes = bytes  # `Spool.bytes` (a property) shadows the builtin inside the class body


class Spool:
    """Append-only, group-committed, crash-safe spool of envelopes (see `capture.spool`)."""

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int,
        warn_ratio: float = 0.8,
        group_commit_ms: float = 2.0,
        linger_ms: float = 0.0,
        metrics: CaptureMetrics | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._segments = SegmentLog(self.directory, segment_bytes=segment_bytes)
        self._bound = SpoolBound(self.directory, max_bytes=max_bytes, warn_ratio=warn_ratio, metrics=metrics)
        self._has_pending = asyncio.Event()
        self._writer = GroupCommitWriter(
            self._segments,
            self._bound,
            self._has_pending,
            group_commit_s=group_commit_ms / 1000.0,
            linger_s=linger_ms / 1000.0,
            metrics=metrics,
        )
        self._ack_lock = asyncio.Lock()

    # ------------------------------------------------------------------ state

    @property
    def depth(self) -> int:
        """Records appended and not yet acknowledged."""
        return len(self._segments.index)

    @property
    def bytes(self) -> int:
        """Bytes of those records (record headers included)."""
        return self._bound.bytes

    @property
    def is_open(self) -> bool:
        return self._writer.running

    @property
    def writer(self) -> GroupCommitWriter:
        """The task that writes the appends: its ``linger_s``, ``fsync_count`` and ``on_fsync`` (tests count
        group commits with it) are the spool's."""
        return self._writer

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Recover from disk: every record appended and not acknowledged is pending again."""
        if self._writer.running:
            return
        self._bound.bytes = await asyncio.to_thread(recover, self._segments)
        self._bound.update_metrics(self.depth)
        if self._segments.index:
            self._has_pending.set()
            log.info("spool %s: recovered %d pending records (%d bytes)", self.directory, self.depth, self.bytes)
        self._writer.start()

    async def close(self) -> None:
        """Finish the appends already queued, then close the files. Pending records stay on disk."""
        if not self._writer.running:
            return
        try:
            await self._writer.stop()
        finally:
            await asyncio.to_thread(self._segments.close_sync)
            self._bound.bytes = 0

    # ------------------------------------------------------------------ producer side

    async def append(self, envelope: Envelope) -> None:
        """Append one envelope; returns once it is fsynced. Raises `SpoolFullError` at the bound."""
        await self.append_payload(envelope.canonical())

    async def append_payload(self, payload: _Bytes) -> None:
        """`append` for bytes already encoded canonically."""
        writer = self._writer
        if not writer.running:
            raise RuntimeError("spool is not open")
        if writer.failed is not None:
            raise SpoolCorruptError(f"spool {self.directory} stopped accepting appends: {writer.failed}")
        item = PendingAppend(payload, asyncio.get_running_loop().create_future())
        self._bound.reserve(item.size)
        writer.queue.put_nowait(item)
        await item.future

    # ------------------------------------------------------------------ publisher side

    async def pending(self, limit: int) -> list[SpoolEntry]:
        """Up to ``limit`` pending records, oldest first."""
        if limit <= 0:
            return []
        segments = self._segments
        async with segments.reclaim_lock:
            wanted: list[tuple[int, Path, int, int]] = []
            for seq, (first, offset, size) in segments.index.items():
                wanted.append((seq, segments.segments[first].path, offset, size))
                if len(wanted) >= limit:
                    break
            if not wanted:
                return []
            return await asyncio.to_thread(read_entries, wanted)

    async def wait_pending(self, max_wait_s: float) -> bool:
        """Wait up to ``max_wait_s`` seconds until something is pending; True when something is."""
        if self._segments.index:
            return True
        self._has_pending.clear()
        try:
            await asyncio.wait_for(self._has_pending.wait(), max_wait_s)
        except TimeoutError:
            pass
        return bool(self._segments.index)

    async def ack(self, seqs: Iterable[int]) -> None:
        """Durably acknowledge records; a segment whose records are all acked is deleted (not the last one)."""
        segments = self._segments
        wanted = sorted({s for s in seqs if s in segments.index})
        if not wanted:
            return
        async with self._ack_lock:
            assert segments.acks is not None
            await asyncio.to_thread(segments.acks.append, to_ranges(wanted))
            freed, reclaim = segments.release(wanted)
            self._bound.bytes -= freed
            self._bound.shrank(self.depth)
            if reclaim:
                await segments.reclaim(reclaim)
            if segments.acks.size > max(1024 * 1024, 64 * len(segments.segments)):
                await asyncio.to_thread(segments.compact_acks, next(iter(segments.segments)))
