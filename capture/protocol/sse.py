"""The framing of a streamed answer: server-sent events, as OpenAI-compatible servers write them (pure).

A stream is a sequence of events, each ended by a blank line; an answer's events are one-line ``data:`` events
holding one JSON chunk each, and the last is ``data: [DONE]``. The sidecar cuts events out of the bytes as they
arrive (`event_end`), rewrites the data of each (`split_data` keeps the spelling upstream used) and passes the
``[DONE]`` event on as it came (`is_done`).
"""

from __future__ import annotations

import re
from typing import Final

SSE_DONE: Final = b"data: [DONE]\n\n"


def sse(body: bytes) -> bytes:
    """One ``data`` event holding `body`."""
    return b"data: " + body + b"\n\n"


def event_end(buffer: bytes) -> int:
    """Where the first complete SSE event in ``buffer`` ends (after its blank line), or -1. SSE ends lines with
    LF (vLLM), CRLF (sse-starlette, behind many OpenAI-compatible servers) or CR; JSON data holds none of them."""
    cut = buffer.find(b"\n\n")
    if cut >= 0 and buffer.find(b"\r", 0, cut) < 0:
        return cut + 2
    found = _EVENT_END.search(buffer)
    return -1 if found is None else found.end()


_EVENT_END: Final = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def split_data(event: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(prefix, data, ending) of a one-line ``data`` event, spelled as upstream spelled it (``data:`` with or
    without its optional space); None for any other event."""
    if not event.startswith(b"data:"):
        return None
    body = event.rstrip(b"\r\n")
    start = 6 if body[5:6] == b" " else 5
    data = body[start:]
    if b"\n" in data or b"\r" in data:
        return None  # several lines: not one JSON document
    return body[:start], data, event[len(body) :]


LONGEST_DONE: Final = len(b"data: [DONE]\r\n\r\n")
"""The longest spelling of the ``[DONE]`` event: a longer event is not it (no need to ask `is_done`)."""


def is_done(event: bytes) -> bool:
    """Whether `event` is the ``[DONE]`` event, in any of its spellings."""
    parts = split_data(event)
    return parts is not None and parts[1] == b"[DONE]"


MAX_FIELD_LINES: Final = 8
"""The most lines a typed event may have around its one ``data`` line (``event:``, ``id:``, comments): more is
not an event the Responses or Messages APIs write, and is passed on unread."""


def split_typed_data(event: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(everything before the data, data, everything after it) of an event with exactly one ``data`` line and a
    few other lines (``event: response.output_text.delta``, as the Responses and Messages APIs write each event
    before its data), spelled as upstream spelled it; None for any other event. A one-line ``data`` event is
    `split_data`'s."""
    if event.startswith(b"data:"):
        return split_data(event)
    start = event.find(b"\ndata:")
    if start < 0 or event.count(b"\n", 0, start) >= MAX_FIELD_LINES:
        return None
    head = event[: start + 1]
    if b"\r" in head and not head.endswith(b"\r\n"):
        return None  # CR-only line ends: not ours to cut
    parts = split_data(event[start + 1 :])
    if parts is None:
        return None
    prefix, data, ending = parts
    return head + prefix, data, ending
