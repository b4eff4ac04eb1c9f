"""The base model every contract record derives from: frozen, strict about unknown fields, versioned."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Immutable contract record: unknown fields are errors, instances cannot be changed after creation.

    Tuples (not lists) hold sequences so that records are hashable and cannot be mutated in place.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
