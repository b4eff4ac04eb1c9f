"""Fixtures of the lake and sealing stack tests: a uuid lake prefix, uuid tenants and uuid topics on the session's
stack (and, for fast tests, `moto_store`: an `AuditStore` on a fresh bucket of a module's moto server). One
shared bucket (``reprolane-lake``) rather than a bucket per test: SeaweedFS gives every bucket its own
volumes, and a bucket per test runs a long-lived dev stack out of volume slots."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.audit.store import AuditStore
from schemas.layout import LAKE_BUCKET
from schemas.sealed import new_data_key
from tests.moto_s3 import moto_client, moto_server


@dataclass
class AuditStack:
    """Addresses of the stack plus this test's own bucket (lake + keys) and topics."""

    info: Any
    suffix: str
    bucket: str
    kek: bytes

    @property
    def prefix(self) -> str:
        return f"lake-{self.suffix}"

    @property
    def envelope_topic(self) -> str:
        return f"env-{self.suffix}"

    @property
    def divergence_topic(self) -> str:
        return f"div-{self.suffix}"

    @property
    def kek_b64(self) -> str:
        return base64.b64encode(self.kek).decode()

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.info.s3_endpoint,
            aws_access_key_id=self.info.s3_access_key,
            aws_secret_access_key=self.info.s3_secret_key,
            region_name=self.info.s3_region,
        )

    def lake_settings(self, **overrides: Any) -> LakeSettings:
        base: dict[str, Any] = {
            "kafka_bootstrap": self.info.kafka_bootstrap,
            "envelope_topic": self.envelope_topic,
            "divergence_topic": self.divergence_topic,
            "group_id": f"archiver-{self.suffix}",
            "session_timeout_ms": 2000,
            "heartbeat_interval_ms": 500,
            "flush_seconds": 0.5,
            "s3_endpoint": self.info.s3_endpoint,
            "s3_access_key": self.info.s3_access_key,
            "s3_secret_key": self.info.s3_secret_key,
            "s3_bucket": self.info.audit_bucket,
            "lake_bucket": self.bucket,
            "lake_prefix": self.prefix,
            "keys_bucket": self.bucket,
        }
        base.update(overrides)
        return LakeSettings(**base)

    def lake(self) -> Lake:
        return Lake.from_settings(self.lake_settings())

    async def produce(self, topic: str, values: list[bytes]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=self.info.kafka_bootstrap, linger_ms=5)
        await producer.start()
        try:
            futures = [await producer.send(topic, v, key=b"k") for v in values]
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    async def consume(self, topic: str, count: int, timeout_s: float = 30.0) -> list[bytes]:
        consumer = AIOKafkaConsumer(
            topic, bootstrap_servers=self.info.kafka_bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
        )
        await consumer.start()
        got: list[bytes] = []
        try:
            deadline = asyncio.get_running_loop().time() + timeout_s
            while len(got) < count and asyncio.get_running_loop().time() < deadline:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    got += [r.value for r in records]
        finally:
            await consumer.stop()
        return got


@pytest.fixture
async def audit_stack(stack: Any) -> AsyncIterator[AuditStack]:
    suffix = uuid.uuid4().hex[:10]
    env = AuditStack(stack, suffix, LAKE_BUCKET, new_data_key())
    client = env.client()
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=env.bucket)
    admin = AIOKafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap)
    await admin.start()
    try:
        topics = [env.envelope_topic, env.divergence_topic]
        await admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1) for t in topics])
    finally:
        await admin.close()
    yield env
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=env.bucket):  # this test's files and keys
        for obj in page.get("Contents", []):
            if env.suffix in obj["Key"]:
                client.delete_object(Bucket=env.bucket, Key=obj["Key"])


async def eventually(condition: Callable[[], bool], within_s: float = 30.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what} not reached within {within_s}s"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def moto_store(moto_endpoint: str) -> AuditStore:
    """An `AuditStore` on a fresh bucket of the module's moto server."""
    client = moto_client(moto_endpoint)
    name = f"t-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return AuditStore(client, name)
