"""The schedule log's index and the checks a replay trusts (segment names and decoding:
`tests/schemas/test_schedule_delivery.py`, the one codec)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas.errors import ContractError
from schemas.schedule import EngineStart, RequestArrival, ScheduledRequest, ScheduleStep
from schemas.schedule_delivery import decode_segment, encode_record, external_request_id_for
from schemas.schedule_log import ScheduleLog

AT = datetime(2026, 12, 1, tzinfo=UTC)
E = "eng-1"


def engine() -> EngineStart:
    return EngineStart(
        engine_id=E,
        started_at=AT,
        vllm_version="0.32.0",
        model="m",
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=256,
        max_model_len=2048,
        block_size=16,
        num_kv_blocks=100,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        scheduling_policy="fcfs",
        seed=0,
    )


def arrival(rid: str, step: int, prompt: int, cached: tuple[tuple[str, int], ...] | None = None) -> RequestArrival:
    return RequestArrival(
        engine_id=E,
        step=step,
        engine_request_id=rid,
        external_request_id=rid,
        num_prompt_tokens=prompt,
        max_tokens=8,
        cached_from=cached,
    )


def step(
    n: int, sched: list[tuple[str, int, int]], finished: tuple[str, ...] = (), preempted: tuple[str, ...] = ()
) -> ScheduleStep:
    return ScheduleStep(
        engine_id=E,
        step=n,
        at=AT,
        scheduled=tuple(
            ScheduledRequest(engine_request_id=r, num_computed_tokens=c, num_scheduled_tokens=s) for r, c, s in sched
        ),
        finished=finished,
        preempted=preempted,
    )


def two_request_log() -> list[EngineStart | RequestArrival | ScheduleStep]:
    """a: 10-token prompt, 3 tokens out (steps 0-2); b arrives before step 1, 4 tokens, 2 out (steps 1-2)."""
    return [
        engine(),
        arrival("a", 0, 10),
        step(0, [("a", 0, 10)]),
        arrival("b", 1, 4),
        step(1, [("a", 10, 1), ("b", 0, 4)]),
        step(2, [("a", 11, 1), ("b", 4, 1)], finished=("a", "b")),
    ]


def test_the_logs_records_round_trip_through_the_one_segment_codec() -> None:
    records = two_request_log()
    data = b"".join(encode_record(r) for r in records)
    assert decode_segment(data, "eng-1") == tuple(records)
    assert ScheduleLog.from_records(decode_segment(data, "eng-1")).problems() == []


def test_consistent_log_has_no_problems_and_output_lengths() -> None:
    log = ScheduleLog.from_records(two_request_log())
    assert log.problems() == []
    assert log.output_length("a") == 3
    assert log.output_length("b") == 2
    assert log.requests["b"].steps == [1, 2]
    assert log.requests["a"].finished_at == 2


def test_a_dropped_step_is_named() -> None:
    records = [r for r in two_request_log() if not (isinstance(r, ScheduleStep) and r.step == 1)]
    problems = ScheduleLog.from_records(records).problems()
    assert any("steps missing from the log: 1" in p for p in problems)
    assert any("request a had 11 tokens computed, its previous step left 10" in p for p in problems)


def test_a_dropped_step_is_found_even_when_steps_are_renumbered() -> None:
    records = [r for r in two_request_log() if not (isinstance(r, ScheduleStep) and r.step == 1)]
    renumbered = [
        r.model_copy(update={"step": r.step - 1}) if isinstance(r, ScheduleStep) and r.step > 1 else r for r in records
    ]
    problems = ScheduleLog.from_records(renumbered).problems()
    assert problems
    assert all("missing from the log" not in p for p in problems)


def test_mixed_engines_are_refused() -> None:
    other = arrival("x", 0, 3).model_copy(update={"engine_id": "eng-2"})
    with pytest.raises(ContractError, match="one engine instance"):
        ScheduleLog.from_records([*two_request_log(), other])


def test_join_by_external_id_is_exact_and_follows_the_servers_naming() -> None:
    a = arrival("chatcmpl-rl-abc-1234abcd", 0, 3).model_copy(update={"external_request_id": "chatcmpl-rl-abc"})
    b = arrival("cmpl-rl-xyz-1-0-1234abcd", 0, 3).model_copy(update={"external_request_id": "cmpl-rl-xyz-1-0"})
    log = ScheduleLog.from_records([engine(), a, b])
    assert log.by_external_id(external_request_id_for("chat.completions", "rl-abc")) == a
    assert log.by_external_id(external_request_id_for("completions", "rl-xyz-1")) == b
    for near in (
        "rl-abc",
        "chatcmpl-rl-ab",
        "chatcmpl-rl-abc-1234abcd",
        external_request_id_for("completions", "rl-xyz"),
    ):
        assert log.by_external_id(near) is None


def test_a_preempted_request_may_resume_from_its_cache() -> None:
    records = [
        engine(),
        arrival("a", 0, 40),
        step(0, [("a", 0, 40)]),
        step(1, [("a", 40, 1)]),
        step(2, [], preempted=("a",)),
        step(3, [("a", 32, 9)]),
        step(4, [("a", 41, 1)], finished=("a",)),
    ]
    assert ScheduleLog.from_records(records).problems() == []
    records[5] = step(3, [("a", 48, 1)])
    assert any("resumed with 48" in p for p in ScheduleLog.from_records(records).problems())
