"""The console's access log: who looked at, changed or was refused what, through ``reprolane console``, and when.

Every console action (a login, a page of a request or workflow, a search, a hold placed or lifted, an on-demand
replay asked for, an evidence download) and every refusal (no session, a role the key lacks, another tenant's
record, a form without its CSRF token) is one `ConsoleAccessRecord`, written once (``If-None-Match: *``) under
`schemas.layout.console_access_key` in the audit bucket *before* the action is answered: an action whose record
cannot be written is not taken.

The fields follow the operator access log of the trust issue (actor key id, the role the action needs, action,
target, tenant, time, result, reason), so one reader can merge both logs; the console adds the peer address.

Pure: no IO; it imports the standard library, pydantic and `schemas` only.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field

from schemas.base import Record, UtcDatetime, decode_record

CONSOLE_ACCESS_SCHEMA_VERSION: Final = "reprolane.console-access/1"

ConsoleRole = Literal["viewer", "hold-admin"]
ConsoleAction = Literal[
    "login",
    "logout",
    "search",
    "view.request",
    "view.workflow",
    "view.overview",
    "hold.add",
    "hold.remove",
    "replay.request",
    "evidence.download",
]
#: The role each action needs (a login needs a key that proves itself, and no role).
CONSOLE_ACTION_ROLES: Final[dict[str, str | None]] = {
    "login": None,
    "logout": None,
    "search": "viewer",
    "view.request": "viewer",
    "view.workflow": "viewer",
    "view.overview": "viewer",
    "hold.add": "hold-admin",
    "hold.remove": "hold-admin",
    "replay.request": "viewer",
    "evidence.download": "viewer",
}

_Text = Annotated[str, Field(max_length=1024)]


class ConsoleAccessRecord(Record):
    """One decision on one console action; written once, never changed."""

    schema_version: Literal["reprolane.console-access/1"] = CONSOLE_ACCESS_SCHEMA_VERSION
    record_id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    at: UtcDatetime
    actor_key_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]{1,64}$")] | None = Field(
        description="the operator key the session was opened with; None when no key proved itself"
    )
    role: ConsoleRole | None = Field(description="the role the action needs; None for login and logout")
    action: ConsoleAction
    target: _Text = Field(description="what the action names: a request or workflow id, a search, a page")
    tenant: Annotated[str, Field(max_length=128)] | None = Field(
        description="the tenant whose records it touches; None: none or every tenant"
    )
    result: Literal["allowed", "refused"]
    reason: _Text | None = Field(default=None, description="why it was refused")
    peer: Annotated[str, Field(max_length=64)] | None = Field(default=None, description="the client's address")


def decode_console_access(data: bytes | str) -> ConsoleAccessRecord:
    return decode_record(ConsoleAccessRecord, "console access record", data)
