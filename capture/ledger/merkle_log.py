"""The append-only Merkle log: which envelope ids were stored, in which order, one log per UTC day.

Layout (in the envelope bucket, next to ``envelopes/``; the keys are `schemas.layout`'s)::

    audit/log/day=<YYYY-MM-DD>/leaves/<start:012d>.bin        32-byte envelope ids, leaf `start` onwards
    audit/checkpoints/day=<YYYY-MM-DD>/<tree_size:012d>.json  signed `schemas.merkle.Checkpoint`
    audit/expiry/<timestamp>-<uuid8>.json                     what an expiry run deleted

The day is the envelope's capture day (the ``date=`` of its object key), so a day's log and a day's objects
can be compared one to one.

Order is fixed at append time. The publisher hands every batch to `MerkleLogWriter` (through the sidecar's
``audit-log`` sink, `capture.sinks.AuditLogSink`) only after *every* sink (Kafka and S3) confirmed it, and acks
the spool only after the writer confirmed: a leaf never precedes its object. The writer appends one leaf batch
object per day per publisher batch with a conditional create of ``<start>.bin`` (If-None-Match): two writers
racing for the same start index cannot both win; the loser relists and takes the next free index. Each batch
object is written once, under Object Lock when retention is set.

Duplicates: delivery is at-least-once (a crash after the append and before the spool ack republishes the
batch), and a restarted writer has forgotten what it appended. Rather than a fragile seen-set, the rule is:
a checkpoint commits to the exact leaf sequence, duplicates included; the verifier takes the *first*
occurrence of an id as its position and reports later ones as harmless duplicates. Within one process the
writer still skips ids it has already appended, so duplicates only follow a crash.

Crash windows, honestly: between the S3 put of an envelope and its leaf append the envelope is stored but
not logged. The spool still holds it, so the restarted publisher appends it; if the spool was lost as well,
the verifier reports "not logged" (distinct from a modification) and ``reprolane audit reconcile --day D``
(`capture.audit.checkpoint.reconcile`) appends the ids it finds in the day's objects. Reconcile cannot tell such
an envelope from one an attacker inserted; that is why it is a deliberate, logged operator action and not
automatic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from capture.ledger.errors import LedgerError
from capture.ledger.records import StoredRecord
from capture.ledger.store import LedgerStore
from schemas.layout import capture_day, is_leaves_key, leaves_key, leaves_prefix, leaves_start
from schemas.merkle import HASH_SIZE, leaf_data

MAX_RACE_RETRIES = 20


@dataclass
class LeafLog:
    """A day's leaves as stored: envelope ids in order, and anything wrong with the batch objects."""

    day: str
    ids: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def first_index(self) -> dict[str, int]:
        """Envelope id -> the index of its first occurrence (the canonical one)."""
        first: dict[str, int] = {}
        for i, eid in enumerate(self.ids):
            first.setdefault(eid, i)
        return first

    def duplicates(self) -> list[tuple[int, int]]:
        """(later index, first index) of every repeated id."""
        first: dict[str, int] = {}
        dups: list[tuple[int, int]] = []
        for i, eid in enumerate(self.ids):
            if eid in first:
                dups.append((i, first[eid]))
            else:
                first[eid] = i
        return dups


def log_size(store: LedgerStore, day: str) -> int:
    """The next free leaf index of a day (from the listing only: start + length of the last batch)."""
    size = 0
    for key, nbytes in store.list_keys(leaves_prefix(day)):
        if is_leaves_key(key):
            size = max(size, leaves_start(key) + nbytes // HASH_SIZE)
    return size


def read_leaves(store: LedgerStore, day: str) -> LeafLog:
    """Read every leaf batch of a day in start order; gaps, overlaps and torn batches become `problems`."""
    leaves = LeafLog(day)
    for key, _ in sorted(store.list_keys(leaves_prefix(day)), key=lambda kv: kv[0]):
        if not is_leaves_key(key):
            leaves.problems.append(f"unexpected object {key} in the leaf log")
            continue
        start = leaves_start(key)
        body = store.get(key)
        if body is None:
            leaves.problems.append(f"leaf batch {key} vanished while reading")
            continue
        if len(body) % HASH_SIZE:
            leaves.problems.append(f"leaf batch {key} is {len(body)} bytes, not a multiple of {HASH_SIZE}")
        if start != len(leaves.ids):
            leaves.problems.append(f"leaf batch {key} starts at {start} but the log has {len(leaves.ids)} leaves")
        for off in range(0, len(body) - len(body) % HASH_SIZE, HASH_SIZE):
            leaves.ids.append(body[off : off + HASH_SIZE].hex())
    return leaves


def append_leaves(store: LedgerStore, day: str, ids: Sequence[str], retain_until: datetime | None) -> int:
    """Append `ids` to a day's log as one batch object; return its start index. Races are retried."""
    body = b"".join(leaf_data(i) for i in ids)
    start = log_size(store, day)
    for _ in range(MAX_RACE_RETRIES):
        if store.put_new(leaves_key(day, start), body, retain_until):
            return start
        start = log_size(store, day)  # another writer took this index: go after it
    raise LedgerError(f"leaf log of {day}: lost the append race {MAX_RACE_RETRIES} times")


class MerkleLogWriter:
    """Appends the ids of every confirmed batch to the day logs (see module doc); `LedgerError` when it cannot."""

    def __init__(self, store: LedgerStore, retention: timedelta | None) -> None:
        self.store = store
        self.retention = retention
        self._seen: dict[str, set[str]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-log")

    def _retain_until(self) -> datetime | None:
        return None if self.retention is None else datetime.now(UTC) + self.retention

    async def append(self, batch: Sequence[StoredRecord]) -> None:
        """Append the batch's ids (in spool order, each day's to its log) that this writer has not appended."""
        by_day: dict[str, list[str]] = {}
        for item in sorted(batch, key=lambda o: o.seq):
            day = capture_day(item.captured_at)
            seen = self._seen.setdefault(day, set())
            ids = by_day.setdefault(day, [])
            if item.envelope_id not in seen and item.envelope_id not in ids:
                ids.append(item.envelope_id)
        loop = asyncio.get_running_loop()
        for day, ids in by_day.items():
            if not ids:
                continue
            try:
                await loop.run_in_executor(self._pool, self._append, day, ids)
            except LedgerError as exc:
                raise LedgerError(f"audit log {day}: {exc}") from exc
            self._seen[day].update(ids)
        self._forget_old_days()

    def _append(self, day: str, ids: list[str]) -> None:
        append_leaves(self.store, day, ids, self._retain_until())

    def _forget_old_days(self, keep: int = 3) -> None:
        for day in sorted(self._seen)[:-keep]:
            del self._seen[day]

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
