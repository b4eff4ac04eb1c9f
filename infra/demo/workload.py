"""The demo's workload: the bundled prompts and agent workflows, planned into waves and driven through the sidecar.

Chat prompts (``infra/workload/prompts.json``) are shuffled with a fixed seed (each wave mixes short, medium and
long prompts) and split into waves sent 1, 4 and 12 at once. The requests of one group leave together, so the
production lane (vLLM with dynamic batching) computes them in one batch: that is what makes outputs differ from
the deterministic lane, which replays one sequence at a time. Every sixth prompt is a seeded sample
(temperature 0.8, a per-request seed); the rest are greedy.

Workflows (``infra/workload/workflows.json``) are driven live: step k+1's messages are the whole conversation so
far, step k's actual answer included. The three workflows run side by side, so their steps are batched too.
Agent workflows (its ``agents``) are tool-calling loops: step 1 offers the tools (`infra.demo.tools`) and forces a
call (a named function, or ``required``), the demo runs the tool the model asked for and sends its result back as
a ``tool`` message, and step 2 asks for the answer in words (``tool_choice: none``). They run beside the others.

Each tenant's requests go with that tenant's API key (``api_key=...``: the sidecar records the key's tenant, and
only keys with the ``flag`` role may flag). Every request carries the demo's own id in ``X-Request-Id``
(``<run id>-c07``, ``<run id>-wf1-s2``), which the sidecar records as the envelope's ``client_request_id``; the
request id is the sidecar's own, read from its ``X-Reprolane-Request-Id`` answer header. Workflow steps also
carry the workflow id, the step and ``X-Reprolane-Flag: 1``. Nothing here reads Kafka or S3: `drive` returns
what was sent and what came back.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

from infra.demo.tools import TOOLS, definitions, run_tool
from infra.errors import DemoError

Echo = Callable[[str], None]
Size = Literal["short", "medium", "long"]

MAX_TOKENS: dict[Size, int] = {"short": 24, "medium": 40, "long": 48}
QUICK_MAX_TOKENS = 12
WAVES: tuple[tuple[int, int], ...] = ((1, 6), (4, 12), (12, 18))  # (sent at once, how many prompts)
QUICK_WAVES: tuple[tuple[int, int], ...] = ((1, 2), (4, 4))
SEEDED_EVERY = 6
SAMPLED_TEMPERATURE = 0.8
REQUEST_ID_HEADER = "x-reprolane-request-id"  # the sidecar's request id of the answer


@dataclass(frozen=True)
class Prompt:
    id: str
    tenant: str
    size: Size
    text: str


@dataclass(frozen=True)
class Workflow:
    name: str
    tenant: str
    system: str
    steps: tuple[str, ...]


@dataclass(frozen=True)
class Agent:
    """A tool-calling agent loop: the task (step 1, with ``tool_choice``: a tool's name or ``required``), then the
    final question (step 2, after the tool results)."""

    name: str
    tenant: str
    system: str
    tools: tuple[str, ...]
    task: str
    tool_choice: str
    final: str

    def choice(self) -> str | dict[str, Any]:
        """Step 1's ``tool_choice`` as the API spells it."""
        if self.tool_choice in ("required", "auto"):
            return self.tool_choice
        return {"type": "function", "function": {"name": self.tool_choice}}


#: An agent loop's steps: the call, then the answer.
AGENT_STEPS = 2
#: A forced call's budget: the call's JSON, whatever the model puts in its arguments (quick demo included).
AGENT_CALL_TOKENS = 64


@dataclass(frozen=True)
class Workload:
    system: str
    prompts: tuple[Prompt, ...]
    workflows: tuple[Workflow, ...]
    agents: tuple[Agent, ...] = ()


@dataclass
class Sent:
    """One request of the demo: how it was sent and what came back. ``request_id`` is the demo's own id until
    the sidecar answers, then the sidecar's (the demo's stays in ``client_request_id``)."""

    request_id: str
    group: str  # "alone", "4 at once", "12 at once", "workflow", "agent" (a tool-calling loop)
    tenant: str
    prompt_id: str
    seed: int | None  # a seeded sample (temperature 0.8) when set, greedy otherwise
    workflow: str | None = None
    step: int | None = None
    answer: str = ""
    error: str | None = None
    seconds: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)
    client_request_id: str = ""
    workflow_id: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the calls the answer made (agent steps)

    def __post_init__(self) -> None:
        self.client_request_id = self.client_request_id or self.request_id


def _read_json(name: str) -> Any:
    try:
        return json.loads(resources.files("infra").joinpath("workload", name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DemoError(f"cannot read the bundled workload infra/workload/{name}: {exc}") from exc


def load_workload(*, quick: bool = False) -> Workload:
    """The bundled workload; ``quick``: 6 prompts and one workflow of 2 steps (for tests)."""
    prompts_doc, workflows_doc = _read_json("prompts.json"), _read_json("workflows.json")
    try:
        prompts = tuple(Prompt(p["id"], p["tenant"], p["size"], p["text"]) for p in prompts_doc["prompts"])
        workflows = tuple(
            Workflow(w["name"], w["tenant"], w["system"], tuple(w["steps"])) for w in workflows_doc["workflows"]
        )
        system = str(prompts_doc["system"])
        agents = tuple(
            Agent(a["name"], a["tenant"], a["system"], tuple(a["tools"]), a["task"], a["tool_choice"], a["final"])
            for a in workflows_doc.get("agents", ())
        )
    except (KeyError, TypeError) as exc:
        raise DemoError(f"the bundled workload is malformed: missing {exc}") from exc
    unknown = sorted({t for a in agents for t in a.tools} - set(TOOLS))
    if unknown:
        raise DemoError(f"the bundled workload's agents name tools infra/demo/tools.py does not have: {unknown}")
    if quick:
        workflows = (Workflow(workflows[0].name, workflows[0].tenant, workflows[0].system, workflows[0].steps[:2]),)
        agents = agents[:1]
    return Workload(system, prompts, workflows, agents)


def plan_waves(prompts: tuple[Prompt, ...], *, quick: bool = False) -> list[tuple[int, list[Prompt]]]:
    """Shuffled prompts (fixed seed) cut into waves of (sent at once, prompts)."""
    order = list(prompts)
    random.Random(7).shuffle(order)
    waves, start = [], 0
    for at_once, count in QUICK_WAVES if quick else WAVES:
        waves.append((at_once, order[start : start + count]))
        start += count
    return waves


def group_name(at_once: int) -> str:
    return "alone" if at_once == 1 else f"{at_once} at once"


def count_requests(workload: Workload, *, quick: bool = False) -> int:
    chats = sum(len(ps) for _, ps in plan_waves(workload.prompts, quick=quick))
    return chats + sum(len(w.steps) for w in workload.workflows) + AGENT_STEPS * len(workload.agents)


class Driver:
    """Sends the workload through the sidecar with the official ``openai`` client."""

    def __init__(
        self, base_url: str, model: str, run_id: str, keys: dict[str, str], *, quick: bool, echo: Echo
    ) -> None:
        try:
            from openai import AsyncOpenAI  # the official client, as a user of the sidecar would
        except ImportError as exc:
            raise DemoError("the demo drives its traffic with the openai client: pip install 'openai>=1.40'") from exc

        self.clients = {  # one client per tenant, with that tenant's API key
            tenant: AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120.0)
            for tenant, key in keys.items()
        }
        self.model = model
        self.run_id = run_id
        self.quick = quick
        self.echo = echo

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()

    async def _chat(
        self,
        sent: Sent,
        messages: list[dict[str, Any]],
        max_tokens: int,
        headers: dict[str, str],
        **tools: Any,
    ) -> None:
        """One chat request (``tools``: the ``tools`` and ``tool_choice`` of an agent step); fills `sent`."""
        from openai import APIStatusError, OpenAIError

        client = self.clients.get(sent.tenant)
        if client is None:
            raise DemoError(f"the demo has no API key for tenant {sent.tenant!r}")
        kwargs: dict[str, Any] = {"temperature": 0.0, **tools}
        if sent.seed is not None:
            kwargs = {"temperature": SAMPLED_TEMPERATURE, "seed": sent.seed, **tools}
        started = time.monotonic()
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                extra_headers={"X-Request-Id": sent.client_request_id, **headers},
                **kwargs,
            )
            sent.request_id = raw.headers.get(REQUEST_ID_HEADER, sent.request_id)
            message = raw.parse().choices[0].message
            sent.answer = message.content or ""
            sent.tool_calls = [call.model_dump(mode="json") for call in message.tool_calls or ()]
        except OpenAIError as exc:
            if isinstance(exc, APIStatusError):
                sent.request_id = exc.response.headers.get(REQUEST_ID_HEADER, sent.request_id)
            sent.error = f"{type(exc).__name__}: {exc}"
        sent.seconds = time.monotonic() - started

    def _max_tokens(self, size: Size) -> int:
        return QUICK_MAX_TOKENS if self.quick else MAX_TOKENS[size]

    async def chat_waves(self, workload: Workload) -> list[Sent]:
        """Each wave in groups of ``at_once`` requests that leave together."""
        out: list[Sent] = []
        n = 0
        for at_once, prompts in plan_waves(workload.prompts, quick=self.quick):
            started = time.monotonic()
            for i in range(0, len(prompts), at_once):
                batch = []
                for prompt in prompts[i : i + at_once]:
                    n += 1
                    seed = 1000 + n if n % SEEDED_EVERY == 0 else None
                    sent = Sent(f"{self.run_id}-c{n:02d}", group_name(at_once), prompt.tenant, prompt.id, seed)
                    messages = [
                        {"role": "system", "content": workload.system},
                        {"role": "user", "content": prompt.text},
                    ]
                    batch.append(self._chat(sent, messages, self._max_tokens(prompt.size), {}))
                    out.append(sent)
                await asyncio.gather(*batch)
            failed = sum(1 for s in out[-len(prompts) :] if s.error)
            self.echo(
                f"      {len(prompts):>2} prompts sent {group_name(at_once):<10} in {time.monotonic() - started:5.1f} s"
                + (f"  ({failed} failed)" if failed else "")
            )
        return out

    async def _workflow(self, index: int, workflow: Workflow) -> list[Sent]:
        workflow_id = f"{self.run_id}-wf{index}"
        messages = [{"role": "system", "content": workflow.system}]
        out: list[Sent] = []
        for step, text in enumerate(workflow.steps, start=1):
            messages.append({"role": "user", "content": text})
            sent = Sent(f"{workflow_id}-s{step}", "workflow", workflow.tenant, f"{workflow.name}#{step}", None)
            sent.workflow, sent.step, sent.workflow_id = workflow.name, step, workflow_id
            headers = {"X-Reprolane-Workflow-Id": workflow_id, "X-Reprolane-Step": str(step), "X-Reprolane-Flag": "1"}
            await self._chat(sent, messages, self._max_tokens("medium"), headers)
            out.append(sent)
            if sent.error:
                break  # the next step is built from this answer: there is none
            messages.append({"role": "assistant", "content": sent.answer})
        return out

    async def _agent(self, index: int, agent: Agent) -> list[Sent]:
        """One agent loop (module docstring): the forced call, the tools run here, then the answer."""
        workflow_id = f"{self.run_id}-ag{index}"
        offered = {"tools": definitions(agent.tools)}
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": agent.system},
            {"role": "user", "content": agent.task},
        ]
        out: list[Sent] = []
        for step, tool_choice in enumerate((agent.choice(), "none"), start=1):
            sent = Sent(f"{workflow_id}-s{step}", "agent", agent.tenant, f"{agent.name}#{step}", None)
            sent.workflow, sent.step, sent.workflow_id = agent.name, step, workflow_id
            headers = {"X-Reprolane-Workflow-Id": workflow_id, "X-Reprolane-Step": str(step), "X-Reprolane-Flag": "1"}
            budget = AGENT_CALL_TOKENS if step == 1 else self._max_tokens("medium")
            await self._chat(sent, messages, budget, headers, tool_choice=tool_choice, **offered)
            out.append(sent)
            if sent.error or step == AGENT_STEPS:
                break
            messages += [*_tool_turn(sent), {"role": "user", "content": agent.final}]
        return out

    async def workflows(self, workload: Workload) -> list[Sent]:
        started = time.monotonic()
        runs = await asyncio.gather(
            *(self._workflow(i, w) for i, w in enumerate(workload.workflows, start=1)),
            *(self._agent(i, a) for i, a in enumerate(workload.agents, start=1)),
        )
        out = [s for run in runs for s in run]
        calls = sum(len(s.tool_calls) for s in out)
        self.echo(
            f"      {len(workload.workflows)} workflows and {len(workload.agents)} tool-calling agents,"
            f" {len(out)} steps (each built from the previous answer; {calls} tool calls run)"
            f" in {time.monotonic() - started:5.1f} s"
        )
        return out


def _named(function: dict[str, Any]) -> dict[str, str]:
    """A call's function part as `run_tool`'s keywords (a missing name or arguments is an empty string)."""
    return {"name": str(function.get("name") or ""), "arguments": str(function.get("arguments") or "")}


def _tool_turn(sent: Sent) -> list[dict[str, Any]]:
    """The messages a tool-calling step adds to the conversation: the assistant's calls and each tool's result
    (`infra.demo.tools.run_tool`), or, when no call could be read from the answer (the model ran out of tokens
    mid-call), the answer as text and a note saying so."""
    if not sent.tool_calls:
        note = "The tool call could not be read (no complete call in the answer)."
        return [{"role": "assistant", "content": sent.answer}, {"role": "user", "content": note}]
    calls = [{"id": c["id"], "type": "function", "function": c["function"]} for c in sent.tool_calls]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": run_tool(**_named(c["function"]))} for c in sent.tool_calls
    ]
    return [{"role": "assistant", "content": sent.answer or None, "tool_calls": calls}, *results]


def tenants(workload: Workload) -> list[str]:
    """Every tenant the workload sends as (each needs an API key)."""
    loops = {w.tenant for w in workload.workflows} | {a.tenant for a in workload.agents}
    return sorted({p.tenant for p in workload.prompts} | loops)


async def drive(
    base_url: str, model: str, run_id: str, workload: Workload, keys: dict[str, str], *, quick: bool, echo: Echo
) -> list[Sent]:
    """Send the whole workload (chat waves, then the workflows) with each tenant's key in `keys`; return every
    request in send order."""
    driver = Driver(base_url, model, run_id, keys, quick=quick, echo=echo)
    try:
        chats = await driver.chat_waves(workload)
        return chats + await driver.workflows(workload)
    finally:
        await driver.close()
