"""Crypto-shredding on the real stack: sealed envelopes through the real Publisher to Tansu and SeaweedFS.

The replayer's store opens them with the tenant's key; after ``keys tenant shred`` the same write-once object is still
in the Object-Lock bucket, byte for byte, and replaying it fails with the one-line crypto-shredding message.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from capture.ledger.sealing import Keyring
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.cli.root import build_app
from replayer.cli import build_replay_app
from replayer.errors import NotReplayableError
from replayer.store import EnvelopeStore
from schemas import decode_envelope
from schemas.layout import data_key_prefix, envelope_key
from schemas.sealed import decode_sealed, is_sealed
from tests.capture.audit.conftest import AuditStack
from tests.capture.audit.support import OperatorKeys, access_records, operator_keys
from tests.cli_process import reprolane
from tests.factories import envelope

pytestmark = pytest.mark.stack


def capture_settings(a: AuditStack, tmp_path: Path, tenant: str) -> CaptureSettings:
    return CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        kafka_bootstrap=a.info.kafka_bootstrap,
        s3_endpoint=a.info.s3_endpoint,
        s3_access_key=a.info.s3_access_key,
        s3_secret_key=a.info.s3_secret_key,
        s3_bucket=a.info.audit_bucket,
        retention_days=1,
        encrypt_tenants=(tenant,),
        kek=a.kek_b64,
        keys_bucket=a.bucket,
    )


async def publish(settings: CaptureSettings, topic: str, envelopes: list[Any]) -> None:
    spool = Spool(settings.spool_dir, max_bytes=1 << 24, group_commit_ms=0)
    await spool.open()
    try:
        for env in envelopes:
            await spool.append(env)
        publisher = Publisher(spool, settings, sinks=[KafkaSink(settings, topic=topic), S3Sink(settings)])
        await publisher.start()
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while spool.depth:
                assert asyncio.get_running_loop().time() < deadline, "spool not drained"
                await asyncio.sleep(0.05)
        finally:
            await publisher.stop()
    finally:
        await spool.close()


async def test_sealed_envelope_opens_until_its_tenant_is_shredded(audit_stack: AuditStack, tmp_path: Path) -> None:
    a = audit_stack
    tenant, other = f"enc-{a.suffix}", f"plain-{a.suffix}"
    now = datetime.now(UTC).replace(microsecond=0)
    secret_env = envelope(request_id=f"req-{uuid.uuid4().hex[:12]}", tenant=tenant, captured_at=now, workflow=None)
    plain_env = envelope(request_id=f"req-{uuid.uuid4().hex[:12]}", tenant=other, captured_at=now, workflow=None)
    settings = capture_settings(a, tmp_path, tenant)
    await publish(settings, a.envelope_topic, [secret_env, plain_env])

    # what left the sidecar: sealed for the encrypted tenant, plaintext for the other, on both sinks
    s3 = a.client()
    key = envelope_key(secret_env.envelope_id(), tenant, now)
    stored = s3.get_object(Bucket=a.info.audit_bucket, Key=key)["Body"].read()
    assert is_sealed(stored)
    assert b"Paris" not in stored
    assert b"smollm2" not in stored
    assert decode_sealed(stored).envelope_id == secret_env.envelope_id()
    on_kafka = await a.consume(a.envelope_topic, 2)
    assert sorted(is_sealed(v) for v in on_kafka) == [False, True]
    assert not any(b"Paris" in v for v in on_kafka if is_sealed(v))
    plain_stored = s3.get_object(Bucket=a.info.audit_bucket, Key=envelope_key(plain_env.envelope_id(), other, now))
    assert decode_envelope(plain_stored["Body"].read()) == plain_env

    # the replayer's store opens it with the tenant's key
    store = EnvelopeStore(s3, a.info.audit_bucket, keys_bucket=a.bucket, kek=a.kek)
    assert store.get_by_request_id(secret_env.request_id) == secret_env
    without_kek = EnvelopeStore(s3, a.info.audit_bucket)
    with pytest.raises(Exception, match="no KEK is configured"):
        without_kek.get_by_request_id(secret_env.request_id)

    # shred: every key object of the tenant is gone, the record stays, and replaying it says why it cannot
    keyring = Keyring(s3, a.bucket, None)
    assert len(keyring.key_ids(tenant)) == 1
    assert keyring.shred(tenant) >= 1
    assert keyring.key_ids(tenant) == []
    assert s3.list_objects_v2(Bucket=a.bucket, Prefix=data_key_prefix(tenant)).get("KeyCount", 0) == 0
    message = (
        f"tenant {tenant}'s data key was destroyed (crypto-shredded): "
        f"request {secret_env.request_id} cannot be replayed"
    )
    with pytest.raises(NotReplayableError) as info:
        store.get_by_request_id(secret_env.request_id)
    assert str(info.value) == message
    assert s3.get_object(Bucket=a.info.audit_bucket, Key=key)["Body"].read() == stored  # write-once, still there
    assert store.get_by_request_id(plain_env.request_id) == plain_env  # other tenants unaffected

    # the replay CLI: one line, exit 2, no lane is even opened
    def no_lane(_settings: Any) -> Any:
        raise AssertionError("a shredded envelope must not reach a lane")

    app = build_app({"replay": build_replay_app(lane_factory=no_lane, store_factory=lambda _s: store)})
    result = CliRunner().invoke(app, ["replay", "request", secret_env.request_id])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"reprolane: error: {message}"


async def test_keys_are_reused_and_a_shredded_tenant_gets_a_new_key(audit_stack: AuditStack) -> None:
    a = audit_stack
    keyring = Keyring(a.client(), a.bucket, a.kek, cache_s=0.0)
    tenant = f"t-{a.suffix}"
    first = keyring.current_key(tenant)
    assert keyring.current_key(tenant) == first  # found in S3 again (cache off), not re-made
    assert keyring.get_key(tenant, first[0]) == first[1]
    keyring.shred(tenant)
    assert keyring.get_key(tenant, first[0]) is None
    second = keyring.current_key(tenant)
    assert second[0] != first[0]
    assert second[1] != first[1]


async def test_the_lake_keeps_only_metadata_of_sealed_envelopes(audit_stack: AuditStack, tmp_path: Path) -> None:
    from tests.capture.audit.lake.test_store_stack import archive

    a = audit_stack
    tenant = f"enc-{a.suffix}"
    env = envelope(request_id=f"req-{uuid.uuid4().hex[:12]}", tenant=tenant, workflow=None)
    await publish(capture_settings(a, tmp_path, tenant), a.envelope_topic, [env])
    await archive(a, 1)
    lake = a.lake()
    [part] = lake.partitions("envelopes")
    table = lake.dataset("envelopes").to_table()
    [row] = table.to_pylist()
    assert row["sealed"] is True
    assert (row["envelope_id"], row["request_id"], row["tenant"]) == (env.envelope_id(), env.request_id, tenant)
    assert row["key_id"]
    content = ("model", "prompt_token_ids", "prompt_text", "output_token_ids", "output_text", "runtime_sha256")
    assert all(row[c] is None for c in content)
    raw = b"".join(lake.fs.open_input_stream(p).read() for p in part.paths)
    assert b"Paris" not in raw
    assert b"smollm2" not in raw


async def test_the_replayer_service_opens_sealed_messages_and_skips_shredded_ones(
    audit_stack: AuditStack, tmp_path: Path
) -> None:
    from faststream.kafka import KafkaBroker

    from replayer.service import ReplayerService
    from replayer.settings import ReplayerSettings
    from tests.replayer.support import FakeLane

    a = audit_stack
    tenant = f"enc-{a.suffix}"
    env = envelope(request_id=f"req-{uuid.uuid4().hex[:12]}", tenant=tenant, workflow=None, flagged=False)
    await publish(capture_settings(a, tmp_path, tenant), a.envelope_topic, [env])
    [message] = await a.consume(a.envelope_topic, 1)
    assert is_sealed(message)
    s3 = a.client()
    store = EnvelopeStore(s3, a.info.audit_bucket, keys_bucket=a.bucket, kek=a.kek)
    assert store.decode_message(message) == env
    service = ReplayerService(ReplayerSettings(metrics_port=None), FakeLane(), store, broker=KafkaBroker())
    assert (await service.handle_envelope_bytes(message)).outcome == "not_selected"  # opened, then selected on
    tampered = message.replace(b'"ciphertext":"', b'"ciphertext":"AAAA')
    with pytest.raises(Exception, match=r"schema: .*does not open: authentication failed"):  # dead-lettered
        await service.handle_envelope_bytes(tampered)
    Keyring(s3, a.bucket, None).shred(tenant)
    assert (await service.handle_envelope_bytes(message)).outcome == "not_replayable"


async def test_after_a_shred_no_plaintext_of_the_tenant_remains_in_s3(audit_stack: AuditStack, tmp_path: Path) -> None:
    """Issue 18, finding 7: the envelope *and what the replayer derived from it* (the replay result in the locked
    bucket, the divergence event) are sealed or redacted; after ``reprolane keys tenant shred`` every object of the
    tenant in S3 is scanned for the prompt, the recorded output and the replayed output."""
    from faststream.kafka import KafkaBroker, TestKafkaBroker
    from faststream.kafka.annotations import KafkaMessage

    from replayer.service import ReplayerService
    from replayer.settings import ReplayerSettings
    from schemas import PromptRecord, decode_divergence
    from schemas.layout import replay_results_prefix, request_index_key, tenant_envelopes_prefix
    from tests.replayer.support import FakeLane

    a = audit_stack
    tenant = f"enc-{a.suffix}"
    prompt_text = f"the secret question {uuid.uuid4().hex}"
    env = envelope(
        request_id=f"req-{uuid.uuid4().hex[:12]}",
        tenant=tenant,
        workflow=None,
        flagged=True,
        prompt=PromptRecord(token_ids=(1, 9690, 198, 2683, 314), source="upstream", text=prompt_text),
    )
    await publish(capture_settings(a, tmp_path, tenant), a.envelope_topic, [env])
    [message] = await a.consume(a.envelope_topic, 1)
    lane = FakeLane()
    lane.learn(env)
    replayed_text = f"the replayed answer {uuid.uuid4().hex}"  # the same token ids, its own text: a marker
    [(prompt_ids, recorded)] = lane.recorded.items()
    lane.recorded[prompt_ids] = recorded.model_copy(update={"text": replayed_text})
    s3 = a.client()
    store = EnvelopeStore(s3, a.info.audit_bucket, keys_bucket=a.bucket, kek=a.kek)
    settings = ReplayerSettings(metrics_port=None, divergence_topic=a.divergence_topic)
    service = ReplayerService(settings, lane, store, broker=KafkaBroker())
    published: list[bytes] = []

    @service.broker.subscriber(a.divergence_topic)
    async def _events(msg: KafkaMessage) -> None:
        published.append(msg.body)

    async with TestKafkaBroker(service.broker):
        handled = await service.handle_envelope_bytes(message)
    assert handled.outcome == "replayed"
    assert lane.calls, "the envelope reached the lane"
    [event] = published
    for marker in ("Paris", prompt_text, replayed_text):
        assert marker.encode() not in event
    assert decode_divergence(event).verdict == "bitwise"

    # everything of this tenant in S3: its envelopes, its request's index, its replay results, its keys
    audit_keys = [
        obj["Key"]
        for prefix in (
            tenant_envelopes_prefix(tenant),
            request_index_key(env.request_id),
            replay_results_prefix(env.envelope_id(), env.captured_at),
        )
        for obj in s3.list_objects_v2(Bucket=a.info.audit_bucket, Prefix=prefix).get("Contents", [])
    ]
    results = [k for k in audit_keys if k.startswith(replay_results_prefix(env.envelope_id(), env.captured_at))]
    assert len(results) == 1, "the replay result is stored"

    ops = operator_keys(tmp_path / "ops", shredder=(("key-admin",), tenant), holder=(("hold-admin",), None))
    refused = audit_cli_keys(a, "keys", "tenant", "shred", tenant, "--yes", "--operator-key-file",
                             ops.key_file("holder"), operators=ops)  # fmt: skip
    assert (refused.returncode, refused.stderr.count("\n")) == (2, 1), refused.stderr
    assert "lacks the 'key-admin' role" in refused.stderr
    assert s3.list_objects_v2(Bucket=a.bucket, Prefix=data_key_prefix(tenant)).get("KeyCount", 0) >= 1
    shred = audit_cli_keys(a, "keys", "tenant", "shred", tenant, "--yes", "--operator-key-file",
                           ops.key_file("shredder"), operators=ops)  # fmt: skip
    assert shred.returncode == 0, shred.stderr
    decisions = [(r.actor_key_id, r.result) for r in access_records(s3, a.info.audit_bucket, tenant)]
    assert decisions == [("holder", "refused"), ("shredder", "allowed")]
    assert s3.list_objects_v2(Bucket=a.bucket, Prefix=data_key_prefix(tenant)).get("KeyCount", 0) == 0
    scanned = 0
    for key in audit_keys:
        body = s3.get_object(Bucket=a.info.audit_bucket, Key=key)["Body"].read()
        scanned += 1
        for marker in ("Paris", prompt_text, replayed_text):
            assert marker.encode() not in body, f"{key} still holds {marker!r} after the shred"
    assert scanned >= 3  # the envelope, its index, its replay result
    with pytest.raises(NotReplayableError, match="crypto-shredded"):
        store.get_result(env, service.lane_fingerprint_sha256)


def audit_cli_keys(a: AuditStack, *args: str, operators: OperatorKeys) -> Any:
    """``reprolane ARGS`` as an operator runs it, with the archiver's S3 settings on this test's keys bucket."""
    import os

    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_OPERATOR_")},
        **operators.env(),
        "REPROLANE_ARCHIVER_S3_BUCKET": a.info.audit_bucket,
        "REPROLANE_ARCHIVER_S3_ENDPOINT": a.info.s3_endpoint,
        "REPROLANE_ARCHIVER_S3_ACCESS_KEY": a.info.s3_access_key,
        "REPROLANE_ARCHIVER_S3_SECRET_KEY": a.info.s3_secret_key,
        "REPROLANE_ARCHIVER_KEYS_BUCKET": a.bucket,
    }
    return reprolane(*args, env=environ, timeout=60)
