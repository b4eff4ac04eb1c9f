"""The schedule lane on the real model: batched "production" runs recorded by the recorder, each request replayed
with filler companions of the recorded shapes, compared bitwise (token ids and logprobs).

"Production" is an in-process engine with the recorder (`replayer.schedule.engine.StepDriver`), settings of
the stack's vLLM except a small token budget per step (``max_num_batched_tokens=256``) so that prefills are chunked
and mixed with decodes, prefix caching on, and float32 (`DTYPE`). One production engine and one lane engine serve
the whole module. vLLM's OpenAI server with the recorder is tested in test_replay_stack.py.

Why float32: what these tests prove (the recorded shapes rebuilt step for step, fillers of the right shapes and
no foreign content, prefix-cache hits and preemption reproduced, outputs and logprobs bitwise) does not depend on
the dtype, and on a CPU without native bfloat16 vLLM falls back to torch's bfloat16 linear layers, four times
slower per step (0.59 s against 0.14 s for 12 requests on the 2-core box). Replay in bfloat16, the stack's dtype,
is proven on the stack's vLLM (test_replay_stack.py, test_traffic_stack.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra import paths
from replayer.errors import NotReplayableError
from replayer.lanes.base import GenRequest
from replayer.lanes.batch_engine import render_chat
from replayer.matrix.inputs import DEFAULT_PROMPTS
from replayer.schedule.engine import StepDriver
from replayer.schedule.lane import ScheduleLane, ScheduleReplay
from replayer.schedule.plan import hit_providers, plan_replay
from replayer.settings import ReplayerSettings
from schemas import SamplingContract
from schemas.schedule import ScheduledRequest, ScheduleStep
from schemas.schedule_delivery import decode_segment, encode_record
from schemas.schedule_log import ScheduleLog

pytestmark = pytest.mark.model

#: The production engine's dtype, and so the lane's (see the module docstring).
DTYPE = "float32"
MAX_TOKENS = 16
TOP_K = 3
GREEDY = SamplingContract(temperature=0.0, seed_scope="none")
SEEDED = SamplingContract(temperature=0.8, top_p=0.95, seed=1234, seed_scope="per_request")
#: 32 distinct chat prompts (the bundled 8, each asked four ways)
PROMPTS = tuple(
    f"{DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]} Answer {style}."
    for i, style in enumerate(
        s for s in ("in one sentence", "as a short list", "in plain words", "for a child") for _ in DEFAULT_PROMPTS
    )
)
LONG_SYSTEM = " ".join(f"Rule {i}: answer precisely, cite the policy section, and never guess." for i in range(40))


def model_dir() -> Path:
    path = paths.model_dir()  # where `reprolane model fetch` put it ($REPROLANE_CACHE_DIR honoured)
    if not (path / "config.json").is_file():
        pytest.skip("no converted model (reprolane model fetch)")
    return path


@pytest.fixture(scope="module")
def prod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StepDriver]:
    driver = StepDriver(
        model_dir(),
        tmp_path_factory.mktemp("prod-schedule"),
        num_threads=2,  # a production CPU engine's; with one, a batch's neighbours do not change a sum's order
        dtype=DTYPE,
        max_num_seqs=256,
        max_num_batched_tokens=256,
        max_model_len=2048,
        enable_prefix_caching=True,
        seed=0,
    )
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def lane(prod: StepDriver) -> Iterator[ScheduleLane]:
    log = prod.log()
    assert log.engine is not None
    lane = ScheduleLane(ReplayerSettings(model_dir=model_dir()), log.engine)
    yield lane
    lane.close()


def gen(ids: tuple[int, ...], sampling: SamplingContract = GREEDY) -> GenRequest:
    return GenRequest(ids, sampling, max_tokens=MAX_TOKENS, top_k_logprobs=TOP_K)


def assert_no_foreign_content(result: ScheduleReplay, target: GenRequest, others: list[GenRequest]) -> None:
    """(f) A filler holds random ids, copies of other fillers, or the target's own tokens; never another
    request's: no 4-gram of another real prompt occurs in any filler."""
    target_grams = {tuple(target.prompt_token_ids[i : i + 4]) for i in range(len(target.prompt_token_ids) - 3)}
    for other in others:
        ids = other.prompt_token_ids
        grams = {tuple(ids[i : i + 4]) for i in range(len(ids) - 3)} - target_grams
        for rid, filler in result.fillers.items():
            found = [i for i in range(len(filler) - 3) if tuple(filler[i : i + 4]) in grams]
            assert not found, f"filler for {rid} holds another request's tokens at {found[:5]}"


def replay_all(lane: ScheduleLane, log: ScheduleLog, runs: list[tuple[str, object]], reqs: list[GenRequest]) -> int:
    bitwise = 0
    for (rid, out), req in zip(runs, reqs, strict=True):
        result = lane.replay_target(log, rid, req)
        assert result.steps.mismatch is None, result.steps.mismatch
        assert result.schedule_reproduced, result.notes
        assert_no_foreign_content(result, req, [r for r in reqs if r is not req])
        bitwise += result.output == out
    return bitwise


def test_the_recorders_log_is_complete_and_canonical(prod: StepDriver) -> None:
    prod.run([(0, gen(p)) for p in render_chat(model_dir(), PROMPTS[:2])])
    log = prod.log()
    assert log.problems() == []
    assert log.engine is not None
    assert log.engine.runtime is not None
    for path in sorted(Path(prod.recorder.writer.directory).glob("*.jsonl")):
        for line in path.read_bytes().splitlines(keepends=True):
            (record,) = decode_segment(line, prod.recorder.engine_id)
            assert encode_record(record) == line  # every line is its record's canonical JSON


def test_twelve_batched_prompts_replay_bitwise(prod: StepDriver, lane: ScheduleLane) -> None:
    """(a) 12 prompts generated together; each replayed as the target with 11 fillers: all bitwise.

    Whether the same prompts one at a time differ is the CPU's fact, not the lane's, so it is measured
    (`reprolane replay matrix`, BENCHMARKS.md), not asserted: on AVX-512 machines most of them forked, on an
    AVX2-only one vLLM's bfloat16 kernels gave every prompt the same logits alone and in the batch."""
    reqs = [gen(p) for p in render_chat(model_dir(), PROMPTS[:12])]
    runs = prod.run([(0, r) for r in reqs])
    log = prod.log()
    assert replay_all(lane, log, runs, reqs) == 12


def test_staggered_long_prompts_with_chunked_prefill_replay_bitwise(prod: StepDriver, lane: ScheduleLane) -> None:
    """(b) two ~556-token prompts among short ones, arriving at different steps, 256 tokens per step: prefills
    are chunked and mixed with decodes; every request replays bitwise, a seeded sampled one included."""
    long_text = " ".join(DEFAULT_PROMPTS) * 8
    longs = render_chat(model_dir(), [long_text[:2450], long_text[300:2750]])
    shorts = render_chat(model_dir(), PROMPTS[12:16])
    assert all(500 < len(p) < 700 for p in longs), [len(p) for p in longs]
    reqs = [gen(shorts[0]), gen(longs[0]), gen(shorts[1], SEEDED), gen(longs[1]), gen(shorts[2]), gen(shorts[3])]
    runs = prod.run(list(zip([0, 1, 2, 3, 5, 8], reqs, strict=True)))
    log = prod.log()
    chunked = [
        s
        for s in log.steps.values()
        if any(r.num_computed_tokens > 0 and r.num_scheduled_tokens > 1 for r in s.scheduled)
    ]
    assert chunked, "no prefill was chunked"
    assert replay_all(lane, log, runs, reqs) == len(reqs)


def test_prefix_cache_hits_replay_bitwise_where_the_log_covers_them(prod: StepDriver, lane: ScheduleLane) -> None:
    """(c) a long shared system prompt: later requests read its blocks from the cache of the first; the fillers
    that provided the target's prefix carry it, and all replay bitwise. A log that starts after the provider
    ran says so and does not claim the schedule reproduced."""
    prompts = render_chat(model_dir(), PROMPTS[16:20], system=LONG_SYSTEM)
    reqs = [gen(p) for p in prompts]
    runs = prod.run([(0, reqs[0]), (1, reqs[1]), (4, reqs[2]), (20, reqs[3])])
    log = prod.log()
    cached = [log.arrivals[rid].cached_from for rid, _ in runs[1:]]
    assert all(c for c in cached), cached
    assert replay_all(lane, log, runs, reqs) == len(reqs)
    # the same log without the provider's arrival and steps: the hit is not covered
    provider = runs[0][0]
    first_other = log.requests[runs[1][0]].steps[0]
    cut = ScheduleLog.from_records(
        [
            log.engine,
            *(a for a in log.arrivals.values() if a.engine_request_id != provider),
            *(s for n, s in log.steps.items() if n >= first_other),
        ]  # type: ignore[list-item]
    )
    result = lane.replay_target(cut, runs[1][0], reqs[1])
    assert any("outside the log" in n for n in result.notes)
    assert not result.schedule_reproduced


def test_busy_periods_between_a_provider_and_its_readers_are_not_replayed(prod: StepDriver, lane: ScheduleLane) -> None:
    """(g) a long-running server: one request computes a shared system prompt, unrelated busy periods follow,
    then requests that read the prompt from the cache. Each reader's replay runs the provider's period and its
    own, not the ones between, and is bitwise with its schedule reproduced."""
    system = LONG_SYSTEM.replace("precisely", "briefly")  # a prefix no other test of the module computes
    provider = gen(render_chat(model_dir(), [PROMPTS[0]], system=system)[0])
    prod.run([(0, provider)])
    for prompt in render_chat(model_dir(), PROMPTS[1:4]):  # three busy periods that share nothing with the readers
        prod.run([(0, gen(prompt))])
    readers = [gen(p) for p in render_chat(model_dir(), PROMPTS[4:6], system=system)]
    runs = prod.run([(0, readers[0]), (2, readers[1])])
    log = prod.log()
    for rid, _ in runs:
        plan = plan_replay(log, rid)
        assert len(plan.periods) == 2, plan.periods  # the provider's and the readers'
        assert plan.end_step - plan.start_step + 1 > len(plan.steps)  # the periods between are left out
    assert replay_all(lane, log, runs, readers) == len(readers)
    assert lane.replay_target(log, runs[0][0], readers[0]).periods == plan_replay(log, runs[0][0]).periods
    limit, lane.max_steps = lane.max_steps, len(plan_replay(log, runs[0][0]).steps) - 1
    try:  # a replay that would run more steps than allowed is refused (the service then replays one at a time)
        with pytest.raises(NotReplayableError, match="schedule_max_steps"):
            lane.replay_target(log, runs[0][0], readers[0])
    finally:
        lane.max_steps = limit


#: Blocks of a prompt past the system prompt (the block size of vLLM on a CPU is 128 tokens).
LONG_CONTEXT = " ".join(DEFAULT_PROMPTS) * 2
#: A shared system prompt no other test of the module computes past its first block (the tests below read it).
KEPT_SYSTEM = LONG_SYSTEM.replace("precisely", "carefully")


def count_runs(lane: ScheduleLane, monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, int], ...]]:
    """The held periods of each run the lane's engine makes (`ScheduleLane._drive`), appended as they happen."""
    runs: list[tuple[tuple[int, int], ...]] = []
    drive = lane._drive

    def counted(*args: object) -> object:
        runs.append(args[-1])  # type: ignore[arg-type]
        return drive(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(lane, "_drive", counted)
    return runs


def test_a_providers_busy_period_is_replayed_once_for_its_readers(
    prod: StepDriver, lane: ScheduleLane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(h) a shared system prompt computed by one busy period, read by three later ones: the first reader's replay
    runs the provider's period and its own; the next readers' replays run only their own, reading the provider's
    blocks from the cache the first replay left, bitwise with the schedule reproduced. A replay of a period the
    engine has passed runs its providers again."""
    provider = gen(render_chat(model_dir(), [PROMPTS[8]], system=KEPT_SYSTEM)[0])
    prod.run([(0, provider)])
    readers = [gen(p) for p in render_chat(model_dir(), PROMPTS[9:12], system=KEPT_SYSTEM)]
    runs = [prod.run([(0, r)])[0] for r in readers]  # each reader a busy period of its own
    log = prod.log()
    provider_period = plan_replay(log, runs[0][0]).periods[-2]
    drives = count_runs(lane, monkeypatch)
    assert replay_all(lane, log, runs, readers) == len(readers)
    assert len(drives) == len(readers)  # one engine run each: nothing ran twice
    assert provider_period not in drives[0]  # the first reader's replay computed it
    for (rid, _), held in zip(runs[1:], drives[1:], strict=True):
        plan = plan_replay(log, rid)
        assert provider_period in held
        assert plan.without(held).periods == (plan.periods[-1],)  # only the reader's own period ran
    # the same long question sent twice in one busy period (a client's retry): the second read the first's blocks.
    # Replayed late first, then early: early's period starts before what the engine has replayed since, and the
    # cache holds early's blocks (late's replay sent early as a filler carrying them for late to read), hits
    # production never had; so early's replay runs every period again from an empty cache, and knows it beforehand
    twice = gen(render_chat(model_dir(), [PROMPTS[4] + " Context: " + LONG_CONTEXT], system=KEPT_SYSTEM)[0])
    early, late = prod.run([(0, twice), (2, twice)])
    log = prod.log()
    assert early[0] in hit_providers(log.arrivals[late[0]])
    assert log.requests[early[0]].steps[-1] < log.requests[late[0]].steps[-1]
    assert lane.replay_target(log, late[0], twice).output == late[1]
    assert provider_period in drives[-1]
    again = lane.replay_target(log, early[0], twice)
    assert again.reused == ()
    assert drives[-1] == ()
    assert len(drives) == len(readers) + 2  # no run wasted on a cache it could not use
    assert again.schedule_reproduced
    assert again.output == early[1]


def test_fillers_of_different_busy_periods_never_share_content(
    prod: StepDriver, lane: ScheduleLane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(k) two busy periods after a provider's, each a reader and a long request nobody read from, in the same
    order. The second replay reuses the cache the first left, which holds the first filler's blocks: the filler
    beside the second reader does not hit them (its random ids are its own), so one run replays it."""
    system = KEPT_SYSTEM.replace("section", "clause")
    prod.run([(0, gen(render_chat(model_dir(), [PROMPTS[16]], system=system)[0]))])
    readers = [gen(p) for p in render_chat(model_dir(), PROMPTS[17:19], system=system)]
    unread = [gen(tuple(range(base, base + 400))) for base in (2000, 3000)]  # three full blocks each, no template
    runs = [prod.run([(0, r), (0, u)])[0] for r, u in zip(readers, unread, strict=True)]
    log = prod.log()
    drives = count_runs(lane, monkeypatch)
    assert replay_all(lane, log, runs, readers) == len(readers)
    assert drives[-1]  # the second replay reused the first's cache
    assert len(drives) == len(readers)


def test_a_reader_of_blocks_the_kept_replay_did_not_carry_runs_its_providers_again(
    prod: StepDriver, lane: ScheduleLane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(i) the kept replay of a provider's period carried the prefix its reader read (the system prompt) and
    random ids past it; a later reader of the provider's whole prompt cannot use that cache: the replay runs the
    provider's period again, from an empty cache, and is bitwise."""
    system = KEPT_SYSTEM.replace("cite", "quote")
    long_question = PROMPTS[12] + " Context: " + LONG_CONTEXT
    question = render_chat(model_dir(), [long_question], system=system)[0]
    other = render_chat(model_dir(), [PROMPTS[13]], system=system)[0]
    prod.run([(0, gen(question))])
    readers = [gen(other), gen(question)]  # the second reads every full block of the provider's prompt
    runs = [prod.run([(0, r)])[0] for r in readers]
    log = prod.log()
    assert len(hit_providers(log.arrivals[runs[1][0]])) > len(hit_providers(log.arrivals[runs[0][0]]))
    drives = count_runs(lane, monkeypatch)
    assert replay_all(lane, log, runs, readers) == len(readers)
    assert drives[-1] == ()
    assert len(drives) == len(readers)  # it knew before it ran: no run was wasted on a cache it could not use


def test_a_replay_that_reused_the_cache_and_missed_the_schedule_runs_again_from_an_empty_one(
    prod: StepDriver, lane: ScheduleLane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(j) a reader whose log has one step altered: the replay that reused the provider's cache does not reproduce
    the schedule, so it runs again from an empty cache, and that replay names the altered step."""
    provider = gen(render_chat(model_dir(), [PROMPTS[14]], system=KEPT_SYSTEM.replace("guess", "speculate"))[0])
    reader = gen(render_chat(model_dir(), [PROMPTS[15]], system=KEPT_SYSTEM.replace("guess", "speculate"))[0])
    prod.run([(0, provider)])
    first = prod.run([(0, reader)])[0]
    second = prod.run([(0, reader)])[0]
    log = prod.log()
    assert lane.replay_target(log, first[0], reader).output == first[1]
    victim = log.steps[log.requests[second[0]].steps[-1]]  # its last: no later step shows the change
    head = victim.scheduled[0]
    log.steps[victim.step] = victim.model_copy(
        update={"scheduled": (head.model_copy(update={"num_scheduled_tokens": head.num_scheduled_tokens + 1}),)}
    )
    drives = count_runs(lane, monkeypatch)
    result = lane.replay_target(log, second[0], reader)
    assert len(drives) == 2
    assert drives[0]  # the first run reused the provider's cache
    assert drives[1] == ()  # the second ran from an empty one
    assert result.reused == ()
    assert result.steps.mismatch is not None
    assert result.steps.mismatch.step == victim.step


def test_an_altered_log_names_the_first_mismatching_step(prod: StepDriver, lane: ScheduleLane) -> None:
    """(d) one step's shape changed in the log: the lane reports that step and does not claim reproduction."""
    reqs = [gen(p) for p in render_chat(model_dir(), PROMPTS[20:24])]
    runs = prod.run([(0, reqs[0]), (0, reqs[1]), (2, reqs[2]), (3, reqs[3])])
    log = prod.log()
    target = runs[0][0]
    victim = log.requests[target].steps[4]
    step = log.steps[victim]
    first = step.scheduled[0]
    altered = ScheduleStep(
        engine_id=step.engine_id,
        step=step.step,
        at=step.at,
        scheduled=(
            ScheduledRequest(
                engine_request_id=first.engine_request_id,
                num_computed_tokens=first.num_computed_tokens,
                num_scheduled_tokens=first.num_scheduled_tokens + 1,
            ),
            *step.scheduled[1:],
        ),
        finished=step.finished,
        preempted=step.preempted,
    )
    log.steps[victim] = altered
    result = lane.replay_target(log, target, reqs[0])
    assert result.steps.mismatch is not None
    assert result.steps.mismatch.step == victim
    assert not result.schedule_reproduced


def test_a_dropped_step_is_detected(prod: StepDriver, lane: ScheduleLane) -> None:
    """(e) a log missing one step (a recorder that dropped it) is named as incomplete, and the replay says so."""
    reqs = [gen(p) for p in render_chat(model_dir(), PROMPTS[24:26])]
    runs = prod.run([(0, reqs[0]), (1, reqs[1])])
    log = prod.log()
    target = runs[0][0]
    dropped = log.requests[target].steps[3]
    del log.steps[dropped]
    assert any("missing" in p for p in log.problems())
    result = lane.replay_target(log, target, reqs[0])
    assert not result.schedule_reproduced
    assert any("missing" in n for n in result.notes)


def test_window_replay_reproduces_every_request_with_real_content(prod: StepDriver, lane: ScheduleLane) -> None:
    reqs = [gen(p) for p in render_chat(model_dir(), PROMPTS[26:30])]
    runs = prod.run([(0, reqs[0]), (1, reqs[1]), (1, reqs[2]), (3, reqs[3])])
    log = prod.log()
    by_id = {rid: r for (rid, _), r in zip(runs, reqs, strict=True)}
    result = lane.replay_window(log, by_id, runs[3][0])
    assert result.steps.mismatch is None
    assert {rid: result.outputs[rid] for rid, _ in runs} == dict(runs)


def test_a_refused_lane_closing_leaves_the_other_engines_of_the_process_working(
    prod: StepDriver, lane: ScheduleLane
) -> None:
    """The replayer keeps its one-at-a-time engine beside schedule lanes; a lane that refuses closes its engine,
    and vLLM's own shutdown would tear down the parallel groups every in-process engine shares."""
    engine = prod.log().engine
    assert engine is not None
    assert engine.runtime is not None
    foreign = engine.model_copy(update={"runtime": engine.runtime.model_copy(update={"device_name": "another CPU"})})
    with pytest.raises(NotReplayableError, match="device_name"):
        ScheduleLane(ReplayerSettings(model_dir=model_dir()), foreign)
    reqs = [gen(p) for p in render_chat(model_dir(), PROMPTS[30:32])]
    runs = prod.run([(0, reqs[0]), (1, reqs[1])])  # production's engine still steps
    assert replay_all(lane, prod.log(), runs, reqs) == 2  # ... and so does the lane's
