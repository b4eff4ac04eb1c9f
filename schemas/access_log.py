"""The operators' roles and the access log: who did (or was refused) what to which records, and when.

The commands that change state (a legal hold, an expiry run, a crypto-shred, an index repair) act for an operator
key (`capture.audit.operators`), and each decision, allowed or refused, is one `AccessRecord` written once
(``If-None-Match: *``) under `schemas.layout.access_log_key` in the audit bucket, before anything is done: an
action that cannot be logged is not taken. Issue 19's console writes its actions the same way.

Roles (`OPERATOR_ROLES`) and the action each one allows (`ACTION_ROLES`):

    viewer           read records (the console's pages); no state-changing command
    hold-admin       hold.add, hold.remove
    retention-admin  expire, lake.rebuild-index
    key-admin        keys.shred

A key may be scoped to one tenant: it then acts on that tenant's records only.

Pure: no IO; it imports the standard library, pydantic and `schemas` only.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field

from schemas.base import Record, UtcDatetime, decode_record

ACCESS_SCHEMA_VERSION: Final = "reprolane.access/1"

OperatorRole = Literal["viewer", "hold-admin", "retention-admin", "key-admin"]
OPERATOR_ROLES: Final[frozenset[str]] = frozenset({"viewer", "hold-admin", "retention-admin", "key-admin"})

OperatorAction = Literal["hold.add", "hold.remove", "expire", "lake.rebuild-index", "keys.shred", "view"]
#: The role each action needs.
ACTION_ROLES: Final[dict[str, str]] = {
    "view": "viewer",
    "hold.add": "hold-admin",
    "hold.remove": "hold-admin",
    "expire": "retention-admin",
    "lake.rebuild-index": "retention-admin",
    "keys.shred": "key-admin",
}

_Text = Annotated[str, Field(max_length=1024)]


class AccessRecord(Record):
    """One decision on one operator action; written once, never changed."""

    schema_version: Literal["reprolane.access/1"] = ACCESS_SCHEMA_VERSION
    record_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    at: UtcDatetime
    actor_key_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")] | None = Field(
        description="the operator key that proved itself; None when none did"
    )
    role: OperatorRole = Field(description="the role the action needs")
    action: OperatorAction
    target: _Text = Field(description="what the action names: a request or workflow id, a tenant, a day")
    tenant: Annotated[str, Field(max_length=128)] | None = Field(
        description="the tenant whose records it touches (as asked); None: every tenant"
    )
    result: Literal["allowed", "refused"]
    reason: _Text | None = Field(default=None, description="why it was refused")


def decode_access_record(data: bytes | str) -> AccessRecord:
    return decode_record(AccessRecord, "access record", data)
