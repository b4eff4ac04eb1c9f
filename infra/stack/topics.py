"""Create the pipeline's Kafka topics (idempotent) so consumers never subscribe to a missing topic.

Tansu creates a topic on first produce, but a consumer group that subscribes first would wait for a
rebalance; real Kafka usually runs with auto-creation off. Production creates them with
``infra/kafka/create-topics.sh``; the local stack calls :func:`ensure_topics` after Kafka is ready.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from infra.clients.connection import KafkaConnectionFields
from infra.clients.kafka import aiokafka_kwargs
from infra.errors import StackError
from schemas.layout import ALL_TOPICS

DEFAULT_PARTITIONS = 4


async def _create(bootstrap: str, topics: Iterable[str], partitions: int) -> list[str]:
    admin = AIOKafkaAdminClient(
        **aiokafka_kwargs(KafkaConnectionFields(kafka_bootstrap=bootstrap)), request_timeout_ms=10_000
    )
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in topics if t not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(name=t, num_partitions=partitions, replication_factor=1) for t in missing]
                )
            except TopicAlreadyExistsError:
                pass  # created concurrently by someone else: that is the outcome we wanted
        return missing
    finally:
        await admin.close()


def ensure_topics(
    bootstrap: str, topics: Iterable[str] = ALL_TOPICS, partitions: int = DEFAULT_PARTITIONS
) -> list[str]:
    """Create the missing topics; return the names created. Safe to call from inside a running loop
    (it runs its own loop in a worker thread)."""
    wanted = list(topics)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        try:
            return pool.submit(asyncio.run, _create(bootstrap, wanted, partitions)).result(timeout=60)
        except (KafkaError, OSError, concurrent.futures.TimeoutError) as exc:
            raise StackError(f"cannot create topics on {bootstrap}: {type(exc).__name__}: {exc}") from exc
