"""The archiver's fault path without a broker: an offset commit that fails (Kafka gone, the group rebalanced) costs
no rows and does not stop it (the real-stack faults are in test_archiver_faults_stack.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.fs as pafs
from aiokafka.errors import CommitFailedError, KafkaConnectionError

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import run_query
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from tests.factories import envelope

SETTINGS = LakeSettings(kafka_bootstrap="127.0.0.1:9", s3_bucket="b", lake_bucket="b", flush_rows=1)


class TP(NamedTuple):
    topic: str
    partition: int


class Record(NamedTuple):
    value: bytes
    offset: int
    headers: tuple[tuple[str, bytes], ...] = ()


class FlakyConsumer:
    """Hands out `values` one per poll; its first `failures` commits raise what Kafka raises when it is gone."""

    def __init__(self, values: list[bytes], failures: list[Exception], stop: asyncio.Event) -> None:
        self.values, self.failures, self.stop_event = list(values), list(failures), stop
        self.commits = 0

    def subscribe(self, topics: list[str], listener: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TP, list[Record]]:
        await asyncio.sleep(0)
        if not self.values:
            self.stop_event.set()
            return {}
        offset = len(self.values)
        return {TP(SETTINGS.envelope_topic, 0): [Record(self.values.pop(0), offset)]}

    async def commit(self) -> None:
        if self.failures:
            raise self.failures.pop(0)
        self.commits += 1

    async def stop(self) -> None:
        pass


async def test_a_failed_commit_costs_no_rows_and_the_archiver_goes_on(tmp_path: Path) -> None:
    lake = Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")
    archiver = Archiver(SETTINGS, lake)
    stop = asyncio.Event()
    values = [envelope(request_id=f"r{i}").canonical() for i in range(3)]
    consumer = FlakyConsumer(values, [KafkaConnectionError(), CommitFailedError("rebalanced")], stop)
    archiver._make_consumer = lambda: consumer  # type: ignore[method-assign]
    await asyncio.wait_for(archiver.run(stop, poll_ms=1), 10)
    assert archiver.stats.commit_failures == 2
    assert consumer.commits >= 2  # the third flush and the final one committed
    assert run_query(lake, "SELECT request_id FROM envelopes ORDER BY 1").rows == [("r0",), ("r1",), ("r2",)]
