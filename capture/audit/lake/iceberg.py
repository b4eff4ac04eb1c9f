"""The audit lake as Apache Iceberg tables behind a REST catalog (``REPROLANE_ARCHIVER_LAKE_KIND=iceberg``).

Why Iceberg: Spark, Trino, Athena or ClickHouse read the same tables with atomic appends, snapshots and schema
evolution; the catalog (SeaweedFS's in the local stack, any Iceberg REST catalog in production, configured by
``iceberg_uri`` + ``iceberg_warehouse``) is the one place that orders commits.

Tables in namespace ``iceberg_namespace``, each partitioned ``day(<time>)``, ``identity(tenant)``:

- ``envelopes``: `capture.audit.lake.schema.ENVELOPES` plus ``tenant`` (partition time: ``captured_at``); a
  table created before the shadow columns were added gets them on open (`IcebergLake._evolved`: an Iceberg
  schema update; its older data files read them as NULL);
- ``divergences``: `DIVERGENCES` plus ``tenant`` (``replayed_at``);
- ``replays``: one row per replay result (`REPLAYS`, ``replayed_at``); its S3 key is joined in the query view.

Exactly once under at-least-once delivery and concurrent archivers (`IcebergLake.append_new`): every commit
is an *anti-join then append* against one snapshot: the ids of the batch already in the table (read from the
partitions the batch touches) are dropped and the rest appended in a commit that asserts the snapshot it read
is still the table's head. A concurrent commit by another archiver of the group makes the catalog refuse ours
(``CommitFailedException``); we refresh and anti-join again, so a row that the other archiver wrote meanwhile
is not written twice. PyIceberg's own retry (which would re-apply the append *without* the anti-join) is off
on our tables (``commit.retry.num-retries=0``). A commit whose outcome is unknown (a lost response) is retried
the same way: if it landed, the anti-join finds its rows. So an envelope id appears once, however often Kafka
delivered it and whichever archiver wrote it.

Maintenance (`IcebergLake.maintain`): compaction rewrites each partition with more than ``min_files`` data files
as one (an overwrite of exactly that partition: same rows, one snapshot); snapshot expiry drops snapshots older
than the retention floor only (``expire_before`` is clamped to ``now - floor``), never the current one, so time
travel over the last ``floor`` days stays possible; neither deletes a row, so rows of envelopes under legal hold
(and every other row) stay. Deleting rows past their retention is not done here (see docs/SCALING.md).

Every pyiceberg / pyarrow / HTTP error becomes `LakeError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from capture.audit.errors import LakeError
from capture.audit.lake.schema import DEDUPE_KEY, DIVERGENCES, ENVELOPES, conform
from capture.audit.lake.store import lake_filesystem

if TYPE_CHECKING:
    from capture.audit.lake.settings import LakeSettings

log = logging.getLogger("reprolane.lake.iceberg")
_T = TypeVar("_T")

TENANT: Final = pa.field("tenant", pa.string())
#: The replays table's columns, in its order: the archiver writes each divergence row there too (projected), so
#: every column is typed as `DIVERGENCES` types it.
REPLAY_COLUMNS: Final = (
    "result_id", "envelope_id", "request_id", "lane", "lane_fingerprint_sha256", "verdict", "target_met",
    "replayed_at", "archived_at",
)  # fmt: skip
REPLAYS: Final = pa.schema([*(DIVERGENCES.field(name) for name in REPLAY_COLUMNS), TENANT])
#: Arrow schema, id column, partition time column of each Iceberg table.
ICEBERG_TABLES: Final = {
    "envelopes": (ENVELOPES.append(TENANT), DEDUPE_KEY["envelopes"], "captured_at"),
    "divergences": (DIVERGENCES.append(TENANT), DEDUPE_KEY["divergences"], "replayed_at"),
    "replays": (REPLAYS, "result_id", "replayed_at"),
}
#: Our retry loop replaces PyIceberg's (module docstring).
TABLE_PROPERTIES: Final = {"commit.retry.num-retries": "0", "write.parquet.compression-codec": "zstd"}
MAX_COMMIT_ATTEMPTS: Final = 20


def _errors() -> tuple[type[BaseException], ...]:
    import requests
    from pyiceberg.exceptions import RESTError

    return (RESTError, OSError, pa.ArrowException, requests.RequestException, ValueError)


def _guard(what: str, call: Callable[[], _T]) -> _T:
    try:
        return call()
    except _errors() as exc:
        raise LakeError(f"iceberg lake: {what}: {exc}") from exc


def catalog_properties(settings: LakeSettings) -> dict[str, str]:
    """PyIceberg REST catalog properties: the catalog URL and warehouse, SigV4 (SeaweedFS, S3 Tables) or a bearer
    token, and the S3 FileIO the data files are written with."""
    if not settings.iceberg_uri:
        raise LakeError("iceberg lake: no catalog URL (set REPROLANE_ARCHIVER_ICEBERG_URI or run the local stack)")
    secret = settings.s3_secret_key.get_secret_value() if settings.s3_secret_key is not None else ""
    props = {"uri": settings.iceberg_uri, "warehouse": settings.iceberg_warehouse, "s3.region": settings.s3_region}
    if settings.s3_endpoint:
        props["s3.endpoint"] = settings.s3_endpoint
    if settings.s3_access_key:
        props.update({"s3.access-key-id": settings.s3_access_key, "s3.secret-access-key": secret})
    if settings.iceberg_sigv4:
        props.update({
            "rest.sigv4-enabled": "true", "rest.signing-name": settings.iceberg_signing_name,
            "rest.signing-region": settings.s3_region, "client.region": settings.s3_region,
            "client.access-key-id": settings.s3_access_key or "", "client.secret-access-key": secret,
        })  # fmt: skip
    if settings.iceberg_token is not None:
        props["token"] = settings.iceberg_token.get_secret_value()
    return props


def _spec(schema: Any, time_column: str) -> Any:
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.transforms import DayTransform, IdentityTransform

    when, tenant = schema.find_field(time_column).field_id, schema.find_field("tenant").field_id
    return PartitionSpec(
        PartitionField(source_id=when, field_id=1000, transform=DayTransform(), name=f"{time_column}_day"),
        PartitionField(source_id=tenant, field_id=1001, transform=IdentityTransform(), name="tenant"),
    )


def _day_range(column: str, day: str) -> Any:
    from pyiceberg.expressions import And, GreaterThanOrEqual, LessThan

    start = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC)
    end = start + timedelta(days=1)
    return And(GreaterThanOrEqual(term=column, value=start.isoformat()), LessThan(term=column, value=end.isoformat()))


def _only_added(tbl: Any) -> bool:
    """True when every schema the table had is its current one less some columns (same field ids, names and
    types): the only evolution we make (`IcebergLake._evolved`), under which a data file reads by column name."""
    current = {f.field_id: (f.name, f.field_type) for f in tbl.schema().fields}
    return all(current.get(f.field_id) == (f.name, f.field_type) for s in tbl.schemas().values() for f in s.fields)


@dataclass(frozen=True)
class MaintenanceReport:
    """What one `IcebergLake.maintain` did to one table (no row is added or dropped by either step)."""

    #: Partitions rewritten as one data file (those with at least ``min_files`` files).
    partitions_compacted: int = 0
    #: Data files those partitions had before compaction.
    files_before: int = 0
    #: Data files they have after it: one each.
    files_after: int = 0
    #: Snapshots expired (older than the cutoff, never the current one): time travel to them is gone.
    snapshots_expired: int = 0


class IcebergLake:
    """The three Iceberg tables of one namespace in one REST catalog (blocking calls)."""

    def __init__(self, catalog: Any, namespace: str, fs: pafs.FileSystem | None = None) -> None:
        """`fs`: the filesystem the data files are read with by `dataset` (None: `scan` into memory instead)."""
        self.catalog = catalog
        self.namespace = namespace
        self.fs = fs
        self._tables: dict[str, Any] = {}
        self._write_lock = threading.Lock()  # the anti-join and the append must see one snapshot (shared Table)
        self.commit_retries = 0  # commits the catalog refused (a concurrent writer won) and we ran again

    @classmethod
    def from_settings(cls, settings: LakeSettings) -> IcebergLake:
        try:
            from pyiceberg.catalog.rest import RestCatalog
        except ModuleNotFoundError as exc:
            raise LakeError("iceberg lake: pyiceberg is not installed (install reprolane's `iceberg` extra)") from exc
        props = catalog_properties(settings)
        catalog = _guard(f"connect {settings.iceberg_uri}", lambda: RestCatalog("reprolane", **props))
        return cls(catalog, settings.iceberg_namespace, lake_filesystem(settings))

    def table(self, name: str) -> Any:
        """The table, created (with its namespace) on first use; a concurrent creator's table is loaded."""
        if name not in self._tables:
            self._tables[name] = _guard(f"open {name}", lambda: self._create_or_load(name))
        return self._tables[name]

    def _create_or_load(self, name: str) -> Any:
        from pyiceberg.catalog import Catalog
        from pyiceberg.exceptions import NamespaceAlreadyExistsError, NoSuchTableError, TableAlreadyExistsError
        from pyiceberg.schema import assign_fresh_schema_ids

        ident = f"{self.namespace}.{name}"
        try:
            return self._evolved(name, self.catalog.load_table(ident))
        except NoSuchTableError:
            pass
        try:
            self.catalog.create_namespace(self.namespace)
        except NamespaceAlreadyExistsError:
            pass
        arrow, _, when = ICEBERG_TABLES[name]
        schema = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(arrow))  # ids the spec can name
        try:
            return self.catalog.create_table(
                ident, schema=schema, partition_spec=_spec(schema, when), properties=TABLE_PROPERTIES
            )
        except TableAlreadyExistsError:
            return self._evolved(name, self.catalog.load_table(ident))

    def _evolved(self, name: str, tbl: Any) -> Any:
        """`tbl` with every column of our schema: one created before a column was added (the ``shadow`` ones)
        gets it appended (an Iceberg schema update, by name; old data files read it as NULL). A concurrent
        archiver adding the same columns makes ours fail: reload, and the columns are there."""
        from pyiceberg.exceptions import CommitFailedException

        arrow = ICEBERG_TABLES[name][0]
        have = {f.name for f in tbl.schema().fields}
        if all(n in have for n in arrow.names):
            return tbl
        try:
            with tbl.update_schema() as update:
                update.union_by_name(arrow)
        except CommitFailedException:
            log.info("iceberg lake: %s: a concurrent schema update won; reloading", name)
        tbl = self.catalog.load_table(f"{self.namespace}.{name}")
        log.info("iceberg lake: %s: added columns %s", name, [n for n in arrow.names if n not in have])
        return tbl

    # -- write -----------------------------------------------------------------------------------------------

    def append_new(self, name: str, rows: pa.Table) -> int:
        """Append the rows whose id is not in the table yet (module docstring); the number appended."""

        with self._write_lock:
            return self._append_new(name, rows)

    def _append_new(self, name: str, rows: pa.Table) -> int:
        from pyiceberg.exceptions import CommitFailedException, CommitStateUnknownException

        arrow, key, _ = ICEBERG_TABLES[name]
        tbl = self.table(name)
        rows = conform(rows, arrow).select([f.name for f in tbl.schema().fields])  # the table's column order
        for attempt in range(MAX_COMMIT_ATTEMPTS):
            _guard(f"refresh {name}", tbl.refresh)
            fresh = rows.filter(pc.invert(pc.is_in(rows[key], value_set=self._existing(name, tbl, rows))))
            if fresh.num_rows == 0:
                return 0
            try:
                _guard(f"append {name}", lambda fresh=fresh: tbl.append(fresh))  # type: ignore[misc]
                return int(fresh.num_rows)
            except (CommitFailedException, CommitStateUnknownException) as exc:
                self.commit_retries += 1
                log.info("iceberg lake: %s commit %d lost a race (%s); anti-join again", name, attempt + 1, exc)
                time.sleep(min(0.05 * 2**attempt, 2.0))
        raise LakeError(f"iceberg lake: {name}: no commit after {MAX_COMMIT_ATTEMPTS} attempts (too much contention)")

    def _existing(self, name: str, tbl: Any, rows: pa.Table) -> pa.Array:
        """The ids of `rows` already in the table, read from the partitions the rows touch only."""
        from pyiceberg.expressions import And, GreaterThanOrEqual, In, LessThanOrEqual

        _, key, when = ICEBERG_TABLES[name]
        if tbl.current_snapshot() is None:
            return pa.array([], pa.string())
        span = pc.min_max(rows[when])
        tenants = {t for t in rows["tenant"].to_pylist() if t is not None}
        row_filter: Any = And(
            And(GreaterThanOrEqual(term=when, value=span["min"].as_py().isoformat()),
                LessThanOrEqual(term=when, value=span["max"].as_py().isoformat())),
            In(term=key, literals=set(rows[key].to_pylist())),
        )  # fmt: skip
        if tenants:
            row_filter = And(row_filter, In(term="tenant", literals=tenants))
        found = _guard(f"scan {name}", lambda: tbl.scan(row_filter=row_filter, selected_fields=(key,)).to_arrow())
        return found[key].combine_chunks().cast(pa.string())

    # -- read ------------------------------------------------------------------------------------------------

    def scan(self, name: str, day: str | None = None) -> pa.Table:
        """The table (of one partition day) as Arrow, with the Hive lake's ``date`` column (``YYYY-MM-DD``,
        UTC) so queries written for the Parquet lake run unchanged."""
        arrow, _, when = ICEBERG_TABLES[name]
        tbl = self.table(name)
        _guard(f"refresh {name}", tbl.refresh)
        kwargs: dict[str, Any] = {"row_filter": _day_range(when, day)} if day else {}
        data = _guard(f"scan {name}", lambda: tbl.scan(**kwargs).to_arrow())
        data = conform(data, arrow) if data.num_rows else arrow.empty_table()  # an evolved table: another order
        return data.append_column("date", pc.strftime(data[when], format="%Y-%m-%d"))

    def dataset(self, name: str, day: str | None = None) -> ds.Dataset:
        """The table's current data files (of one partition day) as a lazy Arrow dataset, so DuckDB reads only
        the columns and files a query needs. Without ``date``: the query views add it. Exact while the tables
        have no delete files (PyIceberg writes none: appends, and overwrites that rewrite whole files) and every
        earlier schema is the current one less some columns (`_only_added`: a file read by name, a column it
        lacks as NULL); otherwise, or without a filesystem, the scan in memory (`scan`, its ``date`` dropped)."""
        arrow, _, when = ICEBERG_TABLES[name]
        tbl = self.table(name)
        _guard(f"refresh {name}", tbl.refresh)
        kwargs: dict[str, Any] = {"row_filter": _day_range(when, day)} if day else {}
        tasks = _guard(f"plan {name}", lambda: list(tbl.scan(**kwargs).plan_files()))
        if self.fs is None or not _only_added(tbl) or any(t.delete_files for t in tasks):
            return ds.dataset(self.scan(name, day).drop_columns(["date"]))
        paths = [t.file.file_path.split("://", 1)[-1] for t in tasks]
        if not paths:
            return ds.dataset(arrow.empty_table())
        fs = self.fs
        return _guard(f"open {name}", lambda: ds.dataset(paths, schema=arrow, format="parquet", filesystem=fs))

    # -- maintenance -----------------------------------------------------------------------------------------

    def maintain(
        self, name: str, *, min_files: int = 2, retention_floor: timedelta, expire_before: datetime | None = None
    ) -> MaintenanceReport:
        """Compact partitions with at least `min_files` files, then expire snapshots older than
        ``min(expire_before, now - retention_floor)`` (module docstring)."""
        with self._write_lock:
            report = _guard(f"compact {name}", lambda: self._compact(name, min_files))
        floor = datetime.now(UTC) - retention_floor
        cutoff = min(expire_before or floor, floor)
        tbl = self.table(name)
        before = len(tbl.snapshots())
        _guard(f"expire {name}", lambda: tbl.maintenance.expire_snapshots().older_than(cutoff).commit())
        _guard(f"refresh {name}", tbl.refresh)
        expired = before - len(tbl.snapshots())
        return MaintenanceReport(report.partitions_compacted, report.files_before, report.files_after, expired)

    def _compact(self, name: str, min_files: int) -> MaintenanceReport:
        from pyiceberg.expressions import And, EqualTo

        arrow, _, when = ICEBERG_TABLES[name]
        tbl = self.table(name)
        tbl.refresh()
        files: dict[tuple[Any, ...], int] = {}
        for task in tbl.scan().plan_files():
            part = task.file.partition
            files[(part[0], part[1])] = files.get((part[0], part[1]), 0) + 1
        report = MaintenanceReport()
        for (days, tenant), count in sorted(files.items(), key=str):
            if count < min_files:
                continue
            day = (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=int(days))).strftime("%Y-%m-%d")
            where = And(_day_range(when, day), EqualTo(term="tenant", value=tenant))
            data = conform(tbl.scan(row_filter=where).to_arrow(), arrow).select([f.name for f in tbl.schema().fields])
            tbl.overwrite(data, overwrite_filter=where)  # one snapshot: delete the partition's files, write one
            report = MaintenanceReport(
                report.partitions_compacted + 1, report.files_before + count, report.files_after + 1
            )
        return report
