"""The engine's schedule: what a production vLLM computed at each step, as shapes only.

On the engines reprolane supports, the numbers a request gets depend on the *shapes* of the batches it ran in (how
many tokens each scheduled request had computed and was given at each step, in which order), not on its
companions' content. A schedule log records exactly those shapes, per engine instance, so a replay can rebuild
them with filler companions (see `replayer.schedule.lane`). It never holds token ids or text: a companion is
another tenant's request, and its shape is all a replay of *this* request may learn about it.

Records (one JSON object per line in a segment, each a `ScheduleRecord`):

- `EngineStart`, once per engine instance (first line of its first segment): the settings that shape the schedule.
- `ScheduleStep`, once per engine step that scheduled anything: for each scheduled request, in the scheduler's
  order, its engine request id, the tokens it had computed before the step and the tokens scheduled in it; which
  requests were preempted to make room for it; which finished in it (its output stopped them, or they were
  aborted since the previous step).
- `RequestArrival`, once per request the engine accepted: its ids, prompt length, and (when prefix caching is on)
  which earlier requests' blocks its cache hit read (`cached_from`), never the blocks' content or hashes.

Ids: vLLM's OpenAI server gives the engine ``<prefix>-<X-Request-Id>`` (e.g. ``chatcmpl-rl-...``) as the external
id and the scheduler sees ``<external>-<8 hex>``. The sidecar forwards its own request id as ``X-Request-Id``, so
`RequestArrival.external_request_id` ends with the envelope's request id: that is the join.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field

from schemas.base import Record, UtcDatetime
from schemas.fingerprint import RuntimeFingerprint

SCHEDULE_SCHEMA_VERSION: Final = "reprolane.schedule/1"

EngineId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
EngineRequestId = Annotated[str, Field(min_length=1, max_length=256)]


#: The provider `RequestArrival.cached_from` names for a block the recorder did not see any request compute.
UNKNOWN_PROVIDER: Final = "?"


class EngineStart(Record):
    """One engine instance's schedule-shaping settings (a new instance id on every start)."""

    kind: Literal["engine"] = "engine"
    schema_version: Literal["reprolane.schedule/1"] = SCHEDULE_SCHEMA_VERSION
    engine_id: EngineId
    started_at: UtcDatetime
    vllm_version: str
    model: str
    dtype: str
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    max_model_len: int = Field(ge=1)
    block_size: int = Field(ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=0, description="KV-cache blocks the engine allocated")
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    scheduling_policy: str
    seed: int | None = Field(default=None, description="the engine's --seed (None: it had none)")
    long_prefill_token_threshold: int | None = Field(
        default=None, description="vLLM's --long-prefill-token-threshold (None: 0, no threshold)"
    )
    async_scheduling: bool | None = Field(default=None, description="vLLM's --async-scheduling (None: not recorded)")
    enforce_eager: bool | None = Field(
        default=None, description="vLLM's --enforce-eager: no CUDA graphs (None: not recorded)"
    )
    runtime: RuntimeFingerprint | None = Field(
        default=None, description="the engine's numerics-relevant environment, as the replay lanes fingerprint theirs"
    )


class RequestArrival(Record):
    """A request the engine accepted (written when the scheduler first sees it)."""

    kind: Literal["arrival"] = "arrival"
    engine_id: EngineId
    step: int = Field(ge=0, description="the step before which it arrived: it can first be scheduled at this step")
    engine_request_id: EngineRequestId
    external_request_id: EngineRequestId
    num_prompt_tokens: int = Field(ge=0)
    max_tokens: int | None = Field(default=None, ge=0)
    cached_from: tuple[tuple[EngineRequestId, int], ...] | None = Field(
        default=None,
        description="prefix-cache hit: (engine request id that computed the blocks, blocks) in block order; "
        '"?" where the recorder did not see the block computed',
    )
    structured_output: bool | None = Field(
        default=None,
        description="True: a grammar masked the request's tokens (structured outputs), so the scheduler first waited "
        "for it to compile, in the background, for as many steps as that took: its first scheduled step, not its "
        "arrival, is when it could first run (None: no grammar)",
    )


class ScheduledRequest(Record):
    engine_request_id: EngineRequestId
    num_computed_tokens: int = Field(ge=0, description="tokens already computed before this step (cache included)")
    num_scheduled_tokens: int = Field(ge=1)


class ScheduleStep(Record):
    kind: Literal["step"] = "step"
    engine_id: EngineId
    step: int = Field(ge=0)
    at: UtcDatetime
    scheduled: tuple[ScheduledRequest, ...]
    finished: tuple[EngineRequestId, ...] = ()
    preempted: tuple[EngineRequestId, ...] = ()


ScheduleRecord = Annotated[EngineStart | RequestArrival | ScheduleStep, Field(discriminator="kind")]
