"""Settings of the replayer: one object per process (env prefix ``REPROLANE_REPLAYER_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.clients.connection import DataKeyFields, KafkaConnectionFields, S3ConnectionFields
from infra.clients.otel import OtelFields
from schemas.layout import (
    TOPIC_DEAD_LETTER,
    TOPIC_DIVERGENCES,
    TOPIC_ENVELOPES,
    TOPIC_REPLAY_REQUESTS,
    TOPIC_REPLAYER_HEARTBEATS,
)


class Thresholds(BaseSettings):
    """Numeric-tolerance level: per-step differences allowed over the common prefix."""

    model_config = SettingsConfigDict(env_prefix="REPROLANE_REPLAYER_THRESHOLD_", extra="forbid", frozen=True)

    max_abs_logprob_diff: float = Field(default=0.05, ge=0.0)
    max_rel_logprob_diff: float = Field(default=0.5, ge=0.0)
    max_rank_shift: int = Field(default=1, ge=0, description="allowed change of a top-k token's rank")
    near_tie_margin: float = Field(default=0.1, ge=0.0, description="top1-top2 logprob margin called a near tie")
    semantic_min_similarity: float = Field(default=0.9, ge=-1.0, le=1.0)


#: The one-at-a-time lanes, by the names users ask for them (each one's class: `replayer.lanes.LANE_CLASSES`).
LaneName = Literal["vllm", "remote", "transformers"]


class ReplayerSettings(BaseSettings, KafkaConnectionFields, S3ConnectionFields, DataKeyFields, OtelFields):
    """The replayer's settings; the Kafka, S3 and data-key fields (the KEK that opens sealed envelopes) come from
    `infra.clients.connection`, the OpenTelemetry export's (``otel_*``: a span per replay, `replayer.telemetry`)
    from `infra.clients.otel`."""

    model_config = SettingsConfigDict(env_prefix="REPROLANE_REPLAYER_", extra="forbid", frozen=True)

    lane: LaneName = "vllm"
    model_dir: Path | None = Field(default=None, description="HF folder of the model; default: the fetched cache")
    served_model_name: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    remote_url: str | None = Field(default=None, description="base URL for the remote lane")
    num_threads: int = Field(default=1, ge=1, description="torch threads of the transformers lane")
    vllm_num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads of the vllm lane on the CPU; None: vLLM's own choice. Set it to production's "
        "engine count (a vLLM server on N cores runs N - 1) in a replayer that also runs schedule lanes: the "
        "first vLLM engine of a process fixes the count for the process, and a schedule lane whose production "
        "engine ran another count refuses (a CPU kernel's split of the work can depend on it)",
    )
    lora_modules: dict[str, Path] = Field(
        default_factory=dict,
        description="the LoRA adapters the vllm lane may load, as production's --lora-modules: adapter name -> local "
        "directory; a replay loads one only when its files' sha256 is the one the envelope recorded",
    )
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        description="the vllm lane's max LoRA rank when it loads adapters (vLLM's --max-lora-rank; production's value, "
        "16 by default)",
    )
    semantic: bool = Field(default=False, description="compute semantic similarity (all-MiniLM-L6-v2)")
    thresholds: Thresholds = Field(default_factory=Thresholds)

    # selection
    replay_all: bool = Field(default=False, description="replay every envelope, not only flagged ones")

    # consumer
    group_id: str = "reprolane-replayer"
    kafka_bootstrap: str = "127.0.0.1:9092"
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    heartbeat_interval_ms: int = Field(default=3_000, ge=100, description="must be below session_timeout_ms")
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    retry_backoff_s: float = Field(default=1.0, ge=0.0, description="pause before re-reading after a store error")
    envelope_topic: str = TOPIC_ENVELOPES
    divergence_topic: str = TOPIC_DIVERGENCES
    dead_letter_topic: str = TOPIC_DEAD_LETTER
    replay_request_topic: str = TOPIC_REPLAY_REQUESTS
    service_heartbeat_topic: str = TOPIC_REPLAYER_HEARTBEATS
    service_heartbeat_interval_s: float = Field(
        default=5.0, gt=0.0, le=3600.0, description="how often the service says it serves on-demand requests"
    )
    schedule_wait_s: float = Field(
        default=15.0,
        ge=0.0,
        le=600.0,
        description="how long after capture the schedule lane waits for an envelope's schedule to be shipped "
        "(the recorder rotates segments every 2 s, the shipper polls twice a second) before the envelope is "
        "replayed one request at a time",
    )
    schedule_max_steps: int = Field(
        default=4096,
        ge=1,
        description="the most recorded steps one schedule replay may run (its window and the prefix-cache "
        "providers' busy periods); an envelope that needs more is replayed one request at a time",
    )
    schedule_reuse_cache: bool = Field(
        default=True,
        description="keep the prefix cache of the busy periods a schedule lane replayed, so that a later replay whose "
        "prefix-cache providers' periods it holds runs only its own (a shared system prompt's period is replayed "
        "once, not for every reader); false: every replay recomputes them from an empty cache",
    )
    replay_unit: Literal["request", "busy_period"] = Field(
        default="busy_period",
        description="busy_period: an envelope's busy period is replayed once for every captured request of it that "
        "has no result yet, each with its real content, and each gets its result "
        "(`replayer.schedule.replay.Companions`); request: each envelope's schedule replay runs its busy period "
        "with fillers for every companion",
    )
    metrics_host: str = Field(default="127.0.0.1", description="bind address of the metrics endpoint")
    metrics_port: int | None = Field(default=9464, ge=0, le=65535, description="None: no metrics server")

    # on-demand replay requests: who may ask (`schemas.replay_auth`, `replayer.request_keys`)
    replay_requests: Literal["signed", "open"] = Field(
        default="signed", description="signed: act only on requests signed by a key of the keys file; open: any"
    )
    replay_request_keys_path: Path | None = Field(
        default=None, description="JSON key id -> {secret, roles}, 0600; None with 'signed': every request refused"
    )
    replay_request_window_s: float = Field(default=300.0, gt=0.0, description="how old a signed request may be")
    replay_request_key_id: str | None = Field(
        default=None, description="the key `replay request` signs with; None: the keys file's only replay key"
    )

    @property
    def replay_request_group_id(self) -> str:
        """The consumer group of the service's replay-request subscriber."""
        return f"{self.group_id}.requests"
