"""The shadow report: production vs candidate over the paired envelopes of a time window (`capture.request.shadow`).

    reprolane release gate --shadow --since T [--until T] [--level LEVEL] [--min-pass-rate R] [--min-similarity S]
                   [--max-length-change L] [--max-finish-shift F] [--report FILE.json]

Pairs come from the audit bucket: every shadow index entry of the window's days whose capture time is in the
window (`replayer.store.EnvelopeStore.shadow_index`), its shadow envelope, and the production envelope of the
same request id, which must be the one the shadow names (``shadow.production_envelope_id``). A shadow whose
production envelope is missing or another one is *unpaired* and named.

Each pair is judged twice:

- **per request, at its declared level** (the production envelope's ``target_level``, or ``--level`` for all)
  with the replayer's comparison (`replayer.compare`): candidate choice 0 against production choice 0, with the
  semantic similarity of their texts (`replayer.semantic`), so every level can be judged (the semantic level
  at ``min_similarity``, the one similarity bar of the report);
- **as distributions**, because under dynamic batching token identity cannot be expected even of an unchanged
  server: semantic similarity (mean, 10th percentile, minimum), output length (mean relative change), finish
  reasons (each side's counts; their total variation distance) and first-divergence positions (percentiles).

The rule (written into every report as ``rule``): the window **passes** when it has at least one pair and

1. the candidate answered every shadow request (candidate errors and timeouts: 0);
2. the share of pairs that met their level is at least ``min_pass_rate`` (default 1.0, as the release gate;
   a candidate known to batch is judged with ``--level semantic`` or a lower rate);
3. the 10th percentile of semantic similarity is at least ``min_similarity``;
4. the mean relative length change ``|len(c) - len(p)| / max(len(p), 1)`` is at most ``max_length_change``;
5. the total variation distance of the finish-reason distributions is at most ``max_finish_shift``.

Each rule that fails is named in ``failures`` with its figures, the worst pairs are shown, and the runtime
fields in which candidate and production differ are listed. Exit codes are the gate's: 0 pass, 1 fail, 2 no
verdict (no pair in the window, S3 unavailable, bad input).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from replayer.compare import Comparison, compare
from replayer.errors import EnvelopeNotFoundError, GateInputError
from replayer.gate.replay import short_text
from replayer.report import ReportModel
from replayer.settings import Thresholds
from replayer.store import EnvelopeStore
from schemas import CapturedError, CapturedOutput, Envelope, FieldDiff, ReplayedOutput, ReproLevel, diff_fingerprints
from schemas.layout import capture_day

__all__ = [
    "SHADOW_REPORT_VERSION",
    "ShadowPair",
    "ShadowReport",
    "compare_shadow",
    "load_pairs",
    "render_shadow",
    "shadow_gate",
]

SHADOW_REPORT_VERSION: Final = "reprolane.shadow-gate/1"
SimilarityFn = Callable[[str, str], float]
_WORST_SHOWN = 5
_MAX_DAYS = 31


class ShadowPair(ReportModel):
    """One production envelope and its candidate's shadow, compared."""

    request_id: str
    production_envelope_id: str
    shadow_envelope_id: str
    level: ReproLevel
    target_met: bool
    verdict: str = Field(description="strictest level held, 'diverged', or 'candidate_error'")
    levels_held: tuple[ReproLevel, ...] = ()
    first_divergence: int | None = None
    near_tie: bool | None = None
    max_abs_logprob_diff: float | None = None
    token_match_rate: float | None = None
    semantic_similarity: float | None = None
    production_length: int
    candidate_length: int | None = None
    production_finish: str | None = None
    candidate_finish: str | None = None
    candidate_error: str | None = None
    production_text: str
    candidate_text: str | None = None


class Spread(ReportModel):
    """A distribution in a few numbers (None when it has no values)."""

    n: int
    mean: float | None = None
    p10: float | None = None
    p50: float | None = None
    p90: float | None = None
    min: float | None = None
    max: float | None = None


class ShadowBars(BaseModel):
    """The bars of the rule (see the module docstring), as ``--min-pass-rate`` and the others set them; every
    report repeats them next to its figures."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    min_pass_rate: float = 1.0
    min_similarity: float = 0.8
    max_length_change: float = 0.25
    max_finish_shift: float = 0.1


class ShadowReport(ReportModel):
    """The shadow gate's verdict on one window, as ``--report`` writes it: ``since`` and ``until`` bound the shadows'
    capture times (both included), ``rule`` is the rule applied, in words, and ``failures`` names each part of it
    that failed, with its figures."""

    schema_version: Literal["reprolane.shadow-gate/1"] = SHADOW_REPORT_VERSION
    mode: Literal["shadow"] = "shadow"
    since: datetime
    until: datetime
    rule: str
    level_override: ReproLevel | None = None
    min_pass_rate: float
    min_similarity: float
    max_length_change: float
    max_finish_shift: float
    candidates: tuple[str, ...]
    changed_fields: tuple[FieldDiff, ...] = Field(description="runtime fields where candidate and production differ")
    pairs: int
    unpaired: tuple[tuple[str, str], ...] = Field(default=(), description="(request_id, why) of shadows without pair")
    candidate_errors: int
    passed: int
    pass_rate: float | None
    token_identical: int
    similarity: Spread
    length_change: Spread
    first_divergence: Spread
    production_finish: dict[str, int]
    candidate_finish: dict[str, int]
    finish_shift: float | None
    failures: tuple[str, ...]
    gate_passed: bool
    results: tuple[ShadowPair, ...] = ()
    started_at: datetime
    finished_at: datetime


RULE: Final = (
    "pass when there is at least one pair and: candidate errors == 0; share meeting their level >= min_pass_rate; "
    "p10 semantic similarity >= min_similarity; mean relative length change <= max_length_change; finish-reason "
    "total variation distance <= max_finish_shift"
)


def _days(since: datetime, until: datetime) -> list[str]:
    if until < since:
        raise GateInputError("--until is before --since")
    first, last = since.astimezone(UTC).date(), until.astimezone(UTC).date()
    count = (last - first).days + 1
    if count > _MAX_DAYS:
        raise GateInputError(f"a shadow window spans at most {_MAX_DAYS} days, not {count}")
    return [capture_day(datetime(first.year, first.month, first.day, tzinfo=UTC) + timedelta(days=i))
            for i in range(count)]  # fmt: skip


def _at(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def load_pairs(
    store: EnvelopeStore, since: datetime, until: datetime
) -> tuple[list[tuple[Envelope, Envelope]], list[tuple[str, str]]]:
    """(production, shadow) pairs of the window, and the shadows without their production envelope."""
    pairs: list[tuple[Envelope, Envelope]] = []
    unpaired: list[tuple[str, str]] = []
    for day in _days(since, until):
        for key, request_id, captured in store.shadow_index(day):
            at = _at(captured)
            if at is None or not since <= at <= until:
                continue
            shadow = store.get_shadow(key, request_id)
            assert shadow.shadow is not None
            try:
                production = store.get_by_request_id(request_id)
            except EnvelopeNotFoundError as exc:
                unpaired.append((request_id, f"no production envelope: {exc}"))
                continue
            if production.envelope_id() != shadow.shadow.production_envelope_id:
                unpaired.append((request_id, "the production envelope is not the one the shadow names"))
                continue
            pairs.append((production, shadow))
    return pairs, unpaired


def _spread(values: Sequence[float]) -> Spread:
    if not values:
        return Spread(n=0)
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]

    return Spread(n=len(values), mean=statistics.fmean(values), p10=pct(0.1), p50=pct(0.5), p90=pct(0.9),
                  min=ordered[0], max=ordered[-1])  # fmt: skip


def compare_shadow(
    production: Envelope,
    shadow: Envelope,
    thresholds: Thresholds,
    level: ReproLevel | None = None,
    similarity: SimilarityFn | None = None,
) -> tuple[ShadowPair, Comparison | None]:
    """One pair judged as the report judges it, and the comparison itself (its fork's top-k, for the console;
    None when the candidate answered an error). `production` must have an output (`shadow_gate` keeps only
    those; the sidecar shadows no other). Without `similarity` none is computed (a page view cannot load the
    embedding model): the semantic level is then held by token-identical outputs only."""
    if not isinstance(production.outcome, CapturedOutput):
        raise GateInputError(f"{production.request_id}: production answered an error, there is nothing to compare")
    recorded = production.outcome.choices[0]
    judged = level or production.target_level
    common = {
        "request_id": production.request_id,
        "production_envelope_id": production.envelope_id(),
        "shadow_envelope_id": shadow.envelope_id(),
        "level": judged,
        "production_length": len(recorded.token_ids),
        "production_finish": recorded.finish_reason,
        "production_text": recorded.text,
    }
    if isinstance(shadow.outcome, CapturedError):
        message = f"{shadow.outcome.error_type}: {shadow.outcome.message}"[:300]
        return ShadowPair(**common, target_met=False, verdict="candidate_error", candidate_error=message), None
    cand = shadow.outcome.choices[0]
    sim = similarity(recorded.text, cand.text) if similarity is not None else None
    replayed = ReplayedOutput(token_ids=cand.token_ids, text=cand.text, logprobs=cand.logprobs,
                              finish_reason=cand.finish_reason)  # fmt: skip
    result = compare(recorded, replayed, thresholds, judged, semantic_similarity=sim)
    first = result.first_divergence
    pair = ShadowPair(
        **common,
        target_met=result.target_met,
        verdict=result.verdict,
        levels_held=result.levels_held,
        first_divergence=None if first is None else first.position,
        near_tie=None if first is None else first.near_tie,
        max_abs_logprob_diff=result.max_abs_logprob_diff,
        token_match_rate=result.token_match_rate,
        semantic_similarity=sim,
        candidate_length=len(cand.token_ids),
        candidate_finish=cand.finish_reason,
        candidate_text=cand.text,
    )
    return pair, result


def _tv_distance(a: Counter[str], b: Counter[str]) -> float | None:
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return None
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def shadow_gate(
    pairs: Sequence[tuple[Envelope, Envelope]],
    unpaired: Sequence[tuple[str, str]],
    *,
    since: datetime,
    until: datetime,
    similarity: SimilarityFn,
    thresholds: Thresholds | None = None,
    level: ReproLevel | None = None,
    bars: ShadowBars | None = None,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> ShadowReport:
    """Judge the pairs (see the module docstring) against ``bars`` (`ShadowBars`' defaults when None);
    `GateInputError` when there is none (no verdict)."""
    started = now()
    bars = bars or ShadowBars()
    judged = [(p, s) for p, s in pairs if isinstance(p.outcome, CapturedOutput)]
    if not judged:
        raise GateInputError(f"no shadow pair between {since.isoformat()} and {until.isoformat()}"
                             + (f" ({len(unpaired)} unpaired)" if unpaired else ""))  # fmt: skip
    # one similarity bar: a pair judged at the semantic level holds it at min_similarity, like the distribution
    th = (thresholds or Thresholds()).model_copy(update={"semantic_min_similarity": bars.min_similarity})
    results = [compare_shadow(p, s, th, level, similarity)[0] for p, s in judged]
    answered = [r for r in results if r.candidate_error is None]
    errors = len(results) - len(answered)
    passed = sum(r.target_met for r in results)
    rate = passed / len(results)
    sims = [r.semantic_similarity for r in answered if r.semantic_similarity is not None]
    changes = [abs((r.candidate_length or 0) - r.production_length) / max(r.production_length, 1) for r in answered]
    forks = [float(r.first_divergence) for r in answered if r.first_divergence is not None]
    fin_p = Counter(r.production_finish or "none" for r in answered)
    fin_c = Counter(r.candidate_finish or "none" for r in answered)
    shift = _tv_distance(fin_p, fin_c)
    sim_spread, change_spread = _spread(sims), _spread(changes)
    failures: list[str] = []
    if errors:
        failures.append(f"candidate errors: {errors} of {len(results)} shadow request(s) got no answer")
    if rate < bars.min_pass_rate:
        failures.append(
            f"per request: {passed}/{len(results)} met their level (rate {rate:.3f} < {bars.min_pass_rate:.3f})"
        )
    if sim_spread.p10 is not None and sim_spread.p10 < bars.min_similarity:
        failures.append(f"semantic similarity: p10 {sim_spread.p10:.3f} < {bars.min_similarity:.3f}"
                        f" (mean {sim_spread.mean:.3f}, min {sim_spread.min:.3f})")  # fmt: skip
    if change_spread.mean is not None and change_spread.mean > bars.max_length_change:
        failures.append(f"length: mean relative change {change_spread.mean:.3f} > {bars.max_length_change:.3f}")
    if shift is not None and shift > bars.max_finish_shift:
        failures.append(f"finish reasons: total variation {shift:.3f} > {bars.max_finish_shift:.3f}"
                        f" (production {dict(fin_p)}, candidate {dict(fin_c)})")  # fmt: skip
    prod_runtime, cand_runtime = judged[0][0].runtime, judged[0][1].runtime
    return ShadowReport(
        since=since, until=until, rule=RULE, level_override=level, **bars.model_dump(),
        candidates=tuple(sorted({s.shadow.candidate for _, s in judged if s.shadow is not None})),
        changed_fields=diff_fingerprints(prod_runtime, cand_runtime, include_unknown=True),
        pairs=len(results), unpaired=tuple(unpaired), candidate_errors=errors, passed=passed, pass_rate=rate,
        token_identical=sum(r.token_match_rate == 1.0 and r.candidate_length == r.production_length for r in answered),
        similarity=sim_spread, length_change=change_spread, first_divergence=_spread(forks),
        production_finish=dict(fin_p), candidate_finish=dict(fin_c), finish_shift=shift,
        failures=tuple(failures), gate_passed=not failures, results=tuple(results), started_at=started,
        finished_at=now(),
    )  # fmt: skip


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def render_shadow(report: ShadowReport) -> str:
    """The summary a person reads: verdict, the rule, failures, distributions, the worst pairs."""
    status = "PASS" if report.gate_passed else "FAIL"
    rate = _fmt(report.pass_rate)
    lines = [
        f"Shadow gate: {status} — {report.pairs} pair(s) from {report.since.isoformat()} to {report.until.isoformat()}",
        f"  candidate(s) {', '.join(report.candidates)}; rule: {report.rule}",
    ]
    if report.changed_fields:
        lines.append(
            "Candidate runtime differs from production in: "
            + ", ".join(f"{d.field} {d.recorded!r} → {d.replayed!r}" for d in report.changed_fields)
        )
    lines.append(
        f"Per request: {report.passed}/{report.pairs} met their level (rate {rate}, required"
        f" {report.min_pass_rate:.3f}); token-identical {report.token_identical}; candidate errors"
        f" {report.candidate_errors}"
    )
    s, lc, fd = report.similarity, report.length_change, report.first_divergence
    lines.append(
        f"Semantic similarity: mean {_fmt(s.mean)}, p10 {_fmt(s.p10)}, min {_fmt(s.min)}"
        f" (required p10 >= {report.min_similarity:.3f})"
    )
    lines.append(
        f"Length change: mean {_fmt(lc.mean)}, max {_fmt(lc.max)} (allowed mean <= {report.max_length_change:.3f})"
    )
    lines.append(
        f"Finish reasons: production {report.production_finish}, candidate {report.candidate_finish}"
        f" (total variation {_fmt(report.finish_shift)}, allowed <= {report.max_finish_shift:.3f})"
    )
    lines.append(
        f"First divergence: {fd.n} pair(s) diverged; position p10 {_fmt(fd.p10)}, p50 {_fmt(fd.p50)},"
        f" p90 {_fmt(fd.p90)}"
    )
    if report.unpaired:
        lines.append(f"Unpaired shadows: {len(report.unpaired)}")
        lines.extend(f"  {rid}: {why}" for rid, why in report.unpaired[:_WORST_SHOWN])
    if report.failures:
        lines.append("Failed:")
        lines.extend(f"  {f}" for f in report.failures)
    worst = sorted(
        (r for r in report.results if not r.target_met),
        key=lambda r: (r.semantic_similarity if r.semantic_similarity is not None else -2.0, r.first_divergence or 0),
    )[:_WORST_SHOWN]
    if worst:
        lines.append("Worst pairs:")
        for r in worst:
            if r.candidate_error is not None:
                lines.append(f"  {r.request_id}: candidate error: {r.candidate_error}")
                continue
            where = f"first divergence at token {r.first_divergence}" if r.first_divergence is not None else "no fork"
            lines.append(
                f"  {r.request_id}: {r.verdict}, level {r.level} NOT MET, {where},"
                f" similarity {_fmt(r.semantic_similarity)}, lengths {r.production_length}/{r.candidate_length}"
            )
            lines.append(f"    production {short_text(r.production_text)}")
            lines.append(f"    candidate  {short_text(r.candidate_text)}")
    return "\n".join(lines) + "\n"
