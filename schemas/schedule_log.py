"""The schedule log one engine instance's records add up to, and the checks a replay relies on.

Segments are named, encoded and decoded in one place, `schemas.schedule_delivery` (the recorder, the shipper, the
lane reading its own log and the replayer's store all go through it: ``decode_segment`` is bounded and checks
every line). This module indexes the decoded records; it is pure.

`ScheduleLog` is one engine instance's records indexed for a replay: the engine's settings, the arrivals in order,
the steps by number. It also says what a replay cannot trust (`ScheduleLog.problems`): a missing step number, or
a request whose computed-token count does not continue from its previous step (a recorder that dropped a step, or
a log that was altered, shows up there even when the step numbers were rewritten).

A log need not hold every step of the engine: `ScheduleLog.covered` names the step ranges it holds (a replay's
window: the target's busy period and the busy periods that computed what it read from the prefix cache), and the
steps between ranges are not missing. Its busy periods (`ScheduleLog.busy_period_starts`) are the stretches
between two moments the engine was empty; each covered range starts at one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from schemas.errors import ContractError
from schemas.schedule import EngineStart, RequestArrival, ScheduleStep


@dataclass
class RequestShape:
    """What the log says about one request: its arrival and every step it was scheduled in (step numbers)."""

    arrival: RequestArrival
    steps: list[int] = field(default_factory=list)
    finished_at: int | None = None  # the step whose ``finished`` names it

    @property
    def first_step(self) -> int | None:
        return self.steps[0] if self.steps else None


@dataclass
class ScheduleLog:
    """One engine instance's schedule, indexed (build it with `ScheduleLog.from_records`)."""

    engine: EngineStart | None
    arrivals: dict[str, RequestArrival]
    steps: dict[int, ScheduleStep]
    requests: dict[str, RequestShape]
    #: the (first, last) step ranges the log holds, in order, each starting a busy period; None: one range, from
    #: its first step to its last
    covered: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_records(
        cls,
        records: Iterable[EngineStart | RequestArrival | ScheduleStep],
        covered: tuple[tuple[int, int], ...] | None = None,
    ) -> ScheduleLog:
        """Index the records of one engine (segments concatenated in sequence order); mixed engines are refused."""
        engine: EngineStart | None = None
        arrivals: dict[str, RequestArrival] = {}
        steps: dict[int, ScheduleStep] = {}
        engine_ids: set[str] = set()
        for rec in records:
            engine_ids.add(rec.engine_id)
            if isinstance(rec, EngineStart):
                engine = rec
            elif isinstance(rec, RequestArrival):
                arrivals.setdefault(rec.engine_request_id, rec)
            else:
                steps.setdefault(rec.step, rec)
        if len(engine_ids) > 1:
            raise ContractError(f"a schedule log holds one engine instance, got {sorted(engine_ids)}")
        requests = {rid: RequestShape(arrival=a) for rid, a in arrivals.items()}
        for number in sorted(steps):
            step = steps[number]
            for s in step.scheduled:
                shape = requests.get(s.engine_request_id)
                if shape is not None:
                    shape.steps.append(number)
            for rid in step.finished:
                shape = requests.get(rid)
                if shape is not None and shape.finished_at is None:
                    shape.finished_at = number
        return cls(engine=engine, arrivals=arrivals, steps=steps, requests=requests, covered=covered)

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The step ranges the log holds (`covered`, or its first to its last step)."""
        if self.covered is not None:
            return self.covered
        return ((min(self.steps), max(self.steps)),) if self.steps else ()

    def busy_period_starts(self, *, first_is_start: bool = True) -> list[int]:
        """The first step of every busy period the log shows, in order: a step ``s`` before which every request
        that arrived earlier had finished (its id in a ``finished`` list of a step ``< s``). A request the log
        names without its arrival (it arrived before the log's first step) counts as running from there.

        ``first_is_start``: the first step of each range starts a period (a log read from the engine's start, or
        ranges chosen to start at one); False for a stretch read from the middle of a log, whose first step says
        nothing of what ran before it."""
        arrived_at: dict[int, set[str]] = {}
        for a in self.arrivals.values():
            arrived_at.setdefault(a.step, set()).add(a.engine_request_id)
        starts: list[int] = []
        for low, high in self.ranges():
            named = {
                rid
                for n in range(low, high + 1)
                if (step := self.steps.get(n)) is not None
                for rid in (*(s.engine_request_id for s in step.scheduled), *step.finished, *step.preempted)
            }
            early = {rid for rid in named if rid not in self.arrivals or self.arrivals[rid].step < low}
            live = early
            finished: set[str] = set()  # in a step before n
            for n in range(low, high + 1):
                live -= finished
                if not live and (n > low or first_is_start):
                    starts.append(n)
                live |= arrived_at.get(n, set()) - finished
                step = self.steps.get(n)
                if step is not None:
                    finished.update(step.finished)
        return starts

    def by_external_id(self, external_id: str) -> RequestArrival | None:
        """The arrival whose external id is exactly ``external_id`` (the join is
        `schemas.schedule_delivery.external_request_id_for`: ``chatcmpl-<request id>``, ``cmpl-<request id>-0``;
        never a prefix or suffix match, so ``rl-1`` does not join ``chatcmpl-rl-12``)."""
        for arrival in self.arrivals.values():
            if arrival.external_request_id == external_id:
                return arrival
        return None

    def scheduled_in(self, number: int) -> dict[str, tuple[int, int]]:
        """Step ``number``'s requests: id -> (computed before, scheduled), in the scheduler's order."""
        step = self.steps.get(number)
        if step is None:
            return {}
        return {s.engine_request_id: (s.num_computed_tokens, s.num_scheduled_tokens) for s in step.scheduled}

    def output_length(self, request_id: str) -> int | None:
        """Tokens the request generated, from its last step (the last sampled token is never computed), or None
        when the log does not show it finishing."""
        shape = self.requests.get(request_id)
        if shape is None or shape.finished_at is None or not shape.steps:
            return None
        computed, scheduled = self.scheduled_in(shape.steps[-1])[request_id]
        return max(computed + scheduled - shape.arrival.num_prompt_tokens + 1, 0)

    def problems(self) -> list[str]:
        """Why the log cannot be trusted as a complete record, one line each (empty: it is consistent)."""
        found: list[str] = []
        if self.engine is None:
            found.append("no engine record (the log does not start at the engine's first segment)")
        if self.steps:
            missing = sorted({n for lo, hi in self.ranges() for n in range(lo, hi + 1)} - set(self.steps))
            if missing:
                found.append(f"steps missing from the log: {_ranges(missing)}")
        progress: dict[str, int] = {}
        preempted: dict[str, int] = {}  # preempted request -> what it had computed (it may resume from its cache)
        for number in sorted(self.steps):
            step = self.steps[number]
            for rid in step.preempted:
                preempted[rid] = progress.get(rid, 0)
            for s in step.scheduled:
                rid = s.engine_request_id
                if rid in preempted:
                    before = preempted.pop(rid)
                    if s.num_computed_tokens > before:
                        found.append(
                            f"step {number}: request {rid} resumed with {s.num_computed_tokens} tokens computed, "
                            f"more than the {before} it had when preempted"
                        )
                elif rid in progress and s.num_computed_tokens != progress[rid]:
                    found.append(
                        f"step {number}: request {rid} had {s.num_computed_tokens} tokens computed, its previous "
                        f"step left {progress[rid]} (a step is missing or altered)"
                    )
                elif rid not in progress and rid not in self.arrivals:
                    found.append(f"step {number}: request {rid} was scheduled without an arrival record")
                progress[rid] = s.num_computed_tokens + s.num_scheduled_tokens
        return found


def _ranges(numbers: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    parts: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if n is not None:
            start = prev = n
    return ", ".join(parts)
