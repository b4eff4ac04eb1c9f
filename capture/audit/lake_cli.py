"""The lake and key commands; `infra.cli` registers them.

    reprolane query "SQL" [--date D] [--json | --csv]      DuckDB over the lake (views: capture.audit.query)
    reprolane archiver serve                               run the archiver until SIGINT/SIGTERM
    reprolane lake compact [--date D] [--table T]          merge + dedupe each partition's small files
    reprolane lake rebuild-index [--date D] [--overwrite]  write lost request-id/workflow index objects back
    reprolane keys list TENANT                             the tenant's stored data key ids
    reprolane keys shred TENANT --yes                      destroy the tenant's data keys (crypto-shredding)

Settings: `LakeSettings` (``REPROLANE_ARCHIVER_*``; a running local stack provides the defaults). The commands
raise: ``typer.BadParameter`` for bad input (bad SQL, bad date, missing --yes), a `capture.audit.errors.LakeError`
or a `capture.ledger.errors.KeyringError` when S3 or Kafka failed; the root of the command line (`infra.cli`)
prints one line on stderr, ``reprolane: error: ...``, and exits 2 or 1.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Annotated, Any

import typer

from capture.audit.lake import Lake
from capture.audit.lake_schema import TABLES
from capture.audit.lake_settings import LakeSettings
from capture.audit.query import QueryError, render_csv, render_json, render_table, run_query
from infra.clients.s3 import S3Policy, make_s3_client
from schemas.layout import DATA_KEYS_PREFIX, INDEX_PREFIX

_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")

DateOpt = Annotated[
    str | None,
    typer.Option(
        "--date", help="only partitions of this day, YYYY-MM-DD (envelopes: capture day, divergences: replay day)"
    ),
]


def _day(value: str | None) -> str | None:
    if value is not None and not _DAY.match(value):
        raise typer.BadParameter(f"--date must be YYYY-MM-DD, not {value!r}")
    return value


def _s3_client(settings: LakeSettings) -> Any:
    return make_s3_client(settings, policy=S3Policy.AUDIT)


def query_command(
    sql: Annotated[str, typer.Argument(help="SQL over the views envelopes, divergences, replays")],
    date: DateOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="rows as a JSON array of objects")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="rows as CSV with a header")] = False,
) -> None:
    """Run SQL (DuckDB) over the audit lake and print the rows as an aligned table."""
    if as_json and as_csv:
        raise typer.BadParameter("--json and --csv exclude each other")
    day = _day(date)
    lake = Lake.from_settings(LakeSettings())
    try:
        result = run_query(lake, sql, day)
    except QueryError as exc:  # the SQL does not run: bad input
        raise typer.BadParameter(str(exc)) from exc
    render = render_json if as_json else render_csv if as_csv else render_table
    typer.echo(render(result), nl=False)


archiver_app = typer.Typer(help="The archiver service (Kafka -> Parquet audit lake).", add_completion=False)


@archiver_app.callback()
def _archiver_group() -> None:
    """The archiver service (Kafka -> Parquet audit lake)."""


@archiver_app.command("serve")
def archiver_serve_cmd() -> None:
    """Consume envelopes and divergence events into the lake until SIGINT/SIGTERM."""
    from capture.audit.archiver import Archiver, run_until_signalled

    settings = LakeSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_until_signalled(Archiver(settings, Lake.from_settings(settings))))


lake_app = typer.Typer(help="The audit lake: compaction, request-id index rebuild.", add_completion=False)


@lake_app.command("compact")
def compact_cmd(
    date: DateOpt = None,
    table: Annotated[str | None, typer.Option("--table", help="envelopes | divergences (default: both)")] = None,
) -> None:
    """Merge each partition's small files into one, dropping duplicate rows."""
    day = _day(date)
    if table is not None and table not in TABLES:
        raise typer.BadParameter(f"--table must be one of {', '.join(TABLES)}, not {table!r}")
    lake = Lake.from_settings(LakeSettings())
    for name in [table] if table else list(TABLES):
        r = lake.compact(name, day)
        typer.echo(
            f"{name}: {r.partitions} partitions compacted, {r.files_read} files -> {r.files_written}, "
            f"{r.rows_in} rows -> {r.rows_out}"
        )


@lake_app.command("rebuild-index")
def rebuild_index_cmd(
    date: DateOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="rewrite existing index objects too")] = False,
) -> None:
    """Write the request-id (and workflow) index objects back from the lake's envelopes."""
    day = _day(date)
    settings = LakeSettings()
    written = Lake.from_settings(settings).rebuild_index(
        _s3_client(settings), settings.s3_bucket, day, overwrite=overwrite
    )
    typer.echo(f"{written} index objects written to s3://{settings.s3_bucket}/{INDEX_PREFIX}")


keys_app = typer.Typer(help="Per-tenant data keys of encrypted tenants.", add_completion=False)


def _keyring(settings: LakeSettings):  # type: ignore[no-untyped-def]
    from capture.ledger.sealing import Keyring

    return Keyring(_s3_client(settings), settings.keys_bucket, None)


@keys_app.command("list")
def keys_list_cmd(tenant: Annotated[str, typer.Argument(help="tenant id")]) -> None:
    """The tenant's stored data key ids, oldest first."""
    ids = _keyring(LakeSettings()).key_ids(tenant)
    for key_id in ids:
        typer.echo(key_id)


@keys_app.command("shred")
def keys_shred_cmd(
    tenant: Annotated[str, typer.Argument(help="tenant id")],
    yes: Annotated[bool, typer.Option("--yes", help="confirm: this cannot be undone")] = False,
) -> None:
    """Destroy every data key of TENANT: its sealed records stay in place and can never be read again."""
    if not yes:
        raise typer.BadParameter(
            f"shredding tenant {tenant}'s keys makes its records unreadable forever; pass --yes to do it"
        )
    settings = LakeSettings()
    deleted = _keyring(settings).shred(tenant)
    typer.echo(f"tenant {tenant}: {deleted} key objects destroyed in s3://{settings.keys_bucket}/{DATA_KEYS_PREFIX}")
