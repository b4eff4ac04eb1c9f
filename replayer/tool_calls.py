"""Where a fork falls in an answer that made tool calls (the divergence view's words for it).

A tool call is generated text like any other: the recorded choice's token ids hold it, and upstream's tool-call
parser read the calls out of it (`schemas.ToolCall`). With the stack's parser (Hermes: vLLM's ``hermes``) a call is
written ``<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>``, so the recorded tokens' texts up to the
fork say whether the fork falls before any call, inside the k-th call's name, or inside its arguments. An auditor
reads "the replay chose other arguments for lookup_policy" rather than "token 14 differs".
"""

from __future__ import annotations

from typing import Final

from schemas import Choice

CALL_OPEN: Final = "<tool_call>"
CALL_CLOSE: Final = "</tool_call>"
ARGUMENTS: Final = '"arguments":'


def fork_in_tool_call(recorded: Choice, position: int) -> str | None:
    """Words for a fork at token `position` of a choice that made tool calls, or None (no calls, no token texts
    to place the fork with, or a fork outside every call)."""
    calls = recorded.tool_calls
    steps = recorded.logprobs
    if not calls or not steps or any(s.token is None for s in steps):
        return None
    before = "".join(s.token or "" for s in steps[:position])
    opened = before.count(CALL_OPEN)
    if opened == 0 or before.count(CALL_CLOSE) >= opened:
        return None
    index = opened - 1
    name = calls[index].name if index < len(calls) else "?"
    current = before[before.rfind(CALL_OPEN) :]
    part = "arguments" if ARGUMENTS in current else "name"
    return f"the fork is inside the {part} of tool call {index} ({name})"
