"""``POST /v1/completions``: what the sidecar asks of a completions request, and how it reads the answer.

A completions request asks for logprobs with ``logprobs: k``; its answer carries them per choice as parallel
lists (``tokens``, ``token_logprobs``, and ``top_logprobs``: one ``{token: logprob}`` object per token). A
choice's text is ``text``. A request may send several prompts (choice ``i`` answers prompt ``i // n``), and may
ask for its prompt to be echoed in front of the answer (`Echo`). vLLM's own module for this endpoint is
``vllm/entrypoints/openai/completion/protocol.py``.
"""

from __future__ import annotations

from typing import Any, Final

from capture.protocol.token_text import candidate, clean_text, token_id_of
from schemas.envelope_codec import StepRow, TopRow

PATH: Final = "/v1/completions"
_DEFAULT_MAX_TOKENS: Final = 16  # vLLM 0.32's CompletionRequest.max_tokens default


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


def ask_logprobs(body: dict[str, Any], up: dict[str, Any], audit_k: int) -> tuple[bool, Any]:
    """Add the audit logprobs to `up` (the upstream body) unless the client asked for its own; returns whether
    it did (the client then gets them) and the k the envelope records (None, or not an int: none recorded)."""
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
    return client_logprobs, recorded_k


def max_tokens(body: dict[str, Any]) -> Any:
    """The output bound the request sets: vLLM's completions request defaults an absent ``max_tokens`` to 16
    (OpenAI's legacy default); a null one falls to the model's default (None here)."""
    return body.get("max_tokens", _DEFAULT_MAX_TOKENS)


def choice_text(choice: dict[str, Any]) -> Any:
    """The text of one choice (or of its part in one SSE chunk); anything but a str means none."""
    return choice.get("text")


def add_steps(steps: list[StepRow], lp: dict[str, Any]) -> None:
    """Append the steps of one choice's ``logprobs`` object (all of them, or one SSE chunk's) to `steps`; the
    alternatives of a step are ranked by logprob (upstream sends them as an object)."""
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    for i, token in enumerate(tokens):
        alts = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        ranked = sorted(alts.items(), key=lambda kv: kv[1], reverse=True)
        text = None if token_id_of(token) is not None else clean_text(token)
        top = [TopRow(value, rank, *candidate(tok, None)) for rank, (tok, value) in enumerate(ranked, start=1)]
        steps.append(StepRow(values[i] if i < len(values) else None, text, None, top))


def add_tool_calls(calls: dict[int, dict[str, str]], choice: dict[str, Any]) -> None:
    """A completion answers no tool calls: nothing to merge (`capture.protocol.endpoints.ChoiceReader`)."""
