"""The schedule lane's pure half: the replay window (busy periods, prefix-cache providers), the fillers' shapes
and forced prefixes, the step comparison, the fingerprint refusal and the mixture-of-experts check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from replayer.lanes.schedule_lane import compare_steps, moe_markers, numeric_differences
from replayer.lanes.schedule_plan import busy_period_start, check_target, plan_replay
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
    log = burst_log()
    assert busy_period_start(log, 2) == 0
    assert busy_period_start(log, 3) == 3
    assert busy_period_start(log, 5) == 3


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
    assert compare_steps(log, 3, 4, replayed, ids) == (2, None)
    wrong = [replayed[0], step(1, [("r-b", 5, 1), ("r-c", 0, 40)])]
    compared, mismatch = compare_steps(log, 3, 4, wrong, ids)
    assert compared == 1
    assert mismatch is not None
    assert mismatch.step == 4
    assert mismatch.replayed == (("b", 5, 1), ("c", 0, 40))
    _, short = compare_steps(log, 3, 5, replayed, ids)
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
