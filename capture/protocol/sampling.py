"""The sampling contract read from a request: every field that changes which tokens come out, with upstream's
defaults made explicit (a field the request leaves out is recorded as the value upstream applied).

`sampling_contract` reads one request; `frozen_contract` is what the proxy calls: the same record for the same
fields (`_CONTRACTS`), since an application sends the same sampling fields request after request and
validating a contract is most of the work of `capture.protocol.audit_fields.prepare`. Fields that look like
credentials (`capture.protocol.credentials`) are never recorded, at any depth.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

from pydantic import TypeAdapter, ValidationError

from capture.protocol import Endpoint
from capture.protocol.credentials import is_credential, without_credentials
from capture.protocol.endpoints import ENDPOINTS
from schemas import OutputConstraint, SamplingContract
from schemas.canonical import canonical_json
from schemas.sampling import CONSTRAINT_FIELDS

# vLLM 0.32's own defaults for a request that leaves a field out (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS);
# the served model's generation_config.json overrides them unless vLLM runs with --generation-config vllm
# (`SamplingDefaults`, `capture.request.runtime.load_sampling_defaults`).
VLLM_DEFAULTS: Final[dict[str, float | int]] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


class SamplingDefaults:
    """What upstream uses for a sampling field a request leaves out: every `VLLM_DEFAULTS` field, plus
    ``max_tokens`` when the model sets one. The contract records these, so it says what upstream applied."""

    __slots__ = ("key", "values")

    def __init__(self, values: dict[str, float | int]) -> None:
        self.values: dict[str, float | int] = {**VLLM_DEFAULTS, **values}
        self.key = tuple(sorted(self.values.items()))  # part of the contract cache's key

    def __repr__(self) -> str:
        return f"SamplingDefaults({self.values!r})"


BUILTIN_DEFAULTS: Final = SamplingDefaults({})
# Request fields mapped onto the contract, or that do not change which tokens come out.
_MAPPED: Final = frozenset(
    {*VLLM_DEFAULTS, "max_tokens", "max_completion_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "n"}
    | {"seed", "logit_bias", "logits_processors", *CONSTRAINT_FIELDS}
)
_NOT_OUTPUT_AFFECTING: Final = frozenset(
    {"model", "messages", "prompt", "stream", "stream_options", "user", "logprobs", "top_logprobs"}
    | {"return_token_ids", "return_tokens_as_token_ids", "request_id", "metadata", "store", "service_tier"}
    | {"parallel_tool_calls", "priority", "cache_salt"}
)


def default_of(body: dict[str, Any], name: str, defaults: SamplingDefaults) -> Any:
    """The value of field `name` upstream applies: the request's, or upstream's default when it has none."""
    value = body.get(name)
    return defaults.values.get(name) if value is None else value


def sampling_contract(
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    recorded_k: int | None,
    seed_injected: bool,
    defaults: SamplingDefaults = BUILTIN_DEFAULTS,
) -> SamplingContract:
    """The request's sampling contract with upstream's defaults explicit; raises ValueError on invalid values."""
    temperature = float(default_of(body, "temperature", defaults))
    seed = body.get("seed")
    if temperature == 0.0:
        scope: Literal["per_request", "worker_global", "none"] = "none"
    elif seed is not None:
        scope = "per_request"
    else:
        scope = "worker_global"
    stop = body.get("stop")
    stops: tuple[str, ...] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    # Responses and Messages bodies come in the chat spelling (`capture.protocol.responses.contract_body`); a
    # bound the request leaves to upstream is the model's default, then the rest of the context (recorded as None)
    max_tokens = ENDPOINTS[endpoint].max_tokens(body)
    if max_tokens is None:
        max_tokens = defaults.values.get("max_tokens")
    bias = body.get("logit_bias") or {}
    processors = body.get("logits_processors") or ()
    constraint = output_constraint(body)
    extra = {
        name: canonical_json(without_credentials(value)).decode("utf-8")
        for name, value in body.items()
        if name not in _MAPPED and name not in _NOT_OUTPUT_AFFECTING and value is not None and not is_credential(name)
    }
    try:
        return SamplingContract(
            temperature=temperature,
            top_p=default_of(body, "top_p", defaults),
            top_k=default_of(body, "top_k", defaults),
            min_p=default_of(body, "min_p", defaults),
            repetition_penalty=default_of(body, "repetition_penalty", defaults),
            presence_penalty=default_of(body, "presence_penalty", defaults),
            frequency_penalty=default_of(body, "frequency_penalty", defaults),
            max_tokens=max_tokens,
            min_tokens=body.get("min_tokens") or 0,
            stop=stops,
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos", False)),
            n=body.get("n") or 1,
            seed=seed,
            seed_scope=scope,
            seed_injected=seed_injected,
            logprobs=recorded_k,
            logit_bias={str(k): float(v) for k, v in bias.items()},
            logits_processors=tuple(p if isinstance(p, str) else canonical_json(p).decode() for p in processors),
            constraint=constraint,
            extra=extra,
        )
    except ValidationError as exc:
        raise ValueError(str(exc)) from exc


def output_constraint(body: dict[str, Any]) -> OutputConstraint | None:
    """The request's structured-output and tool fields as data (`schemas.sampling.OutputConstraint`: each field as
    compact JSON in the client's own key order, credentials left out), or None when it sets none of them.

    Not sorted as canonical JSON is: a JSON schema's property order is the order a grammar backend makes the model
    write the properties in, so sorting the keys would record another constraint."""
    fields = {
        name: json.dumps(without_credentials(body[name]), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        for name in CONSTRAINT_FIELDS
        if body.get(name) is not None
    }
    return OutputConstraint(**fields) if fields else None


def is_sampled(body: dict[str, Any], defaults: SamplingDefaults) -> bool:
    """Whether upstream samples this request (its temperature read as pydantic reads it: ``"0"`` is greedy too)."""
    try:
        return _FLOAT.validate_python(default_of(body, "temperature", defaults)) != 0.0
    except ValidationError:
        return False  # upstream refuses the request


_FLOAT: Final = TypeAdapter(float)

# Contracts already frozen, by what they are made of (`_contract_key`; see the module docstring). Bounded; records
# are immutable, so one may serve many requests.
_CONTRACTS: dict[tuple[Any, ...], SamplingContract | None] = {}
_MAX_CONTRACTS: Final = 256
_SCALARS: Final = frozenset({str, int, float, bool, type(None)})
_MISSING: Final = object()
_NOT_IN_CONTRACT: Final = frozenset({"messages", "prompt"})  # the prompt is recorded as token ids, not here


def _contract_key(
    endpoint: Endpoint, up: dict[str, Any], recorded_k: int | None, injected: bool, defaults: SamplingDefaults
) -> tuple[Any, ...]:
    """What `sampling_contract` reads, as a hashable key (each value with its type: ``1``, ``1.0`` and ``true``
    are equal in Python but not in a contract's ``extra``); () when a field holds a list or an object."""
    key: list[Any] = [endpoint, recorded_k, injected, defaults.key]
    for name, value in up.items():
        if name in _NOT_IN_CONTRACT:
            continue
        kind = type(value)
        if kind not in _SCALARS:
            return ()
        key += (name, kind, value)
    return tuple(key)


def frozen_contract(
    endpoint: Endpoint, up: dict[str, Any], recorded_k: int | None, injected: bool, defaults: SamplingDefaults
) -> SamplingContract | None:
    """`sampling_contract` of the upstream body, or None when it is invalid (upstream will refuse it with a 400, or
    the envelope says the contract is unknown); the same record for the same fields (`_CONTRACTS`)."""
    key = _contract_key(endpoint, up, recorded_k, injected, defaults)
    hit = _CONTRACTS.get(key, _MISSING) if key else _MISSING
    if hit is not _MISSING:
        return hit  # type: ignore[return-value]
    try:
        contract: SamplingContract | None = sampling_contract(
            endpoint, up, recorded_k=recorded_k, seed_injected=injected, defaults=defaults
        )
    except (ValueError, TypeError, AttributeError):
        contract = None
    if key:
        if len(_CONTRACTS) >= _MAX_CONTRACTS:
            _CONTRACTS.clear()
        _CONTRACTS[key] = contract
    return contract
