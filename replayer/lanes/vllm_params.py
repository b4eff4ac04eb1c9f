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

Where the forms differ, they follow what each side of vLLM takes: ``SamplingParams`` gets ``top_k=0`` for "no
top-k", integer ``logit_bias`` keys and ``None`` for an absent option; the server's JSON body gets ``top_k=-1``,
string keys, and leaves an absent option out.
"""

from __future__ import annotations

import json
from typing import Any

from replayer.errors import NotReplayableError
from replayer.lanes.base import GenRequest, effective_seed
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


def sampling_kwargs(request: GenRequest) -> dict[str, Any]:
    """The full contract as `vllm.SamplingParams` keyword arguments (``n`` is always 1: choice 0 only)."""
    sampling = request.sampling
    kwargs: dict[str, Any] = {
        **_contract_fields(request),
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,
        "stop": list(sampling.stop) or None,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "seed": effective_seed(sampling),
        "logit_bias": {int(k): v for k, v in sampling.logit_bias.items()} or None,
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
    return _with_extra(body, sampling)
