"""Sealed envelopes: per-tenant encryption of stored records, so that destroying a key shreds the records.

An encrypted tenant's envelope leaves the capture side as a `SealedEnvelope` instead of the plaintext envelope:
AES-256-GCM (through `cryptography`) of its bytes (canonical JSON, or their compact form:
`schemas.envelope_compact`) under the tenant's *data key*, with the record's metadata as additional authenticated
data. Everything outside ``ciphertext`` is non-sensitive routing metadata (ids, tenant, capture time, workflow
position, key id); prompt, output, model and runtime live only in the ciphertext. ``envelope_id`` is the sha256 of
the *plaintext* canonical envelope, so S3 keys, Kafka headers and the replay idempotency key are the same whether a
tenant is encrypted or not, and `open_envelope` checks it.

Data keys are stored wrapped (`WrappedKey`): AES-256-GCM under a key-encryption key (KEK) from the configured key
source, with the tenant and key id as AAD, so a wrapped key copied to another tenant's name does not unwrap.
Crypto-shredding = deleting every stored version of a tenant's wrapped keys: the write-once records stay where
they are, and nobody can read them again.

What the replayer derives from an encrypted tenant's envelope is sealed the same way, under the same data key:
a replay result (the replayed text, token ids and logprobs) is stored as a `SealedReplayResult`, and the
divergence event published to Kafka is `redact_divergence_event`'s copy, with every token of the fork (ids,
text, top-k) left out: numbers and ids only, which the dashboards and the audit lake need. The full event lives
in the sealed result. So a shred leaves no plaintext of the tenant in S3, and none on the divergence topic.

Pure: no IO. Randomness (nonces, new data keys) comes from `os.urandom`.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from datetime import datetime
from typing import Annotated, Final, Literal, NamedTuple, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import Field

from schemas.base import Record, UtcDatetime, decode_record, has_schema_version
from schemas.canonical import canonical_bytes, canonical_json, sha256_hex
from schemas.envelope import RequestId, Sha256, WorkflowRef
from schemas.envelope_compact import envelope_bytes
from schemas.errors import ContractError, SealError
from schemas.replay import DivergenceEvent, ReplayResult, StepCandidates, decode_replay_result

SEALED_SCHEMA_VERSION: Final = "reprolane.sealed/1"
SEALED_RESULT_SCHEMA_VERSION: Final = "reprolane.sealed-result/1"
WRAPPED_KEY_SCHEMA_VERSION: Final = "reprolane.wrapped-key/1"
KEY_BYTES: Final = 32  # AES-256
NONCE_BYTES: Final = 12

_KEY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
KeyId = Annotated[str, Field(pattern=_KEY_ID_RE.pattern)]
B64 = Annotated[str, Field(min_length=4, pattern=r"^[A-Za-z0-9+/]+={0,2}$")]


def b64e(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64d(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SealError(f"{what} is not valid base64") from exc


def is_valid_key_id(value: str) -> bool:
    return bool(_KEY_ID_RE.match(value))


def new_data_key() -> bytes:
    return os.urandom(KEY_BYTES)


def kek_id(kek: bytes) -> str:
    """A short public name of a KEK (sha256 prefix of a domain-separated hash): tells which KEK wrapped a key."""
    return sha256_hex(b"reprolane.kek-id/1\x00" + kek)[:16]


def parse_kek(text: str) -> bytes:
    """A KEK from its base64 text (a file's content or a setting); exactly 32 bytes or `SealError`."""
    key = b64d(text.strip(), "the key-encryption key")
    if len(key) != KEY_BYTES:
        raise SealError(f"the key-encryption key must be {KEY_BYTES} bytes (base64), not {len(key)}")
    return key


# -- low level: one AEAD seal ----------------------------------------------------------------------------------


class SealedBlob(NamedTuple):
    nonce: bytes
    ciphertext: bytes  # with the 16-byte GCM tag appended


def _check_key(key: bytes, what: str) -> None:
    if len(key) != KEY_BYTES:
        raise SealError(f"{what} must be {KEY_BYTES} bytes, not {len(key)}")


def seal(plaintext: bytes, data_key: bytes, aad: bytes) -> SealedBlob:
    """AES-256-GCM of `plaintext` with a fresh random 96-bit nonce, authenticating `aad` too."""
    _check_key(data_key, "a data key")
    nonce = os.urandom(NONCE_BYTES)
    return SealedBlob(nonce, AESGCM(data_key).encrypt(nonce, plaintext, aad))


def open_sealed(blob: SealedBlob, data_key: bytes, aad: bytes) -> bytes:
    """The plaintext, or `SealError` when the key, the aad, the nonce or the ciphertext is not the sealed one."""
    _check_key(data_key, "a data key")
    if len(blob.nonce) != NONCE_BYTES:
        raise SealError(f"nonce must be {NONCE_BYTES} bytes, not {len(blob.nonce)}")
    try:
        return AESGCM(data_key).decrypt(blob.nonce, blob.ciphertext, aad)
    except InvalidTag:
        raise SealError("authentication failed: wrong key, or the record or its metadata was altered") from None


# -- wrapped data keys -----------------------------------------------------------------------------------------


class WrappedKey(Record):
    """A tenant's data key wrapped by a KEK: what the key store holds (``keys/tenant=T/<key_id>.json``)."""

    schema_version: Literal["reprolane.wrapped-key/1"] = WRAPPED_KEY_SCHEMA_VERSION
    tenant: RequestId
    key_id: KeyId
    kek_id: str = Field(pattern=r"^[0-9a-f]{16}$")
    created_at: datetime
    algorithm: Literal["AES-256-GCM"] = "AES-256-GCM"
    nonce: B64
    wrapped: B64

    def _aad(self) -> bytes:
        return canonical_json({"purpose": WRAPPED_KEY_SCHEMA_VERSION, "tenant": self.tenant, "key_id": self.key_id})


def wrap_key(data_key: bytes, kek: bytes, *, tenant: str, key_id: str, created_at: datetime) -> WrappedKey:
    _check_key(kek, "the key-encryption key")
    _check_key(data_key, "a data key")
    draft = WrappedKey(
        tenant=tenant, key_id=key_id, kek_id=kek_id(kek), created_at=created_at, nonce="AAAA", wrapped="AAAA"
    )
    blob = seal(data_key, kek, draft._aad())
    return draft.model_copy(update={"nonce": b64e(blob.nonce), "wrapped": b64e(blob.ciphertext)})


def unwrap_key(wrapped: WrappedKey, kek: bytes) -> bytes:
    """The data key; `SealError` naming the KEK mismatch when another KEK wrapped it."""
    _check_key(kek, "the key-encryption key")
    if wrapped.kek_id != kek_id(kek):
        raise SealError(
            f"data key {wrapped.key_id} of tenant {wrapped.tenant} was wrapped by KEK {wrapped.kek_id}, "
            f"not by the configured KEK {kek_id(kek)}"
        )
    blob = SealedBlob(b64d(wrapped.nonce, "nonce"), b64d(wrapped.wrapped, "wrapped key"))
    key = open_sealed(blob, kek, wrapped._aad())
    _check_key(key, "an unwrapped data key")
    return key


def decode_wrapped_key(data: bytes | str) -> WrappedKey:
    return decode_record(WrappedKey, "wrapped key", data)


# -- sealed envelopes ------------------------------------------------------------------------------------------


class _Sealed(Record):
    """What a sealed record is besides its fields: the metadata outside ``nonce`` and ``ciphertext`` is
    authenticated (`aad`), and its stored bytes are its canonical encoding."""

    def aad(self) -> bytes:
        """The authenticated metadata: every field but the nonce and the ciphertext, canonically encoded."""
        return canonical_bytes(self, exclude={"nonce", "ciphertext"})

    def canonical(self) -> bytes:
        return canonical_bytes(self)


_S = TypeVar("_S", "SealedEnvelope", "SealedReplayResult")


def _sealed_as(draft: _S, plaintext: bytes, data_key: bytes) -> _S:
    """`draft` (its metadata set, ``nonce`` and ``ciphertext`` placeholders) with `plaintext` sealed under
    `data_key`, the metadata as authenticated data."""
    blob = seal(plaintext, data_key, draft.aad())
    return draft.model_copy(update={"nonce": b64e(blob.nonce), "ciphertext": b64e(blob.ciphertext)})


def _plaintext_of(sealed: SealedEnvelope | SealedReplayResult, data_key: bytes) -> bytes:
    """The plaintext of a sealed record, or `SealError` when it does not open under `data_key` with its metadata."""
    blob = SealedBlob(b64d(sealed.nonce, "nonce"), b64d(sealed.ciphertext, "ciphertext"))
    return open_sealed(blob, data_key, sealed.aad())


class SealedEnvelope(_Sealed):
    """An envelope encrypted under its tenant's data key; only non-sensitive metadata outside ``ciphertext``."""

    schema_version: Literal["reprolane.sealed/1"] = SEALED_SCHEMA_VERSION
    request_id: RequestId
    envelope_id: Sha256 = Field(description="sha256 of the plaintext canonical envelope")
    tenant: RequestId
    captured_at: UtcDatetime
    workflow: WorkflowRef | None = None
    key_id: KeyId
    algorithm: Literal["AES-256-GCM"] = "AES-256-GCM"
    nonce: B64
    ciphertext: B64


def seal_envelope(
    plaintext: bytes,
    *,
    request_id: str,
    tenant: str,
    captured_at: datetime,
    workflow: WorkflowRef | None,
    key_id: str,
    data_key: bytes,
) -> SealedEnvelope:
    """Seal an envelope's bytes, canonical JSON or compact (the caller passes the routing metadata it already
    parsed; ``envelope_id`` is the canonical bytes' hash either way)."""
    draft = SealedEnvelope(
        request_id=request_id,
        envelope_id=sha256_hex(envelope_bytes(plaintext)),
        tenant=tenant,
        captured_at=captured_at,
        workflow=workflow,
        key_id=key_id,
        nonce="AAAA",
        ciphertext="AAAA",
    )
    return _sealed_as(draft, plaintext, data_key)


def open_envelope(sealed: SealedEnvelope, data_key: bytes) -> bytes:
    """The plaintext canonical envelope bytes (its sha256 checked against ``envelope_id``), or `SealError`. The
    sealed plaintext is canonical JSON or, since compact envelopes, their compact form (`envelope_bytes`)."""
    try:
        plaintext = envelope_bytes(_plaintext_of(sealed, data_key))
    except ContractError as exc:
        raise SealError(f"sealed envelope {sealed.envelope_id}: the plaintext is a corrupt compact envelope") from exc
    if sha256_hex(plaintext) != sealed.envelope_id:
        raise SealError(f"sealed envelope {sealed.envelope_id}: the plaintext does not hash to its envelope id")
    return plaintext


# -- sealed replay results and redacted divergence events -----------------------------------------------------


class SealedReplayResult(_Sealed):
    """A replay result encrypted under its tenant's data key; outside ``ciphertext`` only the ids that place it."""

    schema_version: Literal["reprolane.sealed-result/1"] = SEALED_RESULT_SCHEMA_VERSION
    result_id: Sha256
    request_id: RequestId
    envelope_id: Sha256
    lane_fingerprint_sha256: Sha256
    tenant: RequestId
    key_id: KeyId
    algorithm: Literal["AES-256-GCM"] = "AES-256-GCM"
    nonce: B64
    ciphertext: B64


def seal_replay_result(result: ReplayResult, *, tenant: str, key_id: str, data_key: bytes) -> SealedReplayResult:
    """Seal a replay result (its canonical JSON) under the tenant's data key, its ids as authenticated data."""
    event = result.event
    draft = SealedReplayResult(
        result_id=event.result_id(),
        request_id=event.request_id,
        envelope_id=event.envelope_id,
        lane_fingerprint_sha256=event.lane_fingerprint_sha256,
        tenant=tenant,
        key_id=key_id,
        nonce="AAAA",
        ciphertext="AAAA",
    )
    return _sealed_as(draft, canonical_bytes(result), data_key)


def open_replay_result(sealed: SealedReplayResult, data_key: bytes) -> ReplayResult:
    """The replay result, or `SealError` when it does not open or is not the result its metadata names."""
    plaintext = _plaintext_of(sealed, data_key)
    try:
        result = decode_replay_result(plaintext)
    except ContractError as exc:
        raise SealError(f"sealed replay result {sealed.result_id}: the plaintext is not a replay result") from exc
    event = result.event
    if (event.result_id(), event.request_id, event.envelope_id) != (
        sealed.result_id,
        sealed.request_id,
        sealed.envelope_id,
    ):
        raise SealError(f"sealed replay result {sealed.result_id}: the plaintext is another result")
    return result


def redact_divergence_event(event: DivergenceEvent) -> DivergenceEvent:
    """The event an encrypted tenant's replay publishes: the fork's position, margins and near-tie flag stay,
    its tokens (chosen ids, top-k ids and text) go. Every other field is numbers, ids and lane metadata."""
    first = event.first_divergence
    if first is None:
        return event

    def bare(step: StepCandidates) -> StepCandidates:
        return step.model_copy(
            update={"recorded_token_id": None, "replayed_token_id": None, "recorded_top": (), "replayed_top": ()}
        )

    before = None if first.before is None else bare(first.before)
    redacted = first.model_copy(update={"at": bare(first.at), "before": before})
    return event.model_copy(update={"first_divergence": redacted})


# -- stored bytes: which sealed record they hold, decoded -------------------------------------------------------


def is_sealed(data: bytes | str) -> bool:
    """True when `data` is JSON of a sealed envelope (by its schema version); never raises."""
    return has_schema_version(data, SEALED_SCHEMA_VERSION)


def is_sealed_result(data: bytes | str) -> bool:
    """True when `data` is JSON of a sealed replay result (by its schema version); never raises."""
    return has_schema_version(data, SEALED_RESULT_SCHEMA_VERSION)


def decode_sealed(data: bytes | str) -> SealedEnvelope:
    """A sealed envelope's record (`ContractError`, naming the field, when it is not one)."""
    return decode_record(SealedEnvelope, "sealed envelope", data)


def decode_sealed_result(data: bytes | str) -> SealedReplayResult:
    """A sealed replay result's record (`ContractError`, naming the field, when it is not one)."""
    return decode_record(SealedReplayResult, "sealed replay result", data)
