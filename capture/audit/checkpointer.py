"""Checkpoints on a schedule: ``reprolane serve checkpointer`` signs every day log that grew, every period.

Everything after a log's latest checkpoint is only as trustworthy as the bucket's write permissions, so the
window must be short and must not depend on someone remembering a cron line. Each round lists the day logs and,
for each, compares two listings: the log's size (the start and length of its last leaf batch) and the largest
size among its C2SP checkpoint keys. Where they differ (the log grew, or only a JSON checkpoint covers it) it
runs `capture.audit.checkpoint.write_checkpoint`, which reads the leaves, checks that the new tree is
consistent with the latest checkpoint signed (an RFC 9162 consistency proof from it verifies) and only then
signs and publishes. A log that is not (rewritten or truncated under a signed checkpoint) or is broken (gaps,
torn batches) is refused: logged at ERROR, counted, and alerted (``ReprolaneCheckpointRefused``); it is tried
again every round and stays refused until an operator has looked (``reprolane audit verify --range DAY`` names what
changed). A store error skips the day for this round. A round never stops the service.

Metrics (own registry, ``--metrics-port``):

    reprolane_checkpoints_signed_total               checkpoints published
    reprolane_checkpoint_refusals_total{reason}      logs refused: ``inconsistent``, ``broken``, ``store``
    reprolane_checkpointer_last_round_timestamp_seconds   when the last round ended (staleness alerts)

What the listing shortcut cannot see: a log rewritten without growing is not re-read until it grows (the next
checkpoint is then refused); finding such a rewrite is ``reprolane audit verify --range``'s job.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from datetime import timedelta
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from capture.audit.checkpoint import SignedHead, merkle_logs, write_checkpoint
from capture.audit.errors import AuditError, AuditStoreError, InconsistentLogError
from capture.audit.store import AuditStore
from capture.ledger.errors import LedgerError
from capture.ledger.merkle_log import log_size
from schemas.layout import (
    LogName,
    checkpoint_size_of_key,
    checkpoints_prefix,
    is_note_checkpoint_key,
)

log = logging.getLogger("reprolane.checkpointer")


class CheckpointerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.signed = Counter("reprolane_checkpoints_signed", "checkpoints published", registry=self.registry)
        self.refusals = Counter(
            "reprolane_checkpoint_refusals", "logs the checkpointer refused to sign", ["reason"], registry=self.registry
        )
        self.last_round = Gauge(
            "reprolane_checkpointer_last_round_timestamp_seconds", "end of the last round", registry=self.registry
        )

    def value(self, name: str, **labels: str) -> float:
        return sum(
            s.value
            for m in self.registry.collect()
            for s in m.samples
            if s.name == name and labels.items() <= s.labels.items()
        )

    def serve(self, port: int, addr: str = "127.0.0.1") -> WSGIServer:
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server


@dataclass
class RoundReport:
    signed: list[SignedHead] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # day -> why


def _note_size(store: AuditStore, day: str) -> int:
    keys = [k for k, _ in store.list_keys(checkpoints_prefix(day)) if is_note_checkpoint_key(k)]
    sizes = [checkpoint_size_of_key(k) for k in keys]
    return max((s for s in sizes if s is not None), default=0)


@dataclass(eq=False)  # a service, compared by identity
class Checkpointer:
    """One signing key, one bucket (every day log in it, or `only_days`); `run_round` once, or `run` every
    `period_s` until `stop` is set."""

    store: AuditStore
    private_raw: bytes
    _: KW_ONLY
    key_name: str
    retention: timedelta | None
    metrics: CheckpointerMetrics = field(default_factory=CheckpointerMetrics)
    only_days: list[str] | None = None
    stop: threading.Event = field(default_factory=threading.Event, init=False)

    def days(self) -> list[LogName]:
        """The logs of a round: every day log and every engine's schedule log (`only_days`: those days alone)."""
        return merkle_logs(self.store, self.only_days)

    def _refuse(self, report: RoundReport, day: str, reason: str, exc: Exception) -> None:
        report.refused[day] = str(exc)
        self.metrics.refusals.labels(reason=reason).inc()
        log.error("checkpointer: refused to sign %s (%s): %s", day, reason, exc)

    def run_round(self) -> RoundReport:
        report = RoundReport()
        try:
            days = self.days()
        except AuditStoreError as exc:
            self._refuse(report, "*", "store", exc)
            return report
        for day in days:
            try:
                if log_size(self.store, day) == _note_size(self.store, day):
                    continue
                head = write_checkpoint(
                    self.store, day, self.private_raw, retention=self.retention, key_name=self.key_name
                )
            except InconsistentLogError as exc:
                self._refuse(report, day, "inconsistent", exc)
                continue
            except (AuditStoreError, LedgerError) as exc:
                self._refuse(report, day, "store", exc)
                continue
            except AuditError as exc:  # a broken leaf log
                self._refuse(report, day, "broken", exc)
                continue
            if head is not None:
                report.signed.append(head)
                self.metrics.signed.inc()
                log.info("checkpointer: %s size %d root %s", day, head.tree_size, head.root_hash)
        self.metrics.last_round.set(time.time())
        return report

    def run(self, period_s: float) -> None:
        """Rounds every `period_s` (measured from each round's start) until `stop` is set."""
        log.info("checkpointer: every %.1fs, key name %s, bucket %s", period_s, self.key_name, self.store.bucket)
        while not self.stop.is_set():
            started = time.monotonic()
            self.run_round()
            self.stop.wait(max(0.0, period_s - (time.monotonic() - started)))
