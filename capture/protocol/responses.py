"""``POST /v1/responses`` (the OpenAI Responses API): what the sidecar asks of a request, and how it reads the answer.

vLLM (0.32) answers a Responses request with the token ids of its prompt and of its answer when the request sets
``enable_response_messages`` (the response's ``input_messages`` / ``output_messages``, each ``{message, tokens}``;
streamed, in the ``response.completed`` event), and with per-token logprobs when ``include`` names
``message.output_text.logprobs`` (``top_logprobs`` alternatives). The sidecar asks for both and takes them back
out of what the client gets (`strip`). What the endpoint cannot return (`LIMITS`): the alternatives' token ids
(vLLM spells this endpoint's tokens as text; ``return_tokens_as_token_ids`` is a server flag here, not a request
field), so an envelope's alternatives carry text and logprob only. A streamed answer that ends with a token
without text (the end-of-sequence token) has no logprob for it in vLLM's events: its steps are one short of its
token ids, so none are recorded, and the envelope says why (`TEXTLESS_LAST`).

A streamed answer is typed events (``event: response.output_text.delta`` then its ``data``); the answer is read
whole from the terminal event (``response.completed``, ``.incomplete`` or ``.failed``: the full response object),
the text deltas before it only keep what was partial when a stream breaks. vLLM's own module for this endpoint
is ``vllm/entrypoints/openai/responses/protocol.py``.
"""

from __future__ import annotations

from typing import Any, Final

from capture.protocol.token_text import clean_text, decode_bytes
from schemas.envelope_codec import StepRow, TopRow

OutputCollector = Any
"""A `capture.protocol.output.OutputCollector` (which imports this module: named here, not imported)."""

PATH: Final = "/v1/responses"
LOGPROBS_INCLUDE: Final = "message.output_text.logprobs"
TERMINAL: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})
"""The events that end a Responses stream (vLLM sends no ``data: [DONE]`` after them)."""

LIMITS: Final = (
    "logprobs.top.token_id: /v1/responses spells tokens as text (vLLM 0.32 has no per-request "
    "return_tokens_as_token_ids for it): the alternatives hold text and logprob only",
)
TEXTLESS_LAST: Final = (
    "logprobs: vLLM 0.32 streams no logprob for an answer's last token when it has no text (the end-of-sequence "
    "token): one step short of the token ids, the answer's logprobs are not recorded",
)
MULTI_TURN: Final = (
    "prompt and output token ids: the response ran several model turns (tools), recorded only for one turn",
)
_STATUS_FINISH: Final = {"completed": "stop", "incomplete": "length"}

# Request fields that shape the prompt (recorded as its token ids) or the answer's form, not which tokens come out.
_NOT_SAMPLING: Final = frozenset(
    {"model", "input", "instructions", "previous_response_id", "previous_input_messages", "prompt", "include"}
    | {"top_logprobs", "enable_response_messages", "store", "metadata", "background", "service_tier", "user"}
    | {"parallel_tool_calls", "prompt_cache_key", "request_id", "session_id", "priority", "cache_salt", "stream"}
    | {"truncation", "chat_template_kwargs", "include_reasoning", "mm_payload", "return_mm_kwargs"}
    | {"media_io_kwargs", "mm_processor_kwargs", "max_tool_calls"}
)


def ask(body: dict[str, Any], up: dict[str, Any], audit_k: int) -> tuple[bool, bool, int | None]:
    """Add the audit fields to `up` (the upstream body); returns whether the client asked for the token ids
    itself, whether it asked for logprobs itself (it then gets them) and the k the envelope records (None: none)."""
    client_token_ids = body.get("enable_response_messages") is True
    up["enable_response_messages"] = True
    include = body.get("include")
    asked_top = body.get("top_logprobs")
    if isinstance(include, list) and LOGPROBS_INCLUDE in include:
        return client_token_ids, True, asked_top if type(asked_top) is int else 0
    if include is not None and not isinstance(include, list):
        return client_token_ids, False, None  # upstream's to refuse
    up["include"] = [*(include or ()), LOGPROBS_INCLUDE]
    up["top_logprobs"] = audit_k
    return client_token_ids, False, audit_k


def contract_body(up: dict[str, Any]) -> dict[str, Any]:
    """The upstream body in the spelling `capture.protocol.sampling.sampling_contract` reads (``max_tokens``),
    without the fields that shape the prompt or the answer's form."""
    out = {k: v for k, v in up.items() if k not in _NOT_SAMPLING}
    if "max_output_tokens" in out:
        out["max_tokens"] = out.pop("max_output_tokens")
    return out


def collect(collector: OutputCollector, obj: dict[str, Any]) -> None:
    """Record one response object: a whole answer, or one event of a stream."""
    kind = obj.get("type")
    if obj.get("object") == "response":
        _collect_response(collector, obj)
    elif kind in TERMINAL and isinstance(obj.get("response"), dict):
        _collect_response(collector, obj["response"])
        collector.ended = True
    elif kind == "response.output_text.delta":
        delta = obj.get("delta")
        if isinstance(delta, str):
            collector.choice(0).text.append(clean_text(delta))
    elif isinstance(obj.get("response"), dict):  # response.created, .in_progress: the model's name
        model = obj["response"].get("model")
        if isinstance(model, str):
            collector.resolved_model = model


def error_of(obj: dict[str, Any]) -> Any:
    """Upstream's error in a stream event (an ``error`` event, or a failed response), or None."""
    if obj.get("type") == "error":
        return obj.get("message") or obj.get("code") or "error"
    response = obj.get("response")
    if obj.get("type") == "response.failed" and isinstance(response, dict):
        return response.get("error") or "response.failed"
    return None


def _collect_response(collector: OutputCollector, response: dict[str, Any]) -> None:
    model = response.get("model")
    if isinstance(model, str):
        collector.resolved_model = model
    usage = response.get("usage")
    if isinstance(usage, dict):
        collector.usage = {k: v for k, v in usage.items() if type(v) is int}
    acc = collector.reset_choice(0)
    status = response.get("status")
    acc.finish_reason = _STATUS_FINISH.get(status, status) if isinstance(status, str) else None
    prompts, outputs = _raw_tokens(response.get("input_messages")), _raw_tokens(response.get("output_messages"))
    if len(prompts) > 1 or len(outputs) > 1:
        collector.limits.update(MULTI_TURN)
    if prompts and collector.prompt_token_ids is None:
        collector.prompt_token_ids = prompts[0]
    if len(outputs) == 1:
        acc.token_ids.extend(outputs[0])
    logprobs_seen = False
    for position, item in enumerate(response.get("output") or ()):
        if isinstance(item, dict) and item.get("type") == "function_call":
            call = {key: item[key] for key in ("name", "arguments") if isinstance(item.get(key), str)}
            if isinstance(item.get("call_id"), str):
                call["id"] = item["call_id"]
            acc.tool_calls[position] = call
            continue
        if not isinstance(item, dict) or item.get("type") != "message":
            continue
        for part in item.get("content") or ():
            if not isinstance(part, dict) or part.get("type") != "output_text":
                continue
            text = part.get("text")
            if isinstance(text, str):
                acc.text.append(clean_text(text))
            lp = part.get("logprobs")
            if isinstance(lp, list):
                logprobs_seen = True
                add_steps(acc.steps, lp)
    if not logprobs_seen and acc.token_ids:
        acc.logprobs_missing = True
    elif logprobs_seen and len(acc.steps) == len(acc.token_ids) - 1:
        collector.limits.update(TEXTLESS_LAST)


def _raw_tokens(messages: Any) -> list[list[int]]:
    """The token lists of ``input_messages`` / ``output_messages`` (``raw_message_tokens`` items)."""
    out: list[list[int]] = []
    for m in messages if isinstance(messages, list) else ():
        tokens = m.get("tokens") if isinstance(m, dict) else None
        if isinstance(tokens, list) and all(type(t) is int for t in tokens):
            out.append(tokens)
    return out


def add_steps(steps: list[StepRow], items: list[Any]) -> None:
    """Append the steps of one ``output_text`` part's ``logprobs`` (token text, ``bytes``, ``logprob``,
    ``top_logprobs``); token ids are set from the output's token ids when the counts agree."""
    for item in items:
        if not isinstance(item, dict):
            steps.append(StepRow(None))
            continue
        top = [
            TopRow(t.get("logprob"), rank, _text(t))
            for rank, t in enumerate(item.get("top_logprobs") or (), start=1)
            if isinstance(t, dict)
        ]
        steps.append(StepRow(item.get("logprob"), _text(item), None, top))


def _text(item: dict[str, Any]) -> str:
    text = decode_bytes(item.get("bytes"))
    if text is not None:
        return text
    token = item.get("token")
    return clean_text(token) if isinstance(token, str) else ""


def strip(obj: dict[str, Any], *, token_ids: bool, logprobs: bool) -> dict[str, Any]:
    """What the client gets of one response object or stream event: without the token ids (`token_ids` False)
    and the logprobs (`logprobs` False) the sidecar asked for, spelled as vLLM writes them unasked (``null``,
    and ``[]`` in the events that carry an empty list either way). `obj` itself is left as it is."""
    if obj.get("object") == "response":
        return _stripped_response(obj, token_ids=token_ids, logprobs=logprobs)
    kind = obj.get("type")
    response = obj.get("response")
    if isinstance(response, dict):
        return {**obj, "response": _stripped_response(response, token_ids=token_ids, logprobs=logprobs)}
    if logprobs:
        return obj
    if kind == "response.output_text.delta" and obj.get("logprobs"):
        return {**obj, "logprobs": []}
    if kind == "response.content_part.done" and isinstance(obj.get("part"), dict):
        return {**obj, "part": _stripped_part(obj["part"])}
    if kind == "response.output_item.done" and isinstance(obj.get("item"), dict):
        return {**obj, "item": _stripped_item(obj["item"])}
    return obj


def _stripped_response(response: dict[str, Any], *, token_ids: bool, logprobs: bool) -> dict[str, Any]:
    out = dict(response)
    if not token_ids:
        for name in ("input_messages", "output_messages"):
            if out.get(name) is not None:
                out[name] = None
    if not logprobs:
        if out.get("top_logprobs") is not None:
            out["top_logprobs"] = None
        if isinstance(out.get("output"), list):
            out["output"] = [_stripped_item(item) if isinstance(item, dict) else item for item in out["output"]]
    return out


def _stripped_item(item: dict[str, Any]) -> dict[str, Any]:
    content = item.get("content")
    if not isinstance(content, list):
        return item
    return {**item, "content": [_stripped_part(p) if isinstance(p, dict) else p for p in content]}


def _stripped_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") != "output_text" or part.get("logprobs") is None:
        return part
    return {**part, "logprobs": None}
