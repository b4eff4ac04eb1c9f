"""From a client request and upstream's answer to what an envelope is made of (pure: no IO, no clock).

Three steps, in the order the proxy uses them (the third in `capture.assembly`):

1. `prepare`: parse what the client asked for, add the audit fields to the upstream request
   (``return_token_ids``; ``logprobs``/``top_logprobs`` at the audit k with ``return_tokens_as_token_ids`` when
   the client asked for no logprobs; a seed when the policy injects one) and freeze the sampling contract with
   vLLM's defaults made explicit.
2. `OutputCollector` + `strip`: each response object (a whole body, or one SSE chunk) is recorded, and the
   client gets a copy stripped of what it did not ask for. vLLM writes an unrequested field as ``null`` (it
   does not omit it), so stripping sets the field to ``None``: the client gets the shape it gets without us.
3. `capture.assembly.build_envelope_bytes`: assemble the envelope from the `RequestContext` and what was
   collected.

When the client asked for logprobs itself its request is left as it is (its k, its token strings): the
envelope then records what the client gets, with ``token_id`` None for the alternatives.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from pydantic import TypeAdapter, ValidationError

from capture.policy import FlagDecision
from schemas import (
    Choice,
    SamplingContract,
    StepLogprobs,
    TopCandidate,
    WorkflowRef,
)
from schemas.canonical import canonical_json
from schemas.envelope_codec import StepRow, TopRow, steps_canonical_text

Endpoint = Literal["chat.completions", "completions"]
ErrorType = Literal["upstream_error", "timeout", "client_disconnect", "bad_request", "proxy_error"]

# vLLM 0.32's own defaults for a request that leaves a field out (ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS);
# the served model's generation_config.json overrides them unless vLLM runs with --generation-config vllm
# (`SamplingDefaults`, `capture.runtime.load_sampling_defaults`).
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
_COMPLETIONS_MAX_TOKENS: Final = 16  # vLLM 0.32's CompletionRequest.max_tokens default
# Request fields mapped onto the contract, or that do not change which tokens come out.
_MAPPED: Final = frozenset(
    {*VLLM_DEFAULTS, "max_tokens", "max_completion_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "n"}
    | {"seed", "logit_bias", "logits_processors"}
)
_NOT_OUTPUT_AFFECTING: Final = frozenset(
    {"model", "messages", "prompt", "stream", "stream_options", "user", "logprobs", "top_logprobs"}
    | {"return_token_ids", "return_tokens_as_token_ids", "request_id", "metadata", "store", "service_tier"}
    | {"parallel_tool_calls", "priority", "cache_salt"}
)
_TOKEN_ID_PREFIX: Final = "token_id:"
_PREFIX_LEN: Final = len(_TOKEN_ID_PREFIX)
# Fields that carry credentials are never recorded (they do not change outputs): an API key put in the body
# by a client library, a password inside a nested object, ... (names end with one of these words).
_CREDENTIAL: Final = re.compile(
    r"(?:^|[_\-])(?:api[_\-]?key|key|secret|password|passwd|passphrase|token|auth|authorization|credentials?|cookie)$",
    re.IGNORECASE,
)


def _without_credentials(value: Any) -> Any:
    """`value` with every object member whose name looks like a credential removed, at any depth."""
    if isinstance(value, dict):
        return {k: _without_credentials(v) for k, v in value.items() if not _CREDENTIAL.search(str(k))}
    if isinstance(value, list):
        return [_without_credentials(v) for v in value]
    return value


class Echo:
    """The prompt text of an echoed completion, put back where upstream leaves it out.

    vLLM (0.32) does not detokenize the prompt of an ``echo`` request that also asks for ``return_token_ids``:
    its answer's text starts with the generated text instead of the prompt. The sidecar needs the token ids, so
    it asks for them and puts each prompt's text back in front of its choices' text (in a stream: in each
    choice's first chunk), so the client reads what upstream answers to the client's own request. A prompt
    given as text is echoed as that text; one given as token ids is echoed as upstream's decoding of them
    (``/detokenize``, `resolve`). Choice ``i`` answers prompt ``i // n``, as vLLM numbers them.
    """

    __slots__ = ("_echoed", "generates", "n", "prompts", "texts")

    def __init__(self, prompts: list[str | list[int]], n: int, *, generates: bool = True) -> None:
        self.prompts = prompts
        self.n = max(n, 1)
        self.generates = generates  # False for max_tokens=0: the answer is the prompt alone, scored
        self.texts: list[str | None] = [p if isinstance(p, str) else None for p in prompts]
        self._echoed: set[int] = set()

    def pending(self) -> list[tuple[int, list[int]]]:
        """The prompts given as token ids whose text is not known yet, by position."""
        return [(i, p) for i, p in enumerate(self.prompts) if not isinstance(p, str) and self.texts[i] is None]

    def resolve(self, position: int, text: str) -> None:
        self.texts[position] = text

    def abandon(self) -> None:
        """Upstream will echo the prompts itself (the sidecar did not ask for token ids): put nothing back."""
        self.texts = [None] * len(self.prompts)

    def prefix(self, index: int, *, stream: bool) -> str:
        """What goes in front of choice `index`'s text ("" after its first chunk in a stream)."""
        if stream:
            if index in self._echoed:
                return ""
            self._echoed.add(index)
        position = index // self.n
        text = self.texts[position] if 0 <= position < len(self.texts) else None
        return text or ""


def completion_prompts(prompt: Any) -> list[str | list[int]] | None:
    """The prompts of a completions request (a text, token ids, or a list of either), or None for another shape."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompt):
            return list(prompt)
    return None


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


def _opt(body: dict[str, Any], name: str, defaults: SamplingDefaults) -> Any:
    value = body.get(name)
    return defaults.values.get(name) if value is None else value


def derive_seed(request_id: str) -> int:
    """The seed injected by policy: a stable 31-bit function of the request id (replays recompute nothing)."""
    return int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


def sampling_contract(
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    recorded_k: int | None,
    seed_injected: bool,
    defaults: SamplingDefaults = BUILTIN_DEFAULTS,
) -> SamplingContract:
    """The request's sampling contract with upstream's defaults explicit; raises ValueError on invalid values."""
    temperature = float(_opt(body, "temperature", defaults))
    seed = body.get("seed")
    if temperature == 0.0:
        scope: Literal["per_request", "worker_global", "none"] = "none"
    elif seed is not None:
        scope = "per_request"
    else:
        scope = "worker_global"
    stop = body.get("stop")
    stops: tuple[str, ...] = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    max_tokens = body.get("max_completion_tokens") if endpoint == "chat.completions" else None
    if max_tokens is None:
        # vLLM's completions request defaults an absent max_tokens to 16 (OpenAI's legacy default); a null one,
        # and chat's, fall to the model's default, then to the rest of the context (recorded as None)
        max_tokens = body.get("max_tokens", _COMPLETIONS_MAX_TOKENS if endpoint == "completions" else None)
    if max_tokens is None:
        max_tokens = defaults.values.get("max_tokens")
    bias = body.get("logit_bias") or {}
    processors = body.get("logits_processors") or ()
    extra = {
        name: canonical_json(_without_credentials(value)).decode("utf-8")
        for name, value in body.items()
        if name not in _MAPPED
        and name not in _NOT_OUTPUT_AFFECTING
        and value is not None
        and not _CREDENTIAL.search(name)
    }
    try:
        return SamplingContract(
            temperature=temperature,
            top_p=_opt(body, "top_p", defaults),
            top_k=_opt(body, "top_k", defaults),
            min_p=_opt(body, "min_p", defaults),
            repetition_penalty=_opt(body, "repetition_penalty", defaults),
            presence_penalty=_opt(body, "presence_penalty", defaults),
            frequency_penalty=_opt(body, "frequency_penalty", defaults),
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
            extra=extra,
        )
    except ValidationError as exc:
        raise ValueError(str(exc)) from exc


def prepare(
    endpoint: Endpoint,
    body: dict[str, Any],
    *,
    request_id: str,
    audit_k: int,
    inject_seed: bool,
    defaults: SamplingDefaults = BUILTIN_DEFAULTS,
) -> Prepared:
    """Parse a capture request and build the body sent upstream (the client's body is not modified)."""
    up = dict(body)
    client_token_ids = bool(body.get("return_token_ids"))
    up["return_token_ids"] = True
    n = _choices_per_prompt(body.get("n"))
    prompts = completion_prompts(body.get("prompt")) if endpoint == "completions" else None
    echo: Echo | None = None
    if endpoint == "completions" and body.get("echo") and not client_token_ids:
        if prompts is None or n is None:
            del up["return_token_ids"]  # no text to put back: the client's answer comes first, ids are lost
        else:
            echo = Echo(prompts, n, generates=body.get("max_tokens") != 0)
    if endpoint == "chat.completions":
        client_logprobs = bool(body.get("logprobs"))
        asked_top = body.get("top_logprobs")
        if client_logprobs:
            recorded_k: int | None = asked_top or 0
        elif body.get("echo") or not (asked_top is None or (type(asked_top) is int and asked_top == 0)):
            # echo: vLLM scores the prompt with top_logprobs alternatives (prompt_logprobs in the answer); a
            # top_logprobs without logprobs is upstream's to refuse (vLLM: 400): either way, nothing asked
            recorded_k = None
        else:
            up["logprobs"] = True
            up["top_logprobs"] = audit_k
            up["return_tokens_as_token_ids"] = True
            recorded_k = audit_k
    else:
        client_logprobs = body.get("logprobs") is not None
        if client_logprobs:
            recorded_k = body.get("logprobs")
        elif body.get("echo"):
            # Under echo, logprobs make vLLM compute and return the prompt's logprobs too (a pass over the
            # whole vocabulary per prompt token, work the client did not ask for): token ids only.
            recorded_k = None
        else:
            up["logprobs"] = audit_k
            up["return_tokens_as_token_ids"] = True
            recorded_k = audit_k
    seed_injected = False
    if inject_seed and body.get("seed") is None and _sampled(_opt(body, "temperature", defaults)):
        up["seed"] = derive_seed(request_id)
        seed_injected = True
    sampling = _frozen_contract(
        endpoint, up, recorded_k if isinstance(recorded_k, int) else None, seed_injected, defaults
    )
    model = body.get("model")
    return Prepared(
        endpoint=endpoint,
        upstream_body=up,
        model=model if isinstance(model, str) and model else "unknown",
        stream=bool(body.get("stream")),
        client_token_ids=client_token_ids,
        client_logprobs=client_logprobs,
        sampling=sampling,
        echo=echo,
        prompts=len(prompts) if prompts else 1,
        n=n or 1,
    )


def _sampled(temperature: Any) -> bool:
    """Whether upstream samples at this temperature (read as pydantic reads it: ``"0"`` is greedy too)."""
    try:
        return _FLOAT.validate_python(temperature) != 0.0
    except ValidationError:
        return False  # upstream refuses the request


_FLOAT: Final = TypeAdapter(float)
_INT: Final = TypeAdapter(int)  # lax, as upstream's own pydantic models read `n`: 2, 2.0, "2" and true all count


def _choices_per_prompt(value: Any) -> int | None:
    """``n`` as upstream reads it (at least 1), or None when it reads none (upstream refuses the request)."""
    if value is None:
        return 1
    try:
        return max(_INT.validate_python(value), 1)
    except ValidationError:
        return None


# Contracts already frozen, by what they are made of (`_contract_key`): an application sends the same sampling
# fields request after request, and validating a contract is ~2/3 of `prepare`. Bounded; records are immutable.
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


def _frozen_contract(
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


def strip(obj: Any, prepared: Prepared) -> Any:
    """What the client gets of one response object (a whole body or one SSE chunk): `obj` without what the
    sidecar asked for and the client did not. `obj` itself is left as it is (what was recorded from it stays
    true): changed objects are copies, everything else is shared."""
    if not isinstance(obj, dict):
        return obj
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


def _token_id(text: str) -> int | None:
    spelled = _id_spelling(text)
    return None if spelled is None else spelled[0]


def _id_spelling(text: str) -> tuple[int, list[int]] | None:
    """For ``token_id:N`` (how upstream spells a token under ``return_tokens_as_token_ids``): N and the UTF-8
    bytes of that spelling as upstream lists them; None for any other text.

    Spellings are kept in `_SPELLINGS` (the same few thousand token ids come back in every answer: parsing them
    was more than half of collecting a vLLM 16 x top-5 answer); the hot loop of `OutputCollector` looks there
    first itself."""
    spelled = _SPELLINGS.get(text)
    if spelled is not None:
        return spelled
    if len(text) > _MAX_SPELLING or not text.startswith(_TOKEN_ID_PREFIX):
        return None
    try:
        spelled = int(text[_PREFIX_LEN:]), list(text.encode("utf-8"))
    except ValueError:
        return None
    if len(_SPELLINGS) >= _MAX_SPELLINGS:
        _SPELLINGS.clear()  # a bound, not a policy: a vocabulary's hot ids are back within one answer
    _SPELLINGS[text] = spelled
    return spelled


# "token_id:" and up to 20 digits: longer is no vocabulary's id, and the cache below keeps only short keys.
_MAX_SPELLING: Final = _PREFIX_LEN + 20
_MAX_SPELLINGS: Final = 16_384  # keys of <= 29 characters: ~6.4 MiB when full (tracemalloc, as an lru_cache)
_SPELLINGS: dict[str, tuple[int, list[int]]] = {}


def _candidate(token: Any, raw_bytes: Any) -> tuple[str, int | None]:
    """Text and id of one reported token. With ``return_tokens_as_token_ids`` the token reads ``token_id:N``;
    its text then comes from the ``bytes`` field when that holds the token's own bytes, else stays empty."""
    text = _clean(token) if isinstance(token, str) else ""
    tid = _token_id(text)
    if tid is None:
        return text, None
    return _decode_bytes(raw_bytes) or "", tid


def _decode_bytes(raw: Any) -> str | None:
    """The token text from upstream's ``bytes``; None when they are not whole UTF-8, or when they merely spell
    ``token_id:N`` (vLLM 0.32 sends those for top-k alternatives under ``return_tokens_as_token_ids``)."""
    if not isinstance(raw, list):
        return None
    try:
        text = bytes(raw).decode("utf-8")
    except (ValueError, TypeError):
        return None
    return None if text.startswith(_TOKEN_ID_PREFIX) else text


def _clean(text: str) -> str:
    """Text as it can be stored: a lone surrogate (JSON allows ``"\\ud800"``) cannot be encoded as UTF-8 and
    would make the envelope unencodable, so it becomes ``?``."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


@dataclass(slots=True)
class _ChoiceAcc:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    steps: list[StepRow] = field(default_factory=list)  # token_id set once aligned with token_ids
    logprobs_missing: bool = False


class OutputCollector:
    """Accumulates what upstream produced, per choice index, from a whole body or from stream chunks."""

    def __init__(self, endpoint: Endpoint, *, echo: Echo | None = None) -> None:
        self.endpoint = endpoint
        self.echo = echo
        self.choices: dict[int, _ChoiceAcc] = {}
        self.prompt_token_ids: list[int] | None = None
        self.choice_prompts: dict[int, list[int]] = {}  # by choice index, for requests with several prompts
        self.system_fingerprint: str | None = None
        self.resolved_model: str | None = None
        self.version_headers: dict[str, str] = {}
        self.usage: dict[str, int] = {}
        self.chunks = 0

    def note_versions(self, header: Callable[[str, str], str], names: Iterable[str]) -> None:
        """Keep the version-like response headers a hosted API sends (``header(name, default)``)."""
        for name in names:
            value = header(name, "")
            if value:
                self.version_headers[name.lower()] = value[:200]

    def vendor_version(self) -> str | None:
        """``key=value;...`` sorted by key: the resolved model name and the version headers, or None."""
        pairs = dict(self.version_headers)
        if self.resolved_model is not None:
            pairs["model"] = self.resolved_model
        return ";".join(f"{k}={pairs[k]}" for k in sorted(pairs)) or None

    def add(self, obj: dict[str, Any]) -> None:
        """Record one response object (call before `strip`)."""
        self.chunks += 1
        fp = obj.get("system_fingerprint")
        if isinstance(fp, str):
            self.system_fingerprint = fp
        model = obj.get("model")
        if isinstance(model, str):
            self.resolved_model = model
        top_prompt = obj.get("prompt_token_ids")
        if isinstance(top_prompt, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = top_prompt
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        acc = self.choices.get(index)
        if acc is None:
            acc = self.choices[index] = _ChoiceAcc()
        prompt_ids = choice.get("prompt_token_ids")
        if isinstance(prompt_ids, list):
            if index == 0 and self.prompt_token_ids is None:
                self.prompt_token_ids = prompt_ids
            self.choice_prompts.setdefault(index, prompt_ids)
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            acc.token_ids.extend(ids)
        if choice.get("finish_reason") is not None:
            acc.finish_reason = choice["finish_reason"]
        if self.endpoint == "chat.completions":
            part = choice.get("message") or choice.get("delta") or {}
            content = part.get("content") if isinstance(part, dict) else None
        else:
            content = choice.get("text")
        if isinstance(content, str):
            acc.text.append(_clean(content))
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self._add_logprobs(acc, logprobs)
        elif isinstance(ids, list) and ids:
            acc.logprobs_missing = True

    def _add_logprobs(self, acc: _ChoiceAcc, lp: dict[str, Any]) -> None:
        if self.endpoint == "chat.completions":
            spellings = _SPELLINGS
            for item in lp.get("content") or ():
                token = item.get("token", "")
                spelled = (spellings.get(token) or _id_spelling(token)) if type(token) is str else None
                text = _decode_bytes(item.get("bytes")) if spelled is not None else _clean(token)
                top: list[TopRow] = []
                rank = 0
                for t in item.get("top_logprobs") or ():  # `_candidate` inlined: ~100 alternatives per request
                    rank += 1
                    tok = t.get("token")
                    if type(tok) is not str:
                        top.append(TopRow(t.get("logprob"), rank, ""))
                        continue
                    spelled = spellings.get(tok) or _id_spelling(tok)
                    if spelled is None:
                        top.append(TopRow(t.get("logprob"), rank, _clean(tok)))
                        continue
                    raw = t.get("bytes")  # vLLM 0.32: the bytes of "token_id:N" itself, i.e. no text
                    alt_text = "" if raw == spelled[1] else _decode_bytes(raw) or ""
                    top.append(TopRow(t.get("logprob"), rank, alt_text, spelled[0]))
                acc.steps.append(StepRow(item.get("logprob"), text, None, top))
            return
        tokens = lp.get("tokens") or []
        values = lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or []
        for i, token in enumerate(tokens):
            alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
            ranked = sorted(alts.items(), key=lambda kv: kv[1], reverse=True)
            text = None if _token_id(token) is not None else _clean(token)
            top = [TopRow(value, rank, *_candidate(tok, None)) for rank, (tok, value) in enumerate(ranked, start=1)]
            acc.steps.append(StepRow(values[i] if i < len(values) else None, text, None, top))

    def _echo_steps_dropped(self) -> None:
        """Under echo, upstream's logprobs cover the prompt's tokens, then the generated ones: keep the latter
        (none at all when nothing was generated for the client: ``max_tokens=0`` scores the prompt)."""
        if self.echo is None:
            return
        for acc in self.choices.values():
            if not self.echo.generates:
                acc.steps = []
            elif len(acc.steps) > len(acc.token_ids):
                acc.steps = acc.steps[len(acc.steps) - len(acc.token_ids) :]

    def choices_data(self, *, logprobs: bool = True) -> list[dict[str, Any]]:
        """The collected choices as plain data shaped like `Choice`, by index (validated by the caller).

        Logprobs are left out (None) exactly where `choices_record` leaves them out for a shape reason
        (missing, or not aligned with the token ids), and everywhere without `logprobs`; *values* are not
        checked here: an envelope validated from this data either holds them as they are or fails as a whole
        (see `build_envelope`).
        """
        self._echo_steps_dropped()
        return [
            {
                "index": index,
                "token_ids": acc.token_ids,
                "text": "".join(acc.text),
                "finish_reason": acc.finish_reason,
                "logprobs": _steps_data(acc) if logprobs else None,
            }
            for index, acc in sorted(self.choices.items())
        ]

    def logprobs_texts(self) -> list[str | None] | None:
        """Per choice (by index) the canonical text of its logprobs (None: it has none, as in `choices_data`),
        or None when some value is not exactly what a validated record holds (see
        `schemas.envelope_codec.steps_canonical_text`): the caller then takes the model path."""
        self._echo_steps_dropped()
        out: list[str | None] = []
        for _, acc in sorted(self.choices.items()):
            steps = _aligned_steps(acc)
            if steps is None:
                out.append(None)
                continue
            text = steps_canonical_text(steps)
            if text is None:
                return None
            out.append(text)
        return out

    def choices_record(self) -> tuple[Choice, ...]:
        """The collected choices as contract records, by index (one model per value: the slow, careful path)."""
        self._echo_steps_dropped()
        out: list[Choice] = []
        for index, acc in sorted(self.choices.items()):
            out.append(
                Choice(
                    index=index,
                    token_ids=tuple(acc.token_ids),
                    text="".join(acc.text),
                    finish_reason=acc.finish_reason,
                    logprobs=_steps_record(acc),
                )
            )
        return tuple(out)


def _aligned_steps(acc: _ChoiceAcc) -> list[StepRow] | None:
    """A choice's steps with each ``token_id`` set, or None when its logprobs cannot be recorded: some are
    missing, or there is not one step per token id."""
    if acc.logprobs_missing or not acc.steps or len(acc.steps) != len(acc.token_ids):
        return None
    for tid, step in zip(acc.token_ids, acc.steps, strict=True):
        step.token_id = tid
    return acc.steps


def _steps_data(acc: _ChoiceAcc) -> list[dict[str, Any]] | None:
    """A choice's steps as plain data shaped like `StepLogprobs` (None: as `_aligned_steps`)."""
    steps = _aligned_steps(acc)
    if steps is None:
        return None
    return [
        {
            "logprob": s.logprob,
            "token": s.token,
            "token_id": s.token_id,
            "top": [{"logprob": c.logprob, "rank": c.rank, "token": c.token, "token_id": c.token_id} for c in s.top],
        }
        for s in steps
    ]


def _steps_record(acc: _ChoiceAcc) -> tuple[StepLogprobs, ...] | None:
    steps = _aligned_steps(acc)
    if steps is None:
        return None
    try:
        return tuple(
            StepLogprobs(
                token_id=s.token_id,
                token=s.token,
                logprob=s.logprob,
                top=tuple(
                    TopCandidate(token=c.token, token_id=c.token_id, logprob=c.logprob, rank=c.rank) for c in s.top
                ),
            )
            for s in steps
        )
    except (ValidationError, TypeError):
        return None  # e.g. an infinite logprob: the token ids still stand


@dataclass(slots=True)
class RequestContext:
    """Everything about one request that is known before upstream answers, plus the timings after."""

    request_id: str
    received_at: datetime
    tenant: str
    workflow: WorkflowRef | None
    flag: FlagDecision
    endpoint: Endpoint
    stream: bool
    in_flight_at_start: int
    in_flight_at_end: int = 0
    body_sha256: str | None = None
    upstream_ms: float = 0.0
    first_token_ms: float | None = None
    added_ms: float | None = None
    recorded: bool = False  # its envelope was handed to the recorder (the proxy's last-resort handler asks)
