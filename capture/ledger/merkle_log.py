"""The append-only Merkle log: which envelopes were stored, with which bytes, in which order, one log per UTC day.

Layout (in the envelope bucket, next to ``envelopes/``; the keys are `schemas.layout`'s)::

    audit/log/day=<YYYY-MM-DD>/leaves/<start:012d>.bin        leaf batch, leaf `start` onwards
    audit/checkpoints/day=<YYYY-MM-DD>/<tree_size:012d>.json  signed `schemas.merkle.Checkpoint`
    audit/expiry/<timestamp>-<uuid8>.json                     what an expiry run deleted

A leaf is (envelope id, sha256 of the object's stored bytes): leaf format 2 of `schemas.merkle`, which says
what the format-1 leaves of older logs (the id alone) could not prove. The day is the envelope's capture day
(the ``date=`` of its object key), so a day's log and a day's objects can be compared one to one.

Order is fixed at append time. The publisher hands every batch to `MerkleLogWriter` (through the sidecar's
``audit-log`` sink, `capture.publishing.sinks.AuditLogSink`) only after *every* sink (Kafka and S3) confirmed it, and
acks the spool only after the writer confirmed: a leaf never precedes its object. The writer appends one leaf batch
object per day per publisher batch with a conditional create of ``<start>.bin`` (If-None-Match): two writers
racing for the same start index cannot both win; the loser relists and takes the next free index. Each batch
object is written once, under Object Lock when retention is set.

The bytes a leaf commits to are the bytes stored. A plaintext envelope's object key is its content address, so
those are the record's own. A compact envelope (`schemas.envelope_compact`) is a plaintext envelope held in another
encoding: its leaf commits to the canonical bytes it decodes to (the second half of the leaf is then its id, as for
a JSON object), and ``reprolane audit verify`` decodes the object and hashes those. So a leaf says which record was
stored, whichever encoding holds it (the JSON of a record published before an ``envelope_encoding`` switch and
its compact form after it are the same record), without a read-back per envelope; any change to what the object
decodes to, or bytes that do not decode, is a modification.

A sealed envelope is sealed afresh (a new nonce, maybe a newer key) each time a batch is published, and the S3 sink
takes "already there" as success, so after a crash between the S3 put and the leaf append the object holds an
earlier sealing than the record in hand: the writer reads every sealed object back and commits to what is stored
when it is a sealing of the same envelope (same id, request, tenant, capture time and workflow), and to the record
in hand otherwise, so ``reprolane audit verify`` names a foreign object as modified instead of the log vouching for it.
That is one GET per sealed envelope. What this cannot tell: a sealing of the same metadata that someone with
PutObject wrote under the key *before* the sidecar did (they would need the envelope id before it was stored); the
writer holds no data key to open it.

Duplicates: delivery is at-least-once (a crash after the append and before the spool ack republishes the
batch), and a restarted writer has forgotten what it appended. Rather than a fragile seen-set, the rule is:
a checkpoint commits to the exact leaf sequence, duplicates included; the verifier takes the *first*
occurrence of an id as its position and reports later ones as harmless duplicates. Within one process the
writer still skips ids it appended recently, so that a batch the publisher retries (one day's append
succeeded, another's failed) does not append the succeeded day's ids again: `RecentIds`, a bounded
insertion-ordered set of the last ``seen_ids`` ids (raw 32 bytes each). An id older than that is appended
again only if the publisher hands it over again, which only a retry of the same batch or a crash does; a
duplicate leaf is harmless either way.

Crash windows, honestly: between the S3 put of an envelope and its leaf append the envelope is stored but
not logged. The spool still holds it, so the restarted publisher appends it; if the spool was lost as well,
the verifier reports "not logged" (distinct from a modification) and ``reprolane audit reconcile --day D``
(`capture.audit.checkpoint.reconcile`) appends the ids it finds in the day's objects. Reconcile cannot tell such
an envelope from one an attacker inserted; that is why it is a deliberate, logged operator action and not
automatic.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from capture.ledger.errors import LedgerError
from capture.ledger.records import StoredRecord
from capture.ledger.store import LedgerStore
from schemas import sha256_hex
from schemas.envelope_compact import is_compact
from schemas.errors import ContractError
from schemas.layout import capture_day, envelope_key, is_leaves_key, leaves_key, leaves_prefix, leaves_start
from schemas.merkle import LeafEntry, decode_leaf_batch, encode_leaf_batch, leaf_batch_count
from schemas.sealed import SEALED_SCHEMA_VERSION, SealedEnvelope, decode_sealed

log = logging.getLogger(__name__)

MAX_RACE_RETRIES = 20
#: Ids a writer remembers having appended (`RecentIds`): far more than a publisher batch holds (its memory at
#: this size: BENCHMARKS.md, ``bench_audit_log.py --seen-ids``).
SEEN_IDS = 65_536
READ_BACK_WORKERS = 8


@dataclass
class LeafLog:
    """A day's leaves as stored, in order, and anything wrong with the batch objects."""

    day: str
    entries: list[LeafEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ids(self) -> list[str]:
        return [e.envelope_id for e in self.entries]

    def hashes(self) -> list[bytes]:
        return [e.hash() for e in self.entries]

    def first_index(self) -> dict[str, int]:
        """Envelope id -> the index of its first occurrence (the canonical one)."""
        first: dict[str, int] = {}
        for i, entry in enumerate(self.entries):
            first.setdefault(entry.envelope_id, i)
        return first

    def first_entries(self) -> dict[str, LeafEntry]:
        """Envelope id -> its first leaf (what the object's bytes are checked against)."""
        first: dict[str, LeafEntry] = {}
        for entry in self.entries:
            first.setdefault(entry.envelope_id, entry)
        return first

    def duplicates(self) -> list[tuple[int, int]]:
        """(later index, first index) of every repeated id."""
        first: dict[str, int] = {}
        dups: list[tuple[int, int]] = []
        for i, entry in enumerate(self.entries):
            if entry.envelope_id in first:
                dups.append((i, first[entry.envelope_id]))
            else:
                first[entry.envelope_id] = i
        return dups


def log_size(store: LedgerStore, day: str) -> int:
    """The next free leaf index of a day (from the listing only: start + length of the last batch)."""
    size = 0
    for key, nbytes in store.list_keys(leaves_prefix(day)):
        if is_leaves_key(key):
            size = max(size, leaves_start(key) + leaf_batch_count(nbytes))
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
        entries, torn = decode_leaf_batch(body)
        if torn is not None:
            leaves.problems.append(f"leaf batch {key} {torn}")
        if start != len(leaves.entries):
            leaves.problems.append(f"leaf batch {key} starts at {start} but the log has {len(leaves.entries)} leaves")
        leaves.entries += entries
    return leaves


def append_leaves(store: LedgerStore, day: str, entries: Sequence[LeafEntry], retain_until: datetime | None) -> int:
    """Append `entries` to a day's log as one (format 2) batch object; return its start index. Races are retried."""
    body = encode_leaf_batch(entries)
    start = log_size(store, day)
    for _ in range(MAX_RACE_RETRIES):
        if store.put_new(leaves_key(day, start), body, retain_until):
            return start
        start = log_size(store, day)  # another writer took this index: go after it
    raise LedgerError(f"leaf log of {day}: lost the append race {MAX_RACE_RETRIES} times")


class RecentIds:
    """The last `capacity` ids added (raw 32 bytes each), oldest forgotten first: a bounded seen-set."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._ids: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, envelope_id: str) -> bool:
        return bytes.fromhex(envelope_id) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add_all(self, envelope_ids: Iterable[str]) -> None:
        for envelope_id in envelope_ids:
            raw = bytes.fromhex(envelope_id)
            self._ids[raw] = None
            self._ids.move_to_end(raw)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


def _same_envelope(a: SealedEnvelope, b: SealedEnvelope) -> bool:
    """Two sealings of one envelope: the same metadata but for the key, nonce and ciphertext."""
    fields = ("envelope_id", "request_id", "tenant", "captured_at", "workflow")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def stored_digest(store: LedgerStore, item: StoredRecord) -> str:
    """The sha256 a leaf of `item` commits to: of its payload, or of the stored earlier sealing of the same
    envelope (see module doc). `LedgerError` when the object is not there (the S3 sink confirmed it: retry)."""
    if is_compact(item.payload):  # `schemas.merkle.object_digest` of it, known without decoding: the id
        return item.envelope_id
    digest = sha256_hex(item.payload)
    if item.schema_version != SEALED_SCHEMA_VERSION:
        return digest  # plaintext: the id is the hash of the payload, and the object key is that id
    key = envelope_key(item.envelope_id, item.tenant, item.captured_at)
    stored = store.get(key)
    if stored is None:
        raise LedgerError(f"sealed envelope {key} is not stored (yet)")
    if stored == item.payload:
        return digest
    try:
        same = _same_envelope(decode_sealed(stored), decode_sealed(item.payload))
    except ContractError:
        same = False
    if same:
        log.warning("audit log: %s holds an earlier sealing of envelope %s: logging that one", key, item.envelope_id)
        return sha256_hex(stored)
    log.error(
        "audit log: %s holds bytes that are not a sealing of envelope %s: logging the sidecar's own, "
        "verify will report the object modified",
        key,
        item.envelope_id,
    )
    return digest


class MerkleLogWriter:
    """Appends the leaves of every confirmed batch to the day logs (see module doc); `LedgerError` when it cannot."""

    def __init__(self, store: LedgerStore, retention: timedelta | None, *, seen_ids: int = SEEN_IDS) -> None:
        self.store = store
        self.retention = retention
        self._seen = RecentIds(seen_ids)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-log")
        self._readers = ThreadPoolExecutor(max_workers=READ_BACK_WORKERS, thread_name_prefix="audit-log-read")

    def _retain_until(self) -> datetime | None:
        return None if self.retention is None else datetime.now(UTC) + self.retention

    async def append(self, batch: Sequence[StoredRecord]) -> None:
        """Append the batch's leaves (in spool order, each day's to its log) that this writer has not appended."""
        by_day: dict[str, list[StoredRecord]] = {}
        taken: set[str] = set()
        for item in sorted(batch, key=lambda o: o.seq):
            if item.envelope_id in self._seen or item.envelope_id in taken:
                continue
            taken.add(item.envelope_id)
            by_day.setdefault(capture_day(item.captured_at), []).append(item)
        loop = asyncio.get_running_loop()
        for day, items in by_day.items():
            try:
                digests = await asyncio.gather(
                    *(loop.run_in_executor(self._readers, stored_digest, self.store, item) for item in items)
                )
                entries = [LeafEntry(i.envelope_id, d) for i, d in zip(items, digests, strict=True)]
                await loop.run_in_executor(self._pool, self._append, day, entries)
            except LedgerError as exc:
                raise LedgerError(f"audit log {day}: {exc}") from exc
            self._seen.add_all(e.envelope_id for e in entries)

    def _append(self, day: str, entries: list[LeafEntry]) -> None:
        append_leaves(self.store, day, entries, self._retain_until())

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
