"""Canonical encoding: the deterministic bytes that identities are computed from.

The rule, stated once so that any language can reproduce it:

    UTF-8 JSON of the model's JSON-mode dump with null-valued fields left out, object keys sorted, no
    insignificant whitespace (separators "," and ":"), non-ASCII characters written as themselves, floats in
    their shortest round-trip form (Python's repr), NaN and infinities refused.

Field order in the Python class therefore never matters, and because nulls are omitted, adding an optional
field (default ``None``) changes the identity of only the records that set it. Consequently every optional
field of a contract record must default to ``None``, so that "absent" and "null" decode to the same record.
The golden vectors in tests/schemas pin the result byte for byte.

The reference implementation is `canonical_bytes` (``json.dumps`` of ``model_dump(mode="json")``). Faster
encoders were measured and not used because their float text differs: pydantic-core's JSON writes
``[1e-7,0.00001,1e+16]`` and msgspec/orjson ``[1e-7,0.00001,1e16]`` where the rule says ``[1e-07,1e-05,1e+16]``
(re-parsing pydantic's JSON and re-encoding it gives the right bytes, but is ~1.5x slower than the reference).
They differ only in *how* they write the digits, never in which digits: both write the shortest decimal that
reads back as the same double, and msgspec escapes strings and sorts keys exactly as ``json.dumps`` does; an
envelope is written by msgspec on that basis wherever its floats allow (see `MSGSPEC_TEXT_IS_CANONICAL`).
`canonical_object_with` lets a record encode one large member itself (see `schemas.envelope_codec`), exactly.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

import msgspec
from pydantic import BaseModel

from schemas.errors import ContractError

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
encode_string = json.encoder.encode_basestring
"""Canonical text of one string (quoted, escaped as `json.dumps` with ``ensure_ascii=False`` escapes it)."""


# Values whose text must be checked at start-up: the edges of the plain-decimal range and digit-heavy values.
_PROBES: Final = (
    *(0.0, -0.0, 1e-4, -1e-4, 0.00010000000000000002, 9999999999999998.0, -9999999999999998.0, 0.1, 0.2),
    *(-0.0013790050288662314, -1.3609765531356006, 123456.789, 2.5, 1 / 3, -2 / 3, 1e15 + 0.3),
)
# Every ASCII character, the ones JSON encoders are tempted to escape, and characters outside the BMP.
_PROBE_TEXT: Final = "".join(map(chr, range(128))) + "\u00e9\u2028\u2029\ufeff\uffff\u4e2d\U0001f600\U0010ffff"


_SORTED: Final = msgspec.json.Encoder(order="sorted").encode
_PROBE_DOC: Final = {"b": [1, {"z": None, "y": 2.5, "\u00e9": "x"}], "a": {"\U0001f600": 1, "Z": -0.0, "e\x00": 2**70}}


def _msgspec_text_is_canonical() -> bool:
    """Whether msgspec writes strings exactly as `encode_string`, plain-decimal floats exactly as ``repr``, and
    objects with sorted keys exactly as the canonical encoder (checked once at import: a msgspec that ever
    writes them differently is simply not used)."""
    encode = msgspec.json.Encoder().encode
    values = list(_PROBES)
    floats_alike = encode(values).decode("ascii")[1:-1].split(",") == [repr(v) for v in values]
    strings_alike = encode(_PROBE_TEXT).decode("utf-8") == encode_string(_PROBE_TEXT)
    return floats_alike and strings_alike and _SORTED(_PROBE_DOC).decode("utf-8") == _ENCODER.encode(_PROBE_DOC)


MSGSPEC_TEXT_IS_CANONICAL: Final = _msgspec_text_is_canonical()
"""msgspec's JSON text of strings, of 0 and floats of magnitude in [1e-4, 1e16), and of objects with sorted keys
is the canonical text.

Both it and ``repr`` write the shortest digits that read back as the same double; they spell them alike in that
range, while elsewhere ``repr`` writes an exponent (``1e-05``, ``1e+16``) where msgspec writes ``0.00001`` /
``1e16``. Its string escaping is `encode_string`'s for every code point (tests/schemas/test_canonical.py checks
both on 200k random doubles and on all of Unicode). `canonical_text_of_plain` and
`schemas.envelope_codec.steps_canonical_text` rely on it.
"""


def is_plain_float(value: float) -> bool:
    """Whether msgspec writes `value` as ``repr`` does: 0, or a magnitude in [1e-4, 1e16) (False for NaN, inf)."""
    return -1e16 < value <= -1e-4 or value == 0 or 1e-4 <= value < 1e16


def canonical_text_of_plain(data: Any) -> str:
    """`canonical_text` of JSON-mode data whose every float `is_plain_float` (the caller knows it: nothing here
    checks), written by msgspec with sorted keys in one C call, several times faster than the generic path
    (benchmarks/bench_envelope.py)."""
    if not MSGSPEC_TEXT_IS_CANONICAL:
        return canonical_text(data)
    return _SORTED(data).decode("utf-8")


def canonical_text(data: Any) -> str:
    """The canonical encoding as text (not yet UTF-8 encoded)."""
    try:
        return _ENCODER.encode(data)
    except ValueError as exc:  # NaN / inf
        raise ContractError(f"cannot encode canonically: {exc}") from exc


def canonical_json(data: Any) -> bytes:
    """Encode JSON-compatible data canonically (see module docstring)."""
    return canonical_text(data).encode("utf-8")


def canonical_object_with(members: dict[str, Any], key: str, raw: str) -> str:
    """Canonical text of the object `members` plus member `key` (replacing one of that name) whose value is
    given as canonical text `raw`.

    Exact by construction: a canonical object is its members' ``"key":value`` texts in sorted key order joined
    by ``,``, so the members sorting before `key` and those after it are each encoded in one pass and the
    three parts joined. Lets a caller encode one large member faster than the generic encoder does.
    """
    before = canonical_text({k: v for k, v in members.items() if k < key})[1:-1]
    after = canonical_text({k: v for k, v in members.items() if k > key})[1:-1]
    middle = f"{encode_string(key)}:{raw}"
    return "{" + ",".join(part for part in (before, middle, after) if part) + "}"


def canonical_bytes(model: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    """Canonical bytes of a contract model (optionally without some top-level fields)."""
    return canonical_json(model.model_dump(mode="json", exclude=exclude, exclude_none=True))


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
