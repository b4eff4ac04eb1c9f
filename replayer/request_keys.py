"""The replayer's replay-request keys: which callers may ask for an on-demand replay (`schemas.replay_auth`).

The file (``replay_request_keys_path``) is JSON, key id -> ``{"secret": hex or base64, "roles": ["replay"]}``,
and must be its owner's alone (0600): a file readable by others or writable by its group, or one that does not
parse, stops the replayer at start with the field named. A secret that is a committed example value
(`infra.clients.connection.EXAMPLE_SECRETS`) is refused the same way, so a copied example lets nobody in.
"""

from __future__ import annotations

import base64
import binascii
import json
import string
from pathlib import Path

from infra.clients.connection import EXAMPLE_SECRETS, read_private_file
from replayer.errors import ReplayerError
from schemas.replay_auth import ReplayRequestKey

_ID_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")
_MIN_SECRET_BYTES = 16
KNOWN_ROLES = frozenset({"replay"})


def _secret_bytes(text: str) -> bytes:
    """Hex when it reads as hex, else standard base64; at least 16 bytes either way."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("secret is neither hex nor base64") from None
    if len(raw) < _MIN_SECRET_BYTES:
        raise ValueError(f"secret is shorter than {_MIN_SECRET_BYTES} bytes")
    return raw


def load_replay_request_keys(path: Path, *, field: str = "replay_request_keys_path") -> dict[str, ReplayRequestKey]:
    """The file's keys by id; `ReplayerError` naming `field` (never a secret) when it cannot be trusted or read."""
    try:
        raw = read_private_file(path, field)
    except ValueError as exc:
        raise ReplayerError(str(exc)) from None
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise TypeError("not an object of key id -> entry")
        keys: dict[str, ReplayRequestKey] = {}
        for key_id, entry in doc.items():
            if not key_id or len(key_id) > 64 or not set(key_id) <= _ID_CHARS:
                raise ValueError(f"key id {key_id[:64]!r}: must be 1-64 of [A-Za-z0-9._-]")
            if not isinstance(entry, dict) or set(entry) != {"secret", "roles"}:
                raise ValueError(f"key {key_id!r}: must be an object with exactly 'secret' and 'roles'")
            secret, roles = entry["secret"], entry["roles"]
            if not isinstance(secret, str):
                raise TypeError(f"key {key_id!r}: secret is not a string")
            if secret.strip() in EXAMPLE_SECRETS:
                raise ValueError(f"key {key_id!r}: secret is the committed example value: change the file")
            if (
                not isinstance(roles, list)
                or not all(isinstance(r, str) for r in roles)
                or not set(roles) <= KNOWN_ROLES
            ):
                raise ValueError(f"key {key_id!r}: roles must be a list of {sorted(KNOWN_ROLES)}")
            try:
                keys[key_id] = ReplayRequestKey(_secret_bytes(secret.strip()), frozenset(roles))
            except ValueError as exc:
                raise ValueError(f"key {key_id!r}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ReplayerError(f"{field}: {path} is malformed: {exc}") from None
    return keys
