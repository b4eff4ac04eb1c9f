"""The S3 boundary of the audit evidence: a bucket, a boto3 client, and the few calls the jobs make.

Every botocore exception is translated here into `AuditStoreError` (naming the bucket and key), so the rest of
``capture.audit`` never sees one. Calls are synchronous; async callers run them in a thread pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from capture.audit.errors import AuditStoreError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

    from capture.audit.settings import AuditSettings


@dataclass(frozen=True)
class Version:
    key: str
    version_id: str
    is_latest: bool


class AuditStore:
    """One bucket. `put_new` is a conditional create (``If-None-Match: *``), optionally under Object Lock."""

    def __init__(self, client: S3Client, bucket: str, lock_mode: str = "COMPLIANCE") -> None:
        self.client = client
        self.bucket = bucket
        self.lock_mode = lock_mode

    @classmethod
    def from_settings(cls, settings: AuditSettings) -> AuditStore:
        from infra.clients.s3 import S3Policy, make_s3_client

        return cls(make_s3_client(settings, policy=S3Policy.AUDIT), settings.s3_bucket, settings.object_lock_mode)

    def _fail(self, what: str, key: str, exc: Exception) -> AuditStoreError:
        return AuditStoreError(f"s3 {what} {self.bucket}/{key}: {_code(exc)}: {exc}")

    def put_new(self, key: str, body: bytes, retain_until: datetime | None = None) -> bool:
        """Create `key` unless it exists; True when created, False when something was there already."""
        from botocore.exceptions import BotoCoreError, ClientError

        extra: dict[str, Any] = {}
        if retain_until is not None:
            extra = {"ObjectLockMode": self.lock_mode, "ObjectLockRetainUntilDate": retain_until}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*", **extra)
        except ClientError as exc:
            if _status(exc) == 412 or _code(exc) == "PreconditionFailed":
                return False
            raise self._fail("put", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("put", key, exc) from exc
        return True

    def get(self, key: str) -> bytes | None:
        """The current version's bytes, or None when there is no such key."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail("get", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("get", key, exc) from exc

    def list_keys(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every current object under `prefix`, in key order."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    yield obj["Key"], int(obj.get("Size", 0))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("list", prefix, exc) from exc

    def subfolders(self, prefix: str) -> list[str]:
        """The common prefixes one level below `prefix` (``prefix/x/``)."""
        from botocore.exceptions import BotoCoreError, ClientError

        found: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                found += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("list", prefix, exc) from exc
        return found

    def versions(self, prefix: str) -> Iterator[Version]:
        """Every object version (not delete markers) under `prefix`."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in self.client.get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=prefix):
                for v in page.get("Versions", []):
                    yield Version(v["Key"], str(v.get("VersionId") or "null"), bool(v.get("IsLatest")))
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("list versions", prefix, exc) from exc

    def current_version(self, key: str) -> str | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _code(exc) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail("head", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("head", key, exc) from exc
        return str(head.get("VersionId") or "null")

    def set_legal_hold(self, key: str, version_id: str, on: bool) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.put_object_legal_hold(
                Bucket=self.bucket, Key=key, VersionId=version_id, LegalHold={"Status": "ON" if on else "OFF"}
            )
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("legal hold", key, exc) from exc

    def legal_hold(self, key: str, version_id: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            got = self.client.get_object_legal_hold(Bucket=self.bucket, Key=key, VersionId=version_id)
        except ClientError as exc:
            if _code(exc) in ("NoSuchObjectLegalHold", "ObjectLockConfigurationNotFoundError", "InvalidRequest"):
                return False
            raise self._fail("get legal hold", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("get legal hold", key, exc) from exc
        return got.get("LegalHold", {}).get("Status") == "ON"

    def retain_until(self, key: str, version_id: str) -> datetime | None:
        """The version's Object Lock retain-until date; None when it has none."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            got = self.client.get_object_retention(Bucket=self.bucket, Key=key, VersionId=version_id)
        except ClientError as exc:
            if _code(exc) in (
                "NoSuchObjectLockConfiguration",
                "ObjectLockConfigurationNotFoundError",
                "InvalidRequest",
            ):
                return None
            raise self._fail("get retention", key, exc) from exc
        except BotoCoreError as exc:
            raise self._fail("get retention", key, exc) from exc
        until = got.get("Retention", {}).get("RetainUntilDate")
        return until if isinstance(until, datetime) else None

    def delete_version(self, key: str, version_id: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, VersionId=version_id)
        except (ClientError, BotoCoreError) as exc:
            raise self._fail("delete", f"{key}?versionId={version_id}", exc) from exc


def _status(exc: Any) -> int | None:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def _code(exc: Any) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return type(exc).__name__
    return str(response.get("Error", {}).get("Code", "?"))
