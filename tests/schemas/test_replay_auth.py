"""Signed replay requests (`schemas.replay_auth`): only a fresh request signed by a known key with the replay role
verifies; anything changed after signing, another secret, an unknown key or an old request does not."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from schemas import ReplayRequest, decode_replay_request
from schemas.canonical import canonical_bytes
from schemas.replay_auth import ReplayRequestKey, sign_replay_request, verify_replay_request

SECRET = b"s" * 32
KEYS = {"ops": ReplayRequestKey(SECRET, frozenset({"replay"})), "reader": ReplayRequestKey(b"r" * 32, frozenset())}
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def request(**overrides: object) -> ReplayRequest:
    return ReplayRequest.model_validate({"request_id": "rl-1", "reply_to": "ticket-7", **overrides})


def test_a_signed_request_verifies_and_survives_the_wire() -> None:
    good = sign_replay_request(request(), "ops", SECRET, now=NOW)
    assert (good.key_id, good.requested_at) == ("ops", NOW)
    assert verify_replay_request(good, KEYS, NOW + timedelta(seconds=299)) is None
    assert verify_replay_request(decode_replay_request(good.model_dump_json()), KEYS, NOW) is None


def test_an_unsigned_request_keeps_its_bytes() -> None:
    """The new fields are optional and left out when None: existing requests encode as before."""
    assert (
        canonical_bytes(request())
        == b'{"reply_to":"ticket-7","request_id":"rl-1","schema_version":"reprolane.replay/1"}'
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"request_id": "rl-2"}, "bad signature for key id 'ops'"),
        ({"lane": "transformers"}, "bad signature"),
        ({"reply_to": "ticket-8"}, "bad signature"),
        ({"requested_at": NOW + timedelta(seconds=1)}, "bad signature"),
        ({"key_id": "reader"}, "bad signature for key id 'reader'"),
        ({"key_id": "nobody"}, "unknown key id 'nobody'"),
        ({"signature": None}, "not signed"),
        ({"key_id": None}, "not signed"),
    ],
)
def test_a_tampered_or_incomplete_request_is_refused(change: dict[str, object], reason: str) -> None:
    tampered = sign_replay_request(request(), "ops", SECRET, now=NOW).model_copy(update=change)
    refused = verify_replay_request(tampered, KEYS, NOW)
    assert refused is not None
    assert reason in refused


def test_a_wrong_secret_is_refused() -> None:
    assert "bad signature" in (verify_replay_request(sign_replay_request(request(), "ops", b"x" * 32), KEYS) or "")


def test_an_old_or_future_request_is_refused_outside_the_window() -> None:
    good = sign_replay_request(request(), "ops", SECRET, now=NOW)
    assert "outside the 300 s window" in (verify_replay_request(good, KEYS, NOW + timedelta(seconds=301)) or "")
    assert "outside" in (verify_replay_request(good, KEYS, NOW - timedelta(seconds=301)) or "")
    assert verify_replay_request(good, KEYS, NOW + timedelta(seconds=1000), window_s=3600) is None


def test_a_key_without_the_replay_role_is_refused() -> None:
    signed = sign_replay_request(request(), "reader", b"r" * 32, now=NOW)
    assert verify_replay_request(signed, KEYS, NOW) == "key id 'reader' lacks the 'replay' role"


def test_the_key_never_shows_its_secret() -> None:
    assert SECRET.decode() not in repr(KEYS["ops"])
