"""Which lane replays an envelope, and where its result goes: written once, used by every replay entry point.

``reprolane replay request`` and ``replay workflow`` (with a lane loaded here), the replayer service (the envelope
stream, on-demand requests, the console's "replay now") and ``reprolane replay explain`` (its ``schedule``
variation) all replay through `LaneChoice`, so one request gets one verdict wherever it is asked (issue 30: the
command line replayed a workflow's steps one at a time while the service and ``replay request`` took the schedule
lane, and each said another verdict for the same request). The lane asked for:

- **none** (None): the schedule lane when the envelope names a schedule that is found and complete
  (`replayer.schedule.replay.ScheduleReplayer`), else the one-at-a-time lane of the settings, with the reason said;
- ``schedule``: the schedule lane only; without its schedule there is no verdict (`NotReplayableError`, why);
- a one-at-a-time lane's name (``vllm``, ``remote``, ``transformers``): that lane only.

Those are the names results carry (`schemas.DivergenceEvent.lane`) and the names a user may ask for (`ASKABLE`).

A result already stored for the envelope on the chosen lane is the answer, not replayed again (results are keyed
by (envelope id, lane fingerprint) and written once, so a second replay could only print a verdict that is stored
nowhere); a fresh result is stored by `keep`, whoever asked, where the console's request page and evidence
bundles read results (`replayer.store.EnvelopeStore.results`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, get_args

from replayer.errors import NotReplayableError
from replayer.lanes.base import Lane
from replayer.settings import LaneName, ReplayerSettings
from schemas import Envelope, ReplayResult

if TYPE_CHECKING:
    from replayer.schedule.replay import Companions, ScheduleReplayer
    from replayer.schedule.store import ScheduleWindow
    from replayer.store import EnvelopeStore

__all__ = ["ASKABLE", "ONE_AT_A_TIME", "SCHEDULE_LANE", "LaneChoice", "Replayed", "keep"]

log = logging.getLogger("reprolane.replayer")

#: The schedule lane's name, in results and in requests.
SCHEDULE_LANE: Final = "schedule"
#: The one-at-a-time lanes (`replayer.lanes.make_lane`).
ONE_AT_A_TIME: Final[tuple[str, ...]] = get_args(LaneName)
#: Every lane a user may ask for: the lanes results name.
ASKABLE: Final = (SCHEDULE_LANE, *ONE_AT_A_TIME)

#: The result store's lookup: the result of (envelope, lane fingerprint sha256), None when it was never stored.
Stored = Callable[[Envelope, str], ReplayResult | None]


@dataclass(frozen=True)
class Replayed:
    """A replay's result, and whether it was stored already (answered from the store, not replayed)."""

    result: ReplayResult
    stored: bool


class LaneChoice:
    """Replays envelopes on the lane chosen the one way (module docstring).

    ``one_at_a_time`` makes the settings' one-at-a-time lane, called once, when a replay first needs it (a command
    whose envelopes all replay on their schedule never loads it); ``schedule``: None where no schedule lane may
    run. ``say`` gets the one line saying why the schedule lane was not used (default: the log).
    """

    def __init__(
        self,
        settings: ReplayerSettings,
        one_at_a_time: Callable[[], Lane],
        schedule: ScheduleReplayer | None,
        *,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.schedule = schedule
        self._make = one_at_a_time
        self._lane: Lane | None = None
        self._say = say if say is not None else log.info

    def refusal(self, lane: str | None) -> str | None:
        """Why a replay on `lane` cannot be had here (None: it can)."""
        if lane is None or (lane == SCHEDULE_LANE and self.schedule is not None) or lane == self.settings.lane:
            return None
        if lane == SCHEDULE_LANE:
            return "this replayer runs no schedule lane"
        if lane not in ASKABLE:
            return f"unknown lane {lane!r} (one of {', '.join(ASKABLE)})"
        return f"lane {lane!r} is not served here (its one-at-a-time lane is {self.settings.lane})"

    def look(self, envelope: Envelope, lane: str | None = None) -> ScheduleWindow | str | None:
        """The envelope's schedule window, or why there is none, when the choice may take the schedule lane; None
        when it will not look (no schedule named or runnable, a one-at-a-time lane asked). It waits while the
        schedule is not shipped yet (`ScheduleReplayer.find`) and touches no lane, so the service calls it before
        it takes its lane."""
        if self.schedule is None or envelope.schedule is None or lane not in (None, SCHEDULE_LANE):
            return None
        return self.schedule.find(envelope)

    def one_at_a_time(self) -> Lane:
        """The one-at-a-time lane, made on first use."""
        if self._lane is None:
            self._lane = self._make()
        return self._lane

    def replay(
        self,
        envelope: Envelope,
        *,
        lane: str | None = None,
        window: ScheduleWindow | str | None = None,
        stored: Stored | None = None,
        reply_to: str | None = None,
        companions: Companions | None = None,
    ) -> Replayed:
        """`envelope` replayed on the lane chosen for `lane` (module docstring), or its stored result there.

        ``window``: what `look` answered when the caller looked already (None: look now). ``companions``: replay
        the envelope's whole busy period on the schedule lane, once for its captured requests
        (`replayer.schedule.replay.ScheduleReplayer.replay`). Raises
        `NotReplayableError` for a lane that cannot be had or an envelope it cannot replay; a lane or store that
        is down raises its own error."""
        refused = self.refusal(lane)
        if refused is not None:
            raise NotReplayableError(refused)
        hits: list[ReplayResult] = []

        def lookup(env: Envelope, fingerprint_sha256: str) -> ReplayResult | None:
            found = None if stored is None else stored(env, fingerprint_sha256)
            if found is not None:
                hits.append(found)
            return found

        found = window if window is not None else self.look(envelope, lane)
        if found is not None and self.schedule is not None:
            answer = self.schedule.replay(
                envelope, reply_to=reply_to, stored=lookup, window=found, companions=companions
            )
            if not isinstance(answer, str):
                return Replayed(answer, stored=bool(hits))
            if lane == SCHEDULE_LANE:
                raise NotReplayableError(f"the schedule lane cannot replay {envelope.request_id}: {answer}")
            self._say(f"schedule lane not used for {envelope.request_id}: {answer}; replaying it one request at a "
                      f"time on lane {self.settings.lane}")  # fmt: skip
        elif lane == SCHEDULE_LANE:
            raise NotReplayableError(
                f"the schedule lane cannot replay {envelope.request_id}: the envelope names no schedule"
            )
        one = self.one_at_a_time()
        done = lookup(envelope, one.fingerprint().sha256())
        if done is not None:
            return Replayed(done, stored=True)
        from replayer.replay import replay_envelope

        return Replayed(replay_envelope(envelope, one, self.settings, reply_to=reply_to), stored=False)

    def lanes(self) -> list[tuple[str, str]]:
        """(name, fingerprint sha256) of every lane this choice answers with now: the one-at-a-time lane once
        made, then each schedule lane built."""
        made = [] if self._lane is None else [(self._lane.name, self._lane.fingerprint().sha256())]
        return made + [(SCHEDULE_LANE, fp) for fp in (self.schedule.lanes() if self.schedule is not None else ())]

    def close(self) -> None:
        """Close the lanes this choice made (the schedule replayer's and the one-at-a-time lane)."""
        if self.schedule is not None:
            self.schedule.close()
        if self._lane is not None:
            self._lane.close()
            self._lane = None


def keep(store: EnvelopeStore, envelope: Envelope, replayed: Replayed) -> tuple[ReplayResult, bool]:
    """Store a fresh result (without its ``reply_to``: the stored result is everyone's) where the console and
    evidence read results; the result that stands, and whether this call wrote it. Another writer's result
    stored first stands (results are written once): it is the verdict."""
    if replayed.stored:
        return replayed.result, False
    result = replayed.result
    result = result.model_copy(update={"event": result.event.model_copy(update={"reply_to": None})})
    if store.put_result(envelope, result):
        return result, True
    winner = store.get_result(envelope, result.event.lane_fingerprint_sha256)
    return (winner if winner is not None else result), False
