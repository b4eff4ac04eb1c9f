"""Faults of the replayer service on the real stack: a member of its consumer group killed, its S3 gone.

"Exactly once" here is what at-least-once delivery allows and what a reader of the results relies on:

* in S3 every envelope has exactly one replay result, under the key that is a pure function of (envelope id,
  lane fingerprint); the write is conditional, so a second writer (a redelivery, two members racing over a
  partition mid-rebalance) keeps the first result;
* on the divergence topic an envelope may be published more than once (the crash before the commit), but
  always with the same ``result_id``: deduplicated by that id, as the lake does, each envelope counts once;
* no envelope is missing from either;
* the replay metrics count a stored result at most once across all the processes (each worker journals what
  it counted): a result stored by a process killed before it counted it is counted by nobody, since the
  process that takes over finds it stored and only re-publishes it.

The workers are ``tests.replayer.service_worker`` processes with the deterministic `ArithmeticLane`, so a result
replayed by one process is byte-identical to the one another would have made.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from infra.stack import process
from infra.stack.buckets import AUDIT_BUCKET, TANSU_BUCKET, S3Credentials, ensure_buckets
from infra.stack.ports import allocate_ports, require_free
from infra.stack.servers import SERVERS
from infra.stack.state import StackState
from replayer.store import EnvelopeStore, result_key
from schemas import Envelope
from tests.replayer.service_harness import Records, Topics, Worker, events, results_by_request, wait_for_marker
from tests.replayer.support import ArithmeticLane, S3Target, arithmetic_envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]  # a fake lane, its own topics, its own S3 to stop

PARTITIONS = 3


def assert_each_replayed_once(envs: list[Envelope], records: Records, store: EnvelopeStore) -> None:
    """Deduplicated by result id, every envelope is on the topic once, and its result (only it) is in S3."""
    published = results_by_request(events(records))
    assert sorted(published) == sorted(e.request_id for e in envs)  # nothing lost, nothing foreign
    lane_fp = ArithmeticLane().fingerprint().sha256()
    for env in envs:
        (result_id,) = published[env.request_id]  # a redelivery carries the same id
        assert store.list_results(env) == [result_key(env, lane_fp)]  # write-once: one object per envelope
        assert result_key(env, lane_fp).endswith(f"/{result_id}.json")


def distinct_at_least(count: int) -> Callable[[Records], bool]:
    return lambda got: len(results_by_request(events(got))) >= count


async def test_three_replayers_one_killed_mid_run_replay_and_count_each_envelope_once(
    stack: Any, tmp_path: Path
) -> None:
    """Three members share three partitions; the owner of partition 0 dies after storing its 4th result (before
    publishing it or committing). The group rebalances; the new owner re-reads that message, finds the result
    stored and publishes it, and goes on with the eleven behind it."""
    topics = await Topics.create(stack.kafka_bootstrap, S3Target.from_stack(stack), partitions=PARTITIONS)
    envs = [arithmetic_envelope(n, topics.suffix, diverge_at=2 if n % 7 == 3 else None) for n in range(45)]
    doomed = envs[3 * PARTITIONS]  # envelope n goes to partition n % 3: this is the 4th of partition 0
    settings = topics.settings()
    workers = [await Worker.start(settings, tmp_path, f"w{i}", hang_on=doomed.request_id) for i in range(3)]
    try:
        await topics.wait_for_group(members=3, timeout_s=45)
        await topics.produce_to(
            "envelope_topic", ((e.canonical(), e.request_id.encode(), n % PARTITIONS) for n, e in enumerate(envs))
        )
        killed = await wait_for_marker(workers, timeout_s=45)
        await killed.kill()
        records = await topics.consume_until("divergence_topic", distinct_at_least(len(envs)), timeout_s=60)
        for worker in workers:
            assert worker is killed or worker.alive, worker.log_tail()
    finally:
        for worker in workers:
            await worker.kill()
    assert killed.process.returncode == -signal.SIGKILL

    assert_each_replayed_once(envs, records, EnvelopeStore.from_settings(settings))
    assert {killed.marker.read_text()} == results_by_request(events(records))[doomed.request_id]  # its result
    counted = Counter(request_id for worker in workers for request_id in worker.counted())
    assert counted == Counter(e.request_id for e in envs if e is not doomed)  # once each; the doomed one by none
    assert all(worker.counted() for worker in workers)  # the three shared the work


class PrivateS3:
    """A SeaweedFS of one test's own (the stack's is shared by every test), on ports drawn once and a data dir
    kept across `stop` and `start`: the stack's S3 server definition (`infra.stack.servers`: argv, ports, readiness)
    run with `infra.stack.process`, as `LocalStack` runs it. Not `LocalStack` itself: its ``up`` ends by describing
    the stack (`StackState.info`), which needs a Kafka, and this one has none."""

    def __init__(self, run_dir: Path) -> None:
        server = SERVERS["s3"]
        ports = allocate_ports(len(server.port_keys), server.port_offsets)
        self.server, self.ports = server, dict(zip(server.port_keys, ports, strict=True))
        credentials = S3Credentials(access_key="reprolane", secret_key=secrets.token_hex(16))
        self.state = StackState(
            run_dir=run_dir, created_at=datetime.now(UTC), credentials=credentials, audit_bucket=AUDIT_BUCKET,
            tansu_bucket=TANSU_BUCKET, kafka_storage="memory", model_name="none", model_dir=None, servers={},
        )  # fmt: skip
        self.log = run_dir / "s3.log"
        self.ref: process.ProcessRef | None = None

    @property
    def target(self) -> S3Target:
        creds = self.state.credentials
        return S3Target(self.server.url(self.ports), creds.access_key, creds.secret_key, AUDIT_BUCKET, creds.region)

    def start(self) -> None:
        """Start it (again) and wait until it serves; make the buckets (idempotent)."""
        require_free("s3", list(self.ports.values()), self.server.port_offsets)
        launch = self.server.launch(self.state, self.ports)
        self.ref = process.spawn(launch.argv, launch.env, self.log, launch.cwd)
        deadline = time.monotonic() + self.server.ready_timeout_s
        while not self.server.is_ready(self.state, self.ports):
            assert process.is_alive(self.ref), process.log_tail(self.log)
            assert time.monotonic() < deadline, process.log_tail(self.log)
            time.sleep(0.25)
        ensure_buckets(self.target.endpoint, self.state.credentials)

    def stop(self) -> None:
        """SIGTERM its process group by pid and wait until the group is gone (SIGKILL after the stack's timeout)."""
        if self.ref is not None:
            process.stop(self.ref, self.server.stop_timeout_s)
            assert not process.group_alive(self.ref.pid)
            self.ref = None


async def test_s3_down_while_the_replayer_runs_loses_nothing_and_it_resumes_alone(stack: Any, tmp_path: Path) -> None:
    """A SeaweedFS of this test's own (the stack's is shared), stopped by pid and restarted on its ports and data.

    The service takes envelopes from the Kafka message, so what lives in this S3 is the replay results: while it
    is down the worker can neither look a result up nor store one, publishes nothing, and must re-read the
    message until S3 is back, neither skipping it nor dying; nobody restarts it."""
    private = PrivateS3(tmp_path)
    worker: Worker | None = None
    try:
        await asyncio.to_thread(private.start)
        topics = await Topics.create(stack.kafka_bootstrap, private.target)
        envs = [arithmetic_envelope(n, topics.suffix, diverge_at=1 if n % 5 == 2 else None) for n in range(24)]
        before, during = envs[:8], envs[8:]
        settings = topics.settings()
        worker = await Worker.start(settings, tmp_path, "replayer")
        await topics.produce("envelope_topic", *(e.canonical() for e in before))
        await topics.consume_until("divergence_topic", distinct_at_least(len(before)), timeout_s=45)

        await asyncio.to_thread(private.stop)
        await topics.produce("envelope_topic", *(e.canonical() for e in during))
        deadline = time.monotonic() + 30
        while "will re-read" not in worker.log_tail():  # the worker met the outage
            assert worker.alive, worker.log_tail()
            assert time.monotonic() < deadline, f"the worker never retried: {worker.log_tail()}"
            await asyncio.sleep(0.2)
        await asyncio.sleep(2)  # and keeps retrying
        while_down = await topics.consume_until("divergence_topic", distinct_at_least(len(before)), timeout_s=5)
        assert sorted(results_by_request(events(while_down))) == sorted(e.request_id for e in before)
        assert worker.alive, worker.log_tail()
        await asyncio.to_thread(private.start)  # same ports, same data dir

        records = await topics.consume_until("divergence_topic", distinct_at_least(len(envs)), timeout_s=60)
        assert_each_replayed_once(envs, records, EnvelopeStore.from_settings(settings))
        assert Counter(worker.counted()) == Counter(e.request_id for e in envs)  # each counted once
        assert worker.alive, worker.log_tail()  # it resumed by itself
        assert await worker.terminate() == 0, worker.log_tail()  # and stops cleanly
    finally:
        if worker is not None:
            await worker.kill()
        await asyncio.to_thread(private.stop)
