"""Durability against the real stack (Tansu + SeaweedFS): nothing appended to the spool is ever lost.

1. appended envelopes reach Kafka and S3 (content-addressed key, Object Lock retention, index objects);
2. Kafka stopped mid-run and started again (on a stack of the test's own): every envelope is in Kafka at least
   once and in S3;
3. the spool + publisher process SIGKILLed mid-run and restarted on the same spool: every envelope whose
   append had returned is eventually in Kafka and S3.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from capture.metrics import CaptureMetrics
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.buckets import s3_client
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo
from schemas import decode_envelope, envelope_bytes
from schemas.layout import (
    ENCODING_COMPACT,
    HEADER_ENCODING,
    HEADER_ENVELOPE_ID,
    HEADER_REQUEST_ID,
    HEADER_SCHEMA,
    envelope_key,
    request_index_key,
    workflow_index_key,
)
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]  # no model: its own topics and tenants

REPO = Path(__file__).resolve().parents[3]


def capture_env(stack: StackInfo) -> dict[str, str]:
    return {
        "REPROLANE_CAPTURE_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "REPROLANE_CAPTURE_S3_ENDPOINT": stack.s3_endpoint,
        "REPROLANE_CAPTURE_S3_ACCESS_KEY": stack.s3_access_key,
        "REPROLANE_CAPTURE_S3_SECRET_KEY": stack.s3_secret_key,
        "REPROLANE_CAPTURE_S3_REGION": stack.s3_region,
        "REPROLANE_CAPTURE_S3_BUCKET": stack.audit_bucket,
    }


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


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def kafka_envelope_ids(stack: StackInfo, topic: str, want: set[str], within_s: float = 60.0) -> dict[str, int]:
    """Consume ``topic`` from the start with a fresh group until every id in ``want`` was seen (or time is up)."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=stack.kafka_bootstrap,
        group_id=unique("capture-test"),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
    )
    await consumer.start()
    seen: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    try:
        while not want <= seen.keys() and loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    headers = dict(record.headers)
                    env_id = headers[HEADER_ENVELOPE_ID].decode()
                    assert headers[HEADER_SCHEMA] == b"reprolane.envelope/1"
                    assert headers[HEADER_ENCODING] == ENCODING_COMPACT.encode()  # the default encoding
                    decoded = decode_envelope(record.value)
                    assert decoded.envelope_id() == env_id
                    assert headers[HEADER_REQUEST_ID] == decoded.request_id.encode()  # the key names the engine
                    seen[env_id] = seen.get(env_id, 0) + 1
    finally:
        await consumer.stop()
    return seen


def s3_envelope_ids(client: Any, bucket: str, tenant: str) -> set[str]:
    ids: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"envelopes/tenant={tenant}/"):
        ids |= {Path(obj["Key"]).stem for obj in page.get("Contents", [])}
    return ids


async def drained(spool: Spool, within_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while spool.depth:
        assert loop.time() < deadline, f"spool not drained within {within_s}s: {spool.depth} pending"
        await asyncio.sleep(0.05)


@pytest.fixture
async def spool(tmp_path: Path) -> AsyncIterator[Spool]:
    s = Spool(tmp_path / "spool", max_bytes=256 * 1024 * 1024)
    await s.open()
    yield s
    await s.close()


@pytest.mark.parametrize("s3_processes", [0, 2], ids=["s3-threads", "s3-processes"])
async def test_envelopes_reach_kafka_and_s3_with_retention_and_indexes(
    stack: StackInfo, spool: Spool, tmp_path: Path, s3_processes: int
) -> None:
    settings = settings_for(stack, tmp_path / "spool")
    topic, tenant, workflow = unique("envelopes"), unique("tenant"), unique("wf")
    now = datetime.now(UTC).replace(microsecond=0)
    envs = [
        envelope(
            request_id=unique("req"), tenant=tenant, captured_at=now, workflow={"workflow_id": workflow, "step": i}
        )
        for i in range(20)
    ]
    s3 = S3Sink(settings, processes=s3_processes)
    publisher = Publisher(spool, settings, sinks=[KafkaSink(settings, topic=topic), s3])
    await publisher.start()
    try:
        await asyncio.gather(*(spool.append(e) for e in envs))
        await drained(spool, 30)
    finally:
        await publisher.stop()

    ids = {e.envelope_id() for e in envs}
    seen = await kafka_envelope_ids(stack, topic, ids)
    assert ids <= seen.keys()
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    assert s3_envelope_ids(client, stack.audit_bucket, tenant) == ids
    for env in envs[:3]:
        key = envelope_key(env.envelope_id(), tenant, now)
        head = client.head_object(Bucket=stack.audit_bucket, Key=key)
        assert head["ObjectLockMode"] == "COMPLIANCE"
        assert head["ObjectLockRetainUntilDate"] == now + timedelta(days=settings.retention_days)
        assert envelope_bytes(client.get_object(Bucket=stack.audit_bucket, Key=key)["Body"].read()) == env.canonical()
        assert env.workflow is not None
        for index_key in (
            request_index_key(env.request_id),
            workflow_index_key(workflow, env.workflow.step, env.request_id),
        ):
            body = json.loads(client.get_object(Bucket=stack.audit_bucket, Key=index_key)["Body"].read())
            assert body["envelope_id"] == env.envelope_id()
            assert body["key"] == key
            assert body["tenant"] == tenant


async def test_kafka_outage_mid_run_loses_nothing(
    private_stack: tuple[LocalStack, StackInfo], spool: Spool, tmp_path: Path
) -> None:
    """The outage on a stack of the test's own (`tests.conftest.private_stack`): the session's broker keeps serving
    the tests that run beside this one."""
    local_stack, stack = private_stack
    settings = settings_for(stack, tmp_path / "spool")
    topic, tenant = unique("envelopes"), unique("tenant")
    envs = [envelope(request_id=f"{tenant}-{i:04d}", tenant=tenant, captured_at=datetime.now(UTC)) for i in range(120)]
    metrics = CaptureMetrics()
    publisher = Publisher(
        spool,
        settings,
        metrics,
        sinks=[KafkaSink(settings, topic=topic, request_timeout_ms=3000), S3Sink(settings)],
        backoff_max_s=1.0,
    )
    await publisher.start()
    try:
        for env in envs[:40]:
            await spool.append(env)
        await drained(spool, 30)
        await asyncio.to_thread(local_stack.stop_server, "kafka")
        try:
            for env in envs[40:100]:  # appends keep working while the broker is gone
                await spool.append(env)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while metrics.value("reprolane_capture_publish_errors_total", {"sink": "kafka"}) < 1:
                assert loop.time() < deadline, "no kafka publish error counted while the broker was down"
                await asyncio.sleep(0.1)
            assert spool.depth > 0
            assert metrics.value("reprolane_capture_publish_lag_seconds") > 0
        finally:
            await asyncio.to_thread(local_stack.start_server, "kafka")
        for env in envs[100:]:
            await spool.append(env)
        await drained(spool, 90)
    finally:
        await publisher.stop()

    ids = {e.envelope_id() for e in envs}
    seen = await kafka_envelope_ids(stack, topic, ids)
    assert ids - seen.keys() == set(), f"{len(ids - seen.keys())} envelopes missing from Kafka"
    assert s3_envelope_ids(s3_client(stack.s3_endpoint, stack.s3_credentials), stack.audit_bucket, tenant) == ids


def start_worker(
    stack: StackInfo, spool_dir: Path, topic: str, prefix: str, count: int, log: Path
) -> subprocess.Popen[str]:
    env = {**os.environ, **capture_env(stack), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.capture.spool_worker", str(spool_dir), topic, prefix, str(count)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )


def read_until(proc: subprocess.Popen[str], done: Any, within_s: float) -> list[str]:
    """Lines of the worker's stdout until ``done(lines)`` is true."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + within_s
    while not done(lines):
        assert time.monotonic() < deadline, f"worker too slow; last lines: {lines[-3:]}"
        line = proc.stdout.readline()
        assert line, f"worker exited early with {proc.wait()}"
        lines.append(line.strip())
    return lines


async def test_sigkill_mid_run_loses_no_appended_envelope(stack: StackInfo, tmp_path: Path) -> None:
    spool_dir, topic, prefix = tmp_path / "spool", unique("envelopes"), unique("kill")
    log = tmp_path / "worker.log"
    worker = start_worker(stack, spool_dir, topic, prefix, 400, log)
    try:
        lines = await asyncio.to_thread(
            read_until, worker, lambda ls: sum(x.startswith("appended ") for x in ls) >= 150, 60
        )
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    printed = {x.split()[1] for x in lines if x.startswith("appended ")}
    assert len(printed) >= 150

    restarted = start_worker(stack, spool_dir, topic, prefix, 0, log)
    try:
        lines = await asyncio.to_thread(read_until, restarted, lambda ls: bool(ls) and ls[-1] == "drained", 90)
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait()
    recovered = int(lines[0].split()[1])
    assert recovered > 0, "the kill left nothing pending: the test did not kill mid-run"

    seen = await kafka_envelope_ids(stack, topic, printed)
    assert printed - seen.keys() == set(), f"{len(printed - seen.keys())} acknowledged envelopes missing from Kafka"
    assert printed <= s3_envelope_ids(s3_client(stack.s3_endpoint, stack.s3_credentials), stack.audit_bucket, prefix)


async def test_an_engines_envelopes_share_one_partition_and_two_engines_two(stack: StackInfo, tmp_path: Path) -> None:
    """Issue 32: keyed by the engine behind the sidecar, every envelope of one engine lands in one partition of the
    envelope topic, so one member of the replayers' consumer group owns that engine's busy periods; two engines
    (keys the default partitioner puts apart) land in two, so two members verify them in parallel."""
    from aiokafka.partitioner import DefaultPartitioner

    from capture.publishing.outgoing import Outgoing
    from capture.spool import SpoolEntry
    from infra.stack.topics import ensure_topics

    topic = unique("envelopes")
    ensure_topics(stack.kafka_bootstrap, [topic], partitions=3)
    engines = {"engine-a": [envelope(request_id=unique("a")) for _ in range(6)],
               "engine-b": [envelope(request_id=unique("b")) for _ in range(6)]}  # fmt: skip
    partitioner = DefaultPartitioner()
    assert len({partitioner(e.encode(), [0, 1, 2], [0, 1, 2]) for e in engines}) == 2  # keys that part ways
    for engine, envs in engines.items():
        settings = settings_for(stack, tmp_path / engine).model_copy(update={"engine_key": engine})
        sink = KafkaSink(settings, topic=topic)
        try:
            await sink.publish([Outgoing.from_entry(SpoolEntry(i, e.canonical())) for i, e in enumerate(envs)])
        finally:
            await sink.close()
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=stack.kafka_bootstrap, group_id=unique("partitions"), auto_offset_reset="earliest",
        enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    placed: dict[str, set[int]] = {}
    want, seen = sum(len(v) for v in engines.values()), 0
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while seen < want and asyncio.get_running_loop().time() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                for record in records:
                    assert record.key is not None
                    placed.setdefault(record.key.decode(), set()).add(tp.partition)
                    seen += 1
    finally:
        await consumer.stop()
    assert seen == want
    assert set(placed) == set(engines)  # keyed by the engine, not the request
    assert all(len(parts) == 1 for parts in placed.values()), placed
    assert placed["engine-a"] != placed["engine-b"]
