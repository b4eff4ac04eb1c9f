"""The tools the demo's agent workflows call: small deterministic local functions, and their OpenAI definitions.

An agent workflow (``agents`` in ``infra/workload/workflows.json``) is a real agent loop: the model is offered these
tools, asks for one (``tool_choice`` forces the first call), the demo runs it here and sends the result back as a
``tool`` message, until the model answers in words or the loop's step budget ends. The functions read fixed tables
and nothing else, so a run's tool results depend only on the model's calls: a replay of step k has step k's exact
prompt, tool results included.

Bad arguments (the model's JSON may not parse, or may name no policy) give a result that says so, never an
exception: a model's mistake is part of the conversation, as it would be in production.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

#: The insurance back office the tools read (policy number -> record).
POLICIES: Final[dict[str, dict[str, Any]]] = {
    "123456": {"holder": "Maria Lopez", "active": True, "covers": ["water damage", "fire", "storm"], "excess": 250},
    "654321": {"holder": "Jon Berg", "active": False, "covers": ["fire"], "excess": 500},
}
#: Weather reports by city, lower case.
WEATHER: Final[dict[str, dict[str, Any]]] = {
    "lisbon": {"sky": "sunny", "celsius": 21},
    "oslo": {"sky": "snow", "celsius": -4},
    "paris": {"sky": "rain", "celsius": 12},
}


def lookup_policy(arguments: dict[str, Any]) -> dict[str, Any]:
    number = str(arguments.get("number", "")).strip().removeprefix("POL-")
    policy = POLICIES.get(number)
    return {"number": number, **policy} if policy is not None else {"error": f"no policy numbered {number!r}"}


def get_weather(arguments: dict[str, Any]) -> dict[str, Any]:
    city = str(arguments.get("city", "")).strip()
    report = WEATHER.get(city.lower())
    return {"city": city, **report} if report is not None else {"error": f"no weather report for {city!r}"}


#: Every tool: name -> (its OpenAI definition's function part, the local function). ``strict``: the arguments must
#: match the parameters' schema (vLLM pins it in the call's token mask), so even a small model writes a call that
#: parses, instead of running out of tokens inside free-form JSON.
TOOLS: Final[dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], dict[str, Any]]]]] = {
    "lookup_policy": (
        {
            "name": "lookup_policy",
            "strict": True,
            "description": "Find an insurance policy by its number: holder, whether it is active, what it covers.",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "string", "description": "the policy number, six digits"}},
                "required": ["number"],
            },
        },
        lookup_policy,
    ),
    "get_weather": (
        {
            "name": "get_weather",
            "strict": True,
            "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
        get_weather,
    ),
}


def definitions(names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The OpenAI ``tools`` list offering `names` (each must be one of `TOOLS`)."""
    return [{"type": "function", "function": TOOLS[name][0]} for name in names]


def run_tool(name: str, arguments: str) -> str:
    """Run tool `name` on the model's `arguments` (JSON text as upstream returned it); the result as JSON text."""
    tool = TOOLS.get(name)
    if tool is None:
        return json.dumps({"error": f"no tool named {name!r}"})
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:
        return json.dumps({"error": "the arguments are not JSON"})
    if not isinstance(parsed, dict):
        return json.dumps({"error": "the arguments are not a JSON object"})
    return json.dumps(tool[1](parsed), sort_keys=True)
