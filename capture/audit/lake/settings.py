"""Settings of the audit lake: the archiver service, ``reprolane audit lake|query`` and ``reprolane keys``.

Env prefix ``REPROLANE_ARCHIVER_`` (a running local stack provides the Kafka and S3 defaults, see
`infra.stack.env`). ``s3_bucket`` is the audit bucket (where the request-id index lives); the lake and the
wrapped data keys live in ``lake_bucket`` / ``keys_bucket``, which must not be under Object Lock.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.clients.connection import KafkaConnectionFields, S3ConnectionFields
from schemas.layout import ICEBERG_TABLE_BUCKET, LAKE_BUCKET, LAKE_PREFIX, TOPIC_DIVERGENCES, TOPIC_ENVELOPES


class LakeSettings(BaseSettings, KafkaConnectionFields, S3ConnectionFields):
    """The Kafka and S3 connection fields come from `infra.clients.connection`."""

    model_config = SettingsConfigDict(env_prefix="REPROLANE_ARCHIVER_", extra="forbid", frozen=True)

    # --- sources
    kafka_bootstrap: str = "127.0.0.1:9092"
    envelope_topic: str = TOPIC_ENVELOPES
    divergence_topic: str = TOPIC_DIVERGENCES
    group_id: str = "reprolane-archiver"
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    heartbeat_interval_ms: int = Field(default=3_000, ge=100)
    auto_offset_reset: Literal["earliest", "latest"] = "earliest"
    flush_rows: int = Field(default=50_000, ge=1, description="write the buffered rows at this many")
    flush_seconds: float = Field(default=60.0, gt=0.0, description="... or when the oldest is this old")

    # --- S3 (s3_bucket, the audit bucket, is where the request-id index is rebuilt)
    lake_bucket: str = Field(default=LAKE_BUCKET, description="bucket of the lake; must not be under Object Lock")
    lake_prefix: str = Field(default=LAKE_PREFIX, pattern=r"^[A-Za-z0-9._\-/]*[A-Za-z0-9._\-]$")
    keys_bucket: str = Field(default=LAKE_BUCKET, description="bucket of the wrapped data keys")

    # --- which lake: Hive-partitioned Parquet in ``lake_bucket``, or Iceberg tables through a REST catalog
    lake_kind: Literal["parquet", "iceberg"] = "parquet"
    iceberg_uri: str | None = Field(default=None, description="Iceberg REST catalog URL (the stack's by default)")
    iceberg_warehouse: str = Field(default=f"s3://{ICEBERG_TABLE_BUCKET}/", description="catalog warehouse")
    iceberg_namespace: str = Field(default="reprolane", pattern=r"^[A-Za-z0-9_]+$")
    iceberg_sigv4: bool = Field(default=True, description="sign catalog requests with the S3 credentials")
    iceberg_signing_name: str = "s3tables"
    iceberg_token: SecretStr | None = Field(default=None, description="bearer token of the catalog, if it wants one")
