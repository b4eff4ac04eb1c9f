"""Operator authorisation: which operator key may do what to which records, and the access log of every decision.

The state-changing commands (``hold add|remove``, ``expire``, ``keys tenant shred``, ``lake rebuild-index``) and every
console action (`infra.console`) act only for an operator key whose roles grant the role the action needs
(`schemas.access_log`: viewer, hold-admin, retention-admin, key-admin; `Operator.may` asks
`schemas.access_log.role_grants`, the one rule, so a hold-admin may view in the console and the CLI alike), and
only on the records of the key's tenant when the key is scoped to one. Every decision, allowed or refused, is
written once to the audit bucket as an `schemas.access_log.AccessRecord` by `capture.audit.access_log.AccessLog`
*before* the action is taken: an action whose record cannot be written is not taken (the store's error
propagates); a refusal whose record cannot be written is still a refusal, and says so.

Keys: the operator key store (``REPROLANE_OPERATOR_KEYS_PATH``) is a file of hashed keys in the sidecar's
API-key format (`capture.ledger.key_file`; ``tenant`` null = every tenant), written by ``reprolane operator
add-key``. A key is ``rlo_<id>_<secret>``. The caller's key comes from a file (``--operator-key-file`` or
``REPROLANE_OPERATOR_KEY_FILE``, refused when others may read it) or from ``REPROLANE_OPERATOR_KEY``, never
from the command line, whose arguments every user of the machine can read (``ps``). Without a key store every
action is refused.

This is reprolane's own check; the S3 identity each command runs with is the other boundary: a deployment gives
each role's operators an identity that can do that role's calls only (docs/SECURITY.md lists them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final, NoReturn

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from capture.audit.access_log import AccessLog
from capture.audit.errors import AccessDenied
from capture.ledger.errors import KeyFileError
from capture.ledger.key_file import KeyEntry, KeyKind, find_key, load_key_file, read_private
from capture.ledger.store import LedgerStore
from schemas.access_log import ACTION_ROLES, OPERATOR_ROLES, OperatorAction, role_grants

OPERATOR_KEY_PREFIX: Final = "rlo_"
#: Operator keys in `capture.ledger.key_file`'s format: a tenant is optional (none: the key acts for every tenant).
OPERATOR_KEYS: Final = KeyKind(prefix=OPERATOR_KEY_PREFIX, roles=OPERATOR_ROLES, tenant_required=False)


class OperatorSettings(BaseSettings):
    """Where the operator key store is, and this caller's key (env prefix ``REPROLANE_OPERATOR_``)."""

    model_config = SettingsConfigDict(env_prefix="REPROLANE_OPERATOR_", extra="forbid", frozen=True)

    keys_path: Path | None = Field(default=None, description="the store of hashed operator keys (operator add-key)")
    key_file: Path | None = Field(default=None, description="a file holding this caller's operator key")
    key: SecretStr | None = Field(default=None, description="this caller's operator key (environment only)")
    access_log_retention_days: int = Field(
        default=0, ge=0, description="Object Lock retention of each access record; 0 = the bucket's default"
    )


@dataclass(frozen=True, slots=True)
class Operator:
    """Who an operator key says the caller is."""

    key_id: str
    tenant: str | None  # None: every tenant
    roles: frozenset[str]

    @classmethod
    def of(cls, entry: KeyEntry) -> Operator:
        return cls(entry.key_id, entry.tenant, entry.roles)

    def may(self, role: str | None) -> bool:
        """Whether this key's roles grant `role` (`schemas.access_log.role_grants`: a hold-admin may view)."""
        return role_grants(self.roles, role)

    def sees(self, tenant: str) -> bool:
        """Whether `tenant`'s records are in this key's scope."""
        return self.tenant is None or self.tenant == tenant


class OperatorGate:
    """One command's (or one console request's) authorisation against the key store, logged to `store`."""

    def __init__(
        self,
        store: LedgerStore,
        settings: OperatorSettings,
        key_file: Path | None = None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.settings = settings
        self._key_file = key_file or settings.key_file
        self._log = AccessLog(store, retention_days=settings.access_log_retention_days, clock=clock)
        self._operator: Operator | None = None

    def identify(self, action: OperatorAction, target: str, tenant: str | None = None) -> Operator:
        """The caller's operator, when its key proves itself and has the action's role; else the refusal is
        logged and raised (`AccessDenied`). Nothing is logged when it succeeds: `authorise` logs the decision."""
        if self._operator is None:
            entry, why = self._entry()
            if entry is None:
                self._refuse(action, target, tenant, why)
            self._operator = Operator.of(entry)
        op = self._operator
        role = ACTION_ROLES[action]
        if not op.may(role):
            self._refuse(action, target, tenant, f"operator key {op.key_id!r} lacks the {role!r} role", op)
        return op

    def scope(self, action: OperatorAction, target: str, tenant: str | None) -> str | None:
        """The tenant an action asked for `tenant` acts on: `tenant` itself, or the key's tenant when none was
        named. A named tenant outside the key's scope is refused (logged) here, before any record is read."""
        op = self.identify(action, target, tenant)
        if tenant is None:
            return op.tenant
        if op.tenant is not None and tenant != op.tenant:
            self.authorise(action, target, tenant)  # refuses, and logs the refusal
        return tenant

    def authorise(
        self,
        action: OperatorAction,
        target: str,
        tenant: str | None,
        *,
        note: str | None = None,
        case: str | None = None,
        held_envelopes: Sequence[str] = (),
    ) -> Operator:
        """`identify`, then the tenant scope: a key scoped to a tenant acts on that tenant only (`tenant` None
        means every tenant). The decision is logged either way (with what the operator stated: `note`, `case`;
        an allowed hold filed under `held_envelopes` too, `AccessLog.record`); `AccessDenied` when refused."""
        op = self.identify(action, target, tenant)
        if op.tenant is not None and tenant != op.tenant:
            asked = "every tenant" if tenant is None else f"tenant {tenant!r}"
            self._refuse(action, target, tenant, f"operator key {op.key_id!r} is scoped to tenant "
                                                 f"{op.tenant!r}, not {asked}", op)  # fmt: skip
        self._log.record(action, target, operator=op, tenant=tenant, note=note, case=case,
                         held_envelopes=held_envelopes)  # fmt: skip
        return op

    # -- the key -----------------------------------------------------------------------------------------------

    def _entry(self) -> tuple[KeyEntry | None, str]:
        """The key-store entry the caller's key proves, or None and why not (never the key itself)."""
        if self.settings.keys_path is None:
            return None, "no operator key store is configured (REPROLANE_OPERATOR_KEYS_PATH)"
        try:
            keys = load_key_file(self.settings.keys_path, OPERATOR_KEYS, field="REPROLANE_OPERATOR_KEYS_PATH")
            token = self._token()
        except KeyFileError as exc:
            return None, str(exc)
        if token is None:
            return None, "no operator key: pass --operator-key-file or set REPROLANE_OPERATOR_KEY_FILE"
        entry = find_key(keys, OPERATOR_KEYS, token)
        if entry is None:
            return None, "the operator key is not in the key store (unknown, revoked or mistyped)"
        return entry, ""

    def _token(self) -> str | None:
        if self._key_file is not None:
            token = (
                read_private(self._key_file, "--operator-key-file", group_may_read=False)
                .decode("utf-8", "replace")
                .strip()
            )
            return token or None
        if self.settings.key is None:
            return None
        return self.settings.key.get_secret_value().strip() or None

    # -- the log -----------------------------------------------------------------------------------------------

    def _refuse(
        self, action: OperatorAction, target: str, tenant: str | None, why: str, op: Operator | None = None
    ) -> NoReturn:
        try:
            self._log.record(action, target, operator=op, tenant=tenant, refused=why)
        except self.store.error as exc:  # refused all the same; say that the log missed it
            raise AccessDenied(f"{action} refused: {why} (and its access record was not written: {exc})") from exc
        raise AccessDenied(f"{action} refused: {why}")
