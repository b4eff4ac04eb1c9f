"""The claim-check reference: it names only its own envelope object, and verifies exactly the referenced bytes."""

from __future__ import annotations

import pytest

from schemas import ContractError
from schemas.claim_check import claim_check_for, decode_claim_check, is_claim_check, verify_claimed
from schemas.layout import envelope_key, request_index_key
from tests.factories import envelope


def test_a_reference_round_trips_and_verifies_its_bytes() -> None:
    env = envelope()
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    ref = claim_check_for(env.envelope_id(), key, env.canonical())
    encoded = ref.encode()
    assert is_claim_check(encoded)
    assert decode_claim_check(encoded) == ref
    assert verify_claimed(ref, env.canonical()) == env.canonical()
    with pytest.raises(ContractError, match="bytes"):
        verify_claimed(ref, env.canonical()[:-1])
    with pytest.raises(ContractError, match="sha256"):
        verify_claimed(ref, env.canonical()[:-1] + b" ")


def test_envelopes_and_garbage_are_not_references() -> None:
    assert not is_claim_check(envelope().canonical())
    assert not is_claim_check(None)
    assert not is_claim_check(b"reprolane.claim-check/1 but not json")
    assert not is_claim_check(b'{"schema_version": "reprolane.claim-check/1"' + b" " * 5000 + b"}")


def test_a_reference_names_only_the_envelope_object_of_its_own_id() -> None:
    env, other = envelope(), envelope(request_id="someone-else")
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    forged = (
        claim_check_for(env.envelope_id(), key, b"x")
        .encode()
        .replace(env.envelope_id().encode(), other.envelope_id().encode(), 1)
    )  # the envelope_id field only: the key still names env
    with pytest.raises(ContractError, match="does not name envelope"):
        decode_claim_check(forged)
    with pytest.raises(ValueError, match="not an envelope object key"):
        claim_check_for(env.envelope_id(), request_index_key(env.request_id), b"x")
