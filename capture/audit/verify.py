"""Verification: inclusion of one envelope, consistency of a day's checkpoints, and tamper findings.

``reprolane audit verify REQUEST_ID``: index -> envelope object -> its first leaf in the day log -> the object's stored
bytes must hash to what that leaf commits to -> an RFC 9162 inclusion proof of the leaf against the latest signed
checkpoint covering it, whose Ed25519 signature is checked with the public key.

What binds the stored bytes (`check_object`): a format-2 leaf (`schemas.merkle`) commits to the sha256 of the
exact bytes stored (of a compact object, `schemas.envelope_compact`: of the canonical bytes it decodes to), so
any change to an object, sealed or not (junk, another envelope's bytes, the same plaintext sealed again, a
truncation, a compact object edited or that no longer decodes), is ``modified``, and the message says what the
bytes are now. A
plaintext object must also hash to the id in its key name, and a sealed one must be a sealed record of that id.
A format-1 leaf (older logs) and an object in no leaf commit to the id only: a plaintext object is still bound
(its id is its hash), a sealed one only by the id it claims, which anyone with write access can forge; that
is said as an informational ``sealed`` finding.

``reprolane audit verify --schedule ENGINE``: the same of an engine's schedule log (`verify_schedule_log`): its
checkpoints, and every stored segment against the leaf that commits to its shapes.

``reprolane audit verify --range DAY[:FROM:TO]``: every checkpoint's signature, each checkpoint's root against the
current leaf prefix, a consistency proof between consecutive checkpoints, every leaf has its object, every
object of the day is a leaf, and every object's bytes still hash to what its leaf commits to.

What each finding means (``fatal`` ones make the verdict fail, exit 1):

    modified          stored bytes hash to something else than the leaf committed to (or than the id; or a sealed
                      record names another id)
    deleted           a leaf has no object, or a signed checkpoint is larger than the log now is
    reordered         the leaves under a checkpoint are a permutation of what was signed (the swap is named
                      when it is a single one)
    altered           the leaves under a checkpoint no longer hash to its root (inserted or replaced leaves)
    inserted          an object of the day is in no leaf (or it was stored and not logged before a crash)
    misindexed        the request id's index entry disagrees with the envelope it points at (another tenant's,
                      another request's record: `capture.audit.index`)
    not_logged        the envelope asked for is stored but in no leaf
    not_checkpointed  it is logged, but no signed checkpoint covers its leaf yet
    bad_checkpoint    a checkpoint object does not parse, is misnamed, or its signature does not verify
    broken_log        leaf batches with gaps, overlaps or torn lengths
    duplicate, expired, sealed, unsigned_tail   informational
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from capture.audit.checkpoint import SignedHead, StoredCheckpoint, day_objects, list_checkpoints, verified_heads
from capture.audit.errors import UnknownIdError
from capture.audit.index import check_entry, read_entry
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import LeafLog, read_leaves
from schemas import envelope_bytes, sha256_hex
from schemas.envelope_compact import is_compact
from schemas.errors import ContractError
from schemas.layout import (
    EXPIRY_PREFIX,
    LogName,
    capture_day_of_key,
    envelope_id_of_key,
    log_id,
    request_index_key,
    schedule_engine_prefix,
    schedule_log,
)
from schemas.merkle import (
    LeafEntry,
    consistency_proof,
    inclusion_proof,
    object_digest,
    root_from_hashes,
    verify_consistency,
    verify_inclusion,
)
from schemas.schedule_delivery import decode_segment, parse_segment_file_name
from schemas.schedule_proof import record_hashes, segment_id, segment_leaf
from schemas.sealed import decode_sealed, is_sealed

INFO_KINDS = frozenset({"duplicate", "expired", "sealed", "unsigned_tail"})
MAX_SWAP_SEARCH = 64
CHECK_WORKERS = 8  # objects are read and hashed in parallel (boto3 clients are thread-safe)
_ID_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Finding:
    kind: str
    message: str

    @property
    def fatal(self) -> bool:
        return self.kind not in INFO_KINDS


@dataclass
class Verdict:
    subject: str
    findings: list[Finding] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.fatal for f in self.findings)

    def add(self, kind: str, message: str) -> None:
        self.findings.append(Finding(kind, message))

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings if f.fatal}


def _what_it_is(body: bytes, name: str) -> str:
    """What the bytes stored under envelope `name`'s key are, to name a modification."""
    if is_sealed(body):
        try:
            sealed = decode_sealed(body)
        except ContractError:
            return "sealed JSON that is not a valid sealed envelope (forged)"
        if sealed.envelope_id != name:
            return f"a sealed record of another envelope ({sealed.envelope_id}: replaced)"
        return f"a sealed record of this envelope with other bytes (re-sealed: key {sealed.key_id}, another nonce)"
    try:
        doc = json.loads(envelope_bytes(body))
    except ContractError:
        return f"{len(body)} bytes of a compact envelope that do not decode (truncated or overwritten)"
    except ValueError:
        return f"{len(body)} bytes that are not JSON (truncated or overwritten)"
    if isinstance(doc, dict) and isinstance(doc.get("request_id"), str):
        return f"an envelope of request {doc['request_id']} that is not the logged one (edited or replaced)"
    return "JSON that is not an envelope (overwritten)"


def check_object(store: AuditStore, key: str, leaf: LeafEntry | None = None) -> Finding | None:
    """None when the object's bytes are what its leaf (if given) and its key name say (see module doc), else a
    finding: ``modified``, ``deleted``, or ``sealed`` (informational) when only a claimed id binds it."""
    name = envelope_id_of_key(key)
    body = store.get(key)
    if body is None:
        return Finding("deleted", f"deleted: envelope object {key} is gone")
    actual = object_digest(body)  # of a compact object: of the canonical bytes it decodes to
    decoded = " once decoded from compact" if is_compact(body) and actual != sha256_hex(body) else ""
    if leaf is not None and leaf.object_sha256 is not None and actual != leaf.object_sha256:
        return Finding(
            "modified",
            f"modified: stored bytes of {key} hash to {actual}{decoded}, the log committed to {leaf.object_sha256}; "
            f"they are {_what_it_is(body, name)}",
        )
    if not is_sealed(body):
        if actual != name:
            return Finding(
                "modified",
                f"modified: stored bytes of {key} hash to {actual}{decoded}, id says {name}; "
                f"they are {_what_it_is(body, name)}",
            )
        return None
    try:
        sealed = decode_sealed(body)
    except ContractError as exc:
        return Finding("modified", f"modified: {key} is not a valid sealed envelope any more: {exc}")
    if sealed.envelope_id != name:
        return Finding("modified", f"modified: sealed record in {key} says envelope {sealed.envelope_id}")
    if leaf is not None and leaf.object_sha256 is not None:
        return None  # its exact bytes are the logged ones
    return Finding(
        "sealed",
        f"{key} is sealed and its leaf commits to its id only (leaf format 1, or no leaf): the id it claims is "
        "checked, its bytes are not bound",
    )


def expired_ids(store: AuditStore) -> set[str]:
    """Envelope ids an expiry run reported deleting (their leaves have no object on purpose)."""
    ids: set[str] = set()
    for key, _ in store.list_keys(EXPIRY_PREFIX):
        body = store.get(key)
        try:
            doc = json.loads(body or b"{}")
            ids.update(str(d["envelope_id"]) for d in doc.get("deleted", []))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return ids


def _signed(stored: Sequence[StoredCheckpoint], day: str, public_raw: bytes, verdict: Verdict) -> list[SignedHead]:
    """The checkpoints (JSON or C2SP) whose signature, name and log id check out; the others become findings."""
    good, problems = verified_heads(list(stored), day, public_raw)
    for problem in problems:
        verdict.add("bad_checkpoint", f"bad_checkpoint: {problem}")
    return good


def _prefix_problem(ids: list[str], hashes: list[bytes], start: int, cp: SignedHead) -> Finding | None:
    """Why the leaves no longer hash to `cp` (leaves before `start` are known good), or None when they do."""
    size = cp.tree_size
    if size > len(hashes):
        return Finding("deleted", f"deleted: checkpoint size {size} was signed but the log has {len(hashes)} leaves")
    root = bytes.fromhex(cp.root_hash)
    if root_from_hashes(hashes[:size]) == root:
        return None
    lo = start
    if size - lo <= MAX_SWAP_SEARCH:
        for i in range(lo, size):
            for j in range(i + 1, size):
                trial = list(hashes[:size])
                trial[i], trial[j] = trial[j], trial[i]
                if root_from_hashes(trial) == root:
                    return Finding(
                        "reordered",
                        f"reordered: leaves {i} and {j} (envelope ids {ids[i][:16]}…, {ids[j][:16]}…) are swapped "
                        f"against checkpoint size {size}",
                    )
    return Finding("altered", f"altered: leaves {lo}..{size - 1} no longer hash to the root of checkpoint size {size}")


def _check_chain(day: str, leaves: LeafLog, good: list[SignedHead], verdict: Verdict) -> list[SignedHead]:
    """Each checkpoint against the current leaves, and consistency between consecutive ones; returns those that
    still match the leaves."""
    hashes = leaves.hashes()
    matching: list[SignedHead] = []
    last_good = 0
    previous: SignedHead | None = None
    for cp in good:
        problem = _prefix_problem(leaves.ids, hashes, last_good, cp)
        if problem is not None:
            verdict.findings.append(problem)
        else:
            matching.append(cp)
            last_good = cp.tree_size
        if previous is not None and problem is None and previous in matching:
            proof = consistency_proof(hashes[: cp.tree_size], previous.tree_size)
            old, new = bytes.fromhex(previous.root_hash), bytes.fromhex(cp.root_hash)
            if verify_consistency(previous.tree_size, cp.tree_size, old, new, proof):
                verdict.lines.append(
                    f"  consistent: size {previous.tree_size} -> {cp.tree_size} ({len(proof)}-hash proof)"
                )
            else:  # unreachable when both prefixes match; kept as a guard against a broken proof builder
                verdict.add("altered", f"altered: no consistency {previous.tree_size} -> {cp.tree_size}")
        previous = cp
    return matching


def verify_request(store: AuditStore, request_id: str, public_raw: bytes) -> Verdict:
    entry = read_entry(store, request_index_key(request_id))
    if entry is None:
        raise UnknownIdError(f"no envelope with request id {request_id!r} in s3://{store.bucket}")
    key, indexed_id = entry.key, entry.envelope_id
    verdict = Verdict(f"request {request_id}")
    envelope_id = envelope_id_of_key(key)
    if indexed_id != envelope_id:
        verdict.add("modified", f"modified: the index says envelope {indexed_id} but points at {key}")
    day = capture_day_of_key(key)
    if day is None or not _ID_RE.match(envelope_id):
        verdict.add("modified", f"modified: {key} is not an envelope key")
        return verdict
    leaves = read_leaves(store, day)
    leaf = leaves.first_entries().get(envelope_id)
    finding = check_object(store, key, leaf)
    if finding is not None:
        verdict.findings.append(finding)
    if finding is None or not finding.fatal:
        for problem in check_entry(store, entry, request_id=request_id).problems:
            verdict.add("misindexed", f"misindexed: the index entry of {request_id} does not match the envelope "
                                      f"it points at ({key}): {problem}")  # fmt: skip
        bound = "the logged bytes" if leaf is not None and leaf.object_sha256 is not None else "the id"
        verdict.lines.append(f"  object: {key} (stored bytes match {bound})")
    for problem in leaves.problems:
        verdict.add("broken_log", f"broken_log: {problem}")
    index = leaves.first_index().get(envelope_id)
    if index is None:
        verdict.add("not_logged", f"not_logged: envelope {envelope_id} ({key}) is stored but in no leaf of {day}")
        return verdict
    verdict.lines.append(f"  leaf: {index} of {log_id(day)} ({len(leaves.ids)} leaves)")
    good = _signed(list_checkpoints(store, day), day, public_raw, verdict)
    matching = _check_chain(day, leaves, good, verdict)
    covering = [cp for cp in matching if cp.tree_size > index]
    if not covering:
        if not verdict.kinds():
            latest = max((cp.tree_size for cp in good), default=0)
            verdict.add(
                "not_checkpointed",
                f"not_checkpointed: leaf {index} of {day} is after the latest signed checkpoint (size {latest}); "
                "run `reprolane audit checkpoint`",
            )
        return verdict
    cp = max(covering, key=lambda h: (h.tree_size, h.c2sp))  # a C2SP one when both formats sign a size
    hashes = leaves.hashes()[: cp.tree_size]
    proof = inclusion_proof(hashes, index)
    if not verify_inclusion(hashes[index], index, cp.tree_size, proof, bytes.fromhex(cp.root_hash)):
        verdict.add("altered", f"altered: inclusion proof of leaf {index} fails against checkpoint {cp.tree_size}")
        return verdict
    issued = f" issued {cp.issued}" if cp.issued else ""
    verdict.lines += [
        f"  checkpoint: size {cp.tree_size} root {cp.root_hash}{issued} ({cp.key.rsplit('/', 1)[-1]})",
        f"  signature: {cp.signer} verifies",
        f"  inclusion proof: {len(proof)} hashes, leaf {index} -> root: verifies",
    ]
    return verdict


def verify_range(
    store: AuditStore, day: str, public_raw: bytes, from_size: int | None = None, to_size: int | None = None
) -> Verdict:
    verdict = Verdict(f"{log_id(day)}" + (f" sizes {from_size}..{to_size}" if from_size is not None else ""))
    leaves = read_leaves(store, day)
    objects = day_objects(store, day)
    stored = list_checkpoints(store, day)
    if not leaves.ids and not objects and not stored:
        raise UnknownIdError(f"nothing stored for day {day} in s3://{store.bucket}")
    _check_checkpoints(day, leaves, stored, public_raw, verdict, from_size, to_size)
    _check_leaves_and_objects(store, day, leaves, objects, verdict)
    verdict.lines.append(f"  leaves: {len(leaves.ids)}; objects: {len(objects)}")
    return verdict


def _check_checkpoints(
    log: LogName,
    leaves: LeafLog,
    stored: list[StoredCheckpoint],
    public_raw: bytes,
    verdict: Verdict,
    from_size: int | None = None,
    to_size: int | None = None,
) -> None:
    """A log's leaf batches, every checkpoint's signature and root against the leaves, consistency between
    consecutive ones (only those of sizes `from_size`..`to_size` when given), and its unsigned tail."""
    for problem in leaves.problems:
        verdict.add("broken_log", f"broken_log: {problem}")
    good = _signed(stored, log, public_raw, verdict)
    if from_size is not None and to_size is not None:
        sizes = {cp.tree_size for cp in good}
        for size in (from_size, to_size):
            if size not in sizes:
                raise UnknownIdError(f"no signed checkpoint of size {size} for {log} (have {sorted(sizes)})")
        good = [cp for cp in good if from_size <= cp.tree_size <= to_size]
    matching = _check_chain(log, leaves, good, verdict)
    if not good:
        verdict.add("not_checkpointed", f"not_checkpointed: {log} has no signed checkpoint")
    elif matching:
        verdict.lines.insert(
            0, f"  checkpoints: {len(matching)} signed and matching, latest size {matching[-1].tree_size}"
        )
        if matching[-1].tree_size < len(leaves.ids):
            verdict.add(
                "unsigned_tail",
                f"unsigned_tail: leaves {matching[-1].tree_size}..{len(leaves.ids) - 1} not yet checkpointed",
            )


def verify_schedule_log(store: AuditStore, engine_id: str, public_raw: bytes) -> Verdict:
    """``reprolane audit verify --schedule ENGINE``: the engine's schedule log as a day log is checked (its
    checkpoints and their chain), then every segment stored against its leaf (`schemas.schedule_proof`): a leaf
    without its segment is ``deleted``, a segment whose shapes are not what its leaf commits to (or that no longer
    decodes) ``modified``, a segment in no leaf ``inserted`` (or stored before a crash and not logged yet: the
    shipper logs it when it ships the segment again)."""
    log = schedule_log(engine_id)
    verdict = Verdict(log_id(log))
    leaves = read_leaves(store, log)
    segments = {
        segment_id(engine_id, seq): (seq, key)
        for key, _ in store.list_keys(schedule_engine_prefix(engine_id))
        if (seq := parse_segment_file_name(key.rsplit("/", 1)[-1])) is not None
    }
    stored = list_checkpoints(store, log)
    if not leaves.ids and not segments and not stored:
        raise UnknownIdError(f"nothing stored for engine {engine_id} in s3://{store.bucket}")
    _check_checkpoints(log, leaves, stored, public_raw, verdict)
    for later, first in leaves.duplicates():
        verdict.add("duplicate", f"duplicate: leaf {later} repeats leaf {first} (a segment shipped again)")
    logged = leaves.first_entries()
    position = leaves.first_index()
    for sid, index in sorted(position.items(), key=lambda kv: kv[1]):
        if sid not in segments:
            verdict.add("deleted", f"deleted: leaf {index} (segment id {sid[:16]}…) has no segment object")
    for sid, (seq, key) in sorted(segments.items(), key=lambda kv: kv[1]):
        leaf = logged.get(sid)
        if leaf is None:
            verdict.add("inserted", f"inserted: segment {key} is in no leaf of {log}")
            continue
        body = store.get(key)
        try:
            hashes = record_hashes(decode_segment(body or b"", engine_id))
        except ContractError as exc:
            verdict.add("modified", f"modified: segment {key} (leaf {position[sid]}) no longer decodes: {exc}")
            continue
        if segment_leaf(engine_id, seq, hashes) != leaf:
            verdict.add("modified", f"modified: segment {key} holds other shapes than leaf {position[sid]} commits to")
    verdict.lines.append(f"  leaves: {len(leaves.ids)}; segments: {len(segments)}")
    return verdict


def _check_leaves_and_objects(
    store: AuditStore, day: str, leaves: LeafLog, objects: dict[str, str], verdict: Verdict
) -> None:
    expired = expired_ids(store) if any(eid not in objects for eid in leaves.ids) else set()
    for later, first in leaves.duplicates():
        verdict.add("duplicate", f"duplicate: leaf {later} repeats leaf {first} (at-least-once publishing)")
    for eid, index in sorted(leaves.first_index().items(), key=lambda kv: kv[1]):
        if eid in objects:
            continue
        if eid in expired:
            verdict.add("expired", f"expired: leaf {index} (envelope id {eid}) was deleted by an expiry run")
        else:
            verdict.add("deleted", f"deleted: leaf {index} (envelope id {eid}) has no object")
    logged = leaves.first_entries()
    ordered = sorted(objects.items())
    with ThreadPoolExecutor(max_workers=CHECK_WORKERS, thread_name_prefix="audit-verify") as pool:
        checked = list(pool.map(lambda item: check_object(store, item[1], logged.get(item[0])), ordered))
    for (eid, key), finding in zip(ordered, checked, strict=True):
        if eid not in logged:
            verdict.add(
                "inserted",
                f"inserted: object {key} (envelope id {eid}) is in no leaf of {day} "
                "(or it was stored and not logged before a crash: see `reprolane audit reconcile`)",
            )
        if finding is not None:
            verdict.findings.append(finding)
