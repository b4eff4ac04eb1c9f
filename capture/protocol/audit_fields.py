"""The audit fields: added to what goes upstream, taken back out of what the client gets (pure).

1. `prepare`: parse what the client asked for, add the audit fields to the upstream request
   (``return_token_ids``; logprobs at the audit k with ``return_tokens_as_token_ids`` when the client asked for
   no logprobs, in each endpoint's own spelling: `capture.protocol.chat.ask_logprobs`,
   `capture.protocol.completions.ask_logprobs`; a seed when the policy injects one) and freeze the sampling
   contract with upstream's defaults made explicit (`capture.protocol.sampling`).
2. `strip`: each response object (a whole body, or one SSE chunk) is recorded first
   (`capture.protocol.output.OutputCollector`), and the client gets a copy stripped of what it did not ask
   for. vLLM writes an unrequested field as ``null`` (it does not omit it), so stripping sets the field to
   ``None``: the client gets the shape it gets without us.

When the client asked for logprobs itself its request is left as it is (its k, its token strings): the
envelope then records what the client gets, with ``token_id`` None for the alternatives.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final

from pydantic import TypeAdapter, ValidationError

from capture.protocol import Endpoint
from capture.protocol.completions import Echo, completion_prompts
from capture.protocol.endpoints import ENDPOINTS
from capture.protocol.sampling import BUILTIN_DEFAULTS, SamplingDefaults, frozen_contract, is_sampled
from capture.protocol.token_text import clean_text
from schemas import SamplingContract


@dataclass(frozen=True, slots=True)
class Prepared:
    """A parsed capture request: what goes upstream, what the client asked for, the frozen contract."""

    endpoint: Endpoint
    upstream_body: dict[str, Any]
    model: str
    stream: bool
    client_token_ids: bool
    client_logprobs: bool
    sampling: SamplingContract | None
    echo: Echo | None = None
    prompts: int = 1  # a completions request may send several; choice i answers prompt i // n
    n: int = 1
    limits: tuple[str, ...] = ()  # what the endpoint cannot return (`Envelope.capture_limits`)


def derive_seed(request_id: str) -> int:
    """The seed injected by policy: a stable 31-bit function of the request id (replays recompute nothing)."""
    return int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


def prepare(
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    request_id: str,
    audit_k: int,
    inject_seed: bool,
    defaults: SamplingDefaults = BUILTIN_DEFAULTS,
) -> Prepared:
    """Parse a capture request and build the body sent upstream (the client's body is not modified): the
    endpoint's audit fields (`EndpointProtocol.ask`), the echo of a completions request, an injected seed, and the
    frozen contract (a typed endpoint's read in the chat spelling, ``contract_body``)."""
    protocol = ENDPOINTS[endpoint]
    up = dict(body)
    client_token_ids, client_logprobs, recorded_k = protocol.ask(body, up, audit_k)
    n = _choices_per_prompt(body.get("n")) if protocol.choices is not None else 1
    prompts = completion_prompts(body.get("prompt")) if protocol.raw_prompts else None
    echo: Echo | None = None
    if protocol.raw_prompts and body.get("echo") and not client_token_ids:
        if prompts is None or n is None:
            del up["return_token_ids"]  # no text to put back: the client's answer comes first, ids are lost
        else:
            echo = Echo(prompts, n, generates=body.get("max_tokens") != 0)
    seed_injected = False
    if protocol.injects_seed and inject_seed and body.get("seed") is None and is_sampled(body, defaults):
        up["seed"] = derive_seed(request_id)
        seed_injected = True
    contract = up if protocol.contract_body is None else protocol.contract_body(up)
    model = body.get("model")
    return Prepared(
        endpoint=endpoint,
        upstream_body=up,
        model=clean_text(model) if isinstance(model, str) and model else "unknown",  # "\ud800" is no envelope's
        stream=bool(body.get("stream")),
        client_token_ids=client_token_ids,
        client_logprobs=client_logprobs,
        sampling=frozen_contract(endpoint, contract, recorded_k, seed_injected, defaults),
        echo=echo,
        prompts=len(prompts) if prompts else 1,
        n=n or 1,
        limits=protocol.limits,
    )


_INT: Final = TypeAdapter(int)  # lax, as upstream's own pydantic models read `n`: 2, 2.0, "2" and true all count


def _choices_per_prompt(value: Any) -> int | None:
    """``n`` as upstream reads it (at least 1), or None when it reads none (upstream refuses the request)."""
    if value is None:
        return 1
    try:
        return max(_INT.validate_python(value), 1)
    except ValidationError:
        return None


def strip(obj: Any, prepared: Prepared) -> Any:
    """What the client gets of one response object (a whole body or one SSE chunk): `obj` without what the
    sidecar asked for and the client did not. `obj` itself is left as it is (what was recorded from it stays
    true): changed objects are copies, everything else is shared."""
    if not isinstance(obj, dict):
        return obj
    typed_strip = ENDPOINTS[prepared.endpoint].strip
    if typed_strip is not None:
        return typed_strip(obj, token_ids=prepared.client_token_ids, logprobs=prepared.client_logprobs)
    out = obj
    if not prepared.client_token_ids and obj.get("prompt_token_ids") is not None:
        out = {**obj, "prompt_token_ids": None}
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return out
    kept = [_stripped_choice(choice, prepared) for choice in choices]
    if any(new is not old for new, old in zip(kept, choices, strict=True)):
        out = {**out, "choices": kept}
    return out


def _stripped_choice(choice: Any, prepared: Prepared) -> Any:
    if not isinstance(choice, dict):
        return choice
    drop = []
    echo = prepared.echo
    if not prepared.client_token_ids:
        if choice.get("token_ids") is not None:
            drop.append("token_ids")
        # An echoed stream's first chunk of a choice carries the prompt's ids whether or not they were asked for.
        if choice.get("prompt_token_ids") is not None and not (echo is not None and prepared.stream):
            drop.append("prompt_token_ids")
    if not prepared.client_logprobs and choice.get("logprobs") is not None:
        drop.append("logprobs")
    if echo is not None and isinstance(choice.get("text"), str):
        prefix = echo.prefix(choice.get("index", 0), stream=prepared.stream)
        if prefix:
            return {**choice, **dict.fromkeys(drop), "text": prefix + choice["text"]}
    return {**choice, **dict.fromkeys(drop)} if drop else choice
