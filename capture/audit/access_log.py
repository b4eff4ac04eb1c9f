"""The one writer of the access log: a write-once `schemas.access_log.AccessRecord` per decision, before acting.

The CLI's gate (`capture.audit.operators.OperatorGate`) and the console (`infra.console.app`) both log through
`AccessLog.record`: the record is built here (the role from `schemas.access_log.ACTION_ROLES`, texts cut to the
record's bounds, so the log never refuses a record because a caller sent a long id) and written with
``If-None-Match: *`` (`capture.ledger.store.LedgerStore.put_new`) under `schemas.layout.access_log_key`, with an
Object Lock retain-until date when ``retention_days`` asks for one. A record that cannot be written raises the
store's error: the caller does not act (the console answers 503), so nothing is done that is not logged.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

from capture.ledger.store import LedgerStore
from schemas.access_log import ACTION_ROLES, AccessRecord, OperatorAction
from schemas.layout import access_log_key

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
    ) -> AccessRecord:
        """Write one decision (``refused``: why it was refused; None: allowed) and return it."""
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
        )
        until = at + timedelta(days=self.retention_days) if self.retention_days > 0 else None
        key = access_log_key(at, record.record_id)
        if not self.store.put_new(key, record.model_dump_json().encode("utf-8"), until):
            raise self.store.error(f"access record {key} already exists: not acting")
        return record
