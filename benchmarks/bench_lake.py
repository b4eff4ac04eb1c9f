"""Benchmark of the audit lake on the running stack's Tansu + SeaweedFS (uuid prefixes in ``reprolane-lake``).

    REPROLANE_RUN_DIR=/work/devstack .venv/bin/python benchmarks/bench_lake.py [--envelopes 20000] [--rows 1000000]

1. Archiver throughput, end to end: N factory envelopes are produced to a fresh topic, then the real archiver
   (consumer group, decode, row build, Parquet write to S3, commit) is timed until every row is in S3.
2. Archiver write path alone: the same N envelopes through `Archiver.add` + `flush` (no Kafka).
3. Query latency over `--rows` synthetic divergence rows (and as many envelopes, 10 days x 4 tenants,
   written as Parquet to the lake): three queries, each run 3 times through `run_query` (listing the files,
   opening the Arrow datasets, the dedupe views, DuckDB), median and best wall time.

Each is measured for both lake kinds, side by side: the Parquet lake (``bench-<uuid>`` prefixes) and the Iceberg
lake (namespace ``bench<uuid>`` in the stack's REST catalog; the archiver's commits anti-join against the table,
`capture.audit.lake.iceberg`). A stack whose SeaweedFS serves no catalog (recorded before the catalog joined it)
is not touched: a private stack (SeaweedFS with the catalog, in-memory Tansu) in a temporary directory is started
for the run and taken down after, and both lakes are measured on it.

The Parquet prefixes are deleted at the end; the topics and the Iceberg namespace are left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.iceberg import IcebergLake
from capture.audit.lake.query import run_query
from capture.audit.lake.schema import DIVERGENCES, ENVELOPES
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from infra import paths
from infra.stack.buckets import s3_client
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo
from schemas import sha256_hex
from schemas.layout import HEADER_ENVELOPE_ID, LAKE_BUCKET
from tests.factories import envelope, runtime

QUERIES = {
    "count by verdict": "SELECT verdict, count(*) FROM divergences GROUP BY ALL ORDER BY ALL",
    "divergence rate by runtime per day": """
        SELECT e.date, e.runtime_sha256, count(*) AS replays,
               avg(CASE WHEN d.verdict IN ('bitwise', 'token') THEN 0 ELSE 1 END) AS rate
        FROM divergences d JOIN envelopes e USING (envelope_id) GROUP BY ALL ORDER BY ALL""",
    "top first-divergence positions by model": """
        SELECT e.model, d.first_divergence_position AS pos, count(*) AS n
        FROM divergences d JOIN envelopes e USING (envelope_id)
        WHERE d.first_divergence_position IS NOT NULL GROUP BY ALL ORDER BY n DESC LIMIT 10""",
}


async def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    """Like `capture.publishing.kafka_sink.KafkaSink`: the envelope id header rides along (the archiver then skips
    re-hashing)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, v, headers=[(HEADER_ENVELOPE_ID, sha256_hex(v).encode())]) for v in values
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def archive_from_kafka(settings: LakeSettings, lake: Lake | IcebergLake, expected: int) -> float:
    archiver = Archiver(settings, lake)
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(archiver.run(stop))
    while archiver.stats.rows_written < expected and not task.done():  # noqa: ASYNC110 (polling a counter)
        await asyncio.sleep(0.05)
    elapsed = time.perf_counter() - started
    stop.set()
    await task
    return elapsed


def synthetic(n: int, days: int = 10, tenants: int = 4) -> tuple[pa.Table, pa.Table, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = pa.array([f"{i:064x}" for i in range(n)])
    now = datetime(2026, 7, 1, tzinfo=UTC)
    day_of = rng.integers(0, days, n)
    tenant_of = rng.integers(0, tenants, n)
    ts = pa.array([now + timedelta(days=int(d)) for d in day_of], type=pa.timestamp("us", tz="UTC"))
    rts = [runtime(dtype=d).sha256() for d in ("bfloat16", "float32", "float16")]
    env_cols = {
        "request_id": pa.array([f"req-{i}" for i in range(n)]),
        "envelope_id": ids,
        "captured_at": ts,
        "model": pa.array(np.array(["m-a", "m-b", "m-c"])[rng.integers(0, 3, n)]),
        "runtime_sha256": pa.array(np.array(rts)[rng.integers(0, 3, n)]),
        "archived_at": ts,
    }
    envs = pa.table({f.name: env_cols.get(f.name, pa.nulls(n, f.type)) for f in ENVELOPES}, schema=ENVELOPES)
    verdicts = np.array(["bitwise", "token", "numeric", "diverged"])[rng.choice(4, n, p=[0.6, 0.2, 0.1, 0.1])]
    position = rng.integers(0, 64, n)
    has_pos = np.isin(verdicts, ["numeric", "diverged"])
    div_cols = {
        "result_id": pa.array([f"{i:064x}"[::-1] for i in range(n)]),
        "request_id": env_cols["request_id"],
        "envelope_id": ids,
        "lane": pa.array(["vllm"] * n),
        "verdict": pa.array(verdicts),
        "target_met": pa.array(~has_pos),
        "first_divergence_position": pa.array(position, mask=~has_pos),
        "token_match_rate": pa.array(rng.random(n)),
        "replayed_at": ts,
        "archived_at": ts,
    }
    divs = pa.table({f.name: div_cols.get(f.name, pa.nulls(n, f.type)) for f in DIVERGENCES}, schema=DIVERGENCES)
    return envs, divs, day_of, tenant_of


def write_partitions(lake: Lake, name: str, table: pa.Table, day_of: np.ndarray, tenant_of: np.ndarray) -> int:
    files = 0
    for d in np.unique(day_of):
        for t in np.unique(tenant_of):
            mask = pa.array((day_of == d) & (tenant_of == t))
            lake.write(name, f"2026-07-{1 + int(d):02d}", f"tenant-{int(t)}", table.filter(mask))
            files += 1
    return files


def write_iceberg(lake: IcebergLake, envs: pa.Table, divs: pa.Table, tenant_of: np.ndarray) -> None:
    """Bulk load of the synthetic tables (fresh tables: a plain append, not the archiver's anti-join)."""
    tenants = pa.array([f"tenant-{int(t)}" for t in tenant_of])
    envs, divs = envs.append_column("tenant", tenants), divs.append_column("tenant", tenants)
    lake.table("envelopes").append(envs)
    lake.table("divergences").append(divs)
    lake.table("replays").append(divs.select(lake.table("replays").schema().as_arrow().names))


@contextlib.contextmanager
def catalog_stack(run_dir: Path | None) -> Iterator[StackInfo]:
    info = StackInfo.load(paths.run_dir(run_dir))
    if info.iceberg_url:
        yield info
        return
    with tempfile.TemporaryDirectory(prefix="bench-lake-") as tmp:
        private = LocalStack(Path(tmp), kafka_storage="memory")
        print("the stack serves no Iceberg catalog: both lakes measured on a private stack", file=sys.stderr)
        try:
            yield private.up(["s3", "kafka"])
        finally:
            private.down()


def timed_queries(kind: str, lake: Lake | IcebergLake, rows: int) -> None:
    for name, sql in QUERIES.items():
        times = []
        for _ in range(3):
            started = time.perf_counter()
            result = run_query(lake, sql)
            times.append(time.perf_counter() - started)
        print(f"{kind}: query '{name}' over {rows:,} rows: median {statistics.median(times):.3f} s, "
              f"best {min(times):.3f} s ({len(result.rows)} result rows)")  # fmt: skip


def write_path(kind: str, settings: LakeSettings, lake: Lake | IcebergLake, values: list[bytes]) -> None:
    archiver = Archiver(settings, lake)
    started = time.perf_counter()
    for v in values:
        archiver.add(settings.envelope_topic, v, claimed_id=sha256_hex(v).encode())
    built = time.perf_counter() - started
    asyncio.run(archiver.flush())
    total = time.perf_counter() - started
    print(f"{kind}: archiver write path (decode + rows + write): {len(values) / total:,.0f} rows/s "
          f"(decode+rows {built:.2f} s, write {total - built:.2f} s)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envelopes", type=int, default=20_000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args()
    with catalog_stack(args.run_dir) as info:
        run(info, args.envelopes, args.rows)


def run(info: StackInfo, n: int, rows: int) -> None:
    suffix = uuid.uuid4().hex[:8]
    bucket = LAKE_BUCKET  # one shared bucket: SeaweedFS gives each bucket its own volumes
    client = s3_client(info.s3_endpoint, info.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=bucket)
    parquet = LakeSettings(
        kafka_bootstrap=info.kafka_bootstrap, lake_prefix=f"bench-{suffix}",
        envelope_topic=f"bench-env-{suffix}", divergence_topic=f"bench-div-{suffix}",
        group_id=f"bench-{suffix}", session_timeout_ms=2000, heartbeat_interval_ms=500,
        flush_rows=10_000, flush_seconds=5, s3_endpoint=info.s3_endpoint,
        s3_access_key=info.s3_access_key, s3_secret_key=info.s3_secret_key, lake_bucket=bucket,
        iceberg_uri=info.iceberg_url, iceberg_namespace=f"bench{suffix}",
    )  # fmt: skip
    iceberg = parquet.model_copy(update={"lake_kind": "iceberg", "group_id": f"bench-ice-{suffix}"})
    ice_direct = iceberg.model_copy(update={"iceberg_namespace": f"bench{suffix}direct"})
    ice_query = iceberg.model_copy(update={"iceberg_namespace": f"bench{suffix}query"})
    try:
        base = datetime.now(UTC)
        values = [envelope(request_id=f"b{i}", captured_at=base, tenant=f"t{i % 4}").canonical() for i in range(n)]
        print(f"envelopes: {n} x {statistics.mean(len(v) for v in values):.0f} bytes")
        asyncio.run(produce(info.kafka_bootstrap, parquet.envelope_topic, values))
        for kind, settings in (("parquet", parquet), ("iceberg", iceberg)):  # one topic, two consumer groups
            lake: Lake | IcebergLake = (
                Lake.from_settings(settings) if kind == "parquet" else IcebergLake.from_settings(settings)
            )
            elapsed = asyncio.run(archive_from_kafka(settings, lake, n))
            print(f"{kind}: archiver, Kafka -> lake (end to end, incl. group join): {n / elapsed:,.0f} rows/s "
                  f"({elapsed:.2f} s)")  # fmt: skip
        direct = Lake.from_settings(parquet.model_copy(update={"lake_prefix": f"bench-{suffix}-direct"}))
        write_path("parquet", parquet, direct, values)
        write_path("iceberg", ice_direct, IcebergLake.from_settings(ice_direct), values)

        started = time.perf_counter()
        envs, divs, day_of, tenant_of = synthetic(rows)
        gen = time.perf_counter() - started
        bench = Lake.from_settings(parquet.model_copy(update={"lake_prefix": f"bench-{suffix}-query"}))
        started = time.perf_counter()
        files = write_partitions(bench, "envelopes", envs, day_of, tenant_of)
        files += write_partitions(bench, "divergences", divs, day_of, tenant_of)
        wrote = time.perf_counter() - started
        print(f"synthetic: {rows:,} envelopes + {rows:,} divergences generated in {gen:.1f} s; parquet: written "
              f"as {files} files in {wrote:.1f} s ({2 * rows / wrote:,.0f} rows/s)")  # fmt: skip
        ice = IcebergLake.from_settings(ice_query)
        started = time.perf_counter()
        write_iceberg(ice, envs, divs, tenant_of)
        wrote = time.perf_counter() - started
        print(f"iceberg: synthetic tables appended in {wrote:.1f} s ({2 * rows / wrote:,.0f} rows/s)")
        timed_queries("parquet", bench, rows)
        timed_queries("iceberg", ice, rows)
    finally:
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=f"bench-{suffix}"):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=obj["Key"])


if __name__ == "__main__":
    main()
