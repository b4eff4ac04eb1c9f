"""What the demo reads from Kafka: where the topics ended before its traffic, and what arrived after.

The demo never trusts its own bookkeeping for the summary: requests captured are envelopes read back from the
envelope topic, replays are divergence events read back from the divergence topic, both from the end offsets
marked before the first request (`mark`) and filtered to this run's request ids (the topics may carry other
traffic). Records are keyed by request id; at-least-once delivery may repeat one, so they collapse by id.

`start_group_at` commits a fresh consumer group's offsets at the mark before the replayer starts: the replayer
then reads exactly this run's envelopes, whenever its group join completes, and never an earlier run's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from infra.clients.connection import KafkaConnectionFields
from infra.clients.kafka import aiokafka_kwargs
from infra.errors import DemoError
from schemas.layout import HEADER_REQUEST_ID

Progress = Callable[[int], None]
_POLL_MS = 500


def _consumer(bootstrap: str, group_id: str | None) -> AIOKafkaConsumer:
    """A consumer of the local stack's (plaintext) broker that commits only by hand."""
    connection = KafkaConnectionFields(kafka_bootstrap=bootstrap)
    return AIOKafkaConsumer(**aiokafka_kwargs(connection), group_id=group_id, enable_auto_commit=False)


@dataclass(frozen=True)
class Mark:
    """End offsets of one topic at a moment: partition -> next offset."""

    topic: str
    offsets: dict[int, int]


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        await consumer.topics()  # refreshes the metadata
        parts = consumer.partitions_for_topic(topic)
    if not parts:
        raise DemoError(f"topic {topic} does not exist (was the stack started with `reprolane stack up`?)")
    return [TopicPartition(topic, p) for p in sorted(parts)]


async def mark(bootstrap: str, topics: Collection[str]) -> dict[str, Mark]:
    """The end offsets of each topic now."""
    consumer = _consumer(bootstrap, None)
    try:
        await consumer.start()
        out = {}
        for topic in topics:
            tps = await _partitions(consumer, topic)
            ends = await consumer.end_offsets(tps)
            out[topic] = Mark(topic, {tp.partition: ends[tp] for tp in tps})
        return out
    except KafkaError as exc:
        raise DemoError(f"cannot read offsets from Kafka at {bootstrap}: {exc}") from exc
    finally:
        await consumer.stop()


async def start_group_at(bootstrap: str, group_id: str, at: Mark) -> None:
    """Commit ``group_id``'s offsets at ``at`` (and check them), so its consumers start exactly there."""
    consumer = _consumer(bootstrap, group_id)
    tps = [TopicPartition(at.topic, p) for p in at.offsets]
    try:
        await consumer.start()
        consumer.assign(tps)
        await consumer.commit({tp: at.offsets[tp.partition] for tp in tps})
        for tp in tps:
            committed = await consumer.committed(tp)
            if committed != at.offsets[tp.partition]:
                raise DemoError(f"group {group_id}: committed {committed} at {tp}, expected {at.offsets[tp.partition]}")
    except KafkaError as exc:
        raise DemoError(f"cannot commit offsets for group {group_id}: {exc}") from exc
    finally:
        await consumer.stop()


def _request_id(record: Any) -> str:
    """The request a record is about: an envelope's request-id header (its key is the engine it ran on), else the
    key (a divergence event is keyed by its request id)."""
    said = dict(record.headers or ()).get(HEADER_REQUEST_ID) or record.key or b""
    return bytes(said).decode("utf-8", "replace")


async def collect(
    bootstrap: str,
    since: Mark,
    wanted: Callable[[str], bool],
    *,
    until: Callable[[dict[str, bytes]], bool],
    timeout_s: float,
    progress: Progress | None = None,
) -> dict[str, bytes]:
    """Records of ``since.topic`` after the mark whose request id (`_request_id`) passes ``wanted``, by request id
    (last one wins).

    Reads until ``until(found)`` holds, then returns; after ``timeout_s`` returns what it has (the caller says
    what is missing). ``progress(len(found))`` is called whenever the count changes.
    """
    found: dict[str, bytes] = {}
    if until(found):
        return found
    consumer = _consumer(bootstrap, None)
    try:
        await consumer.start()
        tps = [TopicPartition(since.topic, p) for p in since.offsets]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, since.offsets[tp.partition])
        deadline = time.monotonic() + timeout_s
        while not until(found) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=_POLL_MS)
            before = len(found)
            for records in batches.values():
                for record in records:
                    key = _request_id(record)
                    if wanted(key) and record.value is not None:
                        found[key] = record.value
            if progress is not None and len(found) != before:
                progress(len(found))
        return found
    except KafkaError as exc:
        raise DemoError(f"cannot read {since.topic} from Kafka at {bootstrap}: {exc}") from exc
    finally:
        await consumer.stop()
