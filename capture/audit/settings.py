"""Settings of the audit commands (`reprolane verify|hold|expire|audit`): env prefix ``REPROLANE_AUDIT_``.

The publisher's own log writer uses the capture settings (same bucket as the envelopes); these are for the
jobs and the verifier, which may run anywhere with read access and the public key only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class AuditSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REPROLANE_AUDIT_", extra="forbid", frozen=True)

    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: SecretStr | None = None
    s3_bucket: str = "reprolane-audit"
    s3_verify_tls: bool = True
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
