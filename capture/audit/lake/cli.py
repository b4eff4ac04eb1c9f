"""The lake and key commands; `infra.cli` registers them.

    reprolane audit query "SQL" [--day D] [--json | --csv]       DuckDB over the lake (views: capture.audit.lake.query)
    reprolane serve archiver                               run the archiver until SIGINT/SIGTERM
    reprolane audit lake compact [--day D] [--table T]           merge + dedupe each partition's small files
    reprolane audit lake rebuild-index [--day D] [--tenant T] [--overwrite]    write lost index objects back,
                                                           repair invalid ones (retention-admin)
    reprolane keys tenant list TENANT                             the tenant's stored data key ids
    reprolane keys tenant shred TENANT --yes                      destroy the tenant's data keys (key-admin)

``rebuild-index`` and ``keys tenant shred`` act only for an operator key with the role, in its tenant scope
(`capture.audit.operators`, ``--operator-key-file``); each decision is written to the access log first.

Settings: `LakeSettings` (``REPROLANE_ARCHIVER_*``; a running local stack provides the defaults). The commands
raise: ``typer.BadParameter`` for bad input (bad SQL, bad date, missing --yes), a `capture.audit.errors.LakeError`
or a `capture.ledger.errors.KeyringError` when S3 or Kafka failed; the root of the command line (`infra.cli`)
prints one line on stderr, ``reprolane: error: ...``, and exits 2 or 1.
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import timedelta
from typing import Annotated, Any

import typer

from capture.audit.lake.iceberg import IcebergLake
from capture.audit.lake.query import QueryError, render_csv, render_json, render_table, run_query
from capture.audit.lake.schema import TABLES
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.audit.operator_cli import OperatorKeyFileOpt, operator_gate
from capture.audit.store import AuditStore
from infra.clients.s3 import S3Policy, make_s3_client
from schemas.layout import DATA_KEYS_PREFIX, INDEX_PREFIX

_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")

DayOpt = Annotated[
    str | None,
    typer.Option(
        "--day", help="only partitions of this day, YYYY-MM-DD (envelopes: capture day, divergences: replay day)"
    ),
]


def _day(value: str | None) -> str | None:
    if value is not None and not _DAY.match(value):
        raise typer.BadParameter(f"--day must be YYYY-MM-DD, not {value!r}")
    return value


def _s3_client(settings: LakeSettings) -> Any:
    return make_s3_client(settings, policy=S3Policy.AUDIT)


def _audit_store(settings: LakeSettings) -> AuditStore:
    """The audit bucket, where the index lives and the access log is written."""
    return AuditStore(_s3_client(settings), settings.s3_bucket)


def open_lake(settings: LakeSettings) -> Lake | IcebergLake:
    """The lake `settings` select (``lake_kind``)."""
    return IcebergLake.from_settings(settings) if settings.lake_kind == "iceberg" else Lake.from_settings(settings)


def query_command(
    sql: Annotated[str, typer.Argument(help="SQL over the views envelopes, divergences, replays")],
    day: DayOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="rows as a JSON array of objects")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="rows as CSV with a header")] = False,
) -> None:
    """Run SQL (DuckDB) over the audit lake and print the rows as an aligned table.

    Example: reprolane audit query "SELECT tenant, count(*) AS n FROM envelopes GROUP BY tenant" --day 2026-07-14
    """
    if as_json and as_csv:
        raise typer.BadParameter("--json and --csv exclude each other")
    day = _day(day)
    lake = open_lake(LakeSettings())
    try:
        result = run_query(lake, sql, day)
    except QueryError as exc:  # the SQL does not run: bad input
        raise typer.BadParameter(str(exc)) from exc
    render = render_json if as_json else render_csv if as_csv else render_table
    typer.echo(render(result), nl=False)


archiver_app = typer.Typer(
    help="The archiver service (Kafka -> the audit lake: Parquet or Iceberg).", add_completion=False
)


@archiver_app.callback()
def _archiver_group() -> None:
    """The archiver service (Kafka -> the audit lake: Parquet or Iceberg)."""


@archiver_app.command("serve")
def archiver_serve_cmd() -> None:
    """Consume envelopes and divergence events into the lake until SIGINT/SIGTERM.

    Example: reprolane serve archiver
    """
    from capture.audit.lake.archiver import Archiver, run_until_signalled

    settings = LakeSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_until_signalled(Archiver(settings, open_lake(settings))))


lake_app = typer.Typer(help="The audit lake: compaction, request-id index rebuild.", add_completion=False)


@lake_app.command("compact")
def compact_cmd(
    day: DayOpt = None,
    table: Annotated[str | None, typer.Option("--table", help="envelopes | divergences (default: both)")] = None,
    floor_days: Annotated[
        float, typer.Option("--snapshot-floor-days", min=0.0, help="Iceberg: keep snapshots younger than this")
    ] = 7.0,
) -> None:
    """Merge each partition's small files into one, dropping duplicate rows (Iceberg: also expire snapshots
    older than the floor).

    Example: reprolane audit lake compact --day 2026-07-14 --table envelopes
    """
    day = _day(day)
    if table is not None and table not in TABLES:
        raise typer.BadParameter(f"--table must be one of {', '.join(TABLES)}, not {table!r}")
    settings = LakeSettings()
    if settings.lake_kind == "iceberg":
        _maintain_iceberg(IcebergLake.from_settings(settings), [table] if table else [*TABLES, "replays"], floor_days)
        return
    lake = Lake.from_settings(settings)
    for name in [table] if table else list(TABLES):
        r = lake.compact(name, day)
        typer.echo(
            f"{name}: {r.partitions} partitions compacted, {r.files_read} files -> {r.files_written}, "
            f"{r.rows_in} rows -> {r.rows_out}"
        )


def _maintain_iceberg(lake: IcebergLake, tables: list[str], floor_days: float) -> None:
    for name in tables:
        r = lake.maintain(name, retention_floor=timedelta(days=floor_days))
        typer.echo(
            f"{name}: {r.partitions_compacted} partitions compacted, {r.files_before} files -> {r.files_after}, "
            f"{r.snapshots_expired} snapshots expired"
        )


@lake_app.command("rebuild-index")
def rebuild_index_cmd(
    day: DayOpt = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="only this tenant's entries (default: your key's tenant, or all)")
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="also replace invalid index objects (a valid one never is)")
    ] = False,
    operator_key_file: OperatorKeyFileOpt = None,
) -> None:
    """Write lost request-id (and workflow) index objects back from the lake's envelopes (needs retention-admin).

    A row is written only when the envelope it names in S3 agrees with it; an index object already there is
    kept when valid (even if it points at another envelope) and, with --overwrite, replaced when invalid.

    Example: reprolane audit lake rebuild-index --day 2026-07-14 --tenant acme --operator-key-file alice.key
    """
    day = _day(day)
    settings = LakeSettings()
    if settings.lake_kind == "iceberg":
        raise typer.BadParameter("rebuild-index reads the Parquet lake (REPROLANE_ARCHIVER_LAKE_KIND=parquet)")
    store = _audit_store(settings)
    gate = operator_gate(store, operator_key_file)
    target = f"index of {day or 'every day'}" + (" (overwrite invalid)" if overwrite else "")
    tenant = gate.scope("lake.rebuild-index", target, tenant)
    gate.authorise("lake.rebuild-index", target, tenant)
    report = Lake.from_settings(settings).rebuild_index(store, day, tenant=tenant, overwrite=overwrite)
    counts = report.counts()
    typer.echo(
        f"s3://{settings.s3_bucket}/{INDEX_PREFIX}: {counts['written']} written, {counts['repaired']} repaired, "
        f"{counts['kept']} kept, {counts['kept_other']} kept pointing elsewhere, {counts['invalid']} invalid left, "
        f"{counts['skipped']} lake rows skipped"
    )
    for name in ("written", "repaired", "kept_other", "invalid", "skipped"):
        for line in getattr(report, name):
            typer.echo(f"  {name}: {line}")


keys_app = typer.Typer(help="Per-tenant data keys of encrypted tenants.", add_completion=False)


def _keyring(settings: LakeSettings):  # type: ignore[no-untyped-def]
    from capture.ledger.sealing import Keyring

    return Keyring(_s3_client(settings), settings.keys_bucket, None)


@keys_app.command("list")
def keys_list_cmd(tenant: Annotated[str, typer.Argument(help="tenant id")]) -> None:
    """The tenant's stored data key ids, oldest first.

    Example: reprolane keys tenant list acme
    """
    ids = _keyring(LakeSettings()).key_ids(tenant)
    for key_id in ids:
        typer.echo(key_id)


@keys_app.command("shred")
def keys_shred_cmd(
    tenant: Annotated[str, typer.Argument(help="tenant id")],
    yes: Annotated[bool, typer.Option("--yes", help="confirm: this cannot be undone")] = False,
    operator_key_file: OperatorKeyFileOpt = None,
) -> None:
    """Destroy every data key of TENANT: its sealed records stay in place and can never be read again (needs
    key-admin for TENANT).

    Example: reprolane keys tenant shred acme --yes --operator-key-file alice.key
    """
    if not yes:
        raise typer.BadParameter(
            f"shredding tenant {tenant}'s keys makes its records unreadable forever; pass --yes to do it"
        )
    settings = LakeSettings()
    operator_gate(_audit_store(settings), operator_key_file).authorise("keys.shred", tenant, tenant)
    deleted = _keyring(settings).shred(tenant)
    typer.echo(f"tenant {tenant}: {deleted} key objects destroyed in s3://{settings.keys_bucket}/{DATA_KEYS_PREFIX}")
