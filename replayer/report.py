"""The report a person reads after `reprolane replay`: what diverged, where, by how much, and a likely cause.

For one request (`render_request`): the verdict and whether the declared target level held; the runtime
fingerprint fields that differ between capture and replay; the first divergence with both top-k lists side by
side (token text, id, logprob) and the top-1/top-2 margin that tells a near tie from a confident flip; the two
texts with the fork marked ``⟦…⟧``; the largest logprob differences; the cause hint.

For a workflow (`render_workflow`): one line per step, then the first step whose target did not hold.

`fingerprint_diff_lines` is shared with the release gate's summary (`replayer.gate.replay.render_gate`), and
`ReportModel` is the base of every JSON document the replayer writes or reads for itself (the gates' and the
matrix's reports, the vendor gate's cases and assertions).

Pure: takes contract records, returns text. Token text is shown as a JSON string so whitespace is visible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from schemas import (
    CapturedOutput,
    Envelope,
    FieldDiff,
    FirstDivergence,
    ReplayResult,
    StepLogprobs,
    TopCandidate,
)


class ReportModel(BaseModel):
    """Frozen and strict about unknown fields, as the contract's `schemas.Record`, but not a contract record: a
    report's schema is its own ``schema_version``, and its statistics may be NaN."""

    model_config = ConfigDict(frozen=True, extra="forbid")


FORK_OPEN = "⟦"
FORK_CLOSE = "⟧"
_CONTEXT_CHARS = 60  # text shown before the fork
_FORK_TOKENS = 8  # tokens shown inside the fork marks


def fingerprint_diff_lines(diffs: Sequence[FieldDiff]) -> list[str]:
    """One line per differing fingerprint field, names aligned: ``  field  'recorded' → 'replayed'``."""
    width = max((len(d.field) for d in diffs), default=0)
    return [f"  {d.field.ljust(width)}  {d.recorded!r} → {d.replayed!r}" for d in diffs]


def _tok(text: str | None) -> str:
    return json.dumps(text, ensure_ascii=False) if text is not None else "?"


def _num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}g}"


def _cand(c: TopCandidate | None, texts: dict[int, str] | None = None) -> str:
    """One candidate. A recorded alternative may have been captured by id only (vLLM sends no text for
    alternatives asked as ids): its text is then taken from `texts` (same id on the other side, same tokenizer)."""
    if c is None:
        return ""
    tid = "?" if c.token_id is None else str(c.token_id)
    text: str | None = c.token
    if not text and texts is not None and c.token_id is not None:
        text = texts.get(c.token_id, text)
    return f"{_tok(text)} #{tid} {c.logprob:.4f}"


def _side_by_side(
    recorded: Sequence[TopCandidate], replayed: Sequence[TopCandidate], chosen: tuple[int | None, int | None]
) -> list[str]:
    rows = max(len(recorded), len(replayed))
    if rows == 0:
        return ["    (no top-k alternatives were recorded at this step)"]
    known = {c.token_id: c.token for c in (*replayed, *recorded) if c.token_id is not None and c.token}
    left = [_cand(c, known) for c in recorded]
    right = [_cand(c, known) for c in replayed]
    width = max([len("recorded"), *(len(s) + 2 for s in left)])
    lines = [f"    rank  {'recorded'.ljust(width)}  replayed"]
    for i in range(rows):
        rec = recorded[i] if i < len(recorded) else None
        rep = replayed[i] if i < len(replayed) else None
        lmark = "*" if rec is not None and rec.token_id is not None and rec.token_id == chosen[0] else " "
        rmark = "*" if rep is not None and rep.token_id is not None and rep.token_id == chosen[1] else " "
        ltext = (lmark + " " + left[i]) if i < len(left) else ""
        rtext = (rmark + " " + right[i]) if i < len(right) else ""
        lines.append(f"    {i + 1:>4}  {ltext.ljust(width)}  {rtext}".rstrip())
    lines.append("    (* = the token that side chose)")
    return lines


def _token_texts(token_ids: Sequence[int], steps: Sequence[StepLogprobs] | None) -> list[str] | None:
    """Per-token text when every step carries it, else None."""
    if not steps or len(steps) < len(token_ids) or any(s.token is None for s in steps[: len(token_ids)]):
        return None
    return [s.token or "" for s in steps[: len(token_ids)]]


def mark_fork(token_ids: Sequence[int], steps: Sequence[StepLogprobs] | None, position: int) -> str:
    """``…prefix⟦fork tokens⟧…``: the text up to the fork, then up to 8 tokens from it, marked."""
    texts = _token_texts(token_ids, steps)
    if texts is None:  # no token text: show ids
        before_ids = " ".join(str(t) for t in token_ids[max(0, position - 8) : position])
        fork_ids = " ".join(str(t) for t in token_ids[position : position + _FORK_TOKENS])
        lead = "…" if position > 8 else ""
        tail = "…" if len(token_ids) > position + _FORK_TOKENS else ""
        return f"[ids] {lead}{before_ids} {FORK_OPEN}{fork_ids}{FORK_CLOSE}{tail}".replace("  ", " ")
    before = "".join(texts[:position])
    fork = "".join(texts[position : position + _FORK_TOKENS])
    lead = "…" if len(before) > _CONTEXT_CHARS else ""
    tail = "…" if len(texts) > position + _FORK_TOKENS else ""
    body = f"{lead}{before[-_CONTEXT_CHARS:]}{FORK_OPEN}{fork}{FORK_CLOSE}{tail}"
    return body.replace("\n", "⏎")


@dataclass(frozen=True)
class _Recorded:
    token_ids: tuple[int, ...]
    steps: tuple[StepLogprobs, ...] | None
    text: str


def _recorded(envelope: Envelope) -> _Recorded | None:
    if not isinstance(envelope.outcome, CapturedOutput):
        return None
    choice = envelope.outcome.choices[0]
    return _Recorded(choice.token_ids, choice.logprobs, choice.text)


def _divergence_lines(first: FirstDivergence, rec: _Recorded | None, result: ReplayResult) -> list[str]:
    at = first.at
    margin = at.recorded_margin
    if first.near_tie:
        kind = f"near tie (recorded top-1/top-2 margin {_num(margin)})"
    elif margin is not None:
        kind = f"confident flip (recorded top-1/top-2 margin {_num(margin)})"
    else:
        kind = "no recorded margin (fewer than two alternatives were recorded)"
    lines = [
        f"First divergence: generated token {first.position}, {kind}",
        f"  recorded chose #{at.recorded_token_id}, replayed chose #{at.replayed_token_id};"
        f" replayed margin {_num(at.replayed_margin)}",
        *_side_by_side(at.recorded_top, at.replayed_top, (at.recorded_token_id, at.replayed_token_id)),
    ]
    if first.before is not None:
        b = first.before
        lines.append(
            f"  step before (token {b.position}): recorded margin {_num(b.recorded_margin)},"
            f" replayed margin {_num(b.replayed_margin)}"
        )
    replayed = result.replayed
    lines.append("Text (fork marked):")
    if rec is not None:
        lines.append(f"  recorded: {mark_fork(rec.token_ids, rec.steps, first.position)}")
    lines.append(f"  replayed: {mark_fork(replayed.token_ids, replayed.logprobs, first.position)}")
    return lines


def render_divergence(envelope: Envelope, result: ReplayResult) -> str:
    """Only the first-divergence block of `render_request` (top-k side by side, texts with the fork marked).

    Empty when the token ids are identical. For summaries that list several divergences (``reprolane demo``).
    """
    first = result.event.first_divergence
    if first is None:
        return ""
    return "\n".join(_divergence_lines(first, _recorded(envelope), result)) + "\n"


def render_request(envelope: Envelope, result: ReplayResult) -> str:
    """The report for one replayed request (see module docstring)."""
    ev = result.event
    rec = _recorded(envelope)
    held = ", ".join(ev.levels_held) or "none"
    met = "met" if ev.target_met else "NOT MET"
    lines = [
        f"Replay of request {ev.request_id} (envelope {ev.envelope_id[:16]}…) on lane {ev.lane}",
        f"  captured {envelope.captured_at.isoformat()} by {envelope.runtime.engine}"
        f" {envelope.runtime.engine_version or ''}".rstrip()
        + (f"; workflow {ev.workflow_id} step {ev.workflow_step}" if ev.workflow_id else ""),
        f"Verdict: {ev.verdict}   target level: {ev.target_level} — {met}   (levels held: {held})",
        f"Cause: {ev.cause_hint}" + (f" — {ev.cause_detail}" if ev.cause_detail else ""),
    ]
    if ev.schedule_reproduced is not None:
        lines.append(
            "Schedule: the recorded batch shapes were reproduced step for step"
            if ev.schedule_reproduced
            else "Schedule: NOT reproduced"
            + (
                f" (first mismatching step {ev.schedule_mismatch_step})"
                if ev.schedule_mismatch_step is not None
                else ""
            )
        )
    if ev.fingerprint_diffs:
        lines.append("Runtime fingerprint fields that differ (recorded → replayed):")
        lines.extend(fingerprint_diff_lines(ev.fingerprint_diffs))
    else:
        lines.append("Runtime fingerprint: no known field differs from the recorded one")
    if ev.first_divergence is not None:
        lines.extend(_divergence_lines(ev.first_divergence, rec, result))
    else:
        lines.append("Token ids: identical")
    lines.append(
        f"Max logprob difference over the common prefix: |Δ| {_num(ev.max_abs_logprob_diff)},"
        f" relative {_num(ev.max_rel_logprob_diff)}"
    )
    lines.append(
        f"Tokens: recorded {ev.recorded_length}, replayed {ev.replayed_length}"
        f" (length diff {ev.length_diff:+d}), match rate {ev.token_match_rate:.3f}"
    )
    if ev.semantic_similarity is not None:
        lines.append(f"Semantic similarity: {ev.semantic_similarity:.4f}")
    lines.append(f"Replay took {ev.replay_ms:.1f} ms; result id {ev.result_id()[:16]}…")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class WorkflowStep:
    """One step of a workflow replay: a result, or the reason it could not be replayed."""

    envelope: Envelope
    result: ReplayResult | None
    skipped: str | None = None


def first_diverging(steps: Sequence[WorkflowStep]) -> WorkflowStep | None:
    """The first step whose target level did not hold."""
    return next((s for s in steps if s.result is not None and not s.result.event.target_met), None)


def render_workflow(workflow_id: str, steps: Sequence[WorkflowStep]) -> str:
    """One line per step, then the first step whose target did not hold and where it forked."""
    lines = [f"Workflow {workflow_id}: {len(steps)} recorded step(s)"]
    for s in steps:
        step = s.envelope.workflow.step if s.envelope.workflow else -1
        head = f"  step {step:>3}  {s.envelope.request_id}"
        if s.result is None:
            lines.append(f"{head}  skipped: {s.skipped}")
            continue
        ev = s.result.event
        where = f", first divergence at token {ev.first_divergence.position}" if ev.first_divergence else ""
        met = "met" if ev.target_met else "NOT MET"
        lines.append(f"{head}  {ev.verdict} (target {ev.target_level} {met}{where})")
    first = first_diverging(steps)
    if first is None or first.result is None:
        lines.append("Every replayed step met its target level.")
        return "\n".join(lines) + "\n"
    step = first.envelope.workflow.step if first.envelope.workflow else -1
    lines.append(f"First diverging step: {step} (request {first.envelope.request_id})")
    lines.append("")
    lines.append(render_request(first.envelope, first.result).rstrip("\n"))
    return "\n".join(lines) + "\n"
