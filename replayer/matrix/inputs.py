"""What the matrix replays: recorded envelopes (from S3 or a JSONL file) or a small bundled prompt workload.

A `MatrixItem` is one request reduced to what a replay needs: prompt token ids, sampling contract, the token
budget, the top-k to ask for, and the recorded choice 0 when there is one (the baseline a cell is compared with).

- Envelopes: the budget is `replayer.replay.replay_budget` (the contract's ``max_tokens`` capped at the recorded
  length + 16), exactly as a single replay would use it. Envelopes that cannot be replayed are returned apart,
  each with the reason, so the report lists them instead of dropping them.
- Workload: user prompts rendered by the model's chat template (`replayer.lanes.batch_engine.render_chat`), greedy,
  ``max_tokens`` from the command line, top-5 logprobs, no recorded output (the baseline is then the
  one-at-a-time cell). The prompt file is a JSON list of strings, or of objects with ``prompt``/``text``/
  ``content`` or a ``messages`` list (the last user message is used), or an object with a ``prompts`` list (and
  optionally a ``system`` prompt, rendered before each user prompt; entries' ``id`` name the requests).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from replayer.replay import replay_budget
from replayer.selection import not_replayable_reason
from schemas import CapturedOutput, Choice, ContractError, Envelope, SamplingContract, decode_envelope

WORKLOAD_TOP_K: Final = 5

#: Used when no workload file is given and infra/workload/prompts.json is absent.
DEFAULT_PROMPTS: Final = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three uses of copper and say why copper suits each.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Describe a cat in two sentences.",
    "Give three tips for a job interview, with one sentence of reasoning for each tip.",
    "What is the difference between a list and a tuple in Python?",
)


@dataclass(frozen=True)
class MatrixItem:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingContract
    max_tokens: int
    top_k: int
    recorded: Choice | None = None
    captured_at: datetime | None = None
    source: str = "envelope"  # "envelope" | "workload"

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_token_ids)


def item_from_envelope(envelope: Envelope) -> MatrixItem:
    """A replayable envelope -> item (raise ValueError with the reason when it is not replayable)."""
    if not envelope.replayable or envelope.prompt is None or envelope.sampling is None:
        raise ValueError(not_replayable_reason(envelope))
    assert isinstance(envelope.outcome, CapturedOutput)
    choices = [c for c in envelope.outcome.choices if c.index == 0]
    if not choices:
        raise ValueError("the recorded output has no choice with index 0")
    max_tokens, top_k = replay_budget(envelope.sampling, choices[0])
    return MatrixItem(
        request_id=envelope.request_id,
        prompt_token_ids=envelope.prompt.token_ids,
        sampling=envelope.sampling,
        max_tokens=max_tokens,
        top_k=top_k,
        recorded=choices[0],
        captured_at=envelope.captured_at,
    )


def items_from_envelopes(envelopes: Iterable[Envelope]) -> tuple[list[MatrixItem], list[tuple[str, str]]]:
    """(replayable items, [(request id, why not replayable)]); duplicate request ids keep the first."""
    items: list[MatrixItem] = []
    rejected: list[tuple[str, str]] = []
    seen: set[str] = set()
    for env in envelopes:
        if env.request_id in seen:
            continue
        seen.add(env.request_id)
        try:
            items.append(item_from_envelope(env))
        except ValueError as exc:
            rejected.append((env.request_id, str(exc)))
    return items, rejected


def read_envelopes_jsonl(path: Path) -> list[Envelope]:
    """One envelope JSON per line (blank lines ignored); ContractError names the line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ContractError(f"cannot read {path}: {exc.strerror or exc}") from exc
    out = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(decode_envelope(line))
        except ContractError as exc:
            raise ContractError(f"{path}:{n}: {exc}", exc.fields) from exc
    return out


def _prompt_text(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        for key in ("prompt", "text", "content"):
            if isinstance(entry.get(key), str):
                return str(entry[key])
        messages = entry.get("messages")
        if isinstance(messages, list):
            users = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            if users and isinstance(users[-1], str):
                return str(users[-1])
    return None


@dataclass(frozen=True)
class Workload:
    prompts: tuple[str, ...]
    ids: tuple[str, ...]  # the file's ``id`` of each prompt, else its index
    system: str | None = None


def load_prompt_file(path: Path) -> Workload:
    """The prompts of a workload file (see module docstring); ValueError when the shape is not recognised."""
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read workload {path}: {exc}") from exc
    system = data.get("system") if isinstance(data, dict) and isinstance(data.get("system"), str) else None
    if isinstance(data, dict):
        data = data.get("prompts")
    if not isinstance(data, list):
        raise ValueError(f"workload {path}: expected a JSON list of prompts (or {{'prompts': [...]}})")
    prompts = [_prompt_text(e) for e in data]
    missing = [i for i, p in enumerate(prompts) if not p]
    if missing:
        raise ValueError(f"workload {path}: entries {missing[:5]} have no prompt text")
    ids = [str(e["id"]) if isinstance(e, dict) and "id" in e else f"{i:03d}" for i, e in enumerate(data)]
    return Workload(tuple(p for p in prompts if p), tuple(ids), system)


def default_workload() -> Workload:
    return Workload(DEFAULT_PROMPTS, tuple(f"{i:03d}" for i in range(len(DEFAULT_PROMPTS))))


def spread(workload: Workload, limit: int | None) -> Workload:
    """At most ``limit`` prompts spread evenly over the workload (files are often ordered short -> long)."""
    n = len(workload.prompts)
    if not limit or limit >= n:
        return workload
    picks = sorted({round(k * (n - 1) / max(1, limit - 1)) for k in range(limit)})
    return Workload(tuple(workload.prompts[i] for i in picks), tuple(workload.ids[i] for i in picks), workload.system)


def workload_items(
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    prefix: str = "workload",
    ids: Sequence[str] | None = None,
) -> list[MatrixItem]:
    """Greedy items for rendered workload prompts (no recorded output); request id ``<prefix>-<id>``."""
    sampling = SamplingContract(temperature=0.0, max_tokens=max_tokens, seed_scope="none", logprobs=WORKLOAD_TOP_K)
    names = list(ids) if ids is not None else [f"{i:03d}" for i in range(len(prompt_ids))]
    return [
        MatrixItem(
            request_id=f"{prefix}-{name}",
            prompt_token_ids=tuple(p),
            sampling=sampling,
            max_tokens=max_tokens,
            top_k=WORKLOAD_TOP_K,
            source="workload",
        )
        for name, p in zip(names, prompt_ids, strict=True)
    ]
