"""The archiver: a Kafka consumer that writes envelopes and divergence events into the audit lake.

Consumer group ``group_id`` on ``reprolane.envelopes.v1`` and ``reprolane.divergences.v1``, offsets
committed by hand; it connects as every Kafka client does (`infra.clients.kafka.aiokafka_kwargs`: TLS with an
SSL context, SASL). It buffers rows per (table, day, tenant) and writes one Parquet file per partition when
``flush_rows`` rows are buffered or the oldest buffered row is ``flush_seconds`` old, on a
rebalance that takes partitions away, and on stop. The offsets are committed only *after* every buffered row
is in S3: a crash re-delivers what was not written, so nothing is lost, and what was written and re-delivered
is a duplicate that the query views and compaction collapse (by ``envelope_id`` / ``result_id``). A commit that
fails (Kafka unreachable, or the group rebalanced meanwhile) is counted in ``commit_failures`` and logged, and the
archiver goes on: the rows are in the lake already, the next commit covers their offsets, and whoever reads them
again writes copies that collapse, so a Kafka outage costs duplicates, never rows or the process. Each file is
duplicate-free on its own (a redelivery inside one flush is dropped by id), which lets the query views skip
deduplicating partitions of a single file.

With the Iceberg lake (``lake_kind=iceberg``, `capture.audit.lake.iceberg`) a flush is one commit per table
(``envelopes``, ``divergences`` and the ``replays`` derived from the divergence rows) that appends only ids not
already in the table, retried against a concurrent archiver's commit: a redelivery is dropped there (counted in
``duplicates_dropped``), so the tables hold each id once, not only the views. Flushes never overlap: a
rebalance's flush (run by aiokafka's coordinator task) waits for the loop's, instead of writing its buffers twice.

A claim check (an envelope too large for Kafka, `schemas.claim_check`) is resolved from the audit bucket
(``s3_bucket``) before it becomes a row, its size and sha256 checked: an S3 failure or an object not there is a
`LakeError` (offsets stay uncommitted: a restart re-reads it); a reference that does not match its object is
skipped like any message that is not archivable.

Sealed envelopes (encrypted tenants) become metadata-only rows; the archiver holds no key. A message that is
neither an envelope nor a sealed envelope nor a divergence event (the replayer dead-letters those) is counted
in ``skipped``, logged at ERROR with its topic/partition/offset, and committed past: the lake is a derived
copy, and the record itself is still in S3 and on the topic.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from capture.audit.errors import LakeError
from capture.audit.lake.iceberg import ICEBERG_TABLES, IcebergLake
from capture.audit.lake.schema import DEDUPE_KEY, SCHEMAS, day, divergence_row, envelope_row, sealed_row
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from infra.clients.kafka import aiokafka_kwargs, kafka_errors, start_client, stop_quietly
from infra.clients.s3 import S3Policy, error_code, is_missing, make_s3_client, s3_errors
from infra.clients.shutdown import stop_on_signals
from schemas import ContractError, decode_divergence, decode_envelope, envelope_bytes, sha256_hex
from schemas.claim_check import decode_claim_check, is_claim_check, verify_claimed
from schemas.layout import HEADER_ENVELOPE_ID
from schemas.sealed import decode_sealed, is_sealed

log = logging.getLogger("reprolane.archiver")


@dataclass
class ArchiverStats:
    """What one archiver did since it was made (counts only grow)."""

    #: Messages taken from Kafka (`Archiver.add` calls), archivable or not.
    consumed: int = 0
    #: Rows flushed to the lake, one per distinct id of a flush (a message redelivered within one flush is
    #: buffered once); on an Iceberg lake, before its anti-join dropped those already in the table.
    rows_written: int = 0
    #: Parquet lake: files written (one per partition of a flush); Iceberg lake: table commits (a flush with
    #: divergence events commits to ``divergences`` and ``replays``).
    files_written: int = 0
    #: Messages that were not archivable (empty, or no envelope, sealed envelope or divergence event): logged
    #: and passed over, so their offsets are committed like the rest.
    skipped: int = 0
    #: Flushes that wrote at least one row.
    flushes: int = 0
    #: Offset commits Kafka refused after their rows were written (a redelivery of those rows collapses).
    commit_failures: int = 0
    duplicates_dropped: int = 0  # Iceberg lake: rows already in the table (a redelivery another flush wrote)


class Archiver:
    """Buffers rows and writes them to the lake; `run` drives it from Kafka (see module docstring)."""

    def __init__(
        self, settings: LakeSettings, lake: Lake | IcebergLake, *, read_audit: Callable[[str], bytes] | None = None
    ) -> None:
        """`read_audit(key)`: an object of the audit bucket (claim checks); default: an S3 client of `settings`."""
        self.settings = settings
        self.lake = lake
        self._read_audit = read_audit
        self.stats = ArchiverStats()
        self._buffers: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
        self._buffered = 0
        self._oldest: float | None = None
        self._consumer: Any = None
        self._flush_lock = asyncio.Lock()

    @property
    def buffered(self) -> int:
        return self._buffered

    # -- rows ------------------------------------------------------------------------------------------------

    def add(self, topic: str, value: bytes | None, source: str = "?", claimed_id: bytes | None = None) -> bool:
        """Turn one message into a buffered row; False (counted in `skipped`) when it is not archivable.

        `claimed_id` is the ``reprolane-envelope-id`` header: when it equals the sha256 of the value's canonical
        bytes (the value, or what a compact value decodes to), those are the bytes the publisher hashed, and the
        id is not recomputed (a re-encode per row)."""
        self.stats.consumed += 1
        now = datetime.now(UTC)
        try:
            if value is None:
                raise ContractError("empty message")
            if topic == self.settings.divergence_topic:
                event = decode_divergence(value)
                row, where = divergence_row(event, now), ("divergences", day(event.replayed_at), event.tenant)
            elif is_sealed(value):
                sealed = decode_sealed(value)
                row, where = sealed_row(sealed, now), ("envelopes", day(sealed.captured_at), sealed.tenant)
            else:
                canonical = envelope_bytes(value)  # a compact envelope's canonical bytes
                env = decode_envelope(canonical)
                digest = sha256_hex(canonical)
                known = digest if claimed_id is not None and claimed_id.decode(errors="replace") == digest else None
                row, where = envelope_row(env, now, known), ("envelopes", day(env.captured_at), env.tenant)
        except ContractError as exc:
            self.stats.skipped += 1
            log.error("archiver: skipping %s (not archivable): %s", source, str(exc)[:500])
            return False
        rows = self._buffers.setdefault(where, {})
        row_id = row[DEDUPE_KEY[where[0]]]
        if row_id in rows:  # a redelivery within one flush: every file stays duplicate-free
            return True
        rows[row_id] = row
        self._buffered += 1
        if self._oldest is None:
            self._oldest = time.monotonic()
        return True

    def resolve(self, value: bytes | None, source: str = "?") -> bytes | None:
        """`value`, or the envelope bytes its claim check names (module docstring); blocking (call in a thread).
        A reference that does not match its object is returned as it is (then skipped by `add`)."""
        if not is_claim_check(value):
            return value
        assert value is not None
        try:
            ref = decode_claim_check(value)
        except ContractError as exc:
            log.error("archiver: bad claim check at %s: %s", source, exc)
            return value
        if self._read_audit is None:
            client = make_s3_client(self.settings, policy=S3Policy.AUDIT)
            bucket = self.settings.s3_bucket
            self._read_audit = lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read()
        try:
            stored = self._read_audit(ref.key)
        except s3_errors() as exc:
            what = "is not there" if is_missing(exc) else f"cannot be read: {error_code(exc) or exc}"
            raise LakeError(f"archiver: claim check at {source} names {ref.key}, which {what}") from exc
        try:
            return verify_claimed(ref, stored)
        except ContractError as exc:
            log.error("archiver: claim check at %s does not match its object: %s", source, exc)
            return value

    def due(self) -> bool:
        if self._buffered >= self.settings.flush_rows:
            return True
        return self._oldest is not None and time.monotonic() - self._oldest >= self.settings.flush_seconds

    def _write_all(self, buffers: dict[tuple[str, str, str], dict[str, dict[str, Any]]]) -> list[str]:
        if isinstance(self.lake, IcebergLake):
            return self._commit_iceberg(self.lake, buffers)
        paths = []
        for (table, d, tenant), rows in sorted(buffers.items()):
            data = pa.Table.from_pylist(list(rows.values()), schema=SCHEMAS[table])
            paths.append(self.lake.write(table, d, tenant, data))
        return paths

    def _commit_iceberg(
        self, lake: IcebergLake, buffers: dict[tuple[str, str, str], dict[str, dict[str, Any]]]
    ) -> list[str]:
        """One anti-join-and-append commit per table (`capture.audit.lake.iceberg`); replays are derived from the
        divergence rows. The table names committed to (for the stats and the log)."""
        per_table: dict[str, list[dict[str, Any]]] = {}
        for (table, _d, tenant), rows in sorted(buffers.items()):
            per_table.setdefault(table, []).extend({**row, "tenant": tenant} for row in rows.values())
        if "divergences" in per_table:
            per_table["replays"] = per_table["divergences"]
        written = []
        for table, table_rows in per_table.items():
            schema = ICEBERG_TABLES[table][0]
            data = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in table_rows], schema=schema)
            appended = lake.append_new(table, data)
            if appended < data.num_rows:
                log.info("archiver: %s: %d rows already in the lake (redelivered)", table, data.num_rows - appended)
            self.stats.duplicates_dropped += data.num_rows - appended
            written.append(f"{lake.namespace}.{table}")
        return written

    async def flush(self) -> list[str]:
        """Write every buffered row (one file per partition); the paths written. Raises `LakeError`."""
        async with self._flush_lock:  # a rebalance's flush (aiokafka's coordinator task) waits for the loop's
            if not self._buffers:
                return []
            buffers = self._buffers
            paths = await asyncio.to_thread(self._write_all, buffers)
            self.stats.rows_written += self._buffered
            self.stats.files_written += len(paths)
            self.stats.flushes += 1
            log.info("archiver: wrote %d rows in %d files", self._buffered, len(paths))
            self._buffers, self._buffered, self._oldest = {}, 0, None
            return paths

    # -- Kafka -----------------------------------------------------------------------------------------------

    async def _flush_and_commit(self) -> None:
        await self.flush()
        if self._consumer is not None:
            try:
                await self._consumer.commit()
            except kafka_errors() as exc:  # see the module doc: the rows are written, a redelivery collapses
                self.stats.commit_failures += 1
                log.warning("archiver: offset commit failed (%r); the rows are in the lake, continuing", exc)

    def _make_consumer(self) -> Any:
        from aiokafka import AIOKafkaConsumer

        s = self.settings
        kwargs: dict[str, Any] = {
            **aiokafka_kwargs(s),
            "group_id": s.group_id,
            "client_id": "reprolane-archiver",
            "enable_auto_commit": False,
            "auto_offset_reset": s.auto_offset_reset,
            "session_timeout_ms": s.session_timeout_ms,
            "heartbeat_interval_ms": s.heartbeat_interval_ms,
            "max_poll_records": min(s.flush_rows, 10_000),
        }
        return AIOKafkaConsumer(**kwargs)

    async def run(self, stop: asyncio.Event, *, poll_ms: int = 500) -> None:
        """Consume until `stop` is set; flush and commit on the way out. Raises `LakeError` on a lake outage
        (after the buffered rows' offsets were left uncommitted: a restart re-reads them)."""
        from aiokafka import ConsumerRebalanceListener

        archiver = self

        class _FlushOnRevoke(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: Any) -> None:
                if revoked:
                    await archiver._flush_and_commit()

            async def on_partitions_assigned(self, assigned: Any) -> None:
                return None

        consumer = self._make_consumer()
        # a new consumer's subscription cannot fail on Kafka's side (aiokafka raises only for one already assigned)
        consumer.subscribe([self.settings.envelope_topic, self.settings.divergence_topic], listener=_FlushOnRevoke())
        what = f"archiver: cannot consume from {self.settings.kafka_bootstrap}"
        self._consumer = await start_client(consumer, what=what, error=LakeError)
        try:
            while not stop.is_set():
                batches = await consumer.getmany(timeout_ms=poll_ms, max_records=self.settings.flush_rows)
                consumed = False
                for tp, records in batches.items():
                    for rec in records:
                        consumed = True
                        claimed = next((v for k, v in rec.headers or () if k == HEADER_ENVELOPE_ID), None)
                        source = f"{tp.topic}/{tp.partition}/{rec.offset}"
                        value = rec.value
                        if is_claim_check(value):
                            value = await asyncio.to_thread(self.resolve, value, source)
                        self.add(tp.topic, value, source, claimed)
                if self.due() or (consumed and self._buffered == 0):  # all skipped: commit past them
                    await self._flush_and_commit()
            await self._flush_and_commit()
        finally:
            self._consumer = None
            await stop_quietly(consumer)


async def run_until_signalled(archiver: Archiver) -> None:
    stop = stop_on_signals()
    lake = archiver.lake
    where = f"iceberg {lake.namespace}" if isinstance(lake, IcebergLake) else f"s3://{lake.bucket}/{lake.prefix}"
    log.info(
        "archiver: %s + %s -> %s as group %s",
        archiver.settings.envelope_topic,
        archiver.settings.divergence_topic,
        where,
        archiver.settings.group_id,
    )
    await archiver.run(stop)
