"""Sealed envelopes and wrapped keys: round trips, and every way a wrong key or altered byte must fail."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from schemas import ContractError, decode_envelope
from schemas.envelope_compact import encode_compact
from schemas.errors import SealError
from schemas.sealed import (
    SealedBlob,
    SealedEnvelope,
    decode_sealed,
    decode_wrapped_key,
    is_sealed,
    new_data_key,
    open_envelope,
    open_sealed,
    parse_kek,
    seal,
    seal_envelope,
    unwrap_key,
    wrap_key,
)
from tests.factories import envelope

NOW = datetime(2026, 7, 14, 10, 0, tzinfo=UTC)


def sealed_fixture(key: bytes, *, compact: bool = False) -> tuple[bytes, object]:
    """The canonical bytes of the factory envelope, and those bytes (or their compact form) sealed under `key`."""
    env = envelope()
    canonical = env.canonical()
    plaintext = encode_compact(canonical) if compact else canonical
    assert plaintext is not None
    sealed = seal_envelope(
        plaintext,
        request_id=env.request_id,
        tenant=env.tenant,
        captured_at=env.captured_at,
        workflow=env.workflow,
        key_id="k1",
        data_key=key,
    )
    return canonical, sealed


def test_seal_open_round_trip_with_fresh_nonces() -> None:
    key = new_data_key()
    a, b = seal(b"secret", key, b"aad"), seal(b"secret", key, b"aad")
    assert a.nonce != b.nonce
    assert a.ciphertext != b.ciphertext
    assert open_sealed(a, key, b"aad") == b"secret"


@pytest.mark.parametrize("what", ["key", "aad", "ciphertext", "nonce"])
def test_wrong_key_aad_or_any_altered_byte_fails(what: str) -> None:
    key = new_data_key()
    blob = seal(b"secret prompt", key, b"aad")
    other_key, aad = key, b"aad"
    if what == "key":
        other_key = new_data_key()
    elif what == "aad":
        aad = b"aae"
    elif what == "ciphertext":
        blob = SealedBlob(blob.nonce, bytes([blob.ciphertext[0] ^ 1]) + blob.ciphertext[1:])
    else:
        blob = SealedBlob(bytes([blob.nonce[0] ^ 1]) + blob.nonce[1:], blob.ciphertext)
    with pytest.raises(SealError, match="authentication failed"):
        open_sealed(blob, other_key, aad)


def test_a_key_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(SealError, match="32 bytes"):
        seal(b"x", b"short", b"")


def test_sealed_envelope_round_trip_keeps_only_metadata_outside() -> None:
    key = new_data_key()
    canonical, sealed = sealed_fixture(key)
    data = sealed.canonical()  # type: ignore[attr-defined]
    assert is_sealed(data)
    assert not is_sealed(canonical)
    assert not is_sealed(b"not json")
    for secret in (b"Paris", b"smollm2", b"9690", b"vllm"):  # output text, model, prompt ids, runtime
        assert secret not in data
    back = decode_sealed(data)
    plain = open_envelope(back, key)
    assert plain == canonical
    assert decode_envelope(plain).envelope_id() == back.envelope_id


@pytest.mark.parametrize(
    ("field", "value"), [("tenant", "other-tenant"), ("request_id", "req-other"), ("key_id", "k2")]
)
def test_altered_metadata_does_not_open(field: str, value: str) -> None:
    key = new_data_key()
    _, sealed = sealed_fixture(key)
    forged = sealed.model_copy(update={field: value})  # type: ignore[attr-defined]
    with pytest.raises(SealError):
        open_envelope(forged, key)


def test_decode_sealed_names_the_bad_field() -> None:
    key = new_data_key()
    _, sealed = sealed_fixture(key)
    doc = sealed.model_dump(mode="json")  # type: ignore[attr-defined]
    doc["key_id"] = "bad key id!"
    import json

    with pytest.raises(ContractError) as info:
        decode_sealed(json.dumps(doc))
    assert "key_id" in info.value.fields


def test_wrap_unwrap_round_trip_and_kek_mismatch() -> None:
    kek, data_key = new_data_key(), new_data_key()
    wrapped = wrap_key(data_key, kek, tenant="acme", key_id="k1", created_at=NOW)
    assert base64.b64decode(wrapped.wrapped) != data_key
    assert unwrap_key(decode_wrapped_key(wrapped.model_dump_json()), kek) == data_key
    with pytest.raises(SealError, match="not by the configured KEK"):
        unwrap_key(wrapped, new_data_key())


def test_a_wrapped_key_moved_to_another_tenant_does_not_unwrap() -> None:
    kek = new_data_key()
    wrapped = wrap_key(new_data_key(), kek, tenant="acme", key_id="k1", created_at=NOW)
    with pytest.raises(SealError, match="authentication failed"):
        unwrap_key(wrapped.model_copy(update={"tenant": "globex"}), kek)


def test_parse_kek() -> None:
    kek = new_data_key()
    assert parse_kek(base64.b64encode(kek).decode() + "\n") == kek
    with pytest.raises(SealError, match="32 bytes"):
        parse_kek(base64.b64encode(b"short").decode())
    with pytest.raises(SealError, match="base64"):
        parse_kek("not base64 !!")


def test_a_compact_envelope_sealed_opens_to_its_canonical_bytes() -> None:
    """The sidecar seals what it stores: the compact form (`schemas.envelope_compact`); the id is still the
    canonical bytes' hash, and opening gives those bytes back."""
    key = new_data_key()
    canonical, sealed = sealed_fixture(key, compact=True)
    assert isinstance(sealed, SealedEnvelope)
    assert sealed.envelope_id == envelope().envelope_id()
    assert len(sealed.ciphertext) < len(canonical)  # base64 of the compact bytes, smaller than the JSON
    assert open_envelope(sealed, key) == canonical
