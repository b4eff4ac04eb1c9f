"""Where a schedule segment goes: the audit bucket (the segment and its index entries) and the schedules topic.

Both ends are written once or collapse duplicates, so the shipper may publish a segment again after a crash:

- S3 (`SegmentStore`, blocking: call it in a thread): the segment under `schemas.layout.schedule_segment_key` with
  Object Lock retention and ``IfNoneMatch="*"``; a key already there holding the same bytes is a redelivery
  (success), other bytes are a conflict (another writer used that engine id and seq): refused for good. Then one
  `schemas.schedule_delivery.ScheduleIndexEntry` per arrival under `schemas.layout.schedule_index_key`, written
  once the same way; an entry another segment wrote first is kept (counted, logged): the reader checks every
  entry against the segment it names, so a wrong one can never make it read another request's schedule.
  Last, the segment's leaf in its engine's Merkle log (`log_segment`: `schemas.schedule_proof` says what it
  commits to), so the schedule is evidence as envelopes are: the checkpointer signs the log, ``reprolane audit
  verify`` checks every segment against it, and a re-executable bundle proves its window from it.
- Kafka (`SegmentProducer`): the segment's bytes on `schemas.layout.TOPIC_SCHEDULES`, key = engine id, headers
  engine id, seq and sha256, ``acks="all"``; at least once (consumers collapse by engine id and seq). A record
  the broker refuses for good is `RecordsRefused`, anything else a `SinkError` (retried).

Every botocore and aiokafka exception is translated here (`capture.publishing.s3_workers.run_put` for S3 PUTs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from capture.errors import RecordsRefused, SinkError
from capture.ledger.errors import LedgerError
from capture.ledger.merkle_log import RecentIds, append_leaves
from capture.ledger.store import LedgerStore
from capture.publishing.s3_workers import Put, PutOutcome, PutRefusedError, run_put
from infra.clients.kafka import aiokafka_kwargs, kafka_errors, start_client, stop_quietly
from infra.clients.s3 import S3Policy, make_s3_client
from schemas.layout import (
    HEADER_DLQ_REASON,
    HEADER_DLQ_SINK,
    HEADER_ENGINE_ID,
    HEADER_SCHEMA,
    HEADER_SEGMENT_SEQ,
    HEADER_SEGMENT_SHA256,
    MAX_MESSAGE_BYTES,
    TOPIC_DEAD_LETTER,
    TOPIC_SCHEDULES,
    schedule_index_key,
    schedule_log,
    schedule_segment_key,
)
from schemas.schedule import SCHEDULE_SCHEMA_VERSION, ScheduleRecord
from schemas.schedule_delivery import MAX_SEGMENT_BYTES, ScheduleIndexEntry
from schemas.schedule_proof import record_hashes, segment_leaf

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from capture.schedule.shipper_settings import ShipperSettings

log = logging.getLogger(__name__)

#: The minimum retention of a segment stored late (its recorder's clock is not trusted to be ahead of ours).
MIN_RETENTION: Final = timedelta(days=1)
_REASON_LIMIT: Final = 1000
_SINK: Final = "schedule-shipper"
#: Segments whose leaf one store remembers having appended, so that a segment retried for Kafka is logged once.
LOGGED_REMEMBERED: Final = 1024


class SegmentConflictError(SinkError):
    """The segment's key holds other bytes: this segment can never be stored there."""


class SegmentStore:
    """The S3 end (blocking)."""

    def __init__(
        self, client: S3Client, bucket: str, *, retention: timedelta | None, lock_mode: str = "COMPLIANCE"
    ) -> None:
        self._client = client
        self.bucket = bucket
        self.retention = retention
        self.lock_mode = lock_mode
        self.index_conflicts = 0
        self._ledger = LedgerStore(client, bucket, lock_mode)
        self._logged = RecentIds(LOGGED_REMEMBERED)  # segment ids whose leaf this store appended

    @classmethod
    def from_settings(cls, settings: ShipperSettings) -> SegmentStore:
        days = settings.retention_days
        return cls(
            make_s3_client(settings, policy=S3Policy.SIDECAR),
            settings.s3_bucket,
            retention=timedelta(days=days) if days > 0 else None,
            lock_mode=settings.object_lock_mode,
        )

    def put_segment(self, engine_id: str, seq: int, data: bytes, sha256: str) -> PutOutcome:
        """Store the segment once; `SegmentConflictError` when its key holds other bytes, `PutRefusedError` when
        S3 refuses it for good, `SinkError` for anything worth retrying."""
        params: dict[str, Any] = {
            "ContentType": "application/x-ndjson",
            "IfNoneMatch": "*",
            "Metadata": {"sha256": sha256, "schema": SCHEDULE_SCHEMA_VERSION},
        }
        if self.retention is not None:
            params.update(ObjectLockMode=self.lock_mode, ObjectLockRetainUntilDate=self._retain_until())
        key = schedule_segment_key(engine_id, seq)
        outcome = run_put(self._client, self.bucket, Put(key, data, params, seq=seq, index_of=True))
        if outcome is PutOutcome.CONFLICT:
            raise SegmentConflictError(f"s3 {self.bucket}/{key} already holds other bytes than this segment")
        return outcome

    def put_index(self, entries: Sequence[ScheduleIndexEntry]) -> int:
        """Write each entry once; the number that found another entry under their key (kept, logged)."""
        conflicts = 0
        for entry in entries:
            key = schedule_index_key(entry.external_request_id, entry.engine_request_id)
            params = {"ContentType": "application/json", "IfNoneMatch": "*"}
            put = Put(key, entry.encode(), params, seq=entry.segment, index_of=True)
            if run_put(self._client, self.bucket, put) is PutOutcome.CONFLICT:
                conflicts += 1
                log.warning("shipper: index %s already names another arrival; kept it", key[:300])
        self.index_conflicts += conflicts
        return conflicts

    def log_segment(self, engine_id: str, seq: int, records: Sequence[ScheduleRecord]) -> int | None:
        """Append the segment's leaf to its engine's Merkle log (after the segment is stored: a leaf never names
        nothing); its index, or None when this store appended it already (the segment retried because Kafka was
        down). `SinkError` when S3 fails (retried: a leaf appended twice is harmless, the first counts)."""
        leaf = segment_leaf(engine_id, seq, record_hashes(records))
        if leaf.envelope_id in self._logged:
            return None
        try:
            at = append_leaves(
                self._ledger, schedule_log(engine_id), [leaf], self._retain_until() if self.retention else None
            )
        except LedgerError as exc:
            raise SinkError(f"schedule log of engine {engine_id}: {exc}") from exc
        self._logged.add_all([leaf.envelope_id])
        return at

    def _retain_until(self) -> datetime:
        assert self.retention is not None
        return datetime.now(UTC) + max(self.retention, MIN_RETENTION)


class SegmentProducer:
    """The Kafka end: one record per segment, and the dead letter of a refused one."""

    def __init__(self, settings: ShipperSettings, *, request_timeout_ms: int = 10_000) -> None:
        if not settings.kafka_bootstrap:
            raise SinkError("kafka_bootstrap is not set")
        self._settings = settings
        self._request_timeout_ms = request_timeout_ms
        self._producer: Any = None

    async def _started(self) -> Any:
        from aiokafka import AIOKafkaProducer

        if self._producer is None:
            producer = AIOKafkaProducer(
                **aiokafka_kwargs(self._settings),
                acks="all",
                enable_idempotence=False,  # Tansu refuses InitProducerId; delivery is at least once anyway
                max_request_size=MAX_MESSAGE_BYTES,
                compression_type="gzip",
                request_timeout_ms=self._request_timeout_ms,
                retry_backoff_ms=200,
                client_id=f"reprolane-{self._settings.shipper_id}",
            )
            self._producer = await start_client(
                producer, what=f"kafka {self._settings.kafka_bootstrap}: cannot connect", error=SinkError
            )
        return self._producer

    async def send(self, engine_id: str, seq: int, data: bytes, sha256: str) -> None:
        """Confirmed when this returns; `RecordsRefused` when the broker refuses the record for good."""
        from aiokafka.errors import MessageSizeTooLargeError, RecordTooLargeError

        headers = [
            (HEADER_ENGINE_ID, engine_id.encode()),
            (HEADER_SEGMENT_SEQ, str(seq).encode()),
            (HEADER_SEGMENT_SHA256, sha256.encode()),
            (HEADER_SCHEMA, SCHEDULE_SCHEMA_VERSION.encode()),
        ]
        producer = await self._started()
        try:
            future = await producer.send(TOPIC_SCHEDULES, value=data, key=engine_id.encode(), headers=headers)
            await future
        except (MessageSizeTooLargeError, RecordTooLargeError) as exc:
            raise RecordsRefused("kafka", {seq: (type(exc).__name__, f"kafka refused the segment: {exc!r}")}) from exc
        except kafka_errors() as exc:
            raise SinkError(f"kafka send to {TOPIC_SCHEDULES} failed: {exc!r}") from exc

    async def dead_letter(self, engine_id: str, seq: int, payload: bytes, code: str, reason: str) -> bool:
        """The refused segment on the dead-letter topic (its bytes when they fit, else headers only); False
        (logged) when Kafka cannot take it now: the local quarantine holds it either way."""
        headers = [
            (HEADER_DLQ_REASON, f"{code}: {reason}"[:_REASON_LIMIT].encode()),
            (HEADER_DLQ_SINK, _SINK.encode()),
            (HEADER_ENGINE_ID, engine_id.encode()),
            (HEADER_SEGMENT_SEQ, str(seq).encode()),
        ]
        value = payload if len(payload) <= MAX_SEGMENT_BYTES else b""
        unsent: tuple[type[BaseException], ...] = (*kafka_errors(), SinkError, TimeoutError)
        try:
            producer = await self._started()
            future = await producer.send(TOPIC_DEAD_LETTER, value=value, key=engine_id.encode(), headers=headers)
            await asyncio.wait_for(future, 10.0)
            return True
        except unsent as exc:
            log.warning("shipper: dead letter of %s/%08d not sent (%r); it stays in quarantine", engine_id, seq, exc)
            return False

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_quietly(producer)


__all__ = ["PutRefusedError", "SegmentConflictError", "SegmentProducer", "SegmentStore"]
