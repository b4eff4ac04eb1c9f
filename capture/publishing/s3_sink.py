"""The S3 sink: every spooled envelope as an object under Object Lock, and the index objects that find it.

`S3Sink` takes a batch of `capture.publishing.outgoing.Outgoing` records and either confirms *every* record or raises
`SinkError`; every botocore exception is translated (`capture.publishing.s3_workers`), so the publisher only ever sees
`SinkError`. A record refused for good (a 400 with one of `capture.publishing.s3_workers.PERMANENT_CODES`) is reported
in `RecordsRefused` once every other record of the batch is confirmed; a batch with a transient failure too is
retried whole.

Per envelope, with boto3 in a thread pool, or in worker processes with ``s3_processes``
(`capture.publishing.s3_workers`: boto3's CPU per PUT is several times what capturing a request costs):

- ``envelopes/tenant=.../date=.../<envelope_id>.json`` (compact or JSON, its Content-Type says which:
  `schemas.layout.content_type`) with Object Lock retention until
  ``captured_at + retention days`` (the tenant's entry in ``retention_days_by_tenant``, else ``retention_days``;
  0 = no retention header) (if that has passed already, e.g. a backlog older than the retention,
  until now + `MIN_RETENTION`: an audit record is never stored unprotected) and ``IfNoneMatch="*"``:
  the key is a content address, so 412 (already there) means the same envelope is there (its bytes, or the
  same canonical bytes in the other encoding after an ``envelope_encoding`` switch), which is success.
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
- a guaranteed stream's *started* record (`Outgoing.started`) is stored like any envelope but not indexed: the
  write-once index entries go to the envelope that says how the request ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from capture.errors import RecordsRefused, SinkError
from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_workers import Put, PutFailure, PutOutcome, S3Processes, as_failure, run_put
from infra.clients.s3 import S3Policy, make_s3_client
from schemas.layout import client_request_index_key, content_type

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from capture.metrics import CaptureMetrics
    from capture.settings import CaptureSettings

log = logging.getLogger(__name__)

MIN_RETENTION = timedelta(days=1)


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
        """``processes`` > 0: PUTs run in that many worker processes (`capture.publishing.s3_workers`), each with
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
            "ContentType": content_type(item.encoding),
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
