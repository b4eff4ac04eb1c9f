"""The object-key layout, byte for byte: every key and prefix a service writes or reads, and their parsers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import duckdb

from schemas import layout
from tests.factories import FIXED_TIME

DAY = "2026-07-14"  # FIXED_TIME's UTC day
EID = "e" * 64
RID = "r" * 64


def test_capture_day_is_the_utc_day() -> None:
    assert layout.capture_day(FIXED_TIME) == DAY
    late_evening_west = datetime(2026, 7, 13, 23, 30, tzinfo=timezone(timedelta(hours=-5)))
    assert layout.capture_day(late_evening_west) == "2026-07-14"


def test_envelope_keys_and_their_parsers() -> None:
    key = layout.envelope_key(EID, "acme", FIXED_TIME)
    assert key == f"envelopes/tenant=acme/date={DAY}/{EID}.json"
    assert layout.tenant_envelopes_prefix("acme") == "envelopes/tenant=acme/"
    assert layout.envelope_day_prefix("acme", DAY) == f"envelopes/tenant=acme/date={DAY}/"
    assert layout.date_prefix("envelopes/anything/", DAY) == f"envelopes/anything/date={DAY}/"
    assert key.startswith(layout.envelope_day_prefix("acme", DAY))
    assert key.startswith(layout.ENVELOPES_PREFIX)
    assert layout.envelope_day_infix(DAY) in key
    assert layout.is_envelope_key(key)
    assert not layout.is_envelope_key("envelopes/tenant=acme/")
    assert layout.envelope_id_of_key(key) == EID
    assert layout.capture_day_of_key(key) == DAY
    assert layout.capture_day_of_key("index/request-id/r.json") is None
    assert layout.partition_value(key, "tenant") == "acme"
    assert layout.partition_value(key, "date") == DAY
    assert layout.partition_value("audit/log/day=2026-07-14/", "day") == DAY
    assert layout.partition_value(key, "day") is None


def test_index_keys_and_body() -> None:
    assert layout.request_index_key("req-1") == "index/request-id/req-1.json"
    assert layout.workflow_index_prefix("wf-1") == "index/workflow/wf-1/"
    assert layout.workflow_index_key("wf-1", 3, "req-9") == "index/workflow/wf-1/000003-req-9.json"
    assert layout.request_index_key("r").startswith(layout.INDEX_PREFIX)
    body = layout.index_body(EID, "envelopes/k.json", "acme", FIXED_TIME.astimezone(timezone(timedelta(hours=2))))
    assert body == (
        b'{"captured_at":"2026-07-14T09:30:00.123456Z","envelope_id":"' + EID.encode() + b'","key":"envelopes/k.json",'
        b'"tenant":"acme"}'
    )


def test_replay_keys_and_their_sql_form() -> None:
    key = layout.replay_key(EID, RID, FIXED_TIME)
    assert key == f"replays/date={DAY}/{EID}/{RID}.json"
    assert layout.replay_results_prefix(EID, FIXED_TIME) == f"replays/date={DAY}/{EID}/"
    sql = layout.replay_key_sql("d", "e", "r")
    assert duckdb.sql(f"SELECT {sql} AS k FROM (SELECT '{DAY}' AS d, '{EID}' AS e, '{RID}' AS r)").fetchall() == [
        (key,)
    ]


def test_merkle_log_keys() -> None:
    assert layout.log_id(DAY) == f"day={DAY}"
    assert layout.leaves_prefix(DAY) == f"audit/log/day={DAY}/leaves/"
    assert layout.leaves_key(DAY, 42) == f"audit/log/day={DAY}/leaves/000000000042.bin"
    assert layout.is_leaves_key(layout.leaves_key(DAY, 42))
    assert layout.leaves_start(layout.leaves_key(DAY, 42)) == 42
    assert layout.leaves_prefix(DAY).startswith(layout.LOG_PREFIX)
    assert layout.checkpoints_prefix(DAY) == f"audit/checkpoints/day={DAY}/"
    assert layout.checkpoint_key(DAY, 3) == f"audit/checkpoints/day={DAY}/000000000003.json"
    assert layout.checkpoint_key(DAY, 3).endswith(layout.checkpoint_key_suffix(3))
    ran = datetime(2026, 7, 14, 9, 30, 1, 5, tzinfo=UTC)
    assert layout.expiry_report_key(ran, "abcd1234") == "audit/expiry/20260714T093001000005Z-abcd1234.json"
    assert layout.CHECKPOINTS_PREFIX == "audit/checkpoints/"
    assert layout.EXPIRY_PREFIX == "audit/expiry/"


def test_data_keys_and_lake_keys() -> None:
    assert layout.data_key_prefix("acme") == "keys/tenant=acme/"
    assert layout.data_key_key("acme", "k1") == "keys/tenant=acme/k1.json"
    assert layout.data_key_id("acme", layout.data_key_key("acme", "20261201T000000Z-abc")) == "20261201T000000Z-abc"
    assert layout.data_key_prefix("acme").startswith(layout.DATA_KEYS_PREFIX)
    assert layout.lake_table_prefix("envelopes") == "lake/envelopes/"
    assert layout.lake_day_prefix("envelopes", DAY) == f"lake/envelopes/date={DAY}/"
    assert layout.lake_partition_prefix("envelopes", DAY, "acme", "x/y") == f"x/y/envelopes/date={DAY}/tenant=acme/"
    part = layout.lake_part_key("divergences", DAY, "acme", "u1")
    assert part == f"lake/divergences/date={DAY}/tenant=acme/part-u1.parquet"
    assert layout.is_lake_part(part)
