"""Verification binds the exact stored bytes to the signed log, sealed envelopes included (real SeaweedFS).

Sealed and plaintext envelopes go through the real publisher (sealer, S3 sink, Merkle log) into the tamper tests'
bucket (no Object Lock: the test plays an attacker with PutObject), the checkpoint job signs the day, and then
one object is overwritten per test: with forged sealed JSON (a valid-looking sealed record of the same id),
another envelope's bytes, the same plaintext sealed again under a new key and nonce, or a truncation. Each is
``modified`` and named; the untouched ones still prove. The crash window (an earlier sealing stored, the batch
republished and sealed afresh) is not a forgery and still verifies.
"""

from __future__ import annotations

import base64
import contextlib
import json
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from capture.audit.checkpoint import write_checkpoint
from capture.audit.store import AuditStore
from capture.audit.verify import Verdict, verify_range, verify_request
from capture.ledger.sealing import Keyring, Sealer
from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from schemas import ContractError, Envelope, sha256_hex
from schemas.envelope_compact import decode_compact, is_compact
from schemas.layout import envelope_key, index_body, request_index_key
from schemas.sealed import decode_sealed, new_data_key, seal_envelope
from tests.capture.audit.support import audit_cli, new_key, operator_keys, publish_through_s3, random_day
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]

BUCKET = "reprolane-test-audit-tamper"  # test_tamper_stack's: one bucket, a random capture day per test


@dataclass
class Day:
    stack: StackInfo
    client: Any
    store: AuditStore
    settings: CaptureSettings
    sealed: list[Envelope]  # of the encrypted tenant
    plain: list[Envelope]
    private: bytes
    public: bytes
    day: str

    def key(self, env: Envelope) -> str:
        return envelope_key(env.envelope_id(), env.tenant, env.captured_at)

    def stored(self, env: Envelope) -> bytes:
        return bytes(self.client.get_object(Bucket=BUCKET, Key=self.key(env))["Body"].read())

    def overwrite(self, env: Envelope, body: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=self.key(env), Body=body)

    def verify(self, env: Envelope) -> Verdict:
        return verify_request(self.store, env.request_id, self.public)


def capture_settings(stack: StackInfo, tmp_path: Path, tenant: str) -> CaptureSettings:
    return CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_bucket=BUCKET,
        retention_days=0,
        audit_log=True,
        encrypt_tenants=(tenant,),
        kek=base64.b64encode(new_data_key()).decode(),
        keys_bucket=BUCKET,
    )


@pytest.fixture
async def day(stack: StackInfo, tmp_path: Path) -> Day:
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET)
    captured = random_day()
    tenant = f"enc-{uuid.uuid4().hex[:8]}"
    settings = capture_settings(stack, tmp_path, tenant)

    def make(i: int, **kw: Any) -> Envelope:
        return envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=captured + timedelta(seconds=i), **kw)

    sealed = [make(i, tenant=tenant, workflow=None) for i in range(3)]
    plain = [make(3 + i) for i in range(2)]
    await publish_through_s3(settings, [sealed[0], plain[0], sealed[1], plain[1], sealed[2]], tmp_path / "spool")
    store = AuditStore(client, BUCKET)
    private, public = new_key()
    key_day = captured.strftime("%Y-%m-%d")
    assert write_checkpoint(store, key_day, private, retention=None) is not None
    return Day(stack, client, store, settings, sealed, plain, private, public, key_day)


def messages(verdict: Verdict) -> str:
    return "\n".join(f.message for f in verdict.findings)


def assert_modified(d: Day, env: Envelope, body: bytes, what: str) -> None:
    """`env`'s object now holds `body`: the single and the day verification say modified, naming `what`."""
    single = d.verify(env)
    assert single.kinds() == {"modified"}, messages(single)
    digest = sha256_hex(body)
    with contextlib.suppress(ContractError):  # a compact object is hashed as the canonical bytes it decodes to
        digest = f"{sha256_hex(decode_compact(body))} once decoded from compact" if is_compact(body) else digest
    expected = f"modified: stored bytes of {d.key(env)} hash to {digest}, the log committed to "
    assert expected in messages(single)
    assert what in messages(single)
    ranged = verify_range(d.store, d.day, d.public)
    assert ranged.kinds() == {"modified"}, messages(ranged)
    assert what in messages(ranged)
    for other in [*d.sealed, *d.plain]:
        if other is not env:
            assert d.verify(other).ok, messages(d.verify(other))


def test_untouched_sealed_and_plain_envelopes_verify(day: Day) -> None:
    for env in [*day.sealed, *day.plain]:
        verdict = day.verify(env)
        assert verdict.ok, messages(verdict)
        assert f"  object: {day.key(env)} (stored bytes match the logged bytes)" in verdict.lines
        assert not verdict.findings  # no "sealed: only the id is checked" any more
    assert verify_range(day.store, day.day, day.public).ok
    done = audit_cli(
        day.stack, BUCKET, "audit", "verify", day.sealed[1].request_id, public_key=base64.b64encode(day.public).decode()
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_forged_sealed_json_is_modified(day: Day) -> None:
    env = day.sealed[0]
    doc = json.loads(day.stored(env))
    doc["ciphertext"] = base64.b64encode(b"not what was captured, 32 bytes!").decode()  # the id it claims: the same
    forged = json.dumps(doc).encode()
    day.overwrite(env, forged)
    assert_modified(day, env, forged, "a sealed record of this envelope with other bytes")
    junk = json.dumps({"schema_version": "reprolane.sealed/1", "envelope_id": env.envelope_id()}).encode()
    day.overwrite(env, junk)
    assert_modified(day, env, junk, "sealed JSON that is not a valid sealed envelope (forged)")
    done = audit_cli(
        day.stack, BUCKET, "audit", "verify", env.request_id, public_key=base64.b64encode(day.public).decode()
    )
    assert done.returncode == 1
    assert done.stdout.startswith(f"FAILED request {env.request_id}: modified: stored bytes of {day.key(env)}")


def test_another_envelopes_bytes_are_modified(day: Day) -> None:
    env, other = day.sealed[0], day.sealed[1]
    replaced = day.stored(other)
    day.overwrite(env, replaced)
    assert_modified(day, env, replaced, f"a sealed record of another envelope ({other.envelope_id()}: replaced)")
    plain_bytes = day.stored(day.plain[0])
    day.overwrite(env, plain_bytes)
    assert_modified(day, env, plain_bytes, f"an envelope of request {day.plain[0].request_id} that is not the logged")


def test_the_same_plaintext_sealed_again_is_modified(day: Day) -> None:
    env = day.sealed[2]
    before = decode_sealed(day.stored(env))
    resealed = seal_envelope(
        env.canonical(), request_id=env.request_id, tenant=env.tenant, captured_at=env.captured_at,
        workflow=env.workflow, key_id="attacker-key", data_key=new_data_key(),
    ).canonical()  # fmt: skip
    assert decode_sealed(resealed).envelope_id == before.envelope_id  # the same id, a valid sealing
    day.overwrite(env, resealed)
    assert_modified(day, env, resealed, "re-sealed: key attacker-key, another nonce")


def test_truncated_objects_are_modified(day: Day) -> None:
    for env in (day.sealed[1], day.plain[1]):
        original = day.stored(env)
        truncated = original[: len(original) // 2]
        day.overwrite(env, truncated)
        kind = "of a compact envelope that do not decode" if is_compact(original) else "that are not JSON"
        assert_modified(day, env, truncated, f"{len(truncated)} bytes {kind} (truncated or overwritten)")
        day.overwrite(env, original)
        assert day.verify(env).ok


async def test_a_republished_sealed_envelope_logs_the_stored_sealing(stack: StackInfo, tmp_path: Path) -> None:
    """The crash window: the first sealing reached S3 and the process died before the leaf append; the restarted
    publisher seals the spooled record afresh, S3 keeps the first, and the leaf commits to the first."""
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    tenant = f"enc-{uuid.uuid4().hex[:8]}"
    settings = capture_settings(stack, tmp_path, tenant)
    captured = random_day()
    env = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=captured, tenant=tenant, workflow=None)
    keyring = Keyring(client, BUCKET, base64.b64decode(settings.kek.get_secret_value()))  # type: ignore[union-attr]
    first = Sealer(keyring, [tenant]).seal(Outgoing.from_entry(SpoolEntry(1, env.canonical())))
    sink = S3Sink(settings)
    await sink.publish([first])
    await sink.close()
    await publish_through_s3(settings, [env], tmp_path / "spool")  # sealed again: other bytes, S3 keeps the first
    stored = client.get_object(Bucket=BUCKET, Key=first.object_key)["Body"].read()
    assert stored == first.payload
    store = AuditStore(client, BUCKET)
    private, public = new_key()
    assert write_checkpoint(store, captured.strftime("%Y-%m-%d"), private, retention=None) is not None
    verdict = verify_request(store, env.request_id, public)
    assert verdict.ok, messages(verdict)


def test_an_index_entry_moved_to_another_record_is_misindexed_and_never_followed(day: Day, tmp_path: Path) -> None:
    """Whoever can write the bucket points a request id's index entry at another request's record (the entry
    self-consistent: that record's key, id and tenant): verify names it, a hold refuses to follow it."""
    victim, other = day.plain[0], day.plain[1]
    sealed_victim = day.sealed[0]
    for moved, to in ((victim, other), (sealed_victim, other)):
        body = index_body(to.envelope_id(), day.key(to), to.tenant, to.captured_at)
        day.client.put_object(Bucket=BUCKET, Key=request_index_key(moved.request_id), Body=body)
        verdict = day.verify(moved)
        assert "misindexed" in verdict.kinds(), messages(verdict)
        assert f"request id {to.request_id!r}, the entry is filed under {moved.request_id!r}" in messages(verdict)
    public = base64.b64encode(day.public).decode()
    done = audit_cli(day.stack, BUCKET, "audit", "verify", victim.request_id, public_key=public)
    assert done.returncode == 1
    assert done.stdout.startswith(f"FAILED request {victim.request_id}: misindexed: the index entry of ")
    assert audit_cli(day.stack, BUCKET, "audit", "verify", other.request_id, public_key=public).returncode == 0

    ops = operator_keys(tmp_path / "ops", holder=(("hold-admin",), None))
    held = audit_cli(day.stack, BUCKET, "audit", "hold", "add", sealed_victim.request_id, "--operator-key-file",
                     ops.key_file("holder"), operators=ops)  # fmt: skip
    assert held.returncode == 1
    assert held.stderr.count("\n") == 1
    assert "does not match the envelope it points to" in held.stderr
