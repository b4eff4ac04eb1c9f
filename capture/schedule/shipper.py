"""The schedule shipper: every closed segment of the recorder's log to S3 and Kafka, at least once, never stalled.

The recorder inside vLLM writes ``<schedule_dir>/<engine_id>/<seq:08d>.jsonl.part`` and renames it to ``.jsonl``
once it is closed and fsynced (`schemas.schedule_delivery`). The shipper runs beside vLLM (it needs that disk:
``reprolane serve schedules``) and, oldest first, for each closed segment:

1. reads it (at most `schemas.schedule_delivery.MAX_SEGMENT_BYTES`, symlinks refused) and checks every line
   (`decode_segment`: bounded, schema-checked, canonical, of the engine it is filed under);
2. stores it in S3, written once, then one index entry per arrival (`capture.schedule.destinations.SegmentStore`:
   the entries only after the segment they name, so an entry never points at nothing), then its leaf in its
   engine's Merkle log (`schemas.schedule_proof`);
3. sends it to Kafka (`SegmentProducer`) and waits for the broker's ack;
4. only then deletes the file (and fsyncs the directory).

A crash or a kill anywhere before 4 leaves the file in place, and the next start ships it again: S3 finds the same
bytes under its key (success), the index entries the same bodies, Kafka gets a duplicate (at least once; consumers
collapse by engine id and seq). Nothing is lost, nothing is stored twice.

A segment that can never be shipped (bytes that are not a valid segment, over the bound, a key S3 refuses, a key
that holds other bytes, a record Kafka refuses) is *quarantined*: its reason is written to
``<quarantine>/<engine_id>/<seq>-<ns>.reason.json``, the file is moved beside it (a rename: never read whole, never
copied), it is sent to the dead-letter topic when Kafka takes it, and the shipper moves on. Transient failures (S3
or Kafka down) are retried with capped backoff for as long as it takes; every segment would meet them alike.

A ``.part`` file nobody has touched for ``stale_part_s`` belongs to a recorder that died mid-segment; it is
reported (logged once), never shipped: its last line may be cut, and an engine that crashed failed its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from capture.errors import CaptureError, RecordsRefused
from capture.schedule.destinations import PutRefusedError, SegmentConflictError, SegmentProducer, SegmentStore
from capture.schedule.shipper_metrics import ShipperMetrics
from capture.schedule.shipper_settings import ShipperSettings
from capture.spool.disk_format import lock_exclusively
from schemas.errors import ContractError
from schemas.schedule import RequestArrival, ScheduleRecord
from schemas.schedule_delivery import (
    MAX_SEGMENT_BYTES,
    ScheduleIndexEntry,
    decode_segment,
    is_engine_id,
    is_key_safe_id,
    parse_segment_file_name,
)

log = logging.getLogger(__name__)

_PART: Final = ".jsonl.part"


@dataclass(frozen=True, order=True)
class Segment:
    """One closed segment on disk."""

    engine_id: str
    seq: int
    path: Path


class Refused(Exception):
    """This segment can never be shipped (`code`, `reason`): quarantine it."""

    def __init__(self, code: str, reason: str, data: bytes = b"") -> None:
        super().__init__(f"{code}: {reason}")
        self.code, self.reason, self.data = code, reason, data


def index_entries(records: tuple[ScheduleRecord, ...], segment: int, sha256: str) -> list[ScheduleIndexEntry]:
    """One entry per arrival whose ids may be key segments (an id from elsewhere, e.g. a client that called vLLM
    directly with any X-Request-Id, is not indexed: no envelope could name it)."""
    return [
        ScheduleIndexEntry(
            engine_id=r.engine_id,
            external_request_id=r.external_request_id,
            engine_request_id=r.engine_request_id,
            segment=segment,
            segment_sha256=sha256,
            step=r.step,
        )
        for r in records
        if isinstance(r, RequestArrival) and all(map(is_key_safe_id, (r.external_request_id, r.engine_request_id)))
    ]


def _read_bounded(path: Path) -> bytes:
    """The file's bytes, at most `MAX_SEGMENT_BYTES` (`Refused` past it); never through a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, MAX_SEGMENT_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_SEGMENT_BYTES:
                raise Refused("TooLarge", f"over the {MAX_SEGMENT_BYTES}-byte bound of a segment")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Shipper:
    """Ships the closed segments of one schedule directory (`ship_pending` once, or `run` until stopped)."""

    def __init__(
        self,
        settings: ShipperSettings,
        *,
        store: SegmentStore | None = None,
        producer: SegmentProducer | None = None,
        metrics: ShipperMetrics | None = None,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.directory = settings.schedule_dir
        self.store = store if store is not None else SegmentStore.from_settings(settings)
        self.producer = producer if producer is not None else SegmentProducer(settings)
        self.metrics = metrics if metrics is not None else ShipperMetrics()
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.shipped = 0  # segments shipped since start
        self.shipped_bytes = 0
        self.quarantined = 0
        self._reported: set[Path] = set()
        self._stopping = asyncio.Event()
        self._lock_fd: int | None = None

    def hold(self) -> None:
        """Become the one shipper of this directory (an exclusive ``flock`` on ``<quarantine>/LOCK``, held until
        `close`): two would ship each segment twice and race on the quarantine. `CaptureError` when another holds
        it."""
        if self._lock_fd is not None:
            return
        try:
            self.settings.quarantine.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.settings.quarantine / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise CaptureError(f"shipper: cannot open its lock in {self.settings.quarantine}: {exc}") from exc
        try:
            lock_exclusively(fd)
        except OSError as exc:
            raise CaptureError(f"shipper: {self.directory} is shipped by another process already ({exc})") from exc
        self._lock_fd = fd

    # -- the directory -----------------------------------------------------------------------------------------

    def closed_segments(self) -> list[Segment]:
        """Every closed segment now on disk, oldest first per engine (engines in name order)."""
        found: list[Segment] = []
        try:
            engines = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        for engine in engines:
            if engine.name.startswith("."):
                continue  # hidden: nobody's engine (an editor's or a sync tool's file)
            if not engine.is_dir(follow_symlinks=False) or not is_engine_id(engine.name):
                self._report_once(Path(engine.path), "not an engine directory: ignored")
                continue
            for entry in os.scandir(engine.path):
                seq = parse_segment_file_name(entry.name)
                if seq is not None and entry.is_file(follow_symlinks=False):
                    found.append(Segment(engine.name, seq, Path(entry.path)))
                elif entry.name.endswith(_PART):
                    self._check_part(entry)
                elif seq is None:
                    self._report_once(Path(entry.path), "not a segment: ignored")
                else:  # a segment's name on a symlink or a directory: never followed, never shipped
                    found.append(Segment(engine.name, seq, Path(entry.path)))
        self._note_pending(found)
        return sorted(found)

    def _note_pending(self, found: list[Segment]) -> None:
        self.metrics.pending_segments.set(len(found))
        oldest = 0.0
        for segment in found:
            with contextlib.suppress(OSError):
                oldest = max(oldest, time.time() - segment.path.stat(follow_symlinks=False).st_mtime)
        self.metrics.oldest_pending_seconds.set(oldest)

    def _check_part(self, entry: os.DirEntry[str]) -> None:
        with contextlib.suppress(OSError):
            if time.time() - entry.stat(follow_symlinks=False).st_mtime > self.settings.stale_part_s:
                self._report_once(Path(entry.path), "an open segment nobody writes: its recorder died; not shipped")

    def _report_once(self, path: Path, what: str) -> None:
        if path not in self._reported:
            self._reported.add(path)
            log.warning("shipper: %s: %s", path, what)

    # -- one segment -------------------------------------------------------------------------------------------

    async def ship(self, segment: Segment) -> None:
        """Ship one segment and delete it; quarantine it when it can never be shipped. `SinkError`: try again."""
        try:
            data = await asyncio.to_thread(self._read, segment)
        except FileNotFoundError:
            return  # gone since the listing (another shipper of the same directory shipped it)
        except Refused as refused:
            await self._quarantine(segment, refused)
            return
        try:
            await self._publish(segment, data)
        except Refused as refused:
            await self._quarantine(segment, refused)
            return
        await asyncio.to_thread(self._delete, segment)
        self.shipped += 1
        self.shipped_bytes += len(data)
        self.metrics.segments_shipped_total.inc()
        self.metrics.bytes_shipped_total.inc(len(data))

    def _read(self, segment: Segment) -> bytes:
        """The segment's bytes. A file this process cannot read (a link, a directory, no permission, an I/O error)
        is `Refused`: retried, it would hold back every segment behind it; quarantined, it stays on this disk."""
        try:
            return _read_bounded(segment.path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            what = "NotAFile" if not segment.path.is_file() or segment.path.is_symlink() else "Unreadable"
            raise Refused(what, f"cannot read it as a file: {exc.strerror or exc}") from exc

    async def _publish(self, segment: Segment, data: bytes) -> None:
        try:
            records = decode_segment(data, segment.engine_id)
        except ContractError as exc:
            raise Refused("InvalidSegment", str(exc)[:1000], data) from exc
        sha256 = hashlib.sha256(data).hexdigest()
        try:
            await asyncio.to_thread(self.store.put_segment, segment.engine_id, segment.seq, data, sha256)
        except (SegmentConflictError, PutRefusedError) as exc:
            raise Refused(type(exc).__name__, str(exc)[:1000], data) from exc
        entries = index_entries(records, segment.seq, sha256)
        try:
            conflicts = await asyncio.to_thread(self.store.put_index, entries)
            self.metrics.index_conflicts_total.inc(conflicts)
        except PutRefusedError as exc:  # stored, but not findable by request: say so, do not hold the log back
            log.error("shipper: %s/%08d: an index entry was refused for good: %s", segment.engine_id, segment.seq, exc)
        await asyncio.to_thread(self.store.log_segment, segment.engine_id, segment.seq, records)
        try:
            await self.producer.send(segment.engine_id, segment.seq, data, sha256)
        except RecordsRefused as exc:
            code, reason = exc.refused.get(segment.seq, ("Refused", str(exc)))
            raise Refused(code, f"{reason} (S3 holds the segment)"[:1000], data) from exc

    def _delete(self, segment: Segment) -> None:
        segment.path.unlink(missing_ok=True)
        _fsync_dir(segment.path.parent)

    async def _quarantine(self, segment: Segment, refused: Refused) -> None:
        """Reason first, then the file moved beside it (a crash in between quarantines it again later), then the
        dead letter (best effort)."""
        await asyncio.to_thread(self._move_to_quarantine, segment, refused)
        await self.producer.dead_letter(segment.engine_id, segment.seq, refused.data, refused.code, refused.reason)
        self.quarantined += 1
        self.metrics.segments_quarantined_total.labels(code=refused.code).inc()
        log.error("shipper: quarantined %s (%s): %s", segment.path, refused.code, refused.reason)

    def _move_to_quarantine(self, segment: Segment, refused: Refused) -> None:
        where = self.settings.quarantine / (segment.engine_id if is_engine_id(segment.engine_id) else "_")
        stem = f"{segment.seq:08d}-{time.time_ns()}"
        doc = {
            "engine_id": segment.engine_id,
            "seq": segment.seq,
            "code": refused.code,
            "reason": refused.reason,
            "size": len(refused.data) if refused.data else None,
            "sha256": hashlib.sha256(refused.data).hexdigest() if refused.data else None,
            "quarantined_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        }
        try:
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = where / f".{stem}.reason.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, json.dumps(doc, sort_keys=True, indent=1).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            tmp.rename(where / f"{stem}.reason.json")
            os.rename(segment.path, where / f"{stem}.jsonl")
            _fsync_dir(where)
            _fsync_dir(segment.path.parent)
        except OSError as exc:
            raise CaptureError(f"quarantine {where}: cannot keep {segment.path}: {exc}") from exc

    # -- the loop ----------------------------------------------------------------------------------------------

    async def ship_pending(self) -> int:
        """Ship every closed segment on disk now; the number handled (shipped or quarantined). `SinkError` when
        S3 or Kafka fails (what was shipped stays shipped); `CaptureError` when another shipper holds the
        directory (`hold`)."""
        self.hold()
        handled = 0
        for segment in self.closed_segments():
            await self.ship(segment)
            handled += 1
        return handled

    async def run(self) -> None:
        """Ship until `stop`; failures are retried with capped backoff (nothing is skipped)."""
        self.hold()  # before anything else: a second shipper of the same directory stops here
        log.info("shipper: shipping %s to s3://%s and Kafka", self.directory, self.store.bucket)
        if self.settings.metrics_port:
            self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        backoff = self.backoff_initial_s
        while not self._stopping.is_set():
            try:
                handled = await self.ship_pending()
                backoff = self.backoff_initial_s
                delay = 0.0 if handled else self.settings.poll_s
            except CaptureError as exc:
                self.metrics.errors_total.inc()
                log.warning("shipper: %s; retrying in %.1fs (nothing is dropped)", exc, backoff)
                delay, backoff = backoff, min(backoff * 2, self.backoff_max_s)
            if delay:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)

    def stop(self) -> None:
        self._stopping.set()

    async def close(self) -> None:
        await self.producer.close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # releases the flock
