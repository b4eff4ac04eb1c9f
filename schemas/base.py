"""The base model every contract record derives from (frozen, strict about unknown fields, versioned), and the one
way a record is parsed from JSON (`decode_record`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from schemas.errors import ContractError


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("must be timezone-aware (UTC)")
    return value.astimezone(UTC)


#: A point in time that records carry: timezone-aware, normalised to UTC (naive datetimes are refused).
UtcDatetime = Annotated[datetime, AfterValidator(_utc)]


class Record(BaseModel):
    """Immutable contract record: unknown fields are errors, instances cannot be changed after creation.

    Tuples (not lists) hold sequences so that records are hashable and cannot be mutated in place.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


_R = TypeVar("_R", bound=Record)


def decode_record(model: type[_R], what: str, data: bytes | str) -> _R:
    """Parse ``data`` (JSON) as ``model``, raising `ContractError` that names each offending field (``what`` names
    the record in the message: ``"invalid checkpoint: ..."``)."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise ContractError.from_validation(what, exc) from exc


def has_schema_version(data: bytes | str, version: str) -> bool:
    """True when `data` is a JSON object whose ``schema_version`` is `version`; never raises."""
    try:
        doc = json.loads(data)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("schema_version") == version
