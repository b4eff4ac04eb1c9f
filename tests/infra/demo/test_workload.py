"""The demo's bundled workload and how it is cut into waves (pure: no stack)."""

from __future__ import annotations

import json

from infra.demo.tools import definitions, run_tool
from infra.demo.workload import (
    AGENT_STEPS,
    QUICK_WAVES,
    WAVES,
    Sent,
    _tool_turn,
    count_requests,
    group_name,
    load_workload,
    plan_waves,
)


def test_bundled_workload_has_a_few_dozen_prompts_of_every_size_and_three_workflows() -> None:
    workload = load_workload()
    assert 30 <= len(workload.prompts) <= 48
    assert {p.size for p in workload.prompts} == {"short", "medium", "long"}
    assert {p.tenant for p in workload.prompts} == {"insurance", "finance", "health"}
    assert len({p.id for p in workload.prompts}) == len(workload.prompts)
    assert len(workload.workflows) == 3
    assert all(len(w.steps) >= 3 for w in workload.workflows)


def test_waves_send_every_prompt_once_alone_4_and_12_at_once() -> None:
    workload = load_workload()
    waves = plan_waves(workload.prompts)
    assert [(at_once, len(ps)) for at_once, ps in waves] == list(WAVES)
    ids = [p.id for _, ps in waves for p in ps]
    assert len(ids) == len(set(ids)) == sum(n for _, n in WAVES)
    assert plan_waves(workload.prompts) == waves  # fixed shuffle: the same plan every run
    for _, prompts in waves[1:]:
        assert len({p.size for p in prompts}) > 1  # each batched wave mixes lengths


def test_quick_workload_is_six_prompts_one_workflow_of_two_steps_and_one_agent() -> None:
    workload = load_workload(quick=True)
    waves = plan_waves(workload.prompts, quick=True)
    assert [(a, len(ps)) for a, ps in waves] == list(QUICK_WAVES)
    assert len(workload.workflows) == 1
    assert len(workload.workflows[0].steps) == 2
    assert [a.name for a in workload.agents] == ["policy-agent"]
    assert count_requests(workload, quick=True) == 8 + AGENT_STEPS
    assert count_requests(load_workload()) == 36 + 10 + 2 * AGENT_STEPS


def test_the_agents_force_a_call_to_a_tool_they_offer() -> None:
    agents = load_workload().agents
    assert {a.tool_choice for a in agents} == {"lookup_policy", "required"}
    for agent in agents:
        offered = [d["function"]["name"] for d in definitions(agent.tools)]
        assert agent.tool_choice in ("required", *offered)
    assert agents[0].choice() == {"type": "function", "function": {"name": "lookup_policy"}}
    assert agents[1].choice() == "required"


def test_a_tool_turn_carries_the_calls_and_the_local_tools_results() -> None:
    sent = Sent("r", "agent", "insurance", "policy-agent#1", None)
    sent.tool_calls = [
        {"id": "c1", "type": "function", "function": {"name": "lookup_policy", "arguments": '{"number": "123456"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}},
    ]
    assistant, first, second = _tool_turn(sent)
    assert assistant["tool_calls"][0]["function"]["name"] == "lookup_policy"
    assert (first["tool_call_id"], json.loads(first["content"])["holder"]) == ("c1", "Maria Lopez")
    assert json.loads(second["content"]) == {"error": "the arguments are not JSON"}
    sent.tool_calls, sent.answer = [], "<tool_call> {"  # the model ran out of tokens mid-call
    assistant, note = _tool_turn(sent)
    assert assistant == {"role": "assistant", "content": "<tool_call> {"}
    assert "could not be read" in note["content"]


def test_the_tools_are_deterministic_and_refuse_bad_arguments_in_words() -> None:
    assert json.loads(run_tool("lookup_policy", '{"number": "POL-654321"}'))["active"] is False
    assert json.loads(run_tool("lookup_policy", '{"number": "1"}')) == {"error": "no policy numbered '1'"}
    assert json.loads(run_tool("get_weather", '{"city": "Oslo"}')) == {"city": "Oslo", "celsius": -4, "sky": "snow"}
    assert json.loads(run_tool("get_weather", "[1]")) == {"error": "the arguments are not a JSON object"}
    assert json.loads(run_tool("launch", "{}")) == {"error": "no tool named 'launch'"}


def test_group_names() -> None:
    assert group_name(1) == "alone"
    assert group_name(12) == "12 at once"
