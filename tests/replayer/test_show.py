"""``reprolane audit show``: the envelope as stored, checked against its content address, through the root CLI.

Against a moto S3 seeded as the capture side writes (plain and sealed envelopes, their index objects, a wrapped
data key); the same command on the real stack, its ``--json`` stdout compared with the stored bytes, is in
tests/infra/cli/test_json_output.py.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from infra.cli.root import build_app
from replayer.cli import build_show_command
from replayer.store import EnvelopeStore
from schemas.layout import client_request_index_key, envelope_key, index_body
from tests.replayer.support import S3Target, make_envelope, moto_s3, seed_envelope, seed_sealed

KEK = os.urandom(32)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Target]:
    with moto_s3() as target:
        yield target


def show(store: EnvelopeStore, *args: str) -> tuple[int, str, str]:
    app = build_app({"show": build_show_command(store_factory=lambda _settings: store)})
    result = CliRunner().invoke(app, ["audit", "show", *args])
    return result.exit_code, result.stdout, result.stderr


def plain_store(s3: S3Target) -> EnvelopeStore:
    return EnvelopeStore(s3.client(), s3.bucket)


def keyed_store(s3: S3Target) -> EnvelopeStore:
    return EnvelopeStore(s3.client(), s3.bucket, keys_bucket=s3.bucket, kek=KEK)


def test_show_prints_who_when_contract_fingerprints_prompt_and_output(s3: S3Target) -> None:
    env = make_envelope(1, client_request_id="ticket-42")
    seed_envelope(s3.client(), s3.bucket, env)
    code, out, _ = show(plain_store(s3), env.request_id)
    assert code == 0
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    assert out.startswith(f"Request {env.request_id} (envelope {env.envelope_id()})\n")
    assert f"s3://{s3.bucket}/{key} ({len(env.canonical())} bytes; its bytes' sha256 is the envelope id)" in out
    assert f"  who        tenant {env.tenant}, client request id ticket-42" in out
    assert f"  when       {env.captured_at.isoformat()}" in out
    assert env.workflow is None
    assert "  workflow   none" in out
    assert "Sampling contract\n" in out
    assert '  seed_scope          "none"' in out
    assert f"Runtime fingerprint (sha256 {env.runtime.sha256()})" in out
    assert env.prompt is not None
    assert f"  token ids  [{', '.join(map(str, env.prompt.token_ids))}]" in out
    assert "Outcome: output (1 choice(s))" in out


def test_show_json_is_the_stored_bytes_and_client_ids_find_the_newest(s3: S3Target) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    older, newer = (
        make_envelope(n, tenant=tenant, client_request_id="retry-me", captured_at=datetime(2026, 11, 1, n, tzinfo=UTC))
        for n in (1, 2)
    )
    client = s3.client()
    for env in (older, newer):
        key = seed_envelope(client, s3.bucket, env)
        client.put_object(
            Bucket=s3.bucket, Key=client_request_index_key(tenant, "retry-me", env.request_id),
            Body=index_body(env.envelope_id(), key, env.tenant, env.captured_at),
        )  # fmt: skip
    code, out, _ = show(plain_store(s3), older.request_id, "--json")
    assert (code, out) == (0, older.canonical().decode() + "\n")
    code, out, _ = show(plain_store(s3), "--client-request-id", "retry-me", "--tenant", tenant, "--json")
    assert (code, out) == (0, newer.canonical().decode() + "\n")


def test_stored_bytes_that_are_not_their_content_address_are_refused(s3: S3Target) -> None:
    env = make_envelope(3)
    key = seed_envelope(s3.client(), s3.bucket, env)
    altered = env.model_copy(update={"flagged": False}).canonical()  # valid JSON, another record
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=altered)
    code, out, err = show(plain_store(s3), env.request_id)
    assert (code, out) == (2, "")
    assert err.startswith(f"reprolane: error: stored envelope s3://{s3.bucket}/{key}: its bytes hash to ")
    assert f"not to the envelope id {env.envelope_id()}" in err


def test_a_sealed_envelope_opens_with_the_kek_and_says_it_is_sealed_without(s3: S3Target) -> None:
    env = make_envelope(4, tenant=f"enc-{uuid.uuid4().hex[:6]}")
    sealed = seed_sealed(s3, env, KEK)
    code, out, _ = show(keyed_store(s3), env.request_id)
    assert code == 0
    assert "sealed, opened with its tenant's data key; the plaintext's sha256 is the envelope id" in out
    assert f"  who        tenant {env.tenant}" in out
    code, out, _ = show(keyed_store(s3), env.request_id, "--json")
    assert (code, out) == (0, env.canonical().decode() + "\n")

    code, out, _ = show(plain_store(s3), env.request_id)
    assert code == 0
    assert f"is sealed: tenant {env.tenant} is encrypted under data key " in out
    assert "It cannot be opened here:" in out
    assert "no KEK is configured" in out
    assert env.prompt is not None
    assert "token ids" not in out
    code, out, err = show(plain_store(s3), env.request_id, "--json")
    assert (code, out) == (0, sealed.decode() + "\n")
    assert "is sealed and cannot be opened here" in err


def test_a_shredded_tenant_is_shown_sealed_with_the_reason(s3: S3Target) -> None:
    env = make_envelope(5, tenant=f"enc-{uuid.uuid4().hex[:6]}")
    seed_sealed(s3, env, KEK)
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=s3.bucket, Prefix=f"keys/tenant={env.tenant}/").get("Contents", []):
        client.delete_object(Bucket=s3.bucket, Key=obj["Key"])
    code, out, _ = show(keyed_store(s3), env.request_id)
    assert code == 0
    assert "crypto-shredded" in out


def test_show_needs_one_way_to_name_the_request(s3: S3Target) -> None:
    code, _, err = show(plain_store(s3))
    assert (code, err) == (2, "reprolane: error: give REQUEST_ID, or --client-request-id with --tenant\n")
    missing = "rl-" + "0" * 32  # the sidecar's shape: just not there
    code, _, err = show(plain_store(s3), missing)
    assert code == 2
    assert err == f"reprolane: error: no envelope is indexed under request id {missing!r}\n"


def test_a_client_request_id_given_as_the_request_id_gets_the_way_to_ask_for_it(s3: S3Target) -> None:
    code, _, err = show(plain_store(s3), "order-42")  # a client's X-Request-Id: no envelope is indexed under it
    assert code == 2
    assert err.startswith("reprolane: error: no envelope is indexed under request id 'order-42'; ")
    assert "run `reprolane audit show --client-request-id order-42 --tenant TENANT`" in err
    assert "\n" not in err.rstrip("\n")  # one line
