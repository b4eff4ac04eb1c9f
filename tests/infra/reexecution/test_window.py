"""`infra.reexecution.window`: the window a re-executable bundle carries keeps every shape a replay needs and no
other request's id, reading it back refuses what is not such a window (the bundle is a file from anyone), and its
schedule proof holds each line to the engine's signed log: a changed shape, a moved line, another key, another
engine's log are each named (`schemas.schedule_proof.check`)."""

from __future__ import annotations

import json

import pytest

from capture.audit.evidence.export import EvidenceError, LogProofs, ProvenLeaf
from capture.audit.signing_keys import public_of
from infra.reexecution.window import schedule_proof, shapes_only, window_of
from replayer.schedule.plan import plan_replay
from replayer.schedule.replay import window_log
from replayer.schedule.store import ScheduleWindow
from schemas.errors import ContractError
from schemas.layout import LogName, log_origin
from schemas.merkle import inclusion_proof, root_from_hashes
from schemas.note import TreeHead, VerifierKey, parse_note, sign_checkpoint_note
from schemas.schedule import RequestArrival, ScheduleRecord, ScheduleStep
from schemas.schedule_proof import ScheduleProof, blind, check, record_hashes, segment_id, segment_leaf
from tests.capture.audit.test_checkpoint import load_private_fresh
from tests.schemas.test_schedule_log import arrival, engine, step


def _window() -> ScheduleWindow:
    """b is the target (the sidecar's id inside its engine id); a computed the block c read; c ran beside b."""
    target = "chatcmpl-rl-0123456789abcdef0123456789abcdef-1"
    records = (
        arrival("chatcmpl-rl-aaaa-1", 0, 20),
        step(0, [("chatcmpl-rl-aaaa-1", 0, 20)]),
        step(1, [("chatcmpl-rl-aaaa-1", 20, 1)]),
        step(2, [("chatcmpl-rl-aaaa-1", 21, 1)], finished=("chatcmpl-rl-aaaa-1",)),
        arrival(target, 3, 5),
        step(3, [(target, 0, 5)]),
        arrival("chatcmpl-rl-cccc-1", 4, 40, cached=(("chatcmpl-rl-aaaa-1", 1),)),
        step(4, [(target, 5, 1), ("chatcmpl-rl-cccc-1", 16, 24)]),
        step(5, [(target, 6, 1), ("chatcmpl-rl-cccc-1", 40, 1)], finished=(target,), preempted=()),
        step(6, [("chatcmpl-rl-cccc-1", 41, 1)], finished=("chatcmpl-rl-cccc-1",)),
    )
    own = tuple(r for r in records if isinstance(r, RequestArrival) and r.engine_request_id == target)
    return ScheduleWindow(engine(), own, records, 0, 0, complete=True, ranges=((0, 2), (3, 6)))


def test_the_window_keeps_every_shape_and_no_other_requests_id() -> None:
    window = _window()
    schedule, settings = shapes_only(window)
    assert b"aaaa" not in schedule
    assert b"cccc" not in schedule
    back = window_of(schedule, settings)
    target = window.arrivals[0].engine_request_id
    assert [a.engine_request_id for a in back.arrivals] == [target]
    assert back.ranges == window.ranges
    assert back.engine == window.engine
    arrivals = [r for r in back.records if isinstance(r, RequestArrival)]
    a, c = blind("chatcmpl-rl-aaaa-1"), blind("chatcmpl-rl-cccc-1")
    assert [a_.engine_request_id for a_ in arrivals] == [a, target, c]
    assert arrivals[1].external_request_id == window.arrivals[0].external_request_id  # the target's, in clear
    assert arrivals[2].cached_from == ((a, 1),)  # the provider under the same blinded id
    steps = [r for r in back.records if isinstance(r, ScheduleStep)]
    assert steps[-1].finished == (c,)
    # the plan a replay runs is the same, shape for shape
    before, after = plan_replay(window_log(window), target), plan_replay(window_log(back), target)
    shape = [
        (p.arrival.num_prompt_tokens, p.arrival.step, p.output_tokens, p.hit_blocks != ()) for p in before.requests
    ]
    assert shape == [
        (p.arrival.num_prompt_tokens, p.arrival.step, p.output_tokens, p.hit_blocks != ()) for p in after.requests
    ]
    assert (before.start_step, before.end_step) == (after.start_step, after.end_step)


def _parts() -> tuple[bytes, bytes]:
    return shapes_only(_window())


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda s, t: (s.replace(b"\n{", b"\n{ ", 1), t), "canonical"),
        (lambda s, t: (s.split(b"\n", 1)[1], t), "start with the engine's record"),
        (lambda s, t: (s + s.split(b"\n", 1)[0] + b"\n", t), "more than one engine"),
        (lambda s, t: (s, t.replace(b'"target":["', b'"target":["x', 1)), "lacks an arrival of the target"),
        (lambda s, t: (s, t.replace(b'"ranges":[[0,2]', b'"ranges":[[0,-2]', 1)), "ranges"),
        (lambda s, t: (s, b"{}"), "reprolane.reexecution/2"),
        (lambda s, t: (s, t.replace(b'"external":["', b'"external":[1,"', 1)), "external"),
        (lambda s, t: (s[:-1], t), "whole lines"),
        (lambda s, t: (s.replace(b'"kind":"step"', b'"kind":"stop"', 1), t), "schedule.jsonl line"),
    ],
)
def test_what_is_not_such_a_window_is_refused_by_name(change: object, needle: str) -> None:
    schedule, settings = change(*_parts())  # type: ignore[operator]
    with pytest.raises(ContractError, match=needle):
        window_of(schedule, settings)


def test_the_settings_name_the_format_the_target_and_the_ranges() -> None:
    doc = json.loads(_parts()[1])
    target = "chatcmpl-rl-0123456789abcdef0123456789abcdef-1"
    assert doc == {
        "format": "reprolane.reexecution/2",
        "target": [target],
        "external": [_window().arrivals[0].external_request_id],
        "ranges": [[0, 2], [3, 6]],
    }


KEY = "audit.example"


def _proven(window: ScheduleWindow, split: int, private: bytes) -> bytes:
    """The window's proof, its records shipped as two segments (the engine record and the first `split` records,
    then the rest) in a log of three leaves (another segment in between), signed by `private`."""
    assert window.engine is not None
    engine_id = window.engine.engine_id
    segments: dict[int, tuple[ScheduleRecord, ...]] = {
        0: (window.engine, *window.records[:split]),
        2: window.records[split:],
    }
    other = segment_leaf(engine_id, 1, record_hashes(window.records[:1]))
    leaves = [segment_leaf(engine_id, 0, record_hashes(segments[0])), other,
              segment_leaf(engine_id, 2, record_hashes(segments[2]))]  # fmt: skip
    hashes = [leaf.hash() for leaf in leaves]
    log = f"schedules/engine={engine_id}"
    note = sign_checkpoint_note(TreeHead(log_origin(KEY, log), 3, root_from_hashes(hashes)), KEY, private)

    def prove(name: LogName, ids: object) -> LogProofs:
        assert name == log
        found = {leaf.envelope_id: i for i, leaf in enumerate(leaves)}
        return LogProofs(note, 3, root_from_hashes(hashes).hex(), {
            i: ProvenLeaf(found[i], inclusion_proof(hashes, found[i]), leaves[found[i]]) for i in ids  # type: ignore[attr-defined]
        })  # fmt: skip

    return schedule_proof(window, segments, prove)


def _check(schedule: bytes, proof: bytes, public: bytes) -> list[str]:
    doc = ScheduleProof.model_validate_json(proof)
    note = parse_note(doc.checkpoint.encode())
    return check(schedule.splitlines(keepends=True), doc, note, VerifierKey(KEY, public))


def test_every_line_of_the_window_is_proven_a_record_of_the_signed_log() -> None:
    private = load_private_fresh()
    window = _window()
    schedule, _ = shapes_only(window)
    proof = _proven(window, 4, private)
    doc = ScheduleProof.model_validate_json(proof)
    assert [s.seq for s in doc.segments] == [0, 2]  # the segment in between is not the window's: not carried
    assert doc.lines[0] == (0, 0)
    assert doc.lines[-1] == (2, len(window.records) - 5)
    assert _check(schedule, proof, public_of(private)) == []


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        # one step's shapes: the token count the target computed
        (
            lambda s, p: (s.replace(b'"num_scheduled_tokens":5', b'"num_scheduled_tokens":6', 1), p),
            "line 7: not record 1 of segment 2 as the log committed it",
        ),
        # a step dropped
        (lambda s, p: (b"".join(x for i, x in enumerate(s.splitlines(keepends=True)) if i != 3), p), "places 11 lines"),
        # a record hash of a segment changed with the line: the segment is no longer the leaf signed
        (lambda s, p: (s, p.replace(p.split(b'"record_hashes":["')[1][:64], b"0" * 64, 1)), "segment 0"),
        # the proof's checkpoint signed by another key
        (lambda s, p: (s, None), "not signed by the pinned key"),
    ],
)
def test_a_changed_window_or_proof_is_named(change: object, needle: str) -> None:
    private = load_private_fresh()
    window = _window()
    schedule, _ = shapes_only(window)
    proof = _proven(window, 4, private)
    schedule, changed = change(schedule, proof)  # type: ignore[operator]
    if changed is None:
        changed = _proven(window, 4, load_private_fresh())
    problems = _check(schedule, changed, public_of(private))
    assert any(needle in p for p in problems), problems


def test_a_line_not_in_the_segments_read_is_refused_at_export() -> None:
    window = _window()
    assert window.engine is not None
    with pytest.raises(EvidenceError, match="in none of engine"):
        schedule_proof(window, {0: (window.engine,)}, lambda log, ids: None)  # type: ignore[arg-type,return-value]


def test_ids_are_blinded_the_same_everywhere_and_the_unknown_provider_stays() -> None:
    assert blind("x") == blind("x") != blind("y")
    assert blind("x").startswith("h-")
    assert len(blind("x")) == 34
    assert blind("?") == "?"
    assert segment_id("e1", 0) != segment_id("e1", 1)
