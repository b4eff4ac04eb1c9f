"""A replay as an auditor reads it: the text with the fork marked, the top-k tables, the per-token differences.

Pure: from an envelope's recorded choice 0 and a `schemas.ReplayResult` to plain values a template prints
(nothing here escapes HTML: the templates do, every value is text). The fork is the event's first divergence
(`schemas.replay.FirstDivergence`): the text is cut into the common prefix, the token where the two differ and
the rest, for the recorded and the replayed side, using each step's own token text where the lane gave it (so
the cut is where the tokens are), else the decoded text's common character prefix. A top-k candidate the
capture kept as an id only is spelled with the recorded tokenizer when the caller has it (`infra.console.tokens`).

The logprob difference per token is the recorded minus the replayed logprob of the token each side chose; from
the fork on the two sides chose different tokens, so the plot marks the fork and the values after it compare
different tokens (the chart says so).

A shadow pair (`shadow_view`: production's answer and a candidate's, `capture.request.shadow`) is read the same way,
production in the recorded place and the candidate in the replayed one; the comparison is the shadow report's
(`replayer.gate.shadow.compare_shadow`), never a second one written here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from replayer.gate.shadow import ShadowPair, compare_shadow
from replayer.settings import Thresholds
from schemas import Choice, Envelope, FieldDiff, ReplayResult, StepLogprobs, TopCandidate, diff_fingerprints
from schemas.replay import FirstDivergence, StepCandidates

Spell = Callable[[int], str]
"""Token id -> its text, with the tokenizer the envelope was recorded with."""


@dataclass(frozen=True)
class TextCut:
    """A text cut at the fork: ``before`` is shared, ``at`` is this side's forking token, ``after`` the rest."""

    before: str
    at: str
    after: str


@dataclass(frozen=True)
class TopRow:
    rank: int
    recorded: str
    recorded_logprob: float | None
    replayed: str
    replayed_logprob: float | None


@dataclass(frozen=True)
class TopTable:
    title: str
    position: int
    recorded_token: str
    replayed_token: str
    recorded_margin: float | None
    replayed_margin: float | None
    rows: list[TopRow]


@dataclass(frozen=True)
class ReplayView:
    result: ReplayResult
    recorded: TextCut | None
    replayed: TextCut | None
    tables: list[TopTable]
    positions: list[int]
    logprob_diffs: list[float]
    fork: int | None


def recorded_choice(envelope: Envelope) -> Choice | None:
    outcome = envelope.outcome
    if outcome.kind == "output":
        return outcome.choices[0]
    return outcome.partial[0] if outcome.partial else None


def _token_texts(steps: tuple[StepLogprobs, ...] | None, spell: Spell | None) -> list[str] | None:
    """Each step's token text (an empty one spelled by `spell`), or None when some step has none."""
    if not steps or any(s.token is None for s in steps):
        return None
    return [s.token or (spell(s.token_id) if spell is not None else "") for s in steps]


def _cut_tokens(tokens: list[str], fork: int) -> TextCut:
    return TextCut("".join(tokens[:fork]), "".join(tokens[fork : fork + 1]), "".join(tokens[fork + 1 :]))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def cut_at_fork(recorded: Choice, result: ReplayResult, spell: Spell | None = None) -> tuple[TextCut, TextCut] | None:
    """Both texts cut at the fork, or None when the replay did not fork."""
    return _cut(recorded, result.event.first_divergence, result.replayed.logprobs, result.replayed.text, spell)


def _cut(
    recorded: Choice,
    first: FirstDivergence | None,
    other_steps: tuple[StepLogprobs, ...] | None,
    other_text: str,
    spell: Spell | None,
) -> tuple[TextCut, TextCut] | None:
    if first is None:
        return None
    fork = first.position
    rec_tokens, rep_tokens = _token_texts(recorded.logprobs, spell), _token_texts(other_steps, spell)
    if rec_tokens is not None and rep_tokens is not None:
        return _cut_tokens(rec_tokens, fork), _cut_tokens(rep_tokens, fork)
    rec, rep = recorded.text, other_text
    n = _common_prefix(rec, rep)
    return TextCut(rec[:n], rec[n : n + 1], rec[n + 1 :]), TextCut(rep[:n], rep[n : n + 1], rep[n + 1 :])


def _label(candidate: TopCandidate | None, spell: Spell | None) -> str:
    """``'text' (id)``: the candidate's own text, else the id decoded by `spell` (the recorded tokenizer)."""
    if candidate is None:
        return ""
    text = candidate.token
    if not text and spell is not None and candidate.token_id is not None:
        text = spell(candidate.token_id)
    return f"{text!r} ({candidate.token_id})" if candidate.token_id is not None else repr(text)


def _token_label(token_id: int | None, top: tuple[TopCandidate, ...], spell: Spell | None) -> str:
    if token_id is None:
        return "(none)"
    for candidate in top:
        if candidate.token_id == token_id:
            return _label(candidate, spell)
    return _label(TopCandidate(token="", token_id=token_id, logprob=0.0), spell)


def top_table(title: str, step: StepCandidates, spell: Spell | None = None) -> TopTable:
    """The recorded and replayed top-k of one step side by side, by rank."""
    rec = sorted(step.recorded_top, key=lambda c: c.rank or 0)
    rep = sorted(step.replayed_top, key=lambda c: c.rank or 0)
    rows = []
    for i in range(max(len(rec), len(rep))):
        a = rec[i] if i < len(rec) else None
        b = rep[i] if i < len(rep) else None
        a_logprob, b_logprob = (a.logprob if a else None), (b.logprob if b else None)
        rows.append(TopRow(i + 1, _label(a, spell), a_logprob, _label(b, spell), b_logprob))
    return TopTable(
        title,
        step.position,
        _token_label(step.recorded_token_id, step.recorded_top, spell),
        _token_label(step.replayed_token_id, step.replayed_top, spell),
        step.recorded_margin,
        step.replayed_margin,
        rows,
    )


def logprob_diffs(recorded: Choice, result: ReplayResult) -> tuple[list[int], list[float]]:
    """Per generated position: recorded minus replayed logprob of each side's chosen token (common length)."""
    return _diffs(recorded.logprobs, result.replayed.logprobs)


def _diffs(
    recorded: tuple[StepLogprobs, ...] | None, other: tuple[StepLogprobs, ...] | None
) -> tuple[list[int], list[float]]:
    rec, rep = recorded or (), other or ()
    n = min(len(rec), len(rep))
    return list(range(n)), [rec[i].logprob - rep[i].logprob for i in range(n)]


def _fork_tables(first: FirstDivergence | None, spell: Spell | None) -> list[TopTable]:
    tables = []
    if first is not None:
        if first.before is not None:
            tables.append(top_table("the step before the fork", first.before, spell))
        tables.append(top_table("at the fork", first.at, spell))
    return tables


def replay_view(envelope: Envelope, result: ReplayResult, spell: Spell | None = None) -> ReplayView:
    """`spell`: token id -> text with the tokenizer the envelope was recorded with (None: ids only)."""
    recorded = recorded_choice(envelope)
    first = result.event.first_divergence
    tables = _fork_tables(first, spell)
    cuts = cut_at_fork(recorded, result, spell) if recorded is not None else None
    positions, diffs = logprob_diffs(recorded, result) if recorded is not None else ([], [])
    return ReplayView(
        result,
        cuts[0] if cuts else None,
        cuts[1] if cuts else None,
        tables,
        positions,
        diffs,
        first.position if first is not None else None,
    )


@dataclass(frozen=True)
class ShadowView:
    """A production answer and its candidate's shadow (`capture.request.shadow`), compared as the shadow report compares
    them (`replayer.gate.shadow.compare_shadow`, i.e. `replayer.compare`): here "recorded" is production and
    "replayed" is the candidate."""

    shadow: Envelope
    candidate: str
    pair: ShadowPair
    runtime_diffs: tuple[FieldDiff, ...]
    production: TextCut | None
    candidate_cut: TextCut | None
    tables: list[TopTable]
    positions: list[int]
    logprob_diffs: list[float]
    fork: int | None


def shadow_view(
    production: Envelope, shadow: Envelope, thresholds: Thresholds, spell: Spell | None = None
) -> ShadowView | None:
    """The pair's view, judged at production's target level without semantic similarity (a page view does not
    load the embedding model: ``reprolane release gate --shadow`` computes it); None when production has no output to
    compare (the sidecar shadows none of those)."""
    recorded = recorded_choice(production)
    if production.outcome.kind != "output" or recorded is None or shadow.shadow is None:
        return None
    pair, comparison = compare_shadow(production, shadow, thresholds)
    first = comparison.first_divergence if comparison is not None else None
    cand = recorded_choice(shadow) if shadow.outcome.kind == "output" else None
    cuts = _cut(recorded, first, cand.logprobs, cand.text, spell) if cand is not None else None
    positions, diffs = _diffs(recorded.logprobs, cand.logprobs) if cand is not None else ([], [])
    return ShadowView(
        shadow,
        shadow.shadow.candidate,
        pair,
        diff_fingerprints(production.runtime, shadow.runtime, include_unknown=True),
        cuts[0] if cuts else None,
        cuts[1] if cuts else None,
        _fork_tables(first, spell),
        positions,
        diffs,
        first.position if first is not None else None,
    )
