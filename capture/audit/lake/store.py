"""The audit lake on S3: write partition files, list them, read them as Arrow, compact, rebuild the index.

Layout: ``<bucket>/<prefix>/<table>/date=D/tenant=T/part-<uuid>.parquet`` (see `capture.audit.lake.schema`).
The lake bucket must not be under Object Lock: compaction deletes the small files it merged.

Compaction (`Lake.compact`), per partition with more than one file: read every file, keep the first copy per
id (``envelope_id`` / ``result_id``, earliest ``archived_at``), write one ``part-<uuid>.parquet``, *then*
delete the files it read. A file written before a column was added is read with that column NULL
(`capture.audit.lake.schema.conform`), so the merged file has the current schema. A crash between the write
and the deletes leaves duplicates, never a loss: the query views deduplicate, and the next compaction merges
them. A query that lists a file just before compaction deletes it fails with a read error and can simply be
run again.

Index rebuild (`Lake.rebuild_index`): if the request-id index objects of the audit bucket are lost, the lake's
envelopes table still knows, per request id, the newest production envelope (never a shadow: it shares the
request id) and its S3 key; the index objects are written back byte for byte as the capture sink writes them
(``{"captured_at","envelope_id","key","tenant"}``), and the workflow index with them. The lake is not evidence:
a row is written back only when the record it names agrees with it, only missing objects are written, and with
``overwrite`` invalid ones replaced; a valid entry never is (`capture.audit.index.repair_entry`).

Every pyarrow / botocore error becomes `LakeError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from capture.audit.errors import LakeError
from capture.audit.index import RepairReport, repair_entry
from capture.audit.lake.schema import DEDUPE_KEY, PARTITIONING, SCHEMAS, conform
from schemas import layout
from schemas.layout import (
    LAKE_PREFIX,
    is_lake_part,
    lake_day_prefix,
    lake_part_key,
    lake_table_prefix,
    request_index_key,
    workflow_index_key,
)

if TYPE_CHECKING:
    from capture.audit.lake.settings import LakeSettings
    from capture.audit.store import AuditStore

_T = TypeVar("_T")


def lake_filesystem(settings: LakeSettings) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem for the settings' endpoint (path-style, http or https by the URL)."""
    secret = settings.s3_secret_key.get_secret_value() if settings.s3_secret_key is not None else None
    kwargs: dict[str, Any] = {"region": settings.s3_region, "access_key": settings.s3_access_key, "secret_key": secret}
    if settings.s3_endpoint:
        url = urlparse(settings.s3_endpoint)
        kwargs.update(endpoint_override=url.netloc or url.path, scheme=url.scheme or "https")
    return pafs.S3FileSystem(**kwargs)


def _arrow(what: str, call: Callable[[], _T]) -> _T:
    try:
        return call()
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"lake: {what}: {exc}") from exc


@dataclass(frozen=True)
class PartitionFiles:
    table: str
    day: str
    tenant: str
    paths: tuple[str, ...]  # "bucket/key" as pyarrow names them


@dataclass(frozen=True)
class CompactionReport:
    """What one `Lake.compact` did, summed over the partitions it merged."""

    #: Partitions merged (those with at least ``min_files`` files).
    partitions: int = 0
    #: Their files, read and then deleted.
    files_read: int = 0
    #: Files written in their place: one per partition merged.
    files_written: int = 0
    #: Rows in the files read, at-least-once copies included.
    rows_in: int = 0
    #: Rows written: the first copy per id (`dedupe`), so ``rows_in - rows_out`` copies were dropped.
    rows_out: int = 0


def dedupe(table: pa.Table, key: str) -> pa.Table:
    """The first row per `key` by ``archived_at`` (at-least-once copies collapse)."""
    import duckdb

    con = duckdb.connect()
    try:
        con.register("t", table)
        out = con.sql(f"SELECT * FROM t QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY archived_at) = 1")
        return out.to_arrow_table().cast(table.schema)
    finally:
        con.close()


class Lake:
    """One lake: a bucket, a key prefix and pyarrow's filesystem for it (blocking calls)."""

    def __init__(self, fs: pafs.FileSystem, bucket: str, prefix: str = LAKE_PREFIX) -> None:
        self.fs = fs
        self.bucket = bucket
        self.prefix = prefix

    @classmethod
    def from_settings(cls, settings: LakeSettings) -> Lake:
        return cls(lake_filesystem(settings), settings.lake_bucket, settings.lake_prefix)

    def _table_dir(self, table: str) -> str:
        return f"{self.bucket}/{lake_table_prefix(table, self.prefix)}".rstrip("/")

    # -- write -----------------------------------------------------------------------------------------------

    def write(self, table: str, day: str, tenant: str, rows: pa.Table) -> str:
        """Write one new partition file; its path (``bucket/key``)."""
        path = f"{self.bucket}/{lake_part_key(table, day, tenant, uuid.uuid4().hex, self.prefix)}"
        data = rows.cast(SCHEMAS[table])
        if isinstance(self.fs, pafs.LocalFileSystem):  # object stores have no directories to make
            _arrow(f"mkdir {path}", lambda: self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True))
        _arrow(f"write {path}", lambda: pq.write_table(data, path, filesystem=self.fs, compression="zstd"))
        return path

    # -- read ------------------------------------------------------------------------------------------------

    def partitions(self, table: str, day: str | None = None) -> list[PartitionFiles]:
        """Every partition of `table` (of one day, if given) with its files, sorted."""
        prefix = lake_day_prefix(table, day, self.prefix) if day else lake_table_prefix(table, self.prefix)
        base = f"{self.bucket}/{prefix}".rstrip("/")
        selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
        infos = _arrow(f"list {base}", lambda: self.fs.get_file_info(selector))
        found: dict[tuple[str, str], list[str]] = {}
        for info in infos:
            if info.type != pafs.FileType.File or not is_lake_part(info.path):
                continue
            parts = dict(p.split("=", 1) for p in info.path.split("/") if "=" in p)
            if "date" in parts and "tenant" in parts:
                found.setdefault((parts["date"], parts["tenant"]), []).append(info.path)
        return [PartitionFiles(table, d, t, tuple(sorted(paths))) for (d, t), paths in sorted(found.items())]

    def _open(self, table: str, paths: list[str]) -> ds.Dataset:
        schema = pa.unify_schemas([SCHEMAS[table], PARTITIONING])
        if not paths:
            return ds.dataset(schema.empty_table())
        return _arrow(
            f"open {table}",
            lambda: ds.dataset(
                paths,
                schema=schema,
                format="parquet",
                filesystem=self.fs,
                partitioning=ds.partitioning(PARTITIONING, flavor="hive"),
                partition_base_dir=self._table_dir(table),
            ),
        )

    def dataset(self, table: str, day: str | None = None) -> ds.Dataset:
        """The table (with ``date`` and ``tenant`` from the paths) as an Arrow dataset; empty when no file."""
        return self._open(table, [p for part in self.partitions(table, day) for p in part.paths])

    def split_datasets(self, table: str, day: str | None = None) -> tuple[ds.Dataset, ds.Dataset]:
        """(partitions of one file, partitions of several files). Every file is duplicate-free on its own (the
        archiver dedupes each flush, compaction its output) and copies of a record share a partition, so only
        the second can hold duplicates: the query views dedupe that part alone (a compacted lake: nothing)."""
        parts = self.partitions(table, day)
        single = [p for part in parts if len(part.paths) == 1 for p in part.paths]
        multi = [p for part in parts if len(part.paths) > 1 for p in part.paths]
        return self._open(table, single), self._open(table, multi)

    # -- compaction ------------------------------------------------------------------------------------------

    def compact(self, table: str, day: str | None = None, *, min_files: int = 2) -> CompactionReport:
        """Merge every partition of `table` (of `day`) that has at least `min_files` files (module docstring)."""
        report = CompactionReport()
        for part in self.partitions(table, day):
            if len(part.paths) < min_files:
                continue
            pieces = [
                conform(_arrow(f"read {p}", lambda p=p: pq.read_table(p, filesystem=self.fs)), SCHEMAS[table])  # type: ignore[misc]
                for p in part.paths
            ]
            merged = pa.concat_tables(pieces)
            out = dedupe(merged, DEDUPE_KEY[table])
            self.write(table, part.day, part.tenant, out)
            for p in part.paths:
                _arrow(f"delete {p}", lambda p=p: self.fs.delete_file(p))  # type: ignore[misc]
            report = CompactionReport(
                partitions=report.partitions + 1,
                files_read=report.files_read + len(part.paths),
                files_written=report.files_written + 1,
                rows_in=report.rows_in + merged.num_rows,
                rows_out=report.rows_out + out.num_rows,
            )
        return report

    # -- request-id index rebuild ----------------------------------------------------------------------------

    def index_entries(self, day: str | None = None) -> Iterator[dict[str, Any]]:
        """Per request id, the newest envelope's index fields (from the deduplicated envelopes table)."""
        import duckdb

        con = duckdb.connect()
        try:
            con.register("envelopes", self.dataset("envelopes", day))
            rel = con.sql(  # a shadow has its production request's id but never its index entries
                "SELECT request_id, envelope_id, s3_key, tenant, captured_at, workflow_id, workflow_step "
                "FROM envelopes WHERE shadow IS NOT TRUE QUALIFY row_number() OVER (PARTITION BY request_id "
                "ORDER BY captured_at DESC, archived_at) = 1 ORDER BY request_id"
            )
            columns = rel.columns
            for values in rel.fetchall():
                yield dict(zip(columns, values, strict=True))
        finally:
            con.close()

    def rebuild_index(
        self,
        store: AuditStore,
        day: str | None = None,
        *,
        tenant: str | None = None,
        overwrite: bool = False,
    ) -> RepairReport:
        """Write back the index objects (request id and workflow) that are missing, from the lake's rows of `day`
        (and of `tenant` only, when given); with `overwrite`, also replace invalid ones. A valid entry is never
        replaced (`capture.audit.index.repair_entry` says what was done with each)."""
        report = RepairReport()
        for entry in self.index_entries(day):
            if tenant is not None and entry["tenant"] != tenant:
                continue
            body, request_id = index_body(entry), entry["request_id"]
            repair_entry(store, request_index_key(request_id), body, report, request_id=request_id,
                         overwrite=overwrite)  # fmt: skip
            flow, step = entry["workflow_id"], entry["workflow_step"]
            if flow is not None and step is not None:
                key = workflow_index_key(flow, step, request_id)
                repair_entry(store, key, body, report, workflow=(flow, step), overwrite=overwrite)
        return report


def index_body(entry: dict[str, Any]) -> bytes:
    """The index object body of a lake row (`schemas.layout.index_body`, as the capture sink writes it)."""
    return layout.index_body(entry["envelope_id"], entry["s3_key"], entry["tenant"], entry["captured_at"])
