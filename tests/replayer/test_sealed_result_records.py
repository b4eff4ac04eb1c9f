"""Sealed replay results and redacted divergence events (`schemas.sealed`): what opens, what does not, what is left
out. Results come from a real replay (`replayer.replay.replay_envelope`) on the fake lane."""

from __future__ import annotations

import json

import pytest

from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from schemas import ReplayResult
from schemas.canonical import canonical_bytes
from schemas.errors import SealError
from schemas.sealed import (
    b64e,
    decode_sealed_result,
    new_data_key,
    open_replay_result,
    redact_divergence_event,
    seal,
    seal_replay_result,
)
from tests.replayer.support import FakeLane
from tests.replayer.test_service import greedy


def a_result(diverge_at: int | None = 1) -> ReplayResult:
    lane = FakeLane()
    env = greedy(3, lane, diverge_at=diverge_at)
    return replay_envelope(env, lane, ReplayerSettings(metrics_port=None))


def test_a_sealed_result_opens_only_with_its_key_and_metadata() -> None:
    result, key = a_result(), new_data_key()
    sealed = seal_replay_result(result, tenant="acme", key_id="k1", data_key=key)
    assert sealed.result_id == result.event.result_id()
    assert open_replay_result(decode_sealed_result(sealed.canonical()), key) == result
    with pytest.raises(SealError, match="authentication failed"):
        open_replay_result(sealed, new_data_key())
    for field, value in (("tenant", "other"), ("key_id", "k2"), ("request_id", "req-other")):
        with pytest.raises(SealError, match="authentication failed"):
            open_replay_result(sealed.model_copy(update={field: value}), key)


def test_a_sealed_result_cannot_be_passed_off_as_another_result() -> None:
    """Re-sealed under the right key but with another result's ids: the plaintext does not match the metadata."""
    result, key = a_result(), new_data_key()
    other = a_result(diverge_at=None)
    forged = seal_replay_result(result, tenant="acme", key_id="k1", data_key=key)
    draft = forged.model_copy(update={"result_id": other.event.result_id(), "nonce": "AAAA", "ciphertext": "AAAA"})
    blob = seal(canonical_bytes(result), key, draft.aad())
    forged = draft.model_copy(update={"nonce": b64e(blob.nonce), "ciphertext": b64e(blob.ciphertext)})
    with pytest.raises(SealError, match="the plaintext is another result"):
        open_replay_result(forged, key)


def test_redaction_keeps_numbers_and_drops_every_token() -> None:
    event = a_result().event
    assert event.first_divergence is not None
    redacted = redact_divergence_event(event)
    fork = redacted.first_divergence
    assert fork is not None
    text = redacted.model_dump_json()
    for step in (event.first_divergence.at, event.first_divergence.before):
        assert step is not None
        for candidate in (*step.recorded_top, *step.replayed_top):
            assert f'"token":{json.dumps(candidate.token)}' not in text
    assert '"token_id"' not in text
    assert (fork.position, fork.near_tie, fork.at.recorded_margin) == (
        event.first_divergence.position,
        event.first_divergence.near_tie,
        event.first_divergence.at.recorded_margin,
    )
    assert redacted.model_copy(update={"first_divergence": None}) == event.model_copy(update={"first_divergence": None})
    bitwise = a_result(diverge_at=None).event
    assert redact_divergence_event(bitwise) == bitwise  # nothing to redact without a fork
