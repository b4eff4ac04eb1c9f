"""Issue 18, finding 4, on the real parts: ``reprolane serve capture`` (a subprocess, configured through its
environment as an operator would) with an API key file, in front of the stack's vLLM, publishing to the stack's
Kafka and S3, driven by the official ``openai`` client with ``api_key=...``.

The finding's experiment: two tenants send the same ``X-Request-Id: loan-4711`` and the attacker also claims
the bank's tenant. Now the attacker's claim is refused, the sidecar's request ids are its own, and the bank's
lookup by client id finds the bank's envelope only.

The first test needs no stack: a key file others can read stops the sidecar at start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infra.demo.services import reprolane_argv
from infra.stack import process
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo
from replayer.errors import EnvelopeNotFoundError
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from tests.capture.keys import ApiKeys, write_test_keys
from tests.cli_process import reprolane

REPO = Path(__file__).resolve().parents[3]
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Say yes."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sidecar_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_CAPTURE_")}
    env["PYTHONPATH"] = str(REPO)
    return {**env, **extra}


def test_a_key_file_others_can_read_stops_the_cli_sidecar(tmp_path: Path) -> None:
    keys = write_test_keys(tmp_path)
    keys.path.chmod(0o644)
    env = sidecar_env({
        "REPROLANE_CAPTURE_UPSTREAM": "http://127.0.0.1:9",
        "REPROLANE_CAPTURE_AUTH_MODE": "keys",
        "REPROLANE_CAPTURE_API_KEYS_PATH": str(keys.path),
    })  # fmt: skip
    args = ["serve", "capture", "--port", str(free_port()), "--spool-dir", str(tmp_path / "spool")]
    try:
        done = reprolane(*args, env=env, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the sidecar served with a world-readable key file")
    assert done.returncode == 1
    assert "api_keys_path" in done.stderr
    assert "readable by others" in done.stderr


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    return write_test_keys(tmp_path)


@pytest.fixture
def sidecar_url(stack: StackInfo, keys: ApiKeys, tmp_path: Path) -> Iterator[str]:
    """``reprolane serve capture`` with keys on, in front of the stack (its sinks too), until the test ends."""
    port = free_port()
    env = sidecar_env({
        **stack_defaults(stack),
        "REPROLANE_CAPTURE_AUTH_MODE": "keys",
        "REPROLANE_CAPTURE_API_KEYS_PATH": str(keys.path),
    })  # fmt: skip
    args = ["serve", "capture", "--port", str(port), "--spool-dir", str(tmp_path / "spool"), "--sidecar-id",
            f"auth-test-{uuid.uuid4().hex[:6]}"]  # fmt: skip
    log = tmp_path / "sidecar.log"
    ref = process.spawn([*reprolane_argv(), *args], env, log, REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.is_alive(ref), process.log_tail(log, 20)
            try:
                if httpx.get(f"{url}/metrics", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, process.log_tail(log, 20)
            time.sleep(0.2)
        yield url
    finally:
        process.stop(ref, 20.0)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120.0)


def chat(c: openai.OpenAI, model: str, **headers: str) -> str:
    """The sidecar's request id of one short chat request."""
    raw = c.chat.completions.with_raw_response.create(
        model=model,
        messages=MESSAGES,
        max_tokens=2,
        temperature=0,
        extra_headers=headers,  # type: ignore[arg-type]
    )
    return raw.headers["x-reprolane-request-id"]


def replayer_store(stack: StackInfo) -> EnvelopeStore:
    return EnvelopeStore.from_settings(
        ReplayerSettings(
            s3_endpoint=stack.s3_endpoint,
            s3_access_key=stack.s3_access_key,
            s3_secret_key=stack.s3_secret_key,
            s3_region=stack.s3_region,
            s3_bucket=stack.audit_bucket,
        )
    )


@pytest.mark.stack
def test_two_tenants_one_client_id_each_finds_its_own(stack: StackInfo, keys: ApiKeys, sidecar_url: str) -> None:
    client_id = f"loan-{uuid.uuid4().hex[:8]}"
    bank, attacker = client(sidecar_url, keys.bank), client(sidecar_url, keys.attacker)
    bank_rid = chat(bank, stack.model_name, **{"X-Request-Id": client_id})
    with pytest.raises(openai.PermissionDeniedError, match="X-Reprolane-Tenant"):
        chat(attacker, stack.model_name, **{"X-Request-Id": client_id, "X-Reprolane-Tenant": "acme-bank"})
    attacker_rid = chat(attacker, stack.model_name, **{"X-Request-Id": client_id})
    assert bank_rid != attacker_rid
    assert client_id not in (bank_rid, attacker_rid)
    assert bank_rid.startswith("rl-")
    assert len(bank_rid) == 35

    store = replayer_store(stack)
    deadline = time.monotonic() + 60
    while True:  # the publisher stores asynchronously
        try:
            found = {t: store.find_by_client_request_id(t, client_id) for t in ("acme-bank", "attacker")}
            if all(len(v) == 2 if t == "attacker" else len(v) == 1 for t, v in found.items()):
                break
        except EnvelopeNotFoundError:
            pass
        assert time.monotonic() < deadline, "the client-request-id index objects never appeared"
        time.sleep(0.5)
    (bank_env,) = found["acme-bank"]
    assert (bank_env.request_id, bank_env.tenant, bank_env.client_request_id) == (bank_rid, "acme-bank", client_id)
    refused, served = found["attacker"]  # the 403 is recorded too, under the attacker's own tenant
    assert {refused.tenant, served.tenant} == {"attacker"}
    assert served.request_id == attacker_rid
    with pytest.raises(EnvelopeNotFoundError):
        store.get_by_request_id(client_id)  # no sidecar id is ever the client's
    for env in (bank_env, refused, served):
        assert keys.bank.rsplit("_", 1)[1] not in env.model_dump_json()
        assert keys.attacker.rsplit("_", 1)[1] not in env.model_dump_json()


@pytest.mark.stack
def test_unauthenticated_is_401_and_only_the_flag_role_flags(stack: StackInfo, keys: ApiKeys, sidecar_url: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        chat(client(sidecar_url, "sk-anything"), stack.model_name)
    anonymous = httpx.post(f"{sidecar_url}/v1/chat/completions", json={"model": stack.model_name, "messages": MESSAGES})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError, match="flag"):
        chat(client(sidecar_url, keys.attacker), stack.model_name, **{"X-Reprolane-Flag": "1"})
    client_id = f"flag-{uuid.uuid4().hex[:8]}"
    chat(client(sidecar_url, keys.bank), stack.model_name, **{"X-Reprolane-Flag": "1", "X-Request-Id": client_id})
    store = replayer_store(stack)
    deadline = time.monotonic() + 60
    while True:
        try:
            (env,) = store.find_by_client_request_id("acme-bank", client_id)
            break
        except EnvelopeNotFoundError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert (env.flagged, env.flag_reason, env.tenant) == (True, "header", "acme-bank")
