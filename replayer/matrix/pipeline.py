"""The matrix pipeline, `run_matrix`: plan -> execute (one process per engine configuration, see
`replayer.matrix.execution`) -> judge every cell (`replayer.matrix.results`) -> `MatrixReport`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

from replayer.lanes.batch_engine import Platform
from replayer.matrix.dimensions import Cell
from replayer.matrix.execution import CellJob, run_jobs
from replayer.matrix.inputs import MatrixItem
from replayer.matrix.results import BaselineMode, MatrixReport, baselines, evaluate_cell
from replayer.settings import Thresholds

MIN_ITEMS_FOR_SUBSET = 2


def prepare_cells(cells: Sequence[Cell], n_items: int) -> list[Cell]:
    """Skip (with the reason) cells that need more requests than there are."""
    out = []
    for cell in cells:
        if cell.runnable and cell.schedule.subset != "all" and n_items < MIN_ITEMS_FOR_SUBSET:
            cell = replace(cell, skip_reason=f"needs at least {MIN_ITEMS_FOR_SUBSET} requests to split by length")
        out.append(cell)
    return out


def run_matrix(
    items: Sequence[MatrixItem],
    cells: Sequence[Cell],
    *,
    model_dir: Path,
    platform: Platform,
    baseline: BaselineMode,
    source: str,
    rejected: Sequence[tuple[str, str]] = (),
    thresholds: Thresholds | None = None,
    similarity: Callable[[str, str], float] | None = None,
    progress: bool = False,
) -> MatrixReport:
    """Run every runnable cell on every item and judge it against the baseline (see `replayer.matrix.results`)."""
    planned = prepare_cells(cells, len(items))
    runs = run_jobs(model_dir, [CellJob(c, tuple(items)) for c in planned], progress=progress)
    base, base_error = baselines(items, baseline, runs)
    th = thresholds or Thresholds()
    results = tuple(evaluate_cell(c, runs.get(c.name), base, base_error, th, similarity=similarity) for c in planned)
    return MatrixReport(
        created_at=datetime.now(UTC),
        baseline=baseline,
        platform=asdict(platform),
        source=source,
        n_inputs=len(items),
        rejected=tuple(rejected),
        cells=results,
    )
