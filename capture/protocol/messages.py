"""``POST /v1/messages`` (the Anthropic Messages API): how the sidecar reads a request and its answer.

vLLM (0.32) serves this endpoint by converting the request to a chat completion (`chat_messages` mirrors its
``AnthropicServingMessages.to_chat_completion_request`` for text) and the answer back; the conversion carries
no ``seed``, no logprobs and no token ids, and vLLM ignores fields it does not know. So what the endpoint cannot
return (`LIMITS`) is recorded on every envelope:

- prompt token ids: computed by the sidecar through upstream's ``/tokenize`` with the messages as vLLM converts
  them (same chat template; tests/capture/request/test_responses_messages_stack.py proves them equal to what the same
  conversation gets from ``/v1/chat/completions``); a request whose conversion the sidecar does not mirror
  (images, tool blocks, inline system messages, tools, thinking) records none and is not replayable;
- output token ids: the answer's text re-tokenized (``/tokenize``, no special tokens): the end-of-sequence
  token of an answer that ended by itself is not in the text, and a text may re-tokenize to other ids than
  the ones generated;
- logprobs: none; seed: none (a sampled request is not reproducible).

A streamed answer is typed events (``message_start``, ``content_block_delta``, ``message_delta``,
``message_stop``); nothing is added to the request, so nothing is stripped from the answer.
"""

from __future__ import annotations

from typing import Any, Final

from capture.protocol.token_text import clean_text

OutputCollector = Any
"""A `capture.protocol.output.OutputCollector` (which imports this module: named here, not imported)."""

PATH: Final = "/v1/messages"
TERMINAL: Final = frozenset({"message_stop"})
"""The event that ends a Messages stream (vLLM sends no ``data: [DONE]`` after it)."""

LIMITS: Final = (
    "prompt.token_ids: /v1/messages returns none: computed through /tokenize with the messages as vLLM converts them",
    "choices.token_ids: /v1/messages returns none: the answer's text re-tokenized (an end-of-sequence token is "
    "not in it)",
    "choices.logprobs: /v1/messages returns none",
    "sampling.seed: /v1/messages takes none (vLLM 0.32 ignores one): a sampled answer is not reproducible",
)
NOT_RENDERED: Final = "prompt.token_ids: the sidecar does not mirror vLLM's conversion of this request: none recorded"
_STOP_FINISH: Final = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
_NOT_SAMPLING: Final = frozenset({"model", "messages", "system", "stream", "metadata", "stop_sequences"})
_UNMIRRORED: Final = ("tools", "tool_choice", "thinking", "output_config")
_BILLING: Final = "x-anthropic-billing-header"


def contract_body(up: dict[str, Any]) -> dict[str, Any]:
    """The body in the spelling `capture.protocol.sampling.sampling_contract` reads (``stop``), without the
    fields that make the prompt."""
    out = {k: v for k, v in up.items() if k not in _NOT_SAMPLING}
    if up.get("stop_sequences") is not None:
        out["stop"] = up["stop_sequences"]
    return out


def ask(body: dict[str, Any], up: dict[str, Any], audit_k: int) -> tuple[bool, bool, int | None]:
    """Nothing is added to a Messages request (its server takes no field of ours): the client gets all that
    comes back, and no logprobs are recorded."""
    return True, True, None


def strip(obj: dict[str, Any], *, token_ids: bool, logprobs: bool) -> dict[str, Any]:
    """What the client gets of one answer object: all of it (nothing was asked for on its behalf)."""
    return obj


def tokenize_doc(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` document of the chat messages vLLM makes of the request (None: not mirrored here)."""
    converted = chat_messages(body)
    if converted is None:
        return None
    doc: dict[str, Any] = {"messages": converted, "add_generation_prompt": True}
    if body.get("chat_template_kwargs") is not None:
        doc["chat_template_kwargs"] = body["chat_template_kwargs"]
    return doc


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages vLLM makes of a text-only request (its ``_convert_system_message`` and
    ``_convert_messages``), or None when the request holds anything this does not mirror."""
    if any(body.get(name) is not None for name in _UNMIRRORED):
        return None
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        texts = _texts(system) if isinstance(system, list) else [system] if isinstance(system, str) else None
        if texts is None:
            return None
        joined = "".join(t for t in texts if not t.startswith(_BILLING))
        if joined:
            out.append({"role": "system", "content": joined})
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            return None  # an inline system message: vLLM's handling depends on a server setting
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
            continue
        texts = _texts(content) if isinstance(content, list) else None
        if texts is None:
            return None
        if len(texts) == 1:
            out.append({"role": msg["role"], "content": texts[0]})
        elif texts:
            out.append({"role": msg["role"], "content": [{"type": "text", "text": t} for t in texts]})
        elif msg["role"] == "assistant":
            out.append({"role": "assistant"})
    return out


def _texts(blocks: list[Any]) -> list[str] | None:
    """The non-empty texts of a list of content blocks, or None when one is not a text block."""
    texts: list[str] = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text":
            return None
        text = block.get("text")
        if text is not None and not isinstance(text, str):
            return None
        if text:
            texts.append(text)
    return texts


def collect(collector: OutputCollector, obj: dict[str, Any]) -> None:
    """Record one answer object: a whole message, or one event of a stream."""
    kind = obj.get("type")
    if kind == "message":
        _collect_message(collector, obj)
    elif kind == "message_start" and isinstance(obj.get("message"), dict):
        _collect_message(collector, obj["message"])
    elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
        _add_text(collector, obj["content_block"].get("text"))
    elif kind == "content_block_delta" and isinstance(obj.get("delta"), dict):
        if obj["delta"].get("type") == "text_delta":
            _add_text(collector, obj["delta"].get("text"))
    elif kind == "message_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
            collector.choice(0).finish_reason = _STOP_FINISH.get(delta["stop_reason"], delta["stop_reason"])
        _note_usage(collector, obj.get("usage"))
    elif kind in TERMINAL:
        collector.ended = True


def error_of(obj: dict[str, Any]) -> Any:
    """Upstream's error in a stream event (an ``error`` event), or None."""
    return (obj.get("error") or "error") if obj.get("type") == "error" else None


def _collect_message(collector: OutputCollector, message: dict[str, Any]) -> None:
    if isinstance(message.get("model"), str):
        collector.resolved_model = message["model"]
    _note_usage(collector, message.get("usage"))
    acc = collector.choice(0)
    for block in message.get("content") or ():
        if isinstance(block, dict) and block.get("type") == "text":
            _add_text(collector, block.get("text"))
    reason = message.get("stop_reason")
    if isinstance(reason, str):
        acc.finish_reason = _STOP_FINISH.get(reason, reason)


def _add_text(collector: OutputCollector, text: Any) -> None:
    if isinstance(text, str) and text:
        collector.choice(0).text.append(clean_text(text))


def _note_usage(collector: OutputCollector, usage: Any) -> None:
    """Usage as the stream reports it: ``message_start`` the input, ``message_delta`` the output (kept both)."""
    if isinstance(usage, dict):
        collector.usage.update({k: v for k, v in usage.items() if type(v) is int})
