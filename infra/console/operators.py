"""Who a console user is: an operator key proved against the operator key store, and the roles it grants.

The console signs nobody up: a user logs in with an operator key (``rlo_<id>_<secret>``) that the key store
(``REPROLANE_CONSOLE_OPERATOR_KEYS_PATH``, a JSON file of salted hashes, mode 0600) holds the hash of, and the
session acts with that key's roles and tenant scope. The file's format is the trust issue's operator key store
(``{"keys": [{"id", "tenant" (null: every tenant), "roles", "hash": "sha256:<salt hex>:<digest hex>"}]}``), so
a store written by ``reprolane operator add-key`` is read here as is.

The console needs two of its roles: ``viewer`` reads records; ``hold-admin`` also places and lifts legal holds.
A key with neither (a retention or key admin only) cannot open a session.

Interim home (noted in the report of issue 19): until the trust issue's `capture.key_file` is merged, proving a
key is written here against the same file format; afterwards this module keeps `Operator` and `OperatorKeys` as
the console's interface and delegates the file to `capture.key_file`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from infra.errors import InfraError
from schemas.envelope import is_valid_request_id

KEY_PREFIX: Final = "rlo_"
#: Every role an operator key may hold (the trust issue's set); the console acts on the first two.
OPERATOR_ROLES: Final = frozenset({"viewer", "hold-admin", "retention-admin", "key-admin"})
CONSOLE_ROLES: Final = frozenset({"viewer", "hold-admin"})
_ID_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
MAX_TOKEN_CHARS: Final = 256


class OperatorKeyError(InfraError):
    """The operator key store cannot be trusted or read (its path and what is wrong, never a key)."""


@dataclass(frozen=True, slots=True)
class Operator:
    """Who a proved key says the user is: its id, its tenant (None: every tenant) and its roles."""

    key_id: str
    tenant: str | None
    roles: frozenset[str]

    def may(self, role: str | None) -> bool:
        """A hold-admin may do what a viewer may; None (login, logout) needs no role."""
        if role is None:
            return True
        return role in self.roles or (role == "viewer" and "hold-admin" in self.roles)

    def sees(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


@dataclass(frozen=True, slots=True)
class _Entry:
    operator: Operator
    salt: bytes
    digest: bytes


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode("utf-8")).digest()


def _valid_id(key_id: object) -> bool:
    return isinstance(key_id, str) and 0 < len(key_id) <= 64 and set(key_id) <= _ID_CHARS


def new_operator_key(key_id: str, tenant: str | None, roles: Iterable[str]) -> tuple[str, dict[str, Any]]:
    """A fresh key and its store entry (the key is shown once; only the entry is stored)."""
    roles = frozenset(roles)
    if not _valid_id(key_id):
        raise OperatorKeyError(f"key id {key_id!r} must be 1-64 of [A-Za-z0-9-]")
    if tenant is not None and not is_valid_request_id(tenant):
        raise OperatorKeyError(f"tenant {tenant!r} is not a valid tenant")
    if not roles or not roles <= OPERATOR_ROLES:
        raise OperatorKeyError(f"roles must be some of {sorted(OPERATOR_ROLES)}, not {sorted(roles)}")
    key = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    salt = secrets.token_bytes(16)
    entry = {
        "id": key_id,
        "tenant": tenant,
        "roles": sorted(roles),
        "hash": f"sha256:{salt.hex()}:{_digest(salt, key).hex()}",
    }
    return key, entry


def write_operator_keys(path: Path, entries: Sequence[Mapping[str, Any]]) -> None:
    """Write a key store readable by its owner only (0600), as `OperatorKeys.load` wants it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps({"keys": list(entries)}, indent=2) + "\n", encoding="utf-8")


class OperatorKeys:
    """The key store's entries by id; `prove` maps a presented key to its `Operator` (or None)."""

    def __init__(self, entries: Mapping[str, _Entry]) -> None:
        self._entries = dict(entries)

    @classmethod
    def load(cls, path: Path, *, field: str = "operator_keys_path") -> OperatorKeys:
        """Read and check the store; `OperatorKeyError` naming `field` when others may read it or it is malformed."""
        try:
            mode = path.stat().st_mode
            raw = path.read_bytes()
        except OSError as exc:
            raise OperatorKeyError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
            raise OperatorKeyError(f"{field}: {path} is readable by others or writable by its group (mode "
                                   f"{stat.S_IMODE(mode):04o}): chmod 600 it")  # fmt: skip
        entries: dict[str, _Entry] = {}
        try:
            items = json.loads(raw)["keys"]
            if not isinstance(items, list):
                raise TypeError("'keys' is not a list")
            for n, item in enumerate(items):
                key_id, tenant, roles, hashed = item["id"], item.get("tenant"), item["roles"], item["hash"]
                if not _valid_id(key_id) or key_id in entries:
                    raise ValueError(f"entry {n}: id must be 1-64 of [A-Za-z0-9-], once")
                if tenant is not None and (not isinstance(tenant, str) or not is_valid_request_id(tenant)):
                    raise ValueError(f"entry {n}: tenant is not a valid tenant")
                if not isinstance(roles, list) or not set(roles) <= OPERATOR_ROLES:
                    raise ValueError(f"entry {n}: roles must be a list of {sorted(OPERATOR_ROLES)}")
                scheme, salt_hex, digest_hex = str(hashed).split(":")
                if scheme != "sha256" or len(digest_hex) != 64 or len(salt_hex) < 16:
                    raise ValueError(f"entry {n}: hash must be sha256:<salt hex>:<64 hex digits>")
                operator = Operator(key_id, tenant, frozenset(roles))
                entries[key_id] = _Entry(operator, bytes.fromhex(salt_hex), bytes.fromhex(digest_hex))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise OperatorKeyError(f"{field}: {path} is malformed: {exc!r}") from None
        return cls(entries)

    def prove(self, key: str) -> Operator | None:
        """The operator `key` proves (its id found, its salted hash equal in constant time); None otherwise."""
        if len(key) > MAX_TOKEN_CHARS or not key.startswith(KEY_PREFIX):
            return None
        key_id, _, secret = key[len(KEY_PREFIX) :].partition("_")
        entry = self._entries.get(key_id)
        if entry is None or not secret:
            return None
        return entry.operator if hmac.compare_digest(_digest(entry.salt, key), entry.digest) else None

    def still(self, operator: Operator) -> bool:
        """True while the store still holds `operator`'s key with the same tenant and roles (a session of a key
        that was revoked or changed ends on its next request)."""
        entry = self._entries.get(operator.key_id)
        return entry is not None and entry.operator == operator
