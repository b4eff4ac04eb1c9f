"""The part of an engine's schedule log one schedule replay needs, read from the store and no more.

A replay runs the busy period holding the target's arrival (`replayer.schedule.plan`), from the period's
first step (the engine was empty before it) to the step that finished the target, and, before it, each earlier
busy period that computed a prefix-cache block a request of the window read. Nothing else in the log can change
the target's numbers, so nothing else is read:

- **The target's period.** From the segment the target's index entry names, segments are read backwards (one,
  two, four, ... at a time) until the records read prove where the period starts: a step before which every
  request the records name had finished (`schemas.schedule_log.ScheduleLog.busy_period_starts`, with
  ``first_is_start=False``: a stretch from the middle of a log says nothing of what ran before its first step).
  Then forwards until every target request finished.
- **The providers' periods.** A request's arrival names, per cached block, the engine request that computed it.
  That request is found through its own index entry (its engine request id names its external id,
  `schemas.schedule_delivery.external_request_id`), checked like every entry, and its busy period read the same
  way, from its first step to its last. Their requests' providers are followed in turn.

The window's cost so grows with the periods that matter, not with how long the engine has run: a long-running
server's shared chat-template prefix, computed at its start, is one more period read. At most the store's
`max_segments` segments are read for one window. A provider that is not indexed (another client sent it to the
engine directly), whose period would pass that budget, or past `MAX_PERIODS`, is left out: the plan then notes
that the replay cannot recompute its blocks, and the schedule is not claimed reproduced.

The result is a `ScheduleWindow` whose ``ranges`` are the step ranges read; the lane's log keeps them
(`ScheduleLog.covered`), so the steps between two ranges are not taken for missing ones.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Final

from replayer.errors import StoreError
from replayer.schedule.store import ScheduleStore, ScheduleWindow
from schemas import Envelope
from schemas.schedule import UNKNOWN_PROVIDER, EngineStart, RequestArrival, ScheduleRecord, ScheduleStep
from schemas.schedule_log import ScheduleLog

__all__ = ["MAX_PERIODS", "read_window"]

#: Busy periods one window may hold: the target's and the providers' followed from it.
MAX_PERIODS: Final = 64


class _Gap(Exception):
    """The log cannot show the period asked for (a segment not there, or the read budget spent)."""


class _Reader:
    """The segments one window has read, at most ``limit`` of them, and the busy periods they show."""

    def __init__(self, store: ScheduleStore, engine_id: str) -> None:
        self.store, self.engine_id = store, engine_id
        self.segments: dict[int, tuple[ScheduleRecord, ...]] = {}

    def load(self, seq: int) -> None:
        if seq in self.segments:
            return
        if len(self.segments) >= self.store.max_segments:
            raise _Gap(f"over {self.store.max_segments} segments of engine {self.engine_id} would be read")
        records = self.store.segment(self.engine_id, seq)
        if records is None:
            raise _Gap(f"segment {seq} of engine {self.engine_id} is not there")
        self.segments[seq] = records

    def log(self, low: int, high: int) -> ScheduleLog:
        """Segments ``low..high`` (all read) as one stretch of the log."""
        return ScheduleLog.from_records(
            r for seq in range(low, high + 1) for r in self.segments[seq] if not isinstance(r, EngineStart)
        )

    def period(self, seq: int, step: int, finishing: set[str] | None = None) -> tuple[int, int]:
        """(first, last) step of the busy period holding ``step``, whose records start in segment ``seq``. With
        ``finishing``, the period is cut at the step that finished the last of those requests (the target's)."""
        self.load(seq)
        low = high = seq
        while not any(n >= step for n in self.log(low, high).steps):  # an arrival's segment may close before its step
            self._next(high, f"step {step}")
            high += 1
        chunk = 1
        while True:  # backwards, until a period start at or before `step` is proven
            log = self.log(low, high)
            starts = [s for s in log.busy_period_starts(first_is_start=low == 0) if s <= step]
            if starts:
                start = starts[-1]
                break
            if low == 0:
                raise _Gap(f"the log of engine {self.engine_id} shows no busy period holding step {step}")
            for _ in range(min(chunk, low)):
                self.load(low - 1)
                low -= 1
            chunk *= 2
        while True:  # forwards, until the period (or the target) is over
            log = self.log(low, high)
            end = _finish(log, finishing) if finishing is not None else _period_end(log, step)
            if end is not None:
                return start, end
            self._next(high, "the request finished" if finishing is not None else f"the busy period of {step} ended")
            high += 1
            # a long period: read ahead by half of what was read forwards, so that the stretch is rebuilt and
            # checked a logarithmic number of times, reading at most half as many segments again as it needed
            for _ in range((high - seq) // 2):
                if not self._ahead(high + 1):
                    break
                high += 1

    def _next(self, high: int, what: str) -> None:
        try:
            self.load(high + 1)
        except _Gap as exc:
            raise _Gap(f"the log ends at segment {high} of engine {self.engine_id} before {what} ({exc})") from exc

    def _ahead(self, seq: int) -> bool:
        """Read segment ``seq`` if it is there and the budget allows (`load`); False otherwise (`_next` then says
        why)."""
        try:
            self.load(seq)
        except _Gap:
            return False
        return True

    def records(self, ranges: dict[int, tuple[int, int]], target: tuple[int, int]) -> tuple[ScheduleRecord, ...]:
        """The records in ``ranges``, in log order; the target's range stops at the record of its last step
        (an arrival written after it was not scheduled before the target finished)."""
        firsts = sorted(ranges)
        out: list[ScheduleRecord] = []
        closed = False
        for seq in sorted(self.segments):
            for record in self.segments[seq]:
                if isinstance(record, EngineStart):
                    continue
                index = bisect_right(firsts, record.step) - 1
                if index < 0 or record.step > ranges[firsts[index]][1]:
                    continue
                if ranges[firsts[index]] == target:
                    if closed:
                        continue
                    closed = isinstance(record, ScheduleStep) and record.step == target[1]
                out.append(record)
        return tuple(out)


def _finish(log: ScheduleLog, targets: set[str]) -> int | None:
    """The step that finished the last of ``targets``, when the stretch shows every one finishing."""
    done = [shape.finished_at if (shape := log.requests.get(rid)) is not None else None for rid in targets]
    return None if None in done else max(n for n in done if n is not None)


def _period_end(log: ScheduleLog, step: int) -> int | None:
    """The last step of the busy period holding ``step``, when the stretch shows the next one starting."""
    later = [s for s in log.busy_period_starts(first_is_start=False) if s > step]
    if not later:
        return None
    return max(n for n in log.steps if n < later[0])


def _providers(records: tuple[ScheduleRecord, ...]) -> set[str]:
    return {rid for r in records if isinstance(r, RequestArrival) for rid, _ in r.cached_from or ()}


def read_window(store: ScheduleStore, envelope: Envelope) -> ScheduleWindow:
    """The window a schedule replay of `envelope` needs (module docstring); not ``complete`` (with the reason in
    ``gap``) when the log does not show the target's whole period yet."""
    entries = store.entries_for(envelope)
    engine_id = entries[0].engine_id
    arrivals = sorted((store.indexed_arrival(e)[0] for e in entries), key=lambda a: (a.step, a.engine_request_id))
    reader = _Reader(store, engine_id)
    engine = _engine(store, engine_id)
    first_seq = min(e.segment for e in entries)
    try:
        target = reader.period(first_seq, arrivals[0].step, {a.engine_request_id for a in arrivals})
    except _Gap as exc:
        seqs = sorted(reader.segments) or [first_seq]
        return ScheduleWindow(engine, tuple(arrivals), (), seqs[0], seqs[-1], complete=False, gap=str(exc))
    ranges = {target[0]: target}
    records = reader.records(ranges, target)
    have = {r.engine_request_id for r in records if isinstance(r, RequestArrival)}
    todo = sorted(_providers(records) - have)
    while todo and len(ranges) < MAX_PERIODS:
        provider = todo.pop(0)
        if provider in have or provider == UNKNOWN_PROVIDER:
            continue
        entry = store.provider_entry(engine_id, provider)
        if entry is None:
            continue  # not indexed: the plan notes the blocks it cannot recompute
        arrival, _ = store.indexed_arrival(entry)
        try:
            span = reader.period(entry.segment, arrival.step)
        except _Gap:
            continue  # the same: left out, and noted by the plan
        if span[1] >= target[0]:
            raise StoreError(f"the schedule index puts {provider}, a provider of the window, inside it")
        ranges[span[0]] = span
        records = reader.records(ranges, target)
        found = {r.engine_request_id for r in records if isinstance(r, RequestArrival)}
        todo = sorted((set(todo) | _providers(records)) - found)
        have = found
    seqs = sorted(reader.segments)
    spans = tuple(ranges[first] for first in sorted(ranges))
    return ScheduleWindow(
        engine, tuple(arrivals), records, seqs[0], seqs[-1], complete=True, ranges=spans, segments=tuple(seqs)
    )


def _engine(store: ScheduleStore, engine_id: str) -> EngineStart | None:
    records = store.segment(engine_id, 0) or ()
    return records[0] if records and isinstance(records[0], EngineStart) else None
