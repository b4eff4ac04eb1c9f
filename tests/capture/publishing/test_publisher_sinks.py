"""The sinks' boundary: every aiokafka / botocore failure surfaces as `SinkError`; settings pass through."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest

from capture.errors import SinkError
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from capture.publishing.sinks import default_sinks
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from schemas.layout import envelope_key
from tests.factories import envelope
from tests.moto_s3 import moto_server

BUCKET = "reprolane-sinks-test"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens once the socket is closed


def base_settings(**overrides: Any) -> CaptureSettings:
    values: dict[str, Any] = {"upstream": "http://127.0.0.1:9", "spool_dir": Path("unused")}
    values.update(overrides)
    return CaptureSettings(**values)


def outgoing(seq: int = 1, **overrides: Any) -> Outgoing:
    return Outgoing.from_entry(SpoolEntry(seq, envelope(**overrides).canonical()))


@pytest.fixture(scope="module")
def moto_settings() -> Iterator[CaptureSettings]:
    with moto_server() as endpoint:
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s"
        ).create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
        yield base_settings(s3_endpoint=endpoint, s3_access_key="k", s3_secret_key="s", s3_bucket=BUCKET)


def test_outgoing_routes_by_the_canonical_json() -> None:
    env = envelope(request_id="req-route-1")
    item = Outgoing.from_entry(SpoolEntry(7, env.canonical()))
    assert item.seq == 7
    assert item.envelope_id == env.envelope_id()
    assert item.request_id == "req-route-1"
    assert item.object_key == envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    assert item.workflow_id == "claim-7781"
    assert item.workflow_step == 2
    assert len(item.index_keys()) == 2


def test_a_record_that_is_not_an_envelope_is_a_sink_error() -> None:
    with pytest.raises(SinkError, match="seq 3"):
        Outgoing.from_entry(SpoolEntry(3, b'{"not": "an envelope"}'))


async def test_s3_conditional_create_treats_412_as_success(moto_settings: CaptureSettings) -> None:
    sink = S3Sink(moto_settings)
    item = outgoing(request_id="req-twice")
    await sink.publish([item])
    await sink.publish([item])  # second put answers 412: same content address, same bytes
    await sink.close()


async def test_s3_unreachable_is_a_sink_error() -> None:
    settings = base_settings(s3_endpoint=f"http://127.0.0.1:{closed_port()}", s3_access_key="k", s3_secret_key="s")
    sink = S3Sink(settings)
    with pytest.raises(SinkError, match="s3"):
        await sink.publish([outgoing()])
    await sink.close()


async def test_s3_refusal_is_a_sink_error_naming_the_key(moto_settings: CaptureSettings) -> None:
    missing = moto_settings.model_copy(update={"s3_bucket": "no-such-bucket-here"})
    sink = S3Sink(missing)
    item = outgoing()
    with pytest.raises(SinkError, match=f"no-such-bucket-here/{item.object_key}"):
        await sink.publish([item])
    await sink.close()


async def test_kafka_unreachable_is_a_sink_error() -> None:
    sink = KafkaSink(base_settings(kafka_bootstrap=f"127.0.0.1:{closed_port()}"))
    with pytest.raises(SinkError, match="kafka"):
        await sink.publish([outgoing()])
    await sink.close()


def test_kafka_without_bootstrap_is_refused() -> None:
    with pytest.raises(SinkError, match="kafka_bootstrap"):
        KafkaSink(base_settings())


def test_kafka_security_settings_pass_through() -> None:
    settings = base_settings(
        kafka_bootstrap="broker:9093",
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="capture",
        kafka_sasl_password="pw",
    )
    kwargs = KafkaSink(settings)._producer_kwargs()
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_username"] == "capture"
    assert kwargs["sasl_plain_password"] == "pw"
    assert kwargs["ssl_context"] is not None
    assert kwargs["acks"] == "all"
    assert kwargs["enable_idempotence"] is False  # Tansu refuses InitProducerId


def test_s3_client_verifies_tls_unless_told_not_to() -> None:
    def verify_of(settings: CaptureSettings) -> Any:
        threads: Any = S3Sink(settings)._threads
        client = threads[0]
        return client._endpoint.http_session._verify

    common = {"s3_endpoint": "https://s3.example.invalid", "s3_access_key": "k", "s3_secret_key": "s"}
    assert verify_of(base_settings(**common)) is True
    assert verify_of(base_settings(**common, s3_verify_tls=False)) is False


def test_default_sinks_are_the_configured_ones() -> None:
    both = default_sinks(base_settings(kafka_bootstrap="127.0.0.1:9092", s3_endpoint="http://127.0.0.1:9"))
    assert [s.name for s in both] == ["kafka", "s3"]
    assert [s.name for s in default_sinks(base_settings(kafka_bootstrap="127.0.0.1:9092"))] == ["kafka"]
    assert [s.name for s in default_sinks(base_settings(s3_endpoint="http://127.0.0.1:9"))] == ["s3"]
    with pytest.raises(SinkError, match="no sink configured"):
        default_sinks(base_settings())


# ------------------------------------------------------------------ S3 PUTs in worker processes (s3_processes)


async def test_s3_worker_processes_store_objects_indexes_and_retention(moto_settings: CaptureSettings) -> None:
    sink = S3Sink(moto_settings, processes=2)
    try:
        items = [outgoing(seq=i, request_id=f"req-proc-{i}") for i in range(1, 6)]
        await sink.publish(items)
        await sink.publish(items)  # all 412 now (same content addresses), which is success
    finally:
        await sink.close()
    s3: Any = boto3.client(
        "s3",
        endpoint_url=moto_settings.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="k",
        aws_secret_access_key="s",
    )
    for item in items:
        head = s3.head_object(Bucket=BUCKET, Key=item.object_key)
        assert head["ObjectLockMode"] == "COMPLIANCE"
        assert head["Metadata"]["envelope-id"] == item.envelope_id
        index = s3.get_object(Bucket=BUCKET, Key=item.index_keys()[0])["Body"].read()
        assert item.envelope_id.encode() in index


async def test_s3_worker_process_refusal_is_a_sink_error_naming_the_key(moto_settings: CaptureSettings) -> None:
    sink = S3Sink(moto_settings.model_copy(update={"s3_bucket": "no-such-bucket"}), processes=1)
    item = outgoing(request_id="req-proc-missing")
    try:
        with pytest.raises(SinkError, match="no-such-bucket/envelopes/"):
            await sink.publish([item])
    finally:
        await sink.close()


async def test_a_dead_s3_worker_process_fails_its_batch_and_the_next_one_goes_through(
    moto_settings: CaptureSettings,
) -> None:
    import os
    import signal

    sink = S3Sink(moto_settings, processes=1)
    try:
        await sink.publish([outgoing(seq=1, request_id="req-proc-before")])  # the worker is up
        assert sink._processes is not None
        (pid,) = list(sink._processes._pool._processes)  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SinkError, match="worker process died"):
            await sink.publish([outgoing(seq=2, request_id="req-proc-during")])
        await sink.publish([outgoing(seq=2, request_id="req-proc-during")])  # a new worker, same batch
    finally:
        await sink.close()


def test_per_tenant_retention() -> None:
    common: dict[str, Any] = {"s3_endpoint": "http://127.0.0.1:9", "s3_access_key": "k", "s3_secret_key": "s"}
    sink = S3Sink(base_settings(**common, retention_days=2, retention_days_by_tenant={"long": 30, "off": 0}))
    now = datetime.now(UTC)
    assert sink.retain_until(now, "long") == now + timedelta(days=30)
    assert sink.retain_until(now, "someone") == now + timedelta(days=2)
    assert sink.retain_until(now) == now + timedelta(days=2)
    assert sink.retain_until(now, "off") is None
