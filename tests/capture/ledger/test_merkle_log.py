"""The Merkle log: the writer, its append races, reading it back, and its place in the publisher (moto S3; the
real-stack tests are in tests/capture/audit/*_stack.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from capture.errors import SinkError
from capture.ledger.merkle_log import MerkleLogWriter, append_leaves, log_size, read_leaves
from capture.ledger.store import LedgerStore
from capture.publishing.outgoing import Outgoing
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool, SpoolEntry
from schemas.layout import leaves_key
from schemas.merkle import LeafEntry, encode_leaf_batch
from tests.factories import FIXED_TIME, envelope
from tests.moto_s3 import capture_settings, moto_client, moto_server

DAY = FIXED_TIME.strftime("%Y-%m-%d")


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"log-{uuid.uuid4().hex[:12]}"
    moto_client(moto_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def store(moto_endpoint: str, bucket: str) -> LedgerStore:
    return LedgerStore(moto_client(moto_endpoint), bucket)


@pytest.fixture
def settings(moto_endpoint: str, bucket: str, tmp_path: Path) -> CaptureSettings:
    return capture_settings(moto_endpoint, bucket, tmp_path / "spool", retention_days=0, audit_log=True)


@pytest.fixture
async def spool(settings: CaptureSettings) -> AsyncIterator[Spool]:
    s = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes, group_commit_ms=0)
    await s.open()
    yield s
    await s.close()


def outgoing(seq: int, **overrides: Any) -> Outgoing:
    return Outgoing.from_entry(SpoolEntry(seq, envelope(**overrides).canonical()))


class Recorder:
    """A sink that records batches and, while `fail` is set, refuses them."""

    def __init__(self, name: str, events: list[str]) -> None:
        self.name = name
        self.events = events
        self.fail = False
        self.batches: list[list[str]] = []

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        self.events.append(self.name)
        if self.fail:
            raise SinkError(f"{self.name}: down (fake)")
        self.batches.append([o.envelope_id for o in batch])

    async def close(self) -> None:
        pass


async def wait_for(condition: Any, within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_then_sinks_run_after_every_sink_and_before_the_ack(spool: Spool, settings: CaptureSettings) -> None:
    events: list[str] = []
    kafka, s3, log = Recorder("kafka", events), Recorder("s3", events), Recorder("audit-log", events)
    log.fail = True
    envs = [envelope(request_id=f"req-then-{i}") for i in range(3)]
    for env in envs:
        await spool.append(env)
    publisher = Publisher(spool, settings, sinks=[kafka, s3], then=[log], backoff_initial_s=0.01, backoff_max_s=0.02)
    await publisher.start()
    try:
        await wait_for(lambda: events.count("audit-log") >= 3)
        assert spool.depth == 3  # the log refused: nothing is acked, the batch stays pending
        assert events[:3] == ["kafka", "s3", "audit-log"]  # the log only after both sinks confirmed
        assert events.count("kafka") == 1  # confirmed sinks are not asked again while the log retries
        log.fail = False
        await wait_for(lambda: spool.depth == 0)
    finally:
        await publisher.stop()
    assert log.batches == [[e.envelope_id() for e in envs]]


def test_the_audit_log_is_a_then_sink_only_when_enabled(settings: CaptureSettings) -> None:
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    assert [s.name for s in Publisher(spool, settings).then] == ["audit-log"]
    assert Publisher(spool, settings.model_copy(update={"audit_log": False})).then == []


async def test_publisher_appends_each_stored_batch_in_order(
    spool: Spool, settings: CaptureSettings, store: LedgerStore
) -> None:
    envs = [envelope(request_id=f"req-log-{i}") for i in range(5)]
    for env in envs:
        await spool.append(env)
    await spool.append(envs[0])  # a duplicate in the spool: logged once by this writer
    publisher = Publisher(spool, settings, sinks=[S3Sink(settings)], batch_size=2)
    await publisher.start()
    try:
        await wait_for(lambda: spool.depth == 0)
    finally:
        await publisher.stop()
    leaves = read_leaves(store, DAY)
    assert leaves.ids == [e.envelope_id() for e in envs]
    assert leaves.problems == []
    assert [k for k, _ in store.list_keys(f"audit/log/day={DAY}/")] == [
        leaves_key(DAY, 0),
        leaves_key(DAY, 2),
        leaves_key(DAY, 4),
    ]


async def test_writer_groups_by_capture_day_and_skips_what_it_appended(store: LedgerStore) -> None:
    writer = MerkleLogWriter(store, None)
    other_day = FIXED_TIME + timedelta(days=1)
    a, b, c = outgoing(1, request_id="req-a"), outgoing(2, request_id="req-b", captured_at=other_day), outgoing(3)
    await writer.append([a, b])
    await writer.append([a, c])  # a again (a redelivered batch): skipped; c new
    await writer.close()
    assert read_leaves(store, DAY).ids == [a.envelope_id, c.envelope_id]
    assert read_leaves(store, other_day.strftime("%Y-%m-%d")).ids == [b.envelope_id]


def test_a_second_writer_racing_for_the_same_index_goes_after_the_winner(store: LedgerStore) -> None:
    ids = [envelope(request_id=f"req-race-{i}").envelope_id() for i in range(3)]
    entries = [LeafEntry(i, i) for i in ids]
    assert append_leaves(store, DAY, entries[:2], None) == 0
    # a writer that believes the log is empty: its conditional create of leaf 0 loses, it relists
    assert store.put_new(leaves_key(DAY, 0), encode_leaf_batch(entries[2:]), None) is False
    assert append_leaves(store, DAY, entries[2:], None) == 2
    assert log_size(store, DAY) == 3
    assert read_leaves(store, DAY).ids == ids


def test_gaps_and_torn_batches_are_problems(store: LedgerStore) -> None:
    store.put_new(leaves_key(DAY, 0), b"\x01" * 32)
    store.put_new(leaves_key(DAY, 5), b"\x02" * 40)
    problems = read_leaves(store, DAY).problems
    assert any("not a whole number of format-1 leaves of 32 bytes" in p for p in problems)
    assert any("starts at 5 but the log has 1" in p for p in problems)


def test_a_torn_format_2_batch_is_a_problem(store: LedgerStore) -> None:
    eid = envelope(request_id="req-torn").envelope_id()
    store.put_new(leaves_key(DAY, 0), encode_leaf_batch([LeafEntry(eid, eid)])[:-10])
    problems = read_leaves(store, DAY).problems
    assert any("not a whole number of format-2 leaves of 64 bytes" in p for p in problems)


def test_format_1_and_format_2_batches_follow_one_another(store: LedgerStore) -> None:
    old, new = (envelope(request_id=f"req-fmt-{i}").envelope_id() for i in range(2))
    store.put_new(leaves_key(DAY, 0), bytes.fromhex(old))  # a log written before format 2
    assert log_size(store, DAY) == 1
    assert append_leaves(store, DAY, [LeafEntry(new, "ab" * 32)], None) == 1
    assert log_size(store, DAY) == 2  # told from the listing's sizes alone
    leaves = read_leaves(store, DAY)
    assert leaves.problems == []
    assert leaves.entries == [LeafEntry(old), LeafEntry(new, "ab" * 32)]


async def test_the_writer_commits_to_each_payloads_bytes(store: LedgerStore) -> None:
    writer = MerkleLogWriter(store, None)
    a, b = outgoing(1, request_id="req-dig-a"), outgoing(2, request_id="req-dig-b")
    await writer.append([a, b])
    await writer.close()
    assert read_leaves(store, DAY).entries == [
        LeafEntry(a.envelope_id, a.envelope_id),
        LeafEntry(b.envelope_id, b.envelope_id),
    ]


async def test_the_seen_ids_are_bounded(store: LedgerStore) -> None:
    writer = MerkleLogWriter(store, None, seen_ids=4)
    items = [outgoing(i, request_id=f"req-cap-{i}") for i in range(10)]
    for item in items:
        await writer.append([item])
    assert len(writer._seen) == 4
    assert items[9].envelope_id in writer._seen
    assert items[0].envelope_id not in writer._seen
    await writer.append([items[9]])  # still remembered: not appended again
    await writer.close()
    assert read_leaves(store, DAY).ids == [i.envelope_id for i in items]


class FailOnce(LedgerStore):
    """A store whose first leaf append of `day` fails (the publisher then retries the whole batch)."""

    def __init__(self, inner: LedgerStore, day: str) -> None:
        super().__init__(inner.client, inner.bucket)
        self.day, self.failed = day, False

    def put_new(self, key: str, body: bytes, retain_until: Any = None) -> bool:
        if not self.failed and f"day={self.day}/" in key:
            self.failed = True
            from capture.ledger.errors import LedgerStoreError

            raise LedgerStoreError("down (fake)")
        return super().put_new(key, body, retain_until)


async def test_a_retried_batch_does_not_append_what_succeeded_again(store: LedgerStore) -> None:
    from capture.ledger.errors import LedgerError

    other_day = FIXED_TIME + timedelta(days=1)
    writer = MerkleLogWriter(FailOnce(store, other_day.strftime("%Y-%m-%d")), None)
    a, b = outgoing(1, request_id="req-retry-a"), outgoing(2, request_id="req-retry-b", captured_at=other_day)
    with pytest.raises(LedgerError):
        await writer.append([a, b])  # a's day appended, b's failed
    await writer.append([a, b])
    await writer.close()
    assert read_leaves(store, DAY).ids == [a.envelope_id]
    assert read_leaves(store, other_day.strftime("%Y-%m-%d")).ids == [b.envelope_id]


def sealed_outgoing(seq: int, **overrides: Any) -> Outgoing:
    from schemas.sealed import SEALED_SCHEMA_VERSION, new_data_key, seal_envelope

    env = envelope(**overrides)
    item = Outgoing.from_entry(SpoolEntry(seq, env.canonical()))
    sealed = seal_envelope(
        env.canonical(), request_id=env.request_id, tenant=env.tenant, captured_at=env.captured_at,
        workflow=env.workflow, key_id="k1", data_key=new_data_key(),
    )  # fmt: skip
    return item.with_payload(sealed.canonical(), SEALED_SCHEMA_VERSION)


def test_a_sealed_leaf_commits_to_the_sealing_that_is_stored(store: LedgerStore) -> None:
    from capture.ledger.errors import LedgerError
    from capture.ledger.merkle_log import stored_digest
    from schemas import sha256_hex

    first = sealed_outgoing(1, request_id="req-reseal")
    again = sealed_outgoing(1, request_id="req-reseal")  # republished after a crash: sealed afresh
    assert first.payload != again.payload
    assert first.envelope_id == again.envelope_id
    with pytest.raises(LedgerError, match="not stored"):
        stored_digest(store, first)
    store.put_new(first.object_key, first.payload)
    assert stored_digest(store, first) == sha256_hex(first.payload)
    assert stored_digest(store, again) == sha256_hex(first.payload)  # the stored, earlier sealing
    foreign = sealed_outgoing(2, request_id="req-foreign")
    store.put_new(foreign.object_key, b'{"schema_version": "reprolane.sealed/1", "junk": 1}')
    assert stored_digest(store, foreign) == sha256_hex(foreign.payload)  # not vouched for: verify will say so
