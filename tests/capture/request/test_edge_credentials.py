"""Credentials never reach an envelope, not even when upstream quotes them back in an error (in-process sidecar
in front of the fake upstream, whose ``echo400`` answer quotes the request's body and Authorization header)."""

from __future__ import annotations

from typing import Any

import pytest

from schemas import CapturedError
from tests.capture.support import MODEL, finished, only, sidecar

LONG = "sk-live-" + "0123456789abcdef" * 4  # quoted truncated, as pydantic does with long values
SECRETS = {
    "accessToken": "at-1a2b3c4d5e6f",
    "clientSecret": "cs-6f5e4d3c2b1a",
    "secretKey": "sk-9z8y7x6w5v",
    "privateKey": LONG,
    "refreshToken": "rt-q1w2e3r4t5",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.e30.abc",
    "bearer": "br-0p9o8i7u6y",
    "dsn": "https://user:pw-5t6y7u@sentry.example/1",
}
HEADER_SECRET = "sk-header-4f3e2d1c"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_error_quoting_the_request_is_recorded_without_its_secrets(stream: bool) -> None:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "echo400"}],
        "stream": stream,
        **SECRETS,
        "metadata_extra": {"api_key": "ak-nested-7h8j9k"},
    }
    async with sidecar() as (client, _, spool, _):
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {HEADER_SECRET}"}
        )
    assert resp.status_code == 400
    assert SECRETS["accessToken"] in resp.text  # the client gets upstream's answer as it is
    env = finished(spool) if stream else only(spool)  # a guaranteed stream spools its started record first
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.status_code == 400
    recorded = env.outcome.message or ""
    assert "validation error" in recorded
    assert "[redacted]" in recorded
    for secret in [*SECRETS.values(), "ak-nested-7h8j9k", HEADER_SECRET]:
        assert secret not in recorded
    assert LONG[:12] not in recorded
    assert LONG[-12:] not in recorded
    for stored in (e.model_dump_json() for e in spool.envelopes):  # the started record too
        for secret in [*SECRETS.values(), "ak-nested-7h8j9k", HEADER_SECRET]:
            assert secret not in stored
