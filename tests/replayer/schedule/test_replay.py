"""Which lane replays an envelope (issue 22), without a model: the schedule lane when the envelope names a
schedule that is found and complete, with the event saying whether the recorded shapes were reproduced (and the
first mismatching step); otherwise a reason, and the service falls back to its one-at-a-time lane.

The real lanes, the real recorder and the real store are in `test_schedule_replay_stack.py`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import pytest

from replayer.errors import NotReplayableError, ScheduleNotFoundError
from replayer.lane_choice import LaneChoice
from replayer.lanes.base import GenRequest
from replayer.matrix.explain import VariationOutcome, conclude, schedule_outcome
from replayer.schedule.lane import ScheduleReplay, StepCheck, StepMismatch
from replayer.schedule.replay import SCHEDULE_POLL_S, Companions, ScheduleReplayer
from replayer.schedule.store import ScheduleWindow
from replayer.settings import ReplayerSettings
from schemas import Envelope, ReplayedOutput, ReplayResult
from schemas.schedule import EngineStart, RequestArrival, ScheduleStep
from schemas.schedule_delivery import ScheduleRef, external_request_id_for
from schemas.schedule_log import ScheduleLog
from tests.replayer.support import LANE_FINGERPRINT, FakeLane, make_envelope
from tests.schedule_segments import FakeEngine

SETTINGS = ReplayerSettings()


def _scheduled(envelope: Envelope) -> Envelope:
    ref = ScheduleRef(
        external_request_id=external_request_id_for(envelope.endpoint, envelope.request_id), recorder="vllm-scheduler"
    )
    return envelope.model_copy(update={"schedule": ref})


def _window(envelope: Envelope, *, complete: bool = True) -> ScheduleWindow:
    assert envelope.prompt is not None
    engine = FakeEngine("eng-1")
    external = external_request_id_for(envelope.endpoint, envelope.request_id)
    engine.request(external, prompt_tokens=len(envelope.prompt.token_ids))
    engine.run()
    start, *records = engine.take()
    assert isinstance(start, EngineStart)
    return ScheduleWindow(
        engine=start,
        arrivals=tuple(r for r in records if isinstance(r, RequestArrival)),
        records=tuple(records),
        first_segment=0,
        last_segment=0,
        complete=complete,
        gap=None if complete else "the log ends at segment 0 of engine eng-1 before the request finished",
    )


@dataclass
class FakeStore:
    windows: dict[str, ScheduleWindow] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def records_for(self, envelope: Envelope, *, before_steps: int = 0) -> ScheduleWindow:
        self.asked.append(envelope.request_id)
        if envelope.request_id not in self.windows:
            raise ScheduleNotFoundError(f"no schedule is indexed under {envelope.request_id}")
        return self.windows[envelope.request_id]


def read(store: FakeStore, envelope: Envelope) -> ScheduleWindow:
    """The fake stores answer their windows as they are (`replayer.schedule.window` is tested on moto)."""
    return store.records_for(envelope)


@dataclass
class FakeScheduleLane:
    """Echoes the recorded output; `mismatch_at` makes the replayed shapes differ from that step on."""

    echo: FakeLane
    mismatch_at: int | None = None
    targets: list[str] = field(default_factory=list)
    asked: list[list[str]] = field(default_factory=list)  # the engine request ids each run replayed for real
    closed: bool = False
    periods: tuple[tuple[int, int], ...] = ()
    reused: tuple[tuple[int, int], ...] = ()

    def fingerprint(self) -> Any:
        return LANE_FINGERPRINT

    def replay_requests(self, log: ScheduleLog, requests: dict[str, GenRequest]) -> ScheduleReplay:
        assert log.problems() == []
        target = next(iter(requests))
        self.targets.append(target)
        self.asked.append(list(requests))
        outputs: dict[str, ReplayedOutput] = {rid: self.echo.replay(request) for rid, request in requests.items()}
        mismatch = (
            None
            if self.mismatch_at is None
            else StepMismatch(step=self.mismatch_at, recorded=(), replayed=(), reason="a filler was scheduled later")
        )
        return ScheduleReplay(
            output=outputs[target],
            outputs=outputs,
            steps=StepCheck(2, mismatch),
            periods=self.periods,
            reused=self.reused,
        )

    def close(self) -> None:
        self.closed = True


def _replayer(store: FakeStore, lane: FakeScheduleLane) -> ScheduleReplayer:
    return ScheduleReplayer(SETTINGS, store, lambda settings, engine: lane, read=read)  # type: ignore[arg-type, return-value]


def test_an_envelope_with_a_complete_schedule_replays_on_the_schedule_lane() -> None:
    envelope = _scheduled(make_envelope(1))
    echo = FakeLane()
    echo.learn(envelope)
    lane = FakeScheduleLane(echo)
    store = FakeStore({envelope.request_id: _window(envelope)})
    answer = _replayer(store, lane).replay(envelope)
    assert not isinstance(answer, str), answer
    assert answer.event.lane == "schedule"
    assert answer.event.schedule_reproduced is True
    assert answer.event.schedule_mismatch_step is None
    assert answer.event.verdict == "bitwise"
    assert "schedule lane: 2 recorded steps replayed with filler companions" in answer.event.cause_detail
    assert "busy periods" not in answer.event.cause_detail
    assert lane.targets == [store.windows[envelope.request_id].arrivals[0].engine_request_id]


def test_the_event_names_the_busy_periods_a_replay_ran() -> None:
    """A replay that ran its prefix-cache provider's busy period first says which recorded steps it ran."""
    envelope = _scheduled(make_envelope(2))
    echo = FakeLane()
    echo.learn(envelope)
    lane = FakeScheduleLane(echo, periods=((0, 4), (880, 910)))
    answer = _replayer(FakeStore({envelope.request_id: _window(envelope)}), lane).replay(envelope)
    assert not isinstance(answer, str), answer
    assert "(busy periods 0-4, 880-910: its cache's, then its own)" in answer.event.cause_detail
    assert "kept from an earlier replay" not in answer.event.cause_detail


def test_the_event_names_the_busy_periods_whose_cache_an_earlier_replay_left() -> None:
    """A replay that read its provider's blocks from the cache an earlier replay left says so."""
    envelope = _scheduled(make_envelope(2))
    echo = FakeLane()
    echo.learn(envelope)
    lane = FakeScheduleLane(echo, periods=((0, 4), (880, 910)), reused=((0, 4),))
    answer = _replayer(FakeStore({envelope.request_id: _window(envelope)}), lane).replay(envelope)
    assert not isinstance(answer, str), answer
    assert "the cache of busy period(s) 0-4 kept from an earlier replay" in answer.event.cause_detail


def test_a_schedule_not_reproduced_names_the_first_mismatching_step() -> None:
    envelope = _scheduled(make_envelope(2))
    echo = FakeLane()
    echo.learn(envelope, diverge_at=1)
    lane = FakeScheduleLane(echo, mismatch_at=1)
    answer = _replayer(FakeStore({envelope.request_id: _window(envelope)}), lane).replay(envelope)
    assert not isinstance(answer, str)
    assert answer.event.schedule_reproduced is False
    assert answer.event.schedule_mismatch_step == 1
    assert "first mismatching step 1: a filler was scheduled later" in answer.event.cause_detail
    assert answer.event.verdict != "bitwise"


def test_no_schedule_not_found_or_incomplete_say_why() -> None:
    plain = make_envelope(3)
    missing = _scheduled(make_envelope(4))
    partial = _scheduled(make_envelope(5))
    lane = FakeScheduleLane(FakeLane())
    store = FakeStore({partial.request_id: _window(partial, complete=False)})
    replayer = _replayer(store, lane)
    assert "names no schedule" in str(replayer.replay(plain))
    assert "no schedule is indexed" in str(replayer.replay(missing))
    assert "incomplete: the log ends at segment 0" in str(replayer.replay(partial))
    assert lane.targets == []
    assert store.asked == [missing.request_id, partial.request_id]


def test_the_lane_choice_falls_back_to_its_lane_when_the_schedule_lane_is_not_used() -> None:
    """`LaneChoice`, the one choice of every entry point (the service, the CLI, explain): the schedule lane when
    the schedule is there, else the one-at-a-time lane; ``schedule`` asked for without one is no verdict."""
    scheduled = _scheduled(make_envelope(6))
    missing = _scheduled(make_envelope(7))
    echo = FakeLane()
    echo.learn(scheduled)
    echo.learn(missing)
    said: list[str] = []
    schedule = _replayer(FakeStore({scheduled.request_id: _window(scheduled)}), FakeScheduleLane(echo))
    choice = LaneChoice(SETTINGS, lambda: echo, schedule, say=said.append)
    assert choice.replay(scheduled).result.event.lane == "schedule"
    assert choice.lanes() == [("schedule", echo.fingerprint().sha256())]  # the one-at-a-time lane not made yet
    fallback = choice.replay(missing).result.event
    assert fallback.lane == "fake"
    assert fallback.schedule_reproduced is None
    (line,) = said
    assert line.startswith(f"schedule lane not used for {missing.request_id}: ")
    with pytest.raises(NotReplayableError, match=f"the schedule lane cannot replay {missing.request_id}: "):
        choice.replay(missing, lane="schedule")
    with pytest.raises(NotReplayableError, match="lane 'remote' is not served here"):
        choice.replay(scheduled, lane="remote")


@dataclass
class ShippedLater(FakeStore):
    """Not found, then incomplete, then complete: a window while the shipper catches up."""

    answers: list[str] = field(default_factory=lambda: ["missing", "partial", "complete"])

    def records_for(self, envelope: Envelope, *, before_steps: int = 0) -> ScheduleWindow:
        self.asked.append(envelope.request_id)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if answer == "missing":
            raise ScheduleNotFoundError(f"no schedule is indexed under {envelope.request_id}")
        return _window(envelope, complete=answer == "complete")


def test_a_schedule_not_shipped_yet_is_waited_for_until_schedule_wait_s_after_capture() -> None:
    envelope = _scheduled(make_envelope(10))
    echo = FakeLane()
    echo.learn(envelope)
    clock = [envelope.captured_at]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += timedelta(seconds=seconds)

    def replayer(store: FakeStore, lane: FakeScheduleLane) -> ScheduleReplayer:
        return ScheduleReplayer(
            SETTINGS,
            store,
            lambda s, e: lane,
            now=lambda: clock[0],
            sleep=sleep,  # type: ignore[arg-type, return-value]
            read=read,  # type: ignore[arg-type]
        )

    lane = FakeScheduleLane(echo)
    answer = replayer(ShippedLater(), lane).replay(envelope)
    assert not isinstance(answer, str), answer
    assert answer.event.lane == "schedule"
    assert slept == [SCHEDULE_POLL_S, SCHEDULE_POLL_S]

    never = ShippedLater(answers=["partial"])  # the shipper is down: give up schedule_wait_s after the capture
    clock[0], slept[:] = envelope.captured_at, []
    assert "incomplete" in str(replayer(never, lane).replay(envelope))
    assert sum(slept) == pytest.approx(SETTINGS.schedule_wait_s, abs=SCHEDULE_POLL_S)


def test_a_lane_that_refused_is_not_started_again_for_every_envelope() -> None:
    envelopes = [_scheduled(make_envelope(i)) for i in (11, 12)]
    started: list[str] = []

    def refusing(settings: ReplayerSettings, engine: EngineStart) -> Any:
        started.append(engine.engine_id)
        raise NotReplayableError("the schedule lane's runtime differs in numerics: num_threads: 1 != 2")

    replayer = ScheduleReplayer(
        SETTINGS,
        FakeStore({e.request_id: _window(e) for e in envelopes}),  # type: ignore[arg-type]
        refusing,
        read=read,  # type: ignore[arg-type]
    )
    answers = [replayer.replay(e) for e in envelopes]
    assert all("num_threads: 1 != 2" in str(a) for a in answers)
    assert len(started) == 1


def test_a_result_the_schedule_lane_already_stored_is_answered_not_replayed_again() -> None:
    """A redelivered envelope: the service looks its result up under its own lane's fingerprint, which is not the
    schedule lane's; the schedule replayer looks it up under the schedule lane's."""
    envelope = _scheduled(make_envelope(9))
    echo = FakeLane()
    echo.learn(envelope)
    lane = FakeScheduleLane(echo)
    replayer = _replayer(FakeStore({envelope.request_id: _window(envelope)}), lane)
    first = replayer.replay(envelope)
    assert not isinstance(first, str)
    asked: list[str] = []

    def stored(env: Envelope, fingerprint_sha256: str) -> Any:
        asked.append(fingerprint_sha256)
        return first if fingerprint_sha256 == first.event.lane_fingerprint_sha256 else None

    assert replayer.replay(envelope, stored=stored) is first
    assert asked == [LANE_FINGERPRINT.sha256()]
    assert len(lane.targets) == 1  # replayed once


def test_explain_attributes_a_fork_reproduced_bitwise_on_the_schedule_to_batching() -> None:
    envelope = _scheduled(make_envelope(8))
    echo = FakeLane()
    echo.learn(envelope)
    answer = _replayer(FakeStore({envelope.request_id: _window(envelope)}), FakeScheduleLane(echo)).replay(envelope)
    assert not isinstance(answer, str)
    alone = VariationOutcome(
        name="alone", dimension="schedule", description="one at a time", engine="vllm", status="ran",
        reproduced=False, verdict="diverged", first_divergence=1,
    )  # fmt: skip
    hits, text = conclude([alone, schedule_outcome(answer)])
    assert hits == ("schedule",)
    assert text.startswith("attributed to batching")
    assert "while alone it is diverged" in text
    assert "Evidence: the schedule replay (" in text
    assert "2 recorded steps replayed" in text
    # not reproduced step for step: no attribution, whatever the tokens
    unreproduced = _replayer(
        FakeStore({envelope.request_id: _window(envelope)}), FakeScheduleLane(echo, mismatch_at=0)
    ).replay(envelope)
    assert not isinstance(unreproduced, str)
    hits, text = conclude([alone, schedule_outcome(unreproduced)])
    assert hits == ()
    skipped = schedule_outcome("the envelope names no schedule")
    assert skipped.status == "skipped"
    assert skipped.reason == "the envelope names no schedule"


@dataclass
class ChoicesLane(FakeScheduleLane):
    """Answers every choice of an ``n > 1`` replay: the recorded choice i, or (``fork``) choice 1 forked at token 1;
    records each choice's seed and budget."""

    fork: bool = False
    seeds: dict[str, int | None] = field(default_factory=dict)
    recorded: tuple[ReplayedOutput, ...] = ()

    def replay_requests(self, log: ScheduleLog, requests: dict[str, GenRequest]) -> ScheduleReplay:
        outputs = {}
        for i, (rid, request) in enumerate(requests.items()):
            self.seeds[rid] = request.sampling.seed
            out = self.recorded[i]
            if self.fork and i == 1:
                out = out.model_copy(update={"token_ids": (out.token_ids[0], 7, *out.token_ids[2:]), "logprobs": None})
            outputs[rid] = out
        first = next(iter(outputs.values()))
        return ScheduleReplay(output=first, outputs=outputs, steps=StepCheck(3))


def _two_choices() -> tuple[Envelope, ScheduleWindow, tuple[ReplayedOutput, ...]]:
    """A seeded sampled request with n = 2 and its window: one engine request per choice (``<i>_<id>``)."""
    from schemas import CapturedOutput, SamplingContract

    base = make_envelope(3)
    assert isinstance(base.outcome, CapturedOutput)
    first = base.outcome.choices[0]
    second = first.model_copy(update={"index": 1})
    sampling = SamplingContract(temperature=0.8, seed=40, seed_scope="per_request", n=2, max_tokens=16, logprobs=5)
    outcome = base.outcome.model_copy(update={"choices": (first, second)})
    envelope = _scheduled(base.model_copy(update={"sampling": sampling, "outcome": outcome}))
    assert envelope.prompt is not None
    engine = FakeEngine("eng-1")
    external = external_request_id_for(envelope.endpoint, envelope.request_id)
    for i in range(2):
        engine.request(f"{i}_{external}", prompt_tokens=len(envelope.prompt.token_ids))
    engine.run()
    start, *records = engine.take()
    assert isinstance(start, EngineStart)
    arrivals = tuple(r for r in records if isinstance(r, RequestArrival))
    window = ScheduleWindow(start, arrivals, tuple(records), 0, 0, complete=True)
    replayed = tuple(
        ReplayedOutput(token_ids=c.token_ids, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason)
        for c in (first, second)
    )
    return envelope, window, replayed


def test_every_choice_of_a_request_with_n_2_is_replayed_with_its_own_seed_and_checked() -> None:
    envelope, window, replayed = _two_choices()
    lane = ChoicesLane(FakeLane(), recorded=replayed)
    answer = _replayer(FakeStore({envelope.request_id: window}), lane).replay(envelope)
    assert not isinstance(answer, str), answer
    event = answer.event
    assert event.choices is not None
    assert [(c.index, c.verdict) for c in event.choices] == [(0, "bitwise"), (1, "bitwise")]
    assert (event.verdict, event.divergent_choice, event.target_met) == ("bitwise", None, True)
    assert sorted(lane.seeds.values()) == [40, 41]  # vLLM seeds choice i with seed + i
    assert "only choice 0" not in event.cause_detail


def test_the_first_divergent_choice_is_named_and_sets_the_events_verdict() -> None:
    envelope, window, replayed = _two_choices()
    lane = ChoicesLane(FakeLane(), recorded=replayed, fork=True)
    answer = _replayer(FakeStore({envelope.request_id: window}), lane).replay(envelope)
    assert not isinstance(answer, str), answer
    event = answer.event
    assert event.choices is not None
    assert event.choices[0].verdict == "bitwise"
    assert event.choices[1].verdict != "bitwise"
    assert event.choices[1].first_divergence == 1
    assert event.divergent_choice == 1
    assert event.verdict == event.choices[1].verdict
    assert event.first_divergence is not None
    assert event.first_divergence.position == 1
    assert event.cause_detail.startswith("choice 1 of n=2: ")
    assert not event.target_met


def _period() -> tuple[list[Envelope], dict[str, ScheduleWindow]]:
    """Three captured requests of one busy period (a, b, c arrive together; c runs longest) and each one's window
    as the store reads it: the period from its start to where that request finished."""
    envelopes = [_scheduled(make_envelope(i)) for i in range(3)]
    engine = FakeEngine("eng-1")
    for envelope, length in zip(envelopes, (3, 3, 6), strict=True):
        assert envelope.prompt is not None
        external = external_request_id_for(envelope.endpoint, envelope.request_id)
        engine.request(external, prompt_tokens=len(envelope.prompt.token_ids), output_tokens=length)
    engine.run()
    start, *records = engine.take()
    assert isinstance(start, EngineStart)
    arrivals = [r for r in records if isinstance(r, RequestArrival)]
    windows = {}
    for envelope, arrival in zip(envelopes, arrivals, strict=True):
        end = next(r.step for r in records if isinstance(r, ScheduleStep) and arrival.engine_request_id in r.finished)
        cut = tuple(r for r in records if not isinstance(r, EngineStart) and r.step <= end)
        windows[envelope.request_id] = ScheduleWindow(start, (arrival,), cut, 0, 0, complete=True)
    return envelopes, windows


def test_a_busy_period_is_replayed_once_for_every_captured_request_without_a_result() -> None:
    """Issue 32: the first envelope of a period replays the period once, with the real content of every captured
    companion not verified yet, reaching as far as the longest one ran; each gets its result, kept."""
    (a, b, c), windows = _period()
    echo = FakeLane()
    for envelope in (a, b, c):
        echo.learn(envelope)
    lane = FakeScheduleLane(echo)
    kept: list[tuple[str, str]] = []
    companions = Companions(
        load={e.request_id: e for e in (a, b, c)}.get,
        keep=lambda envelope, result: kept.append((envelope.request_id, result.event.verdict)),
    )
    verified = cast(ReplayResult, object())  # b's result on this lane, stored before

    def stored(envelope: Envelope, fingerprint_sha256: str) -> ReplayResult | None:
        return verified if envelope.request_id == b.request_id else None

    answer = _replayer(FakeStore(windows), lane).replay(a, stored=stored, companions=companions)
    assert not isinstance(answer, str), answer
    assert len(lane.targets) == 1  # one run of the lane for the period
    assert lane.asked == [[windows[a.request_id].arrivals[0].engine_request_id,
                           windows[c.request_id].arrivals[0].engine_request_id]]  # fmt: skip
    assert kept == [(c.request_id, "bitwise")]  # b was verified before: a filler now, no second result
    assert answer.event.verdict == "bitwise"
    assert "replayed once for 2 captured requests of the busy period" in answer.event.cause_detail


def test_without_companions_every_other_request_of_the_period_is_a_filler() -> None:
    (a, _, _), windows = _period()
    echo = FakeLane()
    echo.learn(a)
    lane = FakeScheduleLane(echo)
    answer = _replayer(FakeStore(windows), lane).replay(a)
    assert not isinstance(answer, str), answer
    assert lane.asked == [[windows[a.request_id].arrivals[0].engine_request_id]]
    assert "replayed with filler companions" in answer.event.cause_detail


def test_an_engine_request_named_after_a_captured_request_but_not_indexed_as_its_own_stays_a_filler() -> None:
    """Anyone who reaches the engine directly can send a request whose id names a captured request: a member is
    only a request whose own index entries give the engine requests the log's ids point at."""
    (a, b, c), windows = _period()
    echo = FakeLane()
    for envelope in (a, b, c):
        echo.learn(envelope)
    lane = FakeScheduleLane(echo)
    for rid in (b.request_id, c.request_id):  # their index entries name other engine requests than the log's
        own = windows[rid]
        other = own.arrivals[0].model_copy(update={"engine_request_id": own.arrivals[0].engine_request_id + "x"})
        windows[rid] = dataclasses.replace(own, arrivals=(other,))
    kept: list[str] = []
    companions = Companions({e.request_id: e for e in (a, b, c)}.get, lambda e, r: kept.append(e.request_id))
    answer = _replayer(FakeStore(windows), lane).replay(a, companions=companions)
    assert not isinstance(answer, str), answer
    assert lane.asked == [[windows[a.request_id].arrivals[0].engine_request_id]]
    assert kept == []


def test_the_period_is_followed_through_companions_that_arrived_after_the_envelope_finished() -> None:
    """a finishes at step 2; c runs on, and d arrives at step 4 while c still runs (one period): a's window does not
    name d, c's does, so the period is replayed once, as far as d ran, for all three."""
    a, c, d = (_scheduled(make_envelope(i)) for i in range(3))
    engine = FakeEngine("eng-1")

    def arrive(envelope: Envelope, length: int) -> str:
        assert envelope.prompt is not None
        external = external_request_id_for(envelope.endpoint, envelope.request_id)
        return engine.request(external, prompt_tokens=len(envelope.prompt.token_ids), output_tokens=length)

    ids = [arrive(a, 3), arrive(c, 6)]
    for _ in range(4):
        engine.step()
    ids.append(arrive(d, 6))
    engine.run()
    start, *records = engine.take()
    assert isinstance(start, EngineStart)
    windows = {}
    for envelope, rid in zip((a, c, d), ids, strict=True):
        end = next(r.step for r in records if isinstance(r, ScheduleStep) and rid in r.finished)
        cut = tuple(r for r in records if not isinstance(r, EngineStart) and r.step <= end)
        arrival = next(r for r in records if isinstance(r, RequestArrival) and r.engine_request_id == rid)
        windows[envelope.request_id] = ScheduleWindow(start, (arrival,), cut, 0, 0, complete=True)
    assert not any(
        r.engine_request_id == ids[2] for r in windows[a.request_id].records if isinstance(r, RequestArrival)
    )
    echo = FakeLane()
    for envelope in (a, c, d):
        echo.learn(envelope)
    lane = FakeScheduleLane(echo)
    kept: list[str] = []
    companions = Companions({e.request_id: e for e in (a, c, d)}.get, lambda e, r: kept.append(e.request_id))
    answer = _replayer(FakeStore(windows), lane).replay(a, companions=companions)
    assert not isinstance(answer, str), answer
    assert lane.asked == [ids]
    assert sorted(kept) == sorted([c.request_id, d.request_id])
