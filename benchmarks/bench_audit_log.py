"""Benchmark of the audit Merkle log: pure tree math, and the publisher / checkpoint / verify on a real stack.

    .venv/bin/python benchmarks/bench_audit_log.py [--leaves 100000] [--run-dir /work/devstack] [--envelopes 300]
    .venv/bin/python benchmarks/bench_audit_log.py --seen-ids 1000000

`--seen-ids N` (only that, no IO): the memory of the writer's seen-set after N appended ids, 256 per batch, as
RSS and tracemalloc before and after: the bounded `RecentIds` of `MerkleLogWriter` (its default capacity), and
for comparison what the unbounded per-day sets of hex ids it replaced held for the same N.

Part 1 (no IO): root, inclusion proof and consistency proof over `--leaves` leaves, and their verification.
Part 2 (needs a running stack, skipped without --run-dir): a fresh bucket without Object Lock; `--envelopes`
envelopes through Spool -> Publisher (S3 sink) with and without the audit log; then the checkpoint job,
`verify_request` of one envelope and `verify_range` of the day. Prints wall times.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
import time
import uuid
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from schemas.merkle import (
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    root_from_hashes,
    verify_consistency,
    verify_inclusion,
)


def timed(label: str, fn, *args):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    out = fn(*args)
    print(f"{label:<44} {1000 * (time.perf_counter() - started):9.1f} ms")
    return out


def pure(n: int) -> None:
    hashes = [leaf_hash(hashlib.sha256(str(i).encode()).digest()) for i in range(n)]
    root = timed(f"root of {n} leaves", root_from_hashes, hashes)
    proof = timed(f"inclusion proof, leaf {n // 3}", inclusion_proof, hashes, n // 3)
    timed("verify inclusion", verify_inclusion, hashes[n // 3], n // 3, n, proof, root)
    cproof = timed(f"consistency proof {n // 2} -> {n}", consistency_proof, hashes, n // 2)
    old = root_from_hashes(hashes[: n // 2])
    timed("verify consistency", verify_consistency, n // 2, n, old, root, cproof)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def seen_memory(n: int) -> None:
    import gc
    import tracemalloc

    from capture.ledger.merkle_log import SEEN_IDS, RecentIds

    def measure(label: str, add) -> None:  # type: ignore[no-untyped-def]
        gc.collect()
        rss, (before, _) = _rss_mib(), tracemalloc.get_traced_memory()
        started = time.perf_counter()
        batch: list[str] = []
        for eid in ids_again():
            batch.append(eid)
            if len(batch) == 256:
                add(batch)
                batch = []
        add(batch)
        elapsed = time.perf_counter() - started
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
        print(
            f"{label:<44} tracemalloc {(after - before) / 2**20:8.1f} MiB, RSS {rss:7.1f} -> {_rss_mib():7.1f} MiB, "
            f"{n / elapsed:9.0f} ids/s"
        )

    def ids_again():  # type: ignore[no-untyped-def]
        return (hashlib.sha256(i.to_bytes(8, "big")).hexdigest() for i in range(n))

    tracemalloc.start()
    recent = RecentIds(SEEN_IDS)
    measure(f"seen-set after {n} ids: RecentIds({SEEN_IDS})", recent.add_all)
    assert len(recent) == min(n, SEEN_IDS)
    del recent
    unbounded: set[str] = set()
    measure(f"seen-set after {n} ids: unbounded set (before)", unbounded.update)
    tracemalloc.stop()


async def publish(settings, envs, audit: bool) -> float:  # type: ignore[no-untyped-def]
    from capture.publishing.publisher import Publisher
    from capture.publishing.s3_sink import S3Sink
    from capture.spool import Spool

    settings = settings.model_copy(update={"audit_log": audit, "spool_dir": Path(tempfile.mkdtemp())})
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes, group_commit_ms=0)
    await spool.open()
    for env in envs:
        await spool.append(env)
    publisher = Publisher(spool, settings, sinks=[S3Sink(settings)], idle_poll_s=0.01)
    started = time.perf_counter()
    await publisher.start()
    while spool.depth:  # noqa: ASYNC110 (polling the depth is the measurement)
        await asyncio.sleep(0.01)
    elapsed = time.perf_counter() - started
    await publisher.stop()
    await spool.close()
    return elapsed


def stack(run_dir: Path, count: int) -> None:
    from capture.audit.checkpoint import write_checkpoint
    from capture.audit.signing_keys import public_of
    from capture.audit.store import AuditStore
    from capture.audit.verify import verify_range, verify_request
    from capture.settings import CaptureSettings
    from infra.stack.buckets import s3_client
    from infra.stack.state import StackInfo
    from tests.factories import envelope

    info = StackInfo.load(run_dir)
    client = s3_client(info.s3_endpoint, info.s3_credentials)
    bucket = f"bench-audit-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        auth_mode="off",
        s3_endpoint=info.s3_endpoint,
        s3_access_key=info.s3_access_key,
        s3_secret_key=info.s3_secret_key,
        s3_bucket=bucket,
        retention_days=0,
    )
    base = datetime.now(UTC)
    plain = [envelope(request_id=f"req-p{i}-{uuid.uuid4().hex[:6]}", captured_at=base) for i in range(count)]
    logged = [envelope(request_id=f"req-l{i}-{uuid.uuid4().hex[:6]}", captured_at=base) for i in range(count)]
    t_logged = asyncio.run(publish(settings, logged, audit=True))  # with the log first: any warm-up counts against it
    t_plain = asyncio.run(publish(settings, plain, audit=False))
    print(f"publish {count} envelopes, S3 only            {count / t_plain:9.1f} env/s")
    print(f"publish {count} envelopes, S3 + audit log     {count / t_logged:9.1f} env/s")
    store = AuditStore(client, bucket)
    private = hashlib.sha256(b"bench").digest()
    day = base.strftime("%Y-%m-%d")
    cp = timed(
        "checkpoint job (read leaves, sign, put)", partial(write_checkpoint, retention=None), store, day, private
    )
    print(f"  checkpoint size {cp.tree_size if cp else '?'}")
    verdict = timed(
        "verify_request (one envelope)", verify_request, store, logged[count // 2].request_id, public_of(private)
    )
    assert verdict.ok, verdict.findings
    verdict = timed(f"verify_range (day, {2 * count} objects)", verify_range, store, day, public_of(private))
    print(f"  range verdict ok={verdict.ok} findings={len(verdict.findings)} (the S3-only batch is 'inserted')")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaves", type=int, default=100_000)
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--envelopes", type=int, default=300)
    parser.add_argument("--seen-ids", type=int, help="measure only the writer's seen-set memory after this many ids")
    args = parser.parse_args()
    if args.seen_ids:
        seen_memory(args.seen_ids)
        return
    pure(args.leaves)
    if args.run_dir:
        stack(args.run_dir, args.envelopes)


if __name__ == "__main__":
    main()
