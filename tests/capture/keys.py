"""API keys for tests of the sidecar with authentication on: a key file written as the operator would (0600),
by hand from the format `capture.request.auth` documents (so the test also pins that format)."""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ApiKeys:
    """A key file and its keys by name: ``bank`` (tenant acme-bank, capture+flag), ``attacker`` (tenant attacker,
    capture only), ``reader`` (tenant acme-bank, no role)."""

    path: Path
    bank: str
    attacker: str
    reader: str


def mint(key_id: str, tenant: str, roles: list[str]) -> tuple[str, dict[str, object]]:
    key = f"rlk_{key_id}_{secrets.token_urlsafe(32)}"
    salt = secrets.token_bytes(16)
    digest = hashlib.sha256(salt + key.encode()).hexdigest()
    return key, {"id": key_id, "tenant": tenant, "roles": roles, "hash": f"sha256:{salt.hex()}:{digest}"}


def write_test_keys(directory: Path) -> ApiKeys:
    bank, bank_entry = mint("bank-1", "acme-bank", ["capture", "flag"])
    attacker, attacker_entry = mint("attacker-1", "attacker", ["capture"])
    reader, reader_entry = mint("reader-1", "acme-bank", [])
    path = directory / "api-keys.json"
    path.touch(mode=0o600)
    path.write_text(json.dumps({"keys": [bank_entry, attacker_entry, reader_entry]}))
    return ApiKeys(path, bank, attacker, reader)
