"""Hashed key files: one format, and one way to mint, store and prove a key, for every kind of key we issue.

The sidecar's API keys (`capture.request.auth`) and the operators' keys (`capture.audit.operators`) are both bearer
secrets that a file of salted hashes maps to an identity (an id, a tenant or none, roles). A `KeyKind` says what
differs between them: the token prefix, the roles a key may hold, whether a tenant is required. Everything else
is written here once:

The file (JSON, written by the operator, mode 0600 or 0640; refused when unreadable, world-readable, group- or
world-writable, or malformed)::

    {"keys": [{"id": "acme-1", "tenant": "acme", "roles": ["capture", "flag"],
               "hash": "sha256:<salt hex>:<sha256(salt + key) hex>"}]}

A key is ``<prefix><id>_<secret>`` with a 256-bit random secret (`new_key`), so its entry is found by id and one
salted sha256 compared in constant time (`hmac.compare_digest`) proves it: a slow password hash (scrypt) adds
milliseconds per check and protects only guessable secrets, which these are not. The file never holds a key.
A kind whose tenant is optional stores ``"tenant": null`` for a key that is not bound to one tenant.

It lives in the ledger because both the sidecar and the audit jobs use it and the ledger is what both may
import; every failure is a `KeyFileError` naming the setting (the sidecar translates it into a `CaptureError`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from capture.ledger.errors import KeyFileError
from infra.clients.connection import read_private_file
from schemas.envelope import is_valid_request_id

_ID_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_TENANT_RULE: Final = "[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"


@dataclass(frozen=True, slots=True)
class KeyKind:
    """What distinguishes one kind of key: its token prefix, the roles it may grant, whether it names a tenant."""

    prefix: str
    roles: frozenset[str]
    tenant_required: bool = True


@dataclass(frozen=True, slots=True)
class KeyEntry:
    key_id: str
    tenant: str | None
    roles: frozenset[str]
    salt: bytes
    digest: bytes

    def as_entry(self) -> dict[str, Any]:
        """This entry as the key file holds it."""
        hashed = f"sha256:{self.salt.hex()}:{self.digest.hex()}"
        return {"id": self.key_id, "tenant": self.tenant, "roles": sorted(self.roles), "hash": hashed}


def _digest(salt: bytes, key: str) -> bytes:
    return hashlib.sha256(salt + key.encode("utf-8")).digest()


def _valid_id(key_id: object) -> bool:
    return isinstance(key_id, str) and bool(key_id) and set(key_id) <= _ID_CHARS and len(key_id) <= 64


def new_key(kind: KeyKind, key_id: str, tenant: str | None, roles: Iterable[str]) -> tuple[str, dict[str, Any]]:
    """A fresh key and its key-file entry (the key is shown once; only the entry is stored)."""
    roles = frozenset(roles)
    if not _valid_id(key_id):
        raise KeyFileError(f"key id {key_id!r} must be 1-64 of [A-Za-z0-9-]")
    if tenant is None and kind.tenant_required:
        raise KeyFileError("a tenant is required")
    if tenant is not None and not is_valid_request_id(tenant):
        raise KeyFileError(f"tenant {tenant!r} must match {_TENANT_RULE}")
    if not roles <= kind.roles:
        raise KeyFileError(f"roles must be of {sorted(kind.roles)}, not {sorted(roles)}")
    key = f"{kind.prefix}{key_id}_{secrets.token_urlsafe(32)}"
    salt = secrets.token_bytes(16)
    return key, KeyEntry(key_id, tenant, roles, salt, _digest(salt, key)).as_entry()


def write_key_file(path: Path, entries: Sequence[Mapping[str, Any]]) -> None:
    """Write a key file readable by its owner only (0600), as `load_key_file` wants it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps({"keys": list(entries)}, indent=2) + "\n", encoding="utf-8")


def read_private(path: Path, field: str, *, group_may_read: bool) -> bytes:
    """The bytes of a key or token file (`infra.clients.connection.read_private_file`: only its owner may change
    it and, unless `group_may_read`, read it); `KeyFileError` naming `field` when it cannot be trusted or read."""
    try:
        return read_private_file(path, field, group_may_read=group_may_read)
    except ValueError as exc:
        raise KeyFileError(str(exc)) from None


def load_key_file(path: Path, kind: KeyKind, *, field: str) -> dict[str, KeyEntry]:
    """The key file's entries by id; `KeyFileError` naming `field` when it cannot be trusted or read."""
    raw = read_private(path, field, group_may_read=True)  # hashes, not keys: 0640 is fine
    try:
        items = json.loads(raw)["keys"]
        if not isinstance(items, list):
            raise TypeError("'keys' is not a list")
        entries: dict[str, KeyEntry] = {}
        for n, item in enumerate(items):
            key_id, roles, hashed = item["id"], item["roles"], item["hash"]
            tenant = item["tenant"] if kind.tenant_required else item.get("tenant")
            if not _valid_id(key_id):
                raise ValueError(f"entry {n}: id must be 1-64 of [A-Za-z0-9-]")
            if key_id in entries:
                raise ValueError(f"entry {n}: id {key_id!r} appears twice")
            if (tenant is not None or kind.tenant_required) and (
                not isinstance(tenant, str) or not is_valid_request_id(tenant)
            ):
                raise ValueError(f"entry {n}: tenant must match {_TENANT_RULE}")
            if not isinstance(roles, list) or not set(roles) <= kind.roles:
                raise ValueError(f"entry {n}: roles must be a list of {sorted(kind.roles)}")
            scheme, salt_hex, digest_hex = str(hashed).split(":")
            if scheme != "sha256" or len(digest_hex) != 64 or len(salt_hex) < 16:
                raise ValueError(f"entry {n}: hash must be sha256:<salt hex>:<64 hex digits>")
            entries[key_id] = KeyEntry(
                key_id, tenant, frozenset(roles), bytes.fromhex(salt_hex), bytes.fromhex(digest_hex)
            )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyFileError(f"{field}: {path} is malformed: {exc!r}") from None
    return entries


def find_key(entries: Mapping[str, KeyEntry], kind: KeyKind, key: str) -> KeyEntry | None:
    """The entry `key` proves (its id found, its salted hash equal in constant time); None for any other key."""
    if not key.startswith(kind.prefix):
        return None
    key_id, _, secret = key[len(kind.prefix) :].partition("_")
    entry = entries.get(key_id)
    if entry is None or not secret:
        return None
    return entry if hmac.compare_digest(_digest(entry.salt, key), entry.digest) else None
