"""The audit fields: added to the upstream request (per endpoint), stripped back out of what the client gets."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from capture.protocol.audit_fields import derive_seed, prepare, strip

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_prepare_chat_adds_audit_fields_without_touching_client_body() -> None:
    body = dict(CHAT)
    p = prepare("chat.completions", body, request_id="r", audit_k=4, inject_seed=False)
    assert body == CHAT
    assert p.upstream_body["return_token_ids"] is True
    assert p.upstream_body["logprobs"] is True
    assert p.upstream_body["top_logprobs"] == 4
    assert p.upstream_body["return_tokens_as_token_ids"] is True
    assert not p.client_token_ids
    assert not p.client_logprobs
    assert p.sampling is not None
    assert p.sampling.logprobs == 4


def test_prepare_keeps_client_logprobs_request() -> None:
    p = prepare(
        "completions", {"model": "m", "prompt": "x", "logprobs": 1}, request_id="r", audit_k=5, inject_seed=False
    )
    assert p.upstream_body["logprobs"] == 1
    assert "return_tokens_as_token_ids" not in p.upstream_body
    assert p.client_logprobs
    assert p.sampling is not None
    assert p.sampling.logprobs == 1


def test_seed_injection_only_for_sampled_requests_without_seed() -> None:
    sampled = prepare("chat.completions", {**CHAT, "temperature": 0.8}, request_id="r1", audit_k=5, inject_seed=True)
    assert sampled.upstream_body["seed"] == derive_seed("r1")
    assert sampled.sampling is not None
    assert sampled.sampling.seed_injected
    greedy = prepare("chat.completions", {**CHAT, "temperature": 0}, request_id="r1", audit_k=5, inject_seed=True)
    assert "seed" not in greedy.upstream_body
    own = prepare("chat.completions", {**CHAT, "seed": 3}, request_id="r1", audit_k=5, inject_seed=True)
    assert own.upstream_body["seed"] == 3
    assert own.sampling is not None
    assert not own.sampling.seed_injected
    assert derive_seed("r1") == derive_seed("r1")
    assert 0 <= derive_seed("r1") < 2**31


@pytest.mark.parametrize("temperature", [0, 0.0, "0", "0.0"])
def test_no_seed_is_injected_into_a_greedy_request_however_spelled(temperature: object) -> None:
    body = {"model": "m", "prompt": "Hi", "temperature": temperature}
    p = prepare("completions", body, request_id="rl-1", audit_k=5, inject_seed=True)
    assert "seed" not in p.upstream_body


def test_strip_sets_unrequested_fields_to_null_like_vllm() -> None:
    p = prepare("chat.completions", CHAT, request_id="r", audit_k=5, inject_seed=False)
    obj = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [3], "logprobs": {"content": []}}]}
    original = copy.deepcopy(obj)
    assert strip(obj, p) == {"prompt_token_ids": None, "choices": [{"index": 0, "token_ids": None, "logprobs": None}]}
    assert obj == original  # recorded after the answer is sent: strip must not touch it
    no_key = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None}]}
    assert strip(no_key, p) is no_key  # nothing to strip: no copy
    assert "token_ids" not in no_key["choices"][0]  # a key vLLM did not send stays absent
    assert strip([1], p) == [1]
    body = {**CHAT, "logprobs": True, "return_token_ids": True}
    asked = prepare("chat.completions", body, request_id="r", audit_k=5, inject_seed=False)
    assert strip(obj, asked) is obj


@pytest.mark.parametrize("extra", [{"top_logprobs": 3}, {"logprobs": False, "top_logprobs": 3}, {"top_logprobs": "x"}])
def test_chat_top_logprobs_without_logprobs_is_left_for_upstream_to_refuse(extra: dict[str, Any]) -> None:
    """vLLM answers 400 to these; asking for logprobs on the client's behalf would turn that into a 200."""
    p = prepare("chat.completions", {**CHAT, **extra}, request_id="r", audit_k=5, inject_seed=False)
    assert p.upstream_body == {**CHAT, **extra, "return_token_ids": True}
    assert (
        prepare(
            "chat.completions", {**CHAT, "top_logprobs": 0}, request_id="r", audit_k=5, inject_seed=False
        ).upstream_body["top_logprobs"]
        == 5
    )  # 0 is valid without logprobs: audited as usual


def test_chat_echo_asks_for_no_logprobs() -> None:
    """Under echo vLLM returns the prompt's logprobs with top_logprobs alternatives: audit k would show there."""
    p = prepare("chat.completions", {**CHAT, "echo": True}, request_id="r", audit_k=5, inject_seed=False)
    assert p.upstream_body == {**CHAT, "echo": True, "return_token_ids": True}
    assert p.echo is None  # chat's echo keeps its text with token ids
