"""The connection fields every service's settings share: how to reach Kafka and S3, and the tenants' data keys.

Pure pydantic field mixins, no IO: each service's settings class (``CaptureSettings``, ``AuditSettings``,
``LakeSettings``, ``ReplayerSettings``) inherits them and keeps its own environment prefix, so the variable
names stay per service (``REPROLANE_CAPTURE_KAFKA_BOOTSTRAP``, ``REPROLANE_ARCHIVER_KAFKA_BOOTSTRAP``, ...).
A class whose default differs redeclares just that field (the replayer and the archiver default
``kafka_bootstrap`` to the local stack's broker; the sidecar's is unset: no Kafka sink).

The translation of these fields into client options (the SSL context, SASL, timeouts, retries) is written once,
in `infra.clients`; nothing here opens a connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from schemas.layout import LAKE_BUCKET

KafkaSecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]


class KafkaConnectionFields(BaseModel):
    """Where the Kafka brokers are and how a client authenticates to them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kafka_bootstrap: str | None = None
    kafka_security_protocol: KafkaSecurityProtocol = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = Field(
        default=None, description="PLAIN (the default under SASL_*), SCRAM-SHA-256 or SCRAM-SHA-512"
    )
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: Path | None = Field(
        default=None, description="CA bundle (PEM) the brokers' certificates are checked against; unset: the system's"
    )
    kafka_ssl_certfile: Path | None = Field(default=None, description="client certificate (PEM), for mutual TLS")
    kafka_ssl_keyfile: Path | None = Field(default=None, description="the client certificate's private key (PEM)")


class S3ConnectionFields(BaseModel):
    """Where the S3 endpoint is, with which credentials, and the audit bucket (Object Lock)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: SecretStr | None = None
    s3_bucket: str = Field(
        default="reprolane-audit", description="the audit bucket (Object Lock): envelopes, their index, the Merkle log"
    )
    s3_verify_tls: bool = True


class DataKeyFields(BaseModel):
    """Where the encrypted tenants' wrapped data keys are (`schemas.sealed`), and the KEK that unwraps them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kek: SecretStr | None = Field(default=None, description="key-encryption key, base64 of 32 bytes")
    kek_file: Path | None = Field(default=None, description="file holding the KEK (base64); used when kek is unset")
    keys_bucket: str = Field(default=LAKE_BUCKET, description="bucket of the wrapped data keys (no Object Lock)")
