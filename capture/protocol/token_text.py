"""How upstream spells a token, and the text an envelope keeps for it (pure).

Under ``return_tokens_as_token_ids`` vLLM writes each reported token as ``token_id:N``: the sidecar asks for
that spelling so an envelope holds token ids, and reads the token's text from its ``bytes`` instead. Text that
cannot be stored (a lone surrogate) is made storable here. Both endpoints' logprobs parsers
(`capture.protocol.chat`, `capture.protocol.completions`) and `capture.protocol.output` use these.
"""

from __future__ import annotations

from typing import Any, Final

TOKEN_ID_PREFIX: Final = "token_id:"
_PREFIX_LEN: Final = len(TOKEN_ID_PREFIX)


def token_id_of(text: str) -> int | None:
    """N for a token spelled ``token_id:N``, None for any other text."""
    spelled = id_spelling(text)
    return None if spelled is None else spelled[0]


def id_spelling(text: str) -> tuple[int, list[int]] | None:
    """For ``token_id:N`` (how upstream spells a token under ``return_tokens_as_token_ids``): N and the UTF-8
    bytes of that spelling as upstream lists them; None for any other text.

    Spellings are kept in `SPELLINGS`: the same few thousand token ids come back in every answer, and parsing
    them again would be most of the work of collecting one (`capture.protocol.chat.add_steps` looks there first
    itself)."""
    spelled = SPELLINGS.get(text)
    if spelled is not None:
        return spelled
    if len(text) > _MAX_SPELLING or not text.startswith(TOKEN_ID_PREFIX):
        return None
    try:
        spelled = int(text[_PREFIX_LEN:]), list(text.encode("utf-8"))
    except ValueError:
        return None
    if len(SPELLINGS) >= _MAX_SPELLINGS:
        SPELLINGS.clear()  # a bound, not a policy: a vocabulary's hot ids are back within one answer
    SPELLINGS[text] = spelled
    return spelled


# "token_id:" and up to 20 digits: longer is no vocabulary's id, and the cache below keeps only short keys.
_MAX_SPELLING: Final = _PREFIX_LEN + 20
_MAX_SPELLINGS: Final = 16_384  # keys of <= 29 characters: a few MiB when full
SPELLINGS: dict[str, tuple[int, list[int]]] = {}


def candidate(token: Any, raw_bytes: Any) -> tuple[str, int | None]:
    """Text and id of one reported token. With ``return_tokens_as_token_ids`` the token reads ``token_id:N``;
    its text then comes from the ``bytes`` field when that holds the token's own bytes, else stays empty."""
    text = clean_text(token) if isinstance(token, str) else ""
    tid = token_id_of(text)
    if tid is None:
        return text, None
    return decode_bytes(raw_bytes) or "", tid


def decode_bytes(raw: Any) -> str | None:
    """The token text from upstream's ``bytes``; None when they are not whole UTF-8, or when they merely spell
    ``token_id:N`` (vLLM 0.32 sends those for top-k alternatives under ``return_tokens_as_token_ids``)."""
    if not isinstance(raw, list):
        return None
    try:
        text = bytes(raw).decode("utf-8")
    except (ValueError, TypeError):
        return None
    return None if text.startswith(TOKEN_ID_PREFIX) else text


def clean_text(text: str) -> str:
    """Text as it can be stored: a lone surrogate (JSON allows ``"\\ud800"``) cannot be encoded as UTF-8 and
    would make the envelope unencodable, so it becomes ``?``."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text
