"""The archiver under faults, on the real stack (issue #18, "Also prove"): real `reprolane serve archiver`
processes, the lake on SeaweedFS.

- Two archivers in one consumer group, one SIGKILLed mid-run (rows buffered, offsets uncommitted): the survivor
  takes its partitions over, and the lake holds every envelope exactly once as the lake defines it (its
  ``envelopes`` view collapses copies by ``envelope_id``, `capture.audit.lake.schema.DEDUPE_KEY`; compaction
  then leaves one row per id in the files too).
- Kafka down while an archiver runs: nothing lost, and it resumes by itself when Kafka is back. Kafka here is a
  PRIVATE in-memory Tansu (the shared stack's broker is never stopped) behind a TCP relay that Tansu advertises,
  so "down" is every connection cut and refused while the broker keeps its topics and committed offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from capture.audit.lake.query import run_query
from capture.audit.lake.settings import LakeSettings
from schemas import Envelope
from tests.capture.audit.conftest import AuditStack
from tests.factories import envelope
from tests.private_tansu import private_tansu as launch_tansu

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]

REPO = Path(__file__).resolve().parents[4]


@dataclass
class ArchiverProcess:
    """One ``reprolane serve archiver`` and its log."""

    name: str
    process: asyncio.subprocess.Process
    log: Path

    @classmethod
    async def start(
        cls, settings: LakeSettings, directory: Path, name: str, *, kill_after_flush: int = 0
    ) -> ArchiverProcess:
        """`reprolane serve archiver`, or with `kill_after_flush` the worker that SIGKILLs itself after that
        flush's write and before its commit (tests/capture/audit/lake/archiver_worker.py)."""
        env = dict(os.environ)
        for key, value in settings.model_dump().items():
            if value is not None:
                text = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
                env[f"REPROLANE_ARCHIVER_{key.upper()}"] = text
        argv = ["-c", "from infra.cli.root import app; app()", "serve", "archiver"]
        if kill_after_flush:
            env["REPROLANE_TEST_KILL_AFTER_FLUSH"] = str(kill_after_flush)
            argv = ["-m", "tests.capture.audit.lake.archiver_worker"]
        log = directory / f"{name}.log"
        with log.open("wb") as stderr:  # a file, not a pipe: a chatty process never blocks on a full pipe
            process = await asyncio.create_subprocess_exec(
                sys.executable, *argv, cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=stderr
            )
        return cls(name, process, log)

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def flushes(self) -> int:
        return self.text().count("archiver: wrote ")

    async def kill(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(self.process.wait(), 10)

    async def terminate(self) -> int:
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 30)


async def create_topics(bootstrap: str, topics: list[str], partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, num_partitions=partitions, replication_factor=1) for t in topics])
    finally:
        await admin.close()


async def produce(bootstrap: str, topic: str, envs: list[Envelope], *, per_second: float | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, request_timeout_ms=10_000)
    await producer.start()
    try:
        for env in envs:
            await (await producer.send(topic, env.canonical(), key=env.request_id.encode()))
            if per_second:
                await asyncio.sleep(1 / per_second)
    finally:
        await producer.stop()


def lake_counts(a: AuditStack, settings: LakeSettings) -> tuple[int, int, int]:
    """(rows in the files, rows of the deduplicated view, distinct ids) of this test's tenant's envelopes."""
    from capture.audit.lake.store import Lake

    sql = (
        "SELECT (SELECT count(*) FROM envelopes_raw), (SELECT count(*) FROM envelopes), "
        "(SELECT count(DISTINCT envelope_id) FROM envelopes_raw)"
    )
    row = run_query(Lake.from_settings(settings), sql).rows[0]
    return int(row[0]), int(row[1]), int(row[2])


async def until(condition: object, within_s: float, what: str, *workers: ArchiverProcess) -> None:
    deadline = time.monotonic() + within_s
    while not await asyncio.to_thread(condition):  # type: ignore[arg-type]
        for w in workers:
            assert w.alive, f"{w.name} exited {w.process.returncode}: {w.text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not reached in {within_s} s: " + " | ".join(
            w.text()[-1500:] for w in workers
        )
        await asyncio.sleep(0.3)


def envelopes(a: AuditStack, n: int, tag: str) -> list[Envelope]:
    return [envelope(request_id=f"{tag}{i}-{a.suffix}", tenant=f"faults-{a.suffix}") for i in range(n)]


async def test_two_archivers_one_sigkilled_every_envelope_once(audit_stack: AuditStack, tmp_path: Path) -> None:
    """The victim dies by SIGKILL right after its second flush wrote rows and before it committed their offsets:
    the survivor reads them again (copies in the files), and the view still holds each envelope once."""
    a = audit_stack
    topic, divergences = f"env4-{a.suffix}", f"div4-{a.suffix}"
    await create_topics(a.info.kafka_bootstrap, [topic, divergences], partitions=4)
    settings = a.lake_settings(
        envelope_topic=topic, divergence_topic=divergences, session_timeout_ms=3000, heartbeat_interval_ms=500,
        flush_seconds=1.0, flush_rows=50_000,
    )  # fmt: skip
    first, second = envelopes(a, 150, "k"), envelopes(a, 150, "s")
    victim = await ArchiverProcess.start(settings, tmp_path, "victim", kill_after_flush=2)
    survivor = await ArchiverProcess.start(settings, tmp_path, "survivor")
    total = len(first) + len(second)
    try:
        await asyncio.sleep(4)  # both join the group and split the four partitions
        await produce(a.info.kafka_bootstrap, topic, first)
        await until(lambda: victim.flushes() >= 1 and survivor.flushes() >= 1, 60, "both writing", victim, survivor)
        await produce(a.info.kafka_bootstrap, topic, second, per_second=150)  # mid-run: the victim's second flush
        await asyncio.wait_for(victim.process.wait(), 30)
        assert victim.process.returncode == -signal.SIGKILL, victim.text()[-3000:]
        assert "test worker: SIGKILL after flush 2" in victim.text()
        await until(lambda: lake_counts(a, settings)[2] >= total, 90, "every envelope in the lake", survivor)
        await asyncio.sleep(2)  # let the survivor finish re-reading what the victim wrote and never committed
        raw, view, distinct = lake_counts(a, settings)
        assert (view, distinct) == (total, total), (raw, view, distinct)  # none lost, each once in the view
        assert raw > total, (raw, view, distinct)  # the victim's last flush, read again: copies in the files
        assert await survivor.terminate() == 0
    finally:
        for w in (victim, survivor):
            with contextlib.suppress(ProcessLookupError, TimeoutError):
                await w.kill()
    from capture.audit.lake.store import Lake

    lake = Lake.from_settings(settings)
    for part in lake.partitions("envelopes"):
        if part.tenant == f"faults-{a.suffix}":
            lake.compact("envelopes", part.day)
    assert lake_counts(a, settings) == (total, total, total)  # compacted: one row per envelope in the files


@dataclass
class Relay:
    """A TCP relay in front of a private Tansu, which advertises the relay's port; `down` cuts and refuses."""

    inner: int
    port: int
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", self.inner)
        except OSError:
            client_writer.close()
            return
        self.writers |= {client_writer, broker_writer}
        await asyncio.gather(self._pipe(client_reader, broker_writer), self._pipe(broker_reader, client_writer))

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def down(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self.writers.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 5)
        self.server = None


@pytest.fixture
def private_tansu(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(broker port, advertised relay port) of a private in-memory Tansu (`tests.private_tansu`)."""
    with launch_tansu(tmp_path / "tansu.log") as ports:
        yield ports


@pytest.fixture
async def relay(private_tansu: tuple[int, int]) -> AsyncIterator[Relay]:
    r = Relay(*private_tansu)
    await r.up()
    yield r
    if r.server is not None:
        await r.down()


async def test_kafka_down_while_the_archiver_runs_nothing_lost(
    audit_stack: AuditStack, relay: Relay, tmp_path: Path
) -> None:
    a = audit_stack
    topic, divergences = f"envd-{a.suffix}", f"divd-{a.suffix}"
    await create_topics(relay.bootstrap, [topic, divergences], partitions=2)
    settings = a.lake_settings(
        kafka_bootstrap=relay.bootstrap, envelope_topic=topic, divergence_topic=divergences,
        session_timeout_ms=6000, heartbeat_interval_ms=1000, flush_seconds=3.0,
    )  # fmt: skip
    before, buffered, after = envelopes(a, 40, "b"), envelopes(a, 40, "m"), envelopes(a, 40, "a")
    archiver = await ArchiverProcess.start(settings, tmp_path, "arch")
    try:
        await produce(relay.bootstrap, topic, before)
        await until(lambda: lake_counts(a, settings)[2] >= len(before), 60, "the first envelopes archived", archiver)
        await produce(relay.bootstrap, topic, buffered)
        await asyncio.sleep(1.0)  # consumed and buffered; their flush (and offset commit) is due in ~2 s
        await relay.down()  # Kafka gone: connections cut, new ones refused; the flush's commit fails
        await asyncio.sleep(10)  # longer than the session timeout: heartbeats, fetches and commits fail
        assert archiver.alive, archiver.text()[-3000:]
        assert lake_counts(a, settings)[2] == len(before) + len(buffered)  # flushed while Kafka was down
        await relay.up()
        await produce(relay.bootstrap, topic, after)  # the same broker: topics and committed offsets kept
        total = len(before) + len(buffered) + len(after)
        await until(lambda: lake_counts(a, settings)[2] >= total, 90, "archiving after Kafka is back", archiver)
        raw, view, distinct = lake_counts(a, settings)
        assert (view, distinct) == (total, total), (raw, view, distinct)
        assert archiver.alive  # it resumed by itself: no restart
        assert await archiver.terminate() == 0
    finally:
        with contextlib.suppress(ProcessLookupError, TimeoutError):
            await archiver.kill()
