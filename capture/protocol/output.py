"""What upstream produced for one request, collected per choice from a whole body or from SSE chunks (pure).

`OutputCollector.add` records one response object (call it before `capture.protocol.audit_fields.strip`, which
leaves the recorded object as it is). The collected choices are then given in three forms, for the three
envelope builders of `capture.request.assembly`: plain data (`choices_data`), the canonical text of each choice's
logprobs (`logprobs_texts`, for the fast path), and contract records (`choices_record`). Logprobs are kept only
where there is one step per token id; under echo, only the generated tokens' steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from capture.protocol import Endpoint
from capture.protocol.completions import Echo
from capture.protocol.endpoints import ENDPOINTS
from capture.protocol.token_text import clean_text
from schemas import Choice, StepLogprobs, ToolCall, TopCandidate
from schemas.envelope_codec import StepRow, steps_canonical_text


@dataclass(slots=True)
class ChoiceAcc:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    steps: list[StepRow] = field(default_factory=list)  # token_id set once aligned with token_ids
    logprobs_missing: bool = False
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)  # by call index: id, name, arguments


class OutputCollector:
    """Accumulates what upstream produced, per choice index, from a whole body or from stream chunks."""

    def __init__(self, endpoint: Endpoint, *, echo: Echo | None = None) -> None:
        self.endpoint = endpoint
        self.protocol = ENDPOINTS[endpoint]
        self.echo = echo
        self.choices: dict[int, ChoiceAcc] = {}
        self.prompt_token_ids: list[int] | None = None
        self.choice_prompts: dict[int, list[int]] = {}  # by choice index, for requests with several prompts
        self.system_fingerprint: str | None = None
        self.resolved_model: str | None = None
        self.response_id: str | None = None  # upstream's ``id`` (for telemetry only: the envelope has its own ids)
        self.version_headers: dict[str, str] = {}
        self.usage: dict[str, int] = {}
        self.chunks = 0
        self.ended = False  # a Responses or Messages stream's terminal event was read (they send no [DONE])
        self.limits: set[str] = set()  # what upstream could not return for this answer (`Envelope.capture_limits`)

    def choice(self, index: int) -> ChoiceAcc:
        """What is collected of choice `index` (created empty on first use)."""
        acc = self.choices.get(index)
        if acc is None:
            acc = self.choices[index] = ChoiceAcc()
        return acc

    def reset_choice(self, index: int) -> ChoiceAcc:
        """Choice `index` collected anew (a Responses stream's terminal event holds the whole answer)."""
        acc = self.choices[index] = ChoiceAcc()
        return acc

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
        if self.protocol.collect is not None:  # a typed endpoint's module reads its own answers
            self.protocol.collect(self, obj)
            return
        fp = obj.get("system_fingerprint")
        if isinstance(fp, str):
            self.system_fingerprint = fp
        model = obj.get("model")
        if isinstance(model, str):
            self.resolved_model = model
        if self.response_id is None and isinstance(answer_id := obj.get("id"), str):
            self.response_id = answer_id[:256]
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
            acc = self.choices[index] = ChoiceAcc()
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
        reader = self.protocol.choices
        assert reader is not None  # a choices-family endpoint (`add`)
        content = reader.choice_text(choice)
        if isinstance(content, str):
            acc.text.append(clean_text(content))
        reader.add_tool_calls(acc.tool_calls, choice)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            reader.add_steps(acc.steps, logprobs)
        elif isinstance(ids, list) and ids:
            acc.logprobs_missing = True

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
                "tool_calls": _tool_calls_data(acc),
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
                    tool_calls=_tool_calls_record(acc),
                )
            )
        return tuple(out)


def _tool_calls_data(acc: ChoiceAcc) -> list[dict[str, Any]] | None:
    """A choice's tool calls as plain data shaped like `schemas.ToolCall`, in call order (None: none)."""
    if not acc.tool_calls:
        return None
    return [
        {"id": call.get("id"), "name": call.get("name", ""), "arguments": call.get("arguments", "")}
        for _, call in sorted(acc.tool_calls.items())
    ]


def _tool_calls_record(acc: ChoiceAcc) -> tuple[ToolCall, ...] | None:
    """`_tool_calls_data` as records; None when one does not validate (an over-long name from upstream): the
    token ids, which hold the calls, still stand."""
    data = _tool_calls_data(acc)
    if data is None:
        return None
    try:
        return tuple(ToolCall(**call) for call in data)
    except ValidationError:
        return None


def _aligned_steps(acc: ChoiceAcc) -> list[StepRow] | None:
    """A choice's steps with each ``token_id`` set, or None when its logprobs cannot be recorded: some are
    missing, or there is not one step per token id."""
    if acc.logprobs_missing or not acc.steps or len(acc.steps) != len(acc.token_ids):
        return None
    for tid, step in zip(acc.token_ids, acc.steps, strict=True):
        step.token_id = tid
    return acc.steps


def _steps_data(acc: ChoiceAcc) -> list[dict[str, Any]] | None:
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


def _steps_record(acc: ChoiceAcc) -> tuple[StepLogprobs, ...] | None:
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
