"""A record a sink refuses for good is quarantined and the publisher moves on (issue 18, finding 2).

Against moto S3 and a fake Kafka: a record whose workflow index key is over S3's 1,024 bytes (the key S3 refuses),
a record that is not an envelope, and normal records behind them. The normal ones must be published and acked;
the bad ones kept in the local quarantine with their reason (0600, write-once), counted, and left out of the
audit log; transient failures are still retried. The same against the real Tansu + SeaweedFS, with a record
over the Kafka limit (claim check) and the dead-letter topic: `test_publisher_quarantine_stack.py`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import stat
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import (
    CorruptRecordException,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
)
from botocore.exceptions import ClientError

from capture.errors import RecordsRefused, SinkError
from capture.metrics import CaptureMetrics
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.outgoing import Outgoing
from capture.publishing.publisher import Publisher
from capture.publishing.quarantine import Quarantine, Refusal, quarantine_dir
from capture.publishing.s3_sink import S3Sink
from capture.publishing.s3_workers import is_refused_for_good
from capture.settings import CaptureSettings
from capture.spool import Spool, SpoolEntry
from infra.clients.s3 import S3Policy, make_s3_client
from schemas import Envelope, WorkflowRef, envelope_bytes, sha256_hex
from schemas.layout import MAX_KEY_BYTES, envelope_key
from tests.capture.support import drained
from tests.factories import envelope
from tests.moto_s3 import capture_settings, moto_client, moto_server

BUCKET = "reprolane-quarantine-test"
NOT_AN_ENVELOPE = b'{"not": "an envelope"}'


class FakeSink:
    """Records what it is sent; fails (transiently) the first `fail_first` attempts."""

    def __init__(self, name: str, *, refers_to_objects: bool = False, fail_first: int = 0) -> None:
        self.name = name
        self.refers_to_objects = refers_to_objects
        self.sent: list[Outgoing] = []
        self.fail_first = fail_first
        self.attempts = 0
        self.on_publish: Any = None

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        self.attempts += 1
        if self.attempts <= self.fail_first:
            raise SinkError(f"{self.name}: not reachable (fake)")
        if self.on_publish is not None:
            self.on_publish(batch)
        self.sent.extend(batch)

    async def close(self) -> None:
        pass


class KeyLimitS3(S3Sink):
    """moto stores keys of any length; SeaweedFS and AWS refuse one over 1,024 bytes with a 400 KeyTooLongError.
    This S3 sink answers that refusal the way botocore reports it, before the (moto) PUTs of the batch."""

    def __init__(self, settings: CaptureSettings, *, max_body: int | None = None) -> None:
        super().__init__(settings)
        self._real = make_s3_client(settings, policy=S3Policy.SIDECAR)
        self._threads = (_KeyLimitClient(self._real, max_body), self._threads[1])  # type: ignore[index]


class _KeyLimitClient:
    def __init__(self, real: Any, max_body: int | None) -> None:
        self._real = real
        self._max_body = max_body

    def put_object(self, **kwargs: Any) -> Any:
        if self._max_body is not None and len(kwargs["Body"]) > self._max_body:
            raise ClientError(
                {
                    "Error": {"Code": "EntityTooLarge", "Message": "Your proposed upload exceeds the maximum size."},
                    "ResponseMetadata": {"HTTPStatusCode": 400},
                },
                "PutObject",
            )
        if len(kwargs["Key"].encode()) > MAX_KEY_BYTES:
            raise ClientError(
                {
                    "Error": {"Code": "KeyTooLongError", "Message": "Your key is too long."},
                    "ResponseMetadata": {"HTTPStatusCode": 400},
                },
                "PutObject",
            )
        return self._real.put_object(**kwargs)

    def get_object(self, **kwargs: Any) -> Any:
        return self._real.get_object(**kwargs)


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


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def key_too_long(tenant: str) -> Envelope:
    """An envelope whose workflow index key is over S3's limit: a step of 1000 digits (what an unbounded
    ``X-Reprolane-Step`` let through before the edge bounded it)."""
    env = envelope(request_id=unique("req-long"), tenant=tenant, workflow=WorkflowRef(workflow_id="wf", step=10**1000))
    assert len(Outgoing.from_entry(SpoolEntry(0, env.canonical())).index_keys()[1]) > MAX_KEY_BYTES
    return env


async def test_a_record_s3_refuses_for_good_is_quarantined_and_the_rest_flow(
    spool: Spool, settings: CaptureSettings, s3: Any
) -> None:
    tenant = unique("tenant")
    bad = key_too_long(tenant)
    good = [envelope(request_id=unique("req"), tenant=tenant) for _ in range(5)]
    kafka, audit = FakeSink("kafka"), FakeSink("audit-log")
    metrics = CaptureMetrics()
    publisher = Publisher(
        spool,
        settings,
        metrics,
        sinks=[kafka, KeyLimitS3(settings)],
        then=[audit],
        backoff_initial_s=0.01,
        batch_size=2,
    )
    await spool.append(bad)
    for env in good:
        await spool.append(env)
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()
    for env in good:
        key = envelope_key(env.envelope_id(), tenant, env.captured_at)
        assert envelope_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()) == env.canonical()
    logged = {item.envelope_id for item in audit.sent}
    assert logged == {env.envelope_id() for env in good}  # the refused record has no leaf
    assert metrics.value("reprolane_capture_records_quarantined_total", {"sink": "s3", "code": "KeyTooLongError"}) == 1
    assert publisher.quarantined == 1
    qdir = quarantine_dir(settings.spool_dir)
    digest = sha256_hex(bad.canonical())
    record, reason = qdir / f"{digest}.record", qdir / f"{digest}.s3.reason.json"
    assert record.read_bytes() == bad.canonical()
    why = json.loads(reason.read_text())
    assert why["code"] == "KeyTooLongError"
    assert why["envelope_id"] == bad.envelope_id()
    assert why["request_id"] == bad.request_id
    assert why["sink"] == "s3"
    for path in (record, reason):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(qdir.stat().st_mode) == 0o700


async def test_an_envelope_object_s3_refuses_for_good_is_quarantined(
    spool: Spool, settings: CaptureSettings, s3: Any
) -> None:
    noise = secrets.token_urlsafe(12000)  # incompressible, so the compact form is too large as well
    big = envelope(
        request_id=unique("req-big"), sampling=envelope().sampling.model_copy(update={"extra": {"x": noise}})
    )
    good = envelope(request_id=unique("req"))
    kafka = FakeSink("kafka")
    metrics = CaptureMetrics()
    sinks = [kafka, KeyLimitS3(settings, max_body=8000)]
    publisher = Publisher(spool, settings, metrics, sinks=sinks, backoff_initial_s=0.01)
    await spool.append(big)
    await spool.append(good)
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()
    assert metrics.value("reprolane_capture_records_quarantined_total", {"sink": "s3", "code": "EntityTooLarge"}) == 1
    why = json.loads((quarantine_dir(settings.spool_dir) / f"{sha256_hex(big.canonical())}.s3.reason.json").read_text())
    assert (why["code"], why["request_id"]) == ("EntityTooLarge", big.request_id)
    key = envelope_key(good.envelope_id(), good.tenant, good.captured_at)
    assert envelope_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()) == good.canonical()


async def test_a_spool_record_that_is_not_an_envelope_is_quarantined_not_blocking(
    spool: Spool, settings: CaptureSettings
) -> None:
    kafka, s3sink = FakeSink("kafka"), FakeSink("s3")
    good = envelope(request_id=unique("req"))
    await spool.append_payload(NOT_AN_ENVELOPE)
    await spool.append(good)
    metrics = CaptureMetrics()
    publisher = Publisher(spool, settings, metrics, sinks=[kafka, s3sink], backoff_initial_s=0.01)
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()
    assert [item.envelope_id for item in kafka.sent] == [good.envelope_id()]
    assert metrics.value("reprolane_capture_records_quarantined_total", {"sink": "route", "code": "NotAnEnvelope"}) == 1
    assert (
        quarantine_dir(settings.spool_dir) / f"{sha256_hex(NOT_AN_ENVELOPE)}.record"
    ).read_bytes() == NOT_AN_ENVELOPE


async def test_transient_failures_are_still_retried_never_quarantined(spool: Spool, settings: CaptureSettings) -> None:
    kafka, s3sink = FakeSink("kafka", fail_first=3), FakeSink("s3", fail_first=2)
    env = envelope(request_id=unique("req"))
    await spool.append(env)
    publisher = Publisher(spool, settings, sinks=[kafka, s3sink], backoff_initial_s=0.01)
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()
    assert kafka.attempts == 4
    assert [item.envelope_id for item in kafka.sent] == [env.envelope_id()]
    assert publisher.quarantined == 0
    assert not quarantine_dir(settings.spool_dir).exists()


async def test_a_claim_checked_record_goes_to_kafka_only_after_s3_stored_it(
    spool: Spool, settings: CaptureSettings, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        "capture.publishing.outgoing.CLAIM_CHECK_BYTES", 500
    )  # the factory's envelopes are ~1 KB compact
    monkeypatch.setattr("capture.publishing.kafka_sink.CLAIM_CHECK_BYTES", 500)
    env = envelope(request_id=unique("req"))
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    kafka = FakeSink("kafka", refers_to_objects=True)
    stored_first: list[bool] = []
    kafka.on_publish = lambda batch: stored_first.append(
        envelope_bytes(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()) == env.canonical()
    )
    metrics = CaptureMetrics()
    await spool.append(env)
    publisher = Publisher(spool, settings, metrics, sinks=[kafka, S3Sink(settings)], backoff_initial_s=0.01)
    await publisher.start()
    try:
        await drained(spool)
    finally:
        await publisher.stop()
    assert stored_first == [True]
    assert metrics.value("reprolane_capture_claim_checks_total") == 1


def test_the_quarantine_is_write_once(tmp_path: Path) -> None:
    quarantine = Quarantine(tmp_path / "q")
    first = Refusal(1, b"record", "s3", "KeyTooLongError", "first reason")
    (path,) = quarantine.keep([first])
    again = Refusal(9, b"record", "s3", "KeyTooLongError", "second reason")
    quarantine.keep([again])
    assert path.read_bytes() == b"record"
    assert json.loads((tmp_path / "q" / f"{first.digest}.s3.reason.json").read_text())["reason"] == "first reason"
    assert not list((tmp_path / "q").glob(".*.tmp"))


@pytest.mark.parametrize(
    ("code", "status", "for_good"),
    [
        ("KeyTooLongError", 400, True),
        ("EntityTooLarge", 400, True),
        ("InvalidArgument", 400, True),
        ("InternalError", 500, False),
        ("SlowDown", 503, False),
        ("AccessDenied", 403, False),
        ("NoSuchBucket", 404, False),
        ("RequestTimeout", 400, False),
    ],
)
def test_s3_answers_are_classified_permanent_or_transient(code: str, status: int, for_good: bool) -> None:
    exc = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    assert is_refused_for_good(exc) is for_good


class FakeProducer:
    """aiokafka's producer surface the sink uses: `send` returns a future per record (or raises)."""

    def __init__(self, outcomes: dict[bytes, BaseException | None]) -> None:
        self.outcomes = outcomes

    async def send(self, topic: str, *, value: bytes, key: bytes, headers: Any) -> asyncio.Future[None]:
        outcome = self.outcomes.get(key)
        if isinstance(outcome, MessageSizeTooLargeError):
            raise outcome  # the producer's own size check refuses before sending
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if outcome is None:
            future.set_result(None)
        else:
            future.set_exception(outcome)
        return future

    async def stop(self) -> None:
        pass


def invalid_record() -> KafkaError:
    error = KafkaError("INVALID_RECORD")
    error.errno = 87  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize(
    ("outcomes", "refused", "transient"),
    [
        ({b"r1": MessageSizeTooLargeError("too big")}, {1}, False),
        ({b"r2": RecordTooLargeError("too big")}, {2}, False),
        ({b"r1": invalid_record(), b"r3": CorruptRecordException("crc")}, {1, 3}, False),
        ({b"r1": MessageSizeTooLargeError("too big"), b"r2": KafkaTimeoutError()}, set(), True),
    ],
)
async def test_kafka_answers_are_classified_per_record(
    settings: CaptureSettings, outcomes: dict[bytes, BaseException | None], refused: set[int], transient: bool
) -> None:
    sink = KafkaSink(settings.model_copy(update={"kafka_bootstrap": "127.0.0.1:9"}))
    sink._producer = FakeProducer(outcomes)
    batch = [Outgoing.from_entry(SpoolEntry(i, envelope(request_id=f"r{i}").canonical())) for i in (1, 2, 3)]
    with pytest.raises(SinkError) as caught:
        await sink.publish(batch)
    if transient:
        assert not isinstance(caught.value, RecordsRefused)
    else:
        assert isinstance(caught.value, RecordsRefused)
        assert set(caught.value.refused) == refused


@pytest.mark.parametrize(
    ("update", "key"),
    [
        ({}, None),  # no engine named, none recording: each envelope by its request id
        ({"engine_key": "engine-7"}, b"engine-7"),
        ({"schedule_recorder": "vllm-scheduler"}, b"http://127.0.0.1:9"),  # one recording engine: its URL
        ({"schedule_recorder": "vllm-scheduler", "engine_key": "engine-7"}, b"engine-7"),
    ],
)
async def test_envelopes_are_keyed_by_the_engine_behind_the_sidecar(
    settings: CaptureSettings, update: dict[str, str], key: bytes | None
) -> None:
    keys: list[bytes] = []

    class Keys(FakeProducer):
        async def send(self, topic: str, *, value: bytes, key: bytes, headers: Any) -> asyncio.Future[None]:
            keys.append(key)
            return await super().send(topic, value=value, key=key, headers=headers)

    chosen = CaptureSettings.model_validate({**settings.model_dump(), "kafka_bootstrap": "127.0.0.1:9", **update})
    sink = KafkaSink(chosen)
    sink._producer = Keys({})
    await sink.publish([Outgoing.from_entry(SpoolEntry(i, envelope(request_id=f"r{i}").canonical())) for i in (1, 2)])
    assert keys == ([b"r1", b"r2"] if key is None else [key, key])
