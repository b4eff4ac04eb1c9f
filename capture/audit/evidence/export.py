"""``reprolane audit evidence export REQUEST_ID -o FILE``: everything an outside verifier needs about one record,
in one file.

The bundle's format is `capture.audit.evidence.bundle`'s. Export reads, never writes, the audit bucket:

A workflow id (`workflow_requests`) names every recorded step of a workflow: one bundle per step.

1. the request index -> the envelope object, its bytes exactly as stored;
2. the day log: the envelope's first leaf, which must commit to those bytes (export packages only what
   verifies: a record ``reprolane audit verify`` would fail is refused, naming why);
3. the latest C2SP checkpoint that covers the leaf, verified under the audit key and still matching the log
   (none yet: run ``reprolane audit checkpoint``, or wait for the checkpointer; a day with only JSON
   checkpoints gets its first C2SP one that way), and the RFC 9162 inclusion proof against it;
4. the envelope's replay results (divergence events inside), its artifact and runtime fingerprints and the
   replay lanes', the object's legal hold and retention as S3 reports them;
5. a summary page, and the manifest, signed with the audit key (`schemas.note`), which is why export needs
   the signing key: replay results and retention are not in the Merkle log, and the signature is what makes a
   later change to them visible.

A sealed envelope (an encrypted tenant) is exported sealed: its bytes are what the log commits to, and the
bundle opens nothing (fingerprints and prompt stay inside the ciphertext; the summary says so).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from capture.audit.checkpoint import list_checkpoints, verified_heads
from capture.audit.errors import AuditError, UnknownIdError
from capture.audit.evidence.bundle import (
    ENVELOPE,
    FINGERPRINTS,
    KEY,
    MANIFEST,
    PROOF,
    REEXECUTION_PARTS,
    RETENTION,
    SUMMARY,
    Manifest,
    Part,
    proof_parts,
    replay_member,
    write_zip,
)
from capture.audit.evidence.summary import LogPlace, render_summary
from capture.audit.signing_keys import public_of
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import read_leaves
from schemas import ContractError, decode_envelope, sha256_hex
from schemas.envelope import is_valid_request_id
from schemas.layout import (
    REPLAYS_PREFIX,
    LogName,
    capture_day_of_key,
    date_prefix,
    envelope_id_of_key,
    request_index_key,
    workflow_index_prefix,
)
from schemas.merkle import LeafEntry, inclusion_proof, object_digest, root_from_hashes
from schemas.note import TlogProof, VerifierKey, key_fingerprint, sign_note
from schemas.replay import decode_replay_result
from schemas.sealed import decode_sealed, is_sealed, is_sealed_result


class EvidenceError(AuditError):
    """The record cannot be exported as evidence (it does not verify, or no checkpoint covers it yet)."""


@dataclass(frozen=True)
class Exported:
    bundle: bytes
    place: LogPlace
    replays: int


def _pointer(store: AuditStore, request_id: str) -> tuple[str, str]:
    body = store.get(request_index_key(request_id))
    if body is None:
        raise UnknownIdError(f"no envelope with request id {request_id!r} in s3://{store.bucket}")
    try:
        pointer = json.loads(body)
        return str(pointer["key"]), str(pointer["envelope_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UnknownIdError(f"index entry of {request_id!r} is unreadable: {exc!r}") from exc


def _stored_record(store: AuditStore, key: str) -> tuple[bytes, dict[str, Any]]:
    """The envelope object's stored bytes and what they say (`_record_facts`); `EvidenceError` when it is gone or
    does not decode."""
    body = store.get(key)
    if body is None:
        raise EvidenceError(f"envelope object {key} is gone")
    try:
        return body, _record_facts(body)
    except ContractError as exc:
        raise EvidenceError(f"envelope object {key} does not decode: {exc}") from exc


def _record_facts(body: bytes) -> dict[str, Any]:
    """What the stored bytes say about the record (all of it when plaintext, the clear metadata when sealed)."""
    sealed = decode_sealed(body) if is_sealed(body) else None
    record = sealed if sealed is not None else decode_envelope(body)
    facts: dict[str, Any] = {
        "sealed": sealed is not None,
        "tenant": record.tenant,
        "captured_at": record.captured_at.isoformat(),
        "workflow": record.workflow.model_dump(mode="json") if record.workflow else None,
    }
    if sealed is not None:
        facts["key_id"] = sealed.key_id
    else:
        facts["envelope"] = record
    return facts


def _replays(store: AuditStore, day: str, envelope_id: str) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for key, _ in store.list_keys(f"{date_prefix(REPLAYS_PREFIX, day)}{envelope_id}/"):
        name = key.rsplit("/", 1)[-1].removesuffix(".json")
        body = store.get(key)
        if body is not None and len(name) == 64 and all(c in "0123456789abcdef" for c in name):
            found[name] = body
    return found


def _fingerprints(facts: dict[str, Any], replays: dict[str, bytes]) -> dict[str, Any]:
    doc: dict[str, Any] = {"sealed": facts["sealed"], "replays": {}}
    env = facts.get("envelope")
    if env is not None:
        doc["artifacts"] = env.artifacts.model_dump(mode="json")
        doc["runtime"] = env.runtime.model_dump(mode="json")
        doc["runtime_sha256"] = env.runtime.sha256()
    for result_id, body in sorted(replays.items()):
        if is_sealed_result(body):
            doc["replays"][result_id] = {"sealed": True}
            continue
        try:
            event = decode_replay_result(body).event
        except ContractError as exc:
            raise EvidenceError(f"stored replay result {result_id} does not decode: {exc}") from exc
        doc["replays"][result_id] = {
            "lane": event.lane,
            "lane_fingerprint": event.lane_fingerprint.model_dump(mode="json"),
            "lane_fingerprint_sha256": event.lane_fingerprint_sha256,
            "differs": [d.model_dump(mode="json") for d in event.fingerprint_diffs],
        }
    return doc


def _retention(store: AuditStore, key: str) -> dict[str, Any]:
    state = store.lock_state(key)
    if state is None:
        raise EvidenceError(f"envelope object {key} vanished while exporting it")
    return {
        "object_key": key,
        "bucket": store.bucket,
        "version_id": state["version_id"],
        "object_lock_mode": state["mode"],
        "retain_until": state["retain_until"],
        "legal_hold": state["legal_hold"] == "ON" or store.legal_hold(key, str(state["version_id"])),
    }


class ProvenLeaf(NamedTuple):
    at: int  # its first index in the log
    path: list[bytes]  # RFC 9162 inclusion path to the checkpoint's root
    entry: LeafEntry


@dataclass(frozen=True)
class LogProofs:
    """Leaves of one Merkle log proven against one C2SP checkpoint of it, signed by the audit key."""

    checkpoint: bytes  # the signed note
    tree_size: int
    root_hash: str  # hex
    leaves: dict[str, ProvenLeaf]  # by leaf id


#: Proves leaves of a log (`prove_leaves` with the exporter's store and key): the log, the leaf ids.
LogProver = Callable[[LogName, Sequence[str]], LogProofs]
#: What a re-executable bundle adds, from the envelope's stored bytes: members by name (`REEXECUTION_PARTS`); its
#: schedule is proven with the `LogProver` it is given.
ExtraMembers = Callable[[bytes, LogProver], Mapping[str, bytes]]


def prove_leaves(store: AuditStore, log: LogName, leaf_ids: Sequence[str], public: bytes, key_name: str) -> LogProofs:
    """The first leaf of each id in `log`, proven against the largest C2SP checkpoint signed by the key that
    covers them all and still matches the log; `EvidenceError` naming what is missing (a leaf, a checkpoint)."""
    leaves = read_leaves(store, log)
    if leaves.problems:
        raise EvidenceError(f"leaf log {log} is broken ({leaves.problems[0]}): run `reprolane audit verify`")
    first = leaves.first_index()
    missing = [i for i in leaf_ids if i not in first]
    if missing:
        raise EvidenceError(f"{missing[0]} is in no leaf of log {log}: run `reprolane audit verify`")
    needed = max(first[i] for i in leaf_ids) + 1
    heads, _ = verified_heads(list_checkpoints(store, log), log, public, key_name)
    hashes = leaves.hashes()
    covering = [
        h
        for h in heads
        if h.c2sp and h.tree_size >= needed and root_from_hashes(hashes[: h.tree_size]).hex() == h.root_hash
    ]
    if not covering:
        raise EvidenceError(
            f"no C2SP checkpoint of {log} signed by this key covers leaf {needed - 1} yet: "
            "run `reprolane audit checkpoint`"
        )
    head = max(covering, key=lambda h: h.tree_size)
    checkpoint = store.get(head.key)
    if checkpoint is None:
        raise EvidenceError(f"checkpoint {head.key} vanished while exporting")
    tree = hashes[: head.tree_size]
    proven = {i: ProvenLeaf(first[i], inclusion_proof(tree, first[i]), leaves.entries[first[i]]) for i in leaf_ids}
    return LogProofs(checkpoint, head.tree_size, head.root_hash, proven)


def export_bundle(
    store: AuditStore,
    request_id: str,
    private_raw: bytes,
    key_name: str,
    *,
    now: datetime | None = None,
    extra: ExtraMembers | None = None,
) -> Exported:
    """Build the evidence bundle of `request_id` (see module doc); `EvidenceError` when it cannot be evidence.
    ``extra`` adds the members of a re-executable bundle (`infra.reexecution`), signed with the rest."""
    key, indexed_id = _pointer(store, request_id)
    envelope_id = envelope_id_of_key(key)
    day = capture_day_of_key(key)
    if indexed_id != envelope_id or day is None:
        raise EvidenceError(
            f"index entry of {request_id!r} does not match its object {key}: run `reprolane audit verify`"
        )
    body, facts = _stored_record(store, key)
    public = public_of(private_raw)
    proven = prove_leaves(store, day, [envelope_id], public, key_name)
    index, path, leaf = proven.leaves[envelope_id]
    bound = leaf.object_sha256 or leaf.envelope_id
    if object_digest(body) != bound and not (leaf.object_sha256 is None and is_sealed(body)):
        raise EvidenceError(f"stored bytes of {key} are not what leaf {index} commits to: run `reprolane audit verify`")
    checkpoint = proven.checkpoint
    proof = TlogProof(index, tuple(path), checkpoint, leaf.data())
    replays = _replays(store, day, envelope_id)
    exported = (now or datetime.now(UTC)).replace(microsecond=0)
    vkey = VerifierKey(key_name, public)
    fingerprints = _fingerprints(facts, replays)
    retention = _retention(store, key)
    origin = proof_origin(checkpoint)
    members: dict[str, bytes] = {
        ENVELOPE: body,
        PROOF: proof.encode(),
        FINGERPRINTS: _json(fingerprints),
        RETENTION: _json(retention),
        KEY: (vkey.encode() + "\n").encode(),
    }
    members.update({replay_member(rid): data for rid, data in replays.items()})

    def prover(log: LogName, leaf_ids: Sequence[str]) -> LogProofs:
        return prove_leaves(store, log, leaf_ids, public, key_name)

    for name, data in (extra(body, prover) if extra is not None else {}).items():
        if name not in REEXECUTION_PARTS:
            raise EvidenceError(f"a re-executable bundle has no member {name!r}")
        members[name] = data
    place = LogPlace(
        request_id,
        envelope_id,
        origin,
        index,
        proven.tree_size,
        proven.root_hash,
        vkey.encode(),
        key_fingerprint(public),
    )
    members[SUMMARY] = render_summary(
        place,
        facts=facts,
        replays=replays,
        fingerprints=fingerprints,
        retention=retention,
        exported_at=exported.isoformat(),
    ).encode()
    parts = [Part(c, PROOF, sha256_hex(b)) for c, b in proof_parts(members[PROOF]).items()]
    classes = {ENVELOPE: "envelope", FINGERPRINTS: "fingerprints", RETENTION: "retention", SUMMARY: "summary"}
    classes.update(REEXECUTION_PARTS)
    classes[KEY] = "key"
    for name, data in members.items():
        if name != PROOF:
            parts.append(Part(classes.get(name, "replay_result"), name, sha256_hex(data)))
    manifest = Manifest(request_id, envelope_id, origin, index, exported.isoformat(), tuple(parts))
    members[MANIFEST] = sign_note(manifest.text(), key_name, private_raw).encode()
    return Exported(write_zip(members, exported), place, len(replays))


def workflow_requests(store: AuditStore, workflow_id: str, tenant: str | None = None) -> list[tuple[int, str]]:
    """(step, request id) of every recorded step of a workflow, by step: `tenant`'s only. A workflow id is the
    client's label, not an identity (any caller may send the same one), so without `tenant` steps of more than one
    tenant are refused, naming them; a step whose record says another workflow is refused too. `UnknownIdError`
    when none is indexed."""
    if not is_valid_request_id(workflow_id):
        raise UnknownIdError(f"{workflow_id!r} is not a valid workflow id")
    filed: list[tuple[int, str]] = []
    for key, _ in store.list_keys(workflow_index_prefix(workflow_id)):
        number, sep, request_id = key.rsplit("/", 1)[-1].removesuffix(".json").partition("-")
        if number.isdigit() and sep and is_valid_request_id(request_id):
            filed.append((int(number), request_id))
    by_tenant: dict[str, list[tuple[int, str]]] = {}
    for step, request_id in sorted(filed):
        _, facts = _stored_record(store, _pointer(store, request_id)[0])
        said = facts["workflow"] or {}
        if said.get("workflow_id") != workflow_id or said.get("step") != step:
            raise EvidenceError(
                f"request {request_id} is filed as step {step} of {workflow_id!r}, its record says {said}"
            )
        by_tenant.setdefault(facts["tenant"], []).append((step, request_id))
    what = f"workflow {workflow_id!r}" + ("" if tenant is None else f" of tenant {tenant!r}")
    if tenant is None and len(by_tenant) > 1:
        raise UnknownIdError(f"{what} has steps of tenants {', '.join(sorted(by_tenant))}: name the tenant (--tenant)")
    steps = by_tenant.get(tenant, []) if tenant is not None else next(iter(by_tenant.values()), [])
    if not steps:
        raise UnknownIdError(f"no envelope is indexed under {what} in s3://{store.bucket}")
    return steps


def proof_origin(checkpoint: bytes) -> str:
    return checkpoint.split(b"\n", 1)[0].decode()


def _json(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
