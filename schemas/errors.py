"""Errors of the contract.

    ValueError
     ├── ContractError          bytes or data that do not satisfy a schema; names the offending field(s)
     └── SealError              a sealed record or wrapped key does not open: wrong key, altered bytes or metadata

A divergence is a result, never an exception: see `schemas.replay.DivergenceEvent`.
"""

from __future__ import annotations

from pydantic import ValidationError


class ContractError(ValueError):
    """Input that does not satisfy the contract.

    `fields` holds the dotted path of every offending field (``"sampling.temperature"``), so HTTP edges and the
    CLI can name them without parsing the message.
    """

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields

    @classmethod
    def from_validation(cls, what: str, exc: ValidationError) -> ContractError:
        """Translate a pydantic error into one readable line per offending field."""
        fields: list[str] = []
        parts: list[str] = []
        for err in exc.errors():
            path = ".".join(str(p) for p in err["loc"]) or "(root)"
            fields.append(path)
            parts.append(f"{path}: {err['msg']}")
        return cls(f"invalid {what}: " + "; ".join(parts), tuple(fields))


class SealError(ValueError):
    """A sealed record (`schemas.sealed`) that does not open with the key given, or a malformed key."""
