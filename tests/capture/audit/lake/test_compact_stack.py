"""Compact envelopes on the real stack, end to end: a chat request through the sidecar in front of the real vLLM
(``envelope_encoding`` left at its default), the S3 object and the Kafka value are compact, ``reprolane audit verify``
proves it, the replayer replays it from Kafka (remote lane: the stack's vLLM), the archiver puts it in the lake;
an envelope stored as JSON, as sidecars stored them before, takes the same path; a forged compact object fails
``reprolane audit verify``.

One bucket of its own, without Object Lock (the test plays the attacker at the end), reused across runs: every
SeaweedFS bucket takes volume slots. Each run has its own topics, lake prefix and request ids; the day's log of
the bucket grows by run (the sidecar stamps the capture time: the day is today). Every run signs with the same
key and first removes the day's checkpoints (its own bucket: a checkpoint another key signed would be reported).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest

from capture.audit.checkpoint import write_checkpoint
from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import run_query
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.audit.store import AuditStore
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.request.app import build_app
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from replayer.lanes import make_lane
from replayer.service import ReplayerService
from replayer.store import EnvelopeStore
from schemas import CapturedOutput, decode_envelope, envelope_bytes
from schemas.envelope_compact import decode_compact, encode_compact, is_compact
from schemas.layout import (
    ENCODING_COMPACT,
    HEADER_ENCODING,
    HEADER_ENVELOPE_ID,
    LAKE_BUCKET,
    capture_day,
    checkpoints_prefix,
    content_type,
    envelope_key,
)
from tests.capture.audit.conftest import eventually
from tests.capture.audit.support import audit_cli, publish_through_s3
from tests.capture.fake_upstream import serve
from tests.capture.keys import ApiKeys, write_test_keys
from tests.factories import envelope
from tests.replayer.service_harness import Topics, events
from tests.replayer.support import S3Target

pytestmark = pytest.mark.stack

BUCKET = "reprolane-test-compact"
MESSAGES: Any = [{"role": "user", "content": "What is the capital of France?"}]


def signing_key() -> tuple[bytes, bytes]:
    """This test's fixed Ed25519 (private, public) raw key pair (see module docstring)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    private = hashlib.sha256(b"reprolane test_compact_stack signing key").digest()
    public = Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return private, public


def capture_settings(stack: StackInfo, tmp_path: Path, keys: ApiKeys) -> CaptureSettings:
    assert stack.vllm_url is not None
    assert stack.model_dir is not None
    base: dict[str, Any] = {
        "upstream": stack.vllm_url,
        "mode": "guaranteed",
        "spool_dir": tmp_path / "spool",
        "manifest_path": stack.model_dir / "reprolane-manifest.json",
        "auth_mode": "keys",
        "api_keys_path": keys.path,
        "kafka_bootstrap": stack.kafka_bootstrap,
        "s3_endpoint": stack.s3_endpoint,
        "s3_access_key": stack.s3_access_key,
        "s3_secret_key": stack.s3_secret_key,
        "s3_region": stack.s3_region,
        "s3_bucket": BUCKET,
        "retention_days": 0,
        "audit_log": True,
    }
    return CaptureSettings(**base)


async def capture_one(stack: StackInfo, settings: CaptureSettings, keys: ApiKeys, topic: str) -> str:
    """One chat request through the sidecar (its publisher: Kafka `topic`, S3, the Merkle log); its request id,
    once the spool is drained."""
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    publisher = Publisher(spool, settings, sinks=[KafkaSink(settings, topic=topic), S3Sink(settings)], idle_poll_s=0.05)
    async with serve(build_app(settings, spool=spool, publisher=publisher)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=keys.bank, max_retries=0)
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=stack.model_name, messages=MESSAGES, max_tokens=8, temperature=0
            )
        finally:
            await client.close()
        await eventually(lambda: spool.depth == 0, 60, "the sidecar's publishing")
    return raw.headers["x-reprolane-request-id"]


async def test_compact_envelopes_are_stored_sent_verified_replayed_and_archived(
    stack: StackInfo, tmp_path: Path
) -> None:
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET)
    s3 = S3Target(stack.s3_endpoint, stack.s3_access_key, stack.s3_secret_key, BUCKET, stack.s3_region)
    topics = await Topics.create(stack.kafka_bootstrap, s3)
    topic = topics.names["envelope_topic"]

    # 1. captured through the sidecar, compact by default
    keys = write_test_keys(tmp_path)
    settings = capture_settings(stack, tmp_path, keys)
    assert settings.envelope_encoding == "compact"
    request_id = await capture_one(stack, settings, keys, topic)
    store = EnvelopeStore(client, BUCKET)
    captured = store.get_by_request_id(request_id)
    assert isinstance(captured.outcome, CapturedOutput)
    assert captured.outcome.choices[0].logprobs, "the sidecar records top-k logprobs"
    key = envelope_key(captured.envelope_id(), captured.tenant, captured.captured_at)
    obj = client.get_object(Bucket=BUCKET, Key=key)
    stored = obj["Body"].read()
    assert is_compact(stored)
    assert obj["ContentType"] == content_type(ENCODING_COMPACT)
    assert decode_compact(stored) == captured.canonical()
    assert len(stored) < len(captured.canonical()) / 2

    # 2. an envelope stored the old way (JSON object, JSON Kafka value) by an earlier sidecar, the same day
    old = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=datetime.now(UTC), workflow=None)
    json_settings = settings.model_copy(update={"envelope_encoding": "json", "spool_dir": tmp_path / "spool-json"})
    await publish_through_s3(json_settings, [old], tmp_path / "spool-json")
    old_key = envelope_key(old.envelope_id(), old.tenant, old.captured_at)
    assert client.get_object(Bucket=BUCKET, Key=old_key)["Body"].read() == old.canonical()
    await topics.produce("envelope_topic", old.canonical(), key=old.request_id.encode())
    assert store.get_by_request_id(old.request_id) == old

    # 3. on Kafka: the compact value and its encoding header, the JSON one as it was
    records = await topics.consume("envelope_topic", 2)
    by_id = {dict(r.headers).get(HEADER_ENVELOPE_ID, b"").decode(): r for r in records}
    sent = by_id[captured.envelope_id()]
    assert is_compact(sent.value)
    assert dict(sent.headers)[HEADER_ENCODING] == ENCODING_COMPACT.encode()
    assert decode_envelope(sent.value) == captured
    assert [decode_envelope(r.value) for r in records if not is_compact(r.value)] == [old]

    # 4. reprolane audit verify proves both, against a signed checkpoint of the day's log
    private, public = signing_key()
    audit = AuditStore(client, BUCKET)
    day = capture_day(captured.captured_at)
    assert capture_day(old.captured_at) == day, "run this test not at midnight UTC"
    for stale in client.list_objects_v2(Bucket=BUCKET, Prefix=checkpoints_prefix(day)).get("Contents", []):
        client.delete_object(Bucket=BUCKET, Key=stale["Key"])
    assert write_checkpoint(audit, day, private, retention=None) is not None
    public_b64 = base64.b64encode(public).decode()
    for rid in (request_id, old.request_id):
        done = audit_cli(stack, BUCKET, "audit", "verify", rid, public_key=public_b64)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith(f"verified request {rid}")

    # 5. the replayer replays both from Kafka (the remote lane: the stack's vLLM)
    replayer = topics.settings(
        lane="remote", remote_url=stack.vllm_url, served_model_name=stack.model_name, replay_all=True
    )
    lane = make_lane(replayer)
    try:
        async with ReplayerService(replayer, lane, EnvelopeStore.from_settings(replayer)):
            got = {e.envelope_id: e for e in events(await topics.consume("divergence_topic", 2, timeout_s=120))}
    finally:
        lane.close()
    assert got.keys() == {captured.envelope_id(), old.envelope_id()}
    assert got[captured.envelope_id()].recorded_length == len(captured.outcome.choices[0].token_ids)
    assert got[captured.envelope_id()].replayed_length > 0

    # 6. the archiver puts both in the lake, with their ids
    lake_settings = LakeSettings(
        kafka_bootstrap=stack.kafka_bootstrap,
        envelope_topic=topic,
        divergence_topic=topics.names["divergence_topic"],
        group_id=f"archiver-{topics.suffix}",
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        flush_seconds=0.5,
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_bucket=BUCKET,
        lake_bucket=LAKE_BUCKET,
        lake_prefix=f"lake-compact-{topics.suffix}",
        keys_bucket=LAKE_BUCKET,
    )
    lake = Lake.from_settings(lake_settings)
    archiver = Archiver(lake_settings, lake)
    stop = asyncio.Event()
    task = asyncio.create_task(archiver.run(stop))
    try:
        await eventually(lambda: archiver.stats.rows_written >= 4 or task.done(), 90, "archiving")
    finally:
        stop.set()
        await task
    assert archiver.stats.skipped == 0
    rows = run_query(lake, "SELECT envelope_id, request_id FROM envelopes ORDER BY request_id").rows
    assert sorted(rows) == sorted([(captured.envelope_id(), request_id), (old.envelope_id(), old.request_id)])

    # 7. a forged compact object (an edited record, re-encoded) fails verify; the JSON one still verifies
    forged_canonical = envelope_bytes(stored).replace(b'"flagged":false', b'"flagged":true', 1)
    assert forged_canonical != captured.canonical()
    forged = encode_compact(forged_canonical)
    assert forged is not None
    client.put_object(Bucket=BUCKET, Key=key, Body=forged)
    done = audit_cli(stack, BUCKET, "audit", "verify", request_id, public_key=public_b64)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith(f"FAILED request {request_id}: modified: stored bytes of {key}")
    assert audit_cli(stack, BUCKET, "audit", "verify", old.request_id, public_key=public_b64).returncode == 0
