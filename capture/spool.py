"""The local spool: an append-only log on disk that holds every envelope until Kafka *and* S3 have it.

Layout of ``directory``::

    LOCK                         flock'ed while a process has the spool open (one owner at a time)
    00000000000000000001.seg     segment, named by the seq of its first record; rolled at `segment_bytes`
    00000000000000004097.seg     ... the last segment is the only one ever written to
    acks.log                     append-only log of acknowledged seq ranges

Segment: ``b"RLSPOOL" + u8 version`` then records ``u32 length | u32 crc | u64 seq | payload`` (little endian),
``payload`` = ``envelope.canonical()``, ``crc`` = CRC32 (zlib) over the seq bytes and the payload.
Ack log: the same 8-byte header (``b"RLACKS"`` + version) then ``u64 first | u64 last | u32 crc`` records.

Invariants (what makes it correct):

1. `append` returns only after the record's bytes *and* their file's growth are fsynced. Records of concurrent
   appends are written by one writer task in one `write` + one `fsync` (group commit); the HTTP response is
   released after that, so an envelope a client was answered for is on disk. Which appends share a write: by
   default those that arrive while the loop keeps adding to the queue (at most ``group_commit_ms``), so a lone
   appender does not wait; with ``linger_ms`` (best_effort, where no client waits for the spool) every
   ``linger_ms`` after the first: at 400-1000 requests/s an fsync per envelope cost the best_effort sidecar
   14-17% more CPU per request than one per 10 ms (BENCHMARKS.md); under a full load both form large batches.
2. Seqs increase by one per record, across segments and restarts. The last segment is never deleted, so its
   name (or its last record) always tells the next seq: an old ack can never match a new record.
3. A record is pending until its seq is in the ack log, and the ack log is fsynced before `ack` returns.
   A segment is deleted only when every record in it is acked and it is not the last one.
4. Opening scans every segment. A record that fails its length or CRC check is:
   - a *torn tail* when it lies in the last segment and no valid record follows it: the bytes were never
     fsynced, hence never acknowledged to a client; they are truncated and one WARNING line says so;
   - *corruption* anywhere else (a sealed segment, or a valid record follows): `SpoolCorruptError` naming the
     file and the offset. Nothing is skipped silently: the operator moves the file aside on purpose.
   The ack log tolerates a torn tail the same way (a lost ack only means a duplicate publish).
5. On open, a fresh segment is started (a file that took a crash is never appended to again) and the ack log
   is rewritten without the ranges of deleted segments (tmp + fsync + rename + fsync of the directory).
6. The bound: `bytes` (pending record bytes, headers included, plus appends in flight) never exceeds
   `max_bytes`; an append that would cross it raises `SpoolFullError` at once. Disk use can exceed it by up to
   one segment of acked records that share a file with pending ones.

All file IO runs in worker threads (`asyncio.to_thread`); in-memory state is touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from capture.errors import SpoolCorruptError, SpoolFullError
from capture.spool_format import (
    HEADER_SIZE,
    SEGMENT_SUFFIX,
    AckLog,
    ScanResult,
    delete_files,
    encode_record,
    new_segment_file,
    parse_segment_name,
    read_record,
    scan_segment,
    segment_name,
    to_ranges,
)

if TYPE_CHECKING:
    from capture.metrics import CaptureMetrics
    from schemas import Envelope

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 16 * 1024 * 1024
_Bytes = bytes  # `Spool.bytes` (a property) shadows the builtin inside the class body
_MAX_BATCH = 4096
_RECORD_OVERHEAD = len(encode_record(0, b""))  # length, CRC and seq of one record


@dataclass(frozen=True)
class SpoolEntry:
    """One pending record: its seq (for `Spool.ack`) and the canonical envelope bytes."""

    seq: int
    payload: bytes


@dataclass
class _Segment:
    first_seq: int
    path: Path
    size: int
    unacked: int = 0


_Location = tuple[int, int, int]
"""Where a pending record lies: (its segment's first seq, offset of the record header, header + payload size).

A tuple of ints, not an object pointing at its `_Segment`: the index holds one per pending record (hundreds of
thousands while a sink is down), and the garbage collector stops tracking tuples of ints, where it would walk
every such object at each full collection. (No difference measured at ~40k pending records: BENCHMARKS.md.)"""


@dataclass
class _Pending:
    payload: bytes
    future: asyncio.Future[None]
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = _RECORD_OVERHEAD + len(self.payload)  # = len(encode_record(seq, payload)), without a CRC pass


class Spool:
    """Append-only, group-committed, crash-safe spool of envelopes (see the module docstring)."""

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
        self.warn_ratio = warn_ratio
        self.group_commit_s = group_commit_ms / 1000.0
        #: > 0: the writer waits this long after a batch's first append before writing it (see invariant 1).
        self.linger_s = linger_ms / 1000.0
        self.segment_bytes = segment_bytes
        self._metrics = metrics
        #: Called after every fsync of a segment (tests count group commits with it).
        self.on_fsync: Callable[[], None] | None = None
        self.fsync_count = 0

        self._segments: OrderedDict[int, _Segment] = OrderedDict()
        self._index: OrderedDict[int, _Location] = OrderedDict()  # pending seqs, oldest first
        self._bytes = 0
        self._reserved = 0  # bytes of appends queued but not yet written
        self._next_seq = 1
        self._warned = False
        self._full_logged = False
        self._active_fd: int | None = None
        self._lock_fd: int | None = None
        self._acks: AckLog | None = None
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._ack_lock = asyncio.Lock()
        self._reclaim_lock = asyncio.Lock()
        self._has_pending = asyncio.Event()
        self._failed: BaseException | None = None

    # ------------------------------------------------------------------ state

    @property
    def depth(self) -> int:
        """Records appended and not yet acknowledged."""
        return len(self._index)

    @property
    def bytes(self) -> int:
        """Bytes of those records (record headers included)."""
        return self._bytes

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Recover from disk: every record appended and not acknowledged is pending again."""
        if self._writer is not None:
            return
        await asyncio.to_thread(self._open_sync)
        self._update_metrics()
        if self._index:
            self._has_pending.set()
            log.info("spool %s: recovered %d pending records (%d bytes)", self.directory, self.depth, self.bytes)
        self._writer = asyncio.create_task(self._write_loop(), name="spool-writer")

    async def close(self) -> None:
        """Finish the appends already queued, then close the files. Pending records stay on disk."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        self._queue.put_nowait(_Pending(b"", asyncio.get_running_loop().create_future()))  # wake-up sentinel
        try:
            await writer
        finally:
            await asyncio.to_thread(self._close_sync)

    # ------------------------------------------------------------------ producer side

    async def append(self, envelope: Envelope) -> None:
        """Append one envelope; returns once it is fsynced. Raises `SpoolFullError` at the bound."""
        await self.append_payload(envelope.canonical())

    async def append_payload(self, payload: _Bytes) -> None:
        """`append` for bytes already encoded canonically."""
        if self._writer is None:
            raise RuntimeError("spool is not open")
        if self._failed is not None:
            raise SpoolCorruptError(f"spool {self.directory} stopped accepting appends: {self._failed}")
        item = _Pending(payload, asyncio.get_running_loop().create_future())
        total = self._bytes + self._reserved + item.size
        if total > self.max_bytes:
            if not self._full_logged:
                self._full_logged = True
                log.error(
                    "spool %s FULL: %d pending bytes + %d would exceed max_bytes=%d; appends are refused "
                    "until the publisher drains (are Kafka and S3 reachable?)",
                    self.directory,
                    self._bytes + self._reserved,
                    item.size,
                    self.max_bytes,
                )
            raise SpoolFullError(
                f"spool {self.directory} is full: {self._bytes + self._reserved} of {self.max_bytes} bytes pending"
            )
        self._reserved += item.size
        self._queue.put_nowait(item)
        await item.future

    # ------------------------------------------------------------------ publisher side

    async def pending(self, limit: int) -> list[SpoolEntry]:
        """Up to ``limit`` pending records, oldest first."""
        if limit <= 0:
            return []
        async with self._reclaim_lock:
            wanted: list[tuple[int, Path, int, int]] = []
            for seq, (first, offset, size) in self._index.items():
                wanted.append((seq, self._segments[first].path, offset, size))
                if len(wanted) >= limit:
                    break
            if not wanted:
                return []
            return await asyncio.to_thread(_read_entries, wanted)

    async def wait_pending(self, max_wait_s: float) -> bool:
        """Wait up to ``max_wait_s`` seconds until something is pending; True when something is."""
        if self._index:
            return True
        self._has_pending.clear()
        try:
            await asyncio.wait_for(self._has_pending.wait(), max_wait_s)
        except TimeoutError:
            pass
        return bool(self._index)

    async def ack(self, seqs: Iterable[int]) -> None:
        """Durably acknowledge records; a segment whose records are all acked is deleted (not the last one)."""
        wanted = sorted({s for s in seqs if s in self._index})
        if not wanted:
            return
        async with self._ack_lock:
            assert self._acks is not None
            await asyncio.to_thread(self._acks.append, to_ranges(wanted))
            reclaim: list[_Segment] = []
            for seq in wanted:
                loc = self._index.pop(seq, None)
                if loc is None:
                    continue
                first, _, size = loc
                self._bytes -= size
                seg = self._segments[first]
                seg.unacked -= 1
                if seg.unacked == 0 and self._is_sealed(seg):
                    reclaim.append(seg)
            self._after_shrink()
            if reclaim:
                async with self._reclaim_lock:
                    for seg in reclaim:
                        self._segments.pop(seg.first_seq, None)
                    await asyncio.to_thread(delete_files, self.directory, [s.path for s in reclaim])
            if self._acks.size > max(1024 * 1024, 64 * len(self._segments)):
                await asyncio.to_thread(self._compact_acks, next(iter(self._segments)))

    # ------------------------------------------------------------------ internals: writer

    async def _write_loop(self) -> None:
        while True:
            first = await self._queue.get()
            batch = [first]
            if self.linger_s > 0 and first.payload:  # (an empty payload is close()'s wake-up: no waiting)
                await asyncio.sleep(self.linger_s)
            elif self.group_commit_s > 0:
                await self._gather_window()
            while len(batch) < _MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            items = [p for p in batch if p.payload]
            stop = len(items) != len(batch)
            if items:
                await self._commit(items)
            if stop and self._queue.empty():
                return

    async def _gather_window(self) -> None:
        """Let appends that are about to arrive join this fsync: yield to the loop while the queue keeps growing,
        at most `group_commit_s`. A lone appender pays one loop turn, not the whole window (a fixed sleep
        measured slower at every concurrency here: appends queued during an fsync already share the next)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.group_commit_s
        size = self._queue.qsize()
        while loop.time() < deadline:
            await asyncio.sleep(0)
            grown = self._queue.qsize()
            if grown == size:
                return
            size = grown

    async def _commit(self, items: list[_Pending]) -> None:
        size = sum(p.size for p in items)
        self._reserved -= size
        if self._failed is not None:
            for p in items:
                _settle(p.future, SpoolCorruptError(f"spool {self.directory} stopped accepting appends"))
            return
        first_seq = self._next_seq
        self._next_seq += len(items)
        try:
            if self._active_segment().size >= self.segment_bytes:
                await self._roll_async(first_seq)
            seg = self._active_segment()
            assert self._active_fd is not None
            offsets = await asyncio.to_thread(
                self._write_sync, self._active_fd, seg.size, first_seq, [p.payload for p in items]
            )
        except Exception as exc:  # OSError from the disk; anything else is a bug, and must not hang appenders
            self._next_seq = first_seq
            error: BaseException
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                error = SpoolFullError(f"spool {self.directory}: no space left on device")
            else:
                self._failed = exc
                error = SpoolCorruptError(f"spool {self.directory}: write failed, appends stopped: {exc}")
            log.error("spool %s: write of %d records failed: %s", self.directory, len(items), exc)
            for p in items:
                _settle(p.future, error)
            return
        seg.size = offsets[-1]
        for i, p in enumerate(items):
            self._index[first_seq + i] = (seg.first_seq, offsets[i], p.size)
            self._bytes += p.size
        seg.unacked += len(items)
        self.fsync_count += 1
        if self.on_fsync is not None:
            self.on_fsync()
        self._after_grow()
        self._has_pending.set()
        for p in items:
            _settle(p.future, None)

    @staticmethod
    def _write_sync(fd: int, at: int, first_seq: int, payloads: list[_Bytes]) -> list[int]:
        """Write the records at offset ``at`` of ``fd`` and fsync; on failure leave the file as it was."""
        offsets: list[int] = []
        chunks: list[bytes] = []
        pos = at
        for i, payload in enumerate(payloads):
            rec = encode_record(first_seq + i, payload)
            offsets.append(pos)
            chunks.append(rec)
            pos += len(rec)
        data = b"".join(chunks)
        try:
            written = os.pwrite(fd, data, at)
            if written != len(data):
                raise OSError(errno.EIO, f"short write: {written} of {len(data)} bytes")
            os.fsync(fd)
        except OSError:
            try:  # leave no partial record behind for the next batch to follow
                os.ftruncate(fd, at)
            except OSError:
                pass
            raise
        offsets.append(pos)  # the new end of the segment
        return offsets

    def _active_segment(self) -> _Segment:
        return next(reversed(self._segments.values()))

    def _is_sealed(self, seg: _Segment) -> bool:
        return seg is not self._active_segment()

    def _roll(self, first_seq: int) -> None:
        """Seal the active segment and start ``first_seq``'s (blocking: only while opening)."""
        fd = new_segment_file(self.directory / segment_name(first_seq))
        done = self._install_segment(first_seq, fd)
        if done is not None:
            delete_files(self.directory, [done.path])

    async def _roll_async(self, first_seq: int) -> None:
        """`_roll` for the writer: file IO in a thread, in-memory state on the loop."""
        fd = await asyncio.to_thread(new_segment_file, self.directory / segment_name(first_seq))
        done = self._install_segment(first_seq, fd)
        if done is not None:
            async with self._reclaim_lock:
                await asyncio.to_thread(delete_files, self.directory, [done.path])

    def _install_segment(self, first_seq: int, fd: int) -> _Segment | None:
        """Make ``fd`` the active segment (the old one is fsynced already); return the old one if fully acked."""
        old = self._active_segment() if self._segments else None
        if self._active_fd is not None:
            os.close(self._active_fd)
        self._active_fd = fd
        if old is not None and old.first_seq == first_seq:
            return None  # reopening an empty last segment (a restart with nothing appended since)
        self._segments[first_seq] = _Segment(first_seq, self.directory / segment_name(first_seq), HEADER_SIZE)
        if old is not None and old.unacked == 0:
            self._segments.pop(old.first_seq, None)
            return old
        return None

    # ------------------------------------------------------------------ internals: open / close

    def _open_sync(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            raise SpoolCorruptError(f"spool {self.directory} is held by another process: {exc}") from exc
        self._lock_fd = lock_fd
        try:
            self._acks = AckLog(self.directory / "acks.log")
            acked = self._acks.load()
            names = sorted(
                (first, p) for p in self.directory.iterdir() if (first := parse_segment_name(p.name)) is not None
            )
            next_seq = max(1, acked.max_seq + 1)
            for i, (first, path) in enumerate(names):
                last_segment = i == len(names) - 1
                result: ScanResult = scan_segment(path, first, tolerate_torn_tail=last_segment)
                if result.truncated_bytes:
                    log.warning(
                        "spool %s: torn tail of %d bytes at offset %d truncated (a crash during a write; "
                        "those records were never acknowledged)",
                        path,
                        result.truncated_bytes,
                        result.valid_size,
                    )
                seg = _Segment(first, path, result.valid_size)
                self._segments[first] = seg
                for seq, offset, size in result.records:
                    if not acked.contains(seq):
                        self._index[seq] = (first, offset, size)
                        self._bytes += size
                        seg.unacked += 1
                next_seq = max(next_seq, first, result.last_seq + 1)
            self._next_seq = next_seq
            # Start a fresh segment, then drop sealed segments with nothing pending.
            self._roll(next_seq)
            done = [s for s in list(self._segments.values()) if s.unacked == 0 and self._is_sealed(s)]
            for seg in done:
                self._segments.pop(seg.first_seq, None)
            delete_files(self.directory, [s.path for s in done])
            self._compact_acks(next(iter(self._segments)))
        except BaseException:
            self._close_sync()
            raise

    def _compact_acks(self, low: int) -> None:
        """Rewrite the ack log without the ranges of deleted segments (all below ``low``)."""
        assert self._acks is not None
        self._acks.rewrite([(lo, hi) for lo, hi in self._acks.ranges if hi >= low])

    def _close_sync(self) -> None:
        if self._active_fd is not None:
            os.close(self._active_fd)
            self._active_fd = None
        if self._acks is not None:
            self._acks.close()
            self._acks = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
        self._segments.clear()
        self._index.clear()
        self._bytes = 0

    # ------------------------------------------------------------------ internals: bound and metrics

    def _after_grow(self) -> None:
        threshold = self.warn_ratio * self.max_bytes
        if not self._warned and self._bytes >= threshold:
            self._warned = True
            log.warning(
                "spool %s is %.0f%% full (%d of %d bytes, %d records pending): the publisher is behind; "
                "appends will be refused at 100%%",
                self.directory,
                100.0 * self._bytes / self.max_bytes,
                self._bytes,
                self.max_bytes,
                self.depth,
            )
        self._update_metrics()

    def _after_shrink(self) -> None:
        if self._bytes < self.warn_ratio * self.max_bytes:
            if self._warned:
                log.info("spool %s back below %.0f%% full", self.directory, 100.0 * self.warn_ratio)
            self._warned = False
        if self._bytes + self._reserved < self.max_bytes:
            self._full_logged = False
        self._update_metrics()

    def _update_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.spool_depth.set(self.depth)
            self._metrics.spool_bytes.set(self._bytes)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _read_entries(wanted: list[tuple[int, Path, int, int]]) -> list[SpoolEntry]:
    out: list[SpoolEntry] = []
    fds: dict[Path, int] = {}
    try:
        for seq, path, offset, size in wanted:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            out.append(SpoolEntry(seq, read_record(fd, path, offset, size, seq)))
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


__all__ = ["DEFAULT_SEGMENT_BYTES", "SEGMENT_SUFFIX", "Spool", "SpoolEntry"]
