"""Callers authenticate (`capture.request.auth`): the tenant and the right to flag come from the API key, never from a
header the caller sets (issue 18, finding 4); the key never reaches upstream nor the record.

In-process sidecar in front of the fake upstream; tests/capture/request/test_auth_stack.py drives the real
``reprolane serve capture`` on the real stack.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from capture.cli import build_settings, capture_app
from capture.errors import CaptureError
from capture.ledger.key_file import write_key_file
from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.request.auth import KEY_PREFIX, Authenticator, Unauthenticated, load_key_file, new_key
from capture.settings import CaptureSettings
from schemas import CapturedError
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import FakeUpstream, Seen
from tests.capture.keys import ApiKeys, write_test_keys
from tests.capture.support import CHAT, only, sidecar, upstream_calls

CHAT_PATH = "/v1/chat/completions"


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    return write_test_keys(tmp_path)


def keyed(keys: ApiKeys, **overrides: Any) -> dict[str, Any]:
    return {"auth_mode": "keys", "api_keys_path": keys.path, **overrides}


def asked(upstream: FakeUpstream) -> list[Seen]:
    """What upstream was asked, but the sidecar's own start-up probe (``/version``)."""
    return [s for s in upstream.seen if s.path != "/version"]


def bearer(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


async def test_no_key_or_a_wrong_key_is_401_in_openai_format_before_upstream_and_unrecorded(keys: ApiKeys) -> None:
    wrong = keys.bank[:-4] + "AAAA"
    async with sidecar(**keyed(keys)) as (client, upstream, spool, metrics):
        answers = [
            await client.post(CHAT_PATH, json=CHAT),
            await client.post(CHAT_PATH, json=CHAT, headers=bearer(wrong)),
            await client.post(CHAT_PATH, json=CHAT, headers=bearer("sk-not-ours")),
            await client.post(CHAT_PATH, json=CHAT, headers={"X-Reprolane-Tenant": "acme-bank"}),
            await client.get("/v1/models"),  # the pass-through too
        ]
        assert metrics.value("reprolane_capture_requests_total", {"endpoint": "chat.completions", "status": "401"}) == 4
    for resp in answers:
        assert resp.status_code == 401
        error = resp.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert resp.headers["www-authenticate"].startswith("Bearer")
    assert asked(upstream) == []
    assert spool.envelopes == []


async def test_the_tenant_is_the_keys_and_another_tenant_header_is_403(keys: ApiKeys) -> None:
    async with sidecar(**keyed(keys)) as (client, upstream, spool, _m):
        own = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.bank))
        same = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.bank, **{"X-Reprolane-Tenant": "acme-bank"}))
        forged = await client.post(
            CHAT_PATH, json=CHAT, headers=bearer(keys.attacker, **{"X-Reprolane-Tenant": "acme-bank"})
        )
    assert (own.status_code, same.status_code, forged.status_code) == (200, 200, 403)
    assert forged.json()["error"]["param"] == "X-Reprolane-Tenant"
    assert forged.json()["error"]["type"] == "permission_error"
    assert len(upstream_calls(upstream, CHAT_PATH)) == 2
    assert [e.tenant for e in spool.envelopes] == ["acme-bank", "acme-bank", "attacker"]
    assert isinstance(spool.envelopes[2].outcome, CapturedError)  # the refused attempt, under the caller's tenant


async def test_only_keys_with_the_flag_role_flag(keys: ApiKeys) -> None:
    async with sidecar(**keyed(keys)) as (client, upstream, spool, _m):
        flagged = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.bank, **{"X-Reprolane-Flag": "1"}))
        refused = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.attacker, **{"X-Reprolane-Flag": "1"}))
        not_asking = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.attacker, **{"X-Reprolane-Flag": "0"}))
    assert (flagged.status_code, refused.status_code, not_asking.status_code) == (200, 403, 200)
    assert refused.json()["error"]["param"] == "X-Reprolane-Flag"
    assert len(upstream_calls(upstream, CHAT_PATH)) == 2
    assert [(e.tenant, e.flagged) for e in spool.envelopes] == [
        ("acme-bank", True),
        ("attacker", False),
        ("attacker", False),
    ]


async def test_a_key_without_the_capture_role_may_not_send_traffic(keys: ApiKeys) -> None:
    async with sidecar(**keyed(keys)) as (client, upstream, _spool, _m):
        chat = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.reader))
        models = await client.get("/v1/models", headers=bearer(keys.reader))
    assert (chat.status_code, models.status_code) == (403, 403)
    assert asked(upstream) == []


async def test_the_key_is_neither_forwarded_nor_recorded(keys: ApiKeys) -> None:
    """As a Bearer token the key is the sidecar's and stops there; as X-Reprolane-Key it leaves the caller's own
    Authorization (upstream's credential) to reach upstream untouched. Neither is in the record."""
    async with sidecar(**keyed(keys)) as (client, upstream, spool, _m):
        await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.bank))
        await client.post(
            CHAT_PATH, json=CHAT, headers={"X-Reprolane-Key": keys.bank, "Authorization": "Bearer upstream-secret"}
        )
        await client.get("/v1/models", headers=bearer(keys.bank))
    first, second = (s for s in upstream.seen if s.path == CHAT_PATH)
    assert "authorization" not in first.headers
    assert second.headers["authorization"] == "Bearer upstream-secret"
    assert not any(k.startswith("x-reprolane-") for k in second.headers)
    models = next(s for s in upstream.seen if s.path == "/v1/models")
    assert "authorization" not in models.headers
    secret = keys.bank.removeprefix(KEY_PREFIX).split("_", 1)[1].encode()  # the id has no "_"; the secret may
    assert len(secret) > 20
    for env in spool.envelopes:
        assert secret not in env.canonical()
        assert b"upstream-secret" not in env.canonical()


async def test_anonymous_allowed_records_keyless_requests_as_anonymous(keys: ApiKeys) -> None:
    async with sidecar(auth_mode="anonymous-allowed", api_keys_path=keys.path) as (client, upstream, spool, _m):
        anonymous = await client.post(CHAT_PATH, json=CHAT, headers={"X-Reprolane-Tenant": "acme-bank"})
        plain = await client.post(CHAT_PATH, json=CHAT)
        flag = await client.post(CHAT_PATH, json=CHAT, headers={"X-Reprolane-Flag": "1"})
        wrong = await client.post(CHAT_PATH, json=CHAT, headers=bearer("rlk_bank-1_guess"))
        keyed_ = await client.post(CHAT_PATH, json=CHAT, headers=bearer(keys.bank))
        upstreams = await client.post(CHAT_PATH, json=CHAT, headers=bearer("sk-upstream"))  # not ours: upstream's
    codes = [r.status_code for r in (anonymous, plain, flag, wrong, keyed_, upstreams)]
    assert codes == [403, 200, 403, 401, 200, 200]
    assert [e.tenant for e in spool.envelopes] == ["anonymous", "anonymous", "anonymous", "acme-bank", "anonymous"]
    assert [s.headers.get("authorization") for s in asked(upstream) if s.path == CHAT_PATH] == [
        None,
        None,
        "Bearer sk-upstream",
    ]


async def test_trusted_proxy_trusts_the_headers_of_its_networks_only() -> None:
    async with sidecar(auth_mode="trusted-proxy", trusted_proxies=("127.0.0.0/8",)) as (client, _up, spool, _m):
        resp = await client.post(
            CHAT_PATH, json=CHAT, headers={"X-Reprolane-Tenant": "acme-bank", "X-Reprolane-Flag": "1"}
        )
    assert resp.status_code == 200
    env = only(spool)
    assert (env.tenant, env.flagged) == ("acme-bank", True)
    async with sidecar(auth_mode="trusted-proxy", trusted_proxies=("10.0.0.0/8",)) as (client, upstream, spool, _m):
        outside = await client.post(CHAT_PATH, json=CHAT, headers={"X-Reprolane-Tenant": "acme-bank"})
    assert outside.status_code == 401
    assert asked(upstream) == []
    assert spool.envelopes == []


def test_authenticator_checks_key_id_and_secret(keys: ApiKeys) -> None:
    auth = Authenticator("keys", load_key_file(keys.path))
    caller = auth.authenticate({b"authorization": f"Bearer {keys.bank}".encode()}, None)
    assert (caller.tenant, caller.key_id, caller.may_flag) == ("acme-bank", "bank-1", True)
    assert caller.credential_header == b"authorization"
    other_id = keys.attacker.replace("attacker-1", "bank-1", 1)  # the attacker's secret under the bank's id
    for key in (other_id, "rlk_bank-1_", "rlk_nobody_x", keys.bank + "x", "Basic abc"):
        with pytest.raises(Unauthenticated):
            auth.authenticate({b"authorization": f"Bearer {key}".encode()}, None)


def test_the_key_file_holds_hashes_only(keys: ApiKeys) -> None:
    text = keys.path.read_text()
    for key in (keys.bank, keys.attacker, keys.reader):
        secret = key.removeprefix("rlk_").partition("_")[2]  # the secret itself may hold "_" (urlsafe base64)
        assert len(secret) >= 40
        assert secret not in text
    assert os.stat(keys.path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [
        ('{"keys": []}', 0o644, "readable by others"),
        ('{"keys": []}', 0o620, "writable by its group"),
        ("not json", 0o600, "malformed"),
        ('{"keys": [{"id": "a", "tenant": "t", "roles": ["admin"], "hash": "x"}]}', 0o600, "roles"),
        ('{"keys": [{"id": "a", "tenant": "t", "roles": [], "hash": "sha256:00:11"}]}', 0o600, "hash"),
        ('{"keys": [{"id": "a b", "tenant": "t", "roles": [], "hash": "x"}]}', 0o600, "id"),
    ],
)
def test_an_untrustworthy_key_file_refuses_the_start_naming_the_field(
    tmp_path: Path, content: str, mode: int, message: str
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    path.chmod(mode)
    settings = CaptureSettings(upstream="http://127.0.0.1:9", auth_mode="keys", api_keys_path=path)
    with pytest.raises(CaptureError, match=rf"api_keys_path: .*{message}"):
        build_app(settings, spool=FakeSpool(), metrics=CaptureMetrics())


def test_a_missing_key_file_refuses_the_start(tmp_path: Path) -> None:
    settings = CaptureSettings(upstream="http://127.0.0.1:9", auth_mode="keys", api_keys_path=tmp_path / "none")
    with pytest.raises(CaptureError, match="api_keys_path: cannot read"):
        build_app(settings, spool=FakeSpool(), metrics=CaptureMetrics())


def test_keys_mode_is_the_default_and_needs_a_key_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPROLANE_CAPTURE_AUTH_MODE", raising=False)  # tests/conftest.py turns it off elsewhere
    with pytest.raises(CaptureError, match="api_keys_path"):
        build_settings(upstream="http://127.0.0.1:9")
    with pytest.raises(CaptureError, match="trusted_proxies"):
        build_settings(upstream="http://127.0.0.1:9", auth_mode="trusted-proxy")
    with pytest.raises(CaptureError, match="trusted_proxies"):
        build_settings(upstream="http://127.0.0.1:9", auth_mode="trusted-proxy", trusted_proxies=("10.0.0.300/8",))


def test_add_key_appends_a_hashed_entry_and_prints_the_key_once(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    path = tmp_path / "keys" / "api-keys.json"
    runner = CliRunner()
    first = runner.invoke(capture_app, ["add-key", str(path), "--id", "bank-1", "--tenant", "acme-bank"])
    second = runner.invoke(
        capture_app, ["add-key", str(path), "--id", "ops-1", "--tenant", "ops", "--role", "capture", "--role", "flag"]
    )
    again = runner.invoke(capture_app, ["add-key", str(path), "--id", "ops-1", "--tenant", "ops"])
    assert (first.exit_code, second.exit_code, again.exit_code) == (0, 0, 2)
    entries = load_key_file(path)
    assert {k: (e.tenant, sorted(e.roles)) for k, e in entries.items()} == {
        "bank-1": ("acme-bank", ["capture"]),
        "ops-1": ("ops", ["capture", "flag"]),
    }
    auth = Authenticator("keys", entries)
    assert auth.authenticate({b"x-reprolane-key": second.stdout.strip().encode()}, None).tenant == "ops"
    assert second.stdout.strip() not in path.read_text()


def test_new_key_refuses_bad_ids_tenants_and_roles(tmp_path: Path) -> None:
    for args in (("a_b", "t", ()), ("a", "bad tenant", ()), ("a", "t", ("root",))):
        with pytest.raises(CaptureError):
            new_key(*args)
    key, entry = new_key("a", "t")
    write_key_file(tmp_path / "k.json", [entry])
    assert Authenticator("keys", load_key_file(tmp_path / "k.json")).authenticate(
        {b"authorization": b"bearer " + key.encode()}, None
    ).roles == frozenset({"capture"})


async def test_passthrough_and_metrics_with_keys(keys: ApiKeys) -> None:
    """/metrics stays open to the scraper; every other path is the authenticated callers'."""
    async with sidecar(**keyed(keys)) as (client, upstream, _spool, _m):
        metrics = await client.get("/metrics")
        models = await client.get("/v1/models", headers=bearer(keys.attacker))
    assert (metrics.status_code, models.status_code) == (200, 200)
    assert [s.path for s in asked(upstream)] == ["/v1/models"]
