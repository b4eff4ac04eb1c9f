"""`capture.protocol.messages`: a Messages request's contract and the chat messages vLLM makes of it (for
``/tokenize``), its answer collected whole and streamed; nothing added upstream, nothing stripped."""

from __future__ import annotations

from typing import Any

import pytest

from capture.protocol import messages
from capture.protocol.audit_fields import prepare, strip
from capture.protocol.output import OutputCollector

USER = {"role": "user", "content": "What?"}


def prepared(body: dict[str, Any]) -> Any:
    base = {"model": "m", "max_tokens": 5, "messages": [USER]}
    return prepare("messages", {**base, **body}, request_id="rl-1", audit_k=5, inject_seed=True)


def test_nothing_is_added_upstream_and_the_contract_is_read_in_chat_spelling() -> None:
    body = {"model": "m", "max_tokens": 5, "messages": [USER], "temperature": 0.5, "stop_sequences": ["\n"]}
    p = prepare("messages", body, request_id="rl-1", audit_k=5, inject_seed=True)
    assert p.upstream_body == body  # vLLM's Messages endpoint takes no seed, logprobs or token ids
    assert p.sampling is not None
    assert (p.sampling.max_tokens, p.sampling.stop, p.sampling.temperature) == (5, ("\n",), 0.5)
    assert (p.sampling.seed, p.sampling.seed_scope, p.sampling.seed_injected) == (None, "worker_global", False)
    assert p.sampling.logprobs is None
    assert p.sampling.extra == {}
    assert p.limits == messages.LIMITS
    answer = {"type": "message", "content": [{"type": "text", "text": "Hi"}]}
    assert strip(answer, p) is answer


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ({"system": "Be brief.", "messages": [USER]}, [{"role": "system", "content": "Be brief."}, USER]),
        (
            {
                "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"}, {"type": "text", "text": "A"}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"}]}],
            },
            [{"role": "system", "content": "A"}, USER],
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        ),
        (
            {"messages": [USER, {"role": "assistant", "content": []}, {"role": "user", "content": []}]},
            [USER, {"role": "assistant"}],
        ),
    ],
)
def test_text_messages_are_converted_as_vllm_converts_them(body: dict[str, Any], want: list[Any]) -> None:
    assert messages.chat_messages(body) == want


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "system", "content": "inline"}]},
        {"messages": [USER], "tools": [{"name": "f"}]},
        {"messages": [USER], "thinking": {"type": "enabled", "budget_tokens": 2048}},
        {"messages": "x"},
        {"messages": [USER], "system": 3},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
    ],
)
def test_what_is_not_mirrored_is_not_tokenized(body: dict[str, Any]) -> None:
    assert messages.chat_messages(body) is None


def test_a_whole_answer_and_a_stream_record_the_same() -> None:
    whole = OutputCollector("messages")
    whole.add(
        {
            "type": "message",
            "model": "m",
            "content": [{"type": "text", "text": "The capital"}],
            "stop_reason": "max_tokens",
            "usage": {"input_tokens": 28, "output_tokens": 5},
        }
    )
    stream = OutputCollector("messages")
    for event in (
        {
            "type": "message_start",
            "message": {"type": "message", "model": "m", "content": [], "usage": {"input_tokens": 28}},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "The"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " capital"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 5}},
    ):
        stream.add(event)
    assert not stream.ended
    stream.add({"type": "message_stop"})
    assert stream.ended
    assert whole.choices_record() == stream.choices_record()
    (choice,) = whole.choices_record()
    assert (choice.text, choice.finish_reason, choice.token_ids, choice.logprobs) == ("The capital", "length", (), None)
    assert whole.usage == stream.usage == {"input_tokens": 28, "output_tokens": 5}
    assert whole.resolved_model == "m"


def test_hostile_events_do_not_raise_and_errors_are_named() -> None:
    c = OutputCollector("messages")
    for event in (
        {"type": "message_start", "message": "x"},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": 5}},
        {"type": "message_delta", "delta": [], "usage": "x"},
        {"type": "message", "content": "x", "usage": {"a": True}},
    ):
        c.add(event)
    c.choices_record()
    assert messages.error_of({"type": "error", "error": {"type": "overloaded_error"}}) == {"type": "overloaded_error"}
    assert messages.error_of({"type": "ping"}) is None
