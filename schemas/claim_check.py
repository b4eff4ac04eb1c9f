"""The claim check: what Kafka carries instead of a record too large for it.

A Kafka record is bounded (`schemas.layout.MAX_MESSAGE_BYTES`, the topics' ``max.message.bytes``); an envelope is
not (n completions of thousands of tokens with top-k logprobs, or a large prompt escaped twice). An envelope over
`schemas.layout.CLAIM_CHECK_BYTES` is stored whole in S3 as usual (its envelope object) and the envelope topic
carries a `ClaimCheck` instead: where the object is, how long it is and its sha256, with the header
`schemas.layout.HEADER_CLAIM_CHECK`. A consumer reads the object and checks length and sha256 before it uses the
bytes (`verify_claimed`), so a reference cannot make it trust bytes other than those the publisher stored, and
a reference names only the envelope object of its own envelope id (checked when it is decoded).

``sha256`` is of the stored bytes (a sealed tenant's stored bytes are the sealed record, so it differs from
``envelope_id``, which is always the plaintext's hash). Pure: no IO.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Final, Literal

from pydantic import Field, model_validator

from schemas.base import Record, decode_record, has_schema_version
from schemas.envelope import Sha256
from schemas.errors import ContractError
from schemas.layout import ENVELOPES_PREFIX, envelope_id_of_key, is_envelope_key

CLAIM_CHECK_SCHEMA_VERSION: Final = "reprolane.claim-check/1"
#: A reference is a few hundred bytes; anything longer on the topic is not one (and is never parsed as one).
_MAX_REFERENCE_BYTES: Final = 4096
_MARK: Final = CLAIM_CHECK_SCHEMA_VERSION.encode()  # a substring test first: most values are not references


class ClaimCheck(Record):
    """A reference to an envelope object in the audit bucket, in place of the envelope on the topic."""

    schema_version: Literal["reprolane.claim-check/1"] = CLAIM_CHECK_SCHEMA_VERSION
    envelope_id: Sha256
    key: Annotated[str, Field(min_length=1, max_length=1024)]
    size: Annotated[int, Field(ge=0)]
    sha256: Sha256

    @model_validator(mode="after")
    def _names_its_envelope_object(self) -> ClaimCheck:
        """Only an envelope object, and only the one of this envelope id: a reference cannot point a consumer at
        an index entry, a replay result or another envelope."""
        if not (self.key.startswith(ENVELOPES_PREFIX) and is_envelope_key(self.key)):
            raise ValueError(f"key {self.key!r} is not an envelope object key")
        if envelope_id_of_key(self.key) != self.envelope_id:
            raise ValueError(f"key {self.key!r} does not name envelope {self.envelope_id}")
        return self

    def encode(self) -> bytes:
        return self.model_dump_json().encode("utf-8")


def claim_check_for(envelope_id: str, key: str, stored: bytes) -> ClaimCheck:
    """The reference to `stored` (the bytes written under `key`)."""
    return ClaimCheck(envelope_id=envelope_id, key=key, size=len(stored), sha256=hashlib.sha256(stored).hexdigest())


def is_claim_check(data: bytes | None) -> bool:
    """True when a topic value is a claim check (by its schema version); never raises."""
    if data is None or len(data) > _MAX_REFERENCE_BYTES or _MARK not in data:
        return False
    return has_schema_version(data, CLAIM_CHECK_SCHEMA_VERSION)


def decode_claim_check(data: bytes | str) -> ClaimCheck:
    return decode_record(ClaimCheck, "invalid claim check", data)


def verify_claimed(ref: ClaimCheck, stored: bytes) -> bytes:
    """`stored` when it is exactly the bytes `ref` names (length and sha256); `ContractError` otherwise."""
    if len(stored) != ref.size:
        raise ContractError(f"claim check {ref.key}: object is {len(stored)} bytes, the reference says {ref.size}")
    digest = hashlib.sha256(stored).hexdigest()
    if digest != ref.sha256:
        raise ContractError(f"claim check {ref.key}: object sha256 {digest} is not the referenced {ref.sha256}")
    return stored
