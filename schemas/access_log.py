"""The operators' roles and the one access log: who did (or was refused) what to which records, and when.

Every operator action, from the CLI (a legal hold, an expiry run, a crypto-shred, an index repair) or from the
console (a login, a page of a record, a search, a hold, an on-demand replay, an evidence download), acts for an
operator key (`capture.audit.operators`), and each decision, allowed or refused, is one `AccessRecord` written
once (``If-None-Match: *``) under `schemas.layout.access_log_key` in the audit bucket, before anything is done:
an action that cannot be logged is not taken. One model, one key layout, one writer
(`capture.audit.access_log.AccessLog`), whichever door the operator came through; the console adds the client's
address (``peer``), which a CLI call has none of.

Roles (`OPERATOR_ROLES`) and the role each action needs (`ACTION_ROLES`)::

    (none)           login, logout (a key that proves itself; what it may do is checked per action)
    viewer           search, view.request, view.workflow, view.overview, replay.request, evidence.download
    hold-admin       hold.add, hold.remove
    retention-admin  expire, lake.rebuild-index
    key-admin        keys.shred

`role_grants` is the one rule of which roles grant which: a role grants itself, and ``hold-admin`` also grants
``viewer`` (placing a hold on a record means reading it first; a hold-admin who could not see the record could
not check which one it holds). The other admin roles grant nothing else: a retention or key admin acts on
whole days or tenants, and reading the records is a separate grant. The CLI's gate and the console both ask it.

A key may be scoped to one tenant: it then acts on that tenant's records only.

A legal hold carries what the operator stated for it: a reason (``note``) and/or a case number (``case``); its
record is also filed under the envelope it holds (`schemas.layout.hold_decision_key`), so a record's page shows
who placed or lifted its hold, when and why, without reading the whole log.

Pure: no IO; it imports the standard library, pydantic and `schemas` only.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Annotated, Final, Literal

from pydantic import Field

from schemas.base import Record, UtcDatetime, decode_record

ACCESS_SCHEMA_VERSION: Final = "reprolane.access/1"

OperatorRole = Literal["viewer", "hold-admin", "retention-admin", "key-admin"]
OPERATOR_ROLES: Final[frozenset[str]] = frozenset({"viewer", "hold-admin", "retention-admin", "key-admin"})
#: What each role grants beyond itself (see `role_grants`).
IMPLIED_ROLES: Final[dict[str, frozenset[str]]] = {"hold-admin": frozenset({"viewer"})}

OperatorAction = Literal[
    "login",
    "logout",
    "search",
    "view.request",
    "view.workflow",
    "view.overview",
    "replay.request",
    "evidence.download",
    "hold.add",
    "hold.remove",
    "expire",
    "lake.rebuild-index",
    "keys.shred",
]
#: The role each action needs (None: a key that proves itself, no role).
ACTION_ROLES: Final[dict[str, OperatorRole | None]] = {
    "login": None,
    "logout": None,
    "search": "viewer",
    "view.request": "viewer",
    "view.workflow": "viewer",
    "view.overview": "viewer",
    "replay.request": "viewer",
    "evidence.download": "viewer",
    "hold.add": "hold-admin",
    "hold.remove": "hold-admin",
    "expire": "retention-admin",
    "lake.rebuild-index": "retention-admin",
    "keys.shred": "key-admin",
}


def role_grants(roles: Set[str], needed: str | None) -> bool:
    """True when a key holding `roles` may do what needs `needed` (None: anything that needs no role)."""
    if needed is None:
        return True
    return any(needed == role or needed in IMPLIED_ROLES.get(role, ()) for role in roles)


_Text = Annotated[str, Field(max_length=1024)]
#: What an operator states for an action (a legal hold): its reason, one line of printable text.
MAX_NOTE: Final = 500
NOTE_PATTERN: Final = r"^[^\x00-\x1f\x7f]*$"
#: The case or matter number an action is for: an id of the operator's own case system.
CASE_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9 ._:/#-]{0,63}$"


class AccessRecord(Record):
    """One decision on one operator action; written once, never changed."""

    schema_version: Literal["reprolane.access/1"] = ACCESS_SCHEMA_VERSION
    record_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    at: UtcDatetime
    actor_key_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")] | None = Field(
        description="the operator key that proved itself; None when none did"
    )
    role: OperatorRole | None = Field(description="the role the action needs; None for login and logout")
    action: OperatorAction
    target: _Text = Field(description="what the action names: a request or workflow id, a tenant, a day, a search")
    tenant: Annotated[str, Field(max_length=128)] | None = Field(
        description="the tenant whose records it touches (as asked); None: none or every tenant"
    )
    result: Literal["allowed", "refused"]
    reason: _Text | None = Field(default=None, description="why it was refused")
    note: Annotated[str, Field(max_length=MAX_NOTE, pattern=NOTE_PATTERN)] | None = Field(
        default=None, description="the reason the operator stated for the action (a legal hold)"
    )
    case: Annotated[str, Field(pattern=CASE_PATTERN)] | None = Field(
        default=None, description="the case or matter number the operator named for the action (a legal hold)"
    )
    peer: Annotated[str, Field(max_length=64)] | None = Field(
        default=None, description="the client's address (the console's requests); None from the CLI"
    )


def decode_access_record(data: bytes | str) -> AccessRecord:
    return decode_record(AccessRecord, "access record", data)
