"""Retention and legal hold: ``reprolane audit hold add|remove ID`` and ``reprolane audit expire [--dry-run]``.

Retention is per tenant and lives in the objects themselves: the publisher's S3 sink writes each envelope
with an Object Lock retain-until date of ``captured_at + retention_days_by_tenant[tenant]`` (else
``retention_days``). S3 then refuses to delete a version before that date (COMPLIANCE: not even the owner)
or while it is under legal hold. The expiry job therefore needs no policy of its own; it deletes exactly the
envelope versions S3 would let it delete, and says what it kept and why:

    held        a legal hold is on (kept even past retention)
    retained    the retain-until date has not passed
    unretained  the version has no retain-until date at all (written with retention 0): never deleted here
    refused     S3 refused the delete anyway (reported, never retried silently)

Every run that deletes something writes a report to ``audit/expiry/<timestamp>-<uuid8>.json`` (write-once, under
Object Lock when the settings ask for it), so ``reprolane audit verify --range`` tells an expired leaf from a deleted
one. The report is not signed: whoever may write under ``audit/`` could forge one, like any unsigned tail.

A hold is placed on the *current* version of each envelope object (the one the verifier and the replayer
read). An id is a request id (``index/request-id/``) or a workflow id (one tenant's steps under
``index/workflow/``); every index entry is checked against the record it points at before it is followed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from capture.audit.errors import AuditStoreError, UnknownIdError
from capture.audit.index import checked_entry
from capture.audit.store import AuditStore
from schemas.index_entry import IndexEntry, filed_step
from schemas.layout import (
    ENVELOPES_PREFIX,
    envelope_id_of_key,
    expiry_report_key,
    request_index_key,
    workflow_index_prefix,
)


@dataclass(frozen=True)
class HeldObject:
    key: str
    version_id: str
    envelope_id: str


def resolve(store: AuditStore, some_id: str, tenant: str | None = None) -> list[IndexEntry]:
    """The index entries of a request id, or of every step of a workflow id (both when both exist), each checked
    against the record it points at (`capture.audit.index`: a mismatch is `IndexMismatchError`, never followed).

    A workflow id is the client's label: two tenants may send the same one. Its steps are taken for `tenant`
    only, and without a tenant a workflow id is refused (`UnknownIdError`, naming its tenants): a hold by
    workflow never reaches another tenant's records. A request id is the sidecar's own; with `tenant` it must
    be that tenant's.
    """
    found: list[IndexEntry] = []
    direct = checked_entry(store, request_index_key(some_id), request_id=some_id)
    if direct is not None and tenant in (None, direct.tenant):
        found.append(direct)
    steps: list[IndexEntry] = []
    for index_key, _ in store.list_keys(workflow_index_prefix(some_id)):
        step = checked_entry(store, index_key, workflow=filed_step(some_id, index_key))
        if step is not None:
            steps.append(step)
    if steps and tenant is None:
        tenants = ", ".join(sorted({s.tenant for s in steps}))
        raise UnknownIdError(f"{some_id!r} is a workflow id (steps of tenant {tenants}): name the tenant (--tenant)")
    for step in steps:
        if step.tenant == tenant and all(step.key != f.key for f in found):
            found.append(step)
    if not found:
        of = "" if tenant is None else f" of tenant {tenant!r}"
        raise UnknownIdError(f"{some_id!r} is neither a request id nor a workflow id{of} in s3://{store.bucket}")
    return found


def hold_entries(store: AuditStore, entries: list[IndexEntry], on: bool) -> list[HeldObject]:
    """Place (``on``) or lift a legal hold on the current version of each entry's envelope object."""
    done: list[HeldObject] = []
    for entry in entries:
        version = store.current_version(entry.key)
        if version is None:
            raise UnknownIdError(f"the envelope object {entry.key} does not exist")
        store.set_legal_hold(entry.key, version, on)
        done.append(HeldObject(entry.key, version, envelope_id_of_key(entry.key)))
    return done


def set_hold(store: AuditStore, some_id: str, on: bool, tenant: str | None = None) -> list[HeldObject]:
    """`hold_entries` of `resolve(store, some_id, tenant)`."""
    return hold_entries(store, resolve(store, some_id, tenant), on)


@dataclass
class ExpiryReport:
    ran_at: datetime
    dry_run: bool
    deleted: list[dict[str, str]] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    retained: list[str] = field(default_factory=list)
    unretained: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    report_key: str | None = None

    def counts(self) -> dict[str, int]:
        return {
            "deleted": len(self.deleted),
            "held": len(self.held),
            "retained": len(self.retained),
            "unretained": len(self.unretained),
            "refused": len(self.refused),
        }

    def to_json(self) -> bytes:
        doc = {
            "ran_at": self.ran_at.isoformat().replace("+00:00", "Z"),
            "dry_run": self.dry_run,
            "counts": self.counts(),
            "deleted": self.deleted,
            "held": self.held,
            "retained": self.retained,
            "unretained": self.unretained,
            "refused": self.refused,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def expire(
    store: AuditStore,
    *,
    dry_run: bool = False,
    now: datetime | None = None,
    prefix: str = ENVELOPES_PREFIX,
    report_retention: timedelta | None = None,
) -> ExpiryReport:
    """Delete the envelope versions past their retain-until date and not held (see module doc)."""
    now = now or datetime.now(UTC)
    report = ExpiryReport(now, dry_run)
    for version in store.versions(prefix):
        name = f"{version.key}?versionId={version.version_id}"
        if store.legal_hold(version.key, version.version_id):
            report.held.append(name)
            continue
        until = store.retain_until(version.key, version.version_id)
        if until is None:
            report.unretained.append(name)
            continue
        if until.astimezone(UTC) > now:
            report.retained.append(name)
            continue
        entry = {
            "key": version.key,
            "version_id": version.version_id,
            "envelope_id": envelope_id_of_key(version.key),
            "retain_until": until.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        }
        if not dry_run:
            try:
                store.delete_version(version.key, version.version_id)
            except AuditStoreError as exc:
                report.refused.append(f"{name}: {exc}")
                continue
        report.deleted.append(entry)
    if report.deleted and not dry_run:
        key = expiry_report_key(now, uuid.uuid4().hex[:8])
        until = now + report_retention if report_retention is not None else None
        store.put_new(key, report.to_json(), until)
        report.report_key = key
    return report
