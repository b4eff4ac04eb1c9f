"""Shared by the audit stack tests: publish envelopes through the real publisher to S3, and run the audit CLI
(``reprolane verify|hold|expire|audit ...``) in a child process against the session stack."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from capture.publisher import Publisher
from capture.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.state import StackInfo
from schemas import Envelope


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


def audit_cli(stack: StackInfo, bucket: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``reprolane ARGS`` with the audit settings of `stack` and `bucket` (plus ``REPROLANE_AUDIT_<KEY>`` from `env`),
    log retention off so that test objects can be deleted."""
    environ = {
        **os.environ,
        "REPROLANE_AUDIT_S3_ENDPOINT": stack.s3_endpoint,
        "REPROLANE_AUDIT_S3_ACCESS_KEY": stack.s3_access_key,
        "REPROLANE_AUDIT_S3_SECRET_KEY": stack.s3_secret_key,
        "REPROLANE_AUDIT_S3_BUCKET": bucket,
        "REPROLANE_AUDIT_LOG_RETENTION_DAYS": "0",
        **{f"REPROLANE_AUDIT_{key.upper()}": value for key, value in env.items()},
    }
    return subprocess.run(
        [sys.executable, "-c", "from infra.cli import app; app()", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


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
    """A capture day no other test (or earlier run) uses: somewhere in years 2100..7000."""
    return datetime(2100, 1, 1, 10, 0, tzinfo=UTC) + timedelta(days=random.randrange(1_800_000))
