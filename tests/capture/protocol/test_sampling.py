"""The sampling contract read from a request: upstream's defaults explicit, the frozen-contract cache."""

from __future__ import annotations

import json
from typing import Any

import pytest

import capture.protocol.sampling as sampling
from capture.protocol.audit_fields import prepare
from capture.protocol.sampling import BUILTIN_DEFAULTS, SamplingDefaults, sampling_contract

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_sampling_defaults_are_explicit() -> None:
    c = sampling_contract("chat.completions", CHAT, recorded_k=5, seed_injected=False)
    assert (c.temperature, c.top_p, c.top_k, c.min_p) == (1.0, 1.0, 0, 0.0)
    assert (c.repetition_penalty, c.presence_penalty, c.frequency_penalty) == (1.0, 0.0, 0.0)
    assert c.n == 1
    assert c.max_tokens is None
    assert c.seed is None
    assert c.seed_scope == "worker_global"


def test_sampling_maps_fields_and_keeps_other_output_affecting_ones() -> None:
    body = {
        **CHAT,
        "temperature": 0.5,
        "seed": 7,
        "max_completion_tokens": 9,
        "max_tokens": 99,
        "stop": "END",
        "logit_bias": {"42": -100},
        "response_format": {"type": "json_object"},
        "bad_words": ["never"],
        "user": "someone",
    }
    c = sampling_contract("chat.completions", body, recorded_k=None, seed_injected=False)
    assert c.seed == 7
    assert c.seed_scope == "per_request"
    assert c.max_tokens == 9
    assert c.stop == ("END",)
    assert c.logit_bias == {"42": -100.0}
    assert c.extra == {"bad_words": '["never"]'}
    assert c.constraint is not None
    assert c.constraint.response_format == '{"type":"json_object"}'


def test_invalid_sampling_value_gives_no_contract() -> None:
    p = prepare("chat.completions", {**CHAT, "temperature": -1}, request_id="r", audit_k=5, inject_seed=False)
    assert p.sampling is None


def test_contracts_are_reused_for_the_same_fields_only(monkeypatch: pytest.MonkeyPatch) -> None:
    def contract(body: dict[str, Any], prompt: str = "hi") -> Any:
        return prepare(
            "chat.completions",
            {**body, "messages": [{"role": "user", "content": prompt}]},
            request_id="r",
            audit_k=5,
            inject_seed=False,
        ).sampling

    same = contract({**CHAT, "temperature": 0.5, "foo": 1})
    assert contract({**CHAT, "temperature": 0.5, "foo": 1}, prompt="another prompt") is same  # cached
    # 1, 1.0 and true are equal in Python, not in a contract: each its own
    assert [contract({**CHAT, "temperature": 0.5, "foo": v}).extra["foo"] for v in (1, 1.0, True)] == [
        "1",
        "1.0",
        "true",
    ]
    assert contract({**CHAT, "temperature": 0.7, "foo": 1}).temperature == 0.7
    assert contract({**CHAT, "temperature": -1}) is None  # invalid, cached as such
    assert contract({**CHAT, "temperature": -1}) is None
    listed = contract({**CHAT, "stop": ["a"]})
    assert contract({**CHAT, "stop": ["a"]}) is not listed  # lists and objects are not keys: validated each time
    assert contract({**CHAT, "stop": ["b"]}).stop == ("b",)
    monkeypatch.setattr(sampling, "_MAX_CONTRACTS", 3)
    for t in range(10):
        assert contract({**CHAT, "temperature": t / 10}).temperature == t / 10
        assert len(sampling._CONTRACTS) <= 3


def test_left_out_fields_record_upstreams_defaults_and_the_cache_keeps_them_apart() -> None:
    model = SamplingDefaults({"temperature": 0.0, "top_k": 20, "max_tokens": 64})
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    with_model = prepare("chat.completions", body, request_id="rl-1", audit_k=5, inject_seed=True, defaults=model)
    builtin = prepare("chat.completions", body, request_id="rl-1", audit_k=5, inject_seed=True)
    assert with_model.sampling is not None
    assert builtin.sampling is not None
    assert (with_model.sampling.temperature, with_model.sampling.top_k, with_model.sampling.max_tokens) == (0.0, 20, 64)
    assert (builtin.sampling.temperature, builtin.sampling.top_k, builtin.sampling.max_tokens) == (1.0, 0, None)
    # greedy by the model's default: no seed injected (a sampled request by vLLM's own default gets one)
    assert "seed" not in with_model.upstream_body
    assert with_model.sampling.seed_scope == "none"
    assert builtin.sampling.seed_injected


def test_max_tokens_left_out_is_recorded_as_vllm_reads_it() -> None:
    """vLLM's completions request defaults an absent max_tokens to 16; null, and chat's, mean the model's
    default, else the rest of the context (None)."""
    model = SamplingDefaults({"max_tokens": 64})

    def recorded(endpoint: Any, body: dict[str, Any], defaults: SamplingDefaults = BUILTIN_DEFAULTS) -> Any:
        body = {"model": "m", **body}
        p = prepare(endpoint, body, request_id="rl-1", audit_k=5, inject_seed=False, defaults=defaults)
        assert p.sampling is not None
        return p.sampling.max_tokens

    assert recorded("completions", {"prompt": "Hi"}) == 16
    assert recorded("completions", {"prompt": "Hi"}, model) == 16
    assert recorded("completions", {"prompt": "Hi", "max_tokens": None}) is None
    assert recorded("completions", {"prompt": "Hi", "max_tokens": None}, model) == 64
    assert recorded("chat.completions", {"messages": CHAT["messages"]}) is None
    assert recorded("chat.completions", {"messages": CHAT["messages"]}, model) == 64
    assert recorded("chat.completions", {"messages": CHAT["messages"], "max_completion_tokens": 5}, model) == 5


SCHEMA: dict[str, Any] = {"type": "object", "properties": {"label": {"enum": ["approve", "deny"]}}}
LABEL = '{"type":"object","properties":{"label":{"enum":["approve","deny"]}}}'
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("endpoint", "fields", "recorded"),
    [
        (
            "chat.completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            {"response_format": '{"type":"json_schema","json_schema":{"name":"x","schema":' + LABEL + "}}"},
        ),
        (
            "chat.completions",
            {"response_format": {"type": "json_object"}},
            {"response_format": '{"type":"json_object"}'},
        ),
        (
            "chat.completions",
            {"structured_outputs": {"choice": ["a", "b"]}},
            {"structured_outputs": '{"choice":["a","b"]}'},
        ),
        ("completions", {"structured_outputs": {"regex": "[0-9]+"}}, {"structured_outputs": '{"regex":"[0-9]+"}'}),
        (
            "chat.completions",
            {"tools": TOOLS, "tool_choice": "required"},
            {
                "tools": '[{"type":"function","function":{"name":"lookup","parameters":{"type":"object"}}}]',
                "tool_choice": '"required"',
            },
        ),
        ("responses", {"text": {"format": {"type": "json_object"}}}, {"text": '{"format":{"type":"json_object"}}'}),
    ],
)
def test_the_output_constraint_is_recorded_as_data(
    endpoint: sampling.Endpoint, fields: dict[str, Any], recorded: dict[str, str]
) -> None:
    """The constraint itself (the request's field as compact JSON in its own key order), in its own record, not in
    ``extra``."""
    c = sampling_contract(endpoint, {**CHAT, "temperature": 0, **fields}, recorded_k=5, seed_injected=False)
    assert c.constraint is not None
    assert c.constraint.model_dump(exclude_none=True) == recorded
    assert c.constraint.constrains
    assert c.extra == {}


def test_tools_without_a_tool_choice_or_with_none_may_not_constrain() -> None:
    c = sampling_contract(
        "chat.completions", {**CHAT, "tools": TOOLS, "tool_choice": "none"}, recorded_k=5, seed_injected=False
    )
    assert c.constraint is not None
    assert not c.constraint.constrains
    plain = sampling_contract(
        "chat.completions", {**CHAT, "response_format": {"type": "text"}}, recorded_k=5, seed_injected=False
    )
    assert plain.constraint is not None
    assert not plain.constraint.constrains
    assert sampling_contract("chat.completions", CHAT, recorded_k=5, seed_injected=False).constraint is None


def test_a_credential_inside_a_constraint_is_not_recorded() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}, "api_key": "sk-secret"}]
    c = sampling_contract("chat.completions", {**CHAT, "tools": tools}, recorded_k=5, seed_injected=False)
    assert c.constraint is not None
    assert c.constraint.tools is not None
    assert "sk-secret" not in c.constraint.tools


def test_a_schemas_property_order_is_kept() -> None:
    """A grammar makes the model write a schema's properties in their order: sorting them records another
    constraint (the replay of a claim extraction then wrote "amount" first and forked at its second token)."""
    schema = {"type": "object", "properties": {"claimant": {"type": "string"}, "amount": {"type": "integer"}}}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    c = sampling_contract("chat.completions", body, recorded_k=5, seed_injected=False)
    assert c.constraint is not None
    assert c.constraint.response_format is not None
    assert list(json.loads(c.constraint.response_format)["json_schema"]["schema"]["properties"]) == [
        "claimant",
        "amount",
    ]
