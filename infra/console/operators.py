"""Who a console user is: an operator key proved against the operator key store, as the CLI proves it.

The console signs nobody up: a user logs in with an operator key (``rlo_<id>_<secret>``) minted by
``reprolane keys operator`` into the operator key store (``REPROLANE_OPERATOR_KEYS_PATH``), and the
session acts with that key's roles and tenant scope. Everything about keys has one home each: the file format,
its permission checks and the constant-time proof are `capture.ledger.key_file`'s; the operator, its roles
(`Operator.may`, which asks `schemas.access_log.role_grants`) and its tenant scope (`Operator.sees`) are
`capture.audit.operators`'. This module is the console's thin view of them: `OperatorKeys` reads the store
once per login and per request (so a revoked key ends its sessions), `prove` maps a presented key to its
operator, `still` tells whether a session's operator is still in the store unchanged.

A session needs a key whose roles grant ``viewer`` (a viewer or a hold-admin: the same rule as the CLI's); a key
that may only expire or shred (retention-admin, key-admin) cannot open one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final

from capture.audit.operators import OPERATOR_KEYS, Operator
from capture.ledger.key_file import KeyEntry, find_key, load_key_file

__all__ = ["MAX_TOKEN_CHARS", "SESSION_ROLE", "Operator", "OperatorKeys"]

#: The role a key must be granted to open a console session (every page needs it).
SESSION_ROLE: Final = "viewer"
#: A presented key longer than this is refused before any lookup (a real one is far shorter).
MAX_TOKEN_CHARS: Final = 256


class OperatorKeys:
    """The operator key store as read now; `KeyFileError` (naming the setting) when it cannot be trusted."""

    def __init__(self, entries: Mapping[str, KeyEntry]) -> None:
        self._entries = dict(entries)

    @classmethod
    def load(cls, path: Path, *, field: str = "REPROLANE_OPERATOR_KEYS_PATH") -> OperatorKeys:
        return cls(load_key_file(path, OPERATOR_KEYS, field=field))

    def prove(self, key: str) -> Operator | None:
        """The operator `key` proves (`capture.ledger.key_file.find_key`); None for any other key."""
        if len(key) > MAX_TOKEN_CHARS:
            return None
        entry = find_key(self._entries, OPERATOR_KEYS, key)
        return Operator.of(entry) if entry is not None else None

    def still(self, operator: Operator) -> bool:
        """True while the store still holds `operator`'s key with the same tenant and roles (a session of a key
        that was revoked or changed ends on its next request)."""
        entry = self._entries.get(operator.key_id)
        return entry is not None and Operator.of(entry) == operator
