"""The publisher: spool -> Kafka (a fake sink here) and S3 (moto), ack only after both, never drop."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from capture.errors import SealingError, SinkError
from capture.metrics import CaptureMetrics
from capture.publishing.outgoing import Outgoing
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from schemas import WorkflowRef, envelope_bytes
from schemas.envelope_compact import is_compact
from schemas.layout import (
    ENCODING_COMPACT,
    ENCODING_JSON,
    content_type,
    envelope_key,
    request_index_key,
    workflow_index_key,
)
from tests.capture.support import drained
from tests.factories import envelope
from tests.moto_s3 import capture_settings, moto_client, moto_server

BUCKET = "reprolane-audit-test"


class FakeKafka:
    """Records what it is sent; fails while `down` is set (like a broker outage)."""

    name = "kafka"

    def __init__(self) -> None:
        self.sent: list[Outgoing] = []
        self.down = False
        self.attempts = 0

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        self.attempts += 1
        if self.down:
            raise SinkError("kafka: broker not reachable (fake)")
        self.sent.extend(batch)

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        moto_client(endpoint).create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
        yield endpoint


@pytest.fixture
def settings(moto_endpoint: str, tmp_path: Path) -> CaptureSettings:
    return capture_settings(moto_endpoint, BUCKET, tmp_path / "spool", retention_days=1)


@pytest.fixture
def s3(moto_endpoint: str) -> Any:
    return moto_client(moto_endpoint)


@pytest.fixture
async def spool(settings: CaptureSettings) -> AsyncIterator[Spool]:
    s = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes, group_commit_ms=0)
    await s.open()
    yield s
    await s.close()


async def eventually(condition: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def fresh_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


async def test_publishes_to_kafka_and_s3_with_retention_and_indexes(
    spool: Spool, settings: CaptureSettings, s3: Any
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    workflow_id = f"wf-{uuid.uuid4().hex[:8]}"
    envs = [
        envelope(request_id=fresh_request_id(), captured_at=now, workflow=None),
        envelope(request_id=fresh_request_id(), captured_at=now, workflow=WorkflowRef(workflow_id=workflow_id, step=3)),
    ]
    for env in envs:
        await spool.append(env)
    kafka, metrics = FakeKafka(), CaptureMetrics()
    publisher = Publisher(spool, settings, metrics, sinks=[kafka, S3Sink(settings)])
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()

    assert all(is_compact(o.payload) for o in kafka.sent)  # the default encoding: the same record, compact
    assert [envelope_bytes(o.payload) for o in kafka.sent] == [e.canonical() for e in envs]
    assert [o.envelope_id for o in kafka.sent] == [e.envelope_id() for e in envs]
    for env in envs:
        key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
        obj = s3.get_object(Bucket=BUCKET, Key=key)
        body = obj["Body"].read()
        assert is_compact(body)
        assert obj["ContentType"] == content_type(ENCODING_COMPACT)
        assert envelope_bytes(body) == env.canonical()
        assert obj["ObjectLockMode"] == "COMPLIANCE"
        assert obj["ObjectLockRetainUntilDate"] == now + timedelta(days=1)
        index = json.loads(s3.get_object(Bucket=BUCKET, Key=request_index_key(env.request_id))["Body"].read())
        assert index == {
            "envelope_id": env.envelope_id(),
            "key": key,
            "tenant": env.tenant,
            "captured_at": now.isoformat().replace("+00:00", "Z"),
        }
    wf_key = workflow_index_key(workflow_id, 3, envs[1].request_id)
    assert json.loads(s3.get_object(Bucket=BUCKET, Key=wf_key)["Body"].read())["envelope_id"] == envs[1].envelope_id()
    assert metrics.value("reprolane_capture_envelopes_published_total", {"sink": "kafka"}) == 2
    assert metrics.value("reprolane_capture_envelopes_published_total", {"sink": "s3"}) == 2
    assert metrics.value("reprolane_capture_publish_lag_seconds") == 0.0


async def test_the_json_encoding_stores_and_sends_the_canonical_bytes(
    spool: Spool, settings: CaptureSettings, s3: Any
) -> None:
    """``envelope_encoding = "json"``: what was stored before compact envelopes, byte for byte."""
    env = envelope(request_id=fresh_request_id())
    await spool.append(env)
    kafka = FakeKafka()
    plain = settings.model_copy(update={"envelope_encoding": "json"})
    publisher = Publisher(spool, plain, sinks=[kafka, S3Sink(plain)])
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()
    assert [(o.payload, o.encoding) for o in kafka.sent] == [(env.canonical(), ENCODING_JSON)]
    obj = s3.get_object(Bucket=BUCKET, Key=envelope_key(env.envelope_id(), env.tenant, env.captured_at))
    assert obj["Body"].read() == env.canonical()
    assert obj["ContentType"] == content_type(ENCODING_JSON) == "application/json"


async def test_kafka_outage_keeps_everything_pending_then_drains(spool: Spool, settings: CaptureSettings) -> None:
    envs = [envelope(request_id=fresh_request_id()) for _ in range(5)]
    for env in envs:
        await spool.append(env)
    kafka, metrics = FakeKafka(), CaptureMetrics()
    kafka.down = True
    publisher = Publisher(
        spool, settings, metrics, sinks=[kafka, S3Sink(settings)], backoff_initial_s=0.01, backoff_max_s=0.05
    )
    await publisher.start()
    try:
        await eventually(lambda: kafka.attempts >= 4)
        assert spool.depth == 5  # nothing acked while one sink is down
        assert metrics.value("reprolane_capture_publish_errors_total", {"sink": "kafka"}) >= 3
        assert metrics.value("reprolane_capture_publish_lag_seconds") > 0
        # S3 confirmed once and is not re-sent while only Kafka is retried
        assert metrics.value("reprolane_capture_envelopes_published_total", {"sink": "s3"}) == 5
        kafka.down = False
        await drained(spool)
    finally:
        await publisher.stop()
    assert [o.envelope_id for o in kafka.sent] == [e.envelope_id() for e in envs]
    assert metrics.value("reprolane_capture_publish_errors_total", {"sink": "s3"}) == 0


async def test_s3_outage_is_retried_with_sink_errors(spool: Spool, settings: CaptureSettings) -> None:
    dead = settings.model_copy(update={"s3_endpoint": "http://127.0.0.1:9"})  # discard port: refused
    await spool.append(envelope(request_id=fresh_request_id()))
    kafka, metrics = FakeKafka(), CaptureMetrics()
    publisher = Publisher(spool, dead, metrics, sinks=[kafka, S3Sink(dead)], backoff_initial_s=0.01)
    await publisher.start()
    try:
        await eventually(lambda: metrics.value("reprolane_capture_publish_errors_total", {"sink": "s3"}) >= 2)
        assert spool.depth == 1
    finally:
        await publisher.stop()
    assert spool.depth == 1  # stopped while S3 was down: still pending, nothing dropped


async def test_restart_republishes_what_was_not_acked(settings: CaptureSettings, s3: Any) -> None:
    envs = [envelope(request_id=fresh_request_id()) for _ in range(4)]
    first = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    await first.open()
    for env in envs:
        await first.append(env)
    kafka = FakeKafka()
    kafka.down = True
    publisher = Publisher(first, settings, sinks=[kafka, S3Sink(settings)], backoff_initial_s=0.01)
    await publisher.start()
    await eventually(lambda: kafka.attempts >= 2)
    await publisher.stop()
    await first.close()

    second = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    await second.open()
    assert second.depth == 4
    kafka = FakeKafka()
    publisher = Publisher(second, settings, sinks=[kafka, S3Sink(settings)])
    await publisher.start()
    try:
        await drained(second)
    finally:
        await publisher.stop()
        await second.close()
    assert [o.envelope_id for o in kafka.sent] == [e.envelope_id() for e in envs]
    for env in envs:  # written twice (412 the second time): still there, still the same bytes
        key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
        assert envelope_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()) == env.canonical()


async def test_request_index_keeps_the_first_envelope_and_counts_later_claimants(
    spool: Spool, settings: CaptureSettings, s3: Any
) -> None:
    """Index objects are written once (this replaces "the index points at the latest envelope", which let a
    second envelope claiming a request id move the pointer): the first claimant keeps it, within a batch (the
    lowest spool seq, although the puts run concurrently) and across batches; every later claimant is counted
    and keeps its own envelope object."""
    request_id = fresh_request_id()
    envs = [envelope(request_id=request_id, flagged=flag) for flag in (False, True)]
    later = envelope(request_id=request_id, flagged=False, captured_at=datetime.now(UTC))
    for env in envs:
        await spool.append(env)
    metrics = CaptureMetrics()
    publisher = Publisher(spool, settings, metrics, sinks=[FakeKafka(), S3Sink(settings, metrics=metrics)])
    await publisher.start()
    try:
        await drained(spool)
        index = json.loads(s3.get_object(Bucket=BUCKET, Key=request_index_key(request_id))["Body"].read())
        assert index["envelope_id"] == envs[0].envelope_id()
        assert metrics.value("reprolane_capture_index_conflicts_total") == 2  # request id and workflow step
        await spool.append(later)  # a later batch does not move it either
        await drained(spool)
        await spool.append(envs[0])  # a redelivery of the first finds its own entry: no conflict
        await drained(spool)
    finally:
        await publisher.stop()
    index = json.loads(s3.get_object(Bucket=BUCKET, Key=request_index_key(request_id))["Body"].read())
    assert index["envelope_id"] == envs[0].envelope_id()
    assert metrics.value("reprolane_capture_index_conflicts_total") == 4
    for env in [*envs, later]:
        key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
        assert envelope_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()) == env.canonical()


async def test_retention_never_ends_in_the_past(settings: CaptureSettings) -> None:
    sink = S3Sink(settings)
    old = datetime(2020, 1, 1, tzinfo=UTC)
    until = sink.retain_until(old)
    assert until is not None
    assert until > datetime.now(UTC) + timedelta(hours=23)
    recent = datetime.now(UTC)
    assert sink.retain_until(recent) == recent + timedelta(days=1)
    assert S3Sink(settings.model_copy(update={"retention_days": 0})).retain_until(recent) is None
    await sink.close()


async def test_a_record_corrupted_on_disk_blocks_loudly_instead_of_vanishing(
    spool: Spool, settings: CaptureSettings, caplog: pytest.LogCaptureFixture
) -> None:
    await spool.append(envelope(request_id=fresh_request_id()))
    segment = sorted(spool.directory.glob("*.seg"))[-1]
    data = bytearray(segment.read_bytes())
    data[-5] ^= 0xFF  # bit rot under a record that is already acknowledged to the client
    segment.write_bytes(bytes(data))
    kafka = FakeKafka()
    publisher = Publisher(spool, settings, sinks=[kafka, S3Sink(settings)], backoff_initial_s=0.01)
    await publisher.start()
    try:
        await eventually(lambda: sum("is corrupt" in r.getMessage() for r in caplog.records) >= 2)
        assert spool.depth == 1
        assert kafka.sent == []
    finally:
        await publisher.stop()


def test_a_publisher_with_encrypted_tenants_and_no_kek_fails_at_construction(tmp_path: Path) -> None:
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        encrypt_tenants=("acme",),
        s3_endpoint="http://127.0.0.1:9",
    )
    with pytest.raises(SealingError, match="no KEK"):
        Publisher(None, settings, sinks=[])  # type: ignore[arg-type]
