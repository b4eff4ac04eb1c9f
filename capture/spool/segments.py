"""The spool's segments as the event loop sees them: which files there are, where each pending record lies, which
seq comes next, and how the log grows (a batch written, a segment rolled) and shrinks (acks, reclaimed files).

In-memory state is touched on the event loop only; file IO runs in worker threads (`asyncio.to_thread`), or,
while the spool opens, in the thread that opens it (`capture.spool.recovery`). A segment is deleted only when
every record in it is acked and it is not the last one (invariants 2 and 3 of `capture.spool`).
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from capture.spool.disk_format import HEADER_SIZE, AckLog, delete_files, encode_record, new_segment_file, segment_name

DEFAULT_SEGMENT_BYTES = 16 * 1024 * 1024


@dataclass
class Segment:
    first_seq: int
    path: Path
    size: int
    unacked: int = 0


Location = tuple[int, int, int]
"""Where a pending record lies: (its segment's first seq, offset of the record header, header + payload size).

A tuple of ints, not an object pointing at its `Segment`: the index holds one per pending record (hundreds of
thousands while a sink is down), and the garbage collector stops tracking tuples of ints, where it would walk
every such object at each full collection (the benchmark found no difference either way at the sizes it ran:
BENCHMARKS.md)."""


class SegmentLog:
    """The segment files of one spool directory and the index of its pending records."""

    def __init__(self, directory: Path, *, segment_bytes: int) -> None:
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.segments: OrderedDict[int, Segment] = OrderedDict()
        self.index: OrderedDict[int, Location] = OrderedDict()  # pending seqs, oldest first
        self.next_seq = 1
        self.active_fd: int | None = None
        #: A write failed and the active segment could not be cut back to its last complete record yet.
        self.needs_cut_back = False
        self.lock_fd: int | None = None
        self.acks: AckLog | None = None
        #: Held while files may be deleted, and while pending records are read from them.
        self.reclaim_lock = asyncio.Lock()

    def active_segment(self) -> Segment:
        return next(reversed(self.segments.values()))

    def is_sealed(self, seg: Segment) -> bool:
        return seg is not self.active_segment()

    # ------------------------------------------------------------------ growing

    def add_batch(self, seg: Segment, first_seq: int, offsets: list[int], sizes: list[int]) -> int:
        """Index a batch just written to `seg` (the active segment) at `offsets` (its new end last); returns the
        bytes it added."""
        seg.size = offsets[-1]
        for i, size in enumerate(sizes):
            self.index[first_seq + i] = (seg.first_seq, offsets[i], size)
        seg.unacked += len(sizes)
        return sum(sizes)

    @staticmethod
    def write_sync(fd: int, at: int, first_seq: int, payloads: list[bytes]) -> list[int]:
        """Write the records at offset ``at`` of ``fd`` and fsync; returns their offsets and the new end.

        A short write is continued where it stopped (a signal, or the last free blocks); the write that can go
        no further raises (``ENOSPC``). On any failure the caller cuts the file back to ``at`` (`cut_back_sync`).
        """
        offsets: list[int] = []
        chunks: list[bytes] = []
        pos = at
        for i, payload in enumerate(payloads):
            rec = encode_record(first_seq + i, payload)
            offsets.append(pos)
            chunks.append(rec)
            pos += len(rec)
        data = memoryview(b"".join(chunks))
        done = 0
        while done < len(data):
            written = os.pwrite(fd, data[done:], at + done)
            if written <= 0:
                raise OSError(errno.ENOSPC, f"short write: {done} of {len(data)} bytes")
            done += written
        os.fsync(fd)
        offsets.append(pos)  # the new end of the segment
        return offsets

    @staticmethod
    def cut_back_sync(fd: int, end: int) -> None:
        """Make ``end`` the durable end of the segment again: whatever a failed write left after its last complete
        record goes (truncate + fsync). Raises when the disk refuses even that: the writer then cuts back again
        before its next write, so no record is ever written after a partial one."""
        os.ftruncate(fd, end)
        os.fsync(fd)

    def roll_sync(self, first_seq: int) -> None:
        """Seal the active segment and start ``first_seq``'s (blocking: only while opening)."""
        fd = new_segment_file(self.directory / segment_name(first_seq))
        done = self._install_segment(first_seq, fd)
        if done is not None:
            delete_files(self.directory, [done.path])

    async def roll(self, first_seq: int) -> None:
        """`roll_sync` for the writer: file IO in a thread, in-memory state on the loop."""
        fd = await asyncio.to_thread(new_segment_file, self.directory / segment_name(first_seq))
        done = self._install_segment(first_seq, fd)
        if done is not None:
            async with self.reclaim_lock:
                await asyncio.to_thread(delete_files, self.directory, [done.path])

    def _install_segment(self, first_seq: int, fd: int) -> Segment | None:
        """Make ``fd`` the active segment (the old one is fsynced already); return the old one if fully acked."""
        old = self.active_segment() if self.segments else None
        if self.active_fd is not None:
            os.close(self.active_fd)
        self.active_fd = fd
        if old is not None and old.first_seq == first_seq:
            return None  # reopening an empty last segment (a restart with nothing appended since)
        self.segments[first_seq] = Segment(first_seq, self.directory / segment_name(first_seq), HEADER_SIZE)
        if old is not None and old.unacked == 0:
            self.segments.pop(old.first_seq, None)
            return old
        return None

    # ------------------------------------------------------------------ shrinking

    def release(self, seqs: list[int]) -> tuple[int, list[Segment]]:
        """Take acknowledged seqs out of the index: the bytes freed, and the sealed segments left with none."""
        freed = 0
        reclaim: list[Segment] = []
        for seq in seqs:
            loc = self.index.pop(seq, None)
            if loc is None:
                continue
            first, _, size = loc
            freed += size
            seg = self.segments[first]
            seg.unacked -= 1
            if seg.unacked == 0 and self.is_sealed(seg):
                reclaim.append(seg)
        return freed, reclaim

    async def reclaim(self, segments: list[Segment]) -> None:
        """Forget and delete segments whose records are all acked."""
        async with self.reclaim_lock:
            for seg in segments:
                self.segments.pop(seg.first_seq, None)
            await asyncio.to_thread(delete_files, self.directory, [s.path for s in segments])

    def compact_acks(self, low: int) -> None:
        """Rewrite the ack log without the ranges of deleted segments (all below ``low``)."""
        assert self.acks is not None
        self.acks.rewrite([(lo, hi) for lo, hi in self.acks.ranges if hi >= low])

    def close_sync(self) -> None:
        """Close the files (the lock is released) and forget the in-memory state."""
        if self.active_fd is not None:
            os.close(self.active_fd)
            self.active_fd = None
        if self.acks is not None:
            self.acks.close()
            self.acks = None
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None
        self.segments.clear()
        self.index.clear()
