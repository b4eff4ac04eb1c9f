"""The lake's pure parts on a local filesystem: rows, archiver buffering, views, dedupe, compaction, rendering."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import QueryError, render_csv, render_json, render_table, run_query
from capture.audit.lake.schema import ENVELOPES, envelope_row, sealed_row
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake, index_body
from capture.publishing.outgoing import Outgoing
from capture.spool import SpoolEntry
from schemas import CapturedError, Timings
from schemas.envelope_compact import encode_compact
from schemas.sealed import new_data_key, seal_envelope
from tests.factories import FIXED_TIME, envelope, runtime

SETTINGS = LakeSettings(flush_rows=3, flush_seconds=3600)


@pytest.fixture
def lake(tmp_path: Path) -> Lake:
    return Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")


def test_envelope_row_flattens_the_runtime_and_matches_the_schema() -> None:
    env = envelope(runtime=runtime(dtype="float32"))
    row = envelope_row(env, FIXED_TIME)
    assert set(row) == set(ENVELOPES.names)
    assert row["rt_dtype"] == "float32"
    assert row["runtime_sha256"] == env.runtime.sha256()
    assert (row["prompt_len"], row["output_len"], row["finish_reason"]) == (5, 3, "stop")
    assert row["s3_key"].endswith(f"{env.envelope_id()}.json")
    assert (row["workflow_id"], row["workflow_step"]) == ("claim-7781", 2)
    assert row["prompts"] == 1


def test_a_request_with_several_prompts_says_how_many() -> None:
    first = envelope()
    assert first.prompt is not None
    env = envelope(more_prompts=(first.prompt, first.prompt))
    assert envelope_row(env, FIXED_TIME)["prompts"] == 3


def test_error_envelope_row_names_the_error() -> None:
    timings = Timings(received_at=FIXED_TIME, upstream_ms=3.0)
    env = envelope(outcome=CapturedError(error_type="timeout", status_code=504, message="slow", timings=timings))
    row = envelope_row(env, FIXED_TIME)
    assert (row["outcome_kind"], row["error_type"], row["status_code"], row["output_len"]) == (
        "error",
        "timeout",
        504,
        None,
    )


def test_sealed_row_has_metadata_only() -> None:
    env = envelope()
    sealed = seal_envelope(
        env.canonical(), request_id=env.request_id, tenant=env.tenant, captured_at=env.captured_at,
        workflow=env.workflow, key_id="k1", data_key=new_data_key(),
    )  # fmt: skip
    row = sealed_row(sealed, FIXED_TIME)
    assert row["sealed"] is True
    assert row["envelope_id"] == env.envelope_id()
    filled = {k for k, v in row.items() if v is not None}
    assert filled == {"request_id", "envelope_id", "captured_at", "sealed", "key_id", "s3_key", "archived_at",
                      "workflow_id", "workflow_step"}  # fmt: skip


async def test_archiver_buffers_flushes_per_partition_and_skips_garbage(lake: Lake) -> None:
    archiver = Archiver(SETTINGS, lake)
    assert archiver.add(SETTINGS.envelope_topic, envelope(request_id="a").canonical())
    assert not archiver.add(SETTINGS.envelope_topic, b"{}")
    assert not archiver.add(SETTINGS.divergence_topic, envelope().canonical())  # an envelope on the event topic
    assert not archiver.due()
    assert archiver.add(SETTINGS.envelope_topic, envelope(request_id="b", tenant="other").canonical())
    assert archiver.add(SETTINGS.envelope_topic, envelope(request_id="c").canonical())
    assert archiver.due()
    paths = await archiver.flush()
    assert len(paths) == 2  # one file per (day, tenant)
    assert archiver.buffered == 0
    assert (archiver.stats.rows_written, archiver.stats.skipped) == (3, 2)
    rows = run_query(lake, "SELECT tenant, request_id FROM envelopes ORDER BY 2").rows
    assert rows == [("acme-insurance", "a"), ("other", "b"), ("acme-insurance", "c")]


async def test_a_redelivery_within_one_flush_is_written_once(lake: Lake) -> None:
    archiver = Archiver(SETTINGS, lake)
    for _ in range(2):
        archiver.add(SETTINGS.envelope_topic, envelope(request_id="a").canonical())
    assert archiver.buffered == 1
    await archiver.flush()
    assert run_query(lake, "SELECT count(*) FROM envelopes_raw").rows == [(1,)]


async def test_views_dedupe_and_compaction_merges(lake: Lake) -> None:
    archiver = Archiver(SETTINGS, lake)
    for _ in range(2):
        archiver.add(SETTINGS.envelope_topic, envelope(request_id="a").canonical())
        archiver.add(SETTINGS.envelope_topic, envelope(request_id="b").canonical())
        await archiver.flush()
    assert run_query(lake, "SELECT count(*) FROM envelopes_raw").rows == [(4,)]
    assert run_query(lake, "SELECT count(*) FROM envelopes").rows == [(2,)]
    report = lake.compact("envelopes", "2026-07-14")
    assert (report.files_read, report.files_written, report.rows_in, report.rows_out) == (2, 1, 4, 2)
    assert run_query(lake, "SELECT count(*) FROM envelopes_raw").rows == [(2,)]
    assert lake.compact("envelopes", "2026-07-15").partitions == 0


def test_empty_lake_queries_return_no_rows(lake: Lake) -> None:
    assert run_query(lake, "SELECT count(*) FROM divergences").rows == [(0,)]
    with pytest.raises(QueryError, match="nope"):
        run_query(lake, "SELECT nope FROM envelopes")


def test_index_body_is_the_capture_sinks_body() -> None:
    env = envelope(captured_at=datetime(2026, 7, 14, 9, 30, 0, 120000, tzinfo=UTC))
    item = Outgoing.from_entry(SpoolEntry(1, env.canonical()))
    entry = {
        "envelope_id": item.envelope_id,
        "s3_key": item.object_key,
        "tenant": item.tenant,
        "captured_at": env.captured_at,
    }
    assert index_body(entry) == item.index_body()


def test_renderers() -> None:
    from capture.audit.lake.query import QueryResult

    result = QueryResult(["model", "n", "rate"], [("m-a", 10, 0.5), ("m-bb", 2, None)])
    table = render_table(result).splitlines()
    assert table[0] == "model   n  rate"
    assert table[2] == "m-a    10   0.5"
    assert table[3] == "m-bb    2  NULL"
    assert table[-1] == "(2 rows)"
    assert json.loads(render_json(result))[1] == {"model": "m-bb", "n": 2, "rate": None}
    assert render_csv(result).splitlines() == ["model,n,rate", "m-a,10,0.5", "m-bb,2,"]


async def test_a_matching_envelope_id_header_is_trusted_and_a_wrong_one_is_not(lake: Lake) -> None:
    archiver = Archiver(SETTINGS, lake)
    env = envelope(request_id="h")
    data = env.canonical()
    non_canonical = json.dumps(json.loads(data), indent=1).encode()  # same record, other bytes
    for value, claimed in [(data, env.envelope_id().encode()), (data, b"f" * 64), (non_canonical, b"f" * 64)]:
        archiver.add(SETTINGS.envelope_topic, value, claimed_id=claimed)  # the lying headers: id recomputed
        await archiver.flush()
    ids = run_query(lake, "SELECT envelope_id FROM envelopes_raw").rows
    assert ids == [(env.envelope_id(),)] * 3


async def test_a_compact_envelope_is_archived_as_the_record_it_holds(lake: Lake) -> None:
    """What the sidecar sends by default (`schemas.envelope_compact`): the same row as its JSON, its id taken from
    the header only when it is the hash of the decoded canonical bytes."""
    archiver = Archiver(SETTINGS, lake)
    env = envelope(request_id="compact-1")
    compact = encode_compact(env.canonical())
    assert compact is not None
    assert archiver.add(SETTINGS.envelope_topic, compact, claimed_id=env.envelope_id().encode())
    assert archiver.add(SETTINGS.envelope_topic, compact, claimed_id=b"f" * 64)  # a lying header: recomputed
    assert not archiver.add(SETTINGS.envelope_topic, compact[:-3])  # corrupt: skipped, not archived
    await archiver.flush()
    rows = run_query(lake, "SELECT envelope_id, request_id FROM envelopes_raw").rows
    assert rows == [(env.envelope_id(), "compact-1")]
    assert archiver.stats.skipped == 1
