"""What a schedule replay runs, worked out from the log alone (pure: no engine, no IO).

- **The window.** vLLM keeps a persistent batch whose row order depends on which requests came and went before,
  so a replay cannot start in the middle of a burst: it starts at the first step of the *busy period* holding
  the target's arrival (a step before which every earlier request had finished, so the engine was empty, as a
  freshly reset replay engine is). It ends at the target's last step: nothing later can change the target.
- **The providers' busy periods.** When a request of the window read prefix-cache blocks that a request of an
  earlier busy period computed, that provider's busy period is replayed first (and, the same way, the periods
  whose blocks *it* read), so that the replay computes those blocks in the shapes production computed them in.
  Only those periods: an empty engine carries nothing from one busy period to the next but its prefix cache, so
  the busy periods in between, which provided nothing, cannot change a number of the target (`ReplayPlan.periods`).
  A long-running server's shared chat-template prefix, computed once at its start, costs one more period, not
  the whole history since.
- **The fillers.** Every other request of the window is replayed as a filler with its recorded prompt length and
  output length (``min_tokens = max_tokens``, ``ignore_eos``), arriving before the same step. Its content is
  random token ids, except for blocks the log says were prefix-cache hits: those copy the provider's blocks *as
  the replay produced them* (`FillerPlan.hit_blocks`), and a filler whose blocks a request replayed with its real
  content (the target, or one of ``also``) later read carries that request's prompt tokens there
  (`FillerPlan.target_prefix`, `FillerPlan.prefix_of`). A filler never holds any other request's content: the log
  has none (`schemas.schedule`).
- **Grammars.** A request with structured outputs waits, after it arrives, for its grammar to compile in the
  background; the scheduler passes it over meanwhile, for as many steps as compiling took, which no replay
  reproduces by timing. The recorder marks such arrivals. One that production passed over (a request that arrived
  after it was scheduled before it) is added before its first *scheduled* step instead (`FillerPlan.due_step`);
  one that kept its place in the queue (it waited for the token budget, not for its grammar) is added where it
  arrived, so it stands before the requests that arrived after it, as it did. The lane waits for every grammar
  to compile before it steps on.
- **Periods replayed already.** A long-running replay engine keeps the prefix cache of the busy periods it
  replayed (`replayer.schedule.lane`); a plan whose providers' periods it holds runs only the rest
  (`ReplayPlan.without`), and its fillers copy those periods' blocks from the tokens the earlier replay gave them.
- **Notes.** What the log cannot give (a provider before the log starts, a cached prefix that held another
  request's generated tokens, a request that never finished in the log) is said in `ReplayPlan.notes`.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from collections.abc import Collection
from dataclasses import dataclass, field

from schemas.schedule import RequestArrival
from schemas.schedule_log import ScheduleLog


class WindowTooLongError(ValueError):
    """The replay would run more recorded steps than its caller allows (``plan_replay(max_steps=...)``)."""


@dataclass(frozen=True)
class FillerPlan:
    """One request of the window, as the replay will send it."""

    arrival: RequestArrival
    output_tokens: int
    #: per cached block (in order): the engine request id whose replayed tokens it copies
    hit_blocks: tuple[str, ...] = ()
    #: leading prompt tokens that must be a real request's (blocks it later reads from this filler's cache)
    target_prefix: int = 0
    #: the engine request id whose prompt those tokens are (the target, or one of ``also``); None when there are none
    prefix_of: str | None = None
    #: the recorded step before which the replay adds it: its arrival, or for a request that waited for its grammar
    #: to compile (`schemas.schedule.RequestArrival.structured_output`) its first scheduled step (module docstring)
    due_step: int = 0


@dataclass
class ReplayPlan:
    target: str
    start_step: int
    end_step: int
    requests: list[FillerPlan] = field(default_factory=list)  # in arrival order, the target included
    notes: list[str] = field(default_factory=list)
    #: the recorded steps replayed, as (first, last) of each busy period in order; the last one ends at `end_step`
    periods: tuple[tuple[int, int], ...] = ()

    @property
    def steps(self) -> list[int]:
        """The recorded step numbers the replay runs, in order (what its own steps are compared with)."""
        periods = self.periods or ((self.start_step, self.end_step),)
        return [n for first, last in periods for n in range(first, last + 1)]

    def without(self, held: Collection[tuple[int, int]]) -> ReplayPlan:
        """The plan less the busy periods in ``held`` (an earlier replay ran them, and the engine still holds their
        prefix cache): their requests are not sent again and their steps are not run. The target's period is never
        one of them (a period in ``held`` ran before the replay engine reached the target's)."""
        periods = tuple(p for p in self.periods if p not in held)
        if not periods:
            raise ValueError("a plan without its target's busy period runs nothing")
        kept = [p for p in self.requests if any(low <= p.arrival.step <= high for low, high in periods)]
        return dataclasses.replace(self, start_step=periods[0][0], requests=kept, periods=periods)


class _Periods:
    """The log's busy periods, looked up by step: the bounds of the one holding a step."""

    def __init__(self, log: ScheduleLog) -> None:
        self.starts = log.busy_period_starts()
        self.numbers = sorted(log.steps)

    def bounds(self, step: int) -> tuple[int, int]:
        """(first, last) step of the busy period holding ``step``; ``(step, step)`` before the log's first step."""
        index = bisect_right(self.starts, step) - 1
        if index < 0:
            return step, step
        if index + 1 < len(self.starts):  # the last step the log holds before the next period (ranges may skip)
            return self.starts[index], self.numbers[bisect_right(self.numbers, self.starts[index + 1] - 1) - 1]
        return self.starts[index], self.numbers[-1]


def hit_providers(arrival: RequestArrival) -> list[str]:
    """Per prefix-cache block the arrival read (in order), the engine request that computed it."""
    out: list[str] = []
    for rid, blocks in arrival.cached_from or ():
        out.extend([rid] * blocks)
    return out


def plan_replay(
    log: ScheduleLog,
    target: str,
    *,
    max_model_len: int | None = None,
    max_steps: int | None = None,
    also: tuple[str, ...] = (),
) -> ReplayPlan:
    """The window and the fillers that replay ``target`` (an engine request id of the log) and ``also`` (requests
    replayed with their real content beside it: the other choices of a request with ``n > 1``, the other captured
    requests of its busy period; the window ends at the last of them); `WindowTooLongError` when they would run more
    than ``max_steps`` recorded steps."""
    ends = []
    for rid in (target, *also):
        shape = log.requests.get(rid)
        if shape is None:
            raise KeyError(f"request {rid} is not in the schedule log")
        if not shape.steps:
            raise KeyError(f"request {rid} was never scheduled in the log")
        ends.append(shape.steps[-1])
    shape = log.requests[target]
    end = max(ends)
    periods = _Periods(log)
    start = periods.bounds(shape.arrival.step)[0]
    notes: list[str] = []
    included = {start: (start, end)}  # first step of a busy period -> the recorded steps of it replayed
    todo = [start]
    while todo:
        low, high = included[todo.pop()]
        for a in log.arrivals.values():
            if not low <= a.step <= high:
                continue
            for provider in set(hit_providers(a)):
                prov = log.arrivals.get(provider)
                if prov is None:
                    continue
                bounds = periods.bounds(prov.step)
                if bounds[0] not in included:
                    included[bounds[0]] = bounds
                    todo.append(bounds[0])
    spans = tuple(included[first] for first in sorted(included))
    start = spans[0][0]
    replayed_steps = sum(high - low + 1 for low, high in spans)
    if max_steps is not None and replayed_steps > max_steps:
        raise WindowTooLongError(
            f"the schedule replay of {target} would run {replayed_steps} recorded steps in {len(spans)} busy "
            f"period(s), over the limit of {max_steps}"
        )
    window = [a for a in log.arrivals.values() if any(low <= a.step <= high for low, high in spans)]
    in_window = {a.engine_request_id for a in window}
    hits = {a.engine_request_id: hit_providers(a) for a in window}
    for a in window:
        missing = sorted({p for p in hits[a.engine_request_id] if p not in in_window})
        if missing:
            who = "the target" if a.engine_request_id == target else f"request {a.engine_request_id}"
            notes.append(
                f"{who} read prefix-cache blocks computed outside the log ({', '.join(missing)}): the replay "
                "cannot recompute them in the recorded shapes"
            )
    forced = _forced_prefixes(log, (target, *also), hits, notes)
    plans: list[FillerPlan] = []
    for a in window:
        rid = a.engine_request_id
        length = log.output_length(rid)
        if length is None:
            last = log.requests[rid].steps
            if rid != target and rid not in also:
                computed, scheduled = log.scheduled_in(last[-1])[rid] if last else (0, 0)
                length = max(computed + scheduled - a.num_prompt_tokens + 2, 1)
                if max_model_len is not None:
                    length = max(min(length, max_model_len - a.num_prompt_tokens), 1)
            else:
                length = 0
        steps = log.requests[rid].steps if rid in log.requests else []
        plans.append(
            FillerPlan(
                arrival=a,
                output_tokens=length,
                hit_blocks=tuple(hits[rid]),
                target_prefix=forced[rid][0] if rid in forced else 0,
                prefix_of=forced[rid][1] if rid in forced else None,
                due_step=steps[0] if a.structured_output and steps and _waited_for_grammar(log, a) else a.step,
            )
        )
    plans.sort(key=lambda p: p.due_step)  # stable: arrival order among requests due before the same step
    return ReplayPlan(target=target, start_step=start, end_step=end, requests=plans, notes=notes, periods=spans)


def _waited_for_grammar(log: ScheduleLog, arrival: RequestArrival) -> bool:
    """Whether a structured-output request was held back by its grammar (still compiling), not by the token budget.

    The scheduler takes its waiting queue in arrival order and skips only a request whose grammar is not ready. So
    it waited for its grammar if, at a step between its arrival and its first, a later arrival was scheduled before
    it, or the step left room it would have taken (with chunked prefill, any token of budget and a free sequence
    slot). Otherwise it waited for the budget and kept its place in the queue."""
    rid = arrival.engine_request_id
    own = log.requests.get(rid)
    if own is None or not own.steps:
        return False
    first = own.steps[0]
    engine = log.engine
    order = list(log.arrivals)
    later = set(order[order.index(rid) + 1 :])
    for number in range(arrival.step, first + 1):
        step = log.steps.get(number)
        if step is None:
            continue
        for scheduled in step.scheduled:
            if scheduled.engine_request_id == rid:
                return False
            if scheduled.engine_request_id in later:
                return True
        if engine is not None and engine.enable_chunked_prefill:
            tokens = sum(s.num_scheduled_tokens for s in step.scheduled)
            if tokens < engine.max_num_batched_tokens and len(step.scheduled) < engine.max_num_seqs:
                return True
    return False


def check_target(log: ScheduleLog, target: str, num_prompt_tokens: int) -> None:
    """Refuse a join that picked the wrong request: the target's prompt must have the recorded length."""
    arrival = log.arrivals.get(target)
    if arrival is None:
        raise KeyError(f"request {target} is not in the schedule log")
    if arrival.num_prompt_tokens != num_prompt_tokens:
        raise ValueError(
            f"request {target} arrived with {arrival.num_prompt_tokens} prompt tokens, the envelope has "
            f"{num_prompt_tokens}: the schedule is not this request's"
        )


def _forced_prefixes(
    log: ScheduleLog, readers: tuple[str, ...], hits: dict[str, list[str]], notes: list[str]
) -> dict[str, tuple[int, str]]:
    """Per filler, the leading tokens of its prompt that must be a real request's, and whose: the blocks a real
    request (``readers``: the target first) read from a filler's cache were computed by that filler (or read by it
    from another's cache: followed to whoever computed them). Two readers of one filler's blocks read the same
    tokens there (a cache hit is equal content), so the longest need is kept."""
    engine = log.engine
    block = engine.block_size if engine is not None else 16
    real = set(readers)
    forced: dict[str, tuple[int, str]] = {}
    for reader in readers:
        stack = [(p, i) for i, p in enumerate(hits.get(reader, ())) if p in hits]
        while stack:
            rid, index = stack.pop()
            if rid in real:
                continue
            need = (index + 1) * block
            if forced.get(rid, (0, ""))[0] >= need:
                continue
            forced[rid] = (need, reader)
            own = hits.get(rid, [])
            stack.extend((own[j], j) for j in range(min(index + 1, len(own))) if own[j] in hits)
    for rid, (need, reader) in list(forced.items()):
        limit = min(log.arrivals[rid].num_prompt_tokens, log.arrivals[reader].num_prompt_tokens)
        if need > limit:
            who = "the target's" if reader == readers[0] else f"request {reader}'s"
            notes.append(
                f"{who} cached prefix includes tokens that request {rid} generated; a filler cannot reproduce them"
            )
            forced[rid] = (limit, reader)
    return forced
