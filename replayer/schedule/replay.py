"""One envelope replayed inside the batches it ran in: its schedule window on the schedule lane.

`replayer.schedule.window.read_window` gives the part of the production engine's log the envelope's replay needs
(its busy period and the prefix-cache providers' periods); this module turns it into the lane's
`schemas.schedule_log.ScheduleLog`, replays the envelope's engine requests (every choice) as targets
(`replayer.schedule.lane.ScheduleLane.replay_requests`: fillers of the recorded shapes stand in for every
companion) and compares each with the capture exactly as every other lane's replay is compared
(`replayer.replay.replay_envelope`), so a schedule replay's event is the same contract with two more fields:
whether every replayed step had the recorded shapes, and the first step that did not.

A busy period replayed once for all its captured requests (`replay_unit=busy_period`, issue 32): the same run with
the real content of every member (`period_members`, `ScheduleReplayer._period`) and one result per request
(`replay_period_on_schedule`, `Companions`).

A window that is not complete (a segment not shipped yet, a finish the log does not reach) is not replayed here:
`NotReplayableError` says what the log lacks, and the caller falls back to the one-at-a-time lane. The service
consumes an envelope a moment after its capture, before the recorder's segment holding its last step has been
shipped, so `ScheduleReplayer` looks again until ``schedule_wait_s`` after the capture.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from replayer.compare import Comparison, compare
from replayer.errors import LaneUnavailableError, NotReplayableError, ScheduleNotFoundError, StoreError
from replayer.lanes.base import GenRequest
from replayer.replay import FROM_COMPARISON, gen_request, replay_budget, replay_envelope, server_view
from replayer.schedule.plan import check_target
from replayer.settings import ReplayerSettings
from schemas import (
    CapturedOutput,
    Choice,
    ChoiceCheck,
    DivergenceEvent,
    Envelope,
    FirstDivergence,
    ReplayedOutput,
    ReplayResult,
    RuntimeFingerprint,
)
from schemas.replay import CauseHint, Verdict
from schemas.schedule import EngineStart, RequestArrival
from schemas.schedule_delivery import choice_index, external_request_id, request_id_of
from schemas.schedule_log import ScheduleLog

if TYPE_CHECKING:
    from replayer.schedule.lane import ScheduleLane, ScheduleReplay
    from replayer.schedule.store import ScheduleStore, ScheduleWindow

__all__ = ["ScheduleReplayer", "period_members", "replay_on_schedule", "replay_period_on_schedule", "window_log"]


def window_log(window: ScheduleWindow) -> ScheduleLog:
    """The lane's view of a window: the engine's settings, then its arrivals and steps in log order."""
    if window.engine is None:
        raise NotReplayableError("the schedule window has no engine record (segment 0 of the engine is missing)")
    return ScheduleLog.from_records([window.engine, *window.records], covered=window.ranges)


class _Answered:
    """The `replayer.lanes.base.Lane` face of an output a schedule replay already produced, so `replay_envelope`
    compares it as it compares every lane's (the request it is handed was the one replayed: `gen_request`)."""

    name = "schedule"

    def __init__(self, lane: ScheduleLane, output: ReplayedOutput) -> None:
        self._lane, self._output = lane, output

    def fingerprint(self) -> RuntimeFingerprint:
        return self._lane.fingerprint()

    def replay(self, request: GenRequest) -> ReplayedOutput:
        return self._output

    def close(self) -> None:  # the schedule lane outlives one replay
        return None


def choice_request(envelope: Envelope, first: GenRequest, index: int) -> GenRequest:
    """Choice ``index``'s request, from choice 0's: its seed (the request's + ``index``, as vLLM's parallel sampling
    seeds its children) and its own length budget (`replayer.replay.replay_budget` of its recorded choice)."""
    if index == 0:
        return first
    sampling = first.sampling
    if sampling.seed is not None:
        sampling = sampling.model_copy(update={"seed": sampling.seed + index})
    recorded = _recorded_choice(envelope, index)
    max_tokens, _ = replay_budget(first.sampling, recorded)
    return dataclasses.replace(first, sampling=sampling, max_tokens=max_tokens)


def _recorded_choice(envelope: Envelope, index: int) -> Choice:
    outcome = envelope.outcome
    choices = [c for c in outcome.choices if c.index == index] if isinstance(outcome, CapturedOutput) else []
    if not choices:
        raise NotReplayableError(f"{envelope.request_id}: the recorded output has no choice {index}")
    return choices[0]


def _choice_targets(envelope: Envelope, arrivals: Sequence[RequestArrival]) -> dict[int, str]:
    """The engine request of each choice (by index) among the envelope's ``arrivals`` (in log order): one per
    choice of a request with ``n > 1`` (vLLM's ``<i>_`` children), else the first arrival; a log that lacks a
    choice is refused."""
    if not arrivals:
        raise NotReplayableError(f"the schedule log has no engine request of {envelope.request_id}")
    sampling = envelope.sampling
    n = sampling.n if sampling is not None and not envelope.more_prompts else 1
    if n == 1:
        return {0: arrivals[0].engine_request_id}
    targets = {choice_index(a.engine_request_id): a.engine_request_id for a in arrivals}
    missing = [i for i in range(n) if i not in targets]
    if missing:
        raise NotReplayableError(f"the schedule log has no engine request for choice(s) {missing} of n={n}")
    return {i: targets[i] for i in range(n)}


def _every_choice(
    envelope: Envelope,
    targets: dict[int, str],
    replay: ScheduleReplay,
    event: DivergenceEvent,
    settings: ReplayerSettings,
) -> dict[str, Any]:
    """The event's fields for a request whose every choice was replayed: each choice's check (choice 0's is the
    event's own), the first divergent choice, and the event's comparison fields from the choice that held the
    fewest levels when that is not choice 0."""
    sampling = envelope.sampling
    assert sampling is not None  # replay_envelope refused an envelope without one
    checks = [
        _check(0, event.verdict, event.target_met, event.first_divergence, event.token_match_rate, event.cause_hint)
    ]
    worst: tuple[int, Comparison] | None = None
    for index in sorted(targets)[1:]:
        recorded = _recorded_choice(envelope, index)
        k = replay_budget(sampling, recorded)[1]
        replayed = server_view(replay.outputs[targets[index]], envelope.endpoint, k)
        c = compare(
            recorded, replayed, settings.thresholds, envelope.target_level, fingerprint_diffs=event.fingerprint_diffs
        )
        checks.append(
            _check(
                index,
                c.verdict,
                c.target_met and not sampling.unseeded,
                c.first_divergence,
                c.token_match_rate,
                c.cause_hint,
            )
        )
        fewest = len(worst[1].levels_held) if worst is not None else len(event.levels_held)
        if len(c.levels_held) < fewest:
            worst = (index, c)
    fields: dict[str, Any] = {
        "choices": tuple(checks),
        "divergent_choice": next((c.index for c in checks if c.verdict != "bitwise"), None),
        "target_met": all(c.target_met for c in checks),
    }
    if worst is not None:
        index, comparison = worst
        fields.update({name: getattr(comparison, name) for name in FROM_COMPARISON})
        fields["cause_detail"] = f"choice {index} of n={sampling.n}: {comparison.cause_detail}"
    return fields


def _check(
    index: int, verdict: Verdict, met: bool, first: FirstDivergence | None, match: float, hint: CauseHint
) -> ChoiceCheck:
    position = first.position if first is not None else None
    return ChoiceCheck(
        index=index, verdict=verdict, target_met=met, first_divergence=position, token_match_rate=match, cause_hint=hint
    )


def period_members(window: ScheduleWindow, *, finished: bool = True) -> dict[str, tuple[RequestArrival, ...]]:
    """The other captured requests of the target's busy period that finished inside ``window`` (``finished=False``:
    that arrived in it): their request id (`schemas.schedule_delivery.request_id_of` of their engine requests'
    external id) and their engine requests (every choice), for `replay_period_on_schedule` to replay with their real
    content. A request sent to the engine without the sidecar's id, or one still running where the window ends, is
    left to the fillers."""
    log = window_log(window)
    own = {a.engine_request_id for a in window.arrivals}
    first = min(a.step for a in window.arrivals)
    spans = window.ranges or ((min(log.steps, default=first), max(log.steps, default=first)),)
    low, high = next(((lo, hi) for lo, hi in spans if lo <= first <= hi), spans[-1])
    found: dict[str, list[RequestArrival]] = {}
    for arrival in log.arrivals.values():
        if arrival.engine_request_id in own or not low <= arrival.step <= high:
            continue
        request_id = request_id_of(external_request_id(arrival.engine_request_id))
        if request_id is not None:
            found.setdefault(request_id, []).append(arrival)
    return {
        rid: tuple(sorted(arrivals, key=lambda a: (a.step, a.engine_request_id)))
        for rid, arrivals in found.items()
        if not finished
        or all(
            (shape := log.requests.get(a.engine_request_id)) is not None and shape.finished_at is not None
            for a in arrivals
        )
    }


def replay_on_schedule(
    envelope: Envelope,
    window: ScheduleWindow,
    lane: ScheduleLane,
    settings: ReplayerSettings,
    *,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    reply_to: str | None = None,
) -> tuple[ReplayResult, ScheduleReplay]:
    """Replay `envelope` under its recorded schedule (every choice of a request with ``n > 1``, each compared with
    its recorded choice), fillers for every companion; the result's event names the schedule lane and says
    whether the schedule was reproduced (and the first mismatching step when not)."""
    results, replay = replay_period_on_schedule(envelope, window, lane, settings, {}, now=now, reply_to=reply_to)
    return results[envelope.request_id], replay


def replay_period_on_schedule(
    envelope: Envelope,
    window: ScheduleWindow,
    lane: ScheduleLane,
    settings: ReplayerSettings,
    members: Mapping[str, tuple[Envelope, tuple[RequestArrival, ...]]],
    *,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
    reply_to: str | None = None,
) -> tuple[dict[str, ReplayResult], ScheduleReplay]:
    """Replay `envelope` and its busy period's captured ``members`` (`period_members`, each with its envelope) in
    one run, each with its real content (fillers for the rest of the window), and compare each with its capture:
    one result per request, by request id (``reply_to`` on `envelope`'s only). A member that cannot be replayed
    (`gen_request` refuses it, or the log lacks a choice of it) stays a filler and gets no result here: its own
    replay says why."""
    if not window.complete:
        raise NotReplayableError(f"the schedule log of {envelope.request_id} is incomplete: {window.gap}")
    log = window_log(window)
    lane_fp = lane.fingerprint()
    entries = [(envelope, _choice_targets(envelope, window.arrivals), gen_request(envelope, lane_fp, settings))]
    for member, arrivals in members.values():
        try:
            targets = _choice_targets(member, arrivals)
            first = gen_request(member, lane_fp, settings)
            for rid in targets.values():
                check_target(log, rid, len(first.prompt_token_ids))
        except (NotReplayableError, KeyError, ValueError):
            continue
        entries.append((member, targets, first))
    requests = {
        rid: choice_request(env, first, i) for env, targets, first in entries for i, rid in sorted(targets.items())
    }
    started = time.perf_counter()
    replay = lane.replay_requests(log, requests)
    replay_ms = (time.perf_counter() - started) * 1e3
    detail = _detail(replay, shared=len(entries))
    results: dict[str, ReplayResult] = {}
    for env, targets, _ in entries:
        output = replay.outputs.get(targets[0])
        if output is None:
            if env is envelope:
                raise NotReplayableError(f"the schedule replay of {targets[0]} produced no output")
            continue
        result = replay_envelope(
            env,
            _Answered(lane, output),
            settings,
            now=now,
            reply_to=reply_to if env is envelope else None,
            every_choice=len(targets) > 1,
        )
        update: dict[str, Any] = {"replay_ms": replay_ms}
        if len(targets) > 1:
            update |= _every_choice(env, targets, replay, result.event, settings)
        update |= {
            "schedule_reproduced": replay.schedule_reproduced,
            "schedule_mismatch_step": replay.steps.mismatch.step if replay.steps.mismatch else None,
            "cause_detail": "; ".join(x for x in (update.get("cause_detail", result.event.cause_detail), detail) if x),
        }
        results[env.request_id] = result.model_copy(update={"event": result.event.model_copy(update=update)})
    return results, replay


def _end(window: ScheduleWindow) -> int:
    """The last step a window's records reach."""
    return max((r.step for r in window.records if not isinstance(r, EngineStart)), default=-1)


def _detail(replay: ScheduleReplay, *, shared: int = 1) -> str:
    """The event's words for a schedule replay (``shared``: the requests it replayed with their real content):
    what ran, or why the schedule was not reproduced."""
    if not replay.schedule_reproduced:
        mismatch = replay.steps.mismatch
        return (
            "schedule lane: the recorded schedule was not reproduced"
            + (f" (first mismatching step {mismatch.step}: {mismatch.reason})" if mismatch else "")
            + "".join(f"; {n}" for n in replay.notes)
        )
    ran = f"schedule lane: {replay.steps.compared} recorded steps replayed with filler companions"
    if shared > 1:
        ran = (
            f"schedule lane: {replay.steps.compared} recorded steps replayed once for {shared} captured requests "
            f"of the busy period (their real content) and {len(replay.fillers)} filler companion(s)"
        )
    if len(replay.periods) > 1:  # the prefix-cache providers' busy periods ran first
        ran += " (busy periods " + ", ".join(f"{a}-{b}" for a, b in replay.periods) + ": its cache's, then its own)"
    if replay.reused:  # an earlier replay ran them: their prefix cache was read, not computed again
        ran += "; the cache of busy period(s) " + ", ".join(f"{a}-{b}" for a, b in replay.reused)
        ran += " kept from an earlier replay"
    return ran


@dataclass(frozen=True)
class Companions:
    """How a busy-period replay reaches the other captured requests of the period (`ScheduleReplayer.replay`):
    ``load`` a request's envelope by request id (None: not captured, or not readable here), ``keep`` a member's
    result where the console and evidence read it."""

    load: Callable[[str], Envelope | None]
    keep: Callable[[Envelope, ReplayResult], None]


#: How often a schedule not shipped yet is looked for again (within ``schedule_wait_s`` of the capture).
SCHEDULE_POLL_S: Final = 0.5


class ScheduleReplayer:
    """Picks the schedule lane for an envelope whose schedule is named, found and complete (module docstring).

    `replay` answers the result, or the reason the schedule lane was not used (the caller then replays on its
    one-at-a-time lane, whose event carries the fingerprint differences). One schedule lane is kept per
    production engine's settings: loading one takes a while.
    """

    def __init__(
        self,
        settings: ReplayerSettings,
        store: ScheduleStore | None = None,
        lane_factory: Callable[[ReplayerSettings, EngineStart], ScheduleLane] | None = None,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        sleep: Callable[[float], None] = time.sleep,
        read: Callable[[ScheduleStore, Envelope], ScheduleWindow] | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._read = read  # None: `replayer.schedule.window.read_window`
        self._lane_factory = lane_factory
        self._lanes: dict[str, ScheduleLane] = {}
        self._fingerprints: dict[str, str] = {}  # the lanes' fingerprints' sha256, read by another thread (`lanes`)
        self._refused: dict[str, NotReplayableError] = {}
        self._now, self._sleep = now, sleep

    def _window(self, store: ScheduleStore, envelope: Envelope) -> ScheduleWindow:
        """The envelope's window, looked for again while it is not shipped yet (not found, or the log ends before
        the request finished) and the capture is younger than ``schedule_wait_s``."""
        deadline = envelope.captured_at + timedelta(seconds=self.settings.schedule_wait_s)
        while True:
            try:
                window = self._read_window(store, envelope)
            except ScheduleNotFoundError:
                if self._now() >= deadline:
                    raise
            else:
                if window.complete or self._now() >= deadline:
                    return window
            self._sleep(SCHEDULE_POLL_S)

    def _lane(self, engine: EngineStart) -> ScheduleLane:
        """The lane for ``engine``'s settings; a lane that refused (its runtime differs in numerics) is not
        started again for every envelope of that engine: the refusal is kept and raised."""
        key = engine.model_dump_json(exclude={"engine_id", "at", "started_at"})
        if key in self._refused:
            raise self._refused[key]
        lane = self._lanes.get(key)
        if lane is None:
            try:
                if self._lane_factory is None:
                    from replayer.schedule.lane import ScheduleLane

                    lane = ScheduleLane(self.settings, engine)
                else:
                    lane = self._lane_factory(self.settings, engine)
            except NotReplayableError as exc:
                self._refused[key] = exc
                raise
            self._fingerprints[key] = lane.fingerprint().sha256()
            self._lanes[key] = lane
        return lane

    def lanes(self) -> tuple[str, ...]:
        """The fingerprints' sha256 of the schedule lanes built so far, oldest first (what the service advertises
        in its heartbeat); safe to call from another thread while a replay runs."""
        return tuple(self._fingerprints.copy().values())

    def find(self, envelope: Envelope) -> ScheduleWindow | str:
        """The envelope's window, waited for while it is not shipped yet (`_window`), or why there is none. It
        touches no lane: the service looks before it takes its lane, so an envelope waiting for its schedule does
        not hold up the replays behind it."""
        if envelope.schedule is None:
            return "the envelope names no schedule (its upstream did not record one)"
        if (adapter := envelope.artifacts.adapter_name) is not None:
            return f"the schedule lane does not load LoRA adapters (artifacts.adapter_name {adapter!r})"
        if self._store is None:
            from replayer.schedule.store import ScheduleStore

            self._store = ScheduleStore.from_settings(self.settings)
        try:
            window = self._window(self._store, envelope)
        except (NotReplayableError, StoreError, LaneUnavailableError) as exc:  # ScheduleNotFoundError included
            return str(exc)
        return "the schedule log has no engine record" if window.engine is None else window

    def replay(
        self,
        envelope: Envelope,
        *,
        reply_to: str | None = None,
        stored: Callable[[Envelope, str], ReplayResult | None] | None = None,
        window: ScheduleWindow | str | None = None,
        companions: Companions | None = None,
    ) -> ReplayResult | str:
        """The schedule lane's result, or why it was not used (no schedule, not found, incomplete, refused).

        ``window``: what `find` answered, when the caller looked already (None: look now). ``stored(envelope,
        lane fingerprint sha256)`` is the result store's lookup: a result this schedule lane already stored for the
        envelope is answered as it is, not replayed again (the service's idempotence key is the lane's fingerprint,
        and only here is the schedule lane's known). With ``companions``, the envelope's busy period is replayed
        once for every captured request of it that has no result on this lane yet (`_period`), and their results
        are handed to ``companions.keep``."""
        found = self.find(envelope) if window is None else window
        if isinstance(found, str):
            return found
        try:
            assert found.engine is not None  # find answers a reason for a window without one
            lane = self._lane(found.engine)
            fingerprint_sha256 = lane.fingerprint().sha256()
            if stored is not None and (done := stored(envelope, fingerprint_sha256)) is not None:
                return done
            if companions is None:
                result, _ = replay_on_schedule(envelope, found, lane, self.settings, reply_to=reply_to)
                return result
            lead, members = self._period(envelope, found, fingerprint_sha256, stored, companions)
            results, _ = replay_period_on_schedule(envelope, lead, lane, self.settings, members, reply_to=reply_to)
        except (NotReplayableError, StoreError, LaneUnavailableError) as exc:
            return str(exc)
        for member, _arrivals in members.values():
            if (done := results.get(member.request_id)) is not None:
                companions.keep(member, done)
        return results[envelope.request_id]

    def _period(
        self,
        envelope: Envelope,
        window: ScheduleWindow,
        fingerprint_sha256: str,
        stored: Callable[[Envelope, str], ReplayResult | None] | None,
        companions: Companions,
    ) -> tuple[ScheduleWindow, dict[str, tuple[Envelope, tuple[RequestArrival, ...]]]]:
        """The window to replay `envelope`'s busy period in and the captured members to replay with it.

        The envelope's own window ends where it finished; a companion captured since may have run on after it, and
        its window names the requests that arrived meanwhile. So each captured companion's window is read (the
        segments are cached), those it names in turn, and the one reaching furthest is replayed, `envelope`'s
        arrivals as its target, with every captured companion that finished inside it and has no result on this
        lane yet. A member is a request whose own index entries name exactly the engine
        requests the log's ids point at (anyone who can reach the engine directly can name an engine request after
        a captured request's id; such a one stays a filler). A companion whose window cannot be read is not one."""
        store = self._store
        assert store is not None  # find set it
        indexed: dict[str, tuple[Envelope, ScheduleWindow] | None] = {}

        def own_window(request_id: str) -> tuple[Envelope, ScheduleWindow] | None:
            """The companion's envelope and its window as its own index entries give it (None: not a member)."""
            if request_id not in indexed:
                indexed[request_id] = None
                member = companions.load(request_id)
                if member is None or member.request_id != request_id or member.schedule is None:
                    return None
                if member.artifacts.adapter_name is not None:  # the lane's engine runs no adapter: a filler
                    return None
                try:
                    theirs = self._read_window(store, member)
                except (NotReplayableError, StoreError, LaneUnavailableError):
                    return None
                if theirs.complete and theirs.engine == window.engine:
                    indexed[request_id] = (member, theirs)
            return indexed[request_id]

        lead, seen = window, {envelope.request_id}
        while True:  # a companion's window names requests that arrived after the envelope finished: follow them
            furthest = lead
            for request_id in period_members(lead, finished=False):
                if request_id in seen:
                    continue
                seen.add(request_id)
                found = own_window(request_id)
                if found is not None and _end(found[1]) > _end(furthest):
                    furthest = found[1]
            if furthest is lead:
                break
            lead = furthest
        if lead is not window:
            lead = dataclasses.replace(lead, arrivals=window.arrivals)
        members: dict[str, tuple[Envelope, tuple[RequestArrival, ...]]] = {}
        for request_id, arrivals in period_members(lead).items():
            found = own_window(request_id)
            if found is None:
                continue
            member, theirs = found
            if {a.engine_request_id for a in theirs.arrivals} != {a.engine_request_id for a in arrivals}:
                continue  # the log's id points at engine requests the index does not give this request
            if stored is not None and stored(member, fingerprint_sha256) is not None:
                continue  # verified already: a filler now
            members[request_id] = (member, arrivals)
        return lead, members

    def _read_window(self, store: ScheduleStore, envelope: Envelope) -> ScheduleWindow:
        """The envelope's window as the store holds it now (`replayer.schedule.window.read_window`, unless the
        replayer was given another reader)."""
        if self._read is None:
            from replayer.schedule.window import read_window

            self._read = read_window
        return self._read(store, envelope)

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._fingerprints.clear()
