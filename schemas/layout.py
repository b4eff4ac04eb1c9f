"""Where records live: Kafka topics and headers, and the S3 object-key layout.

Kafka (at-least-once: duplicates are expected and collapse by envelope id):

    reprolane.envelopes.v1        key = request_id, value = canonical envelope JSON
    reprolane.divergences.v1      key = request_id, value = DivergenceEvent JSON
    reprolane.replay-requests.v1  key = request_id, value = ReplayRequest JSON (on-demand replays)
    reprolane.dead-letter.v1      key = original key, value = original bytes, reason in headers

S3 (one bucket with Object Lock; every object is written once, keys are content addresses):

    envelopes/tenant=<tenant>/date=<YYYY-MM-DD>/<envelope_id>.json
    index/request-id/<request_id>.json          -> {"envelope_id", "key"}: lookup by request id
    index/workflow/<workflow_id>/<step:06d>-<request_id>.json  -> same, one per workflow step
    replays/date=<YYYY-MM-DD>/<envelope_id>/<result_id>.json   date = the envelope's capture day

A replay result's key is a function of (envelope, lane fingerprint) only, never of when the replay ran, so a
re-replay after a crash (or on another day) lands on the same key and collapses to one result.
An encrypted tenant's envelope object (and Kafka value) holds a `schemas.sealed.SealedEnvelope` instead, under
the same key (``envelope_id`` is the plaintext's hash either way).

Lake bucket (no Object Lock: compaction rewrites files, shredding deletes keys):

    lake/<table>/date=<YYYY-MM-DD>/tenant=<tenant>/part-<uuid>.parquet   Hive-partitioned audit lake
    keys/tenant=<tenant>/<key_id>.json          wrapped data key of an encrypted tenant (schemas.sealed)
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

LAKE_BUCKET: Final = "reprolane-lake"

TOPIC_ENVELOPES: Final = "reprolane.envelopes.v1"
TOPIC_DIVERGENCES: Final = "reprolane.divergences.v1"
TOPIC_REPLAY_REQUESTS: Final = "reprolane.replay-requests.v1"
TOPIC_DEAD_LETTER: Final = "reprolane.dead-letter.v1"
ALL_TOPICS: Final = (TOPIC_ENVELOPES, TOPIC_DIVERGENCES, TOPIC_REPLAY_REQUESTS, TOPIC_DEAD_LETTER)

#: Largest record a producer may send and a consumer must accept (topics are created with this
#: ``max.message.bytes``): an 8k-token output with top-20 logprobs is about 3 MiB of JSON.
MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024

HEADER_ENVELOPE_ID: Final = "reprolane-envelope-id"
HEADER_SCHEMA: Final = "reprolane-schema"
HEADER_DLQ_REASON: Final = "reprolane-dlq-reason"
HEADER_DLQ_SOURCE: Final = "reprolane-dlq-source"


def _day(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d")


def envelope_key(envelope_id: str, tenant: str, captured_at: datetime) -> str:
    return f"envelopes/tenant={tenant}/date={_day(captured_at)}/{envelope_id}.json"


def request_index_key(request_id: str) -> str:
    return f"index/request-id/{request_id}.json"


def workflow_index_prefix(workflow_id: str) -> str:
    return f"index/workflow/{workflow_id}/"


def workflow_index_key(workflow_id: str, step: int, request_id: str) -> str:
    return f"{workflow_index_prefix(workflow_id)}{step:06d}-{request_id}.json"


def replay_key(envelope_id: str, result_id: str, captured_at: datetime) -> str:
    """Pass the envelope's ``captured_at`` (not the replay time): the key must not change between re-replays."""
    return f"replays/date={_day(captured_at)}/{envelope_id}/{result_id}.json"


def data_key_prefix(tenant: str) -> str:
    return f"keys/tenant={tenant}/"


def data_key_key(tenant: str, key_id: str) -> str:
    return f"{data_key_prefix(tenant)}{key_id}.json"


def lake_table_prefix(table: str, prefix: str = "lake") -> str:
    return f"{prefix}/{table}/"


def lake_partition_prefix(table: str, day: str, tenant: str, prefix: str = "lake") -> str:
    return f"{lake_table_prefix(table, prefix)}date={day}/tenant={tenant}/"
