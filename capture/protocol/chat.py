"""``POST /v1/chat/completions``: what the sidecar asks of a chat request, and how it reads the answer.

A chat request asks for logprobs with ``logprobs: true`` and ``top_logprobs: k``; its answer carries them per
choice as ``logprobs.content``: one item per generated token (``token``, ``logprob``, ``bytes``, and the
``top_logprobs`` alternatives). A choice's text is ``message.content`` (whole body) or ``delta.content`` (one
SSE chunk). vLLM's own module for this endpoint is ``vllm/entrypoints/openai/chat_completion/protocol.py``.
"""

from __future__ import annotations

from typing import Any, Final

from capture.protocol.token_text import SPELLINGS, clean_text, decode_bytes, id_spelling
from schemas.envelope_codec import StepRow, TopRow

PATH: Final = "/v1/chat/completions"
_TOKENIZE_KEYS: Final = ("messages", "add_generation_prompt", "continue_final_message", "chat_template", "tools")


def ask_logprobs(body: dict[str, Any], up: dict[str, Any], audit_k: int) -> tuple[bool, int | None]:
    """Add the audit logprobs to `up` (the upstream body) unless the client asked for its own; returns whether
    it did (the client then gets them) and the k the envelope records (None: no logprobs recorded)."""
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
    return client_logprobs, recorded_k


def max_tokens(body: dict[str, Any]) -> Any:
    """The output bound the request sets (``max_completion_tokens``, else the older ``max_tokens``); None: the
    model's default applies, then the rest of the context."""
    bound = body.get("max_completion_tokens")
    return body.get("max_tokens") if bound is None else bound


def tokenize_doc(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` document that renders the request's messages as upstream does (None: no messages)."""
    if "messages" not in body:
        return None
    doc: dict[str, Any] = {key: body[key] for key in _TOKENIZE_KEYS if key in body}
    doc.setdefault("add_generation_prompt", True)
    return doc


def choice_text(choice: dict[str, Any]) -> Any:
    """The text of one choice (or of its part in one SSE chunk); anything but a str means none."""
    part = choice.get("message") or choice.get("delta") or {}
    return part.get("content") if isinstance(part, dict) else None


def add_tool_calls(calls: dict[int, dict[str, str]], choice: dict[str, Any]) -> None:
    """Merge the tool calls of one choice (``message.tool_calls``, or one SSE chunk's ``delta.tool_calls``, whose
    name and arguments come in pieces by ``index``) into `calls` (index -> id, name, arguments so far)."""
    part = choice.get("message") or choice.get("delta") or {}
    items = part.get("tool_calls") if isinstance(part, dict) else None
    for position, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        index = item.get("index", position)
        if type(index) is not int:
            continue
        call = calls.setdefault(index, {})
        if isinstance(item.get("id"), str):
            call["id"] = item["id"]
        function = item.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                piece = function.get(key)
                if isinstance(piece, str):
                    call[key] = call.get(key, "") + piece


def add_steps(steps: list[StepRow], lp: dict[str, Any]) -> None:
    """Append the steps of one choice's ``logprobs`` object (all of them, or one SSE chunk's) to `steps`."""
    spellings = SPELLINGS
    for item in lp.get("content") or ():
        token = item.get("token", "")
        spelled = (spellings.get(token) or id_spelling(token)) if type(token) is str else None
        text = decode_bytes(item.get("bytes")) if spelled is not None else clean_text(token)
        top: list[TopRow] = []
        rank = 0
        for t in item.get("top_logprobs") or ():  # `token_text.candidate` inlined: this runs per alternative
            rank += 1
            tok = t.get("token")
            if type(tok) is not str:
                top.append(TopRow(t.get("logprob"), rank, ""))
                continue
            spelled = spellings.get(tok) or id_spelling(tok)
            if spelled is None:
                top.append(TopRow(t.get("logprob"), rank, clean_text(tok)))
                continue
            raw = t.get("bytes")  # vLLM 0.32: the bytes of "token_id:N" itself, i.e. no text
            alt_text = "" if raw == spelled[1] else decode_bytes(raw) or ""
            top.append(TopRow(t.get("logprob"), rank, alt_text, spelled[0]))
        steps.append(StepRow(item.get("logprob"), text, None, top))
