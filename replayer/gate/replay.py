"""The release gate: any change of the environment fingerprint replays the golden set before the change ships.

    reprolane release gate --baseline A --candidate B --golden SET [--lane L] [--level LEVEL] [--min-pass-rate R]
                   [--always-replay] [--report FILE.json]

Inputs (parsed by the CLI, ``infra.release.gate_cli``; this module takes records):

- **golden set** (`replayer.gate.golden`): envelopes, each with the baseline's recorded output and its declared
  ``target_level``.
- **baseline** A: an `schemas.EnvironmentFingerprint` (``reprolane release fingerprint -o A.json``), or ``golden`` = the
  environment recorded in the golden envelopes themselves (`replayer.gate.golden.golden_environment`).
- **candidate** B: an `EnvironmentFingerprint` of the candidate plus the lane that executes it, or ``local`` =
  the artifacts of the lane's model folder plus the runtime fingerprint the started lane reports.

Logic (`run_gate`, pure given a lane):

1. ``changed = diff_environments(A, B)`` (unknown values count as changes: a candidate that cannot say its CUDA
   version does not pass by omission). Nothing changed and no ``always_replay`` -> the gate **passes without
   replay** (no lane is started).
2. Otherwise every golden envelope is replayed on the candidate lane (`replayer.replay.replay_envelope`) and
   judged at its declared level, or at ``level`` for all when given. An envelope the lane cannot replay
   (`NotReplayableError`: e.g. logit_bias on the transformers lane) counts as not passed, with the reason.
3. The gate passes when ``passed / total >= min_pass_rate`` (default 1.0: every envelope must meet its level).

The output is a `GateReport` (machine-readable JSON for CI: both fingerprints and their sha256, the changed
fields, one `EnvelopeVerdict` per envelope with its first divergence, totals) and `render_gate` (the summary a
person reads: changed fields, counts, the worst divergences with their first position). Exit codes are the
CLI's: 0 pass, 1 fail, 2 no verdict (bad input, lane or store unavailable).

A divergence is a result here too: `LaneUnavailableError` propagates (no verdict), `NotReplayableError` is a
per-envelope failure.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final, Literal

from pydantic import Field

from replayer.errors import NotReplayableError
from replayer.gate.golden import GoldenSet
from replayer.lanes.base import Lane
from replayer.replay import replay_envelope
from replayer.report import ReportModel, fingerprint_diff_lines
from replayer.settings import ReplayerSettings
from schemas import Envelope, EnvironmentFingerprint, FieldDiff, ReplayResult, ReproLevel, diff_environments
from schemas.known_good import KnownGoodEnvironment

__all__ = ["GATE_REPORT_VERSION", "EnvelopeVerdict", "GateReport", "render_gate", "run_gate"]

GATE_REPORT_VERSION: Final = "reprolane.gate/1"
ReplayFn = Callable[[Envelope, Lane, ReplayerSettings], ReplayResult]
_WORST_SHOWN = 5


class EnvelopeVerdict(ReportModel):
    """One golden envelope replayed on the candidate (or the reason it could not be)."""

    request_id: str
    envelope_id: str
    level: ReproLevel = Field(description="the level judged: --level, else the envelope's target_level")
    target_met: bool
    verdict: str = Field(description="strictest level held, 'diverged', or 'not_replayable'")
    levels_held: tuple[ReproLevel, ...] = ()
    first_divergence: int | None = Field(default=None, description="index of the first differing token")
    near_tie: bool | None = None
    max_abs_logprob_diff: float | None = None
    token_match_rate: float | None = None
    recorded_length: int | None = None
    replayed_length: int | None = None
    semantic_similarity: float | None = None
    cause_hint: str | None = None
    detail: str = ""
    recorded_text: str | None = None
    replayed_text: str | None = None


class GateReport(ReportModel):
    """The replay gate's verdict, as ``--report`` writes it for CI: both environments with their sha256 and the
    fields that changed, one `EnvelopeVerdict` per golden envelope, the totals, and the deployment's known-good
    record (a pass) or rollback target (a fail)."""

    schema_version: Literal["reprolane.gate/1"] = GATE_REPORT_VERSION
    mode: Literal["replay"] = "replay"
    golden: str
    baseline: EnvironmentFingerprint
    candidate: EnvironmentFingerprint
    baseline_sha256: str
    candidate_sha256: str
    changed_fields: tuple[FieldDiff, ...]
    replayed: bool
    reason: str
    lane: str | None = None
    lane_fingerprint_sha256: str | None = None
    level_override: ReproLevel | None = None
    min_pass_rate: float
    total: int
    passed: int
    failed: int
    not_replayable: int
    excluded: tuple[tuple[str, str], ...] = Field(default=(), description="(request_id, reason) left out of the set")
    pass_rate: float | None
    gate_passed: bool
    results: tuple[EnvelopeVerdict, ...] = ()
    started_at: datetime
    finished_at: datetime
    deployment: str | None = Field(default=None, description="whose known-good history the gate used")
    known_good_key: str | None = Field(default=None, description="a pass: where its known-good record was written")
    rollback: KnownGoodEnvironment | None = Field(
        default=None, description="a fail: the deployment's last known-good environment, what to roll back to"
    )


#: The members of a verdict that are the divergence event's own, under the same names.
_FROM_EVENT: Final = (
    *("request_id", "envelope_id", "verdict", "levels_held", "max_abs_logprob_diff", "token_match_rate"),
    *("recorded_length", "replayed_length", "semantic_similarity", "cause_hint"),
)


def _worker_global_sample(env: Envelope) -> bool:
    s = env.sampling
    return s is not None and s.unseeded


def _verdict(env: Envelope, result: ReplayResult, level: ReproLevel | None) -> EnvelopeVerdict:
    ev = result.event
    judged = level or env.target_level
    # With an override the level is re-judged from the levels that held; an unreplayable RNG stays unmet.
    met = ev.target_met if level is None else (judged in ev.levels_held and not _worker_global_sample(env))
    first = ev.first_divergence
    recorded = env.outcome.choices[0].text if env.outcome.kind == "output" else None
    return EnvelopeVerdict(
        **{name: getattr(ev, name) for name in _FROM_EVENT},
        level=judged,
        target_met=met,
        first_divergence=None if first is None else first.position,
        near_tie=None if first is None else first.near_tie,
        detail=ev.cause_detail,
        recorded_text=recorded,
        replayed_text=result.replayed.text,
    )


def run_gate(
    golden: GoldenSet,
    baseline: EnvironmentFingerprint,
    candidate: EnvironmentFingerprint,
    open_lane: Callable[[], Lane],
    settings: ReplayerSettings,
    *,
    level: ReproLevel | None = None,
    min_pass_rate: float = 1.0,
    always_replay: bool = False,
    replay_fn: ReplayFn = replay_envelope,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> GateReport:
    """Decide the gate (see module docstring). ``open_lane`` is called only when a replay is needed; the lane it
    returns is closed here. `LaneUnavailableError` propagates."""
    if not 0.0 <= min_pass_rate <= 1.0:
        raise ValueError("min_pass_rate must be within [0, 1]")
    started = now()
    changed = diff_environments(baseline, candidate)
    common = {
        "golden": golden.source,
        "baseline": baseline,
        "candidate": candidate,
        "baseline_sha256": baseline.sha256(),
        "candidate_sha256": candidate.sha256(),
        "changed_fields": changed,
        "level_override": level,
        "min_pass_rate": min_pass_rate,
        "excluded": golden.excluded,
        "started_at": started,
    }
    if not changed and not always_replay:
        return GateReport(
            **common,
            replayed=False,
            reason="no fingerprint change: gate passes without replay",
            total=len(golden.envelopes),
            passed=0,
            failed=0,
            not_replayable=0,
            pass_rate=None,
            gate_passed=True,
            finished_at=now(),
        )
    needs_semantic = level == "semantic" or any(e.target_level == "semantic" for e in golden.envelopes)
    if needs_semantic and not settings.semantic:
        settings = settings.model_copy(update={"semantic": True})
    lane = open_lane()
    verdicts: list[EnvelopeVerdict] = []
    try:
        lane_sha = lane.fingerprint().sha256()
        for env in golden.envelopes:
            try:
                verdicts.append(_verdict(env, replay_fn(env, lane, settings), level))
            except NotReplayableError as exc:
                verdicts.append(
                    EnvelopeVerdict(
                        request_id=env.request_id,
                        envelope_id=env.envelope_id(),
                        level=level or env.target_level,
                        target_met=False,
                        verdict="not_replayable",
                        detail=str(exc),
                    )
                )
    finally:
        lane.close()
    total = len(verdicts)
    passed = sum(v.target_met for v in verdicts)
    rate = passed / total
    reason = (
        f"{len(changed)} fingerprint field(s) changed: replayed {total} golden envelope(s)"
        if changed
        else f"no fingerprint change; replayed {total} golden envelope(s) (--always-replay)"
    )
    return GateReport(
        **common,
        replayed=True,
        reason=reason,
        lane=lane.name,
        lane_fingerprint_sha256=lane_sha,
        total=total,
        passed=passed,
        failed=total - passed,
        not_replayable=sum(v.verdict == "not_replayable" for v in verdicts),
        pass_rate=rate,
        gate_passed=rate >= min_pass_rate,
        results=tuple(verdicts),
        finished_at=now(),
    )


def _severity(v: EnvelopeVerdict) -> tuple[int, float, int]:
    """Worst first: unmet before met, then lower token match, then earlier fork."""
    return (int(v.target_met), v.token_match_rate if v.token_match_rate is not None else -1.0, v.first_divergence or 0)


def short_text(text: str | None, limit: int = 70) -> str:
    """A text on one line (line breaks shown as ⏎), cut at `limit` characters, quoted; "?" for None."""
    if text is None:
        return "?"
    flat = text.replace("\n", "⏎")
    return repr(flat if len(flat) <= limit else flat[:limit] + "…")


def render_gate(report: GateReport) -> str:
    """The summary a person reads (see module docstring)."""
    status = "PASS" if report.gate_passed else "FAIL"
    lines = [
        f"Release gate: {status} — {report.reason}",
        f"  golden {report.golden}; baseline {report.baseline_sha256[:16]} ({report.baseline.source}),"
        f" candidate {report.candidate_sha256[:16]} ({report.candidate.source})",
    ]
    if report.changed_fields:
        lines.append("Changed fingerprint fields (baseline → candidate):")
        lines.extend(fingerprint_diff_lines(report.changed_fields))
    else:
        lines.append("Fingerprint: no field differs")
    if report.excluded:
        lines.append(f"Excluded from the golden set (not replayable): {len(report.excluded)}")
        lines.extend(f"  {rid}: {why}" for rid, why in report.excluded[:_WORST_SHOWN])
    if not report.replayed:
        return "\n".join(lines) + "\n"
    rate = f"{report.pass_rate:.3f}" if report.pass_rate is not None else "n/a"
    lines.append(
        f"Replayed {report.total} on lane {report.lane}: {report.passed} met their level, {report.failed} did not"
        f" ({report.not_replayable} not replayable); pass rate {rate}, required {report.min_pass_rate:.3f}"
    )
    by_verdict: dict[str, int] = {}
    for v in report.results:
        by_verdict[v.verdict] = by_verdict.get(v.verdict, 0) + 1
    lines.append("Verdicts: " + ", ".join(f"{k} {n}" for k, n in sorted(by_verdict.items())))
    worst = [v for v in sorted(report.results, key=_severity) if not v.target_met][:_WORST_SHOWN]
    if worst:
        lines.append("Worst divergences:")
        for v in worst:
            where = f"first divergence at token {v.first_divergence}" if v.first_divergence is not None else "no fork"
            tie = " (near tie)" if v.near_tie else ""
            lines.append(f"  {v.request_id}: {v.verdict}, level {v.level} NOT MET, {where}{tie}")
            if v.verdict == "not_replayable":
                lines.append(f"    {v.detail}")
                continue
            lines.append(f"    recorded {short_text(v.recorded_text)}")
            lines.append(f"    replayed {short_text(v.replayed_text)}")
    return "\n".join(lines) + "\n"
