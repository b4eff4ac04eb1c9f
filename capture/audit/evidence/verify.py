"""``reprolane audit evidence verify FILE --key PUBKEY | --key-fingerprint sha256:HEX``: check a bundle, offline.

Nothing here opens a socket or reads a setting: the bundle's bytes and the pinned key are all it takes. The key
is never taken from the bundle on trust: either the verifier gives it (``--key``: PEM, base64 of the raw 32
bytes, or a C2SP vkey, which pins the key name too), or it pins the key's fingerprint and the bundle's
``key.vkey`` is used only when it hashes to that fingerprint.

Two independent lines of checks, and a problem is named by the part class it is in (`evidence_bundle.LABELS`):

1. **The signed manifest.** Its signature must verify under the key (else ``signature``: nothing it lists can
   be trusted); then every part must hash to what it lists (else that part's class: ``envelope bytes``,
   ``proof``, ``checkpoint``, ``signature``, ``replay result``, ...), and nothing may be in the bundle that it
   does not list.
2. **The log, as any C2SP verifier checks it.** The leaf is recomputed from ``envelope.bin`` (leaf format 2:
   the envelope id and the sha256 of the bytes; format 1: the id), hashed RFC 6962 style, and walked up the
   inclusion path to the checkpoint's root; the checkpoint's signature must verify under the key and its origin
   must be the key name's log of the envelope's capture day. When something fails, which part changed is told
   by what still agrees: a signature that verifies and a path that reaches the root from the ``extra`` leaf but
   not from the envelope means the *envelope bytes* changed; a good signature and a path that reaches the root
   from neither, the *proof*; a signature that fails over a root the path does reach, the *signature*; a
   signature that fails and a root nothing reaches, the *checkpoint* (its size or root were changed).

Replay results are checked to belong to the envelope (their event names its id); that they are the stored
ones rests on the manifest's signature (see `capture.audit.evidence.bundle`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from capture.audit.evidence.bundle import (
    ENVELOPE,
    FINGERPRINTS,
    KEY,
    LABELS,
    MANIFEST,
    PROOF,
    REPLAYS_DIR,
    RETENTION,
    SCHEDULE,
    SCHEDULE_PROOF,
    Manifest,
    parse_manifest,
    proof_parts,
    read_zip,
)
from schemas import ContractError, decode_envelope, envelope_bytes, sha256_hex
from schemas.base import decode_record
from schemas.layout import capture_day, log_origin
from schemas.merkle import leaf_hash, object_digest, verify_inclusion
from schemas.note import (
    Note,
    TlogProof,
    TreeHead,
    VerifierKey,
    key_fingerprint,
    key_named_in,
    parse_note,
    parse_tlog_proof,
    parse_tree_head,
    parse_vkey,
    signature_by,
    verifies,
)
from schemas.replay import decode_replay_result
from schemas.schedule_proof import ScheduleProof
from schemas.schedule_proof import check as check_schedule_proof
from schemas.sealed import decode_sealed, decode_sealed_result, is_sealed, is_sealed_result


@dataclass(frozen=True)
class Problem:
    part_class: str
    message: str

    def line(self) -> str:
        return f"{LABELS[self.part_class]}: {self.message}"


@dataclass
class BundleReport:
    problems: list[Problem] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    subject: str = "evidence bundle"

    @property
    def ok(self) -> bool:
        return not self.problems

    def classes(self) -> set[str]:
        return {p.part_class for p in self.problems}

    def add(self, part_class: str, message: str) -> None:
        problem = Problem(part_class, message)
        if problem not in self.problems:
            self.problems.append(problem)


@dataclass(frozen=True)
class PinnedKey:
    """What the verifier trusts: a key (with or without its name), or a fingerprint of one."""

    public_raw: bytes | None = None
    name: str | None = None
    fingerprint: str | None = None


def _resolve_key(pin: PinnedKey, members: dict[str, bytes], report: BundleReport) -> PinnedKey | None:
    if pin.public_raw is not None:
        return pin
    vkey_text = members.get(KEY, b"").decode("utf-8", "replace").strip()
    try:
        vkey = parse_vkey(vkey_text)
    except ContractError as exc:
        report.add("key", f"the bundle's {KEY} is not a verifier key ({exc}); pass the key itself with --key")
        return None
    if key_fingerprint(vkey.public_raw) != pin.fingerprint:
        report.add("key", f"the bundle's key is {key_fingerprint(vkey.public_raw)}, not the pinned {pin.fingerprint}")
        return None
    return PinnedKey(vkey.public_raw, vkey.name)


def _note_key(pin: PinnedKey, note: Note) -> VerifierKey | None:
    """The pinned key under the name it signs this note with (the pinned name, or one the note's lines carry)."""
    assert pin.public_raw is not None
    if pin.name is not None:
        return VerifierKey(pin.name, pin.public_raw)
    return key_named_in(note, pin.public_raw)


def _check_manifest(members: dict[str, bytes], pin: PinnedKey, report: BundleReport) -> Manifest | None:
    raw = members.get(MANIFEST)
    if raw is None:
        report.add("manifest", f"the bundle has no {MANIFEST}")
        return None
    try:
        note = parse_note(raw)
        manifest = parse_manifest(note.text)
    except ContractError as exc:
        report.add("manifest", f"{MANIFEST} is malformed: {exc}")
        return None
    key = _note_key(pin, note)
    if key is None or not verifies(note, key):
        why = "is not signed by the pinned key" if key is None or signature_by(note, key) is None else "does not verify"
        report.add("signature", f"the manifest's signature {why}: none of what it lists can be trusted")
        return None
    listed: set[str] = set()
    for part in manifest.parts:
        listed.add(part.member)
        data = members.get(part.member)
        if data is None:
            report.add(part.part_class, f"{part.member} is listed in the manifest but not in the bundle")
            continue
        if part.member == PROOF:
            data = proof_parts(data).get(part.part_class, b"")
        actual = sha256_hex(data)
        if actual != part.sha256:
            what = f"{part.member} ({part.part_class} part)" if part.member == PROOF else part.member
            report.add(part.part_class, f"{what} hashes to {actual}, the signed manifest lists {part.sha256}")
    for name in sorted(set(members) - listed - {MANIFEST}):
        report.add("manifest", f"{name} is in the bundle but not in the signed manifest")
    report.lines.append(f"  manifest: signed by {key.name}+{key.key_id:08x}, {len(manifest.parts)} parts")
    return manifest


def _envelope_leaf(body: bytes, leaf_size: int) -> tuple[str, bytes, str | None]:
    """(envelope id, leaf data, capture day) recomputed from the stored bytes."""
    day: str | None = None
    if is_sealed(body):
        sealed = decode_sealed(body)
        envelope_id, day = sealed.envelope_id, capture_day(sealed.captured_at)
    else:
        envelope_id = sha256_hex(envelope_bytes(body))  # a compact envelope: of the canonical bytes it decodes to
        try:
            day = capture_day(decode_envelope(body).captured_at)
        except ContractError:
            day = None
    data = bytes.fromhex(envelope_id)
    if leaf_size != 32:
        data += bytes.fromhex(object_digest(body))
    return envelope_id, data, day


def _check_log(members: dict[str, bytes], pin: PinnedKey, report: BundleReport, changed: set[str]) -> str | None:
    """The C2SP checks (see module doc); the envelope id, when the envelope could be read. `changed`: the parts
    the signed manifest found changed, which tells a changed checkpoint text from a changed signature when the
    proof cannot (a tree size changed so that the path still fits)."""
    body, raw_proof = members.get(ENVELOPE), members.get(PROOF)
    if body is None or raw_proof is None:
        report.add("envelope" if body is None else "proof", f"the bundle has no {ENVELOPE if body is None else PROOF}")
        return None
    try:
        proof: TlogProof = parse_tlog_proof(raw_proof)
    except ContractError as exc:
        report.add("proof", f"{PROOF} is malformed: {exc}")
        return None
    try:
        note = parse_note(proof.checkpoint)
        head: TreeHead = parse_tree_head(note.text)
    except ContractError as exc:
        report.add("checkpoint", f"the checkpoint in {PROOF} is malformed: {exc}")
        return None
    try:
        envelope_id, leaf, day = _envelope_leaf(body, len(proof.extra) if proof.extra is not None else 64)
    except ContractError as exc:
        report.add("envelope", f"{ENVELOPE} is not an envelope as stored: {exc}")
        return None
    key = _note_key(pin, note)
    signed = key is not None and verifies(note, key)
    root, index, size = head.root_hash, proof.index, head.tree_size
    from_envelope = verify_inclusion(leaf_hash(leaf), index, size, proof.path, root)
    from_extra = proof.extra is not None and verify_inclusion(leaf_hash(proof.extra), index, size, proof.path, root)
    if signed and from_envelope:
        assert key is not None
        if day is not None and head.origin != log_origin(key.name, day):
            report.add("checkpoint", f"its origin {head.origin} is not the log of the envelope's day {day}")
        if proof.extra is not None and proof.extra != leaf:
            report.add("proof", "its extra line is not the leaf of envelope.bin")
        report.lines += [
            f"  envelope: {envelope_id} (leaf data recomputed from the stored bytes)",
            f"  inclusion: leaf {index} of {size}, {len(proof.path)}-hash path reaches the signed root",
            f"  checkpoint: {head.origin} size {size}, signed by {key.name}+{key.key_id:08x} (C2SP note): verifies",
        ]
    elif signed and from_extra:
        assert proof.extra is not None
        logged = proof.extra[32:].hex() if len(proof.extra) == 64 else proof.extra.hex()
        report.add(
            "envelope",
            f"{ENVELOPE} hashes to {object_digest(body)}, the log committed to {logged}"
            f" (leaf {index} of {head.origin})",
        )
    elif signed:
        report.add("proof", f"the inclusion path does not lead from leaf {index} to the signed root of size {size}")
    elif (from_envelope or from_extra) and not ("checkpoint" in changed and "signature" not in changed):
        why = "names no key the verifier pinned" if key is None or signature_by(note, key) is None else "fails"
        report.add("signature", f"the checkpoint's signature {why} (its text agrees with the proof)")
    else:
        report.add("checkpoint", "its size or root was changed: the key did not sign it, the proof does not reach it")
    return envelope_id


def _check_replays(members: dict[str, bytes], envelope_id: str | None, report: BundleReport) -> None:
    names = sorted(n for n in members if n.startswith(REPLAYS_DIR))
    for name in names:
        body = members[name]
        try:
            if is_sealed_result(body):
                owner = decode_sealed_result(body).envelope_id
            else:
                owner = decode_replay_result(body).event.envelope_id
        except ContractError as exc:
            report.add("replay_result", f"{name} is not a replay result: {exc}")
            continue
        if envelope_id is not None and owner != envelope_id:
            report.add("replay_result", f"{name} is a replay of envelope {owner}, not of this one")
    if names:
        report.lines.append(f"  replays: {len(names)} result(s) of this envelope")
    for name, part_class in ((FINGERPRINTS, "fingerprints"), (RETENTION, "retention")):
        try:
            json.loads(members.get(name, b"{}"))
        except ValueError:
            report.add(part_class, f"{name} is not JSON")


def _check_schedule(members: dict[str, bytes], pin: PinnedKey, report: BundleReport) -> None:
    """A re-executable bundle's schedule lines against its schedule proof: each a record of the engine's signed
    schedule log (`schemas.schedule_proof`). Nothing to check in a bundle without schedule records."""
    schedule, raw = members.get(SCHEDULE), members.get(SCHEDULE_PROOF)
    if schedule is None:
        return
    if raw is None:
        report.add("schedule_proof", f"the bundle has {SCHEDULE} but no {SCHEDULE_PROOF}")
        return
    try:
        proof = decode_record(ScheduleProof, SCHEDULE_PROOF, raw)
        note = parse_note(proof.checkpoint.encode("utf-8"))
        parse_tree_head(note.text)
    except ContractError as exc:
        report.add("schedule_proof", f"{SCHEDULE_PROOF} is malformed: {exc}")
        return
    lines = schedule.splitlines(keepends=True)
    problems = check_schedule_proof(lines, proof, note, _note_key(pin, note))
    for problem in problems[:5]:
        report.add("schedule", problem)
    if not problems:
        report.lines.append(
            f"  schedule: {len(lines)} records in {len(proof.segments)} segment(s) of engine {proof.engine_id}'s "
            f"schedule log, size {proof.tree_size}: each reaches its signed root"
        )


def verify_bundle(data: bytes, pin: PinnedKey) -> BundleReport:
    """Check a bundle's bytes against the pinned key (see module doc); `ContractError` when it is no bundle."""
    members, refused = read_zip(data)
    report = BundleReport()
    for name in refused:
        report.add("manifest", f"member {name!r} is not part of the format")
    resolved = _resolve_key(pin, members, report)
    if resolved is None:
        return report
    manifest = _check_manifest(members, resolved, report)
    changed = report.classes() if manifest is not None else set()
    envelope_id = _check_log(members, resolved, report, changed)
    if manifest is not None:
        report.subject = f"request {manifest.request_id}"
        if envelope_id is not None and manifest.envelope_id != envelope_id:
            report.add("envelope", f"{ENVELOPE} is envelope {envelope_id}, the manifest says {manifest.envelope_id}")
    _check_replays(members, manifest.envelope_id if manifest is not None else envelope_id, report)
    _check_schedule(members, resolved, report)
    return report
