"""A schedule window as a re-executable bundle carries it: shapes only, every request id blinded, and its proof.

A replay needs the batches the target ran in: for every step, which requests were scheduled and how many tokens
each computed; for every request, its prompt length, its token budget and the prefix-cache blocks it read. It
needs nothing of the other requests' content (the lane fills their places with filler tokens), and it must not
carry their ids either: an engine request id holds the sidecar's request id, which names another tenant's record.

`shapes_only` writes the window's records as the engine's schedule log committed them (`schemas.schedule_proof`):
every request id blinded, the same blinded id wherever it appears (an arrival, a step, a prefix-cache provider),
so the shapes stay whole and each line can be proven a record of the signed log (`schedule_proof`). The target's
own engine request ids (and the external ids vLLM gave them) go in clear into ``reexecution.json``: whoever holds
the record knows them, and `window_of` maps their blinded form back for the replay, which finds its choices by
them.

`shapes_only` and `window_of` are pure: records in, bytes out and back; `ContractError` names the line that is not
a schedule record. `schedule_proof` reads the log through the exporter's `LogProver`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from capture.audit.evidence.export import EvidenceError, LogProver
from replayer.schedule.store import ScheduleWindow
from schemas.canonical import canonical_json
from schemas.errors import ContractError
from schemas.layout import schedule_log
from schemas.schedule import EngineStart, RequestArrival, ScheduleRecord
from schemas.schedule_delivery import decode_record_line
from schemas.schedule_proof import (
    ScheduleProof,
    SegmentProof,
    blind,
    blinded_line,
    line_hash,
    segment_id,
    segment_leaf,
    with_ids,
)

FORMAT = "reprolane.reexecution/2"
#: At most this many records in a window a bundle carries (a replay refuses longer windows anyway).
MAX_RECORDS = 200_000


def shapes_only(window: ScheduleWindow) -> tuple[bytes, bytes]:
    """``(schedule.jsonl, reexecution.json)`` of `window`: its engine record and records as the log committed them
    (blinded, canonical lines); the target's engine request ids and external ids in clear, the step ranges."""
    if window.engine is None:
        raise ContractError("the schedule window has no engine record", ("schedule",))
    lines = [blinded_line(window.engine)] + [blinded_line(r) for r in window.records]
    settings = {
        "format": FORMAT,
        "target": [a.engine_request_id for a in window.arrivals],
        "external": [a.external_request_id for a in window.arrivals],
        "ranges": [list(r) for r in window.ranges] if window.ranges else None,
    }
    return b"".join(lines), canonical_json(settings) + b"\n"


def schedule_proof(window: ScheduleWindow, segments: Mapping[int, Sequence[ScheduleRecord]], prove: LogProver) -> bytes:
    """``schedule-proof.json``: where each line `shapes_only` writes for `window` sits among `segments` (the
    engine's stored segments the window was read from, its first one included: seq -> records), and those
    segments' leaves proven against one signed checkpoint of the engine's log. `EvidenceError` when a line is in
    none of them or the log does not hold them yet."""
    assert window.engine is not None
    engine_id = window.engine.engine_id
    lines = {seq: [blinded_line(r) for r in records] for seq, records in sorted(segments.items())}
    where: dict[bytes, tuple[int, int]] = {}
    for seq, committed in lines.items():
        for index, line in enumerate(committed):
            where.setdefault(line, (seq, index))
    placed = []
    for record in (window.engine, *window.records):
        spot = where.get(blinded_line(record))
        if spot is None:
            raise EvidenceError(f"a record of the window is in none of engine {engine_id}'s segments read")
        placed.append(spot)
    used = sorted({seq for seq, _ in placed})
    hashes = {seq: [line_hash(line) for line in lines[seq]] for seq in used}
    proven = prove(schedule_log(engine_id), [segment_id(engine_id, seq) for seq in used])
    parts = []
    for seq in used:
        at, path, entry = proven.leaves[segment_id(engine_id, seq)]
        if entry.object_sha256 != segment_leaf(engine_id, seq, hashes[seq]).object_sha256:
            raise EvidenceError(
                f"segment {seq} of engine {engine_id} is not what its leaf {at} commits to: "
                "run `reprolane audit verify`"
            )
        parts.append(
            SegmentProof(
                seq=seq, leaf_index=at, inclusion=tuple(h.hex() for h in path),
                record_hashes=tuple(h.hex() for h in hashes[seq]),
            )
        )  # fmt: skip
    proof = ScheduleProof(
        engine_id=engine_id, checkpoint=proven.checkpoint.decode("utf-8"), tree_size=proven.tree_size,
        segments=tuple(parts), lines=tuple(placed),
    )  # fmt: skip
    return canonical_json(proof.model_dump(mode="json")) + b"\n"


def window_of(schedule: bytes, settings: bytes) -> ScheduleWindow:
    """The window `shapes_only` wrote, read back and checked: every line a schedule record in canonical JSON, one
    engine, its record first, an arrival of every engine request of the target."""
    try:
        doc = json.loads(settings)
    except ValueError as exc:
        raise ContractError(f"reexecution.json is not JSON: {exc}", ("reexecution",)) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ContractError(f"reexecution.json is not {FORMAT}", ("reexecution",))
    ranges = _ranges(doc.get("ranges"))
    lines = schedule.split(b"\n")
    if lines[-1] != b"" or len(lines) - 1 > MAX_RECORDS:
        raise ContractError("schedule.jsonl is not whole lines, or has too many", ("schedule",))
    records = [decode_record_line(line, f"schedule.jsonl line {n}") for n, line in enumerate(lines[:-1], start=1)]
    if not records or not isinstance(records[0], EngineStart):
        raise ContractError("schedule.jsonl does not start with the engine's record", ("schedule",))
    engine, rest = records[0], records[1:]
    if any(isinstance(r, EngineStart) or r.engine_id != engine.engine_id for r in rest):
        raise ContractError("schedule.jsonl holds records of more than one engine", ("schedule",))
    target, external = _strings(doc.get("target")), _strings(doc.get("external"))
    if not target or not external or len(external) != len(target):
        raise ContractError(
            "reexecution.json: target and external are not lists of the target's engine and external ids",
            ("reexecution",),
        )
    clear = {blind(t): t for t in target} | {blind(e): e for e in external}
    rest = [with_ids(r, lambda rid: clear.get(rid, rid)) for r in rest]  # the others stay blinded: pseudonyms
    arrivals = tuple(
        sorted(
            (r for r in rest if isinstance(r, RequestArrival) and r.engine_request_id in set(target)),
            key=lambda a: (a.step, a.engine_request_id),
        )
    )
    if len(arrivals) != len(set(target)):
        raise ContractError("schedule.jsonl lacks an arrival of the target", ("schedule",))
    return ScheduleWindow(engine, arrivals, tuple(rest), 0, 0, complete=True, ranges=ranges)


def _strings(value: object) -> list[str]:
    """`value` when it is a list of strings, else empty."""
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else []


def _ranges(value: object) -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(n, int) and n >= 0 for n in r) for r in value
    ):
        raise ContractError("reexecution.json: ranges is not a list of [first, last] steps", ("reexecution",))
    return tuple((int(a), int(b)) for a, b in value)
