"""Where records live: Kafka topics and headers, and the S3 object-key layout.

Every key, prefix and partition path any service writes or reads is a function or constant here; nobody else
spells ``"index/..."``. Kafka (at-least-once: duplicates are expected and collapse by envelope id):

    reprolane.envelopes.v1        key = the engine it ran on (else request_id; header `HEADER_REQUEST_ID`),
                                  value = the envelope: canonical JSON or compact (header `HEADER_ENCODING`;
                                  `schemas.envelope_compact`)
    reprolane.divergences.v1      key = request_id, value = DivergenceEvent JSON
    reprolane.replay-requests.v1  key = request_id, value = ReplayRequest JSON (on-demand replays)
    reprolane.dead-letter.v1      key = original key, value = original bytes, reason in headers
    reprolane.schedules.v1        key = engine id, value = one closed schedule segment (`schemas.schedule_delivery`),
                                  headers engine id, segment seq and sha256 (duplicates collapse by engine + seq)
    reprolane.replayer-heartbeats.v1  key = consumer group, value = ReplayerHeartbeat JSON (who serves requests)

An envelope over `CLAIM_CHECK_BYTES` travels on the envelope topic as a `schemas.claim_check.ClaimCheck` (header
`HEADER_CLAIM_CHECK`) naming its envelope object; the capture side's dead letters (records a sink refused for
good) carry `HEADER_DLQ_REASON`, `HEADER_DLQ_SINK` and `HEADER_ENVELOPE_ID`, and their value is the record itself
when it fits in `MAX_MESSAGE_BYTES` (else empty: the sidecar's local quarantine holds it).

S3, the audit bucket (Object Lock; every object is written once, keys are content addresses):

    envelopes/tenant=<tenant>/date=<YYYY-MM-DD>/<envelope_id>.json           envelope_key
    index/request-id/<request_id>.json                                       request_index_key
    index/workflow/<workflow_id>/<step:06d>-<request_id>.json                 workflow_index_key
    index/client-request-id/tenant=<t>/<client_id>/<request_id>.json          client_request_index_key
    index/shadow/date=<YYYY-MM-DD>/<request_id>.json                           shadow_index_key (a shadow's day)
    replays/date=<YYYY-MM-DD>/<envelope_id>/<result_id>.json                 replay_key (date: the envelope's)
    audit/log/day=<YYYY-MM-DD>/leaves/<start:012d>.bin                       leaves_key: Merkle-log leaf batches
    audit/checkpoints/day=<YYYY-MM-DD>/<tree_size:012d>.json                 checkpoint_key: signed checkpoints
    audit/log/schedules/engine=<engine_id>/leaves/<start:012d>.bin           an engine's schedule log (`schedule_log`):
    audit/checkpoints/schedules/engine=<engine_id>/<size:012d>.checkpoint     one leaf per segment, checkpoints alike
    audit/expiry/<YYYYmmddTHHMMSSffffffZ>-<uuid8>.json                       expiry_report_key
    audit/access/date=<YYYY-MM-DD>/<YYYYmmddTHHMMSSffffffZ>-<id>.json        access_log_key: every operator action
                                                                             (CLI and console, one AccessRecord each)
    schedules/engine=<engine_id>/<seq:08d>.jsonl                              schedule_segment_key: one closed
                                                                              segment of an engine's schedule log
    index/schedule/<external_request_id>/<engine_request_id>.json            schedule_index_key: a request's
                                                                              arrival (`ScheduleIndexEntry`)
    environments/deployment=<d>/known-good/<YYYYmmddTHHMMSSffffffZ>-<record_id>.json  known_good_key

An index object's body is `index_body`: ``{"captured_at", "envelope_id", "key", "tenant"}`` (sorted, compact).
The day of an envelope key, a Merkle log and a replay result is always the envelope's *capture* day
(`capture_day`, UTC), so a day's log and a day's objects compare one to one, and a replay result's key is a
function of (envelope, lane fingerprint) only, never of when the replay ran: a re-replay after a crash (or on
another day) lands on the same key and collapses to one result. An encrypted tenant's envelope object (and
Kafka value) holds a `schemas.sealed.SealedEnvelope` instead, under the same key (``envelope_id`` is the
plaintext's hash either way).

Lake bucket (no Object Lock: compaction rewrites files, shredding deletes keys):

    lake/<table>/date=<YYYY-MM-DD>/tenant=<tenant>/part-<uuid>.parquet   lake_part_key: Hive-partitioned lake
    keys/tenant=<tenant>/<key_id>.json                                   data_key_key: a wrapped data key
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Final

LAKE_BUCKET: Final = "reprolane-lake"
#: The Iceberg lake's table bucket (S3 Tables; one REST catalog warehouse) in the local stack.
ICEBERG_TABLE_BUCKET: Final = "reprolane-tables"

TOPIC_ENVELOPES: Final = "reprolane.envelopes.v1"
TOPIC_DIVERGENCES: Final = "reprolane.divergences.v1"
TOPIC_REPLAY_REQUESTS: Final = "reprolane.replay-requests.v1"
TOPIC_DEAD_LETTER: Final = "reprolane.dead-letter.v1"
TOPIC_SCHEDULES: Final = "reprolane.schedules.v1"
TOPIC_REPLAYER_HEARTBEATS: Final = "reprolane.replayer-heartbeats.v1"
ALL_TOPICS: Final = (
    TOPIC_ENVELOPES,
    TOPIC_DIVERGENCES,
    TOPIC_REPLAY_REQUESTS,
    TOPIC_DEAD_LETTER,
    TOPIC_SCHEDULES,
    TOPIC_REPLAYER_HEARTBEATS,
)

#: Largest record a producer may send and a consumer must accept (topics are created with this
#: ``max.message.bytes``): an 8k-token output with top-20 logprobs is about 3 MiB of JSON.
MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024

HEADER_ENVELOPE_ID: Final = "reprolane-envelope-id"
#: The request id of an envelope record: its Kafka key is the engine it ran on (`capture.settings`'s ``kafka_key``),
#: so a reader that looks for requests reads this header.
HEADER_REQUEST_ID: Final = "reprolane-request-id"
HEADER_SCHEMA: Final = "reprolane-schema"
HEADER_DLQ_REASON: Final = "reprolane-dlq-reason"
HEADER_DLQ_SOURCE: Final = "reprolane-dlq-source"
#: How an envelope's bytes are encoded (`ENCODING_JSON` or `ENCODING_COMPACT`): the Kafka header of an envelope
#: record, and through `content_type` the S3 object's Content-Type. Informational: readers tell the encoding
#: from the bytes themselves (`COMPACT_MAGIC`), so a record without the header, or with a wrong one, still reads.
HEADER_ENCODING: Final = "reprolane-encoding"
ENCODING_JSON: Final = "json"
ENCODING_COMPACT: Final = "compact/1"
#: The first bytes of a compact envelope (`schemas.envelope_compact`): never the start of JSON, nor of UTF-8 text.
COMPACT_MAGIC: Final = b"\xd2RLC"
_CONTENT_TYPES: Final = {
    ENCODING_JSON: "application/json",
    ENCODING_COMPACT: "application/vnd.reprolane.envelope+compact",
}


def content_type(encoding: str) -> str:
    """The S3 Content-Type of an envelope object in `encoding` (the key stays ``<envelope_id>.json`` either way:
    a key is the envelope's content address, and every reader finds its encoding in the bytes)."""
    return _CONTENT_TYPES[encoding]


HEADER_ENGINE_ID: Final = "reprolane-engine-id"
HEADER_SEGMENT_SEQ: Final = "reprolane-segment-seq"
HEADER_SEGMENT_SHA256: Final = "reprolane-segment-sha256"

ENVELOPES_PREFIX: Final = "envelopes/"
INDEX_PREFIX: Final = "index/"
REPLAYS_PREFIX: Final = "replays/"
LOG_PREFIX: Final = "audit/log/"
CHECKPOINTS_PREFIX: Final = "audit/checkpoints/"
EXPIRY_PREFIX: Final = "audit/expiry/"
ACCESS_LOG_PREFIX: Final = "audit/access/"
DATA_KEYS_PREFIX: Final = "keys/"
SCHEDULES_PREFIX: Final = "schedules/"
SCHEDULE_INDEX_PREFIX: Final = f"{INDEX_PREFIX}schedule/"
ENVIRONMENTS_PREFIX: Final = "environments/"
#: The lake's default key prefix in the lake bucket (``REPROLANE_ARCHIVER_LAKE_PREFIX`` changes it).
LAKE_PREFIX: Final = "lake"

_DATE_PARTITION = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/")


# ---------------------------------------------------------------------------------------------------- days


def capture_day(at: datetime) -> str:
    """``YYYY-MM-DD`` of `at` in UTC: the ``date=`` of envelope and replay keys, the day of a Merkle log."""
    return at.astimezone(UTC).strftime("%Y-%m-%d")


def partition_value(path: str, name: str) -> str | None:
    """The value of the Hive-style segment ``<name>=<value>`` in a key or prefix (``tenant``, ``date``, ``day``);
    the innermost one when there are several."""
    for segment in reversed(path.split("/")):
        if segment.startswith(f"{name}="):
            return segment.removeprefix(f"{name}=")
    return None


# ----------------------------------------------------------------------------------------------- envelopes


def tenant_envelopes_prefix(tenant: str) -> str:
    return f"{ENVELOPES_PREFIX}tenant={tenant}/"


def date_prefix(prefix: str, day: str) -> str:
    """A folder (`prefix`, ending in ``/``) narrowed to its ``date=`` partition of `day` (``YYYY-MM-DD``)."""
    return f"{prefix}date={day}/"


def envelope_day_prefix(tenant: str, day: str) -> str:
    """Every envelope of `tenant` captured on `day` (``YYYY-MM-DD``)."""
    return date_prefix(tenant_envelopes_prefix(tenant), day)


def envelope_key(envelope_id: str, tenant: str, captured_at: datetime) -> str:
    return f"{envelope_day_prefix(tenant, capture_day(captured_at))}{envelope_id}.json"


def envelope_day_infix(day: str) -> str:
    """``/date=D/``: the part every envelope key of capture day D has, whatever its tenant (a filter over a
    listing of `ENVELOPES_PREFIX`)."""
    return f"/date={day}/"


def is_envelope_key(key: str) -> bool:
    """True for a key under `ENVELOPES_PREFIX` that names an envelope object (not a folder marker or stray file)."""
    return key.endswith(".json")


def envelope_id_of_key(key: str) -> str:
    """The envelope id an envelope key names (its file name without ``.json``)."""
    return key.rsplit("/", 1)[-1].removesuffix(".json")


def capture_day_of_key(key: str) -> str | None:
    """The capture day in an envelope (or replay) key's ``date=`` segment; None when it has none."""
    match = _DATE_PARTITION.search(key)
    return match.group(1) if match else None


# -------------------------------------------------------------------------------------------------- index


def request_index_key(request_id: str) -> str:
    return f"{INDEX_PREFIX}request-id/{request_id}.json"


def workflow_index_prefix(workflow_id: str) -> str:
    return f"{INDEX_PREFIX}workflow/{workflow_id}/"


def workflow_index_key(workflow_id: str, step: int, request_id: str) -> str:
    return f"{workflow_index_prefix(workflow_id)}{step:06d}-{request_id}.json"


def client_request_index_prefix(tenant: str, client_request_id: str) -> str:
    """Every envelope a tenant's client sent under one ``X-Request-Id`` (its retries each have their own key)."""
    return f"{INDEX_PREFIX}client-request-id/tenant={tenant}/{client_request_id}/"


def client_request_index_key(tenant: str, client_request_id: str, request_id: str) -> str:
    """One envelope's client-request-id index object, written once (``IfNoneMatch``)."""
    return f"{client_request_index_prefix(tenant, client_request_id)}{request_id}.json"


def shadow_index_prefix(day: str) -> str:
    """Every shadow envelope (`schemas.envelope.ShadowMarker`) captured on `day`: a shadow has the production
    request's id, so it must never take the request's own write-once index entries."""
    return f"{INDEX_PREFIX}shadow/date={day}/"


def shadow_index_key(day: str, request_id: str) -> str:
    return f"{shadow_index_prefix(day)}{request_id}.json"


def index_body(envelope_id: str, key: str, tenant: str, captured_at: datetime) -> bytes:
    """The body of an index object: where the envelope is, byte for byte as the capture sink writes it."""
    body = {
        "envelope_id": envelope_id,
        "key": key,
        "tenant": tenant,
        "captured_at": captured_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# ------------------------------------------------------------------------------------------------ replays


def replay_results_prefix(envelope_id: str, captured_at: datetime) -> str:
    """Every replay result of one envelope (any lane)."""
    return f"{date_prefix(REPLAYS_PREFIX, capture_day(captured_at))}{envelope_id}/"


def replay_key(envelope_id: str, result_id: str, captured_at: datetime) -> str:
    """Pass the envelope's ``captured_at`` (not the replay time): the key must not change between re-replays."""
    return f"{replay_results_prefix(envelope_id, captured_at)}{result_id}.json"


def replay_key_sql(day: str, envelope_id: str, result_id: str) -> str:
    """`replay_key` as a SQL string expression over three column expressions (the lake's ``replays`` view)."""
    return f"'{REPLAYS_PREFIX}date=' || {day} || '/' || {envelope_id} || '/' || {result_id} || '.json'"


# ------------------------------------------------------------------------------------------- Merkle log


_LOG_NAME_DIGITS = 12


def _log_name(n: int, ext: str) -> str:
    """A Merkle-log object's name: a leaf index or tree size, zero-padded so that a listing is in numeric order
    (`checkpoint_size_of_key` parses it back)."""
    return f"{n:0{_LOG_NAME_DIGITS}d}.{ext}"


#: How the log functions below name a Merkle log: a capture day (``YYYY-MM-DD``: that day's envelopes) or an
#: engine's schedule log (`schedule_log`: its shipped segments). One format of leaves, checkpoints and proofs for
#: both; the name only chooses the prefix and the checkpoint's origin.
LogName = str

_SCHEDULE_LOG: Final = "schedules/engine="


def schedule_log(engine_id: str) -> LogName:
    """The Merkle log of one engine instance's schedule segments (one leaf per shipped segment, in seq order)."""
    return f"{_SCHEDULE_LOG}{engine_id}"


#: Where the schedule logs' folders are (one ``engine=<id>/`` each).
SCHEDULE_LOGS_PREFIX: Final = f"{LOG_PREFIX}{_SCHEDULE_LOG.split('/')[0]}/"


def schedule_log_engine(log: LogName) -> str | None:
    """The engine a `schedule_log` name is of; None for a day."""
    return log.removeprefix(_SCHEDULE_LOG) if log.startswith(_SCHEDULE_LOG) else None


def log_id(log: LogName) -> str:
    """The id a checkpoint names its log by: ``day=<D>`` for a day, the name itself for a schedule log."""
    return log if log.startswith(_SCHEDULE_LOG) else f"day={log}"


def leaves_prefix(log: LogName) -> str:
    """Every leaf batch of the log, in start order."""
    return f"{LOG_PREFIX}{log_id(log)}/leaves/"


def leaves_key(log: LogName, start: int) -> str:
    """The leaf batch that starts at leaf `start` of the log."""
    return f"{leaves_prefix(log)}{_log_name(start, 'bin')}"


def is_leaves_key(key: str) -> bool:
    """True for a leaf batch object (anything else under `leaves_prefix` does not belong there)."""
    return key.endswith(".bin")


def leaves_start(key: str) -> int:
    """The start index a `leaves_key` names."""
    return int(key.rsplit("/", 1)[1].removesuffix(".bin"))


def checkpoints_prefix(log: LogName) -> str:
    return f"{CHECKPOINTS_PREFIX}{log_id(log)}/"


def checkpoint_key(log: LogName, tree_size: int) -> str:
    return f"{checkpoints_prefix(log)}{_log_name(tree_size, 'json')}"


def checkpoint_key_suffix(tree_size: int) -> str:
    """How a `checkpoint_key` of that size ends (a checkpoint must be stored under its own size)."""
    return f"/{_log_name(tree_size, 'json')}"


def note_checkpoint_key(log: LogName, tree_size: int) -> str:
    """A C2SP checkpoint (a signed note, `schemas.note`) of the log at that size; `checkpoint_key` holds the older
    JSON checkpoints (day logs only)."""
    return f"{checkpoints_prefix(log)}{_log_name(tree_size, 'checkpoint')}"


def is_note_checkpoint_key(key: str) -> bool:
    return key.endswith(".checkpoint")


def checkpoint_size_of_key(key: str) -> int | None:
    """The tree size a checkpoint key (either format) names, None for anything else."""
    name = key.rsplit("/", 1)[-1]
    stem, dot, ext = name.partition(".")
    return (
        int(stem)
        if dot and ext in ("json", "checkpoint") and stem.isdigit() and len(stem) == _LOG_NAME_DIGITS
        else None
    )


def log_origin(key_name: str, log: LogName) -> str:
    """The origin line of the log's C2SP checkpoints: the signing key's name, then the log id."""
    return f"{key_name}/{log_id(log)}"


def time_ordered_name(at: datetime, suffix: str) -> str:
    """The name of a record stored once per event: its UTC time to the microsecond, so that a listing (S3 lists
    in key order) is in time order, then a random `suffix` so that two events of the same microsecond differ."""
    return f"{at.astimezone(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{suffix}.json"


def expiry_report_key(ran_at: datetime, suffix: str) -> str:
    """Where an expiry run's report goes: its start time and a random suffix (`time_ordered_name`)."""
    return f"{EXPIRY_PREFIX}{time_ordered_name(ran_at, suffix)}"


def access_log_day_prefix(day: str) -> str:
    """Every access-log record (`schemas.access_log.AccessRecord`) of one day (``YYYY-MM-DD``, UTC)."""
    return date_prefix(ACCESS_LOG_PREFIX, day)


def access_log_key(at: datetime, record_id: str) -> str:
    """Where one access-log record goes: its day, then its time and random id (`time_ordered_name`)."""
    return f"{access_log_day_prefix(capture_day(at))}{time_ordered_name(at, record_id)}"


def hold_decisions_prefix(envelope_id: str) -> str:
    """The legal-hold decisions on one envelope: copies of their access records (`hold_decision_key`), in time
    order; under ``audit/access/`` (the operators may write there, write-once) but beside the day folders."""
    return f"{ACCESS_LOG_PREFIX}holds/envelope={envelope_id}/"


def hold_decision_key(envelope_id: str, at: datetime, record_id: str) -> str:
    """Where a copy of a legal-hold decision's access record is filed under the envelope it holds."""
    return f"{hold_decisions_prefix(envelope_id)}{time_ordered_name(at, record_id)}"


# ------------------------------------------------------------------------------------------- schedules


def schedule_engine_prefix(engine_id: str) -> str:
    """Every shipped segment of one engine instance's schedule log, in seq order."""
    return f"{SCHEDULES_PREFIX}engine={engine_id}/"


def schedule_segment_key(engine_id: str, seq: int) -> str:
    """One closed segment, written once (``IfNoneMatch``): the same seq is always the same bytes."""
    return f"{schedule_engine_prefix(engine_id)}{seq:08d}.jsonl"


def schedule_index_prefix(external_request_id: str) -> str:
    """Every arrival indexed under one external request id (a request with ``n > 1`` has one per child)."""
    return f"{SCHEDULE_INDEX_PREFIX}{external_request_id}/"


def schedule_index_key(external_request_id: str, engine_request_id: str) -> str:
    """One arrival's index entry (`schemas.schedule_delivery.ScheduleIndexEntry`), written once."""
    return f"{schedule_index_prefix(external_request_id)}{engine_request_id}.json"


# ------------------------------------------------------------------------------------ known-good environments


def known_good_prefix(deployment: str) -> str:
    """Every environment a gate passed for `deployment`, oldest first (`schemas.known_good`)."""
    return f"{ENVIRONMENTS_PREFIX}deployment={deployment}/known-good/"


def known_good_key(deployment: str, passed_at: datetime, record_id: str) -> str:
    """One known-good record, written once: its passing time, so a listing is in order, and its own sha256
    (`time_ordered_name`)."""
    return f"{known_good_prefix(deployment)}{time_ordered_name(passed_at, record_id)}"


def is_known_good_key(key: str) -> bool:
    return key.endswith(".json")


# ---------------------------------------------------------------------------------------------- data keys


def data_key_prefix(tenant: str) -> str:
    return f"{DATA_KEYS_PREFIX}tenant={tenant}/"


def data_key_key(tenant: str, key_id: str) -> str:
    return f"{data_key_prefix(tenant)}{key_id}.json"


def data_key_id(tenant: str, key: str) -> str:
    """The key id a `data_key_key` of `tenant` names."""
    return key.removeprefix(data_key_prefix(tenant)).removesuffix(".json")


# --------------------------------------------------------------------------------------------------- lake


def lake_table_prefix(table: str, prefix: str = LAKE_PREFIX) -> str:
    return f"{prefix}/{table}/"


def lake_day_prefix(table: str, day: str, prefix: str = LAKE_PREFIX) -> str:
    """Every partition of `table` of one day (the lake partitions by ``date`` first, then ``tenant``)."""
    return date_prefix(lake_table_prefix(table, prefix), day)


def lake_partition_prefix(table: str, day: str, tenant: str, prefix: str = LAKE_PREFIX) -> str:
    return f"{lake_day_prefix(table, day, prefix)}tenant={tenant}/"


def lake_part_key(table: str, day: str, tenant: str, part_id: str, prefix: str = LAKE_PREFIX) -> str:
    """One Parquet file of a partition (`part_id`: a fresh uuid per file)."""
    return f"{lake_partition_prefix(table, day, tenant, prefix)}part-{part_id}.parquet"


def is_lake_part(key: str) -> bool:
    """True for a lake data file (the lake reads nothing else under a table's prefix)."""
    return key.endswith(".parquet")


# ------------------------------------------------------------------------------------- large records, refusals

#: An envelope longer than this goes to Kafka as a claim check (`schemas.claim_check`): the record limit less
#: room for the key, the headers and the record batch's own framing.
CLAIM_CHECK_BYTES: Final = MAX_MESSAGE_BYTES - 64 * 1024
HEADER_CLAIM_CHECK: Final = "reprolane-claim-check"
#: The sink that refused a dead-lettered record for good (``kafka``, ``s3``, ``route``).
HEADER_DLQ_SINK: Final = "reprolane-dlq-sink"
#: The longest object key S3 accepts (bytes of UTF-8).
MAX_KEY_BYTES: Final = 1024
