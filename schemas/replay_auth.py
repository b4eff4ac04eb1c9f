"""Signed replay requests: who may make the replayer replay a request id.

Anyone who can write the replay-request topic could otherwise make the replayer replay any request id. A caller
holding a shared secret signs the request: HMAC-SHA256 over the canonical bytes (`schemas.canonical`) of the
request without its ``signature``, so the request id, the lane, ``reply_to``, ``requested_at`` and ``key_id`` are
all covered. ``requested_at`` bounds a captured request's life: `verify_replay_request` refuses one older (or
further in the future) than a window. The secret never leaves the caller's and the replayer's key files; the
reasons given for a refusal never contain it.

Pure: it imports the standard library and `schemas` only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from schemas.canonical import canonical_bytes
from schemas.replay import ReplayRequest

REPLAY_ROLE = "replay"
"""The role a key needs for its requests to be acted on."""
DEFAULT_WINDOW_S = 300.0


@dataclass(frozen=True, repr=False)
class ReplayRequestKey:
    """One signing key: its secret and the roles it grants (`repr` leaves the secret out)."""

    secret: bytes
    roles: frozenset[str]

    def __repr__(self) -> str:
        return f"ReplayRequestKey(roles={sorted(self.roles)!r})"


def _mac(request: ReplayRequest, secret: bytes) -> str:
    return hmac.new(secret, canonical_bytes(request, exclude={"signature"}), hashlib.sha256).hexdigest()


def sign_replay_request(
    request: ReplayRequest, key_id: str, secret: bytes, *, now: datetime | None = None
) -> ReplayRequest:
    """`request` stamped with ``requested_at`` (`now`, default the current UTC time) and ``key_id``, and signed."""
    stamped = request.model_copy(update={"requested_at": now or datetime.now(UTC), "key_id": key_id, "signature": None})
    return stamped.model_copy(update={"signature": _mac(stamped, secret)})


def verify_replay_request(
    request: ReplayRequest,
    keys: Mapping[str, ReplayRequestKey],
    now: datetime | None = None,
    window_s: float = DEFAULT_WINDOW_S,
) -> str | None:
    """Why `request` must not be acted on, or None when it is signed by a known key with the replay role, within
    `window_s` seconds of `now` (default the current UTC time)."""
    if request.signature is None or request.key_id is None:
        return "the request is not signed"
    key = keys.get(request.key_id)
    if key is None:
        return f"unknown key id {request.key_id!r}"
    if not hmac.compare_digest(_mac(request, key.secret), request.signature):
        return f"bad signature for key id {request.key_id!r}"
    if REPLAY_ROLE not in key.roles:
        return f"key id {request.key_id!r} lacks the {REPLAY_ROLE!r} role"
    if request.requested_at is None:
        return "the request carries no requested_at"
    at = request.requested_at if request.requested_at.tzinfo else request.requested_at.replace(tzinfo=UTC)
    age = ((now or datetime.now(UTC)) - at).total_seconds()
    if abs(age) > window_s:
        return f"requested_at is {age:.0f} s from now, outside the {window_s:.0f} s window"
    return None
