"""Reading a spool back from its files: at open, every record appended and not acknowledged becomes pending
again; afterwards, pending records are read back for the publisher.

`recover` runs once, in a worker thread, while nothing else touches the spool (invariants 4 and 5 of
`capture.spool`): it takes the directory's lock, scans every segment (a torn tail of the last one is
truncated with one WARNING line; corruption anywhere else is `SpoolCorruptError`, naming the file and the
offset), indexes the records the ack log does not hold, starts a fresh segment, deletes the sealed segments
with nothing pending and rewrites the ack log without their ranges.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from capture.errors import SpoolCorruptError
from capture.spool.disk_format import (
    AckLog,
    ScanResult,
    delete_files,
    lock_exclusively,
    make_private_dir,
    open_private,
    parse_segment_name,
    read_record,
    scan_segment,
)
from capture.spool.segments import Segment, SegmentLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpoolEntry:
    """One pending record: its seq (for `Spool.ack`) and the canonical envelope bytes."""

    seq: int
    payload: bytes


def recover(segments: SegmentLog) -> int:
    """Open the spool's files into `segments` (blocking); returns the bytes of the records pending again.
    On any failure the files are closed again and the error raised."""
    directory = segments.directory
    make_private_dir(directory)
    lock_fd = open_private(directory / "LOCK", os.O_RDWR)
    try:
        lock_exclusively(lock_fd)
    except OSError as exc:
        raise SpoolCorruptError(f"spool {directory} is held by another process: {exc}") from exc
    segments.lock_fd = lock_fd
    pending_bytes = 0
    try:
        segments.acks = AckLog(directory / "acks.log")
        acked = segments.acks.load()
        names = sorted((first, p) for p in directory.iterdir() if (first := parse_segment_name(p.name)) is not None)
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
            seg = Segment(first, path, result.valid_size)
            segments.segments[first] = seg
            for seq, offset, size in result.records:
                if not acked.contains(seq):
                    segments.index[seq] = (first, offset, size)
                    pending_bytes += size
                    seg.unacked += 1
            next_seq = max(next_seq, first, result.last_seq + 1)
        segments.next_seq = next_seq
        # Start a fresh segment, then drop sealed segments with nothing pending.
        segments.roll_sync(next_seq)
        done = [s for s in list(segments.segments.values()) if s.unacked == 0 and segments.is_sealed(s)]
        for seg in done:
            segments.segments.pop(seg.first_seq, None)
        delete_files(directory, [s.path for s in done])
        segments.compact_acks(next(iter(segments.segments)))
    except BaseException:
        segments.close_sync()
        raise
    return pending_bytes


def read_entries(wanted: list[tuple[int, Path, int, int]]) -> list[SpoolEntry]:
    """The records at (seq, segment path, offset, size), each checked against its CRC (blocking)."""
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
