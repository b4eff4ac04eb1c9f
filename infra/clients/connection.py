"""The connection fields every service's settings share: how to reach Kafka and S3, and the tenants' data keys.

Pydantic field mixins beside the clients they configure: each service's settings class (``CaptureSettings``,
``AuditSettings``, ``LakeSettings``, ``ReplayerSettings``) inherits them and keeps its own environment prefix,
so the variable names stay per service (``REPROLANE_CAPTURE_KAFKA_BOOTSTRAP``,
``REPROLANE_ARCHIVER_KAFKA_BOOTSTRAP``, ...).
A class whose default differs redeclares just that field (the replayer and the archiver default
``kafka_bootstrap`` to the local stack's broker; the sidecar's is unset: no Kafka sink).

The translation of these fields into client options (the SSL context, SASL, timeouts, retries) is written once,
in `infra.clients`; nothing here opens a connection.

Secrets, checked when the settings are built (docs/SECURITY.md, "Keys and secrets"); the key files a service
reads at start (the sidecar's API keys, the replayer's replay-request keys) go through `read_private_file`,
which refuses one that anyone but its owner may change:

- *From files, not the environment.* Each secret has a ``*_file`` twin (``s3_secret_key_file``,
  ``kafka_sasl_password_file``, ``s3_access_key_file``; the KEK already had ``kek_file``). A twin names a file
  (a Docker secret under ``/run/secrets``, a mounted Kubernetes secret) whose content, trailing newline removed,
  becomes the value when the value itself is unset; an empty file means unset. The file is read here, at
  settings build, so the secret never passes through the process environment, where every child process and
  ``/proc/<pid>/environ`` would see it. It reads only a path the operator configured.
- *Never an example value.* `EXAMPLE_SECRETS` lists every value committed in ``infra/secrets/*.example`` (a test
  keeps the two in step); a service configured with one refuses to start, naming the field and the file to
  change. The local stack (`infra.stack.launcher`) makes its own random S3 secret, which is never one of them.
- *SASL needs a user.* Under ``SASL_PLAINTEXT`` / ``SASL_SSL`` a username and a password are required: a client
  that would log in as the empty user fails at start, not at its first produce.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from schemas.layout import LAKE_BUCKET

KafkaSecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]

#: Every value committed in ``infra/secrets/*.example`` (and the example KEK), refused as a credential.
EXAMPLE_SECRETS: Final = frozenset(
    {
        "LOCAL-ONLY-change-me-writer-secret",
        "LOCAL-ONLY-change-me-minio-root",
        "LOCAL-ONLY-change-me-grafana",
        "LOCAL-ONLY-change-me-kafka-admin",
        "LOCAL-ONLY-change-me-kafka-capture",
        "LOCAL-ONLY-change-me-kafka-replayer",
        "LOCAL-ONLY-change-me-kafka-archiver",
        "LOCAL-ONLY-change-me-kafka-monitor",
        "LOCAL-ONLY-change-me-kafka-shipper",
        "TE9DQUwtT05MWS1jaGFuZ2UtbWUta2VrLTAwMDAwMCE=",  # base64 of "LOCAL-ONLY-change-me-kek-000000!"
        "TE9DQUwtT05MWS1jaGFuZ2UtbWUtcmVwbGF5LWtleSE=",  # base64 of "LOCAL-ONLY-change-me-replay-key!"
    }
)
#: Where an operator replaces an example value.
SECRETS_README: Final = "infra/secrets/README.md"


def _read_secret_file(path: Any, field: str) -> str | None:
    """The content of a secret file (trailing newline removed), None when empty; `ValueError` naming the field."""
    try:
        text = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"{field}_file: cannot read {path}: {exc.strerror or exc}") from exc
    return text or None


def _fill_from_files(data: Any, fields: tuple[str, ...]) -> Any:
    """For each secret field unset in the input whose ``<field>_file`` is set, the file's content."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for field in fields:
        path = out.get(f"{field}_file")
        if path in (None, "") or out.get(field) not in (None, ""):
            continue
        value = _read_secret_file(path, field)
        if value is not None:
            out[field] = value
    return out


_REFUSED_MODES: Final = {
    # group_may_read -> (the mode bits refused, how the refusal says it)
    False: (stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH, "readable or writable by group or others"),
    True: (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP, "readable by others or writable by its group"),
}


def read_private_file(path: Path, field: str, *, group_may_read: bool = False) -> bytes:
    """The bytes of a file that decides who may do what (a key file), when only its owner may change it and,
    unless `group_may_read` (a file of hashes, not secrets: 0640 is fine), only its owner may read it.
    `ValueError` naming `field` when it cannot be read or its mode lets anyone else in (never its content)."""
    try:
        mode = path.stat().st_mode
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror or exc}") from None
    refused, how = _REFUSED_MODES[group_may_read]
    if mode & refused:
        raise ValueError(f"{field}: {path} is {how} (mode {stat.S_IMODE(mode):04o}): chmod 600 it")
    return raw


def refuse_example_secret(field: str, value: str | SecretStr | None, source: Path | None = None) -> None:
    """`ValueError` when `value` is one of `EXAMPLE_SECRETS`: the message names the field and what to change."""
    if value is None:
        return
    text = value.get_secret_value() if isinstance(value, SecretStr) else value
    if text.strip() in EXAMPLE_SECRETS:
        where = f"the file {source}" if source is not None else "its value"
        raise ValueError(
            f"{field} is the committed example value: change {where} to a secret of your own "
            f"(the example files are described in {SECRETS_README})"
        )


class KafkaConnectionFields(BaseModel):
    """Where the Kafka brokers are and how a client authenticates to them."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    kafka_bootstrap: str | None = None
    kafka_security_protocol: KafkaSecurityProtocol = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = Field(
        default=None, description="PLAIN (the default under SASL_*), SCRAM-SHA-256 or SCRAM-SHA-512"
    )
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_sasl_password_file: Path | None = Field(
        default=None, description="file holding the SASL password (a Docker secret); used when the password is unset"
    )
    kafka_ssl_cafile: Path | None = Field(
        default=None, description="CA bundle (PEM) the brokers' certificates are checked against; unset: the system's"
    )
    kafka_ssl_certfile: Path | None = Field(default=None, description="client certificate (PEM), for mutual TLS")
    kafka_ssl_keyfile: Path | None = Field(default=None, description="the client certificate's private key (PEM)")

    @model_validator(mode="before")
    @classmethod
    def _kafka_secret_files(cls, data: Any) -> Any:
        return _fill_from_files(data, ("kafka_sasl_password",))

    @model_validator(mode="after")
    def _kafka_credentials(self) -> Self:
        refuse_example_secret("kafka_sasl_password", self.kafka_sasl_password, self.kafka_sasl_password_file)
        if self.kafka_security_protocol.startswith("SASL_") and self.kafka_bootstrap:
            if not self.kafka_sasl_username or self.kafka_sasl_password is None:
                raise ValueError(
                    f"kafka_security_protocol {self.kafka_security_protocol} needs kafka_sasl_username and "
                    "kafka_sasl_password (or kafka_sasl_password_file)"
                )
        return self


class S3ConnectionFields(BaseModel):
    """Where the S3 endpoint is, with which credentials, and the audit bucket (Object Lock)."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    s3_endpoint: str | None = None
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_access_key_file: Path | None = Field(default=None, description="file holding the access key id")
    s3_secret_key: SecretStr | None = None
    s3_secret_key_file: Path | None = Field(
        default=None, description="file holding the secret key (a Docker secret); used when the secret key is unset"
    )
    s3_bucket: str = Field(
        default="reprolane-audit", description="the audit bucket (Object Lock): envelopes, their index, the Merkle log"
    )
    s3_verify_tls: bool = True

    @model_validator(mode="before")
    @classmethod
    def _s3_secret_files(cls, data: Any) -> Any:
        return _fill_from_files(data, ("s3_access_key", "s3_secret_key"))

    @model_validator(mode="after")
    def _s3_credentials(self) -> Self:
        refuse_example_secret("s3_secret_key", self.s3_secret_key, self.s3_secret_key_file)
        return self


class DataKeyFields(BaseModel):
    """Where the encrypted tenants' wrapped data keys are (`schemas.sealed`), and the KEK that unwraps them."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    kek: SecretStr | None = Field(default=None, description="key-encryption key, base64 of 32 bytes")
    kek_file: Path | None = Field(default=None, description="file holding the KEK (base64); used when kek is unset")
    keys_bucket: str = Field(default=LAKE_BUCKET, description="bucket of the wrapped data keys (no Object Lock)")

    @model_validator(mode="after")
    def _kek_not_an_example(self) -> Self:
        """The KEK itself is read where it is used (`kek_file` may be mounted later); an example one is refused
        here when it can already be read."""
        refuse_example_secret("kek", self.kek)
        if self.kek is None and self.kek_file is not None:
            try:
                text = self.kek_file.read_text(encoding="utf-8")
            except OSError:
                return self  # reported, with its reason, by the reader that needs the key
            refuse_example_secret("kek", text, self.kek_file)
        return self
