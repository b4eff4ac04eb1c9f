"""Settings of the schedule shipper: one object per process, built once in main and passed down.

Every field can be set from the environment with the prefix ``REPROLANE_SHIPPER_`` or from flags of
``reprolane serve schedules``; the schedule directory is also read from ``REPROLANE_SCHEDULE_DIR``, the variable
the recorder inside vLLM writes to, so one setting names it for both sides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.clients.connection import KafkaConnectionFields, S3ConnectionFields


class ShipperSettings(BaseSettings, KafkaConnectionFields, S3ConnectionFields):
    """The shipper's settings; the Kafka and S3 fields come from `infra.clients.connection`."""

    model_config = SettingsConfigDict(env_prefix="REPROLANE_SHIPPER_", extra="forbid", frozen=True)

    schedule_dir: Path = Field(
        validation_alias=AliasChoices("schedule_dir", "REPROLANE_SHIPPER_SCHEDULE_DIR", "REPROLANE_SCHEDULE_DIR"),
        description="the recorder's directory: <dir>/<engine id>/<seq>.jsonl",
    )
    quarantine_dir: Path | None = Field(
        default=None, description="where refused segments go (default: <schedule_dir>.quarantine, beside it)"
    )
    shipper_id: str = Field(default="schedules-0", max_length=64, description="the Kafka client id's suffix")
    poll_s: float = Field(default=0.5, gt=0.0, le=60.0, description="how often the directory is looked at when idle")
    retention_days: int = Field(default=1, ge=0, description="Object Lock retention of segments; 0 = none")
    object_lock_mode: Literal["COMPLIANCE", "GOVERNANCE"] = "COMPLIANCE"
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus /metrics port (0: not served)")
    metrics_host: str = "127.0.0.1"
    stale_part_s: float = Field(
        default=300.0,
        gt=0.0,
        description="a segment still open (.part) and untouched for this long is reported (its recorder died)",
    )

    @property
    def quarantine(self) -> Path:
        return self.quarantine_dir or self.schedule_dir.with_name(f"{self.schedule_dir.name}.quarantine")
