"""The started record: an envelope whose outcome is ``incomplete`` (issue #18, finding 5). The outcome value is
new; the golden vectors of the records that existed before stay what they were (tests/schemas/golden)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from schemas import CapturedError, Timings
from schemas.envelope import decode_envelope
from tests.factories import envelope


def started(**overrides: object) -> CapturedError:
    values: dict[str, object] = {
        "error_type": "incomplete",
        "message": "started: recorded before the answer was relayed",
        "timings": Timings(received_at=datetime(2026, 7, 14, 9, 30, tzinfo=UTC), upstream_ms=0.0),
    }
    values.update(overrides)
    return CapturedError(**values)  # type: ignore[arg-type]


def test_a_started_record_is_an_envelope_that_round_trips_and_is_not_replayable() -> None:
    env = envelope(outcome=started(), prompt=None)
    again = decode_envelope(env.canonical())
    assert again == env
    assert again.envelope_id() == env.envelope_id()
    assert again.is_started_record
    assert not again.replayable


def test_other_outcomes_are_not_started_records() -> None:
    assert not envelope().is_started_record
    assert not envelope(outcome=started(error_type="client_disconnect")).is_started_record


def test_an_unknown_error_type_is_still_refused() -> None:
    with pytest.raises(ValidationError):
        started(error_type="in_progress")
