"""`infra.reexecution.window`: the window a re-executable bundle carries keeps every shape a replay needs and no
other request's id, and reading it back refuses what is not such a window (the bundle is a file from anyone)."""

from __future__ import annotations

import json

import pytest

from infra.reexecution.window import pseudonym, shapes_only, window_of
from replayer.schedule.plan import plan_replay
from replayer.schedule.replay import window_log
from replayer.schedule.store import ScheduleWindow
from schemas.errors import ContractError
from schemas.schedule import RequestArrival, ScheduleStep
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
    assert [a.engine_request_id for a in arrivals] == [pseudonym(1), target, pseudonym(2)]
    assert arrivals[2].cached_from == ((pseudonym(1), 1),)  # the provider under the same pseudonym
    steps = [r for r in back.records if isinstance(r, ScheduleStep)]
    assert steps[-1].finished == (pseudonym(2),)
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
        (lambda s, t: (s, b"{}"), "reprolane.reexecution/1"),
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
    assert doc == {
        "format": "reprolane.reexecution/1",
        "target": ["chatcmpl-rl-0123456789abcdef0123456789abcdef-1"],
        "ranges": [[0, 2], [3, 6]],
    }
