"""Shadow envelopes in the lake (Parquet on a local filesystem): their rows carry the marker, the production
views leave them out, ``shadow_pairs`` pairs them, and files written before the columns existed still read."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import run_query
from capture.audit.lake.schema import ADDED_COLUMNS, ENVELOPES, conform, envelope_row
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from schemas import CapturedOutput, Choice, Envelope, ShadowMarker
from schemas.layout import lake_part_key
from tests.factories import FIXED_TIME, envelope, runtime

SETTINGS = LakeSettings(flush_rows=100, flush_seconds=3600)
CANDIDATE = "http://127.0.0.1:9/candidate"
RT_F32 = runtime(dtype="float32")


@pytest.fixture
def lake(tmp_path: Path) -> Lake:
    return Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")


def shadow_of(prod: Envelope, ids: tuple[int, ...] | None = None) -> Envelope:
    """The candidate's answer to `prod` (float32 runtime), its choice 0's token ids `ids` (default: the same)."""
    assert isinstance(prod.outcome, CapturedOutput)
    choice = prod.outcome.choices[0]
    changed = Choice(index=0, token_ids=ids if ids is not None else choice.token_ids, text="cand",
                     finish_reason="length")  # fmt: skip
    return prod.model_copy(
        update={
            "captured_at": prod.captured_at + timedelta(seconds=2),
            "runtime": RT_F32,
            "outcome": prod.outcome.model_copy(update={"choices": (changed,)}),
            "flagged": False,
            "flag_reason": None,
            "shadow": ShadowMarker(production_envelope_id=prod.envelope_id(), candidate=CANDIDATE),
        }
    )


def test_a_shadow_row_carries_its_marker_and_a_production_row_says_it_is_none() -> None:
    prod = envelope()
    row = envelope_row(shadow_of(prod), FIXED_TIME)
    assert set(row) == set(ENVELOPES.names)
    assert (row["shadow"], row["shadow_production_envelope_id"], row["shadow_candidate"]) == (
        True,
        prod.envelope_id(),
        CANDIDATE,
    )
    assert row["request_id"] == prod.request_id
    assert row["rt_dtype"] == "float32"
    plain = envelope_row(prod, FIXED_TIME)
    assert (plain["shadow"], plain["shadow_production_envelope_id"], plain["shadow_candidate"]) == (False, None, None)


async def _archive(lake: Lake, *envelopes: Envelope) -> None:
    archiver = Archiver(SETTINGS, lake)
    for env in envelopes:
        assert archiver.add(SETTINGS.envelope_topic, env.canonical())
    await archiver.flush()


def _rows(lake: Lake, sql: str) -> list[tuple[Any, ...]]:
    return run_query(lake, sql).rows


async def test_production_views_leave_shadows_out_and_shadow_pairs_pairs_them(lake: Lake) -> None:
    same, forked, alone = (envelope(request_id=f"r{i}", workflow=None) for i in range(3))
    assert isinstance(forked.outcome, CapturedOutput)
    ids = forked.outcome.choices[0].token_ids
    await _archive(lake, same, forked, alone, shadow_of(same), shadow_of(forked, ids=(ids[0], ids[1] + 1, *ids[2:])))
    assert _rows(lake, "SELECT request_id FROM envelopes ORDER BY 1") == [("r0",), ("r1",), ("r2",)]
    assert _rows(lake, "SELECT count(*), count(DISTINCT request_id) FROM envelopes") == [(3, 3)]
    assert _rows(lake, "SELECT count(*) FROM all_envelopes") == [(5,)]
    assert _rows(lake, "SELECT request_id, shadow_candidate FROM shadows ORDER BY 1") == [
        ("r0", CANDIDATE),
        ("r1", CANDIDATE),
    ]
    pairs = _rows(
        lake,
        "SELECT request_id, paired, production_envelope_id, token_identical, first_divergence_position,"
        " production_runtime_sha256 <> candidate_runtime_sha256, production_finish, candidate_finish,"
        " candidate_text FROM shadow_pairs ORDER BY 1",
    )
    assert pairs == [
        ("r0", True, same.envelope_id(), True, None, True, "stop", "length", "cand"),
        ("r1", True, forked.envelope_id(), False, 1, True, "stop", "length", "cand"),
    ]


async def test_a_shadow_whose_production_is_not_in_the_lake_is_unpaired(lake: Lake) -> None:
    await _archive(lake, shadow_of(envelope(request_id="gone", workflow=None)))
    assert _rows(lake, "SELECT request_id, paired, token_identical FROM shadow_pairs") == [("gone", False, None)]
    assert _rows(lake, "SELECT count(*) FROM envelopes") == [(0,)]


async def test_the_index_is_rebuilt_from_production_rows_only(lake: Lake) -> None:
    prod = envelope(request_id="r-idx", workflow=None)
    await _archive(lake, prod, shadow_of(prod))  # the shadow is newer: it must still not take the request's entry
    entries = list(lake.index_entries())
    assert [(e["request_id"], e["envelope_id"]) for e in entries] == [("r-idx", prod.envelope_id())]


def _write_old_file(lake: Lake, env: Envelope) -> None:
    """A partition file as the archiver wrote it before the shadow columns existed."""
    old = pa.schema([f for f in ENVELOPES if f.name not in ADDED_COLUMNS])
    row = {k: v for k, v in envelope_row(env, FIXED_TIME).items() if k not in ADDED_COLUMNS}
    path = Path(lake.bucket) / lake_part_key("envelopes", "2026-07-14", env.tenant, "old0", lake.prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([row], schema=old), str(path))


async def test_files_without_the_shadow_columns_read_as_production_and_compact(lake: Lake) -> None:
    old = envelope(request_id="r-old", workflow=None)
    _write_old_file(lake, old)
    assert _rows(lake, "SELECT request_id, shadow FROM envelopes") == [("r-old", None)]
    new = envelope(request_id="r-new", workflow=None)
    await _archive(lake, new, shadow_of(new))
    assert _rows(lake, "SELECT request_id FROM envelopes ORDER BY 1") == [("r-new",), ("r-old",)]
    report = lake.compact("envelopes", "2026-07-14")
    assert (report.files_read, report.rows_out) == (2, 3)
    assert _rows(lake, "SELECT request_id, shadow FROM all_envelopes ORDER BY 1, 2") == [
        ("r-new", False),
        ("r-new", True),
        ("r-old", None),
    ]


def test_conform_fills_a_missing_column_and_orders_them_as_the_schema() -> None:
    schema = pa.schema([("a", pa.string()), ("b", pa.bool_()), ("c", pa.int64())])
    table = pa.table({"c": [1], "a": ["x"]})
    out = conform(table, schema)
    assert out.schema == schema
    assert out.to_pylist() == [{"a": "x", "b": None, "c": 1}]
