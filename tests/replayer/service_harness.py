"""Harness of the replayer service's stack tests: uuid topics on the stack's Kafka, and worker processes.

`Topics` is a fresh set of the service's five topics (uuid suffix, a consumer group of its own) with ways to
produce to them, read them back and wait for the group to settle. `Worker` is ``tests.replayer.service_worker``
in a process of its own, started with a `Topics`' settings, so that a test can SIGKILL it where it chooses (it
hangs on one request id after storing that result, and says so in its marker file) and read afterwards what
it counted (its journal: one request id per stored result, written as the metric is incremented).

What a downstream consumer counts is `DivergenceEvent.result_id`: the lake's divergences table and its views
keep one row per result id, so `results_by_request` groups the events the same way.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from pydantic import SecretStr

from infra.demo.services import reprolane_argv
from replayer.settings import ReplayerSettings
from schemas import DivergenceEvent, decode_divergence
from tests.replayer.support import S3Target

REPO = Path(__file__).resolve().parents[2]
Records = list[ConsumerRecord[Any, Any]]


@dataclass
class Topics:
    bootstrap: str
    s3: S3Target
    suffix: str

    @classmethod
    async def create(cls, bootstrap: str, s3: S3Target, *, partitions: int = 1) -> Topics:
        """New uuid topics (each with `partitions` partitions) on the broker at `bootstrap`."""
        topics = cls(bootstrap, s3, uuid.uuid4().hex[:10])
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics(
                [NewTopic(name, num_partitions=partitions, replication_factor=1) for name in topics.names.values()]
            )
        finally:
            await admin.close()
        return topics

    @property
    def names(self) -> dict[str, str]:
        return {
            "envelope_topic": f"env-{self.suffix}",
            "divergence_topic": f"div-{self.suffix}",
            "dead_letter_topic": f"dlq-{self.suffix}",
            "replay_request_topic": f"rrq-{self.suffix}",
            "service_heartbeat_topic": f"hb-{self.suffix}",
        }

    @property
    def group_id(self) -> str:
        return f"replayer-{self.suffix}"

    def settings(self, **overrides: Any) -> ReplayerSettings:
        """Short session timeouts, so a dead member leaves the group (and a rebalance ends) in seconds."""
        base: dict[str, Any] = {
            "kafka_bootstrap": self.bootstrap,
            "group_id": self.group_id,
            "session_timeout_ms": 2000,
            "heartbeat_interval_ms": 500,
            "retry_backoff_s": 0.1,
            **self.names,
        }
        base.update(overrides)
        return self.s3.settings(**base)

    async def produce(self, topic_field: str, *values: bytes, key: bytes = b"k", partition: int | None = None) -> None:
        await self.produce_to(topic_field, [(value, key, partition) for value in values])

    async def produce_to(self, topic_field: str, messages: Iterable[tuple[bytes, bytes, int | None]]) -> None:
        """Send each ``(value, key, partition)`` in order (partition None: the key's partition)."""
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, enable_idempotence=False)
        await producer.start()
        try:
            for value, key, partition in messages:
                await producer.send_and_wait(self.names[topic_field], value, key=key, partition=partition)
        finally:
            await producer.stop()

    async def consume(self, topic_field: str, count: int, timeout_s: float = 30.0) -> Records:
        """Read `count` records from the start of the topic (fails after `timeout_s`), then 0.5 s more."""
        records = await self.consume_until(topic_field, lambda got: len(got) >= count, timeout_s)
        assert len(records) >= count, f"got {len(records)} of {count} records from {self.names[topic_field]}"
        return records

    async def consume_until(self, topic_field: str, done: Callable[[Records], bool], timeout_s: float) -> Records:
        """Read from the start of the topic until `done(records)` (then 0.5 s more, so that a duplicate right
        behind shows) or `timeout_s` passes; the caller asserts on what came."""
        consumer = AIOKafkaConsumer(
            self.names[topic_field], bootstrap_servers=self.bootstrap, group_id=None, auto_offset_reset="earliest"
        )
        await consumer.start()
        records: Records = []
        try:
            deadline = time.monotonic() + timeout_s
            settle: float | None = None
            while True:
                now = time.monotonic()
                if settle is None and done(records):
                    settle = now + 0.5
                if (settle is not None and now >= settle) or now >= deadline:
                    break
                batch = await consumer.getmany(timeout_ms=200)
                for recs in batch.values():
                    records.extend(recs)
        finally:
            await consumer.stop()
        return records

    async def wait_for_group(self, members: int, timeout_s: float) -> None:
        """Until the envelope consumer group is ``Stable`` with `members` members (so each holds partitions)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                (response,) = await admin.describe_consumer_groups([self.group_id])
                _error, _group, state, _ptype, _protocol, got = response.groups[0][:6]
                if state == "Stable" and len(got) == members:
                    return
                if time.monotonic() > deadline:
                    raise AssertionError(f"group {self.group_id}: {state} with {len(got)} of {members} members")
                await asyncio.sleep(0.25)
        finally:
            await admin.close()


def events(records: Records) -> list[DivergenceEvent]:
    return [decode_divergence(r.value) for r in records]


def results_by_request(got: Iterable[DivergenceEvent]) -> dict[str, set[str]]:
    """The result ids published for each request id: duplicates (redeliveries) collapse, as downstream."""
    by_request: dict[str, set[str]] = {}
    for ev in got:
        by_request.setdefault(ev.request_id, set()).add(ev.result_id())
    return by_request


def worker_environment(settings: ReplayerSettings) -> dict[str, str]:
    """``REPROLANE_REPLAYER_*`` for `settings` (secrets in clear, unset fields left out) over this environment."""
    values = settings.model_dump(exclude={"thresholds"})
    env = dict(os.environ)
    for name, value in values.items():
        if value is None:
            continue
        text = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
        env[f"REPROLANE_REPLAYER_{name.upper()}"] = text
    return env


def start_replayer_service(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``reprolane serve replayer`` as an operator starts it (settings from the environment), in a process group of
    its own (the test stops it by that group), its output in `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [*reprolane_argv(), "serve", "replayer", "--metrics-port", "0"],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
        )  # fmt: skip


@dataclass
class Worker:
    """One ``tests.replayer.service_worker`` process and its files (marker, journal, log) in `directory`."""

    name: str
    process: asyncio.subprocess.Process
    marker: Path
    journal: Path
    log: Path

    @classmethod
    async def start(
        cls, settings: ReplayerSettings, directory: Path, name: str, *, hang_on: str | None = None
    ) -> Worker:
        marker, journal, log = (directory / f"{name}.{what}" for what in ("stored", "counted", "log"))
        env = {
            **worker_environment(settings),
            "REPROLANE_TEST_MARKER": str(marker),
            "REPROLANE_TEST_JOURNAL": str(journal),
        }
        if hang_on is not None:
            env["REPROLANE_TEST_HANG_ON"] = hang_on
        with log.open("wb") as stderr:  # a file, not a pipe: a chatty worker must never block on a full pipe
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.replayer.service_worker",
                cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        return cls(name, process, marker, journal, log)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def counted(self) -> list[str]:
        """Request ids this worker counted as replayed (one per stored result), in order."""
        return self.journal.read_text().split() if self.journal.exists() else []

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    async def kill(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.process.wait(), 10)

    async def terminate(self, timeout_s: float = 40.0) -> int:
        """SIGTERM (the service stops its consumer cleanly) and the exit status."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), timeout_s)


async def wait_for_marker(workers: Iterable[Worker], timeout_s: float) -> Worker:
    """The first worker to reach its crash point (its marker file exists); fails if a worker exits first."""
    waiting = list(workers)
    deadline = time.monotonic() + timeout_s
    while True:
        for worker in waiting:
            if await asyncio.to_thread(worker.marker.exists):
                return worker
            if not worker.alive:
                status = worker.process.returncode
                raise AssertionError(f"worker {worker.name} exited with {status}: {worker.log_tail()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker reached the crash point in {timeout_s} s")
        await asyncio.sleep(0.1)
