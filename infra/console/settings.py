"""Settings of ``reprolane serve console`` (env prefix ``REPROLANE_CONSOLE_``).

The console reads what other services wrote, with their own settings: the audit bucket (holds, Merkle log,
checkpoints, the access log) through `capture.audit.settings.AuditSettings` (``REPROLANE_AUDIT_*``), the lake
through `capture.audit.lake.settings.LakeSettings` (``REPROLANE_ARCHIVER_*``), envelopes, replay results and the
on-demand topic through `replayer.settings.ReplayerSettings` (``REPROLANE_REPLAYER_*``). A running local stack
fills all three in (`infra.stack.env`). Whose keys it accepts and how long access records are retained are the
CLI's operator settings (`capture.audit.operators.OperatorSettings`: ``REPROLANE_OPERATOR_KEYS_PATH``,
``REPROLANE_OPERATOR_ACCESS_LOG_RETENTION_DAYS``), one store and one log for both doors. These fields are the
console's own: where it listens, how its sessions behave, and the key it signs on-demand replay requests with.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ConsoleSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REPROLANE_CONSOLE_", extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="address to bind; loopback unless a proxy fronts it")
    port: int = Field(default=8700, ge=0, le=65535)
    secure_cookie: bool = Field(
        default=False, description="mark the session cookie Secure (set it whenever TLS fronts the console)"
    )
    session_idle_s: float = Field(default=1800.0, gt=0.0, description="a session ends after this long unused")
    session_max_s: float = Field(default=8 * 3600.0, gt=0.0, description="... and this long after login")
    replay_keys_path: Path | None = Field(
        default=None, description="replay-request keys file (the replayer's format); 'replay now' signs with one"
    )
    replay_key_id: str | None = Field(default=None, description="which key of replay_keys_path signs")
    replay_timeout_s: float = Field(
        default=60.0, gt=0.0, le=600.0, description="how long 'replay now' waits for the replayer service's answer"
    )
    gate_reports_dir: Path | None = Field(
        default=None, description="a folder of release-gate reports (gate --report FILE.json) for the overview"
    )
    search_limit: int = Field(default=50, ge=1, le=5000, description="rows per page of a search's results")
