"""A schedule window as a re-executable bundle carries it: shapes only, other requests under pseudonyms.

A replay needs the batches the target ran in: for every step, which requests were scheduled and how many tokens
each computed; for every request, its prompt length, its token budget and the prefix-cache blocks it read. It
needs nothing of the other requests' content (the lane fills their places with filler tokens), and it must not
carry their ids either: an engine request id holds the sidecar's request id, which names another tenant's record.
`shapes_only` keeps the target's own engine requests as they are (the replay finds its choices by them) and
gives every other request a pseudonym, the same one wherever it appears (an arrival, a step, a prefix-cache
provider), so the shapes stay whole.

Pure: bytes in, records out; `ContractError` names the line that is not a schedule record.
"""

from __future__ import annotations

import json
from typing import Any

from replayer.schedule.store import ScheduleWindow
from schemas.canonical import canonical_json
from schemas.errors import ContractError
from schemas.schedule import UNKNOWN_PROVIDER, EngineStart, RequestArrival, ScheduleStep
from schemas.schedule_delivery import decode_record_line, encode_record

FORMAT = "reprolane.reexecution/1"
#: At most this many records in a window a bundle carries (a replay refuses longer windows anyway).
MAX_RECORDS = 200_000


def pseudonym(n: int) -> str:
    return f"other-{n:05d}"


def shapes_only(window: ScheduleWindow) -> tuple[bytes, bytes]:
    """``(schedule.jsonl, reexecution.json)`` of `window`: its engine record and records as canonical lines, every
    request but the target's own under a pseudonym; the step ranges it holds."""
    if window.engine is None:
        raise ContractError("the schedule window has no engine record", ("schedule",))
    own = {a.engine_request_id for a in window.arrivals}
    names: dict[str, str] = {}

    def alias(rid: str) -> str:
        if rid in own or rid == UNKNOWN_PROVIDER:
            return rid
        return names.setdefault(rid, pseudonym(len(names) + 1))

    lines = [encode_record(window.engine)]
    for record in window.records:
        if isinstance(record, RequestArrival):
            hidden = alias(record.engine_request_id)
            update: dict[str, Any] = {"engine_request_id": hidden}
            if hidden != record.engine_request_id:
                update["external_request_id"] = hidden
            if record.cached_from is not None:
                update["cached_from"] = tuple((alias(p), n) for p, n in record.cached_from)
            record = record.model_copy(update=update)
        elif isinstance(record, ScheduleStep):
            record = record.model_copy(
                update={
                    "scheduled": tuple(
                        s.model_copy(update={"engine_request_id": alias(s.engine_request_id)}) for s in record.scheduled
                    ),
                    "finished": tuple(alias(r) for r in record.finished),
                    "preempted": tuple(alias(r) for r in record.preempted),
                }
            )
        lines.append(encode_record(record))
    settings = {
        "format": FORMAT,
        "target": sorted(own),
        "ranges": [list(r) for r in window.ranges] if window.ranges else None,
    }
    return b"".join(lines), canonical_json(settings) + b"\n"


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
    target = doc.get("target")
    if not isinstance(target, list) or not target or not all(isinstance(t, str) for t in target):
        raise ContractError("reexecution.json: target is not a list of engine request ids", ("reexecution",))
    arrivals = tuple(
        sorted(
            (r for r in rest if isinstance(r, RequestArrival) and r.engine_request_id in set(target)),
            key=lambda a: (a.step, a.engine_request_id),
        )
    )
    if len(arrivals) != len(set(target)):
        raise ContractError("schedule.jsonl lacks an arrival of the target", ("schedule",))
    return ScheduleWindow(engine, arrivals, tuple(rest), 0, 0, complete=True, ranges=ranges)


def _ranges(value: object) -> tuple[tuple[int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(n, int) and n >= 0 for n in r) for r in value
    ):
        raise ContractError("reexecution.json: ranges is not a list of [first, last] steps", ("reexecution",))
    return tuple((int(a), int(b)) for a, b in value)
