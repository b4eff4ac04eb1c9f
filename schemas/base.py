"""The base model every contract record derives from: frozen, strict about unknown fields, versioned."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


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
