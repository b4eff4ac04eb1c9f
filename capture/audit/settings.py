"""Settings of the audit commands (`reprolane audit verify|hold|expire|audit`): env prefix ``REPROLANE_AUDIT_``.

The publisher's own log writer uses the capture settings (same bucket as the envelopes); these are for the
jobs and the verifier, which may run anywhere with read access and the public key only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.clients.connection import S3ConnectionFields


class AuditSettings(BaseSettings, S3ConnectionFields):
    model_config = SettingsConfigDict(env_prefix="REPROLANE_AUDIT_", extra="forbid", frozen=True)

    signing_key: str | None = Field(
        default=None, description="Ed25519 private key: path to a PEM file, or base64 of the 32 raw bytes"
    )
    public_key: str | None = Field(
        default=None, description="Ed25519 public key (PEM path or base64 raw); derived from signing_key if unset"
    )
    object_lock_mode: Literal["COMPLIANCE", "GOVERNANCE"] = "COMPLIANCE"
    log_retention_days: int = Field(
        default=1, ge=0, description="Object Lock retention of checkpoints and expiry reports; 0 = none"
    )
    log_origin: str = Field(
        default="reprolane.local/audit",
        pattern=r"^[!-*,-~]{1,200}$",
        description="C2SP checkpoint key name and origin prefix (<log_origin>/day=D), unique per deployment",
    )
