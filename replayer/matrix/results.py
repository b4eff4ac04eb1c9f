"""Per-cell metrics: every cell's outputs judged against the baseline with `replayer.compare`.

The baseline of a request is its recorded output (choice 0 of the envelope) when the matrix runs recorded
envelopes, or the output of the one-at-a-time cell (``batch.single``) otherwise (``baseline="single"``: the
workload, or on request). Per cell:

- token-identical rate (``n_identical / n``) and the first-divergence position of each diverged request;
- for each diverged request, the top-k and logprobs at the step before the fork and at the fork
  (`schemas.StepCandidates`, from `replayer.compare`);
- max absolute and relative chosen-token logprob difference over the numeric window (common prefix + fork);
- semantic similarity of the final texts, mean over requests (only when enabled);
- throughput (generated tokens / wall time of the cell), p95 latency (see `replayer.matrix.execution` for what a
  request's latency is under each schedule: ``latency_kind``), peak RSS of the cell's process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Literal

import numpy as np
from pydantic import Field

from replayer.compare import Comparison, compare
from replayer.matrix.dimensions import BASELINE_CELL, Cell
from replayer.matrix.execution import CellRun
from replayer.matrix.inputs import MatrixItem
from replayer.report import ReportModel
from replayer.settings import Thresholds
from schemas import Choice, DivergenceEvent, ReplayedOutput, StepCandidates

Status = Literal["ran", "skipped", "failed"]
BaselineMode = Literal["recorded", "single"]
LATENCY_KIND = {"single": "per request", "fixed": "per static batch", "all": "whole batch (one call)"}


class RequestOutcome(ReportModel):
    """One request of a cell, compared with its baseline (the recorded output, or the ``batch.single`` cell's)."""

    request_id: str
    token_identical: bool = Field(description="the same token ids as the baseline")
    verdict: str
    first_divergence: int | None = Field(default=None, description="index of the first token that differs (the fork)")
    before_fork: StepCandidates | None = Field(
        default=None, description="both sides' top-k at the step before the fork"
    )
    at_fork: StepCandidates | None = Field(default=None, description="both sides' top-k at the fork")
    max_abs_logprob_diff: float | None = None
    max_rel_logprob_diff: float | None = None
    semantic_similarity: float | None = None
    latency_ms: float = Field(description="its own call's, or its batch's: see the cell's latency_kind")
    generated_tokens: int
    cause_detail: str = ""


def comparison_fields(c: Comparison | DivergenceEvent) -> dict[str, Any]:
    """How a matrix row (`RequestOutcome`, `replayer.matrix.explain.VariationOutcome`) reports a comparison with
    the recorded output, alike whether it was compared here (`replayer.compare.Comparison`) or by the schedule
    replay that ran it (its divergence event)."""
    fd = c.first_divergence
    return {
        "verdict": c.verdict,
        "first_divergence": fd.position if fd else None,
        "before_fork": fd.before if fd else None,
        "at_fork": fd.at if fd else None,
        "max_abs_logprob_diff": c.max_abs_logprob_diff,
        "max_rel_logprob_diff": c.max_rel_logprob_diff,
        "cause_detail": c.cause_detail,
    }


class CellResult(ReportModel):
    name: str
    dimension: str
    description: str
    engine: str
    schedule: str
    status: Status
    reason: str | None = None
    is_baseline: bool = False
    n: int = 0
    n_identical: int = 0
    token_identical_rate: float | None = None
    divergence_positions: tuple[int, ...] = Field(default=(), description="each diverged request's first_divergence")
    max_abs_logprob_diff: float | None = Field(default=None, description="the largest over its requests")
    max_rel_logprob_diff: float | None = None
    semantic_mean: float | None = Field(default=None, description="mean similarity over its requests (with --semantic)")
    tokens_per_s: float | None = Field(default=None, description="generated tokens / the cell's wall time")
    p95_latency_ms: float | None = None
    latency_kind: str | None = None
    peak_rss_mb: float | None = Field(default=None, description="peak RSS of the engine's process during the cell")
    wall_s: float | None = None
    fingerprint: dict[str, Any] | None = None
    order: tuple[str, ...] = ()
    requests: tuple[RequestOutcome, ...] = ()


class MatrixReport(ReportModel):
    created_at: datetime
    baseline: BaselineMode
    platform: dict[str, Any]
    source: str
    n_inputs: int
    rejected: tuple[tuple[str, str], ...] = ()
    cells: tuple[CellResult, ...]


def as_choice(output: ReplayedOutput) -> Choice:
    """A replayed output in the shape of a recorded choice (to serve as a baseline)."""
    return Choice(
        index=0,
        token_ids=output.token_ids,
        text=output.text,
        finish_reason=output.finish_reason,
        logprobs=output.logprobs,
    )


def _base(cell: Cell) -> dict[str, Any]:
    return {
        "name": cell.name,
        "dimension": cell.dimension,
        "description": cell.description,
        "engine": cell.engine.key,
        "schedule": cell.schedule.describe(),
        "is_baseline": cell.name == BASELINE_CELL,
    }


def p95(values: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile (None for no values)."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), 95, method="inverted_cdf"))


def _max(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def baselines(
    items: Sequence[MatrixItem], mode: BaselineMode, runs: dict[str, CellRun]
) -> tuple[dict[str, Choice], str | None]:
    """request id -> baseline choice, or an error when the baseline is unavailable."""
    if mode == "recorded":
        missing = [i.request_id for i in items if i.recorded is None]
        if missing:
            return {}, f"no recorded output for {', '.join(missing[:3])}"
        return {i.request_id: i.recorded for i in items if i.recorded is not None}, None
    run = runs.get(BASELINE_CELL)
    if run is None or run.error:
        why = run.error if run is not None else "it did not run"
        return {}, f"the baseline cell {BASELINE_CELL} has no outputs ({why})"
    return {rid: as_choice(out) for rid, out in run.outputs.items()}, None


def evaluate_cell(
    cell: Cell,
    run: CellRun | None,
    base: dict[str, Choice],
    base_error: str | None,
    thresholds: Thresholds,
    *,
    similarity: Callable[[str, str], float] | None = None,
) -> CellResult:
    """Judge one cell's outputs against the baselines (see module docstring)."""
    head = _base(cell)
    if not cell.runnable:
        return CellResult(**head, status="skipped", reason=cell.skip_reason)
    if run is None:
        return CellResult(**head, status="failed", reason="the cell did not run")
    if run.error:
        return CellResult(**head, status="failed", reason=run.error, peak_rss_mb=run.peak_rss_mb)
    if base_error:
        return CellResult(**head, status="failed", reason=base_error)
    outcomes: list[RequestOutcome] = []
    for rid in run.order:
        out = run.outputs.get(rid)
        recorded = base.get(rid)
        if out is None or recorded is None:
            continue
        sim = None
        if similarity is not None:
            sim = 1.0 if out.text == recorded.text else similarity(recorded.text, out.text)
        cmp = compare(recorded, out, thresholds, "token", semantic_similarity=sim)
        outcomes.append(
            RequestOutcome(
                **comparison_fields(cmp),
                request_id=rid,
                token_identical="token" in cmp.levels_held,
                semantic_similarity=sim,
                latency_ms=run.latency_ms.get(rid, 0.0),
                generated_tokens=len(out.token_ids),
            )
        )
    n = len(outcomes)
    n_same = sum(o.token_identical for o in outcomes)
    sims = [o.semantic_similarity for o in outcomes if o.semantic_similarity is not None]
    return CellResult(
        **head,
        status="ran",
        n=n,
        n_identical=n_same,
        token_identical_rate=(n_same / n) if n else None,
        divergence_positions=tuple(o.first_divergence for o in outcomes if o.first_divergence is not None),
        max_abs_logprob_diff=_max([o.max_abs_logprob_diff for o in outcomes]),
        max_rel_logprob_diff=_max([o.max_rel_logprob_diff for o in outcomes]),
        semantic_mean=float(np.mean(sims)) if sims else None,
        tokens_per_s=(run.generated_tokens / run.wall_s) if run.wall_s > 0 else None,
        p95_latency_ms=p95([o.latency_ms for o in outcomes]),
        latency_kind=LATENCY_KIND[cell.schedule.mode],
        peak_rss_mb=run.peak_rss_mb,
        wall_s=run.wall_s,
        fingerprint=run.fingerprint.model_dump(mode="json") if run.fingerprint else None,
        order=run.order,
        requests=tuple(outcomes),
    )
