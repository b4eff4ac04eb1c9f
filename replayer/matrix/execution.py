"""Executing cells (for the matrix and for `reprolane replay explain`): one spawned process per engine configuration,
every cell of that configuration inside it; outputs, latencies and peak RSS per cell.

Why a process per configuration: vLLM keeps process-global state (it turns ``torch.set_num_threads`` into a no-op
once its CPU worker starts; the transformers lane switches on ``torch.use_deterministic_algorithms``), so a
thread-count or engine cell run after another engine in the same process would silently run under the first
one's settings. Two vLLM engines one after the other in one process do start and generate, but isolation is what
makes each cell's configuration and its peak memory trustworthy. The price is one vLLM import per configuration,
on top of the engine start that every configuration pays anyway.

Inside the process the prompts are arranged by the cell's `Schedule` (`arrange`) and submitted:

- ``single``: one ``generate`` call per prompt; the latency of a request is its own call;
- ``fixed``: one call per static batch of ``batch_size``; every request of a batch gets the batch's latency;
- ``all``: one call with every prompt; every request gets the whole call's latency (vLLM's offline API returns
  when the last sequence finishes), so p95 of an ``all`` cell is the batch latency: the report says so.

Before the first cell the engine generates one token from a one-token prompt (`BatchEngine.warm_up`), so the
first timed request does not carry first-call set-up. Peak memory is the peak RSS of the cell's process (and its
children), sampled every `RSS_INTERVAL_S` while the cell runs; it includes the loaded engine.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from replayer.errors import ReplayerError
from replayer.lanes.base import GenRequest
from replayer.lanes.batch_engine import BatchEngine, EngineConfig
from replayer.matrix.dimensions import Cell, Schedule
from replayer.matrix.inputs import MatrixItem
from schemas import ReplayedOutput, RuntimeFingerprint

SHUFFLE_SEED = 0
RSS_INTERVAL_S = 0.02


@dataclass(frozen=True)
class CellJob:
    """One cell and the prompts it runs (the matrix gives every cell the same items; explain does not)."""

    cell: Cell
    items: tuple[MatrixItem, ...]


@dataclass
class CellRun:
    cell_name: str
    outputs: dict[str, ReplayedOutput] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    peak_rss_mb: float | None = None
    fingerprint: RuntimeFingerprint | None = None
    order: tuple[str, ...] = ()
    error: str | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs.values())


def arrange(items: Sequence[MatrixItem], schedule: Schedule) -> list[MatrixItem]:
    """The prompts a cell submits, in submission order: subset by prompt length, then order."""
    chosen = list(items)
    if schedule.subset != "all":
        by_len = sorted(chosen, key=lambda i: (i.prompt_length, i.request_id))
        half = len(by_len) // 2
        keep = {i.request_id for i in (by_len[:half] if schedule.subset == "short" else by_len[half:])}
        chosen = [i for i in chosen if i.request_id in keep]
    if schedule.order == "reversed":
        chosen.reverse()
    elif schedule.order == "shuffled":
        random.Random(SHUFFLE_SEED).shuffle(chosen)
    return chosen


def batches(items: Sequence[MatrixItem], schedule: Schedule) -> list[list[MatrixItem]]:
    """The ``generate`` calls of a schedule: one per prompt, per static batch, or one for all."""
    if schedule.mode == "single":
        return [[i] for i in items]
    if schedule.mode == "fixed":
        size = max(1, schedule.batch_size or 1)
        return [list(items[k : k + size]) for k in range(0, len(items), size)]
    return [list(items)] if items else []


class _PeakRss:
    """Peak RSS (MiB) of this process and its children, sampled in a daemon thread."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process(os.getpid())
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # a child that just exited
                continue
        return total

    def _loop(self) -> None:
        while not self._stop.wait(RSS_INTERVAL_S):
            self._peak = max(self._peak, self._sample())

    def reset(self) -> None:
        self._peak = self._sample()

    def peak_mb(self) -> float:
        return max(self._peak, self._sample()) / 2**20

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def _run_group(model_dir: str, config: EngineConfig, jobs: list[CellJob]) -> list[CellRun]:
    """Child process body: start the engine once, run each job's schedule, report outputs and timings."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    try:
        engine = BatchEngine(Path(model_dir), config)
        engine.warm_up()
    except ReplayerError as exc:
        return [CellRun(cell_name=j.cell.name, error=str(exc)) for j in jobs]
    rss = _PeakRss()
    runs: list[CellRun] = []
    try:
        for job in jobs:
            run = CellRun(cell_name=job.cell.name, fingerprint=engine.fingerprint())
            arranged = arrange(job.items, job.cell.schedule)
            run.order = tuple(i.request_id for i in arranged)
            rss.reset()
            started = time.perf_counter()
            try:
                for group in batches(arranged, job.cell.schedule):
                    reqs = [
                        GenRequest(i.prompt_token_ids, i.sampling, max_tokens=i.max_tokens, top_k_logprobs=i.top_k)
                        for i in group
                    ]
                    t0 = time.perf_counter()
                    outs = engine.generate(reqs)
                    ms = (time.perf_counter() - t0) * 1e3
                    for item, out in zip(group, outs, strict=True):
                        run.outputs[item.request_id] = out
                        run.latency_ms[item.request_id] = ms
            except ReplayerError as exc:
                run.error = str(exc)
            run.wall_s = time.perf_counter() - started
            run.peak_rss_mb = rss.peak_mb()
            runs.append(run)
    finally:
        rss.stop()
        engine.close()
    return runs


def engine_groups(jobs: Sequence[CellJob]) -> list[tuple[EngineConfig, list[CellJob]]]:
    """Jobs grouped by engine configuration, in first-appearance order (one engine start per group)."""
    groups: dict[EngineConfig, list[CellJob]] = {}
    for job in jobs:
        groups.setdefault(job.cell.engine, []).append(job)
    return list(groups.items())


def run_jobs(model_dir: Path, jobs: Sequence[CellJob], *, progress: bool = False) -> dict[str, CellRun]:
    """Run every runnable job (one spawned process per engine configuration); cell name -> run."""
    runs: dict[str, CellRun] = {}
    ctx = multiprocessing.get_context("spawn")
    for config, group in engine_groups([j for j in jobs if j.cell.runnable]):
        if progress:
            names = ", ".join(j.cell.name for j in group)
            print(f"[matrix] engine {config.key}: {names}", flush=True)
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            try:
                results = pool.submit(_run_group, str(model_dir), config, list(group)).result()
            except Exception as exc:  # the child died (OOM, a crash inside the engine)
                results = [CellRun(cell_name=j.cell.name, error=f"engine process failed: {exc!r}") for j in group]
        for run in results:
            runs[run.cell_name] = run
    return runs
