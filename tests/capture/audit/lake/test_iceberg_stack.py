"""The Iceberg audit lake on the real stack (issue #20, item 2): SeaweedFS's Iceberg REST catalog, S3 data files,
Kafka consumer groups.

The catalog is the session stack's when it serves one (``StackInfo.iceberg_url``); a stack recorded before the
catalog joined it has it off, and then this module starts a PRIVATE stack (SeaweedFS with the catalog on free
loopback ports, in-memory Tansu) through `infra.stack.launcher.LocalStack`, and takes it down at the end.

- redelivered envelopes and events (the same ids in several flushes) are in the tables once; the query views work;
- two lakes committing overlapping batches at once: the catalog refuses one commit, the anti-join runs again,
  each id once;
- two ``reprolane serve archiver`` processes in one group, one SIGKILLed after a flush wrote and before it
  committed its offsets: the survivor re-reads what the victim wrote, and the table holds every envelope once
  (in the files, not only in a view: there is no deduplicating view over Iceberg);
- maintenance: compaction leaves one file per partition and the same rows; snapshot expiry spares the floor;
- a table created before the shadow columns existed gets them when the lake opens it; shadows are told apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.iceberg import ICEBERG_TABLES, TABLE_PROPERTIES, IcebergLake, _only_added, _spec
from capture.audit.lake.query import run_query
from capture.audit.lake.schema import ADDED_COLUMNS, envelope_row
from capture.audit.lake.settings import LakeSettings
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo
from tests.capture.audit.lake.test_archiver_faults_stack import (
    ArchiverProcess,
    create_topics,
    produce,
    until,
)
from tests.capture.audit.lake.test_shadow import CANDIDATE, shadow_of
from tests.capture.audit.lake.test_store_stack import event_for
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]


@pytest.fixture(scope="module")
def catalog_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    """A stack that serves the Iceberg catalog: the attached one if it does, else a private one (module doc)."""
    attached = os.environ.get("REPROLANE_TEST_RUN_DIR")
    if attached:
        info = LocalStack(Path(attached)).info()
        if info.iceberg_url:
            yield info
            return
    private = LocalStack(tmp_path_factory.mktemp("iceberg-stack"), kafka_storage="memory")
    try:
        yield private.up(["s3", "kafka"])
    finally:
        private.down()


class Ice:
    """This test's namespace, tenant and topics on the catalog stack."""

    def __init__(self, info: StackInfo) -> None:
        self.info = info
        self.suffix = uuid.uuid4().hex[:10]
        self.tenant = f"ice-{self.suffix}"

    def settings(self, **overrides: Any) -> LakeSettings:
        base: dict[str, Any] = {
            "kafka_bootstrap": self.info.kafka_bootstrap,
            "envelope_topic": f"env-{self.suffix}",
            "divergence_topic": f"div-{self.suffix}",
            "group_id": f"archiver-{self.suffix}",
            "session_timeout_ms": 3000,
            "heartbeat_interval_ms": 500,
            "flush_seconds": 1.0,
            "s3_endpoint": self.info.s3_endpoint,
            "s3_access_key": self.info.s3_access_key,
            "s3_secret_key": self.info.s3_secret_key,
            "s3_bucket": self.info.audit_bucket,
            "lake_kind": "iceberg",
            "iceberg_uri": self.info.iceberg_url,
            "iceberg_namespace": f"t{self.suffix}",
        }
        base.update(overrides)
        return LakeSettings(**base)

    def lake(self) -> IcebergLake:
        return IcebergLake.from_settings(self.settings())

    def counts(self, table: str = "envelopes", key: str = "envelope_id") -> tuple[int, int]:
        """(rows, distinct ids) of the table, through `reprolane audit query`'s connection."""
        sql = f"SELECT count(*), count(DISTINCT {key}) FROM {table}"
        row = run_query(self.lake(), sql).rows[0]
        return int(row[0]), int(row[1])


@pytest.fixture
def ice(catalog_stack: StackInfo) -> Ice:
    return Ice(catalog_stack)


def test_stack_info_names_the_catalog(catalog_stack: StackInfo) -> None:
    assert catalog_stack.iceberg_url
    assert catalog_stack.iceberg_url.startswith("http://127.0.0.1:")


async def test_redelivered_envelopes_and_events_are_in_the_tables_once(ice: Ice) -> None:
    envs = [envelope(request_id=f"r{i}-{ice.suffix}", tenant=ice.tenant) for i in range(6)]
    events = [event_for(e, "diverged", 2) for e in envs[:3]]
    archiver = Archiver(ice.settings(), ice.lake())
    for _round in range(2):  # the second round is Kafka delivering it all again, after a lost offset commit
        for e in envs:
            assert archiver.add(ice.settings().envelope_topic, e.canonical())
        for ev in events:
            assert archiver.add(ice.settings().divergence_topic, ev.model_dump_json().encode())
        await archiver.flush()
    assert archiver.stats.duplicates_dropped == len(envs) + 2 * len(events)  # divergences and replays
    assert ice.counts() == (6, 6)
    assert ice.counts("divergences", "result_id") == (3, 3)
    lake = ice.lake()
    rows = run_query(lake, "SELECT verdict, s3_key, replay_date FROM replays ORDER BY s3_key").rows
    assert len(rows) == 3
    assert all(r[0] == "diverged" and r[1].endswith(".json") for r in rows)
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    joined = run_query(lake, "SELECT count(*) FROM divergences d JOIN envelopes e USING (envelope_id)").rows
    assert joined == [(3,)]
    assert run_query(lake, "SELECT DISTINCT date, tenant FROM divergences", today).rows == [(today, ice.tenant)]
    spec = lake.table("envelopes").spec()
    assert [str(f.transform) for f in spec.fields] == ["day", "identity"]


def test_concurrent_commits_of_overlapping_batches_keep_each_id_once(ice: Ice) -> None:
    """Two lakes (two catalog clients, as two archivers have) append overlapping batches at the same time, many
    rounds: optimistic concurrency makes one of each pair retry, and its anti-join drops the other's rows."""
    schema = ICEBERG_TABLES["envelopes"][0]
    envs = [envelope(request_id=f"c{i}-{ice.suffix}", tenant=ice.tenant) for i in range(40)]
    now = datetime.now(UTC)
    rows = [{**envelope_row(e, now), "tenant": ice.tenant} for e in envs]
    ice.lake().table("envelopes")  # created once up front, so both race on appends, not on creation
    appended: list[int] = []
    errors: list[BaseException] = []

    def worker(lake: IcebergLake, start: int) -> None:
        try:
            for r in range(8):  # windows of 10 rows, overlapping the other worker's by half
                lo = (start + 5 * r) % 40
                batch = [rows[(lo + i) % 40] for i in range(10)]
                appended.append(lake.append_new("envelopes", pa.Table.from_pylist(batch, schema=schema)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(ice.lake(), s)) for s in (0, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    total, distinct = ice.counts()
    assert total == distinct == sum(appended) == 40


def test_a_commit_that_loses_the_race_runs_the_anti_join_again(ice: Ice) -> None:
    """Deterministic race: between our anti-join and our append, another writer commits half of our rows. The
    catalog refuses our commit (its base snapshot is stale); the retry's anti-join drops those rows."""
    schema = ICEBERG_TABLES["envelopes"][0]
    now = datetime.now(UTC)
    rows = [
        {**envelope_row(envelope(request_id=f"x{i}-{ice.suffix}", tenant=ice.tenant), now), "tenant": ice.tenant}
        for i in range(6)
    ]
    other = ice.lake()
    other.table("envelopes")

    class Interrupted(IcebergLake):
        def _existing(self, name: str, tbl: Any, batch: pa.Table) -> pa.Array:
            found = super()._existing(name, tbl, batch)
            if self.commit_retries == 0:  # the other archiver wins the first race
                assert other.append_new(name, pa.Table.from_pylist(rows[:3], schema=schema)) == 3
            return found

    ours = Interrupted(ice.lake().catalog, f"t{ice.suffix}")
    assert ours.append_new("envelopes", pa.Table.from_pylist(rows, schema=schema)) == 3
    assert ours.commit_retries == 1
    assert ice.counts() == (6, 6)


async def test_two_archivers_one_sigkilled_every_envelope_exactly_once(ice: Ice, tmp_path: Path) -> None:
    settings = ice.settings(flush_rows=50_000)
    await create_topics(ice.info.kafka_bootstrap, [settings.envelope_topic, settings.divergence_topic], 4)
    ice.lake().table("envelopes")

    first = [envelope(request_id=f"k{i}-{ice.suffix}", tenant=ice.tenant) for i in range(150)]
    second = [envelope(request_id=f"s{i}-{ice.suffix}", tenant=ice.tenant) for i in range(150)]
    total = len(first) + len(second)
    victim = await ArchiverProcess.start(settings, tmp_path, "victim", kill_after_flush=2)
    survivor = await ArchiverProcess.start(settings, tmp_path, "survivor")
    try:
        await asyncio.sleep(4)  # both join the group and split the four partitions
        await produce(ice.info.kafka_bootstrap, settings.envelope_topic, first)
        await until(lambda: victim.flushes() >= 1 and survivor.flushes() >= 1, 60, "both writing", victim, survivor)
        await produce(ice.info.kafka_bootstrap, settings.envelope_topic, second, per_second=150)
        await asyncio.wait_for(victim.process.wait(), 60)
        assert victim.process.returncode == -signal.SIGKILL, victim.text()[-3000:]
        assert "test worker: SIGKILL after flush 2" in victim.text()
        await until(lambda: ice.counts()[1] >= total, 90, "every envelope in the table", survivor)
        await asyncio.sleep(3)  # the survivor re-reads what the victim wrote and never committed
        assert ice.counts() == (total, total)  # none lost, none twice: in the table itself
        assert "rows already in the lake (redelivered)" in survivor.text()  # the victim's rows came again
        assert await survivor.terminate() == 0
    finally:
        for w in (victim, survivor):
            with contextlib.suppress(ProcessLookupError, TimeoutError):
                await w.kill()
    assert ice.counts() == (total, total)


def test_compaction_and_snapshot_expiry_keep_every_row_and_the_floor(ice: Ice) -> None:
    schema = ICEBERG_TABLES["envelopes"][0]
    lake = ice.lake()
    now = datetime.now(UTC)
    for i in range(3):  # three commits: three files in today's partition
        e = envelope(request_id=f"m{i}-{ice.suffix}", tenant=ice.tenant)
        lake.append_new("envelopes", pa.Table.from_pylist([{**envelope_row(e, now), "tenant": ice.tenant}], schema))
    tbl = lake.table("envelopes")
    assert len(list(tbl.scan().plan_files())) == 3
    kept = lake.maintain("envelopes", retention_floor=timedelta(days=1), expire_before=datetime.now(UTC))
    assert (kept.partitions_compacted, kept.files_before, kept.files_after) == (1, 3, 1)
    assert kept.snapshots_expired == 0  # every snapshot is younger than the floor: time travel stays
    assert ice.counts() == (3, 3)
    snapshots = len(tbl.snapshots())
    gone = lake.maintain("envelopes", retention_floor=timedelta(0), expire_before=datetime.now(UTC))
    assert gone.partitions_compacted == 0
    assert gone.snapshots_expired == snapshots - 1
    assert ice.counts() == (3, 3)
    assert len(list(tbl.scan().plan_files())) == 1


async def test_a_table_from_before_the_shadow_columns_gets_them_and_shadows_are_told_apart(ice: Ice) -> None:
    """An envelopes table created with the schema of before the shadow columns (one row in it) is evolved when
    the lake opens it; its old row reads as production, a shadow lands with its marker, the views pair it."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.schema import assign_fresh_schema_ids

    arrow = ICEBERG_TABLES["envelopes"][0]
    before = pa.schema([f for f in arrow if f.name not in ADDED_COLUMNS])
    catalog = ice.lake().catalog
    catalog.create_namespace(ice.settings().iceberg_namespace)
    schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(before))
    spec = _spec(schema, "captured_at")
    ident = f"{ice.settings().iceberg_namespace}.envelopes"
    old_table = catalog.create_table(ident, schema=schema, partition_spec=spec, properties=TABLE_PROPERTIES)
    old = envelope(request_id=f"old-{ice.suffix}", tenant=ice.tenant, workflow=None)
    old_row = {**envelope_row(old, datetime.now(UTC)), "tenant": ice.tenant}
    old_table.append(pa.Table.from_pylist([{k: old_row[k] for k in before.names}], schema=before))

    prod = envelope(request_id=f"p-{ice.suffix}", tenant=ice.tenant, workflow=None)
    shadow = shadow_of(prod)
    lake = ice.lake()  # a new archiver process: it opens the old table
    archiver = Archiver(ice.settings(), lake)
    for env in (prod, shadow):
        assert archiver.add(ice.settings().envelope_topic, env.canonical())
    await archiver.flush()
    assert set(ADDED_COLUMNS) <= {f.name for f in lake.table("envelopes").schema().fields}
    lake = ice.lake()
    assert len(lake.table("envelopes").schemas()) == 2
    assert _only_added(lake.table("envelopes"))  # so the views read the data files lazily, old ones included
    rows = run_query(lake, "SELECT request_id, shadow, shadow_candidate FROM all_envelopes ORDER BY 1, 2").rows
    assert rows == [(old.request_id, None, None), (prod.request_id, False, None), (prod.request_id, True, CANDIDATE)]
    assert run_query(lake, "SELECT request_id FROM envelopes ORDER BY 1").rows == [
        (old.request_id,),
        (prod.request_id,),
    ]
    pairs = run_query(lake, "SELECT request_id, paired, production_envelope_id, shadow_envelope_id FROM shadow_pairs")
    assert pairs.rows == [(prod.request_id, True, prod.envelope_id(), shadow.envelope_id())]
    again = Archiver(ice.settings(), ice.lake())  # redelivered after the evolution: still once
    assert again.add(ice.settings().envelope_topic, shadow.canonical())
    await again.flush()
    assert ice.counts() == (2, 2)  # production rows only: the old one and prod
    assert ice.counts("shadows") == (1, 1)
    report = ice.lake().maintain("envelopes", retention_floor=timedelta(days=1))  # the old file and the new one
    assert (report.partitions_compacted, report.files_after) == (1, 1)
    after = run_query(ice.lake(), "SELECT request_id, shadow, shadow_candidate FROM all_envelopes ORDER BY 1, 2").rows
    assert after == rows
