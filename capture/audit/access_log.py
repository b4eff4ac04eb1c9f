"""The one writer of the access log: a write-once `schemas.access_log.AccessRecord` per decision, before acting.

The CLI's gate (`capture.audit.operators.OperatorGate`) and the console (`infra.console.app`) both log through
`AccessLog.record`: the record is built here (the role from `schemas.access_log.ACTION_ROLES`, texts cut to the
record's bounds, so the log never refuses a record because a caller sent a long id) and written with
``If-None-Match: *`` (`capture.ledger.store.LedgerStore.put_new`) under `schemas.layout.access_log_key`, with an
Object Lock retain-until date when ``retention_days`` asks for one. A record that cannot be written raises the
store's error: the caller does not act (the console answers 503), so nothing is done that is not logged.

A legal-hold decision that was allowed is also filed, the same bytes, under each envelope it holds
(`schemas.layout.hold_decision_key`); `hold_decisions` reads them back, newest first, for the console's record
page. Like the log itself they are not signed: whoever may write under ``audit/access/`` could add one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

from capture.ledger.store import LedgerStore
from schemas.access_log import ACTION_ROLES, AccessRecord, OperatorAction, decode_access_record
from schemas.errors import ContractError
from schemas.layout import access_log_key, hold_decision_key, hold_decisions_prefix

_MAX_TARGET: Final = 1024
_MAX_REASON: Final = 1024
_MAX_TENANT: Final = 128
_MAX_PEER: Final = 64


class Actor(Protocol):
    """Whoever acted: an operator key's id (`capture.audit.operators.Operator`)."""

    @property
    def key_id(self) -> str: ...


class AccessLog:
    """Writes operators' decisions to one audit bucket."""

    def __init__(
        self,
        store: LedgerStore,
        *,
        retention_days: int = 0,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.retention_days = retention_days
        self._clock = clock

    def record(
        self,
        action: OperatorAction,
        target: str,
        *,
        operator: Actor | None,
        tenant: str | None = None,
        refused: str | None = None,
        peer: str | None = None,
        note: str | None = None,
        case: str | None = None,
        held_envelopes: Sequence[str] = (),
    ) -> AccessRecord:
        """Write one decision (``refused``: why it was refused; None: allowed) and return it; `note` and `case`:
        what the operator stated for it; `held_envelopes`: the envelope ids an allowed hold decision acts on (the
        record is filed under each of them too)."""
        at = self._clock()
        record = AccessRecord(
            record_id=uuid.uuid4().hex,
            at=at,
            actor_key_id=operator.key_id if operator is not None else None,
            role=ACTION_ROLES[action],
            action=action,
            target=target[:_MAX_TARGET],
            tenant=tenant[:_MAX_TENANT] if tenant is not None else None,
            result="allowed" if refused is None else "refused",
            reason=refused[:_MAX_REASON] if refused is not None else None,
            peer=peer[:_MAX_PEER] if peer is not None else None,
            note=note,
            case=case,
        )
        until = at + timedelta(days=self.retention_days) if self.retention_days > 0 else None
        body = record.model_dump_json().encode("utf-8")
        filed = [hold_decision_key(eid, at, record.record_id) for eid in held_envelopes] if refused is None else []
        for key in (access_log_key(at, record.record_id), *filed):
            if not self.store.put_new(key, body, until):
                raise self.store.error(f"access record {key} already exists: not acting")
        return record


#: At most this many hold decisions of one envelope are read back (the newest).
MAX_HOLD_DECISIONS: Final = 50


def hold_decisions(store: LedgerStore, envelope_id: str) -> tuple[list[AccessRecord], list[str]]:
    """The legal-hold decisions filed under `envelope_id` (newest first, at most `MAX_HOLD_DECISIONS`), and a
    line for each filed object that does not read as one (not decoded, another action, refused)."""
    keys = [key for key, _ in store.list_keys(hold_decisions_prefix(envelope_id))][-MAX_HOLD_DECISIONS:]
    records, problems = [], []
    for key in reversed(keys):
        body = store.get(key)
        try:
            record = decode_access_record(body or b"")
        except ContractError as exc:
            problems.append(f"{key} does not read as an access record: {str(exc).splitlines()[0]}")
            continue
        if record.action not in ("hold.add", "hold.remove") or record.result != "allowed":
            problems.append(f"{key} is not an allowed hold decision ({record.action}, {record.result})")
            continue
        records.append(record)
    return records, problems
