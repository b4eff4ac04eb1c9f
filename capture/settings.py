"""Settings of the capture sidecar: one object per process, built once in main and passed down.

Every field can be set from the environment with the prefix ``REPROLANE_CAPTURE_`` (for example
``REPROLANE_CAPTURE_UPSTREAM=http://127.0.0.1:8000``) or from CLI flags.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.clients.connection import DataKeyFields, KafkaConnectionFields, S3ConnectionFields
from infra.clients.otel import OtelFields


class CaptureSettings(BaseSettings, KafkaConnectionFields, S3ConnectionFields, DataKeyFields, OtelFields):
    """The sidecar's settings; the Kafka, S3 and data-key fields come from `infra.clients.connection`, the
    OpenTelemetry export's (``otel_*``: a span per captured request, `capture.request.telemetry`) from
    `infra.clients.otel`."""

    model_config = SettingsConfigDict(env_prefix="REPROLANE_CAPTURE_", extra="forbid", frozen=True)

    # --- HTTP edge
    upstream: str = Field(description="base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    host: str = "127.0.0.1"
    port: int = Field(default=8100, ge=0, le=65535)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    upstream_timeout_s: float = Field(default=300.0, gt=0)
    sidecar_id: str = "capture-0"

    # --- what is recorded
    mode: Literal["guaranteed", "best_effort"] = Field(
        default="guaranteed",
        description="guaranteed: the envelope is durable in the spool before the response is released",
    )
    audit_top_logprobs: int = Field(default=5, ge=0, le=20, description="top-k asked of upstream for the record")
    manifest_path: Path | None = Field(default=None, description="reprolane-manifest.json of the served model")
    runtime_path: Path | None = Field(
        default=None, description="JSON of RuntimeFingerprint fields the sidecar cannot observe (dtype, ...)"
    )
    lora_modules: dict[str, Path] = Field(
        default_factory=dict,
        description="the LoRA adapters upstream serves, as upstream vLLM's --lora-modules NAME=PATH: adapter name -> "
        "its directory (read at start); a request naming one records the adapter's sha256 in its artifacts",
    )
    inject_seed: bool | None = Field(
        default=None,
        description="add a seed to sampled requests that have none (None: in guaranteed mode only; see `injects_seed`)",
    )
    upstream_generation_config: Literal["auto", "vllm"] = Field(
        default="auto",
        description="upstream vLLM's --generation-config: auto (its default) takes sampling defaults from the "
        "model's generation_config.json, recorded in the manifest; vllm: vLLM's own defaults only",
    )
    upstream_override_generation_config: dict[str, float] = Field(
        default_factory=dict,
        description="upstream vLLM's --override-generation-config (JSON), the same object: sampling defaults that "
        "win over the model's",
    )
    schedule_recorder: str | None = Field(
        default=None,
        max_length=64,
        pattern=r"^[A-Za-z0-9._:\-]+$",
        description="upstream records its engine schedule (vLLM with reprolane's recording scheduler): every "
        "envelope that went upstream says where its schedule is, under this recorder name (e.g. vllm-scheduler)",
    )
    engine_key: str | None = Field(
        default=None,
        max_length=200,
        pattern=r"^[A-Za-z0-9._:/\-]+$",
        description="the engine behind --upstream: every envelope is keyed by it on Kafka, so one member of the "
        "replayers' consumer group owns the engine's busy periods (in order, each replayed once, moved to another "
        "member when it fails); None: the upstream URL when a schedule recorder is named (one recording engine "
        "behind), else each envelope's request id",
    )
    version_headers: tuple[str, ...] = Field(
        default=("openai-version", "openai-model", "x-model-version", "x-api-version", "anthropic-version"),
        description="response headers recorded as the vendor version of upstreams without an engine version",
    )

    # --- what is not captured
    refuse_uncaptured: bool = Field(
        default=False,
        description="answer 403 to writes (POST, PUT, ...) on paths the sidecar does not capture (/v1/responses, "
        "/v1/messages, /inference/v1/generate, /update_weights, ...) except uncaptured_allowed: nothing reaches "
        "upstream unrecorded that could generate or change what it serves",
    )
    uncaptured_allowed: tuple[str, ...] = Field(
        default=(
            "/tokenize",
            "/detokenize",
            "/v1/chat/completions/render",
            "/v1/completions/render",
            "/v1/messages/count_tokens",
        ),
        description="write paths still passed through under refuse_uncaptured (they generate nothing)",
    )

    # --- replay policy
    flag_tenants: tuple[str, ...] = ()
    sample_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    default_tenant: str = "default"

    # --- shadow traffic (capture/request/shadow.py): a sample of live requests sent again to a candidate server
    shadow_upstream: str | None = Field(
        default=None, description="base URL of the candidate server (production configuration, batching on)"
    )
    shadow_sample: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of requests shadowed (decided by a hash of the request id)"
    )
    shadow_model: str | None = Field(default=None, description="the candidate's served model name (default: as asked)")
    shadow_runtime_path: Path | None = Field(
        default=None, description="JSON of the candidate's RuntimeFingerprint fields it cannot report (dtype, ...)"
    )
    shadow_timeout_s: float = Field(default=120.0, gt=0, description="one shadow request, whole")
    shadow_queue: int = Field(default=256, ge=1, le=65536, description="shadows waiting to be sent; above it: dropped")
    shadow_concurrency: int = Field(default=8, ge=1, le=256, description="shadow requests in flight at once")
    shadow_spool_share: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="a shadow envelope is spooled only while the spool holds less than this share of its bound: "
        "shadows never fill the spool production needs",
    )

    # --- durability
    spool_dir: Path = Path(".reprolane/spool")
    spool_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024)
    spool_warn_ratio: float = Field(default=0.8, gt=0.0, le=1.0)
    group_commit_ms: float = Field(default=2.0, ge=0.0)
    best_effort_linger_ms: float = Field(
        default=10.0,
        ge=0.0,
        le=1000.0,
        description="best_effort only: the spool writes and fsyncs what arrived every this many ms (the client never "
        "waits for it; a crash loses at most this much more); 0: as in guaranteed mode, no wait",
    )

    # --- sinks (Kafka when kafka_bootstrap is set, S3 when s3_endpoint or s3_access_key is)
    s3_processes: int = Field(
        default=0,
        ge=0,
        le=64,
        description="worker processes for S3 PUTs (0: threads of the sidecar process); boto3's CPU per PUT is more "
        "than a captured request's: above a few hundred envelopes/s give it processes "
        "(capture/publishing/s3_workers.py)",
    )
    retention_days: int = Field(default=1, ge=0, description="Object Lock retention; 0 = no retention header")
    retention_days_by_tenant: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="per-tenant Object Lock retention (days), overrides retention_days"
    )
    audit_log: bool = Field(
        default=False, description="append every stored envelope id to the Merkle log (capture.ledger.merkle_log)"
    )
    object_lock_mode: Literal["COMPLIANCE", "GOVERNANCE"] = "COMPLIANCE"
    envelope_encoding: Literal["compact", "json"] = Field(
        default="compact",
        description="how envelopes are stored in S3 and sent on Kafka: compact (schemas/envelope_compact.py, several "
        "times smaller; the same canonical bytes and id) or json (the canonical JSON itself); readers take both",
    )

    # --- privacy: per-tenant encryption (capture/ledger/sealing.py, schemas/sealed.py; the KEK and keys bucket are
    # the data-key fields)
    encrypt_tenants: tuple[str, ...] = Field(
        default=(), description="tenants whose envelopes are sealed (AES-256-GCM) before they leave the sidecar"
    )
    data_key_cache_s: float = Field(default=300.0, ge=0.0, description="how long a data key is reused from memory")

    # --- bounds of the HTTP edge (what one client may hold of the sidecar: capture/cli.py,
    # capture/request/http_server.py)
    http_parser: Literal["httptools", "h11"] = Field(
        default="httptools",
        description="uvicorn's HTTP parser, pinned so the dev install and the image parse request targets alike",
    )
    max_concurrency: int = Field(
        default=2048, ge=1, description="requests in progress at once; a request above it gets 503"
    )
    max_connections: int = Field(
        default=4096,
        ge=1,
        description="open connections at once; a newcomer closes the oldest that has presented no valid key, or "
        "gets 503 when every one has (capture/request/connection_limits.py)",
    )
    max_anonymous_per_address: int = Field(
        default=256,
        ge=1,
        description="open connections of one client address (IPv6: its /64) that have presented no valid key; a "
        "newcomer past it closes that address's oldest (trusted proxies are not capped)",
    )
    request_head_timeout_s: float = Field(
        default=5.0, gt=0, description="a connection that has not sent a whole request head within this is closed"
    )
    request_body_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request body must arrive within this plus a second per request_body_min_rate bytes received; "
        "else 408",
    )
    request_body_min_rate: int = Field(
        default=64 * 1024,
        ge=1,
        description="bytes per second a request body earns its time at, after request_body_timeout_s (a body "
        "trickled slower is cut)",
    )

    # --- who may call (capture/request/auth.py): the tenant and the right to flag come from the caller's credential
    auth_mode: Literal["keys", "anonymous-allowed", "trusted-proxy", "off"] = Field(
        default="keys",
        description="keys: an API key of api_keys_path on every request (401 without); anonymous-allowed: a request "
        "without a key is recorded as tenant 'anonymous'; trusted-proxy: only peers in trusted_proxies, whose "
        "X-Reprolane-Tenant/-Flag headers are trusted; off: local development, headers trusted from anyone",
    )
    api_keys_path: Path | None = Field(
        default=None, description="the key file (JSON, hashed keys, mode 0600): read once at start"
    )
    trusted_proxies: tuple[str, ...] = Field(
        default=(), description="trusted-proxy mode: the networks (CIDR) whose identity headers are trusted"
    )

    @property
    def kafka_key(self) -> str | None:
        """What every envelope is keyed by on Kafka (`engine_key`'s rule); None: each by its request id."""
        if self.engine_key is not None:
            return self.engine_key
        return self.upstream if self.schedule_recorder is not None else None

    @property
    def injects_seed(self) -> bool:
        """Whether a sampled request without a seed gets one (recorded as ``seed_injected``): as set, else in
        guaranteed mode. A sample drawn from the worker's global random state can never be replayed token for token
        (seed scope ``worker_global``); an injected per-request seed draws from the same distribution (a fresh random
        seed per request) and makes the record replayable. A deployment that must not add a field to what its
        clients send turns it off, and its unseeded samples are then reported as ``unseeded_sampling``."""
        return self.inject_seed if self.inject_seed is not None else self.mode == "guaranteed"

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for network in value:
            ipaddress.ip_network(network, strict=False)  # ValueError names the bad network
        return value

    @field_validator("shadow_upstream")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value == "":  # compose's `${VAR:-}`: not set
            return None
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL")
        return value

    @model_validator(mode="after")
    def _auth_complete(self) -> CaptureSettings:
        if self.auth_mode == "keys" and self.api_keys_path is None:
            raise ValueError("api_keys_path: required when auth_mode is 'keys' (or choose another auth_mode)")
        if self.auth_mode == "trusted-proxy" and not self.trusted_proxies:
            raise ValueError("trusted_proxies: required when auth_mode is 'trusted-proxy'")
        return self
