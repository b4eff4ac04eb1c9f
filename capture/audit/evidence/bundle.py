"""The evidence bundle's file format: one zip, a signed manifest, and what each member is (its *part class*).

``reprolane audit evidence export`` writes it (`capture.audit.evidence.export`), ``reprolane audit evidence
verify`` reads it (`capture.audit.evidence.verify`), offline. Members::

    manifest.note        C2SP signed note (`schemas.note`), signed by the audit key: what the bundle claims, and
                         the sha256 of every part below
    envelope.bin         the envelope object's bytes exactly as stored (plaintext JSON or a sealed record)
    proof.tlog-proof     c2sp.org/tlog-proof: leaf data (``extra``), leaf index, inclusion path, then the C2SP
                         checkpoint verbatim; three parts: ``proof`` (the lines before the checkpoint),
                         ``checkpoint`` (its note text), ``signature`` (its signature lines)
    replays/<id>.json    each replay result as stored (with its divergence event; sealed for sealed tenants)
    fingerprints.json    artifact and runtime fingerprints of the record, and each replay lane's
    retention.json       the object's version, legal hold and retain-until date as S3 reported them at export
    summary.html         the same, for a person (no script, no external resource)
    key.vkey             the audit key as a C2SP verifier key: only used when the verifier pinned its fingerprint

A re-executable bundle (``export --reexecutable``, `infra.reexecution`) adds what a replay needs, and nothing of
another request but its shapes::

    schedule.jsonl       the engine's settings and the target's schedule window (its busy period and those of its
                         prefix-cache providers) as the engine's schedule log committed them: canonical records,
                         every request id blinded (`schemas.schedule_proof`): token counts and steps only
    schedule-proof.json  that each of those lines is a record of the engine's signed schedule log: its place, the
                         record hashes of its segments, their inclusion paths, one C2SP checkpoint
    reexecution.json     what the records alone do not say: the target's ids in clear, the step ranges the window
                         holds
    model-manifest.json  the model manifest (every file's sha256) the record's artifact hashes were taken from

The manifest text, line by line (``part`` lines sorted)::

    reprolane.evidence/1
    request <request id>
    envelope <envelope id>
    origin <checkpoint origin>
    leaf <index>
    exported <ISO time>
    part <class> <member> <sha256 hex>

What a signature over the manifest adds: the checkpoint proves the envelope bytes were in the log (whoever
exported the bundle); replay results, fingerprints and retention are not in the Merkle log, so for them the
bundle is the word of whoever holds the audit key, and the signed manifest makes any later change to them show.

Reading is bounded (member count, sizes, names from a fixed set): a bundle is a file from anyone.
"""

from __future__ import annotations

import io
import re
import zipfile
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from schemas.errors import ContractError

FORMAT: Final = "reprolane.evidence/1"
MANIFEST = "manifest.note"
ENVELOPE = "envelope.bin"
PROOF = "proof.tlog-proof"
FINGERPRINTS = "fingerprints.json"
RETENTION = "retention.json"
SUMMARY = "summary.html"
KEY = "key.vkey"
REPLAYS_DIR = "replays/"
SCHEDULE = "schedule.jsonl"
REEXECUTION = "reexecution.json"
SCHEDULE_PROOF = "schedule-proof.json"
MODEL_MANIFEST = "model-manifest.json"
#: The members a re-executable bundle adds (`export_bundle`'s ``extra``), by their part class.
REEXECUTION_PARTS: Final = {
    SCHEDULE: "schedule",
    SCHEDULE_PROOF: "schedule_proof",
    REEXECUTION: "reexecution",
    MODEL_MANIFEST: "model_manifest",
}

#: The part classes a verifier names a problem by, and how it says them.
LABELS: Final = {
    "envelope": "envelope bytes",
    "proof": "proof",
    "checkpoint": "checkpoint",
    "signature": "signature",
    "replay_result": "replay result",
    "fingerprints": "fingerprints",
    "retention": "retention",
    "summary": "summary",
    "key": "key",
    "manifest": "manifest",
    "schedule": "schedule records",
    "schedule_proof": "schedule proof",
    "reexecution": "re-execution settings",
    "model_manifest": "model manifest",
}
MAX_MEMBERS: Final = 256
MAX_MEMBER_BYTES: Final = 64 << 20
MAX_TOTAL_BYTES: Final = 256 << 20
_MEMBER_RE = re.compile(
    r"^(manifest\.note|envelope\.bin|proof\.tlog-proof|fingerprints\.json|retention\.json|summary\.html|key\.vkey"
    r"|replays/[0-9a-f]{64}\.json|schedule\.jsonl|schedule-proof\.json|reexecution\.json|model-manifest\.json)$"
)
_TOKEN_RE = re.compile(r"^[!-~]{1,256}$")  # one printable, space-free token


def replay_member(result_id: str) -> str:
    return f"{REPLAYS_DIR}{result_id}.json"


@dataclass(frozen=True)
class Part:
    part_class: str
    member: str
    sha256: str


@dataclass(frozen=True)
class Manifest:
    request_id: str
    envelope_id: str
    origin: str
    leaf_index: int
    exported_at: str
    parts: tuple[Part, ...]

    def text(self) -> str:
        for value in (self.request_id, self.envelope_id, self.origin, self.exported_at):
            if not _TOKEN_RE.match(value):
                raise ContractError(f"manifest value {value[:40]!r} is not one printable token", ("manifest",))
        lines = [
            FORMAT,
            f"request {self.request_id}",
            f"envelope {self.envelope_id}",
            f"origin {self.origin}",
            f"leaf {self.leaf_index}",
            f"exported {self.exported_at}",
        ]
        lines += [f"part {p.part_class} {p.member} {p.sha256}" for p in sorted(self.parts, key=lambda p: p.member)]
        return "\n".join(lines) + "\n"


def parse_manifest(text: str) -> Manifest:
    lines = text.rstrip("\n").split("\n")
    if not lines or lines[0] != FORMAT:
        raise ContractError(f"manifest does not start with {FORMAT}", ("manifest",))
    fields: dict[str, str] = {}
    parts: list[Part] = []
    for line in lines[1:]:
        words = line.split(" ")
        if words[0] == "part" and len(words) == 4 and words[1] in LABELS and re.fullmatch(r"[0-9a-f]{64}", words[3]):
            parts.append(Part(words[1], words[2], words[3]))
        elif len(words) == 2 and words[0] in ("request", "envelope", "origin", "leaf", "exported"):
            fields[words[0]] = words[1]
        else:
            raise ContractError(f"manifest line {line[:60]!r} is not understood", ("manifest",))
    missing = {"request", "envelope", "origin", "leaf", "exported"} - fields.keys()
    if missing or not fields.get("leaf", "").isdigit():
        raise ContractError(f"manifest lacks {', '.join(sorted(missing)) or 'a leaf index'}", ("manifest",))
    return Manifest(
        fields["request"], fields["envelope"], fields["origin"], int(fields["leaf"]), fields["exported"], tuple(parts)
    )


def write_zip(members: dict[str, bytes], when: datetime) -> bytes:
    """The bundle's bytes: members in name order, with one fixed timestamp (the export time)."""
    buffer = io.BytesIO()
    stamp = (max(when.year, 1980), when.month, when.day, when.hour, when.minute, when.second)
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(members):
            if not _MEMBER_RE.match(name):
                raise ContractError(f"bundle member {name!r} is not one of the format's", ("member",))
            info = zipfile.ZipInfo(name, date_time=stamp)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, members[name])
    return buffer.getvalue()


def read_zip(data: bytes) -> tuple[dict[str, bytes], list[str]]:
    """The members of a bundle, and the names of members refused (unknown names, duplicates); `ContractError`
    when it is not a zip or is over the bounds."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError) as exc:
        raise ContractError(f"not an evidence bundle (not a zip file: {exc})", ("bundle",)) from exc
    members: dict[str, bytes] = {}
    refused: list[str] = []
    with zf:
        infos = zf.infolist()
        if len(infos) > MAX_MEMBERS:
            raise ContractError(f"bundle has {len(infos)} members, more than {MAX_MEMBERS}", ("bundle",))
        total = 0
        for info in infos:
            if not _MEMBER_RE.match(info.filename) or info.filename in members:
                refused.append(info.filename[:80])
                continue
            if info.file_size > MAX_MEMBER_BYTES or total + info.file_size > MAX_TOTAL_BYTES:
                raise ContractError(f"bundle member {info.filename} is too large", ("bundle",))
            try:
                with zf.open(info) as fh:
                    body = fh.read(MAX_MEMBER_BYTES + 1)
            except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError) as exc:
                refused.append(f"{info.filename} (unreadable: {exc})")
                continue
            if len(body) > MAX_MEMBER_BYTES:
                raise ContractError(f"bundle member {info.filename} is too large", ("bundle",))
            total += len(body)
            members[info.filename] = body
    return members, refused


def proof_parts(data: bytes) -> dict[str, bytes]:
    """The three parts of a tlog-proof the manifest hashes apart, by class: ``proof`` (the lines before the
    checkpoint), ``checkpoint`` (the checkpoint's note text), ``signature`` (its signature lines). A proof without
    the blank lines that separate them is all ``proof``."""
    head, sep, note = data.partition(b"\n\n")
    if not sep:
        return {"proof": data, "checkpoint": b"", "signature": b""}
    split = note.rfind(b"\n\n")
    if split < 0:
        return {"proof": head + b"\n", "checkpoint": note, "signature": b""}
    return {"proof": head + b"\n", "checkpoint": note[: split + 1], "signature": note[split + 2 :]}
