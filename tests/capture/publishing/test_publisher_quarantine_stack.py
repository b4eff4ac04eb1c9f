"""One record no longer stops the pipeline, against the real Tansu + SeaweedFS (issue 18, finding 2).

Into one spool, in this order: a record whose workflow index key SeaweedFS refuses (a step of 1000 digits:
KeyTooLongError), an envelope over the Kafka record limit (4.5 MiB of backslashes in ``sampling.extra``,
escaped to over 8 MiB), then normal records. Before the fix the publisher retried the first batch forever and
nothing behind it arrived. Now: the normal records reach Kafka and S3 promptly; the large one is stored whole
in S3 and Kafka carries its claim check (which resolves to exactly those bytes); the refused one is in the local
quarantine and the dead-letter topic with its reason; the spool drains; nothing is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from capture.metrics import CaptureMetrics
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.quarantine import quarantine_dir
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from schemas import Envelope, SamplingContract, WorkflowRef, sha256_hex
from schemas.claim_check import decode_claim_check, verify_claimed
from schemas.layout import (
    HEADER_CLAIM_CHECK,
    HEADER_DLQ_REASON,
    HEADER_DLQ_SINK,
    HEADER_ENVELOPE_ID,
    MAX_MESSAGE_BYTES,
    envelope_key,
)
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def settings_for(stack: StackInfo, spool_dir: Path) -> CaptureSettings:
    return CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=spool_dir,
        kafka_bootstrap=stack.kafka_bootstrap,
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_region=stack.s3_region,
        s3_bucket=stack.audit_bucket,
    )


async def consume(stack: StackInfo, topic: str, count: int | None, within_s: float = 60.0) -> list[Any]:
    """Records of `topic` from the start (a fresh group) until `count` were read (None: every record the topic held
    when called, up to its end offsets then) or time is up."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=stack.kafka_bootstrap,
        group_id=unique("quarantine-test"),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_partition_fetch_bytes=MAX_MESSAGE_BYTES,
    )
    await consumer.start()
    found: list[Any] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    try:
        ends: dict[TopicPartition, int] = {}
        if count is None:
            await consumer.topics()  # the cluster's metadata, so that the topic's partitions are known
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            ends = {tp: end for tp, end in (await consumer.end_offsets(partitions)).items() if end > 0}
        last: dict[TopicPartition, int] = {}

        def done() -> bool:
            if count is not None:
                return len(found) >= count
            return all(last.get(tp, -1) >= end - 1 for tp, end in ends.items())

        while not done() and loop.time() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                found.extend(records)
                last[tp] = max(last.get(tp, -1), records[-1].offset)
    finally:
        await consumer.stop()
    return found


@pytest.fixture
async def spool(tmp_path: Path) -> AsyncIterator[Spool]:
    s = Spool(tmp_path / "spool", max_bytes=256 * 1024 * 1024)
    await s.open()
    yield s
    await s.close()


@pytest.mark.parametrize("s3_processes", [0, 2], ids=["s3-threads", "s3-processes"])
async def test_refused_and_oversized_records_do_not_stop_the_pipeline(
    stack: StackInfo, spool: Spool, tmp_path: Path, s3_processes: int
) -> None:
    # JSON envelopes: a record over Kafka's limit is easy to make as JSON (compact ones of this junk are tiny)
    settings = settings_for(stack, tmp_path / "spool").model_copy(update={"envelope_encoding": "json"})
    topic, dead, tenant = unique("envelopes"), unique("dead-letter"), unique("tenant")
    now = datetime.now(UTC)
    refused = envelope(
        request_id=unique("req-long"),
        tenant=tenant,
        captured_at=now,
        workflow=WorkflowRef(workflow_id="wf", step=10**1000),
    )
    sampling = SamplingContract(
        temperature=0.7, max_tokens=16, seed=1, seed_scope="per_request", extra={"junk": "\\" * (4 * 1024 * 1024 + 256)}
    )
    large = envelope(request_id=unique("req-large"), tenant=tenant, captured_at=now, sampling=sampling)
    assert len(large.canonical()) > MAX_MESSAGE_BYTES
    normal = [envelope(request_id=unique("req"), tenant=tenant, captured_at=now) for _ in range(10)]
    for env in [refused, large, *normal]:
        await spool.append(env)
    metrics = CaptureMetrics()
    publisher = Publisher(
        spool,
        settings,
        metrics,
        sinks=[
            KafkaSink(settings, topic=topic, dead_letter_topic=dead),
            S3Sink(settings, processes=s3_processes, metrics=metrics),
        ],
        batch_size=4,
        backoff_max_s=1.0,
    )
    await publisher.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while spool.depth:
            assert loop.time() < deadline, f"spool blocked: {spool.depth} of 12 records still pending"
            await asyncio.sleep(0.1)
    finally:
        await publisher.stop()

    # the normal records and the large one: in S3 whole, and on the topic (the large one as a claim check)
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    for env in [large, *normal]:
        key = envelope_key(env.envelope_id(), tenant, env.captured_at)
        assert client.get_object(Bucket=stack.audit_bucket, Key=key)["Body"].read() == env.canonical()
    records = await consume(stack, topic, 1 + len(normal))
    by_id = {dict(r.headers)[HEADER_ENVELOPE_ID].decode(): r for r in records}
    assert {e.envelope_id() for e in normal} <= by_id.keys()
    for env in normal:
        assert Envelope.model_validate_json(by_id[env.envelope_id()].value).envelope_id() == env.envelope_id()
    claim = by_id[large.envelope_id()]
    assert dict(claim.headers)[HEADER_CLAIM_CHECK] == b"1"
    ref = decode_claim_check(claim.value)
    assert ref.key == envelope_key(large.envelope_id(), tenant, now)
    assert ref.sha256 == hashlib.sha256(large.canonical()).hexdigest()
    stored = client.get_object(Bucket=stack.audit_bucket, Key=ref.key)["Body"].read()
    assert verify_claimed(ref, stored) == large.canonical()

    # the refused one: quarantined with its reason, dead-lettered, counted
    digest = sha256_hex(refused.canonical())
    qdir = quarantine_dir(settings.spool_dir)
    assert (qdir / f"{digest}.record").read_bytes() == refused.canonical()
    why = json.loads((qdir / f"{digest}.s3.reason.json").read_text())
    assert why["code"] == "KeyTooLongError"
    assert why["envelope_id"] == refused.envelope_id()
    (letter,) = await consume(stack, dead, 1)
    headers = dict(letter.headers)
    assert letter.value == refused.canonical()
    assert b"KeyTooLongError" in headers[HEADER_DLQ_REASON]
    assert headers[HEADER_DLQ_SINK] == b"s3"
    assert headers[HEADER_ENVELOPE_ID] == refused.envelope_id().encode()
    assert metrics.value("reprolane_capture_records_quarantined_total", {"sink": "s3", "code": "KeyTooLongError"}) == 1
    assert metrics.value("reprolane_capture_claim_checks_total") == 1


async def test_a_record_kafka_refuses_for_good_is_quarantined_not_retried(
    stack: StackInfo, spool: Spool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the claim check out of the way, Kafka's own refusal (record over ``max_request_size``) is classified
    as for good: quarantined and dead-lettered (empty value: it would not fit either), the rest flow."""
    monkeypatch.setattr("capture.publishing.outgoing.CLAIM_CHECK_BYTES", 2 * MAX_MESSAGE_BYTES)
    monkeypatch.setattr("capture.publishing.kafka_sink.CLAIM_CHECK_BYTES", 2 * MAX_MESSAGE_BYTES)
    settings = settings_for(stack, tmp_path / "spool").model_copy(update={"envelope_encoding": "json"})  # as above
    topic, dead, tenant = unique("envelopes"), unique("dead-letter"), unique("tenant")
    extra = {"junk": "\\" * (4 * 1024 * 1024 + 256)}
    sampling = SamplingContract(temperature=0.7, max_tokens=16, seed=1, seed_scope="per_request", extra=extra)
    large = envelope(request_id=unique("req-large"), tenant=tenant, captured_at=datetime.now(UTC), sampling=sampling)
    normal = [envelope(request_id=unique("req"), tenant=tenant, captured_at=datetime.now(UTC)) for _ in range(3)]
    for env in [large, *normal]:
        await spool.append(env)
    metrics = CaptureMetrics()
    publisher = Publisher(
        spool, settings, metrics, sinks=[KafkaSink(settings, topic=topic, dead_letter_topic=dead), S3Sink(settings)]
    )
    await publisher.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while spool.depth:
            assert loop.time() < deadline, f"spool blocked: {spool.depth} of 4 records still pending"
            await asyncio.sleep(0.1)
    finally:
        await publisher.stop()
    records = await consume(stack, topic, len(normal))
    assert {dict(r.headers)[HEADER_ENVELOPE_ID].decode() for r in records} == {e.envelope_id() for e in normal}
    code = "MessageSizeTooLargeError"
    assert metrics.value("reprolane_capture_records_quarantined_total", {"sink": "kafka", "code": code}) == 1
    digest = sha256_hex(large.canonical())
    assert (quarantine_dir(settings.spool_dir) / f"{digest}.record").read_bytes() == large.canonical()
    (letter,) = await consume(stack, dead, 1)
    assert letter.value in (b"", None)
    assert code.encode() in dict(letter.headers)[HEADER_DLQ_REASON]
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)  # S3 took it: the record is stored as well
    key = envelope_key(large.envelope_id(), tenant, large.captured_at)
    assert client.get_object(Bucket=stack.audit_bucket, Key=key)["Body"].read() == large.canonical()
