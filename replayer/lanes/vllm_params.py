"""A lane's request (`replayer.lanes.base.GenRequest`) as vLLM's sampling parameters, in the two forms the vLLM
lanes send it.

- `sampling_kwargs`: keyword arguments of ``vllm.SamplingParams``, for vLLM in this process (the vllm lane and
  the matrix's batch engine);
- `completion_body`: the body of a vLLM server's ``POST /v1/completions``, for the remote lane. Its ``prompt`` is
  the recorded token id list, and it asks for ``return_token_ids`` and ``return_tokens_as_token_ids`` so that the
  generated ids and the top-k alternatives come back as ids.

Both carry the whole contract or refuse it with `NotReplayableError`: logits processors are code, not data, and
cannot be replayed; each ``sampling.extra`` entry (a vLLM option the capture kept as JSON) is passed on under its
own name, unless it names a parameter already set. ``n`` is always 1 (only choice 0 is replayed) and the seed
follows the seed scope (`replayer.lanes.base.effective_seed`).

The output constraint (`schemas.OutputConstraint`: structured outputs, a response format, offered tools) becomes
vLLM's ``StructuredOutputsParams`` exactly as vLLM's server makes them, through vLLM's own code
(`structured_outputs`): its chat or Responses request model reads the fields (``extract_structured_outputs``)
after the server's tool parser, named by production's fingerprint, has adjusted the request for the tools
offered (``Parser.adjust_request``). The server body gives a vLLM server the request's own ``response_format``
and ``structured_outputs``, which its completions endpoint takes; a Responses ``text.format`` or tools it
refuses (``/v1/completions`` takes neither).

Where the forms differ, they follow what each side of vLLM takes: ``SamplingParams`` gets ``top_k=0`` for "no
top-k", integer ``logit_bias`` keys and ``None`` for an absent option; the server's JSON body gets ``top_k=-1``,
string keys, and leaves an absent option out.
"""

from __future__ import annotations

import json
from typing import Any

from replayer.errors import NotReplayableError
from replayer.lanes.base import GenRequest, effective_seed, quiet_imports
from schemas import SamplingContract

__all__ = ["completion_body", "sampling_kwargs"]


def _contract_fields(request: GenRequest) -> dict[str, Any]:
    """The parameters both forms spell alike."""
    sampling, max_tokens = request.sampling, request.max_tokens
    if sampling.logits_processors:
        raise NotReplayableError(f"custom logits processors cannot be replayed: {list(sampling.logits_processors)}")
    return {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "max_tokens": max_tokens,
        "min_tokens": min(sampling.min_tokens, max_tokens),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": request.top_k_logprobs,
    }


def _with_extra(params: dict[str, Any], sampling: SamplingContract) -> dict[str, Any]:
    """``params`` plus the contract's ``extra`` entries (JSON values); one that names a set parameter is refused."""
    for name, raw in sampling.extra.items():
        if name in params:
            raise NotReplayableError(f"sampling.extra.{name} duplicates a contract field")
        try:
            params[name] = json.loads(raw)
        except ValueError as exc:
            raise NotReplayableError(f"sampling.extra.{name} is not JSON: {exc}") from exc
    return params


def structured_outputs(request: GenRequest, tokenizer: Any = None) -> Any:
    """vLLM's ``StructuredOutputsParams`` for the request's output constraint, made as vLLM's server makes them
    (module docstring); None when nothing constrains the output. `NotReplayableError` names the field that cannot
    be applied: vLLM refuses it, or tools are offered and the parser or the tokenizer it needs is unknown."""
    constraint = request.sampling.constraint
    if constraint is None or not constraint.constrains:
        return None
    with quiet_imports():
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    fields = {name: json.loads(raw) for name, raw in constraint.model_dump(exclude_none=True).items()}
    named = ", ".join(constraint.named())
    try:
        vllm_request: Any = (
            ResponsesRequest.model_validate({"input": "", **fields})
            if "text" in fields
            else ChatCompletionRequest.model_validate({"messages": [], **fields})
        )
        if vllm_request.tools and vllm_request.tool_choice != "none":
            vllm_request = _parsed_for_tools(vllm_request, request.tool_call_parser, tokenizer, named)
        return vllm_request.extract_structured_outputs()
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError and vLLM's are ValueErrors
        raise NotReplayableError(f"vLLM refuses the recorded output constraint ({named}): {exc}") from exc


def _parsed_for_tools(vllm_request: Any, parser_name: str | None, tokenizer: Any, named: str) -> Any:
    """The request as the server's tool parser adjusts it before sampling (vLLM 0.32's ``Parser.adjust_request``:
    a structural tag or a JSON schema of calls, by parser, tool choice and strictness), for a server run with
    ``--enable-auto-tool-choice --tool-call-parser NAME`` at the default tool strict level."""
    if parser_name is None:
        raise NotReplayableError(
            f"tools are offered ({named}) but the envelope names no tool-call parser (runtime.tool_call_parser): "
            "the constraint the server derived from them is unknown"
        )
    if tokenizer is None:
        raise NotReplayableError(f"this lane has no tokenizer to build the {parser_name} tool parser ({named})")
    with quiet_imports():
        from vllm.parser import ParserManager

    parser_cls = ParserManager.get_parser(tool_parser_name=parser_name, enable_auto_tools=True, tokenizer=tokenizer)
    if parser_cls is None:
        raise NotReplayableError(f"vLLM has no tool-call parser {parser_name!r} (runtime.tool_call_parser)")
    return parser_cls(tokenizer, vllm_request.tools).adjust_request(request=vllm_request)


def sampling_kwargs(request: GenRequest, tokenizer: Any = None) -> dict[str, Any]:
    """The full contract as `vllm.SamplingParams` keyword arguments (``n`` is always 1: choice 0 only);
    `tokenizer` (the engine's) builds a tool parser when the request offered tools (`structured_outputs`)."""
    sampling = request.sampling
    kwargs: dict[str, Any] = {
        **_contract_fields(request),
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,
        "stop": list(sampling.stop) or None,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "seed": effective_seed(sampling),
        "logit_bias": {int(k): v for k, v in sampling.logit_bias.items()} or None,
        "structured_outputs": structured_outputs(request, tokenizer),
    }
    return _with_extra(kwargs, sampling)


def completion_body(model: str, request: GenRequest) -> dict[str, Any]:
    """The ``/v1/completions`` body that replays the request on a vLLM server."""
    sampling = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        **_contract_fields(request),
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    seed = effective_seed(sampling)
    if seed is not None:
        body["seed"] = seed
    if sampling.logit_bias:
        body["logit_bias"] = dict(sampling.logit_bias)
    constraint = sampling.constraint
    if constraint is not None and constraint.constrains:
        if constraint.text is not None or constraint.tools is not None:
            raise NotReplayableError(
                "the remote lane replays through /v1/completions, which takes no Responses text.format and no tools: "
                f"cannot apply {', '.join(constraint.named())}"
            )
        for name in ("response_format", "structured_outputs"):
            raw = getattr(constraint, name)
            if raw is not None:
                body[name] = json.loads(raw)
    return _with_extra(body, sampling)
