"""The audit jobs' reading of index objects: an entry is acted on only when the record it points at agrees.

``verify``, ``hold`` and ``lake rebuild-index`` find records through index objects, which anyone with write
access could have written or (before they were write-once) overwritten: an entry pointing at another tenant's
envelope would let a hold land on the wrong record while the real one expires. `checked_entry` reads an entry
and the object it names and applies `schemas.index_entry.index_mismatch` (the same rule the replayer's store
applies): a mismatch is an `IndexMismatchError`, never followed. The audit jobs hold no KEK, so a sealed record
is compared by its clear metadata (whether its bytes are the logged ones is `verify`'s business).
`repair_entry` writes a lost entry back from the lake under the same rule, and never replaces a valid one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from capture.audit.errors import IndexMismatchError, UnknownIdError
from capture.audit.store import AuditStore
from capture.ledger.store import LedgerStore
from schemas.errors import ContractError
from schemas.index_entry import IndexEntry, index_mismatch, parse_index_entry, record_facts


@dataclass(frozen=True, slots=True)
class EntryCheck:
    """An index entry and what its record says against it: `problems` empty means it can be trusted;
    `missing` means the object it names is not there (deleted, expired, or never written)."""

    entry: IndexEntry
    problems: tuple[str, ...] = ()
    missing: bool = False


def read_entry(store: LedgerStore, index_key: str) -> IndexEntry | None:
    """The entry stored under `index_key`; None when there is none; `UnknownIdError` when it does not parse."""
    body = store.get(index_key)
    if body is None:
        return None
    try:
        return parse_index_entry(body, f"s3://{store.bucket}/{index_key}")
    except ContractError as exc:
        raise UnknownIdError(str(exc)) from None


def check_entry(
    store: LedgerStore,
    entry: IndexEntry,
    *,
    request_id: str | None = None,
    workflow: tuple[str, int] | None = None,
) -> EntryCheck:
    """`entry` against the record it points at (see module doc)."""
    data = store.get(entry.key)
    if data is None:
        return EntryCheck(entry, missing=True)
    try:
        facts = record_facts(data)
    except ContractError as exc:
        return EntryCheck(entry, (f"the object it points at is not an envelope: {exc}",))
    return EntryCheck(entry, tuple(index_mismatch(entry, facts, request_id=request_id, workflow=workflow)))


def checked_entry(
    store: LedgerStore,
    index_key: str,
    *,
    request_id: str | None = None,
    workflow: tuple[str, int] | None = None,
) -> IndexEntry | None:
    """The entry under `index_key` when its record agrees with it; None when there is no entry;
    `IndexMismatchError` naming every difference when the record disagrees (or is not an envelope)."""
    entry = read_entry(store, index_key)
    if entry is None:
        return None
    check = check_entry(store, entry, request_id=request_id, workflow=workflow)
    if check.problems:
        raise IndexMismatchError(
            f"index object s3://{store.bucket}/{index_key} does not match the envelope it points to: "
            + "; ".join(check.problems)
        )
    return entry


# -- rebuilding lost entries (``reprolane audit lake rebuild-index``) ------------------------------------------------


@dataclass
class RepairReport:
    """What `repair_entry` did with each entry: ``written`` (missing, now written), ``repaired`` (invalid,
    replaced: only with ``overwrite``), ``invalid`` (invalid, left as it is), ``kept`` (valid, the same
    envelope), ``kept_other`` (valid but pointing at another envelope: never replaced), ``skipped`` (the lake's
    row does not match the record in S3: nothing written from it)."""

    written: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    kept_other: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {name: len(getattr(self, name)) for name in self.__dataclass_fields__}


def repair_entry(
    store: AuditStore,
    index_key: str,
    body: bytes,
    report: RepairReport,
    *,
    request_id: str | None = None,
    workflow: tuple[str, int] | None = None,
    overwrite: bool = False,
) -> None:
    """Write the index entry `body` (from the lake) under `index_key` when that is safe, and say in `report` what
    was done. The lake is an analytics copy, not evidence: its entry is written only when the record it points
    at agrees with it. An entry already there is replaced only when it is invalid (malformed, pointing at a
    missing object or at a record that disagrees with it) and `overwrite` is set; a valid entry is never
    replaced, even when it points at another envelope than the lake's row."""
    wanted = parse_index_entry(body, f"the lake's row for {index_key}")
    check = check_entry(store, wanted, request_id=request_id, workflow=workflow)
    if check.missing or check.problems:
        why = "its object is missing" if check.missing else "; ".join(check.problems)
        report.skipped.append(f"{index_key}: the lake's row does not match S3 ({why})")
        return
    broken: str | None = None
    try:
        present = read_entry(store, index_key)
    except UnknownIdError as exc:
        present, broken = None, str(exc)
    if present is None and broken is None:
        if store.put_new(index_key, body):
            report.written.append(index_key)
            return
        present = read_entry(store, index_key)  # the capture side wrote it meanwhile
    if present is not None:
        now = check_entry(store, present, request_id=request_id, workflow=workflow)
        if not now.missing and not now.problems:
            if present.envelope_id == wanted.envelope_id and present.key == wanted.key:
                report.kept.append(index_key)
            else:
                report.kept_other.append(f"{index_key} -> {present.key} (the lake says {wanted.key})")
            return
        broken = "it points at a missing object" if now.missing else "; ".join(now.problems)
    if not overwrite:
        report.invalid.append(f"{index_key}: {broken} (pass --overwrite to repair it)")
        return
    store.replace(index_key, body)
    report.repaired.append(f"{index_key}: {broken}")
