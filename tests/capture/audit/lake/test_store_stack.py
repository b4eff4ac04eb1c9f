"""The audit lake on the real stack: the archiver consumes envelopes and divergence events from Tansu, writes
Hive-partitioned Parquet to SeaweedFS; DuckDB answers over it; compaction merges and dedupes; the request-id
index is rebuilt from the lake."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import run_query
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.cli.root import build_app
from replayer.errors import EnvelopeNotFoundError, StoreError
from replayer.store import EnvelopeStore
from schemas import DivergenceEvent, Envelope, FirstDivergence, StepCandidates, WorkflowRef
from schemas.layout import envelope_key, index_body, request_index_key, workflow_index_key
from tests.capture.audit.conftest import AuditStack, eventually
from tests.capture.audit.lake.test_shadow import CANDIDATE, RT_F32, shadow_of
from tests.capture.audit.support import access_records, operator_keys
from tests.factories import envelope, runtime

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]

D1 = datetime(2026, 7, 14, 9, 0, tzinfo=UTC)
D2 = D1 + timedelta(days=1)
RT_A = runtime()
RT_B = runtime(dtype="float32")
DIVERGENCE_RATE = """
    SELECT e.date AS day, e.runtime_sha256, count(*) AS replays,
           avg(CASE WHEN d.verdict IN ('bitwise', 'token') THEN 0 ELSE 1 END) AS divergence_rate
    FROM divergences d JOIN envelopes e USING (envelope_id) GROUP BY ALL ORDER BY day, replays DESC, divergence_rate
"""
TOP_POSITIONS = """
    SELECT e.model, d.first_divergence_position AS position, count(*) AS n
    FROM divergences d JOIN envelopes e USING (envelope_id)
    WHERE d.first_divergence_position IS NOT NULL GROUP BY ALL ORDER BY e.model, n DESC, position
"""
# (request, capture day, runtime, model, verdict, first divergence position)
CASES = [
    ("r0", D1, RT_A, "m-a", "bitwise", None),
    ("r1", D1, RT_A, "m-a", "diverged", 3),
    ("r2", D1, RT_B, "m-b", "diverged", 3),
    ("r3", D1, RT_B, "m-b", "diverged", 5),
    ("r4", D2, RT_A, "m-a", "token", None),
    ("r5", D2, RT_A, "m-b", "diverged", 3),
    ("r6", D2, RT_B, "m-b", "numeric", 7),
]


def event_for(env: Envelope, verdict: str, position: int | None) -> DivergenceEvent:
    lane = runtime(max_num_seqs=1, prefix_caching=False)
    first = None
    if position is not None:
        first = FirstDivergence(position=position, at=StepCandidates(position=position), near_tie=position == 3)
    return DivergenceEvent(
        request_id=env.request_id,
        envelope_id=env.envelope_id(),
        lane="vllm",
        lane_fingerprint=lane,
        lane_fingerprint_sha256=lane.sha256(),
        verdict=verdict,  # type: ignore[arg-type]
        levels_held=("bitwise", "token", "numeric") if verdict == "bitwise" else (),
        target_level="token",
        target_met=verdict in ("bitwise", "token"),
        first_divergence=first,
        token_match_rate=1.0 if position is None else 0.5,
        recorded_length=3,
        replayed_length=3,
        length_diff=0,
        cause_hint="identical" if position is None else "late_fork_numeric_drift",
        tenant=env.tenant,
        replayed_at=datetime.now(UTC),
        replay_ms=12.5,
    )


async def archive(a: AuditStack, expected_rows: int, consumed: int = 0, **overrides: Any) -> Archiver:
    """Run the real archiver (consumer group) until `expected_rows` rows are in S3 (and at least `consumed`
    messages were read), then stop it."""
    archiver = Archiver(a.lake_settings(**overrides), a.lake())
    stop = asyncio.Event()
    task = asyncio.create_task(archiver.run(stop))
    try:
        stats = archiver.stats
        await eventually(
            lambda: (stats.rows_written >= expected_rows and stats.consumed >= consumed) or task.done(), 60, "archiving"
        )
    finally:
        stop.set()
        await task
    return archiver


async def test_archiver_writes_parquet_and_duckdb_answers_the_audit_questions(audit_stack: AuditStack) -> None:
    a = audit_stack
    tenant = f"acme-{a.suffix}"
    envs = [
        envelope(request_id=f"{rid}-{a.suffix}", captured_at=at, runtime=rt, model=model, tenant=tenant)
        for rid, at, rt, model, _v, _p in CASES
    ]
    events = [event_for(env, v, p) for env, (_r, _a, _rt, _m, v, p) in zip(envs, CASES, strict=True)]
    shadow = shadow_of(envs[0])  # the candidate's answer to r0: same request id, a float32 runtime
    await a.produce(a.envelope_topic, [e.canonical() for e in envs] + [envs[2].canonical(), b"not json"])
    await a.produce(a.envelope_topic, [shadow.canonical()])
    await a.produce(a.divergence_topic, [e.model_dump_json().encode() for e in events])
    archiver = await archive(a, 15, consumed=17)
    assert archiver.stats.rows_written == 15  # the redelivered envelope inside the same flush: written once
    assert archiver.stats.skipped == 1
    # at-least-once across flushes: an envelope and an event delivered again later. The group resumes after the
    # committed offsets (only what was written was committed), so it reads exactly these two.
    await a.produce(a.envelope_topic, [envs[2].canonical()])
    await a.produce(a.divergence_topic, [events[1].model_dump_json().encode()])
    again = await archive(a, 2)
    assert again.stats.consumed == 2

    lake = a.lake()
    parts = lake.partitions("envelopes")
    assert [(p.day, p.tenant) for p in parts] == [("2026-07-14", tenant), ("2026-07-15", tenant)]
    assert all(
        p.startswith(f"{a.bucket}/{a.prefix}/envelopes/date=2026-07-14/tenant={tenant}/part-") for p in parts[0].paths
    )
    files = [pq.read_table(p, filesystem=lake.fs) for p in parts[0].paths]
    assert sum(t.num_rows for t in files) == 6  # r0..r3, r0's shadow, and the later copy of r2 in a file of its own
    marked = [(r["request_id"], r["shadow_candidate"]) for t in files for r in t.to_pylist() if r["shadow"]]
    assert marked == [(envs[0].request_id, CANDIDATE)]
    assert len(files) >= 2
    assert all(len(set(t["envelope_id"].to_pylist())) == t.num_rows for t in files)  # each file duplicate-free

    rate = run_query(lake, DIVERGENCE_RATE)
    assert rate.rows == [
        ("2026-07-14", RT_A.sha256(), 2, 0.5),
        ("2026-07-14", RT_B.sha256(), 2, 1.0),
        ("2026-07-15", RT_A.sha256(), 2, 0.5),
        ("2026-07-15", RT_B.sha256(), 1, 1.0),
    ]
    top = run_query(lake, TOP_POSITIONS)
    assert top.rows == [("m-a", 3, 1), ("m-b", 3, 2), ("m-b", 5, 1), ("m-b", 7, 1)]
    counts = run_query(lake, "SELECT (SELECT count(*) FROM envelopes_raw), (SELECT count(*) FROM envelopes), "
                             "(SELECT count(*) FROM divergences_raw), (SELECT count(*) FROM divergences)")  # fmt: skip
    assert counts.rows == [(9, 7, 8, 7)]  # the shadow is in the files, not in the production view
    pairs = run_query(lake, "SELECT request_id, paired, production_envelope_id, shadow_envelope_id, "
                            "token_identical, candidate_runtime_sha256 FROM shadow_pairs")  # fmt: skip
    assert pairs.rows == [
        (envs[0].request_id, True, envs[0].envelope_id(), shadow.envelope_id(), True, RT_F32.sha256())
    ]
    replays = run_query(lake, f"SELECT s3_key FROM replays WHERE request_id = 'r1-{a.suffix}'")
    assert replays.rows == [(f"replays/date=2026-07-14/{envs[1].envelope_id()}/{events[1].result_id()}.json",)]

    # the CLI: same numbers, as JSON
    app = build_app()
    env = {
        "REPROLANE_ARCHIVER_S3_ENDPOINT": a.info.s3_endpoint,
        "REPROLANE_ARCHIVER_S3_ACCESS_KEY": a.info.s3_access_key,
        "REPROLANE_ARCHIVER_S3_SECRET_KEY": a.info.s3_secret_key,
        "REPROLANE_ARCHIVER_LAKE_BUCKET": a.bucket,
        "REPROLANE_ARCHIVER_LAKE_PREFIX": a.prefix,
    }
    result = CliRunner().invoke(app, ["audit", "query", TOP_POSITIONS, "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[1] == {"model": "m-b", "position": 3, "n": 2}
    sql = "SELECT request_id, model, output_len FROM envelopes ORDER BY 1"
    table = CliRunner().invoke(
        app, ["audit", "query", sql, "--day", "2026-07-14"], env=env
    )  # partitions of that day only
    assert table.exit_code == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["request_id", "model", "output_len"]
    assert lines[2].split() == [f"r0-{a.suffix}", "m-a", "3"]
    assert lines[-1] == "(4 rows)"
    bad = CliRunner().invoke(app, ["audit", "query", "SELECT nope FROM envelopes"], env=env)
    assert bad.exit_code == 2
    assert bad.stderr.startswith("reprolane: error: query: Binder Error")


async def test_compaction_merges_small_files_and_drops_duplicates(audit_stack: AuditStack) -> None:
    a = audit_stack
    tenant = f"acme-{a.suffix}"
    envs = [envelope(request_id=f"c{i}-{a.suffix}", captured_at=D1, tenant=tenant) for i in range(5)]
    for round_ in range(3):  # three archiver runs: three files, the second and third full of duplicates
        await a.produce(a.envelope_topic, [e.canonical() for e in envs])
        await archive(a, 5, group_id=f"archiver-{a.suffix}-{round_}" if round_ else f"archiver-{a.suffix}")
    lake = a.lake()
    [part] = lake.partitions("envelopes")
    assert len(part.paths) >= 3
    before = run_query(lake, "SELECT count(*) FROM envelopes_raw").rows[0][0]
    assert before >= 15

    report = lake.compact("envelopes")
    assert (report.partitions, report.files_read, report.files_written) == (1, len(part.paths), 1)
    assert (report.rows_in, report.rows_out) == (before, 5)
    [after] = lake.partitions("envelopes")
    assert len(after.paths) == 1
    assert not set(after.paths) & set(part.paths)
    assert run_query(lake, "SELECT count(*), count(DISTINCT envelope_id) FROM envelopes_raw").rows == [(5, 5)]
    assert lake.compact("envelopes").partitions == 0  # nothing left to merge


async def test_rebuild_index_restores_lost_entries_and_never_replaces_a_valid_one(
    audit_stack: AuditStack, tmp_path: Path
) -> None:
    a = audit_stack
    now = datetime.now(UTC).replace(microsecond=0)
    day, tenant = now.strftime("%Y-%m-%d"), f"t-{a.suffix}"
    workflow = WorkflowRef(workflow_id=f"wf-{a.suffix}", step=4)
    envs = [
        envelope(request_id=f"ix{i}-{a.suffix}", captured_at=now, tenant=tenant, workflow=workflow if i else None)
        for i in range(3)
    ]
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9", spool_dir=tmp_path / "spool", kafka_bootstrap=a.info.kafka_bootstrap,
        s3_endpoint=a.info.s3_endpoint, s3_access_key=a.info.s3_access_key, s3_secret_key=a.info.s3_secret_key,
        s3_bucket=a.info.audit_bucket,
    )  # fmt: skip
    spool = Spool(settings.spool_dir, max_bytes=1 << 24, group_commit_ms=0)
    await spool.open()
    for env in envs:
        await spool.append(env)
    publisher = Publisher(spool, settings, sinks=[KafkaSink(settings, topic=a.envelope_topic), S3Sink(settings)])
    await publisher.start()
    await eventually(lambda: spool.depth == 0, 30, "publish")
    await publisher.stop()
    await spool.close()
    await archive(a, 3)

    s3, bucket = a.client(), a.info.audit_bucket
    store = EnvelopeStore(s3, bucket)
    step_key = [workflow_index_key(workflow.workflow_id, 4, e.request_id) for e in envs]
    lost = [request_index_key(envs[0].request_id), request_index_key(envs[1].request_id), step_key[1]]
    originals = {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in lost}
    for key in lost:
        s3.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(EnvelopeNotFoundError):
        store.get_by_request_id(envs[0].request_id)

    # envs[2]'s request-id entry now points at envs[0]'s record (invalid: another request); its workflow step
    # entry points at envs[1], which is valid (the same tenant and step): a rebuild must keep it
    def body_of(env: Envelope) -> bytes:
        return index_body(env.envelope_id(), envelope_key(env.envelope_id(), tenant, now), tenant, now)

    s3.put_object(Bucket=bucket, Key=request_index_key(envs[2].request_id), Body=body_of(envs[0]))
    s3.put_object(Bucket=bucket, Key=step_key[2], Body=body_of(envs[1]))

    ops = operator_keys(
        tmp_path / "ops", keeper=(("retention-admin",), None), holder=(("hold-admin",), None),
        other=(("retention-admin",), f"other-{a.suffix}"),
    )  # fmt: skip
    env = {
        **ops.env(),
        "REPROLANE_ARCHIVER_S3_ENDPOINT": a.info.s3_endpoint,
        "REPROLANE_ARCHIVER_S3_ACCESS_KEY": a.info.s3_access_key,
        "REPROLANE_ARCHIVER_S3_SECRET_KEY": a.info.s3_secret_key,
        "REPROLANE_ARCHIVER_S3_BUCKET": bucket,
        "REPROLANE_ARCHIVER_LAKE_BUCKET": a.bucket,
        "REPROLANE_ARCHIVER_LAKE_PREFIX": a.prefix,
    }
    target, started = f"index of {day}", datetime.now(UTC)

    def rebuild(*args: str) -> Any:
        return CliRunner().invoke(build_app(), ["audit", "lake", "rebuild-index", "--day", day, *args], env=env)

    for refused, why in (
        (rebuild(), "no operator key"),
        (rebuild("--operator-key-file", ops.key_file("holder")), "lacks the 'retention-admin' role"),
        (rebuild("--operator-key-file", ops.key_file("other"), "--tenant", tenant), "is scoped to tenant"),
    ):
        assert (refused.exit_code, refused.stderr.count("\n")) == (2, 1), refused.output
        assert refused.stderr.startswith("reprolane: error: lake.rebuild-index refused: ")
        assert why in refused.stderr
    with pytest.raises(EnvelopeNotFoundError):
        store.get_by_request_id(envs[0].request_id)  # refused: nothing was written

    done = rebuild("--operator-key-file", ops.key_file("keeper"))
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[0].endswith(
        ": 3 written, 0 repaired, 0 kept, 1 kept pointing elsewhere, 1 invalid left, 0 lake rows skipped"
    )
    for key, body in originals.items():
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body  # byte for byte
    assert store.get_by_request_id(envs[0].request_id) == envs[0]
    with pytest.raises(StoreError, match="does not match"):
        store.get_by_request_id(envs[2].request_id)  # left invalid without --overwrite, and said so
    assert f"invalid: {request_index_key(envs[2].request_id)}" in done.stdout

    done = rebuild("--operator-key-file", ops.key_file("keeper"), "--overwrite")
    assert done.exit_code == 0, done.output
    assert ": 0 written, 1 repaired, 3 kept, 1 kept pointing elsewhere, 0 invalid left" in done.stdout
    assert store.get_by_request_id(envs[2].request_id) == envs[2]  # repaired
    assert s3.get_object(Bucket=bucket, Key=step_key[2])["Body"].read() == body_of(envs[1])  # never clobbered
    assert f"kept_other: {step_key[2]} -> " in done.stdout

    decisions = [(r.actor_key_id, r.result, r.role) for r in access_records(s3, bucket, target, started)]
    assert decisions == [
        (None, "refused", "retention-admin"),
        ("holder", "refused", "retention-admin"),
        ("other", "refused", "retention-admin"),
        ("keeper", "allowed", "retention-admin"),
        ("keeper", "allowed", "retention-admin"),
    ]
