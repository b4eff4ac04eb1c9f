"""Where spooled envelopes go: a Kafka topic and an S3 bucket with Object Lock.

Both sinks take a batch of `Outgoing` records and either confirm *every* record or raise `SinkError`; every
aiokafka / botocore exception is translated here, so the publisher only ever sees `SinkError`.

Kafka (`KafkaSink`): topic `schemas.layout.TOPIC_ENVELOPES`, key = request id, value = the canonical envelope
bytes, headers ``reprolane-envelope-id`` and ``reprolane-schema``; ``acks="all"``, linger 5 ms, all sends of a
batch awaited together. Idempotence is off on purpose: Tansu refuses InitProducerId, and delivery is
at-least-once anyway (duplicates collapse by envelope id downstream).

S3 (`S3Sink`), per envelope, with boto3 in a thread pool, or in worker processes with ``s3_processes``
(`capture.s3_workers`: boto3's CPU per PUT is several times what capturing a request costs):

- ``envelopes/tenant=.../date=.../<envelope_id>.json`` with Object Lock retention until
  ``captured_at + retention days`` (the tenant's entry in ``retention_days_by_tenant``, else ``retention_days``;
  0 = no retention header) (if that has passed already, e.g. a backlog older than the retention,
  until now + `MIN_RETENTION`: an audit record is never stored unprotected) and ``IfNoneMatch="*"``:
  the key is a content address, so 412 (already there) means the same bytes are there, which is success.
- index objects ``index/request-id/<request_id>.json`` and, with a workflow,
  ``index/workflow/<id>/<step>-<request_id>.json``, body ``{"envelope_id", "key", "tenant", "captured_at"}``,
  written without retention and without a condition: a later envelope with the same request id (a retry after
  an error envelope) overwrites it. The audit bucket is versioned (Object Lock requires it), so an overwrite is
  a new version and the older pointer stays readable. Within one batch only the newest record per index key is
  written, so concurrent puts cannot leave an older envelope on top.
- with a client ``X-Request-Id``, ``index/client-request-id/tenant=<t>/<client id>/<request_id>.json`` (same
  body), written once with ``IfNoneMatch="*"``: one per envelope, so a tenant's retries are all found.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from capture.errors import SinkError
from capture.ledger.errors import LedgerError
from capture.ledger.merkle_log import MerkleLogWriter
from capture.ledger.store import LedgerStore
from capture.s3_workers import Put, S3Processes, run_put
from capture.spool import SpoolEntry
from infra.clients.kafka import aiokafka_kwargs, kafka_errors
from infra.clients.s3 import S3Policy, make_s3_client
from schemas import sha256_hex
from schemas.layout import (
    HEADER_ENVELOPE_ID,
    HEADER_SCHEMA,
    MAX_MESSAGE_BYTES,
    TOPIC_ENVELOPES,
    client_request_index_key,
    envelope_key,
    index_body,
    request_index_key,
    workflow_index_key,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from capture.settings import CaptureSettings

MIN_RETENTION = timedelta(days=1)


class _WorkflowFields(msgspec.Struct):
    workflow_id: str
    step: int


class _RouteFields(msgspec.Struct):
    """The members of an envelope's canonical JSON the sinks route by (msgspec skips the rest unparsed: ~10x
    faster than ``json.loads`` of a whole 6 KB envelope, per envelope published)."""

    request_id: str
    tenant: str
    captured_at: str
    schema_version: str
    workflow: _WorkflowFields | None = None
    client_request_id: str | None = None


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
            )
        except (ValueError, msgspec.DecodeError) as exc:
            raise SinkError(f"spool record seq {entry.seq} is not a routable envelope: {exc!r}") from exc

    @property
    def object_key(self) -> str:
        return envelope_key(self.envelope_id, self.tenant, self.captured_at)

    def index_keys(self) -> list[str]:
        keys = [request_index_key(self.request_id)]
        if self.workflow_id is not None and self.workflow_step is not None:
            keys.append(workflow_index_key(self.workflow_id, self.workflow_step, self.request_id))
        return keys

    def index_body(self) -> bytes:
        return index_body(self.envelope_id, self.object_key, self.tenant, self.captured_at)

    def with_payload(self, payload: bytes, schema_version: str) -> Outgoing:
        """This record with another payload (the sealed one, `capture.ledger.sealing`): routed and keyed the same."""
        return dataclasses.replace(self, payload=payload, schema_version=schema_version)


class Sink(Protocol):
    """A destination the publisher drains to. `publish` confirms every record of the batch or raises SinkError."""

    name: str

    async def publish(self, batch: Sequence[Outgoing]) -> None: ...

    async def close(self) -> None: ...


class KafkaSink:
    name = "kafka"

    def __init__(self, settings: CaptureSettings, *, topic: str = TOPIC_ENVELOPES, request_timeout_ms: int = 10000):
        if not settings.kafka_bootstrap:
            raise SinkError("kafka_bootstrap is not set")
        self.topic = topic
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
        try:
            futures = [
                await producer.send(
                    self.topic,
                    value=item.payload,
                    key=item.request_id.encode(),
                    headers=[
                        (HEADER_ENVELOPE_ID, item.envelope_id.encode()),
                        (HEADER_SCHEMA, item.schema_version.encode()),
                    ],
                )
                for item in batch
            ]
            results = await asyncio.gather(*futures, return_exceptions=True)
        except kafka_errors() as exc:
            raise SinkError(f"kafka send to {self.topic} failed: {exc!r}") from exc
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise SinkError(f"kafka: {len(failed)} of {len(batch)} sends to {self.topic} failed: {failed[0]!r}")

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await _quiet_stop(producer)


async def _quiet_stop(producer: Any) -> None:
    with contextlib.suppress(*kafka_errors()):
        await producer.stop()


class S3Sink:
    name = "s3"

    def __init__(
        self, settings: CaptureSettings, *, client: S3Client | None = None, workers: int = 8, processes: int = 0
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
        newest: dict[str, Outgoing] = {}
        for item in sorted(batch, key=lambda o: o.seq):
            for key in item.index_keys():
                newest[key] = item
        puts += [Put(key, item.index_body(), {"ContentType": "application/json"}) for key, item in newest.items()]
        # the client's X-Request-Id, per tenant: one object per envelope, written once (never overwritten)
        puts += [
            Put(
                client_request_index_key(item.tenant, item.client_request_id, item.request_id),
                item.index_body(),
                {"ContentType": "application/json", "IfNoneMatch": "*"},
                created_is_enough=True,
            )
            for item in batch
            if item.client_request_id is not None
        ]
        if self._threads is None:
            assert self._processes is not None  # one of the two modes, chosen in __init__
            await self._processes.run(self.bucket, puts)
            return
        loop, (client, pool) = asyncio.get_running_loop(), self._threads
        results = await asyncio.gather(
            *(loop.run_in_executor(pool, run_put, client, self.bucket, put) for put in puts),
            return_exceptions=True,
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            first = failed[0]
            if not isinstance(first, SinkError):
                raise SinkError(f"s3: unexpected error: {first!r}") from first
            raise SinkError(f"s3: {len(failed)} of {len(puts)} puts failed; first: {first}") from first

    def _envelope_put(self, item: Outgoing) -> Put:
        params: dict[str, Any] = {
            "ContentType": "application/json",
            "IfNoneMatch": "*",
            "Metadata": {"envelope-id": item.envelope_id, "schema": item.schema_version},
        }
        until = self.retain_until(item.captured_at, item.tenant)
        if until is not None:
            params.update(ObjectLockMode=self.lock_mode, ObjectLockRetainUntilDate=until)
        return Put(item.object_key, item.payload, params, created_is_enough=True)

    async def close(self) -> None:
        if self._threads is not None:
            self._threads[1].shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            await self._processes.close()


class AuditLogSink:
    """The Merkle log as a publisher "then" sink (`capture.ledger.merkle_log`): a batch's ids are appended after
    every sink stored it; a ledger failure is a `SinkError`, retried like any failing sink."""

    name = "audit-log"

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


def default_sinks(settings: CaptureSettings) -> list[Sink]:
    """The configured sinks: Kafka when `kafka_bootstrap` is set, S3 when `s3_endpoint` or `s3_access_key` is
    (an S3 with neither would be AWS with ambient credentials: say so with an access key). The publisher acks
    only what *every* one of them has confirmed; production runs both."""
    sinks: list[Sink] = []
    if settings.kafka_bootstrap:
        sinks.append(KafkaSink(settings))
    if settings.s3_endpoint or settings.s3_access_key:
        sinks.append(S3Sink(settings, processes=settings.s3_processes))
    if not sinks:
        raise SinkError("no sink configured: set kafka_bootstrap and/or s3_endpoint (or s3_access_key)")
    return sinks
