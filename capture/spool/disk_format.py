"""The spool's on-disk formats: segment files of CRC'd records and the ack log (see `capture.spool`).

Segment::

    header  b"RLSPOOL" u8 version(=1)                      8 bytes
    record  u32 length | u32 crc | u64 seq | payload       16 + length bytes, little endian
            crc = zlib.crc32(seq bytes + payload); seqs are consecutive from the seq in the file name

Ack log::

    header  b"RLACKS\\0" u8 version(=1)                     8 bytes
    record  u64 first | u64 last | u32 crc                 20 bytes, crc = zlib.crc32(first + last bytes)

This module knows bytes and files only; the rules about *when* something is torn or corrupt are stated in
`capture.spool`'s docstring and enforced by `scan_segment` (segments) and `AckLog.load` (acks).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from capture.errors import SpoolCorruptError

log = logging.getLogger(__name__)

SEGMENT_MAGIC = b"RLSPOOL"
ACKLOG_MAGIC = b"RLACKS\0"
FORMAT_VERSION = 1
HEADER_SIZE = 8
SEGMENT_SUFFIX = ".seg"
RECORD_HEADER = struct.Struct("<IIQ")
ACK_RECORD = struct.Struct("<QQI")
_SEQ = struct.Struct("<Q")
#: How many following seqs the torn-tail check looks for after a bad record.
_RESYNC_WINDOW = 64

#: The spool holds request and answer text: its files are the owner's alone, whatever the umask.
FILE_MODE = 0o600
DIR_MODE = 0o700

SEGMENT_HEADER = SEGMENT_MAGIC + bytes([FORMAT_VERSION])
ACKLOG_HEADER = ACKLOG_MAGIC + bytes([FORMAT_VERSION])


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem, dot, suffix = name.partition(".")
    if dot and f".{suffix}" == SEGMENT_SUFFIX and len(stem) == 20 and stem.isdigit():
        return int(stem)
    return None


def encode_record(seq: int, payload: bytes) -> bytes:
    body = _SEQ.pack(seq) + payload
    return struct.pack("<II", len(payload), zlib.crc32(body)) + body


def read_record(fd: int, path: Path, offset: int, size: int, seq: int) -> bytes:
    """The payload of the record ``seq`` at ``offset``, verified again (the disk may have changed since)."""
    data = os.pread(fd, size, offset)
    if _record_at(data, 0, seq) == size:
        return data[RECORD_HEADER.size :]
    raise SpoolCorruptError(f"spool segment {path}: record seq {seq} at offset {offset} is corrupt")


def to_ranges(sorted_seqs: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted seqs as inclusive ranges: [1, 2, 3, 7] -> [(1, 3), (7, 7)]."""
    out: list[tuple[int, int]] = []
    for seq in sorted_seqs:
        if out and out[-1][1] + 1 == seq:
            out[-1] = (out[-1][0], seq)
        else:
            out.append((seq, seq))
    return out


def delete_files(directory: Path, paths: list[Path]) -> None:
    """Unlink ``paths`` (missing ones are fine), then fsync ``directory`` so the deletion is durable."""
    for path in paths:
        path.unlink(missing_ok=True)
    if paths:
        fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_CREAT)`` with the file's mode set to `FILE_MODE` (a umask can only narrow the
    mode given to ``open``, and an older file keeps its own: ``fchmod`` makes both exact)."""
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def lock_exclusively(fd: int) -> None:
    """Take a non-blocking exclusive ``flock`` on `fd`, the LOCK file that makes one process the owner of a
    directory (the spool's, the schedule shipper's); when another process holds it, `fd` is closed and the
    `OSError` raised for the caller to translate."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and its parents) if needed and make it `DIR_MODE`, its files `FILE_MODE`."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(directory, DIR_MODE)
    except PermissionError as exc:  # a directory someone else owns (a mount point): its files still are ours
        log.warning("spool %s: cannot make the directory private (%s); its files are made 0600", directory, exc)
    for path in directory.iterdir():
        if path.is_file() and not path.is_symlink():
            os.chmod(path, FILE_MODE)


def new_segment_file(path: Path) -> int:
    """Open ``path`` for writing, creating it with its header (file and directory fsynced) when new. A header
    that failed to be written (a full disk) is written again by the next call, which the writer retries."""
    fd = open_private(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < HEADER_SIZE:  # new, or a creation a full disk cut short: (re)write the header
            if os.pwrite(fd, SEGMENT_HEADER, 0) != HEADER_SIZE:
                raise OSError(errno.ENOSPC, f"short write of the header of {path}")
            os.fsync(fd)
            fsync_dir(path.parent)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass
class ScanResult:
    records: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, offset, size)
    valid_size: int = HEADER_SIZE
    truncated_bytes: int = 0
    last_seq: int = 0


def _record_at(data: bytes, offset: int, seq: int) -> int:
    """Size of the valid record with ``seq`` at ``offset``, or 0 when there is none."""
    if offset + RECORD_HEADER.size > len(data):
        return 0
    length, crc, rec_seq = RECORD_HEADER.unpack_from(data, offset)
    end: int = offset + RECORD_HEADER.size + int(length)
    if rec_seq != seq or end > len(data):
        return 0
    if zlib.crc32(memoryview(data)[offset + 8 : end]) != crc:
        return 0
    return end - offset


def _valid_record_follows(data: bytes, bad_offset: int, bad_seq: int) -> bool:
    """True when a valid record with one of the next seqs lies after ``bad_offset`` (then it is not a torn tail)."""
    for seq in range(bad_seq + 1, bad_seq + 1 + _RESYNC_WINDOW):
        needle = _SEQ.pack(seq)
        hit = data.find(needle, bad_offset + 1)
        while hit != -1:
            if hit - 8 > bad_offset and _record_at(data, hit - 8, seq):
                return True
            hit = data.find(needle, hit + 1)
    return False


def _truncate(path: Path, size: int, header: bytes | None = None) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        if header is not None:
            os.pwrite(fd, header, 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def scan_segment(path: Path, first_seq: int, *, tolerate_torn_tail: bool) -> ScanResult:
    """Read every record of a segment; truncate a torn tail when allowed, else raise `SpoolCorruptError`."""
    data = path.read_bytes()
    result = ScanResult(last_seq=first_seq - 1)
    header = data[:HEADER_SIZE]
    if header != SEGMENT_HEADER:
        torn_creation = len(data) <= HEADER_SIZE and header.strip(b"\0") in (b"", SEGMENT_HEADER[: len(header)])
        if tolerate_torn_tail and torn_creation:
            _truncate(path, HEADER_SIZE, SEGMENT_HEADER)
            result.truncated_bytes = len(data)
            return result
        raise SpoolCorruptError(f"spool segment {path}: bad header {header!r} at offset 0 (not a spool segment?)")
    offset, seq = HEADER_SIZE, first_seq
    while offset < len(data):
        size = _record_at(data, offset, seq)
        if size == 0:
            if tolerate_torn_tail and not _valid_record_follows(data, offset, seq):
                _truncate(path, offset)
                result.truncated_bytes = len(data) - offset
                break
            raise SpoolCorruptError(
                f"spool segment {path}: corrupt record (seq {seq}) at offset {offset}; valid records follow, "
                "so this is not a torn tail. Move the file aside to start without it (its records are lost)."
            )
        result.records.append((seq, offset, size))
        offset += size
        seq += 1
    result.valid_size = offset if result.truncated_bytes else len(data)
    result.last_seq = seq - 1
    return result


@dataclass
class AckedSet:
    """Acknowledged seqs as sorted, merged, inclusive ranges."""

    ranges: list[tuple[int, int]]

    def __post_init__(self) -> None:
        self.ranges = merge_ranges(self.ranges)
        self._starts = [lo for lo, _ in self.ranges]

    def contains(self, seq: int) -> bool:
        i = bisect.bisect_right(self._starts, seq) - 1
        return i >= 0 and self.ranges[i][1] >= seq

    @property
    def max_seq(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


def _encode_acks(ranges: list[tuple[int, int]]) -> bytes:
    return b"".join(ACK_RECORD.pack(lo, hi, zlib.crc32(_SEQ.pack(lo) + _SEQ.pack(hi))) for lo, hi in ranges)


class AckLog:
    """The append-only log of acknowledged seq ranges (fsynced on every append)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ranges: list[tuple[int, int]] = []
        self.size = 0
        self._fd: int | None = None

    def load(self) -> AckedSet:
        """Read the log (a torn tail is truncated, a bad record in the middle skipped with a warning)."""
        data = self.path.read_bytes() if self.path.exists() else b""
        if data and data[:HEADER_SIZE] != ACKLOG_HEADER and len(data) > HEADER_SIZE:
            raise SpoolCorruptError(f"spool ack log {self.path}: bad header at offset 0")
        ranges: list[tuple[int, int]] = []
        offset = HEADER_SIZE
        while offset + ACK_RECORD.size <= len(data):
            lo, hi, crc = ACK_RECORD.unpack_from(data, offset)
            if zlib.crc32(data[offset : offset + 16]) == crc and lo <= hi:
                ranges.append((lo, hi))
            elif offset + ACK_RECORD.size < len(data):
                log.warning("spool ack log %s: bad record at offset %d skipped (republishes)", self.path, offset)
            offset += ACK_RECORD.size
        self.ranges = merge_ranges(ranges)
        self.rewrite(self.ranges)
        return AckedSet(list(self.ranges))

    def append(self, ranges: list[tuple[int, int]]) -> None:
        """Append and fsync. A write that failed (a full disk) is cut back, here or, if even that failed, before
        the next append, so the records after it stay aligned (the publisher acks those seqs again)."""
        assert self._fd is not None
        data = _encode_acks(ranges)
        try:
            if os.fstat(self._fd).st_size != self.size:
                os.ftruncate(self._fd, self.size)
            if os.write(self._fd, data) != len(data):
                raise OSError(errno.ENOSPC, f"short write to {self.path}")
            os.fsync(self._fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.size)
            raise
        self.ranges.extend(ranges)
        self.size += len(data)

    def rewrite(self, ranges: list[tuple[int, int]]) -> None:
        """Replace the log atomically with ``ranges`` (tmp + fsync + rename + fsync of the directory)."""
        merged = merge_ranges(ranges)
        tmp = self.path.with_name(self.path.name + ".tmp")
        data = ACKLOG_HEADER + _encode_acks(merged)
        fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.ranges = merged
        self.size = len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
