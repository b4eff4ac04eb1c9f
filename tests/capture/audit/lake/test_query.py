"""`reprolane audit query`'s DuckDB connection reads the lake's views and nothing else: no file or network access, no
extension, no Python variable, and no SET that undoes it (a local-file lake; the CLI over the real SeaweedFS lake
is in test_query_stack.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import QueryError, connect, run_query
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from tests.factories import envelope

SETTINGS = LakeSettings(kafka_bootstrap="127.0.0.1:9", s3_bucket="b", lake_bucket="b", flush_rows=3)

#: Each was answered before the lockdown (a file read, a file write, a database file, an extension, the lock).
REFUSED = [
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_csv('/etc/passwd')",
    "COPY (SELECT 1 AS x) TO '{out}'",
    "COPY envelopes TO '{out}' (FORMAT parquet)",
    "ATTACH '{out}' AS other",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET lock_configuration = false",
]


@pytest.fixture
def lake(tmp_path: Path) -> Lake:
    return Lake(pafs.LocalFileSystem(), str(tmp_path / "lakeroot"), "lake")


async def filled(lake: Lake) -> Lake:
    archiver = Archiver(SETTINGS, lake)
    archiver.add(SETTINGS.envelope_topic, envelope(request_id="a").canonical())
    await archiver.flush()
    return lake


@pytest.mark.parametrize("sql", REFUSED)
async def test_a_query_outside_the_lake_is_refused(lake: Lake, tmp_path: Path, sql: str) -> None:
    await filled(lake)
    out = tmp_path / "stolen.out"
    with pytest.raises(QueryError, match="query refused"):
        run_query(lake, sql.format(out=out))
    assert not out.exists()


async def test_the_lake_views_still_answer(lake: Lake) -> None:
    await filled(lake)
    assert run_query(lake, "SELECT request_id FROM envelopes").rows == [("a",)]
    assert run_query(lake, "SELECT count(*) FROM envelopes_raw").rows == [(1,)]


def test_the_connection_is_locked_down(lake: Lake) -> None:
    con = connect(lake)
    try:
        settings = dict(
            con.execute(
                "SELECT name, value FROM duckdb_settings() WHERE name IN ('enable_external_access', "
                "'lock_configuration', 'autoinstall_known_extensions', 'autoload_known_extensions', "
                "'python_enable_replacements', 'allow_community_extensions')"
            ).fetchall()
        )
    finally:
        con.close()
    assert settings == {
        "enable_external_access": "false",
        "lock_configuration": "true",
        "autoinstall_known_extensions": "false",
        "autoload_known_extensions": "false",
        "python_enable_replacements": "false",
        "allow_community_extensions": "false",
    }


def test_a_python_variable_is_not_a_table(lake: Lake) -> None:
    with pytest.raises(QueryError):
        run_query(lake, "SELECT * FROM lake")  # run_query's own local: DuckDB's replacement scan would find it


async def test_the_verification_view_says_per_envelope_whether_and_by_which_replay_it_was_verified(lake: Lake) -> None:
    from datetime import timedelta

    from schemas import CapturedError
    from tests.capture.audit.lake.test_store_stack import event_for

    verified, waiting = envelope(request_id="v"), envelope(request_id="w")
    failed = envelope(
        request_id="f",
        outcome=CapturedError(error_type="upstream_error", message="x", timings=verified.outcome.timings),
    )
    first = event_for(verified, "bitwise", None)
    first = first.model_copy(update={"replayed_at": verified.captured_at + timedelta(seconds=3)})
    later = {
        "replayed_at": first.replayed_at + timedelta(seconds=60),
        "lane": "schedule",
        "lane_fingerprint_sha256": "e" * 64,
    }
    again = first.model_copy(update=later)  # another lane's replay: another result id
    archiver = Archiver(SETTINGS, lake)
    for env in (verified, waiting, failed):
        archiver.add(SETTINGS.envelope_topic, env.canonical())
    for event in (again, first):  # delivered late first: the first replay still counts
        archiver.add(SETTINGS.divergence_topic, event.model_dump_json().encode())
    await archiver.flush()
    rows = run_query(
        lake, "SELECT request_id, verifiable, verified, lane, verdict, lag_s FROM verification ORDER BY request_id"
    ).rows
    assert rows == [
        ("f", False, False, None, None, None),
        ("v", True, True, "vllm", "bitwise", 3.0),
        ("w", True, False, None, None, None),
    ]
