"""SQL over the audit lake with DuckDB: ``reprolane audit query "SQL"``.

DuckDB's S3 support (the ``httpfs`` extension) is downloaded from the internet on first use, which a closed
network cannot do, and the PyPI wheel does not bundle it. So the lake's files are opened with pyarrow's own
S3 filesystem as Arrow datasets and *registered* in DuckDB (projection and filter pushdown still apply); that
works offline and with any S3 pyarrow reaches.

The SQL is the caller's, so once the lake is registered the connection is shut: no file or network access
(``read_text('/etc/passwd')``, ``COPY ... TO``, ``ATTACH``), no extension installed or loaded, no scan of a
Python variable by name, and the configuration locked so a ``SET`` cannot undo any of it (`LOCKDOWN`). What
such a statement gets is `QueryError` (bad input, exit 2), not a result. The registered Arrow datasets are
read by pyarrow, outside DuckDB's file system, so the views keep working.

Views (every query sees these names):

- ``envelopes``: one row per *production* envelope id (at-least-once copies collapsed: the first archived copy
  wins); a shadow envelope (``shadow`` true: a candidate's answer to a sampled production request, same
  request id) is not in it, so counts per request or per runtime mean what they meant before shadowing;
- ``shadows``: one row per shadow envelope id (``shadow_candidate``, ``shadow_production_envelope_id``);
- ``shadow_pairs``: one row per shadow with the production envelope it names: both runtimes, outcomes,
  lengths, finish reasons and texts, ``token_identical`` and ``first_divergence_position`` (the first index
  where the choice-0 token ids differ; NULL when identical or not comparable) and ``paired`` (false: the
  production envelope is not in the lake, yet or at all). The full per-pair judgement (levels, logprobs,
  semantic similarity) is ``reprolane release gate --shadow``'s;
- ``all_envelopes``: production and shadow envelopes, one row per envelope id;
- ``divergences``: one row per replay result id;
- ``replays``: result id, envelope, lane, verdict and the replay result's S3 key (needs the envelope's
  capture day, so ``s3_key`` is NULL for a result whose envelope is not in the lake);
- ``verification``: one row per production envelope: ``verified`` (a replay result of it is in the lake), the
  first one's ``result_id``, ``lane``, ``verdict`` and ``replayed_at``, and ``lag_s`` (replayed at - captured at);
  ``verifiable`` is false for a record with no output to replay (an error, a started record): the share of
  traffic verified is ``avg(verified::int) FILTER (WHERE verifiable)``;
- ``envelopes_raw`` / ``divergences_raw``: the files as written, duplicates (and shadows) included.

A file written before the shadow columns existed reads them as NULL, and NULL is "not a shadow"; one written before
``client_request_id`` existed reads it as NULL too (as does a request whose client sent no ``X-Request-Id``).

Over the Iceberg lake (`capture.audit.lake.iceberg`) the same views are built from PyIceberg scans registered
as Arrow tables (DuckDB's iceberg extension is a download too); the ``*_raw`` views equal the others there.

Only partitions with more than one file are deduplicated (a window over their rows): every single file is
duplicate-free (see `Lake.split_datasets`), so on a compacted lake the views cost nothing over the raw scan.

``date`` and ``tenant`` are the Hive partition columns (strings, ``YYYY-MM-DD``); for envelopes the date is the
capture day, for divergences the replay day. Examples::

    -- divergence rate by runtime fingerprint per day
    SELECT e.date, e.runtime_sha256, count(*) AS replays,
           avg(CASE WHEN d.verdict IN ('bitwise', 'token') THEN 0 ELSE 1 END) AS divergence_rate
    FROM divergences d JOIN envelopes e USING (envelope_id) GROUP BY ALL ORDER BY ALL;
    -- top first-divergence positions by model
    SELECT e.model, d.first_divergence_position AS position, count(*) AS n
    FROM divergences d JOIN envelopes e USING (envelope_id)
    WHERE d.first_divergence_position IS NOT NULL GROUP BY ALL ORDER BY n DESC, position LIMIT 10;
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from capture.audit.errors import LakeError
from capture.audit.lake.iceberg import IcebergLake
from capture.audit.lake.schema import DEDUPE_KEY, TABLES
from capture.audit.lake.store import Lake
from schemas.layout import replay_key_sql

TABLE_VIEWS = """
CREATE VIEW {t}_raw AS SELECT * FROM {t}_single UNION ALL SELECT * FROM {t}_multi;
CREATE VIEW {view} AS SELECT * FROM {t}_single UNION ALL (SELECT * FROM {t}_multi
    QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY archived_at) = 1);
"""
#: The deduplicated view of each table (``envelopes`` is then production's part of ``all_envelopes``).
DEDUPED_VIEW = {"envelopes": "all_envelopes", "divergences": "divergences"}
#: Over ``all_envelopes``, in both lakes: production, shadows, and the pairs (module docstring).
SHADOW_VIEWS = """
CREATE VIEW envelopes AS SELECT * FROM all_envelopes WHERE shadow IS NOT TRUE;
CREATE VIEW shadows AS SELECT * FROM all_envelopes WHERE shadow;
CREATE VIEW shadow_pairs AS
    SELECT s.request_id, s.tenant, s.date, s.shadow_candidate AS candidate,
           s.shadow_production_envelope_id AS production_envelope_id, s.envelope_id AS shadow_envelope_id,
           p.envelope_id IS NOT NULL AS paired, p.captured_at AS production_captured_at,
           s.captured_at AS shadow_captured_at, p.model,
           p.runtime_sha256 AS production_runtime_sha256, s.runtime_sha256 AS candidate_runtime_sha256,
           p.outcome_kind AS production_outcome, s.outcome_kind AS candidate_outcome,
           s.error_type AS candidate_error_type,
           p.output_len AS production_len, s.output_len AS candidate_len,
           p.finish_reason AS production_finish, s.finish_reason AS candidate_finish,
           CASE WHEN p.output_token_ids IS NULL OR s.output_token_ids IS NULL THEN NULL
                ELSE p.output_token_ids = s.output_token_ids END AS token_identical,
           CASE WHEN p.output_token_ids IS NULL OR s.output_token_ids IS NULL
                     OR p.output_token_ids = s.output_token_ids THEN NULL
                ELSE list_filter(range(greatest(len(p.output_token_ids), len(s.output_token_ids))),
                                 lambda i: p.output_token_ids[i + 1] IS DISTINCT FROM s.output_token_ids[i + 1])[1]
           END AS first_divergence_position,
           p.output_text AS production_text, s.output_text AS candidate_text
    FROM shadows s LEFT JOIN envelopes p ON p.envelope_id = s.shadow_production_envelope_id;
"""
VIEWS = f"""
CREATE VIEW replays AS
    SELECT d.result_id, d.envelope_id, d.request_id, d.tenant, d.lane, d.lane_fingerprint_sha256, d.verdict,
           d.target_met, d.replayed_at, d.date AS replay_date,
           {replay_key_sql("e.date", "d.envelope_id", "d.result_id")} AS s3_key
    FROM divergences d LEFT JOIN envelopes e USING (envelope_id);
"""

#: Over ``envelopes`` and ``replays``, in both lakes (module docstring).
VERIFICATION_VIEW = """
CREATE VIEW verification AS
    SELECT e.envelope_id, e.request_id, e.tenant, e.date, e.captured_at, e.flagged,
           coalesce(e.sealed OR e.outcome_kind = 'output', false) AS verifiable,
           v.result_id IS NOT NULL AS verified, v.result_id, v.lane, v.verdict, v.replayed_at,
           epoch(v.replayed_at) - epoch(e.captured_at) AS lag_s
    FROM envelopes e LEFT JOIN (
        SELECT * FROM replays QUALIFY row_number() OVER (PARTITION BY envelope_id ORDER BY replayed_at, result_id) = 1
    ) v USING (envelope_id);
"""

#: Applied after the lake's datasets are registered; ``lock_configuration`` last, so nothing after it can
#: change the others (DuckDB's names, checked against the installed version by tests/capture/audit/lake/test_query.py).
LOCKDOWN = (
    "SET python_enable_replacements = false",
    "SET autoinstall_known_extensions = false",
    "SET autoload_known_extensions = false",
    "SET allow_community_extensions = false",
    "SET enable_external_access = false",
    "SET lock_configuration = true",
)


class QueryError(LakeError):
    """The SQL itself was refused (syntax, unknown column, ...): the caller's input, not the lake."""


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]


#: ``date`` as the Hive lake has it: the UTC day of the partition time, ``YYYY-MM-DD`` (no time zone extension).
_DAY = "CAST(CAST(make_timestamp(epoch_us({c})) AS DATE) AS VARCHAR)"
ICEBERG_VIEWS = f"""
CREATE VIEW all_envelopes AS SELECT *, {_DAY.format(c="captured_at")} AS date FROM envelopes_table;
{SHADOW_VIEWS}
CREATE VIEW divergences AS SELECT *, {_DAY.format(c="replayed_at")} AS date FROM divergences_table;
CREATE VIEW replays_dated AS SELECT *, {_DAY.format(c="replayed_at")} AS date FROM replays_table;
CREATE VIEW envelopes_raw AS SELECT * FROM all_envelopes;
CREATE VIEW divergences_raw AS SELECT * FROM divergences;
CREATE VIEW replays AS
    SELECT r.result_id, r.envelope_id, r.request_id, r.tenant, r.lane, r.lane_fingerprint_sha256, r.verdict,
           r.target_met, r.replayed_at, r.date AS replay_date,
           {replay_key_sql("e.date", "r.envelope_id", "r.result_id")} AS s3_key
    FROM replays_dated r LEFT JOIN envelopes e USING (envelope_id);
"""


def _connect_iceberg(con: Any, lake: IcebergLake, day: str | None) -> None:
    """The Iceberg tables' current data files, as PyIceberg plans them, registered as Arrow datasets (DuckDB's
    iceberg extension is a download, like httpfs). Ids are unique by construction (`IcebergLake.append_new`), so
    ``*_raw`` equal the views."""
    for table in (*TABLES, "replays"):
        con.register(f"{table}_table", lake.dataset(table, day))
    con.execute(ICEBERG_VIEWS)
    con.execute(VERIFICATION_VIEW)


def connect(lake: Lake | IcebergLake, day: str | None = None) -> Any:
    """A DuckDB connection with the lake's tables (of one partition day, if given) and the views, locked down
    (`LOCKDOWN`): it reads the lake and nothing else."""
    import duckdb

    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    if isinstance(lake, IcebergLake):
        _connect_iceberg(con, lake, day)
        for statement in LOCKDOWN:
            con.execute(statement)
        return con
    for table in TABLES:
        single, multi = lake.split_datasets(table, day)
        con.register(f"{table}_single", single)
        con.register(f"{table}_multi", multi)
        con.execute(TABLE_VIEWS.format(t=table, view=DEDUPED_VIEW[table], key=DEDUPE_KEY[table]))
    con.execute(SHADOW_VIEWS)
    con.execute(VIEWS)
    con.execute(VERIFICATION_VIEW)
    for statement in LOCKDOWN:
        con.execute(statement)
    return con


def run_query(lake: Lake | IcebergLake, sql: str, day: str | None = None) -> QueryResult:
    import duckdb

    con = connect(lake, day)
    try:
        rel = con.sql(sql)
        if rel is None:  # a statement without a result (SET, CREATE VIEW ...)
            return QueryResult([], [])
        return QueryResult(list(rel.columns), rel.fetchall())
    except (duckdb.ParserException, duckdb.BinderException, duckdb.CatalogException) as exc:
        raise QueryError(f"query: {str(exc).splitlines()[0]}") from exc
    except duckdb.PermissionException as exc:  # the lockdown said no
        raise QueryError(f"query refused: {str(exc).splitlines()[0]} (only the lake's views can be read)") from exc
    except duckdb.InvalidInputException as exc:  # e.g. a SET of a locked option
        raise QueryError(f"query refused: {str(exc).splitlines()[0]}") from exc
    except duckdb.Error as exc:
        raise LakeError(f"query failed: {str(exc).splitlines()[0]}") from exc
    finally:
        con.close()


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, datetime | date):
        return value.isoformat()
    return str(value)


def render_table(result: QueryResult) -> str:
    """An aligned text table (numbers right-aligned) with a row count."""
    cells = [[_text(v) for v in row] for row in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    numeric = [
        all(isinstance(r[i], int | float | Decimal) or r[i] is None for r in result.rows) for i in range(len(widths))
    ]

    def line(values: list[str]) -> str:
        out = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(out).rstrip()

    lines = [line(result.columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells]
    lines.append(f"({len(result.rows)} row{'s' if len(result.rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def render_json(result: QueryResult) -> str:
    docs = [{c: _jsonable(v) for c, v in zip(result.columns, row, strict=True)} for row in result.rows]
    return json.dumps(docs, indent=2, ensure_ascii=False) + "\n"


def render_csv(result: QueryResult) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(result.columns)
    writer.writerows([["" if v is None else _jsonable(v) for v in row] for row in result.rows])
    return buf.getvalue()
