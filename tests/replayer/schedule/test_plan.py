"""The schedule lane's pure half: the replay window (busy periods, prefix-cache providers), the fillers' shapes
and forced prefixes, the step comparison, the fingerprint refusal and the mixture-of-experts check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replayer.schedule.lane import StepCheck, compare_steps, moe_markers, numeric_differences
from replayer.schedule.plan import WindowTooLongError, check_target, plan_replay
from schemas import RuntimeFingerprint
from schemas.schedule_log import ScheduleLog
from tests.schemas.test_schedule_log import arrival, engine, step


def burst_log() -> ScheduleLog:
    """Busy period 1: a (steps 0-2). Busy period 2: b (3-5) and c joining at 4 with a cache hit on a's block 0."""
    return ScheduleLog.from_records(
        [
            engine(),
            arrival("a", 0, 20),
            step(0, [("a", 0, 20)]),
            step(1, [("a", 20, 1)]),
            step(2, [("a", 21, 1)], finished=("a",)),
            arrival("b", 3, 5),
            step(3, [("b", 0, 5)]),
            arrival("c", 4, 40, cached=(("a", 1),)),
            step(4, [("b", 5, 1), ("c", 16, 24)]),
            step(5, [("b", 6, 1), ("c", 40, 1)], finished=("b",)),
            step(6, [("c", 41, 1)], finished=("c",)),
        ]
    )


def test_a_busy_period_starts_where_every_earlier_request_had_finished() -> None:
    assert burst_log().busy_period_starts() == [0, 3]
    assert long_running_log(3).busy_period_starts() == [0, 3, 6, 9, 12, 16]


def test_the_window_reaches_back_to_a_prefix_cache_provider() -> None:
    plan = plan_replay(burst_log(), "b")
    assert plan.start_step == 0  # c (in b's window) read a's block: a's busy period is replayed too
    assert [p.arrival.engine_request_id for p in plan.requests] == ["a", "b", "c"]
    assert plan.end_step == 5
    by_id = {p.arrival.engine_request_id: p for p in plan.requests}
    assert by_id["a"].output_tokens == 3
    assert by_id["c"].hit_blocks == ("a",)
    assert by_id["a"].target_prefix == 0
    assert plan.notes == []


def long_running_log(unrelated: int) -> ScheduleLog:
    """A server that ran ``unrelated`` busy periods between the one that computed a prefix (a) and the one that
    read it (b with c reading a's block, then d reading c's blocks in the period after)."""
    records: list[object] = [engine(), arrival("a", 0, 20)]
    records += [step(0, [("a", 0, 20)]), step(1, [("a", 20, 1)]), step(2, [("a", 21, 1)], finished=("a",))]
    for i in range(unrelated):
        n, rid = 3 + 3 * i, f"x{i}"
        records += [arrival(rid, n, 8), step(n, [(rid, 0, 8)]), step(n + 1, [(rid, 8, 1)])]
        records.append(step(n + 2, [(rid, 9, 1)], finished=(rid,)))
    n = 3 + 3 * unrelated
    records += [arrival("b", n, 5), step(n, [("b", 0, 5)]), arrival("c", n + 1, 40, cached=(("a", 1),))]
    records += [step(n + 1, [("b", 5, 1), ("c", 16, 24)]), step(n + 2, [("b", 6, 1), ("c", 40, 1)], finished=("b",))]
    records += [step(n + 3, [("c", 41, 1)], finished=("c",)), arrival("d", n + 4, 40, cached=(("c", 2),))]
    records += [step(n + 4, [("d", 32, 8)]), step(n + 5, [("d", 40, 1)], finished=("d",))]
    return ScheduleLog.from_records(records)  # type: ignore[arg-type]


def test_busy_periods_that_provided_nothing_are_left_out() -> None:
    """On a long-running server, the window is the target's busy period and the periods that computed what it
    read from the prefix cache: not every period in between (they would make a replay's cost grow with uptime)."""
    plan = plan_replay(long_running_log(100), "c")
    assert plan.periods == ((0, 2), (303, 306))
    assert plan.steps == [0, 1, 2, 303, 304, 305, 306]
    assert [p.arrival.engine_request_id for p in plan.requests] == ["a", "b", "c"]
    assert plan.start_step == 0
    assert plan.end_step == 306
    assert plan.notes == []


def test_providers_are_followed_period_by_period() -> None:
    """d read c's blocks, c read a's: d's plan replays a's, c's and d's periods, and no unrelated one."""
    plan = plan_replay(long_running_log(5), "d")
    assert plan.periods == ((0, 2), (18, 21), (22, 23))
    assert [p.arrival.engine_request_id for p in plan.requests] == ["a", "b", "c", "d"]
    by_id = {p.arrival.engine_request_id: p for p in plan.requests}
    assert by_id["c"].target_prefix == 32  # d's two cached blocks are c's: c carries d's first 32 tokens
    assert by_id["a"].target_prefix == 16  # and c's block 0 was a's


def test_a_plan_without_the_periods_a_replay_engine_holds_runs_only_the_rest() -> None:
    """d's plan less a's and c's periods (an earlier replay ran them, their cache kept): only d's steps and
    requests, starting at d's period; without every period there is nothing to run."""
    plan = plan_replay(long_running_log(5), "d")
    rest = plan.without({(0, 2), (18, 21)})
    assert rest.periods == ((22, 23),)
    assert rest.steps == [22, 23]
    assert rest.start_step == 22
    assert [p.arrival.engine_request_id for p in rest.requests] == ["d"]
    assert rest.requests[0].hit_blocks == ("c", "c")  # copied from the kept replay's tokens of c
    assert plan.without({(0, 2)}).periods == ((18, 21), (22, 23))
    assert plan.without(set()) == plan
    with pytest.raises(ValueError, match="runs nothing"):
        plan.without(set(plan.periods))


def test_a_window_over_the_step_limit_is_refused() -> None:
    log = long_running_log(100)
    assert len(plan_replay(log, "c", max_steps=7).steps) == 7
    with pytest.raises(WindowTooLongError, match="would run 7 recorded steps in 2 busy period"):
        plan_replay(log, "c", max_steps=6)


def test_a_filler_that_provided_the_targets_prefix_carries_it() -> None:
    plan = plan_replay(burst_log(), "c")
    by_id = {p.arrival.engine_request_id: p for p in plan.requests}
    assert by_id["a"].target_prefix == 16  # block 0 of c came from a's cache: a's first block is c's own tokens
    assert by_id["b"].target_prefix == 0


def test_a_provider_outside_the_log_is_noted() -> None:
    log = burst_log()
    log.arrivals["c"] = arrival("c", 4, 40, cached=(("z", 1),))
    log = ScheduleLog.from_records([log.engine, *log.arrivals.values(), *log.steps.values()])  # type: ignore[list-item]
    plan = plan_replay(log, "c")
    assert plan.start_step == 3
    assert any("outside the log (z)" in n for n in plan.notes)


def test_compare_steps_maps_ids_and_names_the_first_difference() -> None:
    log = burst_log()
    replayed = [
        step(n, [(f"r-{r}", c, s) for r, c, s in shape])
        for n, shape in enumerate([[("b", 0, 5)], [("b", 5, 1), ("c", 16, 24)]])
    ]
    ids = {"r-b": "b", "r-c": "c"}
    assert compare_steps(log, range(3, 5), replayed, ids) == StepCheck(2, None)
    wrong = [replayed[0], step(1, [("r-b", 5, 1), ("r-c", 0, 40)])]
    check = compare_steps(log, range(3, 5), wrong, ids)
    mismatch = check.mismatch
    assert check.compared == 1
    assert mismatch is not None
    assert mismatch.step == 4
    assert mismatch.replayed == (("b", 5, 1), ("c", 0, 40))
    assert mismatch.reason.endswith("(recorded only: [('c', 16, 24)]; replayed only: [('c', 0, 40)])")
    short = compare_steps(log, range(3, 6), replayed, ids).mismatch
    assert short is not None
    assert short.reason == "the replay ended before this step"


def test_numeric_differences_name_the_fields() -> None:
    prod = RuntimeFingerprint(
        engine="vllm", engine_version="0.32.0", device_name="cpu A", num_threads=2, max_num_seqs=256
    )
    lane = prod.model_copy(update={"device_name": "cpu B", "max_num_seqs": 1})
    assert numeric_differences(prod, lane) == ["device_name: 'cpu A' != 'cpu B'"]
    assert numeric_differences(prod, prod) == []
    assert numeric_differences(None, lane)


def test_mixture_of_experts_is_detected_from_the_model_config() -> None:
    assert moe_markers(SimpleNamespace(num_local_experts=8, num_experts_per_tok=2)) == [
        "num_local_experts=8",
        "num_experts_per_tok=2",
    ]
    assert moe_markers(SimpleNamespace(text_config=SimpleNamespace(n_routed_experts=64))) == ["n_routed_experts=64"]
    assert moe_markers(SimpleNamespace(hidden_size=576)) == []


def test_a_join_to_the_wrong_request_is_refused() -> None:
    log = burst_log()
    check_target(log, "c", 40)
    with pytest.raises(ValueError, match="not this request's"):
        check_target(log, "c", 39)
    with pytest.raises(KeyError):
        check_target(log, "zz", 40)


def test_a_filler_that_provided_another_real_requests_prefix_carries_that_requests_tokens() -> None:
    """Busy-period replay (issue 32): b is the target, c is replayed with its real content beside it; a (a filler)
    computed the block c read, so a carries c's first block, and says whose it is."""
    plan = plan_replay(burst_log(), "b", also=("c",))
    by_id = {p.arrival.engine_request_id: p for p in plan.requests}
    assert (by_id["a"].target_prefix, by_id["a"].prefix_of) == (16, "c")
    assert plan.end_step == 6  # the window runs until c, the last of them, finished
    alone = {p.arrival.engine_request_id: p for p in plan_replay(burst_log(), "b").requests}
    assert (alone["a"].target_prefix, alone["a"].prefix_of) == (0, None)  # b alone reads nothing of a


def _grammar_log(passed_over: bool) -> ScheduleLog:
    """p fills step 0's budget; x (structured outputs) and y arrive with it. x either keeps its place in the queue
    (scheduled at step 1 before y) or is passed over while its grammar compiles (y at step 1, x at step 2)."""
    x = arrival("x", 0, 20).model_copy(update={"structured_output": True})
    later = (
        [step(1, [("p", 256, 1), ("y", 0, 20)]), step(2, [("p", 257, 1), ("y", 20, 1), ("x", 0, 20)])]
        if passed_over
        else [
            step(1, [("p", 256, 1), ("x", 0, 20), ("y", 0, 20)]),
            step(2, [("p", 257, 1), ("x", 20, 1), ("y", 20, 1)]),
        ]
    )
    return ScheduleLog.from_records(
        [engine(), arrival("p", 0, 256), x, arrival("y", 0, 20), step(0, [("p", 0, 256)]), *later]
    )


def test_a_structured_request_that_kept_its_place_is_added_where_it_arrived() -> None:
    """It waited for the token budget, not its grammar: added at its arrival, it stands before y, as it did."""
    plan = plan_replay(_grammar_log(passed_over=False), "p")
    assert [(p.arrival.engine_request_id, p.due_step) for p in plan.requests] == [("p", 0), ("x", 0), ("y", 0)]


def test_a_structured_request_passed_over_while_its_grammar_compiled_is_added_where_it_was_scheduled() -> None:
    plan = plan_replay(_grammar_log(passed_over=True), "p")
    assert [(p.arrival.engine_request_id, p.due_step) for p in plan.requests] == [("p", 0), ("y", 0), ("x", 2)]


def test_a_structured_request_left_out_of_a_step_with_room_waited_for_its_grammar() -> None:
    """Every request arrived at once (the CI case): q took 20 of 256 tokens at step 0, x was left out though the
    budget had room and nobody after it went first. Only its grammar held it: it is added where it was scheduled."""
    x = arrival("x", 0, 20).model_copy(update={"structured_output": True})
    log = ScheduleLog.from_records(
        [engine(), arrival("q", 0, 20), x, step(0, [("q", 0, 20)]), step(1, [("q", 20, 1), ("x", 0, 20)])]
    )
    plan = plan_replay(log, "q")
    assert [(p.arrival.engine_request_id, p.due_step) for p in plan.requests] == [("q", 0), ("x", 1)]
