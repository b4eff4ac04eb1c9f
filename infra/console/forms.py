"""What a browser sends, parsed once at the edge into bounded, typed values (`FormError` names the field).

Ids (request, client request, workflow, tenant) must be what the capture side accepts as an id
(`schemas.envelope.is_valid_request_id`); a time is ISO 8601 (a bare date or a ``datetime-local`` value, read
as UTC); a verdict is one of `schemas.replay.Verdict`; a runtime fingerprint is a sha256 prefix (hex, 4-64) or
a ``system_fingerprint`` value. Nothing else reaches a reader, and a refused value is never echoed raw into SQL.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from datetime import UTC, datetime

from infra.console.records import Filters
from schemas.envelope import is_valid_request_id
from schemas.replay import Verdict

VERDICTS: tuple[str, ...] = typing.get_args(Verdict)
_HEX = re.compile(r"^[0-9a-f]{4,64}$")
_SYSTEM_FINGERPRINT = re.compile(r"^[A-Za-z0-9._:+-]{1,128}$")
MAX_FIELD = 256


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
