"""The schedule as evidence: what an engine's schedule log commits to, and the proof a bundle carries of a window.

Each engine instance has a Merkle log of its own (`schemas.layout.schedule_log`), in the format of the day logs of
envelopes (RFC 9162 leaves, C2SP checkpoints under the same key), with one leaf per shipped segment (the shipper
appends it once the segment is stored). A leaf commits to the segment's *shapes*, not to its bytes:

    leaf        = LeafEntry(segment_id(engine, seq), root of the segment's record hashes)   (format 2, 64 bytes)
    record hash = RFC 9162 leaf hash of the record's canonical line with every request id blinded (`blind`)

Blinding is what lets a bundle prove a window without carrying another tenant's ids: a re-executable bundle's
``schedule.jsonl`` holds the window's records in blinded form, the exact lines the log committed to, and
``schedule-proof.json`` (`ScheduleProof`) says where each line sits in its segment, every record hash of those
segments (32 bytes each: hashes reveal nothing), and each segment's inclusion path to one signed checkpoint of
the engine's log. A verifier recomputes each line's hash, each segment's root and leaf, walks the paths to the
checkpoint's root and checks its signature and origin (`check`): a changed shape, a dropped or added step, a
step moved to another segment all fail. A blinded id is ``h-`` and the first 128 bits of the id's sha256: the
same request has the same blinded id wherever it appears (the shapes stay whole), and ids that are random (the
sidecar's request ids are) cannot be guessed back. The target's own ids are known to whoever holds its record, so
the bundle names them in clear (``reexecution.json``) and the reader maps their blinded form back.

Pure: no IO.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final, Literal

from pydantic import Field

from schemas.base import Record
from schemas.layout import log_origin, schedule_log, schedule_segment_key
from schemas.merkle import LeafEntry, leaf_hash, root_from_hashes, verify_inclusion
from schemas.note import Note, VerifierKey, parse_tree_head, verifies
from schemas.schedule import UNKNOWN_PROVIDER, RequestArrival, ScheduleRecord, ScheduleStep
from schemas.schedule_delivery import encode_record

PROOF_FORMAT: Final = "reprolane.schedule-proof/1"
BLIND_PREFIX: Final = "h-"
#: At most this many segments, and record hashes in all, in one proof (a bundle's window is far smaller).
MAX_SEGMENTS: Final = 10_000
MAX_HASHES: Final = 1_000_000

_Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def blind(request_id: str) -> str:
    """A request id as the log commits to it (`UNKNOWN_PROVIDER` stays as it is: it names no request)."""
    if request_id == UNKNOWN_PROVIDER:
        return request_id
    return BLIND_PREFIX + hashlib.sha256(request_id.encode("utf-8")).hexdigest()[:32]


def with_ids(record: ScheduleRecord, rename: Callable[[str], str]) -> ScheduleRecord:
    """`record` with every request id in it passed through `rename` (an engine's record has none)."""
    if isinstance(record, RequestArrival):
        update: dict[str, Any] = {
            "engine_request_id": rename(record.engine_request_id),
            "external_request_id": rename(record.external_request_id),
        }
        if record.cached_from is not None:
            update["cached_from"] = tuple((rename(p), n) for p, n in record.cached_from)
        return record.model_copy(update=update)
    if isinstance(record, ScheduleStep):
        return record.model_copy(
            update={
                "scheduled": tuple(
                    s.model_copy(update={"engine_request_id": rename(s.engine_request_id)}) for s in record.scheduled
                ),
                "finished": tuple(rename(r) for r in record.finished),
                "preempted": tuple(rename(r) for r in record.preempted),
            }
        )
    return record


def blinded(record: ScheduleRecord) -> ScheduleRecord:
    """`record` with every request id in it blinded."""
    return with_ids(record, blind)


def blinded_line(record: ScheduleRecord) -> bytes:
    """The canonical line the log commits to for `record` (newline included)."""
    return encode_record(blinded(record))


def line_hash(line: bytes) -> bytes:
    """A record's hash in its segment's tree, from its `blinded_line`."""
    return leaf_hash(line)


def record_hashes(records: Sequence[ScheduleRecord]) -> list[bytes]:
    return [line_hash(blinded_line(r)) for r in records]


def segment_id(engine_id: str, seq: int) -> str:
    """A segment's id in its engine's log: the sha256 of its object key (hex)."""
    return hashlib.sha256(schedule_segment_key(engine_id, seq).encode("ascii")).hexdigest()


def segment_leaf(engine_id: str, seq: int, hashes: Sequence[bytes]) -> LeafEntry:
    """The leaf of segment `seq` whose records hash to `hashes` (`record_hashes`)."""
    return LeafEntry(segment_id(engine_id, seq), root_from_hashes(hashes).hex())


class SegmentProof(Record):
    """One segment of the window: where its leaf is in the engine's log, and every record hash of it."""

    seq: int = Field(ge=0)
    leaf_index: int = Field(ge=0)
    inclusion: tuple[_Hex32, ...] = Field(max_length=64, description="RFC 9162 inclusion path, hex")
    record_hashes: tuple[_Hex32, ...] = Field(min_length=1, max_length=MAX_HASHES)


class ScheduleProof(Record):
    """``schedule-proof.json``: that a bundle's ``schedule.jsonl`` lines are records of its engine's signed log."""

    format: Literal["reprolane.schedule-proof/1"] = PROOF_FORMAT
    engine_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    checkpoint: str = Field(max_length=64_000, description="a C2SP checkpoint of the engine's log, as a signed note")
    tree_size: int = Field(ge=1)
    segments: tuple[SegmentProof, ...] = Field(min_length=1, max_length=MAX_SEGMENTS)
    lines: tuple[tuple[int, int], ...] = Field(description="per schedule.jsonl line: its segment's seq, its index")


def check(lines: Sequence[bytes], proof: ScheduleProof, note: Note, key: VerifierKey | None) -> list[str]:
    """What is wrong with `proof` for the bundle's schedule `lines` (each with its newline), checked against the
    checkpoint `note` (parsed from ``proof.checkpoint``) and the pinned `key` (None: the note names no key the
    verifier pinned); empty when every line is a record of the engine's signed log."""
    if key is None or not verifies(note, key):
        return ["the schedule log's checkpoint is not signed by the pinned key"]
    head = parse_tree_head(note.text)
    if head.origin != log_origin(key.name, schedule_log(proof.engine_id)):
        return [f"the checkpoint's origin {head.origin} is not the schedule log of engine {proof.engine_id}"]
    if head.tree_size != proof.tree_size:
        return [f"the proof is of size {proof.tree_size}, its checkpoint of {head.tree_size}"]
    if sum(len(s.record_hashes) for s in proof.segments) > MAX_HASHES:
        return ["the proof holds too many record hashes"]
    problems: list[str] = []
    segments = {s.seq: s for s in proof.segments}
    for s in proof.segments:
        leaf = segment_leaf(proof.engine_id, s.seq, [bytes.fromhex(h) for h in s.record_hashes])
        path = [bytes.fromhex(h) for h in s.inclusion]
        if not verify_inclusion(leaf.hash(), s.leaf_index, head.tree_size, path, head.root_hash):
            problems.append(f"segment {s.seq}: its records are not the leaf {s.leaf_index} the log signed")
    if len(proof.lines) != len(lines):
        return [*problems, f"the proof places {len(proof.lines)} lines, schedule.jsonl has {len(lines)}"]
    for n, (line, (seq, index)) in enumerate(zip(lines, proof.lines, strict=True), start=1):
        segment = segments.get(seq)
        if segment is None or not 0 <= index < len(segment.record_hashes):
            problems.append(f"schedule.jsonl line {n}: the proof places it nowhere (segment {seq}, record {index})")
        elif line_hash(line).hex() != segment.record_hashes[index]:
            problems.append(f"schedule.jsonl line {n}: not record {index} of segment {seq} as the log committed it")
    return problems
