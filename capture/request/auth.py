"""Who is calling: the sidecar's callers authenticate, and their tenant and roles come from the credential.

Modes (``CaptureSettings.auth_mode``):

- ``keys`` (the default): every request carries an API key of the key file (``api_keys_path``); no key or an
  unknown one is a 401 in OpenAI's format before anything is read further or sent upstream (and nothing is
  recorded: an unauthenticated caller cannot fill the spool).
- ``anonymous-allowed``: as ``keys``, but a request without any key is served and recorded as tenant
  ``anonymous`` without roles beyond ``capture`` (a wrong key is still a 401).
- ``trusted-proxy``: no keys; requests are accepted only from the peer networks ``trusted_proxies`` (a gateway
  that authenticated the caller), whose ``X-Reprolane-Tenant`` and ``X-Reprolane-Flag`` are trusted; any other
  peer gets 401.
- ``off``: local development only: anyone, and the headers are trusted as they come.

The key travels as ``X-Reprolane-Key: <key>`` when upstream needs the ``Authorization`` header itself (it is
then forwarded untouched), else as ``Authorization: Bearer <key>`` (what the official clients send with
``api_key=...``), which the sidecar then consumes: it is not forwarded upstream. A Bearer token that is not
one of ours (no ``rlk_`` prefix) is upstream's: under ``anonymous-allowed`` it travels on untouched with an
anonymous request, under ``keys`` the request has no key (401). ``X-Reprolane-*`` headers are
never forwarded, and no request header is recorded in the envelope.

Where identity comes from a key, ``X-Reprolane-Tenant`` may be sent only with the key's own tenant (another is
403), and ``X-Reprolane-Flag`` only with the ``flag`` role (else 403): a caller is told, never silently
re-labelled. Roles: ``capture`` (may send traffic at all: a key without it gets 403) and ``flag``.

The key file and the key format are `capture.ledger.key_file`'s (shared with the operators' keys): a key is
``rlk_<id>_<secret>``, stored only as a salted sha256, mode 0600 or 0640, refused at start when it cannot be
trusted.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from capture.errors import CaptureError
from capture.ledger import key_file
from capture.ledger.errors import KeyFileError
from capture.ledger.key_file import KeyEntry, KeyKind, find_key
from capture.request.edge import ASGIApp, Receive, Scope, Send, error_body, send_json

AuthMode = Literal["keys", "anonymous-allowed", "trusted-proxy", "off"]
Role = Literal["capture", "flag"]
ROLES: Final = frozenset({"capture", "flag"})
ANONYMOUS_TENANT: Final = "anonymous"
KEY_PREFIX: Final = "rlk_"
_KEY_PREFIX_BYTES: Final = KEY_PREFIX.encode("ascii")
KEY_HEADER: Final = b"x-reprolane-key"
_AUTHORIZATION: Final = b"authorization"


class Unauthenticated(Exception):
    """The request carries no acceptable credential (answered 401)."""


class Forbidden(Exception):
    """The caller is known but may not do this (answered 403)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request. ``tenant`` None: the headers say (``off``, ``trusted-proxy``), else the credential's."""

    tenant: str | None
    key_id: str | None
    roles: frozenset[str]
    credential_header: bytes | None = None  # the header that carried the key (not forwarded upstream)

    @property
    def may_flag(self) -> bool:
        return "flag" in self.roles


HEADER_TRUSTED: Final = Caller(tenant=None, key_id=None, roles=ROLES)


#: The sidecar's API keys in `capture.ledger.key_file`'s format.
API_KEYS: Final = KeyKind(prefix=KEY_PREFIX, roles=ROLES, tenant_required=True)


def new_key(key_id: str, tenant: str, roles: Iterable[str] = ("capture",)) -> tuple[str, dict[str, Any]]:
    """A fresh API key and its key-file entry (the key is shown once; only the entry is stored)."""
    try:
        return key_file.new_key(API_KEYS, key_id, tenant, roles)
    except KeyFileError as exc:
        raise CaptureError(str(exc)) from None


def load_key_file(path: Path, *, field: str = "api_keys_path") -> dict[str, KeyEntry]:
    """The API key file's entries by id; `CaptureError` naming `field` when it cannot be trusted or read."""
    try:
        return key_file.load_key_file(path, API_KEYS, field=field)
    except KeyFileError as exc:
        raise CaptureError(str(exc)) from None


class Authenticator:
    """The sidecar's one decision of who a request comes from (built once at start)."""

    def __init__(
        self, mode: AuthMode, keys: dict[str, KeyEntry] | None = None, trusted_proxies: Sequence[str] = ()
    ) -> None:
        self.mode = mode
        self._keys = keys or {}
        self._networks = [ipaddress.ip_network(n, strict=False) for n in trusted_proxies]

    @classmethod
    def from_settings(cls, settings: Any) -> Authenticator:
        """From `CaptureSettings` (the key file read now: a bad one fails the start, naming the field)."""
        path: Path | None = settings.api_keys_path
        keys = load_key_file(path) if path is not None and settings.auth_mode in ("keys", "anonymous-allowed") else {}
        return cls(settings.auth_mode, keys, settings.trusted_proxies)

    def authenticate(self, headers: dict[bytes, bytes], client: Sequence[Any] | None) -> Caller:
        """The caller of a request (`Unauthenticated` when it has no acceptable credential)."""
        if self.mode == "off":
            return HEADER_TRUSTED
        if self.mode == "trusted-proxy":
            if client is None or not self._trusted_peer(str(client[0])):
                raise Unauthenticated("requests must come through the trusted proxy")
            return HEADER_TRUSTED
        header = KEY_HEADER
        key = headers.get(KEY_HEADER)
        if key is None:
            auth = headers.get(_AUTHORIZATION)
            token = auth[7:].strip() if auth is not None and auth[:7].lower() == b"bearer " else b""
            if token.startswith(_KEY_PREFIX_BYTES):  # any other token is upstream's, not a key of ours
                header, key = _AUTHORIZATION, token
        if key is None:
            if self.mode == "anonymous-allowed":
                return Caller(tenant=ANONYMOUS_TENANT, key_id=None, roles=frozenset({"capture"}))
            raise Unauthenticated("no API key: send Authorization: Bearer <key> or X-Reprolane-Key: <key>")
        entry = self._check(key.decode("latin-1"))
        if entry is None:
            raise Unauthenticated("incorrect API key provided")
        return Caller(tenant=entry.tenant, key_id=entry.key_id, roles=entry.roles, credential_header=header)

    def vouches_for(self, headers: dict[bytes, bytes], client: Sequence[Any] | None) -> bool:
        """Whether a request head proves who sent it: a valid API key of the key file (``keys``,
        ``anonymous-allowed``), a trusted proxy's address (``trusted-proxy``); never under ``off``. The server
        serves such a connection first (`capture.request.connection_limits`); whether the request may do what it asks
        (its roles, its tenant header) is still `authenticate`'s and the app's to say."""
        if self.mode == "off":
            return False
        if self.mode == "trusted-proxy":
            return client is not None and self.trusted_peer(str(client[0]))
        try:
            return self.authenticate(headers, client).key_id is not None
        except Unauthenticated:
            return False

    def trusted_peer(self, host: str) -> bool:
        """Whether `host` is in a trusted proxy network (``trusted-proxy`` mode only; False in any other)."""
        return self.mode == "trusted-proxy" and self._trusted_peer(host)

    def _check(self, key: str) -> KeyEntry | None:
        return find_key(self._keys, API_KEYS, key)

    def _trusted_peer(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self._networks)


def unauthenticated_body(message: str) -> bytes:
    """OpenAI's 401 document."""
    return error_body(message, type_="invalid_request_error", code="invalid_api_key")


def forbidden_body(message: str) -> bytes:
    return error_body(message, type_="permission_error", code=403)


async def send_unauthenticated(send: Send, message: str, rid: bytes | None) -> None:
    extra = [(b"content-type", b"application/json"), (b"www-authenticate", b'Bearer realm="reprolane"')]
    await send_json(send, 401, unauthenticated_body(message), rid, extra)


def authenticated(app: ASGIApp, authenticator: Authenticator) -> ASGIApp:
    """`app` (the pass-through) for authenticated callers with the ``capture`` role only; the header that
    carried the key is removed before `app` sees the request, so it never reaches upstream."""
    if authenticator.mode == "off":
        return app

    async def gate(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            caller = authenticator.authenticate(dict(scope["headers"]), scope.get("client"))
        except Unauthenticated as exc:
            await send_unauthenticated(send, str(exc), None)
            return
        if "capture" not in caller.roles:
            await send_json(send, 403, forbidden_body("this API key has no 'capture' role"), None)
            return
        if caller.credential_header is not None:
            drop = caller.credential_header
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != drop]}
        await app(scope, receive, send)

    return gate
