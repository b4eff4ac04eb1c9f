"""The real local stack: Tansu, SeaweedFS and vLLM CPU answer as the rest of the project assumes.

All tests share the session's stack (see ``tests/conftest.py``); each isolates itself with a uuid topic
or key. ``test_down_leaves_no_process_alive`` takes the stack down and brings it back up, so tests
after it still find it running.
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from botocore.exceptions import ClientError

from infra.stack import process
from infra.stack.buckets import s3_client
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo, StackState

pytestmark = pytest.mark.stack


async def _create_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name=topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def _consume(bootstrap: str, topic: str, count: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"g-{uuid.uuid4().hex}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
    )
    await consumer.start()
    received: list[bytes] = []
    try:
        while len(received) < count:
            batches = await consumer.getmany(timeout_ms=10_000)
            if not batches:
                break
            received.extend(msg.value for msgs in batches.values() for msg in msgs if msg.value is not None)
        await consumer.commit()
    finally:
        await consumer.stop()
    return received


async def test_kafka_round_trip_with_consumer_group(stack: StackInfo) -> None:
    topic = f"t-{uuid.uuid4().hex}"
    await _create_topic(stack.kafka_bootstrap, topic)
    values = [f"m{i}".encode() for i in range(5)]
    await _produce(stack.kafka_bootstrap, topic, values)
    assert await _consume(stack.kafka_bootstrap, topic, len(values)) == values


async def test_kafka_restart_keeps_port_and_topic(private_stack: tuple[LocalStack, StackInfo]) -> None:
    """On a private stack, as every test that stops a server (`tests.conftest.private_stack`)."""
    local_stack, stack = private_stack
    topic = f"t-{uuid.uuid4().hex}"
    await _create_topic(stack.kafka_bootstrap, topic)
    await _produce(stack.kafka_bootstrap, topic, [b"before"])
    local_stack.stop_server("kafka")
    assert StackState.load(stack.run_dir).servers["kafka"].pid is None
    local_stack.start_server("kafka")
    assert local_stack.info().kafka_bootstrap == stack.kafka_bootstrap
    await _produce(stack.kafka_bootstrap, topic, [b"after"])
    assert await _consume(stack.kafka_bootstrap, topic, 2) == [b"before", b"after"]


def test_object_lock_refuses_deleting_a_locked_version(stack: StackInfo) -> None:
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    key = f"audit/{uuid.uuid4().hex}.json"
    put = client.put_object(
        Bucket=stack.audit_bucket,
        Key=key,
        Body=b'{"x": 1}',
        ObjectLockMode="COMPLIANCE",
        ObjectLockRetainUntilDate=datetime.now(UTC) + timedelta(minutes=1),
    )
    version = put["VersionId"]
    with pytest.raises(ClientError) as refused:
        client.delete_object(Bucket=stack.audit_bucket, Key=key, VersionId=version)
    assert refused.value.response["Error"]["Code"] in ("AccessDenied", "ObjectLocked", "InvalidRequest")
    assert client.get_object(Bucket=stack.audit_bucket, Key=key, VersionId=version)["Body"].read() == b'{"x": 1}'


def test_vllm_chat_returns_token_ids_and_logprobs(stack: StackInfo) -> None:
    assert stack.vllm_url is not None
    body = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 3,
        "max_tokens": 8,
        "temperature": 0,
    }
    response = httpx.post(f"{stack.vllm_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["prompt_token_ids"]
    assert all(isinstance(t, int) for t in data["prompt_token_ids"])
    choice = data["choices"][0]
    assert 0 < len(choice["token_ids"]) <= 8
    steps = choice["logprobs"]["content"]
    assert len(steps) == len(choice["token_ids"])
    assert all(len(step["top_logprobs"]) == 3 for step in steps)


def test_up_twice_starts_no_duplicates(local_stack: LocalStack, stack: StackInfo) -> None:
    before = {name: rec.pid for name, rec in StackState.load(stack.run_dir).servers.items()}
    assert local_stack.up() == stack
    after = {name: rec.pid for name, rec in StackState.load(stack.run_dir).servers.items()}
    assert before == after
    assert all(s.health == "ready" for s in local_stack.status())


def test_down_leaves_no_process_alive(tmp_path: Path) -> None:
    """On a private stack (S3 and Kafka: seconds), so the session's stack keeps its ports for later tests.
    The session fixture checks the same of the stack with vLLM when it takes that one down."""
    private = LocalStack(tmp_path / "private")
    info = private.up(servers=("s3", "kafka"))
    refs = [rec.process for rec in StackState.load(info.run_dir).servers.values()]
    assert len(refs) == 2
    assert all(ref is not None and process.is_alive(ref) for ref in refs)
    private.down()
    for ref in refs:
        assert ref is not None
        with pytest.raises(ProcessLookupError):
            os.kill(ref.pid, 0)
        assert not process.group_alive(ref.pid)
    assert not (info.run_dir / "pids").exists() or not any((info.run_dir / "pids").iterdir())
