"""What a schedule replay runs, worked out from the log alone (pure: no engine, no IO).

- **The window.** vLLM keeps a persistent batch whose row order depends on which requests came and went before,
  so a replay cannot start in the middle of a burst: it starts at the first step of the *busy period* holding
  the target's arrival (a step before which every earlier request had finished, so the engine was empty, as a
  freshly reset replay engine is). When a request of the window read prefix-cache blocks that a request before
  the window computed, the window starts earlier, at that provider's busy period (repeatedly), so that the
  replay computes those blocks too. It ends at the target's last step: nothing later can change the target.
- **The fillers.** Every other request of the window is replayed as a filler with its recorded prompt length and
  output length (``min_tokens = max_tokens``, ``ignore_eos``), arriving before the same step. Its content is
  random token ids, except for blocks the log says were prefix-cache hits: those copy the provider's blocks *as
  the replay produced them* (`FillerPlan.hit_blocks`), and a filler whose blocks the target later read carries
  the target's own prompt tokens there (`FillerPlan.target_prefix`). A filler never holds any other request's
  content: the log has none (`schemas.schedule`).
- **Notes.** What the log cannot give (a provider before the log starts, a cached prefix that held another
  request's generated tokens, a request that never finished in the log) is said in `ReplayPlan.notes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.schedule import RequestArrival
from schemas.schedule_log import ScheduleLog

UNKNOWN_PROVIDER = "?"


@dataclass(frozen=True)
class FillerPlan:
    """One request of the window, as the replay will send it."""

    arrival: RequestArrival
    output_tokens: int
    #: per cached block (in order): the engine request id whose replayed tokens it copies
    hit_blocks: tuple[str, ...] = ()
    #: leading prompt tokens that must be the target's (blocks the target later reads from this filler's cache)
    target_prefix: int = 0


@dataclass
class ReplayPlan:
    target: str
    start_step: int
    end_step: int
    requests: list[FillerPlan] = field(default_factory=list)  # in arrival order, the target included
    notes: list[str] = field(default_factory=list)


def busy_period_start(log: ScheduleLog, step: int) -> int:
    """The first step of the busy period containing ``step``: the latest step ``s <= step`` before which every
    request that arrived earlier had finished (its id in a ``finished`` list of a step ``< s``)."""
    numbers = sorted(n for n in log.steps if n <= step)
    if not numbers:
        return step
    arrived_before: dict[int, set[str]] = {}
    for a in log.arrivals.values():
        arrived_before.setdefault(a.step, set()).add(a.engine_request_id)
    finished: set[str] = set()  # finished in a step before n
    live: set[str] = set()
    start = numbers[0]
    for n in range(numbers[0], numbers[-1] + 1):
        live -= finished
        if not live:
            start = n
        live |= arrived_before.get(n, set()) - finished
        step_rec = log.steps.get(n)
        if step_rec is not None:
            finished.update(step_rec.finished)
    return start


def _hit_providers(arrival: RequestArrival) -> list[str]:
    out: list[str] = []
    for rid, blocks in arrival.cached_from or ():
        out.extend([rid] * blocks)
    return out


def plan_replay(log: ScheduleLog, target: str, *, max_model_len: int | None = None) -> ReplayPlan:
    """The window and the fillers that replay ``target`` (an engine request id of the log)."""
    shape = log.requests.get(target)
    if shape is None:
        raise KeyError(f"request {target} is not in the schedule log")
    if not shape.steps:
        raise KeyError(f"request {target} was never scheduled in the log")
    end = shape.steps[-1]
    start = busy_period_start(log, shape.arrival.step)
    notes: list[str] = []
    while True:
        window = [a for a in log.arrivals.values() if start <= a.step <= end]
        earliest = start
        for a in window:
            for provider in set(_hit_providers(a)):
                prov = log.arrivals.get(provider)
                if prov is None:
                    continue
                if prov.step < earliest:
                    earliest = busy_period_start(log, prov.step)
        if earliest >= start:
            break
        start = earliest
    window = [a for a in log.arrivals.values() if start <= a.step <= end]
    in_window = {a.engine_request_id for a in window}
    hits = {a.engine_request_id: _hit_providers(a) for a in window}
    for a in window:
        missing = sorted({p for p in hits[a.engine_request_id] if p not in in_window})
        if missing:
            who = "the target" if a.engine_request_id == target else f"request {a.engine_request_id}"
            notes.append(
                f"{who} read prefix-cache blocks computed outside the log ({', '.join(missing)}): the replay "
                "cannot recompute them in the recorded shapes"
            )
    forced = _target_forced(log, target, hits, notes)
    plans: list[FillerPlan] = []
    for a in window:
        rid = a.engine_request_id
        length = log.output_length(rid)
        if length is None:
            last = log.requests[rid].steps
            if rid != target:
                computed, scheduled = log.scheduled_in(last[-1])[rid] if last else (0, 0)
                length = max(computed + scheduled - a.num_prompt_tokens + 2, 1)
                if max_model_len is not None:
                    length = max(min(length, max_model_len - a.num_prompt_tokens), 1)
            else:
                length = 0
        plans.append(
            FillerPlan(
                arrival=a,
                output_tokens=length,
                hit_blocks=tuple(hits[rid]),
                target_prefix=forced.get(rid, 0),
            )
        )
    return ReplayPlan(target=target, start_step=start, end_step=end, requests=plans, notes=notes)


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


def _target_forced(log: ScheduleLog, target: str, hits: dict[str, list[str]], notes: list[str]) -> dict[str, int]:
    """Tokens of each filler's prompt that must be the target's: the blocks the target read from a filler's
    cache were computed by that filler (or read by it from another's cache: followed to whoever computed them)."""
    engine = log.engine
    block = engine.block_size if engine is not None else 16
    target_prompt = log.arrivals[target].num_prompt_tokens
    forced: dict[str, int] = {}
    stack = [(p, i) for i, p in enumerate(hits.get(target, ())) if p in hits]
    while stack:
        rid, index = stack.pop()
        if rid == target:
            continue
        need = (index + 1) * block
        if forced.get(rid, 0) >= need:
            continue
        forced[rid] = need
        own = hits.get(rid, [])
        stack.extend((own[j], j) for j in range(min(index + 1, len(own))) if own[j] in hits)
    for rid, need in list(forced.items()):
        limit = min(log.arrivals[rid].num_prompt_tokens, target_prompt)
        if need > limit:
            notes.append(
                f"the target's cached prefix includes tokens that request {rid} generated; a filler cannot "
                "reproduce them"
            )
            forced[rid] = limit
    return forced
