"""The console's access log: one write-once record per action or refusal, in the audit bucket, before answering.

`AccessLog.record` builds a `schemas.console_access.ConsoleAccessRecord` and writes it with
``If-None-Match: *`` (`capture.ledger.store.LedgerStore.put_new`) under `schemas.layout.console_access_key`,
with an Object Lock retain-until date when ``retention_days`` asks for one. A record that cannot be written
raises the store's error: the caller answers 503 and takes no action, so nothing is done that is not logged.
Texts from the client (a search, an id) are cut to the record's bounds: the log must never refuse a record
because an attacker sent a long id.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from capture.ledger.store import LedgerStore
from infra.console.operators import Operator
from schemas.console_access import CONSOLE_ACTION_ROLES, ConsoleAccessRecord, ConsoleAction
from schemas.layout import console_access_key

_MAX_TARGET = 1024
_MAX_REASON = 1024


class AccessLog:
    """Writes the console's decisions to one bucket."""

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
        action: ConsoleAction,
        target: str,
        *,
        operator: Operator | None,
        tenant: str | None = None,
        refused: str | None = None,
        peer: str | None = None,
    ) -> ConsoleAccessRecord:
        """Write one decision (``refused``: why it was refused; None: allowed) and return it."""
        at = self._clock()
        tenant_text = tenant[:128] if tenant is not None else None
        record = ConsoleAccessRecord(
            record_id=uuid.uuid4().hex,
            at=at,
            actor_key_id=operator.key_id if operator is not None else None,
            role=CONSOLE_ACTION_ROLES[action],
            action=action,
            target=target[:_MAX_TARGET],
            tenant=tenant_text,
            result="allowed" if refused is None else "refused",
            reason=refused[:_MAX_REASON] if refused is not None else None,
            peer=peer[:64] if peer is not None else None,
        )
        until = at + timedelta(days=self.retention_days) if self.retention_days > 0 else None
        key = console_access_key(at, record.record_id)
        if not self.store.put_new(key, record.model_dump_json().encode("utf-8"), until):
            raise self.store.error(f"access record {key} already exists: not acting")
        return record
