"""Real application traffic, captured by the real sidecar and replayed bitwise on its schedule (issue 29).

Regulated workflows extract into JSON schemas and classify into fixed choices; agent teams call tools. The
session stack's vLLM serves all of it (``--enable-auto-tool-choice --tool-call-parser hermes``, its structured
outputs on their default backend) and records its schedule; the sidecar in front of it records each request's
output constraint as data (`schemas.OutputConstraint`); the shipper ships the schedule to the real SeaweedFS; each
envelope is replayed on the schedule lane, which applies the same constraint through vLLM's own code.

The reference is what the *client* received (its ``return_token_ids`` and per-token logprobs), not the stored copy:
every replay must give the same token ids and the same logprobs, sent all at once (batched) and staggered. The
first request is replayed on its own with fillers; the rest once per busy period, with every captured request's real
content (`tests.replayer.schedule.scheduled_stack.replay_by_period`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.settings import CaptureSettings
from infra.stack import servers
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo
from replayer.schedule.lane import ScheduleLane
from replayer.schedule.store import ScheduleStore, ScheduleWindow
from replayer.schedule.window import read_window
from replayer.settings import ReplayerSettings
from schemas import CapturedOutput, Envelope
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import serve
from tests.replayer.schedule.scheduled_stack import replay_by_period, ship_schedules
from tests.replayer.schedule.test_lane_model import model_dir
from tests.replayer.schedule.test_replay_stack import _fields, _spooled

pytestmark = [pytest.mark.stack, pytest.mark.model]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
POLICY = {
    "type": "function",
    "function": {
        "name": "lookup_policy",
        "description": "Find an insurance policy by its number.",
        "parameters": {"type": "object", "properties": {"number": {"type": "string"}}, "required": ["number"]},
    },
}
CLAIM_SCHEMA = {
    "type": "object",
    "properties": {"claimant": {"type": "string"}, "amount": {"type": "integer"}, "urgent": {"type": "boolean"}},
    "required": ["claimant", "amount", "urgent"],
}
CLAIM = "Claim from Maria Lopez: water damage in the kitchen, repair quote 4200 euros, the ceiling may fall."


def _body(content: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A chat body that asks for what the reference needs: token ids and per-token logprobs."""
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
        **fields,
    }


#: One request per kind of application traffic (name -> body).
TRAFFIC: dict[str, dict[str, Any]] = {
    "json_schema": _body(
        f"Extract the claimant, the amount and whether it is urgent as JSON. {CLAIM}",
        40,
        response_format={"type": "json_schema", "json_schema": {"name": "claim", "schema": CLAIM_SCHEMA}},
    ),
    "json_object": _body(f"Answer in JSON with a field summary. {CLAIM}", 24, response_format={"type": "json_object"}),
    "choice": _body(
        f"Classify the claim as approve, review or deny. {CLAIM}",
        4,
        structured_outputs={"choice": ["approve", "review", "deny"]},
    ),
    "regex": _body("Give a policy number.", 12, structured_outputs={"regex": "POL-[0-9]{6}"}),
    "seeded_schema": _body(
        f"Extract the claim as JSON. {CLAIM}",
        32,
        temperature=0.8,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "claim", "schema": CLAIM_SCHEMA}},
    ),
    "tool_required": _body("What is the weather in Lisbon?", 64, tools=[WEATHER, POLICY], tool_choice="required"),
    "tool_named": _body(
        "Look up policy 123456.",
        24,
        tools=[WEATHER, POLICY],
        tool_choice={"type": "function", "function": {"name": "lookup_policy"}},
    ),
    "tool_auto": _body("What is the weather in Oslo?", 24, tools=[WEATHER], tool_choice="auto"),
    "plain": _body("Name three rivers.", 16),
}


@pytest.fixture(scope="module")
def sidecar(stack: StackInfo) -> dict[str, Any]:
    """The real sidecar in front of the session stack's vLLM (which records its schedule)."""
    assert stack.vllm_url is not None
    env = stack_defaults(stack)  # the stack's runtime file and manifest: what `reprolane serve capture` reads
    settings = CaptureSettings(
        upstream=stack.vllm_url,
        spool_max_bytes=1 << 22,
        schedule_recorder=servers.RECORDER_NAME,
        runtime_path=env["REPROLANE_CAPTURE_RUNTIME_PATH"],
        manifest_path=env["REPROLANE_CAPTURE_MANIFEST_PATH"],
    )
    spool = FakeSpool()
    return {"app": build_app(settings, spool=spool, metrics=CaptureMetrics()), "spool": spool}


async def _send(app: Any, bodies: list[dict[str, Any]], gaps_s: float) -> list[httpx.Response]:
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=600.0) as client:

        async def one(i: int, body: dict[str, Any]) -> httpx.Response:
            await asyncio.sleep(i * gaps_s)
            return await client.post("/v1/chat/completions", json=body)

        replies = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    assert [r.status_code for r in replies] == [200] * len(bodies), [r.text for r in replies]
    return list(replies)


def _client_reference(reply: httpx.Response) -> tuple[list[int], list[float]]:
    """The token ids and chosen-token logprobs the client received."""
    choice = reply.json()["choices"][0]
    return choice["token_ids"], [item["logprob"] for item in choice["logprobs"]["content"]]


def _check_recorded(name: str, body: dict[str, Any], envelope: Envelope, vllm_url: str) -> None:
    """The constraint is in the contract as data; offered tools are in the prompt's token ids."""
    sampling = envelope.sampling
    assert sampling is not None
    constraint = sampling.constraint
    if name == "plain":
        assert constraint is None
        return
    assert constraint is not None, name
    for field in ("response_format", "structured_outputs", "tools", "tool_choice"):
        if field in body:
            assert json.loads(getattr(constraint, field)) == body[field], (name, field)
    if "tools" in body:
        assert envelope.prompt is not None
        detokenized = httpx.post(f"{vllm_url}/detokenize", json={"tokens": list(envelope.prompt.token_ids)})
        prompt = detokenized.json()["prompt"]
        assert "<tools>" in prompt, name
        for tool in body["tools"]:
            assert json.dumps(tool["function"]["parameters"]) in prompt, name  # the rendered tools, in the ids
        assert envelope.runtime.tool_call_parser == "hermes"
    assert envelope.artifacts.chat_template_sha256 is not None  # the template that rendered the tools
    assert envelope.runtime.structured_outputs is not None
    assert "xgrammar=" in envelope.runtime.structured_outputs


async def _windows(stack: StackInfo, envelopes: list[Envelope], work: Path) -> list[ScheduleWindow]:
    """The envelopes' schedule windows, shipped (a copy of the stack's segments: `ship_schedules`) and read back
    through the index as the service reads them."""
    store_settings = ReplayerSettings(**_fields(stack_defaults(stack), "REPROLANE_REPLAYER_"))
    await ship_schedules(stack, store_settings, envelopes, work)
    store = ScheduleStore.from_settings(store_settings)
    return [read_window(store, e) for e in envelopes]


@pytest.mark.parametrize(
    ("names", "gaps_s"),
    [
        (list(TRAFFIC), 0.0),  # every kind at once, beside every other kind
        (["json_schema", "plain", "tool_required", "choice"], 0.4),  # staggered: each joins a running batch
    ],
    ids=["at-once", "staggered"],
)
async def test_application_traffic_replays_bitwise_against_what_the_client_received(
    stack: StackInfo,
    sidecar: dict[str, Any],
    lane_box: dict[str, ScheduleLane],
    names: list[str],
    gaps_s: float,
    tmp_path: Path,
) -> None:
    replies = await _send(sidecar["app"], [TRAFFIC[n] for n in names], gaps_s)
    ids = [r.headers["x-reprolane-request-id"] for r in replies]
    envelopes = await _spooled(sidecar["spool"], ids)
    for name, envelope in zip(names, envelopes, strict=True):
        _check_recorded(name, TRAFFIC[name], envelope, stack.vllm_url or "")
    for name in {"tool_required", "tool_named"} & set(names):  # the stack serves tool calls, forced by the constraint
        message = replies[names.index(name)].json()["choices"][0]["message"]
        assert message.get("tool_calls") or (message["content"] or "").startswith("<tool_call>"), message

    windows = await _windows(stack, envelopes, tmp_path)
    if gaps_s == 0.0:
        assert max(len(s.scheduled) for w in windows for s in w.steps) > 1, "vLLM never batched the requests"
    settings = ReplayerSettings(model_dir=model_dir())
    assert windows[0].engine is not None
    if "lane" not in lane_box:
        lane_box["lane"] = ScheduleLane(settings, windows[0].engine)
    results = replay_by_period(envelopes, windows, lane_box["lane"], settings)  # the first alone, the rest by period
    failures = []
    for name, reply, envelope in zip(names, replies, envelopes, strict=True):
        result, _ = results[envelope.request_id]
        token_ids, logprobs = _client_reference(reply)
        replayed = result.replayed
        assert isinstance(envelope.outcome, CapturedOutput)
        assert list(envelope.outcome.choices[0].token_ids) == token_ids  # the record is what the client got
        same = list(replayed.token_ids) == token_ids and [s.logprob for s in replayed.logprobs or ()] == logprobs
        if not (same and result.event.verdict == "bitwise" and result.event.schedule_reproduced):
            failures.append(f"{name} {envelope.request_id}: {result.event.verdict}, {result.event.cause_detail}")
    assert not failures, f"{len(failures)} of {len(names)} not bitwise:\n" + "\n".join(failures)
