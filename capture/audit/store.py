"""The S3 boundary of the audit jobs: the ledger's store plus the calls only the jobs make.

`AuditStore` is a `capture.ledger.store.LedgerStore` (conditional creates, reads, listings: what the Merkle log
and the checkpoints need) with the version, legal-hold, retention and delete calls of the retention jobs and the
one-level listing the verifier walks days with. Every botocore exception becomes `AuditStoreError` (naming the
bucket and key), so the rest of ``capture.audit`` never sees one. Calls are synchronous; async callers run them
in a thread pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

from capture.audit.errors import AuditStoreError
from capture.ledger.store import LedgerStore
from infra.clients.s3 import S3Policy, error_code, is_missing, make_s3_client, s3_errors

if TYPE_CHECKING:
    from capture.audit.settings import AuditSettings

_T = TypeVar("_T")


@dataclass(frozen=True)
class Version:
    """One version of an object, as S3 lists it."""

    key: str
    version_id: str
    is_latest: bool


#: What S3 servers answer for "this version has no legal hold / no retention" (not errors for the jobs).
NO_LEGAL_HOLD = frozenset({"NoSuchObjectLegalHold", "ObjectLockConfigurationNotFoundError", "InvalidRequest"})
NO_RETENTION = frozenset({"NoSuchObjectLockConfiguration", "ObjectLockConfigurationNotFoundError", "InvalidRequest"})


class AuditStore(LedgerStore):
    """One bucket, as the audit jobs use it (see module docstring)."""

    error = AuditStoreError

    @classmethod
    def from_settings(cls, settings: AuditSettings) -> AuditStore:
        return cls(make_s3_client(settings, policy=S3Policy.AUDIT), settings.s3_bucket, settings.object_lock_mode)

    def _call(self, what: str, key: str, call: Callable[[], _T], absent: Callable[[BaseException], bool]) -> _T | None:
        """`call()`; None when S3's answer means "absent" by `absent`; any other failure is `AuditStoreError`."""
        try:
            return call()
        except s3_errors() as exc:
            if absent(exc):
                return None
            raise self._fail(what, key, exc) from exc

    def subfolders(self, prefix: str) -> list[str]:
        """The common prefixes one level below `prefix` (``prefix/x/``)."""
        found: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                found += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        except s3_errors() as exc:
            raise self._fail("list", prefix, exc) from exc
        return found

    def versions(self, prefix: str) -> Iterator[Version]:
        """Every object version (not delete markers) under `prefix`."""
        try:
            for page in self.client.get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=prefix):
                for v in page.get("Versions", []):
                    yield Version(v["Key"], str(v.get("VersionId") or "null"), bool(v.get("IsLatest")))
        except s3_errors() as exc:
            raise self._fail("list versions", prefix, exc) from exc

    def current_version(self, key: str) -> str | None:
        """The current version id of `key`; None when there is no such key."""
        head = self._call("head", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key), is_missing)
        return None if head is None else str(head.get("VersionId") or "null")

    def lock_state(self, key: str) -> dict[str, str | None] | None:
        """The current version's id, Object Lock mode, retain-until date (ISO) and legal hold, from one HEAD;
        None when there is no such key."""
        head = self._call("head", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key), is_missing)
        if head is None:
            return None
        until = head.get("ObjectLockRetainUntilDate")
        return {
            "version_id": str(head.get("VersionId") or "null"),
            "mode": head.get("ObjectLockMode"),
            "retain_until": until.isoformat() if isinstance(until, datetime) else None,
            "legal_hold": head.get("ObjectLockLegalHoldStatus"),
        }

    def set_legal_hold(self, key: str, version_id: str, on: bool) -> None:
        self._call(
            "legal hold",
            key,
            lambda: self.client.put_object_legal_hold(
                Bucket=self.bucket, Key=key, VersionId=version_id, LegalHold={"Status": "ON" if on else "OFF"}
            ),
            lambda _: False,
        )

    def legal_hold(self, key: str, version_id: str) -> bool:
        got = self._call(
            "get legal hold",
            key,
            lambda: self.client.get_object_legal_hold(Bucket=self.bucket, Key=key, VersionId=version_id),
            lambda exc: error_code(exc) in NO_LEGAL_HOLD,
        )
        return got is not None and got.get("LegalHold", {}).get("Status") == "ON"

    def retain_until(self, key: str, version_id: str) -> datetime | None:
        """The version's Object Lock retain-until date; None when it has none."""
        got = self._call(
            "get retention",
            key,
            lambda: self.client.get_object_retention(Bucket=self.bucket, Key=key, VersionId=version_id),
            lambda exc: error_code(exc) in NO_RETENTION,
        )
        until = None if got is None else got.get("Retention", {}).get("RetainUntilDate")
        return until if isinstance(until, datetime) else None

    def delete_version(self, key: str, version_id: str) -> None:
        self._call(
            "delete",
            f"{key}?versionId={version_id}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=key, VersionId=version_id),
            lambda _: False,
        )

    def replace(self, key: str, body: bytes) -> None:
        """Write a new current version of `key` unconditionally (repairing an invalid index entry only: every
        other object is written once, `put_new`)."""
        self._call(
            "put",
            key,
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType="application/json"),
            lambda _: False,
        )
