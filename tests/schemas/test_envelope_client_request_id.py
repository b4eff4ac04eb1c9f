"""``client_request_id`` (issue 18): the client's own X-Request-Id, recorded beside the sidecar's request id.

Absent (None) it is left out of the canonical bytes, so every envelope written before the field existed keeps
its id (golden/envelope_v1.json, pinned in test_envelope.py); set, it is part of the identity, pinned here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import decode_envelope
from tests.factories import envelope
from tests.schemas.test_envelope import GOLDEN_ENVELOPE_ID

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_WITH_CLIENT_ID = "a4e292eef99f61d459b8cfd628057ea475bfc810104af601cf0f1b13371de009"


def test_without_a_client_id_the_bytes_and_id_are_unchanged() -> None:
    env = envelope()
    assert env.client_request_id is None
    assert b"client_request_id" not in env.canonical()
    assert env.canonical() == (GOLDEN / "envelope_v1.json").read_bytes()
    assert env.envelope_id() == GOLDEN_ENVELOPE_ID


def test_golden_vector_with_a_client_id() -> None:
    env = envelope(client_request_id="loan-4711")
    expected = (GOLDEN / "envelope_v1_client_request_id.json").read_bytes()
    assert env.canonical() == expected
    assert env.envelope_id() == GOLDEN_WITH_CLIENT_ID
    assert b'"client_request_id":"loan-4711"' in expected
    assert decode_envelope(expected) == env


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "-leading"])
def test_a_client_id_is_a_bounded_id(bad: str) -> None:
    with pytest.raises(ValidationError):
        envelope(client_request_id=bad)
