"""Signed checkpoints of the day logs (``reprolane audit checkpoint``, and on a schedule
`capture.audit.checkpointer`) and the reconcile repair job.

`write_checkpoint` reads a day's leaf batches, computes the RFC 9162 root of the whole sequence, signs a C2SP
checkpoint (`schemas.note`: origin ``<key name>/day=D``, size, root; an Ed25519 signed note) with the key from
the settings and writes it once, under Object Lock, to ``audit/checkpoints/day=D/<tree_size:012d>.checkpoint``.
Before it signs, the new tree must be consistent with the latest checkpoint already signed (an RFC 9162
consistency proof from that one to the new one verifies): a log that was truncated or rewritten under a signed
checkpoint is refused with `InconsistentLogError`, never signed over. Nothing new since the last checkpoint:
nothing is written. A leaf log with gaps or overlapping batches is refused too (it would sign a broken
sequence): that is a finding for ``reprolane audit verify --range``, not something a checkpoint may paper over.

Two formats are read: the C2SP notes written now, and the JSON `schemas.merkle.Checkpoint` objects
(``<size>.json``) written before; both are verified with the same Ed25519 key (`verified_heads`). A day whose
latest checkpoint is a JSON one gets a C2SP checkpoint of the same size on the next run (after the same
consistency check), so every log has a checkpoint outside tools can read.

Run it often (a cron every few minutes, and once after the day ends): everything after the latest checkpoint
is only as trustworthy as the bucket's write permissions; everything before it is signed.

`reconcile` appends the leaves (id and the sha256 of the bytes stored) of a day's envelope objects that are in no
leaf (the crash window of `capture.ledger.merkle_log`), and says which. It is an operator action: it cannot tell
such an envelope from an inserted one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from capture.audit.errors import AuditError, InconsistentLogError
from capture.audit.signing_keys import public_of
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import append_leaves, read_leaves
from schemas.errors import ContractError
from schemas.layout import (
    ENVELOPES_PREFIX,
    LOG_PREFIX,
    SCHEDULE_LOGS_PREFIX,
    LogName,
    checkpoint_size_of_key,
    checkpoints_prefix,
    date_prefix,
    envelope_id_of_key,
    is_envelope_key,
    is_note_checkpoint_key,
    log_id,
    log_origin,
    note_checkpoint_key,
    partition_value,
    schedule_log,
)
from schemas.merkle import (
    Checkpoint,
    LeafEntry,
    consistency_proof,
    decode_checkpoint,
    object_digest,
    root_from_hashes,
    verify_checkpoint,
    verify_consistency,
)
from schemas.note import (
    Note,
    TreeHead,
    VerifierKey,
    key_named_in,
    parse_note,
    parse_tree_head,
    sign_checkpoint_note,
    verifies,
)

log = logging.getLogger(__name__)

#: The key name (and origin prefix) of checkpoints when the settings name none (``REPROLANE_AUDIT_LOG_ORIGIN``).
DEFAULT_KEY_NAME = "reprolane.local/audit"


@dataclass(frozen=True)
class StoredCheckpoint:
    """One checkpoint object as stored: a JSON `Checkpoint`, or a C2SP note and its tree head; neither (with
    `error`) when it does not parse."""

    key: str
    checkpoint: Checkpoint | None
    error: str | None = None
    note: Note | None = None
    head: TreeHead | None = None

    @property
    def tree_size(self) -> int:
        if self.checkpoint is not None:
            return self.checkpoint.tree_size
        return self.head.tree_size if self.head is not None else -1


@dataclass(frozen=True)
class SignedHead:
    """A checkpoint whose signature verified under the key asked for, in either format."""

    key: str
    tree_size: int
    root_hash: str  # hex
    signer: str  # how the report names the key that signed it
    issued: str | None  # JSON checkpoints say when they were signed; C2SP notes do not
    c2sp: bool


def _parse(key: str, body: bytes) -> StoredCheckpoint:
    try:
        if is_note_checkpoint_key(key):
            note = parse_note(body)
            return StoredCheckpoint(key, None, note=note, head=parse_tree_head(note.text))
        return StoredCheckpoint(key, decode_checkpoint(body))
    except ContractError as exc:
        return StoredCheckpoint(key, None, str(exc))


def list_checkpoints(store: AuditStore, day: str) -> list[StoredCheckpoint]:
    """Every checkpoint object of a day, smallest tree first (unparseable ones kept, with their error)."""
    found: list[StoredCheckpoint] = []
    for key, _ in sorted(store.list_keys(checkpoints_prefix(day))):
        body = store.get(key)
        if body is not None:
            found.append(_parse(key, body))
    return sorted(found, key=lambda c: (c.tree_size, c.key))


def verified_heads(
    stored: list[StoredCheckpoint], day: str, public_raw: bytes, key_name: str | None = None
) -> tuple[list[SignedHead], list[str]]:
    """The checkpoints signed by this key for this day's log (named by their size), and why each other one is
    not. A note is signed under `key_name`, or (None) under any name whose key id this key gives; its origin
    must be that name's origin of the day (`schemas.layout.log_origin`)."""
    good: list[SignedHead] = []
    problems: list[str] = []
    for item in stored:
        size_named = checkpoint_size_of_key(item.key)
        if item.checkpoint is not None:
            cp = item.checkpoint
            if not verify_checkpoint(cp, public_raw):
                problems.append(f"signature of {item.key} does not verify (key {cp.key_id})")
            elif size_named != cp.tree_size or cp.log_id != log_id(day):
                problems.append(f"{item.key} holds {cp.log_id} size {cp.tree_size}")
            else:
                signer = f"Ed25519 key {cp.key_id}"
                good.append(SignedHead(item.key, cp.tree_size, cp.root_hash, signer, cp.issued_at.isoformat(), False))
        elif item.note is not None and item.head is not None:
            key = VerifierKey(key_name, public_raw) if key_name else key_named_in(item.note, public_raw)
            if key is None or not verifies(item.note, key):
                problems.append(f"signature of {item.key} does not verify under the key")
            elif size_named != item.head.tree_size or item.head.origin != log_origin(key.name, day):
                problems.append(f"{item.key} holds {item.head.origin} size {item.head.tree_size}")
            else:
                signer = f"C2SP note, key {key.name}+{key.key_id:08x}"
                good.append(SignedHead(item.key, item.head.tree_size, item.head.root_hash.hex(), signer, None, True))
        else:
            problems.append(f"{item.key} does not parse: {item.error}")
    return good, problems


def check_consistent(day: str, hashes: list[bytes], heads: list[SignedHead]) -> None:
    """`InconsistentLogError` unless the tree of `hashes` extends every signed checkpoint of the largest size
    (an RFC 9162 consistency proof from it to the whole tree verifies)."""
    if not heads:
        return
    latest = max(h.tree_size for h in heads)
    if latest == 0:
        return
    new_root = root_from_hashes(hashes)
    for head in (h for h in heads if h.tree_size == latest):
        if latest > len(hashes):
            raise InconsistentLogError(
                f"log of {day} has {len(hashes)} leaves but checkpoint {head.key} signed {latest}: truncated"
            )
        old_root = bytes.fromhex(head.root_hash)
        proof = consistency_proof(hashes, latest)
        if not verify_consistency(latest, len(hashes), old_root, new_root, proof):
            raise InconsistentLogError(
                f"log of {day} is not consistent with checkpoint {head.key} (size {latest}): its first {latest} "
                "leaves were rewritten; not signing"
            )


def write_checkpoint(
    store: AuditStore,
    day: str,
    private_raw: bytes,
    *,
    retention: timedelta | None,
    key_name: str = DEFAULT_KEY_NAME,
    now: datetime | None = None,
) -> SignedHead | None:
    """Sign and store a C2SP checkpoint of the whole day log once it is consistent with the latest one signed;
    None when a C2SP checkpoint of this size is there already."""
    leaves = read_leaves(store, day)
    if leaves.problems:
        raise AuditError(f"leaf log of {day} is broken, not signing it: {leaves.problems[0]}")
    hashes = leaves.hashes()
    size = len(hashes)
    heads, problems = verified_heads(list_checkpoints(store, day), day, public_of(private_raw), key_name)
    for problem in problems:
        log.warning("audit: checkpoint of %s ignored: %s", day, problem)
    check_consistent(day, hashes, heads)
    if size == 0 or any(h.tree_size == size and h.c2sp for h in heads):
        return None
    issued = now or datetime.now(UTC)
    root = root_from_hashes(hashes)
    body = sign_checkpoint_note(TreeHead(log_origin(key_name, day), size, root), key_name, private_raw)
    until = issued + retention if retention is not None else None
    key = note_checkpoint_key(day, size)
    if not store.put_new(key, body, until):
        return None  # a concurrent run signed the same size first
    log.info("audit: checkpoint %s size %d root %s", day, size, root.hex())
    signer = VerifierKey(key_name, public_of(private_raw))
    return SignedHead(key, size, root.hex(), f"C2SP note, key {signer.encode()}", issued.isoformat(), True)


def merkle_logs(store: AuditStore, only_days: Sequence[str] | None = None) -> list[LogName]:
    """Every Merkle log in the bucket: the day logs (only `only_days` when given), then every engine's schedule
    log (none when days are named)."""
    days = sorted(d for p in store.subfolders(LOG_PREFIX) if (d := partition_value(p, "day")))
    if only_days is not None:
        return [d for d in days if d in only_days]
    engines = sorted(e for p in store.subfolders(SCHEDULE_LOGS_PREFIX) if (e := partition_value(p, "engine")))
    return days + [schedule_log(e) for e in engines]


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
