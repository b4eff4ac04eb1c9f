"""What looks like a credential, in any spelling, never reaches the sampling contract; what does not, does; and
the values of credentials are scrubbed out of text that quotes them."""

from __future__ import annotations

from typing import Any

import pytest

from capture.protocol.credentials import REDACTED, credential_values, is_credential, scrub, words
from capture.protocol.sampling import sampling_contract

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def spellings(*parts: str) -> list[str]:
    """One name in the styles clients use: camelCase, PascalCase, snake, kebab, SCREAMING, run together."""
    first, *rest = parts
    return [
        first + "".join(p.title() for p in rest),
        "".join(p.title() for p in parts),
        "_".join(parts),
        "-".join(parts),
        "_".join(parts).upper(),
        "".join(parts),
    ]


CREDENTIALS = [
    *spellings("access", "token"),
    *spellings("client", "secret"),
    *spellings("secret", "key"),
    *spellings("private", "key"),
    *spellings("refresh", "token"),
    *spellings("api", "key"),
    *spellings("aws", "secret", "access", "key"),
    *spellings("id", "token"),
    *spellings("bearer", "token"),
    *spellings("sentry", "dsn"),
    *spellings("user", "password"),
    *spellings("session", "id"),
    "jwt",
    "JWT",
    "Jwt",
    "user_jwt",
    "bearer",
    "Bearer",
    "dsn",
    "DSN",
    "APIKey",
    "X-Api-Key",
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "auth",
    "authorization",
    "credentials",
    "cookie",
    "key",
]
NOT_CREDENTIALS = [
    "max_tokens",
    "min_tokens",
    "allowed_token_ids",
    "truncate_prompt_tokens",
    "bad_words",
    "top_k",
    "monkey",
    "keyword",
    "tokenizer_mode",
    "guided_json",
    "priority",
    "spaces_between_special_tokens",
    "skip_special_tokens",
    "author",
]


@pytest.mark.parametrize("name", CREDENTIALS)
def test_a_credential_in_any_spelling_is_never_recorded(name: str) -> None:
    assert is_credential(name)
    body = {**CHAT, name: "s3cr3t-value", "nested": {name: "s3cr3t-value", "kept": 1}}
    contract = sampling_contract("chat.completions", body, recorded_k=None, seed_injected=False)
    assert name not in contract.extra
    assert "s3cr3t" not in "".join(contract.extra.values())
    assert contract.extra["nested"] == '{"kept":1}'


@pytest.mark.parametrize("name", NOT_CREDENTIALS)
def test_a_field_that_is_not_a_credential_is_recorded(name: str) -> None:
    assert not is_credential(name)
    body = {**CHAT, "vllm_xargs": {name: 3}}
    contract = sampling_contract("chat.completions", body, recorded_k=None, seed_injected=False)
    assert contract.extra["vllm_xargs"] == f'{{"{name}":3}}'


def test_words_read_every_style_alike() -> None:
    assert {words(n) for n in spellings("client", "secret")[:5]} == {("client", "secret")}
    assert words("APIKey") == ("api", "key")
    assert words("x-api-key") == ("x", "api", "key")


def test_credential_values_come_from_the_body_at_any_depth_and_from_credential_headers() -> None:
    body = {**CHAT, "apiKey": "sk-body-1234", "extra": {"auth": {"refreshToken": "rt-5678", "n": 7}}, "user": "al"}
    headers = {b"authorization": b"Bearer sk-header-9999", b"x-api-key": b"xk-0000", b"content-type": b"json"}
    found = credential_values(body, headers)
    assert set(found) == {"sk-body-1234", "rt-5678", "Bearer sk-header-9999", "Bearer", "sk-header-9999", "xk-0000"}
    assert "al" not in found
    assert "json" not in found


def test_scrub_replaces_whole_secrets_and_long_quoted_pieces() -> None:
    secret = "sk-live-" + "0123456789abcdef" * 4
    truncated = f"{secret[:25]}...{secret[-24:]}"  # how pydantic quotes a long input value
    text = f"bad value {secret!r}; input_value='{truncated}'; short 'pw12' ok"
    scrubbed = scrub(text, [secret, "pw12"])
    assert secret[:12] not in scrubbed
    assert secret[-12:] not in scrubbed
    assert "pw12" not in scrubbed
    assert scrubbed.count(REDACTED) == 4
    assert scrubbed.startswith("bad value '[redacted]'")
