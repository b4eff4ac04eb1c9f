"""The publisher: drains the spool to every sink (Kafka and S3), at least once, never dropping a record.

One loop, oldest first:

1. take up to `batch_size` pending entries from the spool (waiting when there are none);
2. publish the batch to every sink concurrently; a sink that fails is retried alone (the others keep their
   confirmation), with capped exponential backoff, for as long as it takes. Every failed attempt counts in
   ``publish_errors_total{sink}``; ``publish_lag_seconds`` is the age (from ``captured_at``) of the oldest
   entry still unpublished. A batch holding an envelope too large for Kafka (a claim check,
   `capture.publishing.kafka_sink`) goes to S3 first and to Kafka only after S3 stored it;
3. only when *every* sink has confirmed the whole batch, hand it to the ``then`` sinks the same way (the
   audit Merkle log, `capture.publishing.sinks.AuditLogSink` over `capture.ledger.merkle_log`, when ``audit_log`` is on:
   a leaf must never precede its stored object), and only when those confirmed too, `Spool.ack` it.

A record a sink refuses *for good* (`capture.errors.RecordsRefused`: too large, a key S3 will not take, an
invalid record), or that is not an envelope at all, would block every record behind it if it were retried like
an outage. It is quarantined instead (`capture.publishing.quarantine`): made durable in the local quarantine with its
reason, sent to the dead-letter topic when Kafka takes it, counted in ``records_quarantined_total{sink,code}``,
left out of the later sinks (the ``then`` sinks never log a record a sink refused) and acked with its batch.
Its envelope object may still be in S3 (when Kafka refused it, or S3 refused only an index key): the reason file
and the dead letter say which sink refused what. Transient failures (timeouts, 5xx, connection errors, throttling,
a missing bucket or permission) keep being retried as above, since every record would meet them alike.

A crash or a stop anywhere before 3 leaves the batch pending: the next start publishes it again. Duplicates
are therefore possible and harmless (the envelope id is the content hash; S3 writes are content-addressed
and conditional; the quarantine's files are named by the record's hash).

With ``envelope_encoding = "compact"`` (the default) each record's payload is swapped for its compact form
(`capture.publishing.outgoing.Outgoing.compacted`, in a worker thread) between 1 and 2: the spool keeps the canonical
JSON, the sinks store and send the compact bytes. Tenants in ``settings.encrypt_tenants`` are sealed after that
(`capture.ledger.sealing.Sealer`, over the compact bytes): the sinks receive the `schemas.sealed.SealedEnvelope`
bytes, never the plaintext (which exists only in the local spool).
A keyring failure (the ledger's `KeyringError`, here a `SealingError`) is retried like a failing sink; at
construction (no KEK) it is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from capture.errors import CaptureError, RecordsRefused, SealingError, SinkError
from capture.ledger.errors import KeyringError
from capture.ledger.sealing import Keyring, Sealer, load_kek
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.outgoing import Outgoing
from capture.publishing.quarantine import Quarantine, Refusal, quarantine_dir
from capture.publishing.sinks import AuditLogSink, Sink, default_sinks
from capture.spool import Spool, SpoolEntry
from infra.clients.s3 import S3Policy, make_s3_client
from schemas import envelope_bytes

if TYPE_CHECKING:
    from capture.metrics import CaptureMetrics
    from capture.settings import CaptureSettings

log = logging.getLogger(__name__)


def _sealer(settings: CaptureSettings) -> Sealer:
    """The sealer of ``encrypt_tenants``, its keys in ``keys_bucket``; `SealingError` without a usable KEK."""
    try:
        kek = load_kek(settings)
    except KeyringError as exc:
        raise SealingError(str(exc)) from exc
    client = make_s3_client(settings, policy=S3Policy.SIDECAR)
    return Sealer(
        Keyring(client, settings.keys_bucket, kek, cache_s=settings.data_key_cache_s), settings.encrypt_tenants
    )


def _compacted(batch: Sequence[Outgoing]) -> list[Outgoing]:
    return [item.compacted() for item in batch]


class Publisher:
    """Drains a `Spool` to its sinks in a background task (`start` / `stop`)."""

    def __init__(
        self,
        spool: Spool,
        settings: CaptureSettings,
        metrics: CaptureMetrics | None = None,
        *,
        sinks: Sequence[Sink] | None = None,
        then: Sequence[Sink] | None = None,
        sealer: Sealer | None = None,
        quarantine: Quarantine | None = None,
        batch_size: int = 256,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        idle_poll_s: float = 0.5,
    ) -> None:
        self.spool = spool
        self._settings = settings
        self._metrics = metrics
        self._sinks: list[Sink] | None = list(sinks) if sinks is not None else None
        self._then: list[Sink] | None = list(then) if then is not None else None
        if sealer is None and settings.encrypt_tenants:
            sealer = _sealer(settings)  # a missing KEK fails here, at construction
        self._sealer = sealer
        self.quarantine = quarantine if quarantine is not None else Quarantine(quarantine_dir(settings.spool_dir))
        self.quarantined = 0  # records quarantined since start
        self.batch_size = batch_size
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.idle_poll_s = idle_poll_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.published = 0  # entries acked since start

    @property
    def sinks(self) -> list[Sink]:
        if self._sinks is None:
            self._sinks = default_sinks(self._settings, self._metrics)
        return self._sinks

    @property
    def then(self) -> list[Sink]:
        """Sinks that get a batch only after every sink confirmed it (default: the audit log if enabled)."""
        if self._then is None:
            self._then = []
            if self._settings.audit_log:
                self._then.append(AuditLogSink.from_settings(self._settings))
        return self._then

    async def start(self) -> None:
        if self._task is not None:
            return
        names = [sink.name for sink in [*self.sinks, *self.then]]  # built now: bad settings fail at start
        log.info("publisher: draining %s to %s", self.spool.directory, " and ".join(names))
        self._stopping.clear()
        self._task = asyncio.create_task(self._run(), name="capture-publisher")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop after the batch in flight (waiting at most ``grace_s``); unacked entries stay in the spool."""
        task, self._task = self._task, None
        if task is not None:
            self._stopping.set()
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            elif task.exception() is not None:
                log.error("publisher loop had died: %r", task.exception())
        for sink in [*(self._sinks or []), *(self._then or [])]:
            await sink.close()

    async def _run(self) -> None:
        backoff = self.backoff_initial_s
        while not self._stopping.is_set():
            try:
                await self._step()
                backoff = self.backoff_initial_s
            except CaptureError as exc:  # e.g. a spool record that reads back corrupt: keep it, say so, retry
                log.error("publisher: %s; retrying in %.1fs (nothing is dropped)", exc, backoff)
            except Exception:
                log.exception("publisher: unexpected error; retrying in %.1fs", backoff)
            else:
                continue
            if await self._sleep(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max_s)

    async def _step(self) -> None:
        """One batch: wait for entries, publish them everywhere, quarantine what a sink refused for good, ack."""
        if not await self.spool.wait_pending(self.idle_poll_s):
            self._set_lag(None)
            return
        entries = await self.spool.pending(self.batch_size)
        if not entries:
            return
        batch, refused = self._routable(entries)
        if batch and self._settings.envelope_encoding == "compact":
            batch = await asyncio.to_thread(_compacted, batch)
        if batch and self._sealer is not None:
            try:
                batch = await asyncio.to_thread(self._sealer.seal_batch, batch)
            except KeyringError as exc:
                raise SealingError(str(exc)) from exc
        if batch and not await self._publish_stages(batch, refused):
            return  # stopping: the batch stays pending
        stored = [item for item in batch if item.seq not in refused]
        if self.then and stored and not await self._publish_everywhere(stored, self.then, refused):
            return
        if refused:
            await self._quarantine(list(refused.values()))
        await self.spool.ack(e.seq for e in entries)
        self.published += len(entries) - len(refused)
        if self.spool.depth == 0:
            self._set_lag(None)

    def _routable(self, entries: Sequence[SpoolEntry]) -> tuple[list[Outgoing], dict[int, Refusal]]:
        """The entries as `Outgoing`, and the refusals of those that are not routable envelopes."""
        batch: list[Outgoing] = []
        refused: dict[int, Refusal] = {}
        for entry in entries:
            try:
                batch.append(Outgoing.from_entry(entry))
            except SinkError as exc:
                log.error("publisher: %s; quarantining it", exc)
                refused[entry.seq] = Refusal(entry.seq, entry.payload, "route", "NotAnEnvelope", str(exc)[:1000])
        return batch, refused

    async def _publish_stages(self, batch: list[Outgoing], refused: dict[int, Refusal]) -> bool:
        """Publish to `sinks`, in two stages when a record's Kafka value is a claim check (S3 first)."""
        sinks = self.sinks
        stages = [sinks]
        if any(item.claim_checked for item in batch):
            first = [s for s in sinks if not getattr(s, "refers_to_objects", False)]
            stages = [first, [s for s in sinks if s not in first]]
            if self._metrics is not None:
                self._metrics.claim_checks_total.inc(sum(item.claim_checked for item in batch))
        for stage in stages:
            pending = [item for item in batch if item.seq not in refused]
            if stage and pending and not await self._publish_everywhere(pending, stage, refused):
                return False
        return True

    async def _publish_everywhere(
        self, batch: list[Outgoing], sinks: Sequence[Sink], refused: dict[int, Refusal]
    ) -> bool:
        """Publish to every one of `sinks` until all have confirmed (records they refuse for good are added to
        `refused`); False when stopping first."""
        oldest = min(item.captured_at for item in batch)
        by_seq = {item.seq: item for item in batch}
        remaining = list(sinks)
        backoff = self.backoff_initial_s
        while remaining:
            self._set_lag(oldest)
            results = await asyncio.gather(*(sink.publish(batch) for sink in remaining), return_exceptions=True)
            failed: list[Sink] = []
            for sink, result in zip(remaining, results, strict=True):
                if result is None:
                    self._count("envelopes_published_total", sink.name, len(batch))
                    continue
                if isinstance(result, RecordsRefused) and result.refused.keys() <= by_seq.keys():
                    for seq, (code, reason) in result.refused.items():
                        item = by_seq[seq]
                        log.error("publisher: %s refused seq %d (%s) for good: %s", sink.name, seq, code, reason)
                        refused.setdefault(
                            seq,
                            Refusal(
                                seq,
                                envelope_bytes(item.payload),  # a compact record is kept as canonical JSON
                                sink.name,
                                code,
                                reason,
                                item.envelope_id,
                                item.request_id,
                                item.tenant,
                            ),
                        )
                    self._count("envelopes_published_total", sink.name, len(batch) - len(result.refused))
                    continue
                if not isinstance(result, SinkError):
                    if isinstance(result, asyncio.CancelledError):
                        raise result
                    log.exception("publisher: sink %s raised unexpectedly", sink.name, exc_info=result)
                else:
                    log.warning("publisher: %s failed for %d envelopes: %s", sink.name, len(batch), result)
                self._count("publish_errors_total", sink.name, 1)
                failed.append(sink)
            remaining = failed
            if remaining:
                if await self._sleep(backoff * random.uniform(0.8, 1.2)):
                    return False
                backoff = min(backoff * 2, self.backoff_max_s)
        return True

    async def _quarantine(self, refusals: list[Refusal]) -> None:
        """Durable in the local quarantine (a disk error raises: the batch stays pending), then dead-lettered
        when Kafka takes it, and counted."""
        await asyncio.to_thread(self.quarantine.keep, refusals)
        kafka = next((s for s in self.sinks if isinstance(s, KafkaSink)), None)
        for refusal in refusals:
            if kafka is not None:
                await kafka.dead_letter(refusal)
            if self._metrics is not None:
                self._metrics.records_quarantined_total.labels(sink=refusal.sink, code=refusal.code).inc()
            log.error(
                "publisher: quarantined seq %d (%s, %d bytes) in %s: %s refused it (%s)",
                refusal.seq,
                refusal.envelope_id or refusal.digest,
                len(refusal.payload),
                self.quarantine.directory,
                refusal.sink,
                refusal.code,
            )
        self.quarantined += len(refusals)

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early when stopping; True when stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    def _set_lag(self, oldest: datetime | None) -> None:
        if self._metrics is not None:
            lag = 0.0 if oldest is None else max(0.0, (datetime.now(UTC) - oldest).total_seconds())
            self._metrics.publish_lag_seconds.set(lag)

    def _count(self, metric: str, sink: str, amount: int) -> None:
        if self._metrics is not None:
            getattr(self._metrics, metric).labels(sink=sink).inc(amount)
