"""Per-tenant data keys for sealed envelopes, and crypto-shredding.

The key source is the KEK from the settings (``REPROLANE_CAPTURE_KEK``, base64 of 32 bytes, or the file named by
``REPROLANE_CAPTURE_KEK_FILE``); in production that is where a KMS-held key or a mounted secret plugs in. Each
tenant's data keys are stored *wrapped* by it (`schemas.sealed.WrappedKey`) in the keys bucket, which is not
under Object Lock (``schemas.layout.data_key_key``: ``keys/tenant=T/<key_id>.json``). Key ids sort by creation
time; the newest is the tenant's current key, and older ones stay readable for the records they sealed.

- `Keyring.current_key` returns (key id, data key) for sealing, creating the tenant's first key on demand
  (``If-None-Match: *``: two sidecars racing both succeed with two keys, each record names its own).
  Keys are cached in memory for ``data_key_cache_s``: a shredded key can keep sealing *new* records in a
  running sidecar for at most that long, and those records are unreadable too (their key is gone).
- `Keyring.shred` deletes every version (and delete marker) of every wrapped key of the tenant, then checks
  that none is left. The envelope objects stay in place, write-once, and can never be opened again.
- `Sealer` turns a record of an encrypted tenant (the sidecar's `capture.publishing.outgoing.Outgoing`: any
  `capture.ledger.records.StoredRecord`) into the sealed record the sinks send instead.

boto3 is blocking: the publisher calls `Sealer.seal_batch` in a worker thread. Every botocore error becomes
`KeyringError`. The KEK is read from the data-key fields every settings class with data keys inherits
(`infra.clients.connection.DataKeyFields`); the sidecar builds its sealer (`capture.publishing.publisher`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from capture.ledger.errors import KeyringError
from capture.ledger.records import StoredRecord
from infra.clients.connection import DataKeyFields
from infra.clients.s3 import error_code, is_missing, s3_errors
from schemas import ContractError, WorkflowRef
from schemas.errors import SealError
from schemas.layout import data_key_id, data_key_key, data_key_prefix
from schemas.sealed import (
    SEALED_SCHEMA_VERSION,
    decode_wrapped_key,
    new_data_key,
    parse_kek,
    seal_envelope,
    unwrap_key,
    wrap_key,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


_R = TypeVar("_R", bound=StoredRecord)


def load_kek(settings: DataKeyFields) -> bytes:
    """The KEK from ``kek`` or ``kek_file``; `KeyringError` when neither is set or it is malformed."""
    if settings.kek is not None:
        text = settings.kek.get_secret_value()
    elif settings.kek_file is not None:
        try:
            text = settings.kek_file.read_text()
        except OSError as exc:
            raise KeyringError(f"cannot read the KEK file {settings.kek_file}: {exc.strerror or exc}") from exc
    else:
        raise KeyringError("encrypt_tenants is set but no KEK is configured (REPROLANE_CAPTURE_KEK or _KEK_FILE)")
    try:
        return parse_kek(text)
    except SealError as exc:
        raise KeyringError(str(exc)) from exc


def _new_key_id() -> str:
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:12]}"


class Keyring:
    """Wrapped data keys of every tenant in one bucket (see module docstring). Thread-safe."""

    def __init__(
        self,
        client: S3Client,
        bucket: str,
        kek: bytes | None,
        *,
        cache_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client, self.bucket, self._kek = client, bucket, kek
        self.cache_s, self._clock = cache_s, clock  # a key is reused from memory this long (by `clock`)
        self._cache: dict[str, tuple[str, bytes, float]] = {}  # tenant -> (key id, data key, fetched at)
        self._lock = threading.Lock()

    def _s3(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except s3_errors() as exc:
            raise KeyringError(f"s3 {what} in bucket {self.bucket}: {error_code(exc) or exc}") from exc

    def _need_kek(self) -> bytes:
        if self._kek is None:
            raise KeyringError("no KEK configured: data keys can be listed and shredded, not used")
        return self._kek

    def key_ids(self, tenant: str) -> list[str]:
        """The tenant's stored key ids, oldest first."""
        prefix = data_key_prefix(tenant)

        def _list() -> list[str]:
            keys: list[str] = []
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                keys += [data_key_id(tenant, o["Key"]) for o in page.get("Contents", []) if "Key" in o]
            return sorted(keys)

        return list(self._s3(f"list {prefix}", _list))

    def get_key(self, tenant: str, key_id: str) -> bytes | None:
        """The unwrapped data key, or None when it does not exist (never made, or shredded)."""
        key = data_key_key(tenant, key_id)
        try:
            body = self._s3(f"get {key}", lambda: self._client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except KeyringError as exc:
            if exc.__cause__ is not None and is_missing(exc.__cause__):
                return None
            raise
        try:
            return unwrap_key(decode_wrapped_key(body), self._need_kek())
        except (ContractError, SealError) as exc:
            raise KeyringError(f"data key {key}: {exc}") from exc

    def _create(self, tenant: str) -> tuple[str, bytes]:
        kek = self._need_kek()
        key_id, data_key = _new_key_id(), new_data_key()
        wrapped = wrap_key(data_key, kek, tenant=tenant, key_id=key_id, created_at=datetime.now(UTC))
        key = data_key_key(tenant, key_id)
        body = wrapped.model_dump_json().encode()
        self._s3(
            f"put {key}",
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentType="application/json", IfNoneMatch="*"
            ),
        )
        return key_id, data_key

    def current_key(self, tenant: str) -> tuple[str, bytes]:
        """(key id, data key) to seal the tenant's new records with; creates the first key when there is none."""
        with self._lock:
            cached = self._cache.get(tenant)
            if cached is not None and self._clock() - cached[2] < self.cache_s:
                return cached[0], cached[1]
            found: tuple[str, bytes] | None = None
            for key_id in reversed(self.key_ids(tenant)):
                data_key = self.get_key(tenant, key_id)
                if data_key is not None:
                    found = (key_id, data_key)
                    break
            if found is None:
                found = self._create(tenant)
            self._cache[tenant] = (found[0], found[1], self._clock())
            return found

    def _versions(self, prefix: str) -> list[tuple[str, str | None]]:
        def _list() -> list[tuple[str, str | None]]:
            found: list[tuple[str, str | None]] = []
            pages = self._client.get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for entry in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                    found.append((entry["Key"], entry.get("VersionId")))
            return found

        return list(self._s3(f"list versions {prefix}", _list))

    def _delete(self, key: str, version: str | None) -> None:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if version and version != "null":
            kwargs["VersionId"] = version
        self._s3(f"delete {key}", lambda: self._client.delete_object(**kwargs))

    def shred(self, tenant: str) -> int:
        """Delete every version of every wrapped key of `tenant`; the number of objects/versions deleted.

        Raises `KeyringError` if anything of the tenant's keys is still listed afterwards.
        """
        prefix = data_key_prefix(tenant)
        with self._lock:
            self._cache.pop(tenant, None)
            deleted = 0
            for key, version in self._versions(prefix):
                self._delete(key, version)
                deleted += 1
            for key_id in self.key_ids(tenant):  # a store that lists no versions: plain deletes
                self._delete(data_key_key(tenant, key_id), None)
                deleted += 1
            left = self.key_ids(tenant) + [key for key, _ in self._versions(prefix)]
        if left:
            raise KeyringError(f"shredding tenant {tenant}: {len(left)} key objects are still listed: {left[:3]}")
        return deleted


class Sealer:
    """Seals the outgoing envelopes of the configured tenants; the others pass through untouched."""

    def __init__(self, keyring: Keyring, tenants: Sequence[str]) -> None:
        self.keyring = keyring
        self.tenants = frozenset(tenants)

    def seal(self, item: _R) -> _R:
        if item.tenant not in self.tenants or item.schema_version == SEALED_SCHEMA_VERSION:
            return item
        key_id, data_key = self.keyring.current_key(item.tenant)
        workflow = None
        if item.workflow_id is not None and item.workflow_step is not None:
            workflow = WorkflowRef(workflow_id=item.workflow_id, step=item.workflow_step)
        sealed = seal_envelope(
            item.payload,
            request_id=item.request_id,
            tenant=item.tenant,
            captured_at=item.captured_at,
            workflow=workflow,
            key_id=key_id,
            data_key=data_key,
        )
        return item.with_payload(sealed.canonical(), SEALED_SCHEMA_VERSION)

    def seal_batch(self, batch: Sequence[_R]) -> list[_R]:
        return [self.seal(item) for item in batch]
