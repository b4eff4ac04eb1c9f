"""A started record (outcome ``incomplete``) is never replayed: the envelope that supersedes it is the one
judged, so a flagged guaranteed stream is counted once (issue #18, finding 5)."""

from __future__ import annotations

from datetime import UTC, datetime

from replayer.selection import not_replayable_reason, select
from replayer.settings import ReplayerSettings
from schemas import CapturedError, Timings
from tests.factories import envelope

STARTED = CapturedError(
    error_type="incomplete",
    message="started: recorded before the answer was relayed",
    timings=Timings(received_at=datetime(2026, 7, 14, 9, 30, tzinfo=UTC), upstream_ms=0.0),
)


def test_a_started_record_is_never_selected_and_its_finished_envelope_is() -> None:
    started = envelope(flagged=True, flag_reason="header", prompt=None, outcome=STARTED)
    done = envelope(flagged=True, flag_reason="header")
    for settings in (ReplayerSettings(), ReplayerSettings(replay_all=True)):
        assert select(started, settings) == "not_selected"
        assert select(done, settings) == "replay"


def test_why_a_started_record_is_not_replayable_says_what_it_is() -> None:
    started = envelope(prompt=None, outcome=STARTED)
    assert "started record" in not_replayable_reason(started)
    assert "sidecar stopped mid-answer" in not_replayable_reason(started)
