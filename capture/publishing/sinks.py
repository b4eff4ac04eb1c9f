"""The sinks the publisher drains to: what a sink must answer, the audit log as one, and the configured set.

A sink (`Sink`) takes a batch of `capture.publishing.outgoing.Outgoing` records and either confirms *every* record or
raises: `SinkError` for a failure worth retrying (the batch is retried whole), `capture.errors.RecordsRefused`
naming the records it refuses for good once every other record is confirmed (the publisher quarantines them,
`capture.publishing.quarantine`). A sink whose records point at objects another sink stores (Kafka's claim checks) sets
`Sink.refers_to_objects`: the publisher gives it such a batch only after the others confirmed it.

- `capture.publishing.kafka_sink`: `KafkaSink`, the envelopes topic (claim checks for large envelopes, the
  dead-letter topic).
- `capture.publishing.s3_sink`: `S3Sink`, envelope objects under Object Lock and the write-once index objects.
- here: the `Sink` protocol, `AuditLogSink` (the Merkle log, a publisher "then" sink) and `default_sinks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

from capture.errors import SinkError
from capture.ledger.errors import LedgerError
from capture.ledger.merkle_log import MerkleLogWriter
from capture.ledger.store import LedgerStore
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from infra.clients.s3 import S3Policy, make_s3_client

if TYPE_CHECKING:
    from capture.metrics import CaptureMetrics
    from capture.settings import CaptureSettings


class Sink(Protocol):
    """A destination the publisher drains to. `publish` confirms every record of the batch or raises SinkError."""

    name: str
    #: True for a sink whose records may refer to objects the other sinks store (Kafka's claim checks): the
    #: publisher gives it a batch holding such records only after the others confirmed it.
    refers_to_objects: bool

    async def publish(self, batch: Sequence[Outgoing]) -> None: ...

    async def close(self) -> None: ...


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
