"""The client's own request id (``X-Request-Id``) in the lake (Parquet on a local filesystem): a column of the
``envelopes`` view that searches can filter on, NULL where there is none, and files written before the column
existed still read (NULL) and compact into the current schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import run_query
from capture.audit.lake.schema import ADDED_COLUMNS, ENVELOPES, envelope_row, sealed_row
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from schemas import Envelope
from schemas.layout import lake_part_key
from schemas.sealed import seal_envelope
from tests.factories import FIXED_TIME, envelope

SETTINGS = LakeSettings(flush_rows=100, flush_seconds=3600)


@pytest.fixture
def lake(tmp_path: Path) -> Lake:
    return Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")


async def _archive(lake: Lake, *envelopes: Envelope) -> None:
    archiver = Archiver(SETTINGS, lake)
    for env in envelopes:
        assert archiver.add(SETTINGS.envelope_topic, env.canonical())
    await archiver.flush()


def _rows(lake: Lake, sql: str) -> list[tuple[Any, ...]]:
    return run_query(lake, sql).rows


def test_a_row_carries_the_client_request_id_and_a_sealed_row_does_not() -> None:
    row = envelope_row(envelope(client_request_id="order-42"), FIXED_TIME)
    assert set(row) == set(ENVELOPES.names)
    assert row["client_request_id"] == "order-42"
    assert envelope_row(envelope(client_request_id=None), FIXED_TIME)["client_request_id"] is None
    env = envelope(client_request_id="order-42")
    sealed = seal_envelope(env.canonical(), request_id=env.request_id, tenant=env.tenant,
                           captured_at=env.captured_at, workflow=env.workflow, key_id="k1",
                           data_key=bytes(32))  # fmt: skip
    assert sealed_row(sealed, FIXED_TIME)["client_request_id"] is None  # not in the clear metadata


async def test_the_envelopes_view_has_the_column_and_a_search_filters_on_it(lake: Lake) -> None:
    await _archive(
        lake,
        envelope(request_id="r1", client_request_id="order-42", workflow=None),
        envelope(request_id="r2", client_request_id="order-43", workflow=None),
        envelope(request_id="r3", client_request_id=None, workflow=None),
    )
    assert _rows(lake, "SELECT request_id, client_request_id FROM envelopes ORDER BY 1") == [
        ("r1", "order-42"),
        ("r2", "order-43"),
        ("r3", None),
    ]
    assert _rows(lake, "SELECT request_id FROM envelopes WHERE client_request_id = 'order-43'") == [("r2",)]


def _write_file_without_the_column(lake: Lake, env: Envelope) -> None:
    """A partition file as the archiver wrote it before ``client_request_id`` existed (the shadow columns were
    there already: the column is the last one added)."""
    assert ADDED_COLUMNS[-1] == "client_request_id"
    old = pa.schema([f for f in ENVELOPES if f.name != "client_request_id"])
    row = {k: v for k, v in envelope_row(env, FIXED_TIME).items() if k != "client_request_id"}
    path = Path(lake.bucket) / lake_part_key("envelopes", "2026-07-14", env.tenant, "old0", lake.prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([row], schema=old), str(path))


async def test_files_written_before_the_column_read_it_as_null_and_compact(lake: Lake) -> None:
    _write_file_without_the_column(lake, envelope(request_id="r-old", client_request_id="order-1", workflow=None))
    assert _rows(lake, "SELECT request_id, client_request_id FROM envelopes") == [("r-old", None)]
    await _archive(lake, envelope(request_id="r-new", client_request_id="order-2", workflow=None))
    expected = [("r-new", "order-2"), ("r-old", None)]
    assert _rows(lake, "SELECT request_id, client_request_id FROM envelopes ORDER BY 1") == expected
    report = lake.compact("envelopes", "2026-07-14")
    assert (report.files_read, report.rows_out) == (2, 2)
    (merged,) = [p for part in lake.partitions("envelopes") for p in part.paths]
    assert pq.read_schema(merged, filesystem=lake.fs).names[-1] == "client_request_id"
    assert _rows(lake, "SELECT request_id, client_request_id FROM envelopes ORDER BY 1") == expected
