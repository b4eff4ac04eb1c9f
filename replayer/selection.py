"""Which envelopes the service replays: the flagged ones, or every one when ``settings.replay_all``.

A shadow envelope (a candidate's answer to a production request, `capture.request.shadow`) is never selected: the
shadow report compares it with production (`replayer.gate.shadow`).

Selection is decided before replayability: an envelope that is not selected is skipped quietly; a selected one
that cannot be replayed (an error envelope, a request rejected before tokenization) is counted as
not replayable and skipped. A started record (outcome ``incomplete``: guaranteed mode writes one before it
relays a stream) is never selected: the envelope with the same request id that supersedes it is the one judged,
so a flagged stream is counted once. On-demand requests (the replay-request topic) bypass selection entirely.
"""

from __future__ import annotations

from typing import Literal

from replayer.settings import ReplayerSettings
from schemas import Envelope

Decision = Literal["replay", "not_selected", "not_replayable"]


def select(envelope: Envelope, settings: ReplayerSettings) -> Decision:
    """What the consumer does with `envelope` (see module docstring)."""
    if envelope.is_started_record or envelope.shadow is not None or not (envelope.flagged or settings.replay_all):
        return "not_selected"  # a shadow is a candidate's answer: the shadow report compares it (replayer.gate.shadow)
    if not envelope.replayable:
        return "not_replayable"
    return "replay"


def not_replayable_reason(envelope: Envelope) -> str:
    """Why `envelope.replayable` is False, in words."""
    if envelope.is_started_record:
        return (
            "it is a started record, written before the answer was relayed: the envelope with this request id "
            "written after it holds the outcome (none exists when the sidecar stopped mid-answer)"
        )
    if envelope.prompt is None:
        return "no prompt token ids were recorded"
    if envelope.sampling is None:
        return "no sampling contract was recorded (request rejected as invalid)"
    if envelope.outcome.kind == "error":
        return f"the request ended in an error ({envelope.outcome.error_type}), not a complete output"
    return "replayable"
