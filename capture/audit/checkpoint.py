"""Signed checkpoints of the day logs (``reprolane audit checkpoint``) and the reconcile repair job.

`write_checkpoint` reads a day's leaf batches, computes the RFC 9162 root of the whole sequence, signs a
`schemas.merkle.Checkpoint` with the Ed25519 key from the settings and writes it once, under Object Lock, to
``audit/checkpoints/day=D/<tree_size:012d>.json``. Nothing new since the last checkpoint: nothing is written.
A leaf log with gaps or overlapping batches is refused (it would sign a broken sequence): that is a finding
for ``reprolane verify --range``, not something a checkpoint may paper over.

Run it often (a cron every few minutes, and once after the day ends): everything after the latest checkpoint
is only as trustworthy as the bucket's write permissions; everything before it is signed.

`reconcile` appends the leaves (id and the sha256 of the bytes stored) of a day's envelope objects that are in no
leaf (the crash window of `capture.ledger.merkle_log`), and says which. It is an operator action: it cannot tell
such an envelope from an inserted one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from capture.audit.errors import AuditError
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import append_leaves, read_leaves
from schemas.errors import ContractError
from schemas.layout import (
    ENVELOPES_PREFIX,
    checkpoint_key,
    checkpoints_prefix,
    date_prefix,
    envelope_id_of_key,
    is_envelope_key,
    log_id,
    partition_value,
)
from schemas.merkle import Checkpoint, LeafEntry, decode_checkpoint, merkle_root, object_digest, sign_checkpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredCheckpoint:
    key: str
    checkpoint: Checkpoint | None  # None: the object does not parse as a checkpoint
    error: str | None = None


def list_checkpoints(store: AuditStore, day: str) -> list[StoredCheckpoint]:
    """Every checkpoint object of a day, smallest tree first (unparseable ones kept, with their error)."""
    found: list[StoredCheckpoint] = []
    for key, _ in sorted(store.list_keys(checkpoints_prefix(day))):
        body = store.get(key)
        if body is None:
            continue
        try:
            found.append(StoredCheckpoint(key, decode_checkpoint(body)))
        except ContractError as exc:
            found.append(StoredCheckpoint(key, None, str(exc)))
    return sorted(found, key=lambda c: (c.checkpoint.tree_size if c.checkpoint else -1, c.key))


def write_checkpoint(
    store: AuditStore,
    day: str,
    private_raw: bytes,
    *,
    retention: timedelta | None,
    now: datetime | None = None,
) -> Checkpoint | None:
    """Sign and store a checkpoint of the whole day log; None when the latest checkpoint already covers it."""
    leaves = read_leaves(store, day)
    if leaves.problems:
        raise AuditError(f"leaf log of {day} is broken, not signing it: {leaves.problems[0]}")
    size = len(leaves.ids)
    existing = [c.checkpoint for c in list_checkpoints(store, day) if c.checkpoint is not None]
    if size == 0 or any(c.tree_size == size for c in existing):
        return None
    issued = now or datetime.now(UTC)
    root = merkle_root([e.data() for e in leaves.entries])
    checkpoint = sign_checkpoint(private_raw, log_id(day), size, root, issued)
    until = issued + retention if retention is not None else None
    if not store.put_new(checkpoint_key(day, size), checkpoint.canonical(), until):
        return None  # a concurrent run signed the same size first
    log.info("audit: checkpoint %s size %d root %s", day, size, checkpoint.root_hash)
    return checkpoint


def envelope_days(store: AuditStore) -> list[str]:
    """Every capture day that has envelope objects (any tenant)."""
    days: set[str] = set()
    for tenant_prefix in store.subfolders(ENVELOPES_PREFIX):
        for day_prefix in store.subfolders(tenant_prefix):
            day = partition_value(day_prefix, "date")
            if day is not None:
                days.add(day)
    return sorted(days)


def day_objects(store: AuditStore, day: str) -> dict[str, str]:
    """Envelope id (from the key name) -> object key, for every tenant's objects of a day."""
    objects: dict[str, str] = {}
    for tenant_prefix in store.subfolders(ENVELOPES_PREFIX):  # every folder, not only well-named tenants
        for key, _ in store.list_keys(date_prefix(tenant_prefix, day)):
            if is_envelope_key(key):
                objects[envelope_id_of_key(key)] = key
    return objects


def reconcile(store: AuditStore, day: str, *, retention: timedelta | None, dry_run: bool = False) -> list[str]:
    """Append (in key order) leaves of the day's objects that are in no leaf, committing to the bytes stored now;
    return their ids."""
    logged = set(read_leaves(store, day).ids)
    objects = day_objects(store, day)
    missing = sorted(eid for eid in objects if eid not in logged)
    if missing and not dry_run:
        entries = []
        for eid in missing:
            body = store.get(objects[eid])
            if body is None:
                raise AuditError(f"reconcile {day}: {objects[eid]} vanished while reading it")
            entries.append(LeafEntry(eid, object_digest(body)))
        until = datetime.now(UTC) + retention if retention is not None else None
        start = append_leaves(store, day, entries, until)
        log.warning("audit: reconcile %s appended %d ids at leaf %d", day, len(missing), start)
    return missing
