"""Where spooled envelopes go: a Kafka topic and an S3 bucket with Object Lock.

Both sinks take a batch of `Outgoing` records and either confirm *every* record or raise `SinkError`; every
aiokafka / botocore exception is translated here, so the publisher only ever sees `SinkError`.

Kafka (`KafkaSink`): topic `schemas.layout.TOPIC_ENVELOPES`, key = request id, value = the canonical envelope
bytes, headers ``reprolane-envelope-id`` and ``reprolane-schema``; ``acks="all"``, linger 5 ms, all sends of a
batch awaited together. Idempotence is off on purpose: Tansu refuses InitProducerId, and delivery is
at-least-once anyway (duplicates collapse by envelope id downstream). An envelope over
`schemas.layout.CLAIM_CHECK_BYTES` is sent as a `schemas.claim_check.ClaimCheck` naming its envelope object
(header ``reprolane-claim-check``); the publisher sends such a batch to Kafka only after S3 stored it
(`Sink.refers_to_objects`), so a reference never points at nothing.

A record a sink refuses for good (Kafka: record too large, invalid or corrupt record; S3: a 400 with one of
`capture.s3_workers.PERMANENT_CODES`) is reported in `RecordsRefused` once every other record of the batch is
confirmed; the publisher quarantines it (`capture.quarantine`). Every other failure is a plain `SinkError`,
retried: a batch with both is retried whole.

S3 (`S3Sink`), per envelope, with boto3 in a thread pool, or in worker processes with ``s3_processes``
(`capture.s3_workers`: boto3's CPU per PUT is several times what capturing a request costs):

- ``envelopes/tenant=.../date=.../<envelope_id>.json`` with Object Lock retention until
  ``captured_at + retention days`` (the tenant's entry in ``retention_days_by_tenant``, else ``retention_days``;
  0 = no retention header) (if that has passed already, e.g. a backlog older than the retention,
  until now + `MIN_RETENTION`: an audit record is never stored unprotected) and ``IfNoneMatch="*"``:
  the key is a content address, so 412 (already there) means the same bytes are there, which is success.
- index objects ``index/request-id/<request_id>.json`` and, with a workflow,
  ``index/workflow/<id>/<step>-<request_id>.json``, body ``{"envelope_id", "key", "tenant", "captured_at"}``,
  written without retention and *once* (``IfNoneMatch="*"``): the first record to claim a request id (or a
  workflow step) keeps it. The sidecar's own request ids are unique per request, so a second claimant is
  another sidecar or a replayed client id: it is counted in ``index_conflicts_total``, logged, and its envelope
  stays stored under its own content address (the index is not moved to it). A redelivery of the same record
  finds its own body there, which is not a conflict. Within one batch the lowest spool seq per index key is
  written; the later ones are conflicts. Readers check that the entry and the envelope agree
  (`replayer.store`).
- with a client ``X-Request-Id``, ``index/client-request-id/tenant=<t>/<client id>/<request_id>.json`` (same
  body), written once with ``IfNoneMatch="*"``: one per envelope, so a tenant's retries are all found.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from capture.errors import RecordsRefused, SinkError
from capture.ledger.errors import LedgerError
from capture.ledger.merkle_log import MerkleLogWriter
from capture.ledger.store import LedgerStore
from capture.quarantine import Refusal
from capture.s3_workers import Put, PutFailure, PutOutcome, S3Processes, as_failure, run_put
from capture.spool import SpoolEntry
from infra.clients.kafka import aiokafka_kwargs, kafka_errors
from infra.clients.s3 import S3Policy, make_s3_client
from schemas import sha256_hex
from schemas.claim_check import claim_check_for
from schemas.envelope import STARTED_ERROR_TYPE
from schemas.layout import (
    CLAIM_CHECK_BYTES,
    HEADER_CLAIM_CHECK,
    HEADER_DLQ_REASON,
    HEADER_DLQ_SINK,
    HEADER_ENVELOPE_ID,
    HEADER_SCHEMA,
    MAX_MESSAGE_BYTES,
    TOPIC_DEAD_LETTER,
    TOPIC_ENVELOPES,
    client_request_index_key,
    envelope_key,
    index_body,
    request_index_key,
    workflow_index_key,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from capture.metrics import CaptureMetrics
    from capture.settings import CaptureSettings

log = logging.getLogger(__name__)

MIN_RETENTION = timedelta(days=1)
#: Kafka's INVALID_RECORD error code (aiokafka has no class for it: it arrives as a plain KafkaError).
_INVALID_RECORD = 87
#: Longest dead-letter reason header (a refusal message can quote a whole key).
_REASON_LIMIT = 1000


def _kafka_refusals() -> tuple[type[BaseException], ...]:
    """aiokafka's errors for a record the broker (or the producer's own size check) will never take."""
    from aiokafka.errors import (
        CorruptRecordException,
        InvalidMessageError,
        MessageSizeTooLargeError,
        RecordListTooLargeError,
        RecordTooLargeError,
    )

    return (
        MessageSizeTooLargeError,
        RecordTooLargeError,
        RecordListTooLargeError,
        InvalidMessageError,
        CorruptRecordException,
    )


class _WorkflowFields(msgspec.Struct):
    workflow_id: str
    step: int


class _OutcomeFields(msgspec.Struct):
    error_type: str | None = None


class _RouteFields(msgspec.Struct):
    """The members of an envelope's canonical JSON the sinks route by (msgspec skips the rest unparsed, far
    cheaper than ``json.loads`` of a whole envelope, per envelope published: benchmarks/bench_envelope.py)."""

    request_id: str
    tenant: str
    captured_at: str
    schema_version: str
    workflow: _WorkflowFields | None = None
    client_request_id: str | None = None
    outcome: _OutcomeFields | None = None


_ROUTE_DECODER = msgspec.json.Decoder(_RouteFields)


@dataclass(frozen=True)
class Outgoing:
    """A spooled envelope with the few fields the sinks route by (read from its canonical JSON)."""

    seq: int
    payload: bytes
    envelope_id: str
    request_id: str
    tenant: str
    captured_at: datetime
    schema_version: str
    workflow_id: str | None
    workflow_step: int | None
    client_request_id: str | None = None
    #: A guaranteed stream's *started* record (outcome ``incomplete``, `schemas.Envelope.is_started_record`):
    #: stored and logged like any envelope, but not indexed, so the write-once index entries go to the envelope
    #: that says how the request ended (a started record no finished one followed is found by its object key).
    started: bool = False

    @classmethod
    def from_entry(cls, entry: SpoolEntry) -> Outgoing:
        try:
            doc = _ROUTE_DECODER.decode(entry.payload)
            return cls(
                seq=entry.seq,
                payload=entry.payload,
                envelope_id=sha256_hex(entry.payload),
                request_id=doc.request_id,
                tenant=doc.tenant,
                captured_at=datetime.fromisoformat(doc.captured_at).astimezone(UTC),
                schema_version=doc.schema_version,
                workflow_id=doc.workflow.workflow_id if doc.workflow is not None else None,
                workflow_step=doc.workflow.step if doc.workflow is not None else None,
                client_request_id=doc.client_request_id,
                started=doc.outcome is not None and doc.outcome.error_type == STARTED_ERROR_TYPE,
            )
        except (ValueError, msgspec.DecodeError) as exc:
            raise SinkError(f"spool record seq {entry.seq} is not a routable envelope: {exc!r}") from exc

    @property
    def object_key(self) -> str:
        return envelope_key(self.envelope_id, self.tenant, self.captured_at)

    def index_keys(self) -> list[str]:
        if self.started:
            return []
        keys = [request_index_key(self.request_id)]
        if self.workflow_id is not None and self.workflow_step is not None:
            keys.append(workflow_index_key(self.workflow_id, self.workflow_step, self.request_id))
        return keys

    def index_body(self) -> bytes:
        return index_body(self.envelope_id, self.object_key, self.tenant, self.captured_at)

    @property
    def claim_checked(self) -> bool:
        """True when Kafka gets a claim check instead of the payload (see module docstring)."""
        return len(self.payload) > CLAIM_CHECK_BYTES

    def with_payload(self, payload: bytes, schema_version: str) -> Outgoing:
        """This record with another payload (the sealed one, `capture.ledger.sealing`): routed and keyed the same."""
        return dataclasses.replace(self, payload=payload, schema_version=schema_version)


class Sink(Protocol):
    """A destination the publisher drains to. `publish` confirms every record of the batch or raises SinkError."""

    name: str
    #: True for a sink whose records may refer to objects the other sinks store (Kafka's claim checks): the
    #: publisher gives it a batch holding such records only after the others confirmed it.
    refers_to_objects: bool

    async def publish(self, batch: Sequence[Outgoing]) -> None: ...

    async def close(self) -> None: ...


class KafkaSink:
    name = "kafka"
    refers_to_objects = True

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        topic: str = TOPIC_ENVELOPES,
        dead_letter_topic: str = TOPIC_DEAD_LETTER,
        request_timeout_ms: int = 10000,
    ):
        if not settings.kafka_bootstrap:
            raise SinkError("kafka_bootstrap is not set")
        self.topic = topic
        self.dead_letter_topic = dead_letter_topic
        self._settings = settings
        self._request_timeout_ms = request_timeout_ms
        self._producer: Any = None

    def _producer_kwargs(self) -> dict[str, Any]:
        return {
            **aiokafka_kwargs(self._settings),
            "acks": "all",
            "enable_idempotence": False,
            "linger_ms": 5,
            "max_request_size": MAX_MESSAGE_BYTES,  # aiokafka's 1 MiB default would strand large envelopes
            "compression_type": "gzip",  # JSON of token ids and logprobs shrinks 1.7-3.6x (benchmarks/envelope_size.py)
            "request_timeout_ms": self._request_timeout_ms,
            "retry_backoff_ms": 200,
            "client_id": f"reprolane-{self._settings.sidecar_id}",
        }

    async def _ensure_started(self) -> Any:
        from aiokafka import AIOKafkaProducer

        if self._producer is None:
            producer = AIOKafkaProducer(**self._producer_kwargs())
            try:
                await producer.start()
            except kafka_errors() as exc:
                await _quiet_stop(producer)
                raise SinkError(f"kafka {self._settings.kafka_bootstrap}: cannot connect: {exc!r}") from exc
            self._producer = producer
        return self._producer

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        producer = await self._ensure_started()
        refusals = _kafka_refusals()
        refused: dict[int, tuple[str, str]] = {}
        sent: list[tuple[Outgoing, Any]] = []
        try:
            for item in batch:
                value, headers = (
                    item.payload,
                    [
                        (HEADER_ENVELOPE_ID, item.envelope_id.encode()),
                        (HEADER_SCHEMA, item.schema_version.encode()),
                    ],
                )
                if item.claim_checked:
                    value = claim_check_for(item.envelope_id, item.object_key, item.payload).encode()
                    headers.append((HEADER_CLAIM_CHECK, b"1"))
                try:
                    future = await producer.send(self.topic, value=value, key=item.request_id.encode(), headers=headers)
                except refusals as exc:  # the producer's own checks (max_request_size) refuse before sending
                    refused[item.seq] = (type(exc).__name__, f"kafka refused the record: {exc!r}"[:_REASON_LIMIT])
                    continue
                sent.append((item, future))
            results = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        except kafka_errors() as exc:
            raise SinkError(f"kafka send to {self.topic} failed: {exc!r}") from exc
        failed: list[BaseException] = []
        for (item, _), result in zip(sent, results, strict=True):
            if isinstance(result, refusals) or getattr(result, "errno", None) == _INVALID_RECORD:
                refused[item.seq] = (type(result).__name__, f"kafka refused the record: {result!r}"[:_REASON_LIMIT])
            elif isinstance(result, BaseException):
                failed.append(result)
        if failed:
            raise SinkError(f"kafka: {len(failed)} of {len(batch)} sends to {self.topic} failed: {failed[0]!r}")
        if refused:
            raise RecordsRefused(self.name, refused)

    async def dead_letter(self, refusal: Refusal, *, timeout_s: float = 10.0) -> bool:
        """Send a refused record to the dead-letter topic (`TOPIC_DEAD_LETTER`) with its reason; False (logged)
        when Kafka cannot take it now (the local quarantine holds it either way). A value Kafka refuses for good
        (too large) is sent again empty: the headers still say what was refused and why."""
        headers = [
            (HEADER_DLQ_REASON, f"{refusal.code}: {refusal.reason}"[:_REASON_LIMIT].encode()),
            (HEADER_DLQ_SINK, refusal.sink.encode()),
            (HEADER_ENVELOPE_ID, (refusal.envelope_id or "").encode()),
        ]
        key = (refusal.request_id or "")[:256].encode() or None
        unsent: tuple[type[BaseException], ...] = (*kafka_errors(), SinkError, TimeoutError)
        values = [refusal.payload, b""] if len(refusal.payload) <= CLAIM_CHECK_BYTES else [b""]
        for value in values:
            try:
                producer = await self._ensure_started()
                future = await producer.send(self.dead_letter_topic, value=value, key=key, headers=headers)
                await asyncio.wait_for(future, timeout_s)
                return True
            except _kafka_refusals() as exc:
                log.warning("publisher: dead letter of seq %d refused with its value (%r)", refusal.seq, exc)
            except unsent as exc:
                log.warning("publisher: dead letter of seq %d not sent (%r); it stays in quarantine", refusal.seq, exc)
                return False
        return False

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _quiet_stop(producer)


async def _quiet_stop(producer: Any) -> None:
    with contextlib.suppress(*kafka_errors()):
        await producer.stop()


class S3Sink:
    name = "s3"
    refers_to_objects = False

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        client: S3Client | None = None,
        workers: int = 8,
        processes: int = 0,
        metrics: CaptureMetrics | None = None,
    ) -> None:
        """``processes`` > 0: PUTs run in that many worker processes (`capture.s3_workers`), each with
        ``workers`` threads; else in ``workers`` threads of this process with `client` (built when None)."""
        self.bucket = settings.s3_bucket
        self.retention = timedelta(days=settings.retention_days) if settings.retention_days > 0 else None
        self.retention_by_tenant = {
            tenant: timedelta(days=days) if days > 0 else None
            for tenant, days in settings.retention_days_by_tenant.items()
        }
        self.lock_mode = settings.object_lock_mode
        self._metrics = metrics
        self.index_conflicts = 0
        self._processes: S3Processes | None = None
        self._threads: tuple[S3Client, ThreadPoolExecutor] | None = None
        if processes > 0:
            self._processes = S3Processes(settings, processes, threads=workers)
        else:
            self._threads = (
                client if client is not None else make_s3_client(settings, policy=S3Policy.SIDECAR, threads=workers),
                ThreadPoolExecutor(max_workers=workers, thread_name_prefix="capture-s3"),
            )

    def retain_until(self, captured_at: datetime, tenant: str | None = None) -> datetime | None:
        retention = self.retention_by_tenant.get(tenant, self.retention) if tenant is not None else self.retention
        if retention is None:
            return None
        until = captured_at + retention
        now = datetime.now(UTC)
        return until if until > now else now + MIN_RETENTION

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        puts = [self._envelope_put(item) for item in batch]
        first: dict[str, Outgoing] = {}
        for item in sorted(batch, key=lambda o: o.seq):
            for key in item.index_keys():
                if key in first:
                    self._conflict(key, first[key].envelope_id, item.envelope_id)
                else:
                    first[key] = item
        puts += [
            Put(
                key,
                item.index_body(),
                {"ContentType": "application/json", "IfNoneMatch": "*"},
                seq=item.seq,
                index_of=True,
            )
            for key, item in first.items()
        ]
        # the client's X-Request-Id, per tenant: one object per envelope, written once (never overwritten)
        puts += [
            Put(
                client_request_index_key(item.tenant, item.client_request_id, item.request_id),
                item.index_body(),
                {"ContentType": "application/json", "IfNoneMatch": "*"},
                created_is_enough=True,
                seq=item.seq,
            )
            for item in batch
            if item.client_request_id is not None and not item.started
        ]
        if self._threads is None:
            assert self._processes is not None  # one of the two modes, chosen in __init__
            outcomes = await self._processes.run(self.bucket, puts)
        else:
            loop, (client, pool) = asyncio.get_running_loop(), self._threads
            results = await asyncio.gather(
                *(loop.run_in_executor(pool, run_put, client, self.bucket, put) for put in puts),
                return_exceptions=True,
            )
            outcomes = []
            for put, result in zip(puts, results, strict=True):
                if isinstance(result, SinkError):
                    outcomes.append(as_failure(put, result))
                elif isinstance(result, BaseException):
                    raise SinkError(f"s3: unexpected error: {result!r}") from result
                else:
                    outcomes.append(result)
        self._settle(batch, puts, outcomes)

    def _settle(
        self, batch: Sequence[Outgoing], puts: Sequence[Put], outcomes: Sequence[PutOutcome | PutFailure]
    ) -> None:
        """Count index conflicts; raise `SinkError` for any transient failure, else `RecordsRefused`."""
        by_seq = {item.seq: item for item in batch}
        failures = [o for o in outcomes if isinstance(o, PutFailure)]
        for put, outcome in zip(puts, outcomes, strict=True):
            if outcome is PutOutcome.CONFLICT:
                self._conflict(put.key, None, by_seq[put.seq].envelope_id)
        transient = [f for f in failures if f.refused_code is None]
        if transient:
            raise SinkError(f"s3: {len(failures)} of {len(puts)} puts failed; first: {transient[0].message}")
        refused: dict[int, tuple[str, str]] = {}
        for failure in failures:
            assert failure.refused_code is not None
            refused.setdefault(failure.seq, (failure.refused_code, failure.message))
        if refused:
            raise RecordsRefused(self.name, refused)

    def _conflict(self, key: str, kept: str | None, refused: str) -> None:
        self.index_conflicts += 1
        if self._metrics is not None:
            self._metrics.index_conflicts_total.inc()
        log.warning(
            "s3: index %s already names %s; envelope %s keeps its object but not the index entry",
            key[:300],
            kept or "another envelope",
            refused,
        )

    def _envelope_put(self, item: Outgoing) -> Put:
        params: dict[str, Any] = {
            "ContentType": "application/json",
            "IfNoneMatch": "*",
            "Metadata": {"envelope-id": item.envelope_id, "schema": item.schema_version},
        }
        until = self.retain_until(item.captured_at, item.tenant)
        if until is not None:
            params.update(ObjectLockMode=self.lock_mode, ObjectLockRetainUntilDate=until)
        return Put(item.object_key, item.payload, params, created_is_enough=True, seq=item.seq)

    async def close(self) -> None:
        if self._threads is not None:
            self._threads[1].shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            await self._processes.close()


class AuditLogSink:
    """The Merkle log as a publisher "then" sink (`capture.ledger.merkle_log`): a batch's ids are appended after
    every sink stored it; a ledger failure is a `SinkError`, retried like any failing sink."""

    name = "audit-log"
    refers_to_objects = False

    def __init__(self, writer: MerkleLogWriter) -> None:
        self.writer = writer

    @classmethod
    def from_settings(cls, settings: CaptureSettings) -> AuditLogSink:
        """Writes into the envelope bucket, locked as long as the longest envelope retention of any tenant."""
        days = max([settings.retention_days, *settings.retention_days_by_tenant.values()])
        client = make_s3_client(settings, policy=S3Policy.SIDECAR)
        store = LedgerStore(client, settings.s3_bucket, settings.object_lock_mode)
        return cls(MerkleLogWriter(store, timedelta(days=days) if days > 0 else None))

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        try:
            await self.writer.append(batch)
        except LedgerError as exc:
            raise SinkError(str(exc)) from exc

    async def close(self) -> None:
        await self.writer.close()


def default_sinks(settings: CaptureSettings, metrics: CaptureMetrics | None = None) -> list[Sink]:
    """The configured sinks: Kafka when `kafka_bootstrap` is set, S3 when `s3_endpoint` or `s3_access_key` is
    (an S3 with neither would be AWS with ambient credentials: say so with an access key). The publisher acks
    only what *every* one of them has confirmed; production runs both."""
    sinks: list[Sink] = []
    if settings.kafka_bootstrap:
        sinks.append(KafkaSink(settings))
    if settings.s3_endpoint or settings.s3_access_key:
        sinks.append(S3Sink(settings, processes=settings.s3_processes, metrics=metrics))
    if not sinks:
        raise SinkError("no sink configured: set kafka_bootstrap and/or s3_endpoint (or s3_access_key)")
    return sinks
