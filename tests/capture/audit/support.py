"""Shared by the audit stack tests: publish envelopes through the real publisher to S3, and run the audit CLI
(``reprolane audit verify|hold|expire|audit ...``) in a child process against the session stack."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from capture.audit.operators import OPERATOR_KEYS
from capture.ledger.key_file import new_key as new_operator_key
from capture.ledger.key_file import write_key_file
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.state import StackInfo
from schemas import Envelope
from schemas.access_log import AccessRecord, decode_access_record
from schemas.layout import access_log_day_prefix
from tests.cli_process import reprolane


async def publish_through_s3(
    settings: CaptureSettings,
    envs: list[Envelope],
    spool_dir: Path,
    *,
    sink: S3Sink | None = None,
    batch_size: int = 256,
) -> None:
    """Spool `envs`, then run the real publisher (S3 sink, then the Merkle log when the settings ask for it) until
    the spool is empty; `sink` replaces the default S3 sink (a test's retention, say)."""
    spool = Spool(spool_dir, max_bytes=settings.spool_max_bytes, group_commit_ms=0)
    await spool.open()
    publisher = Publisher(spool, settings, sinks=[sink or S3Sink(settings)], batch_size=batch_size, idle_poll_s=0.05)
    try:
        for env in envs:
            await spool.append(env)
        await publisher.start()
        for _ in range(600):
            if spool.depth == 0:
                break
            await asyncio.sleep(0.05)
        assert spool.depth == 0, "publisher did not drain"
    finally:
        await publisher.stop()
        await spool.close()


def audit_cli(
    stack: StackInfo, bucket: str, *args: str, operators: OperatorKeys | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """``reprolane ARGS`` with the audit settings of `stack` and `bucket` (plus ``REPROLANE_AUDIT_<KEY>`` from `env`),
    log retention off so that test objects can be deleted; with `operators`, its key store configured."""
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_OPERATOR_")},
        **(operators.env() if operators is not None else {}),
        "REPROLANE_AUDIT_S3_ENDPOINT": stack.s3_endpoint,
        "REPROLANE_AUDIT_S3_ACCESS_KEY": stack.s3_access_key,
        "REPROLANE_AUDIT_S3_SECRET_KEY": stack.s3_secret_key,
        "REPROLANE_AUDIT_S3_BUCKET": bucket,
        "REPROLANE_AUDIT_LOG_RETENTION_DAYS": "0",
        **{f"REPROLANE_AUDIT_{key.upper()}": value for key, value in env.items()},
    }
    return reprolane(*args, env=environ, timeout=60)


@dataclass(frozen=True)
class OperatorKeys:
    """An operator key store (`capture.audit.operators`) and one 0600 key file per key, by name."""

    store: Path
    files: dict[str, Path]

    def env(self) -> dict[str, str]:
        return {"REPROLANE_OPERATOR_KEYS_PATH": str(self.store)}

    def key_file(self, name: str) -> str:
        return str(self.files[name])


def operator_keys(directory: Path, **keys: tuple[tuple[str, ...], str | None]) -> OperatorKeys:
    """A key store in `directory` with one key per keyword, ``name=(roles, tenant or None)``."""
    directory.mkdir(parents=True, exist_ok=True)
    entries, files = [], {}
    for name, (roles, tenant) in keys.items():
        key, entry = new_operator_key(OPERATOR_KEYS, name, tenant, roles)
        entries.append(entry)
        files[name] = directory / f"{name}.key"
        files[name].write_text(key + "\n", encoding="utf-8")
        files[name].chmod(0o600)
    write_key_file(directory / "operators.json", entries)
    return OperatorKeys(directory / "operators.json", files)


def access_records(client: Any, bucket: str, target: str, since: datetime | None = None) -> list[AccessRecord]:
    """The access-log records of today (UTC) in `bucket` whose target starts with `target` (made at or after
    `since`), oldest first."""
    prefix = access_log_day_prefix(datetime.now(UTC).strftime("%Y-%m-%d"))
    found = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            record = decode_access_record(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            if record.target.startswith(target) and (since is None or record.at >= since):
                found.append(record)
    return sorted(found, key=lambda r: r.at)


def new_key() -> tuple[bytes, bytes]:
    """A fresh Ed25519 (private, public) raw key pair to sign checkpoints with."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    key = Ed25519PrivateKey.generate()
    return (
        key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()),
        key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
    )


def random_day() -> datetime:
    """A capture day no other test (or earlier run) uses: somewhere in years 2100..7000. Drawn from the OS, not from
    `random`: an in-process vLLM engine seeds the process's `random` (``seed=0``), which made two tests of one worker
    draw the same day and read each other's checkpoints."""
    return datetime(2100, 1, 1, 10, 0, tzinfo=UTC) + timedelta(days=secrets.randbelow(1_800_000))
