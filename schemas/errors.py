"""Errors of the contract, and the root of every error reprolane raises on purpose.

    ReprolaneError              the project's root; each package's tree hangs below it, with its CLI exit code
     ├── ContractError          (also a ValueError) bytes or data that do not satisfy a schema; names the field(s)
     ├── SealError              (also a ValueError) a sealed record or wrapped key does not open: wrong key,
     │                          altered bytes or metadata
     ├── capture.errors.CaptureError, capture.audit.errors.AuditError, capture.ledger.errors.LedgerError
     ├── replayer.errors.ReplayerError
     └── infra.errors.InfraError

A divergence is a result, never an exception: see `schemas.replay.DivergenceEvent`.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import ValidationError


class ReprolaneError(Exception):
    """The root of every error reprolane raises on purpose; anything else escaping a command is a bug.

    `exit_code` is what the command line exits with (`infra.cli`): 2 when the caller's input is at fault (an
    argument, an id, a key, data that breaks the contract) or, for the replayer, when no verdict could be reached;
    1 when the world is (a server, a broker, a bucket). A tree sets it once at its root; a subclass overrides it
    only when it is the other kind.
    """

    exit_code: ClassVar[int] = 1


class ContractError(ReprolaneError, ValueError):
    """Input that does not satisfy the contract.

    `fields` holds the dotted path of every offending field (``"sampling.temperature"``), so HTTP edges and the
    CLI can name them without parsing the message.
    """

    exit_code: ClassVar[int] = 2

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


class SealError(ReprolaneError, ValueError):
    """A sealed record (`schemas.sealed`) that does not open with the key given, or a malformed key."""

    exit_code: ClassVar[int] = 2
