"""Where a fork falls in an answer that made tool calls (`replayer.tool_calls`), and the event that says so."""

from __future__ import annotations

from replayer.tool_calls import fork_in_tool_call
from schemas import Choice, StepLogprobs, ToolCall

PIECES = [
    "<tool_call>",
    "\n",
    '{"name": "',
    "lookup",
    "_policy",
    '", ',
    '"arguments": ',
    '{"number": "',
    "12",
    '"}}',
    "\n",
    "</tool_call>",
]


def choice(
    calls: tuple[ToolCall, ...] | None = (ToolCall(name="lookup_policy", arguments='{"number": "12"}'),),
) -> Choice:
    steps = tuple(StepLogprobs(token_id=100 + i, token=t, logprob=-0.5) for i, t in enumerate(PIECES))
    return Choice(index=0, token_ids=tuple(s.token_id for s in steps), text="", logprobs=steps, tool_calls=calls)


def test_a_fork_is_placed_in_a_calls_arguments_or_name() -> None:
    assert (
        fork_in_tool_call(choice(), PIECES.index("12"))
        == "the fork is inside the arguments of tool call 0 (lookup_policy)"
    )
    assert (
        fork_in_tool_call(choice(), PIECES.index("_policy"))
        == "the fork is inside the name of tool call 0 (lookup_policy)"
    )


def test_a_fork_outside_every_call_or_without_calls_says_nothing() -> None:
    assert fork_in_tool_call(choice(), 0) is None  # before the call opens
    assert fork_in_tool_call(choice(), len(PIECES)) is None  # after it closed
    assert fork_in_tool_call(choice(calls=None), PIECES.index("12")) is None
