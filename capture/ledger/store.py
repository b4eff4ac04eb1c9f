"""The S3 boundary of the ledger: one bucket, a boto3 client, and the calls the Merkle log makes.

`LedgerStore` creates objects once (``If-None-Match: *``, optionally under Object Lock), reads them and lists a
prefix; every botocore exception becomes `LedgerStoreError`, naming the bucket and key (the audit jobs' subclass,
`capture.audit.store.AuditStore`, raises its own error type instead, through `error`). Which S3 answers mean
"no such key" and "already written" is `infra.clients.s3`'s reading, the same for every caller. Calls are
synchronous; async callers run them in a thread pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from capture.ledger.errors import LedgerStoreError
from infra.clients.s3 import error_code, is_already_written, is_missing, s3_errors

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def describe(exc: BaseException) -> str:
    """``<code>: <message>`` of an S3 failure (the exception's type where S3 gave no code)."""
    code = error_code(exc) or ("?" if hasattr(exc, "response") else type(exc).__name__)
    return f"{code}: {exc}"


class LedgerStore:
    """One bucket. `put_new` is a conditional create, optionally under Object Lock (``lock_mode``)."""

    #: The error every failed call raises (a subclass names its own).
    error: ClassVar[type[Exception]] = LedgerStoreError

    def __init__(self, client: S3Client, bucket: str, lock_mode: str = "COMPLIANCE") -> None:
        self.client = client
        self.bucket = bucket
        self.lock_mode = lock_mode

    def _fail(self, what: str, key: str, exc: BaseException) -> Exception:
        return type(self).error(f"s3 {what} {self.bucket}/{key}: {describe(exc)}")

    def put_new(self, key: str, body: bytes, retain_until: datetime | None = None) -> bool:
        """Create `key` unless it exists; True when created, False when something was there already."""
        extra: dict[str, Any] = {}
        if retain_until is not None:
            extra = {"ObjectLockMode": self.lock_mode, "ObjectLockRetainUntilDate": retain_until}
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*", **extra)
        except s3_errors() as exc:
            if is_already_written(exc):
                return False
            raise self._fail("put", key, exc) from exc
        return True

    def get(self, key: str) -> bytes | None:
        """The current version's bytes, or None when there is no such key."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except s3_errors() as exc:
            if is_missing(exc):
                return None
            raise self._fail("get", key, exc) from exc

    def list_keys(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every current object under `prefix`, in key order."""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    yield obj["Key"], int(obj.get("Size", 0))
        except s3_errors() as exc:
            raise self._fail("list", prefix, exc) from exc
