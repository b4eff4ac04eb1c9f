"""Stored envelopes never contain credentials: not from headers, not from secret-looking fields of the body."""

from __future__ import annotations

from tests.capture.support import CHAT, only, sidecar

SECRETS = ("sk-header-sekrit", "key-header-sekrit", "sk-body-sekrit", "pw-body-sekrit")


async def test_credentials_in_headers_and_body_never_reach_the_stored_envelope() -> None:
    body = {**CHAT, "api_key": "sk-body-sekrit", "extra_body": {"password": "pw-body-sekrit"}, "user": "alice"}
    body["truncate_prompt_tokens"] = 64  # output-affecting, not a credential: must stay recorded
    headers = {
        "Authorization": "Bearer sk-header-sekrit",
        "X-Api-Key": "key-header-sekrit",
        "Cookie": "session=key-header-sekrit",
    }
    async with sidecar() as (client, upstream, spool, _m):
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    seen = next(s for s in upstream.seen if s.path == "/v1/chat/completions")
    assert seen.headers["authorization"] == "Bearer sk-header-sekrit"  # forwarded upstream, as a proxy must
    stored = only(spool).canonical()  # exactly the bytes the sinks write to Kafka and S3
    for secret in SECRETS:
        assert secret.encode() not in stored, secret
    assert b"sekrit" not in stored
    sampling = only(spool).sampling
    assert sampling is not None
    assert sampling.extra["truncate_prompt_tokens"] == "64"
    assert "api_key" not in sampling.extra
    assert sampling.extra["extra_body"] == "{}"  # the nested password removed, the field itself kept
