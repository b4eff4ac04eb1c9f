"""What looks like a credential in a request, and keeping it out of the record (pure).

A client library may put an API key in the body, an application a password or a refresh token in a nested
object; none of them changes which tokens come out, and none may be recorded. A field's name is a credential's
when, split into words whatever its style (``accessToken``, ``access_token``, ``ACCESS-TOKEN``, ``AccessToken``
all read ``access token``; ``accesstoken`` is matched as a known compound):

- any word is one of `ANY_WORDS` (``secret``, ``password``, ``jwt``, ``bearer``, ``dsn``, ...), or
- its last word is one of `LAST_WORDS` (``key``, ``token``, ``auth``: ``max_tokens`` and ``allowed_token_ids``
  are sampling fields, not credentials), or
- its words written together end with one of `COMPOUNDS` (``apikey``, ``privatekey``, ``refreshtoken``,
  ``password``, ``dsn``, ...: ``userpassword``, ``sentrydsn``).

`without_credentials` drops such members from a value at any depth (the sampling contract's extra fields). An
upstream error can quote the request back (a validation error's ``input_value``): `credential_values` are the
values of those fields and of the credential headers, and `scrub` replaces each of them, and any long enough
piece of one (messages truncate what they quote), before an error message is recorded.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

ANY_WORDS: Final = frozenset(
    {"secret", "secrets", "password", "passwords", "passwd", "pwd", "passphrase", "credential", "credentials"}
    | {"authorization", "cookie", "cookies", "jwt", "bearer", "dsn", "apikey", "privatekey", "otp", "totp"}
)
LAST_WORDS: Final = frozenset({"key", "keys", "token", "auth", "signature"})
COMPOUNDS: Final = (
    "apikey",
    "accesskey",
    "secretkey",
    "privatekey",
    "signingkey",
    "accesstoken",
    "refreshtoken",
    "idtoken",
    "authtoken",
    "sessiontoken",
    "bearertoken",
    "apitoken",
    "clientsecret",
    "sessionid",
    # words no ordinary word ends with, so a name run together ends with them only when it names one
    "secret",
    "password",
    "passwd",
    "passphrase",
    "credential",
    "credentials",
    "jwt",
    "dsn",
)
REDACTED: Final = "[redacted]"
_CAMEL: Final = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_NOT_ALNUM: Final = re.compile(r"[^A-Za-z0-9]+")
_SHORTEST_SECRET: Final = 4  # shorter values would redact ordinary text; no credential is that short
_SHORTEST_PIECE: Final = 12  # a quoted piece of a secret this long is redacted too (truncated quotes)


def words(name: str) -> tuple[str, ...]:
    """The words of a field name in any style, lower case: ``clientSecret`` and ``CLIENT-SECRET`` are both
    ``("client", "secret")``; ``APIKey`` is ``("api", "key")``."""
    return tuple(w.lower() for w in _NOT_ALNUM.split(_CAMEL.sub("_", name)) if w)


@functools.lru_cache(maxsize=4096)
def is_credential(name: str) -> bool:
    """Whether a field (or header) named `name` holds a credential (see the module docstring)."""
    found = words(name)
    if not found:
        return False
    if found[-1] in LAST_WORDS or not ANY_WORDS.isdisjoint(found):
        return True
    joined = "".join(found)
    return joined.endswith(COMPOUNDS)


def without_credentials(value: Any) -> Any:
    """`value` with every object member whose name looks like a credential removed, at any depth."""
    if isinstance(value, dict):
        return {k: without_credentials(v) for k, v in value.items() if not is_credential(str(k))}
    if isinstance(value, list):
        return [without_credentials(v) for v in value]
    return value


def credential_values(body: Any, headers: Mapping[bytes, bytes] | None = None) -> list[str]:
    """The values of a request's credentials: its body's credential-named members (at any depth, walked without
    recursion), and its credential headers (``Authorization``, ``X-Api-Key``, ``Cookie``: the whole value and
    each part of it), longest first."""
    found: set[str] = set()
    todo = [body]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if is_credential(str(k)):
                    _add_leaves(v, found)
                else:
                    todo.append(v)
        elif isinstance(node, list):
            todo.extend(node)
    for name, raw in (headers or {}).items():
        if is_credential(name.decode("latin-1")):
            value = raw.decode("latin-1").strip()
            found.add(value)
            found.update(part for part in re.split(r"[\s;,=]+", value) if part)
    return sorted((s for s in found if len(s) >= _SHORTEST_SECRET), key=len, reverse=True)


def _add_leaves(value: Any, found: set[str]) -> None:
    todo = [value]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, str | int | float) and not isinstance(node, bool):
            found.add(str(node))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every secret in it replaced by ``[redacted]``, and every piece of one at least
    `_SHORTEST_PIECE` characters long (a validation error quotes the start and the end of a long value)."""
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
        if len(secret) >= _SHORTEST_PIECE:
            text = _scrub_pieces(text, secret)
    return text


def _scrub_pieces(text: str, secret: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        end = i + _SHORTEST_PIECE
        if end <= len(text) and text[i:end] in secret:
            while end < len(text) and text[i : end + 1] in secret:
                end += 1
            out.append(REDACTED)
            i = end
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
