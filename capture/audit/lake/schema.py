"""The lake's tables: Arrow schemas and the row builders the archiver uses.

Files live at ``<prefix>/<table>/date=<YYYY-MM-DD>/tenant=<tenant>/part-<uuid>.parquet`` (Hive partitioning);
the partition columns ``date`` and ``tenant`` are in the path only, never inside the files.

- ``envelopes``: one row per envelope (partition date = capture day). Runtime fingerprint fields are flattened
  as ``rt_<field>`` next to ``runtime_sha256``. A *sealed* envelope (encrypted tenant) gets a metadata-only
  row (``sealed`` true, ids, key id, capture time, workflow, S3 key): the lake never holds what the ciphertext
  hides, not even the model or runtime. ``prompts`` counts the prompts of a completions request that sent several;
  the ``prompt_*`` and ``output_*`` columns describe the first prompt and choice 0 (the rest are in the envelope).
  A *shadow* envelope (a candidate's answer to a sampled production request, `schemas.envelope.ShadowMarker`)
  has the production envelope's ``request_id``; ``shadow`` is true on its row, ``shadow_production_envelope_id``
  names the production envelope it pairs with and ``shadow_candidate`` the candidate's base URL. ``shadow`` is
  NULL on a sealed row (the marker is inside the ciphertext) and in files written before the column existed
  (a dataset read fills a missing column with NULL): NULL reads as "not a shadow". ``client_request_id`` is
  the client's own ``X-Request-Id`` (its tenant's label, unique per tenant at best): NULL when the client sent
  none, on a sealed row (not in the clear metadata) and in files written before the column was added.
- ``divergences``: one row per `schemas.DivergenceEvent` (partition date = replay day). The recorded
  envelope's runtime is joined in SQL (``envelope_id``).
- ``replays`` is a view, not a table (see `capture.audit.lake.query`): result id and S3 key, from divergences joined
  with envelopes (the replay key needs the envelope's capture day).

Delivery is at least once: the same envelope or event can appear in several files. ``archived_at`` orders
copies; the query views and compaction keep the first copy per ``envelope_id`` / ``result_id``.
"""

from __future__ import annotations

import functools
import types
import typing
from datetime import UTC, datetime
from typing import Any, Final

import pyarrow as pa

from schemas import CapturedError, CapturedOutput, DivergenceEvent, Envelope, RuntimeFingerprint
from schemas.layout import envelope_key
from schemas.sealed import SealedEnvelope

TABLES: Final = ("envelopes", "divergences")
DEDUPE_KEY: Final = {"envelopes": "envelope_id", "divergences": "result_id"}
PARTITIONING: Final = pa.schema([("date", pa.string()), ("tenant", pa.string())])
TS = pa.timestamp("us", tz="UTC")


def _runtime_type(annotation: Any) -> pa.DataType:
    args = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
    if bool in args:
        return pa.bool_()
    if int in args:
        return pa.int64()
    return pa.string()


RUNTIME_FIELDS: Final = tuple(RuntimeFingerprint.model_fields)

ENVELOPES: Final = pa.schema(
    [
        ("request_id", pa.string()),
        ("envelope_id", pa.string()),
        ("captured_at", TS),
        ("sealed", pa.bool_()),
        ("key_id", pa.string()),
        ("model", pa.string()),
        ("endpoint", pa.string()),
        ("model_sha256", pa.string()),
        ("tokenizer_sha256", pa.string()),
        ("chat_template_sha256", pa.string()),
        *[(f"rt_{name}", _runtime_type(RuntimeFingerprint.model_fields[name].annotation)) for name in RUNTIME_FIELDS],
        ("runtime_sha256", pa.string()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int64()),
        ("seed", pa.int64()),
        ("seed_scope", pa.string()),
        ("max_tokens", pa.int64()),
        ("n", pa.int64()),
        ("prompts", pa.int64()),
        ("prompt_len", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("prompt_text", pa.string()),
        ("output_len", pa.int64()),
        ("output_token_ids", pa.list_(pa.int32())),
        ("output_text", pa.string()),
        ("finish_reason", pa.string()),
        ("outcome_kind", pa.string()),
        ("error_type", pa.string()),
        ("status_code", pa.int64()),
        ("upstream_ms", pa.float64()),
        ("flagged", pa.bool_()),
        ("flag_reason", pa.string()),
        ("target_level", pa.string()),
        ("workflow_id", pa.string()),
        ("workflow_step", pa.int64()),
        ("in_flight_at_start", pa.int64()),
        ("in_flight_at_end", pa.int64()),
        ("stream", pa.bool_()),
        ("sidecar_id", pa.string()),
        ("s3_key", pa.string()),
        ("archived_at", TS),
        # last, so older files' columns keep their positions (schema evolution: `conform`)
        ("shadow", pa.bool_()),
        ("shadow_production_envelope_id", pa.string()),
        ("shadow_candidate", pa.string()),
        ("client_request_id", pa.string()),
    ]
)
#: Columns added after the first files were written, in the order they were added (each appended last): absent
#: from the files written before, NULL when read (`conform`, the dataset reads, `IcebergLake._evolved`).
ADDED_COLUMNS: Final = ("shadow", "shadow_production_envelope_id", "shadow_candidate", "client_request_id")

DIVERGENCES: Final = pa.schema(
    [
        ("result_id", pa.string()),
        ("request_id", pa.string()),
        ("envelope_id", pa.string()),
        ("lane", pa.string()),
        ("lane_fingerprint_sha256", pa.string()),
        ("verdict", pa.string()),
        ("levels_held", pa.list_(pa.string())),
        ("target_level", pa.string()),
        ("target_met", pa.bool_()),
        ("first_divergence_position", pa.int64()),
        ("near_tie", pa.bool_()),
        ("recorded_margin", pa.float64()),
        ("replayed_margin", pa.float64()),
        ("recorded_token_id", pa.int64()),
        ("replayed_token_id", pa.int64()),
        ("max_abs_logprob_diff", pa.float64()),
        ("max_rel_logprob_diff", pa.float64()),
        ("token_match_rate", pa.float64()),
        ("recorded_length", pa.int64()),
        ("replayed_length", pa.int64()),
        ("length_diff", pa.int64()),
        ("semantic_similarity", pa.float64()),
        ("cause_hint", pa.string()),
        ("fingerprint_diff_fields", pa.list_(pa.string())),
        ("workflow_id", pa.string()),
        ("workflow_step", pa.int64()),
        ("replayed_at", TS),
        ("replay_ms", pa.float64()),
        ("archived_at", TS),
    ]
)

SCHEMAS: Final = {"envelopes": ENVELOPES, "divergences": DIVERGENCES}


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` in `schema`'s column order and types, a column it lacks (a file written before the column was
    added) filled with NULL; a column `schema` does not have is dropped."""
    if table.column_names == schema.names:
        return table.cast(schema)
    have = set(table.column_names)
    columns = [table[f.name] if f.name in have else pa.nulls(table.num_rows, f.type) for f in schema]
    return pa.Table.from_arrays(columns, names=schema.names).cast(schema)


def day(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%d")


def _blank(schema: pa.Schema) -> dict[str, Any]:
    return dict.fromkeys(schema.names)


@functools.lru_cache(maxsize=1024)
def _runtime_sha256(fingerprint: RuntimeFingerprint) -> str:
    return fingerprint.sha256()  # a fleet has few distinct runtimes: hash each once


def envelope_row(envelope: Envelope, archived_at: datetime, envelope_id: str | None = None) -> dict[str, Any]:
    """The lake row of a plaintext envelope (partition: capture day, tenant).

    Pass `envelope_id` only when it is known to be the sha256 of the canonical bytes (it saves re-encoding)."""
    env_id = envelope_id or envelope.envelope_id()
    row = _blank(ENVELOPES)
    row.update(
        request_id=envelope.request_id,
        client_request_id=envelope.client_request_id,
        envelope_id=env_id,
        captured_at=envelope.captured_at,
        sealed=False,
        model=envelope.model,
        endpoint=envelope.endpoint,
        model_sha256=envelope.artifacts.model_sha256,
        tokenizer_sha256=envelope.artifacts.tokenizer_sha256,
        chat_template_sha256=envelope.artifacts.chat_template_sha256,
        runtime_sha256=_runtime_sha256(envelope.runtime),
        flagged=envelope.flagged,
        flag_reason=envelope.flag_reason,
        target_level=envelope.target_level,
        in_flight_at_start=envelope.context.in_flight_at_start,
        in_flight_at_end=envelope.context.in_flight_at_end,
        stream=envelope.context.stream,
        sidecar_id=envelope.context.sidecar_id,
        s3_key=envelope_key(env_id, envelope.tenant, envelope.captured_at),
        archived_at=archived_at,
    )
    for name in RUNTIME_FIELDS:
        row[f"rt_{name}"] = getattr(envelope.runtime, name)
    if envelope.workflow is not None:
        row.update(workflow_id=envelope.workflow.workflow_id, workflow_step=envelope.workflow.step)
    row["shadow"] = envelope.shadow is not None
    if envelope.shadow is not None:
        row.update(shadow_production_envelope_id=envelope.shadow.production_envelope_id,
                   shadow_candidate=envelope.shadow.candidate)  # fmt: skip
    if envelope.sampling is not None:
        s = envelope.sampling
        row.update(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, seed_scope=s.seed_scope,
            max_tokens=s.max_tokens, n=s.n,
        )  # fmt: skip
    if envelope.prompt is not None:
        row.update(
            prompts=1 + len(envelope.more_prompts or ()),
            prompt_len=len(envelope.prompt.token_ids),
            prompt_token_ids=list(envelope.prompt.token_ids),
            prompt_text=envelope.prompt.text,
        )
    outcome = envelope.outcome
    row["outcome_kind"] = outcome.kind
    row["upstream_ms"] = outcome.timings.upstream_ms
    choices = outcome.choices if isinstance(outcome, CapturedOutput) else outcome.partial
    if isinstance(outcome, CapturedError):
        row.update(error_type=outcome.error_type, status_code=outcome.status_code)
    if choices:
        first = choices[0]
        row.update(
            output_len=len(first.token_ids),
            output_token_ids=list(first.token_ids),
            output_text=first.text,
            finish_reason=first.finish_reason,
        )
    return row


def sealed_row(sealed: SealedEnvelope, archived_at: datetime) -> dict[str, Any]:
    """The metadata-only row of a sealed envelope: nothing that the ciphertext hides (``shadow`` stays NULL)."""
    row = _blank(ENVELOPES)
    row.update(
        request_id=sealed.request_id,
        envelope_id=sealed.envelope_id,
        captured_at=sealed.captured_at,
        sealed=True,
        key_id=sealed.key_id,
        s3_key=envelope_key(sealed.envelope_id, sealed.tenant, sealed.captured_at),
        archived_at=archived_at,
    )
    if sealed.workflow is not None:
        row.update(workflow_id=sealed.workflow.workflow_id, workflow_step=sealed.workflow.step)
    return row


def divergence_row(event: DivergenceEvent, archived_at: datetime) -> dict[str, Any]:
    """The lake row of a divergence event (partition: replay day, tenant)."""
    row = _blank(DIVERGENCES)
    row.update(
        result_id=event.result_id(),
        request_id=event.request_id,
        envelope_id=event.envelope_id,
        lane=event.lane,
        lane_fingerprint_sha256=event.lane_fingerprint_sha256,
        verdict=event.verdict,
        levels_held=list(event.levels_held),
        target_level=event.target_level,
        target_met=event.target_met,
        max_abs_logprob_diff=event.max_abs_logprob_diff,
        max_rel_logprob_diff=event.max_rel_logprob_diff,
        token_match_rate=event.token_match_rate,
        recorded_length=event.recorded_length,
        replayed_length=event.replayed_length,
        length_diff=event.length_diff,
        semantic_similarity=event.semantic_similarity,
        cause_hint=event.cause_hint,
        fingerprint_diff_fields=[d.field for d in event.fingerprint_diffs],
        workflow_id=event.workflow_id,
        workflow_step=event.workflow_step,
        replayed_at=event.replayed_at,
        replay_ms=event.replay_ms,
        archived_at=archived_at,
    )
    fd = event.first_divergence
    if fd is not None:
        row.update(
            first_divergence_position=fd.position,
            near_tie=fd.near_tie,
            recorded_margin=fd.at.recorded_margin,
            replayed_margin=fd.at.replayed_margin,
            recorded_token_id=fd.at.recorded_token_id,
            replayed_token_id=fd.at.replayed_token_id,
        )
    return row
