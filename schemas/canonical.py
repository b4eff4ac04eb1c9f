"""Canonical encoding: the deterministic bytes that identities are computed from.

The rule, stated once so that any language can reproduce it:

    UTF-8 JSON of the model's JSON-mode dump with null-valued fields left out, object keys sorted, no
    insignificant whitespace (separators "," and ":"), non-ASCII characters written as themselves, floats in
    their shortest round-trip form (Python's repr), NaN and infinities refused.

Field order in the Python class therefore never matters, and because nulls are omitted, adding an optional
field (default ``None``) changes the identity of only the records that set it. Consequently every optional
field of a contract record must default to ``None``, so that "absent" and "null" decode to the same record.
The golden vectors in tests/schemas pin the result byte for byte.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from schemas.errors import ContractError


def canonical_json(data: Any) -> bytes:
    """Encode JSON-compatible data canonically (see module docstring)."""
    try:
        text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as exc:  # NaN / inf
        raise ContractError(f"cannot encode canonically: {exc}") from exc
    return text.encode("utf-8")


def canonical_bytes(model: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    """Canonical bytes of a contract model (optionally without some top-level fields)."""
    return canonical_json(model.model_dump(mode="json", exclude=exclude, exclude_none=True))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
