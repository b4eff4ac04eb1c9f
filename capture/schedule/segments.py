"""The segment writer: schedule records to ``<dir>/<engine_id>/<seq:08d>.jsonl``, off the engine's step.

The engine step only puts a plain dict (ids and integers) on a queue; a daemon thread encodes it canonically,
appends it to the open ``.jsonl.part`` file (buffered), and rotates: every ``rotate_seconds`` (checked even while
the engine is idle, so the last records of a burst reach a complete segment soon) or once a segment holds
``rotate_bytes``, and at `SegmentWriter.close`. Rotation flushes, fsyncs, renames the part to ``.jsonl`` and
fsyncs the directory, so a complete segment is durable before anyone may ship it.

The writer never raises into the engine: an IO error is counted (`SegmentWriter.io_errors`), logged, the segment
being written is abandoned (renamed complete if it can be, else left as a part), and writing resumes with the
next segment. A queue that grows past ``max_queue`` records (a disk that stalls) drops records and counts them
(`SegmentWriter.dropped`) rather than growing the engine's memory without bound: the log then has a gap, which
`schemas.schedule_log.ScheduleLog.problems` names, and a replay refuses to call it complete.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import IO, Any, Final

from schemas.canonical import canonical_text_of_plain
from schemas.schedule_delivery import part_file_name, segment_file_name

logger = logging.getLogger(__name__)

DEFAULT_ROTATE_SECONDS: Final = 2.0
DEFAULT_ROTATE_BYTES: Final = 4 << 20
DEFAULT_MAX_QUEUE: Final = 100_000
_STOP: Final = object()


class SegmentWriter:
    """One engine instance's segments. `submit` is cheap and thread-safe; `close` drains and completes."""

    def __init__(
        self,
        directory: Path,
        engine_id: str,
        *,
        rotate_seconds: float = DEFAULT_ROTATE_SECONDS,
        rotate_bytes: int = DEFAULT_ROTATE_BYTES,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ) -> None:
        self.directory = directory / engine_id
        self.rotate_seconds = rotate_seconds
        self.rotate_bytes = rotate_bytes
        self.max_queue = max_queue
        self.io_errors = 0
        self.dropped = 0
        self.records = 0
        self.bytes_written = 0
        self.segments_completed = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._seq = 0
        self._fh: IO[bytes] | None = None
        self._size = 0
        self._opened_at = 0.0
        self._thread = threading.Thread(target=self._run, name=f"schedule-writer-{engine_id}", daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, record: dict[str, Any] | bytes) -> None:
        """Queue one record (JSON-mode dict without floats, or an already encoded line); never blocks or raises."""
        if self._queue.qsize() >= self.max_queue:
            self.dropped += 1
            return
        self._queue.put(record)

    def sync(self, timeout: float = 10.0) -> bool:
        """Complete the open segment now (everything submitted before is then in a ``.jsonl``); True when done
        within ``timeout``. The replay lane reads its own log this way; production rotates on time and size."""
        if self._closed:
            return False
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, complete the open segment, stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # -- the writer thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            wait = self.rotate_seconds if self._fh is None else max(self._deadline() - time.monotonic(), 0.0)
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._rotate()
                return
            if isinstance(item, threading.Event):
                self._rotate()
                item.set()
                continue
            if item is not None:
                self._write(item)
            if self._fh is not None and (self._size >= self.rotate_bytes or time.monotonic() >= self._deadline()):
                self._rotate()

    def _deadline(self) -> float:
        return self._opened_at + self.rotate_seconds

    def _write(self, item: dict[str, Any] | bytes) -> None:
        try:
            line = item if isinstance(item, bytes) else (canonical_text_of_plain(item) + "\n").encode("utf-8")
            if self._fh is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.directory / part_file_name(self._seq), "wb")
                self._size = 0
                self._opened_at = time.monotonic()
            self._fh.write(line)
            self._size += len(line)
            self.bytes_written += len(line)
            self.records += 1
        except (OSError, TypeError, ValueError) as exc:
            self._failed("write", exc)

    def _rotate(self) -> None:
        fh, self._fh = self._fh, None
        if fh is None:
            return
        seq, self._seq = self._seq, self._seq + 1
        try:
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(self.directory / part_file_name(seq), self.directory / segment_file_name(seq))
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            self.segments_completed += 1
        except OSError as exc:
            self._failed("rotate", exc)
            try:
                fh.close()
            except OSError:
                pass

    def _failed(self, what: str, exc: Exception) -> None:
        self.io_errors += 1
        logger.warning("schedule recorder: %s failed (%d errors so far), serving on: %s", what, self.io_errors, exc)
        if what == "write" and self._fh is not None:
            self._rotate()
