"""An envelope's engine schedule, read back from S3 and checked: the window of records a schedule replay needs.

The capture side's shipper (`capture.schedule.shipper`) stores each closed segment of an engine's schedule log once
under `schemas.layout.schedule_segment_key` and, per arrival, a `schemas.schedule_delivery.ScheduleIndexEntry`
under `schemas.layout.schedule_index_key` (external request id, engine request id). An envelope whose upstream
records schedules names its engine request in ``envelope.schedule`` (`schemas.schedule_delivery.ScheduleRef`).

`ScheduleStore.records_for` joins the two and trusts nothing it reads:

- the reference must name the envelope's own request (`external_request_id_for` of its endpoint and request id:
  the sidecar forwarded that id, so a reference to anything else was not written by it);
- every index entry under that id must be filed under its own ids, and name one engine;
- the segment an entry names must have the entry's sha256 and hold the arrival the entry describes;
- every segment is read bounded and line by line schema-checked (`schemas.schedule_delivery.decode_segment`), of
  the engine it is filed under.

Anything else is a `StoreError` naming the object: an entry written by someone other than the shipper, or moved to
another request's arrival, can never make a replay use another request's schedule. An envelope without a
schedule, or one whose index is not there (yet), is `ScheduleNotFoundError`.

The window: every step and arrival of the target's engine from ``before_steps`` steps before its (first) arrival
to the step that reports it finished (for ``n > 1``, every child), in log order, plus the engine's settings (the
first record of its first segment). Where the log does not reach that far (a segment not shipped yet, or not
recorded) the window says so (`ScheduleWindow.complete`, `ScheduleWindow.gap`); the lane decides what it can do
with it. A replay reads less: `replayer.schedule.window.read_window` asks this store for the target's busy period
and its prefix-cache providers' only. Blocking (boto3): async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar

from botocore.exceptions import BotoCoreError
from cachetools import LRUCache

from infra.clients.s3 import S3Policy, is_missing, make_s3_client, s3_call
from replayer.errors import ScheduleNotFoundError, StoreError
from replayer.settings import ReplayerSettings
from schemas import ContractError, Envelope
from schemas.layout import schedule_index_key, schedule_index_prefix, schedule_segment_key
from schemas.schedule import EngineStart, RequestArrival, ScheduleRecord, ScheduleStep
from schemas.schedule_delivery import (
    MAX_INDEX_ENTRY_BYTES,
    MAX_SEGMENT_BYTES,
    ScheduleIndexEntry,
    decode_index_entry,
    decode_segment,
    external_request_id,
    external_request_id_for,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_T = TypeVar("_T")
#: Index entries one request may have (one per child of ``n``); more under one id is not the shipper's doing.
MAX_ENTRIES: Final = 256
DEFAULT_MAX_SEGMENTS: Final = 1024
#: Stored bytes of the shipped segments a store keeps decoded (least recently used out first): a shipped segment
#: never changes (written once), and the replays of one engine read its provider periods (often the engine's first
#: segments) and the segments next to their own again and again.
DEFAULT_CACHE_BYTES: Final = 32 << 20


@dataclass(frozen=True)
class ScheduleWindow:
    """The records of the target's engine around the target, in log order (no `EngineStart` among them)."""

    engine: EngineStart | None  # the engine's schedule-shaping settings; None when its first segment is not there
    arrivals: tuple[RequestArrival, ...]  # the target's engine requests (one per child)
    records: tuple[ScheduleRecord, ...]
    first_segment: int
    last_segment: int
    complete: bool  # every target request's finish is in `records`, and the window reaches back as far as asked
    gap: str | None = None  # what the log lacks when not complete
    #: the step ranges `records` hold (`replayer.schedule.window`); None: one range, from the first to the last
    ranges: tuple[tuple[int, int], ...] | None = None
    #: the segments `records` were read from (None: every one from `first_segment` to `last_segment`)
    segments: tuple[int, ...] | None = None

    @property
    def steps(self) -> tuple[ScheduleStep, ...]:
        return tuple(r for r in self.records if isinstance(r, ScheduleStep))


class _Checked(NamedTuple):
    """A shipped segment as the store checked it."""

    sha256: str  # of the stored bytes
    size: int  # of the stored bytes: what it costs the cache
    records: tuple[ScheduleRecord, ...]


def _stored_size(checked: _Checked) -> int:
    return checked.size


class ScheduleStore:
    """Reads schedule segments and their index from the audit bucket (blocking; see module docstring)."""

    #: Segments one window may read (each at most `MAX_SEGMENT_BYTES`).
    max_segments: int = DEFAULT_MAX_SEGMENTS

    def __init__(self, client: S3Client, bucket: str, *, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._client = client
        self.bucket = bucket
        self._cache: LRUCache[tuple[str, int], _Checked] = LRUCache(cache_bytes, getsizeof=_stored_size)
        self._cache_lock = threading.Lock()  # the replayer's worker threads share one store
        self.segments_read = 0  # GETs of segments, cached ones not counted

    @classmethod
    def from_settings(cls, settings: ReplayerSettings) -> ScheduleStore:
        try:
            return cls(make_s3_client(settings, policy=S3Policy.REPLAYER), settings.s3_bucket)
        except (BotoCoreError, ValueError) as exc:
            raise StoreError(f"cannot configure the schedule store: {exc}") from exc

    # -- S3 ----------------------------------------------------------------------------------------------------

    def _s3(self, what: str, key: str, call: Callable[[], _T]) -> _T | None:
        return s3_call(what, f"s3://{self.bucket}/{key}", call, none_if=is_missing, error=StoreError)

    def _get(self, key: str, limit: int) -> bytes | None:
        """The object's bytes (None when missing); `StoreError` when it is over `limit` (never read whole)."""

        def get() -> bytes:
            body = self._client.get_object(Bucket=self.bucket, Key=key)["Body"]
            data = bytes(body.read(limit + 1))
            body.close()
            return data

        data = self._s3("get", key, get)
        if data is not None and len(data) > limit:
            raise StoreError(f"s3://{self.bucket}/{key} is over {limit} bytes: not a schedule object")
        return data

    def _list(self, prefix: str) -> list[str]:
        def keys() -> list[str]:
            page = self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=MAX_ENTRIES + 1)
            return [obj["Key"] for obj in page.get("Contents", []) if "Key" in obj]

        return sorted(self._s3("list", prefix, keys) or [])

    def segment(self, engine_id: str, seq: int) -> tuple[ScheduleRecord, ...] | None:
        """One shipped segment's records, checked (`StoreError` when they are not a segment of `engine_id`); None
        when it is not there."""
        found = self._load(engine_id, seq)
        return None if found is None else found[1]

    def _load(
        self, engine_id: str, seq: int, *, entry: ScheduleIndexEntry | None = None
    ) -> tuple[str, tuple[ScheduleRecord, ...]] | None:
        """The segment's sha256 and checked records, from the cache or S3 (then kept); with the index `entry` that
        names it, its sha256 must be the entry's (checked before the bytes are decoded)."""
        key = schedule_segment_key(engine_id, seq)
        with self._cache_lock:
            hit = self._cache.get((engine_id, seq))
        if hit is not None:
            self._check_sha256(entry, key, hit.sha256)
            return hit.sha256, hit.records
        data = self._get(key, MAX_SEGMENT_BYTES)
        if data is None:
            return None
        self.segments_read += 1
        sha256 = hashlib.sha256(data).hexdigest()
        self._check_sha256(entry, key, sha256)
        records = self._decode(key, data, engine_id)
        with self._cache_lock, contextlib.suppress(ValueError):  # ValueError: larger than the whole cache
            self._cache[(engine_id, seq)] = _Checked(sha256, len(data), records)
        return sha256, records

    @staticmethod
    def _check_sha256(entry: ScheduleIndexEntry | None, key: str, sha256: str) -> None:
        if entry is not None and sha256 != entry.segment_sha256:
            raise StoreError(f"the schedule index of {entry.external_request_id} does not match {key} (sha256)")

    def _decode(self, key: str, data: bytes, engine_id: str) -> tuple[ScheduleRecord, ...]:
        try:
            return decode_segment(data, engine_id)
        except ContractError as exc:
            raise StoreError(f"s3://{self.bucket}/{key} is not a schedule segment of {engine_id}: {exc}") from exc

    # -- the join ----------------------------------------------------------------------------------------------

    def entries_for(self, envelope: Envelope) -> list[ScheduleIndexEntry]:
        """The index entries of `envelope`'s engine request(s), each checked against its key and the envelope."""
        ref = envelope.schedule
        if ref is None:
            raise ScheduleNotFoundError(f"envelope of request {envelope.request_id} names no schedule")
        expected = external_request_id_for(envelope.endpoint, envelope.request_id)
        if ref.external_request_id != expected:
            raise StoreError(
                f"envelope of request {envelope.request_id} names schedule {ref.external_request_id!r}, "
                f"not its own engine request {expected!r}"
            )
        keys = self._list(schedule_index_prefix(expected))
        if not keys:
            raise ScheduleNotFoundError(f"no schedule is indexed under {expected} (not shipped yet, or not recorded)")
        if len(keys) > MAX_ENTRIES:
            raise StoreError(f"over {MAX_ENTRIES} schedule index entries under {schedule_index_prefix(expected)}")
        entries = [entry for key in keys if (entry := self._entry(key, expected)) is not None]
        if len({e.engine_id for e in entries}) > 1:
            engines = sorted({e.engine_id for e in entries})
            raise StoreError(f"schedule index of {expected} names several engines: {engines}")
        if not entries:
            raise ScheduleNotFoundError(f"no schedule is indexed under {expected}")
        return entries

    def _entry(self, key: str, external_request_id: str) -> ScheduleIndexEntry | None:
        """The index entry at `key`, which must be filed under its own ids and `external_request_id`."""
        body = self._get(key, MAX_INDEX_ENTRY_BYTES)
        if body is None:
            return None
        try:
            entry = decode_index_entry(body)
        except ContractError as exc:
            raise StoreError(f"schedule index s3://{self.bucket}/{key} is malformed: {exc}") from exc
        if key != schedule_index_key(entry.external_request_id, entry.engine_request_id) or (
            entry.external_request_id != external_request_id
        ):
            raise StoreError(f"schedule index s3://{self.bucket}/{key} is not filed under its own ids")
        return entry

    def provider_entry(self, engine_id: str, engine_request_id: str) -> ScheduleIndexEntry | None:
        """The index entry of one engine request of `engine_id`, found by its own ids; None when it is not indexed
        (a request some other client than the sidecar sent the engine, or one whose id the recorder had to cut)."""
        external = external_request_id(engine_request_id)
        entry = self._entry(schedule_index_key(external, engine_request_id), external)
        if entry is not None and entry.engine_id != engine_id:
            raise StoreError(
                f"the schedule index of {engine_request_id} names engine {entry.engine_id}, not {engine_id}"
            )
        return entry

    def indexed_arrival(self, entry: ScheduleIndexEntry) -> tuple[RequestArrival, tuple[ScheduleRecord, ...]]:
        """The arrival an entry indexes, from the segment it names, checked against the entry's sha256."""
        where = schedule_segment_key(entry.engine_id, entry.segment)
        found = self._load(entry.engine_id, entry.segment, entry=entry)
        if found is None:
            raise StoreError(f"the schedule index of {entry.external_request_id} names {where}, which is missing")
        records = found[1]
        for record in records:
            if isinstance(record, RequestArrival) and entry.matches_arrival(record):
                return record, records
        raise StoreError(f"{where} holds no arrival of {entry.engine_request_id} at step {entry.step}")

    def records_for(self, envelope: Envelope, *, before_steps: int = 0) -> ScheduleWindow:
        """The window of `envelope`'s engine records (module docstring); `before_steps`: how many steps before
        the target's arrival it starts (the companions already running, the prefix-cache providers)."""
        entries = self.entries_for(envelope)
        engine_id = entries[0].engine_id
        arrivals: list[RequestArrival] = []
        segments: dict[int, tuple[ScheduleRecord, ...]] = {}
        for entry in entries:
            arrival, records = self.indexed_arrival(entry)
            arrivals.append(arrival)
            segments[entry.segment] = records
        start_step = max(min(a.step for a in arrivals) - before_steps, 0)
        first = min(segments)
        gap: str | None = None
        # an arrival is written before the first step that schedules it and a segment may close in between, so a
        # segment reaches back only when a step *before* the start is in it (the start step's arrivals then are)
        reached_back = self._first_step(segments[first]) < start_step
        while not reached_back and first > 0 and len(segments) < self.max_segments:
            found = self.segment(engine_id, first - 1)
            if found is None:
                gap = f"segment {first - 1} of engine {engine_id} is not there (the window starts later)"
                break
            first -= 1
            segments[first] = found
            reached_back = self._first_step(found) < start_step
        reached_back = reached_back or first == 0
        targets = {a.engine_request_id for a in arrivals}
        last = max(segments)
        for seq in range(min(segments), last + 1):  # fill segments between two children's arrivals
            if seq not in segments:
                found = self.segment(engine_id, seq)
                if found is None:
                    gap = gap or f"segment {seq} of engine {engine_id} is not there"
                    break
                segments[seq] = found
        unfinished = targets - self._finished(segments.values())
        while unfinished and gap is None and len(segments) < self.max_segments:
            found = self.segment(engine_id, last + 1)
            if found is None:
                gap = f"the log ends at segment {last} of engine {engine_id} before the request finished"
                break
            last += 1
            segments[last] = found
            unfinished -= self._finished([found])
        if unfinished and gap is None:
            gap = f"the request did not finish within {self.max_segments} segments"
        return ScheduleWindow(
            engine=self._engine(engine_id, segments),
            arrivals=tuple(sorted(arrivals, key=lambda a: (a.step, a.engine_request_id))),
            records=self._window(segments, start_step, targets),
            first_segment=first,
            last_segment=last,
            complete=not unfinished and reached_back and gap is None,
            gap=gap,
        )

    @staticmethod
    def _first_step(records: tuple[ScheduleRecord, ...]) -> int:
        steps = [r.step for r in records if isinstance(r, ScheduleStep)]
        return min(steps) if steps else 1 << 62

    @staticmethod
    def _finished(segments: Iterable[tuple[ScheduleRecord, ...]]) -> set[str]:
        done: set[str] = set()
        for records in segments:
            for record in records:
                if isinstance(record, ScheduleStep):
                    done.update(record.finished)
        return done

    def _engine(self, engine_id: str, segments: dict[int, tuple[ScheduleRecord, ...]]) -> EngineStart | None:
        records = segments.get(0)
        if records is None:
            records = self.segment(engine_id, 0) or ()
        start = records[0] if records else None
        return start if isinstance(start, EngineStart) else None

    @staticmethod
    def _window(
        segments: dict[int, tuple[ScheduleRecord, ...]], start_step: int, targets: set[str]
    ) -> tuple[ScheduleRecord, ...]:
        """The steps and arrivals from `start_step` on, in segment order, up to the step that finished the last
        target (nothing after it)."""
        out: list[ScheduleRecord] = []
        pending = set(targets)
        for seq in sorted(segments):
            for record in segments[seq]:
                if isinstance(record, EngineStart) or record.step < start_step:
                    continue
                out.append(record)
                if isinstance(record, ScheduleStep):
                    pending -= set(record.finished)
                    if not pending:
                        return tuple(out)
        return tuple(out)
