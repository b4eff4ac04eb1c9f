"""Which envelopes the service replays: the flagged ones, or every one when ``settings.replay_all``.

Selection is decided before replayability: an envelope that is not selected is skipped quietly; a selected one
that cannot be replayed (an error envelope, a request rejected before tokenization) is counted as
not replayable and skipped. On-demand requests (the replay-request topic) bypass selection entirely.
"""

from __future__ import annotations

from typing import Literal

from replayer.settings import ReplayerSettings
from schemas import Envelope

Decision = Literal["replay", "not_selected", "not_replayable"]


def select(envelope: Envelope, settings: ReplayerSettings) -> Decision:
    """What the consumer does with `envelope` (see module docstring)."""
    if not (envelope.flagged or settings.replay_all):
        return "not_selected"
    if not envelope.replayable:
        return "not_replayable"
    return "replay"


def not_replayable_reason(envelope: Envelope) -> str:
    """Why `envelope.replayable` is False, in words."""
    if envelope.prompt is None:
        return "no prompt token ids were recorded"
    if envelope.sampling is None:
        return "no sampling contract was recorded (request rejected as invalid)"
    if envelope.outcome.kind == "error":
        return f"the request ended in an error ({envelope.outcome.error_type}), not a complete output"
    return "replayable"
