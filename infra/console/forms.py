"""What a browser sends, parsed once at the edge into bounded, typed values (`FormError` names the field).

Ids (request, client request, workflow, tenant) must be what the capture side accepts as an id
(`schemas.envelope.is_valid_request_id`); a time is ISO 8601 (a bare date or a ``datetime-local`` value, read
as UTC); a verdict is one of `schemas.replay.Verdict`; a runtime fingerprint is a sha256 prefix (hex, 4-64) or
a ``system_fingerprint`` value; a page number is 1 to `MAX_PAGE`. Nothing else reaches a reader, and a refused
value is never echoed raw into SQL.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlencode, urlsplit

from infra.console.records import Filters
from schemas.access_log import CASE_PATTERN, MAX_NOTE
from schemas.envelope import is_valid_request_id
from schemas.replay import Verdict

VERDICTS: tuple[str, ...] = typing.get_args(Verdict)
_HEX = re.compile(r"^[0-9a-f]{4,64}$")
_SYSTEM_FINGERPRINT = re.compile(r"^[A-Za-z0-9._:+-]{1,128}$")
MAX_FIELD = 256
MAX_PAGE = 10_000
#: The search form's fields, in the form's order (a link to another page of results repeats them).
SEARCH_FIELDS: tuple[str, ...] = (
    "request_id", "client_request_id", "workflow_id", "tenant", "since", "until", "verdict", "runtime",
)  # fmt: skip


class FormError(ValueError):
    """A field the browser sent is not acceptable (the message names it)."""


def _text(values: Mapping[str, str], name: str) -> str | None:
    value = values.get(name, "").strip()
    if len(value) > MAX_FIELD:
        raise FormError(f"{name}: longer than {MAX_FIELD} characters")
    return value or None


def an_id(value: str | None, name: str) -> str | None:
    if value is not None and not is_valid_request_id(value):
        raise FormError(f"{name}: {value[:64]!r} is not an id ([A-Za-z0-9][A-Za-z0-9._:-]*)")
    return value


def _time(values: Mapping[str, str], name: str) -> datetime | None:
    value = _text(values, name)
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise FormError(f"{name}: {value[:64]!r} is not a date or time (YYYY-MM-DD[THH:MM])") from None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def filters(values: Mapping[str, str]) -> Filters:
    verdict = _text(values, "verdict")
    if verdict is not None and verdict not in VERDICTS:
        raise FormError(f"verdict: must be one of {', '.join(VERDICTS)}")
    runtime = _text(values, "runtime")
    if runtime is not None:
        runtime = runtime.lower() if _HEX.match(runtime.lower()) else runtime
        if not (_HEX.match(runtime) or _SYSTEM_FINGERPRINT.match(runtime)):
            raise FormError("runtime: a runtime fingerprint's sha256 (or a prefix) or a system_fingerprint")
    since, until = _time(values, "since"), _time(values, "until")
    if since is not None and until is not None and until <= since:
        raise FormError("until: must be after since")
    return Filters(
        request_id=an_id(_text(values, "request_id"), "request_id"),
        client_request_id=an_id(_text(values, "client_request_id"), "client_request_id"),
        workflow_id=an_id(_text(values, "workflow_id"), "workflow_id"),
        tenant=an_id(_text(values, "tenant"), "tenant"),
        since=since,
        until=until,
        verdict=verdict,
        runtime=runtime,
    )


def page(values: Mapping[str, str]) -> int:
    """The page of results asked for (``page``, 1-based; absent: 1)."""
    value = _text(values, "page")
    if value is None:
        return 1
    if not value.isdigit() or not 1 <= int(value) <= MAX_PAGE:
        raise FormError(f"page: a number from 1 to {MAX_PAGE}")
    return int(value)


def searched(values: Mapping[str, str]) -> bool:
    """Whether the search form was submitted (any of its fields or a page is in the query, even empty): an empty
    search lists the newest requests; only the bare page waits for one."""
    return any(name in values for name in (*SEARCH_FIELDS, "page"))


def search_query(values: Mapping[str, str], page_no: int) -> str:
    """The query string of page `page_no` of the search `values` asked for (call after `filters` accepted them)."""
    kept = [(name, values[name].strip()) for name in SEARCH_FIELDS if values.get(name, "").strip()]
    return urlencode([*kept, ("page", str(page_no))])


MAX_NEXT = 2048
#: The pages a login may return to (`next_path`): the console's own pages, never the login itself.
_RETURN_PAGES = ("/search", "/overview")
_RETURN_PREFIXES = ("/requests/", "/workflows/")


def next_path(value: str | None) -> str | None:
    """The console page a login returns to (a deep link kept through the login), or None when `value` is not
    one: only a page of this console (`_RETURN_PAGES`, `_RETURN_PREFIXES`, with its query), never another site
    (``//evil``, ``https://...``, ``/\\evil``), bounded, printable ASCII only."""
    if not value or len(value) > MAX_NEXT or not value.isascii() or not value.isprintable() or " " in value:
        return None
    if not value.startswith("/") or value.startswith("//") or "\\" in value:
        return None
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or parts.fragment:
        return None
    if parts.path not in _RETURN_PAGES and not parts.path.startswith(_RETURN_PREFIXES):
        return None
    return value


_CASE = re.compile(CASE_PATTERN)


@dataclass(frozen=True)
class HoldForm:
    """A legal-hold change as the form asked for it: place (``on``) or lift, why, for which case."""

    on: bool
    reason: str | None
    case: str | None


def hold_form(values: Mapping[str, str]) -> HoldForm:
    """The hold form: ``action`` add or remove, a ``reason`` (one line, up to `MAX_NOTE` characters) and/or a
    ``case`` number (at least one of them), and ``confirm`` ticked."""
    action = values.get("action")
    if action not in ("add", "remove"):
        raise FormError("action: add or remove")
    raw = values.get("reason", "")
    if len(raw) > MAX_NOTE * 2:
        raise FormError(f"reason: longer than {MAX_NOTE} characters")
    reason = " ".join(raw.split()) or None  # line breaks and tabs become spaces: the record's note is one line
    if reason is not None and (len(reason) > MAX_NOTE or not reason.isprintable()):
        raise FormError(f"reason: up to {MAX_NOTE} printable characters")
    case = _text(values, "case")
    if case is not None and not _CASE.match(case):
        raise FormError("case: up to 64 of [A-Za-z0-9 ._:/#-], starting with a letter or digit")
    if reason is None and case is None:
        raise FormError("a legal hold needs a reason or a case number (or both): say why")
    if values.get("confirm") != "yes":
        raise FormError("confirm: tick the box to confirm the change to the legal hold")
    return HoldForm(action == "add", reason, case)


#: What a page shows after an action redirected to it (``?done=``): fixed texts, never the query's own.
DONE = {"hold-placed": "legal hold placed", "hold-lifted": "legal hold lifted"}
