"""The cells of the replay matrix: which configurations exist, and which of them this host can run (and why not).

A cell is one engine configuration (`replayer.lanes.batch_engine.EngineConfig`: engine, dtype, prefix cache, torch
threads, compiled) and one schedule (`Schedule`: how the prompts are submitted: one at a time, in fixed batches of
4, or all at once; in which order; which subset by prompt length). Cells that share an engine configuration share
one engine.

The dimensions, as the source brief lists them, and what each means here:

- ``batch``: ``batch.single`` (one request at a time: the fixed schedule of the replay lane, always planned: it
  is the reference), ``batch.single.again`` (the same a second time: the lane's determinism), ``batch.fixed4``
  (static batches of 4: one ``generate`` call per 4 prompts), ``batch.dynamic`` (every prompt at once; the
  engine batches dynamically, up to 256 sequences).
- ``order``: all at once in reversed / shuffled (seed 0) order.
- ``input``: all at once, only the shorter half / only the longer half of the prompts (by prompt length).
- ``dtype``: float32 instead of bfloat16, one at a time and all at once.
- ``threads``: one torch thread instead of the default (every core), one at a time.
- ``prefix_cache``: vLLM's prefix cache on (prompts share the chat template's system prefix), one at a time.
- ``compile``: torch.compile instead of eager; on the CPU its warm-up dwarfs every other cell's run (STACK.md
  has the measurement), so only with ``include_slow``.
- ``cuda_graphs``, ``attention``, ``tp``: need GPUs (skipped here with the reason).
- ``engine``: engine A vs B. Only one vLLM version can be installed in one environment, so "version A vs B" is
  skipped with a pointer to comparing two recorded runs; ``engine.transformers`` swaps the engine itself for the
  float32 transformers reference lane (a different engine, *not* another vLLM version: the label says so).

Every planned cell appears in the report; a cell that cannot run carries ``skip_reason``. Pure: no IO.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, Literal

from replayer.lanes.batch_engine import EngineConfig, Platform

ScheduleMode = Literal["single", "fixed", "all"]
Order = Literal["given", "reversed", "shuffled"]
Subset = Literal["all", "short", "long"]

DIMENSIONS: Final = (
    "batch",
    "order",
    "input",
    "dtype",
    "threads",
    "prefix_cache",
    "compile",
    "cuda_graphs",
    "attention",
    "tp",
    "engine",
)
#: The dimensions run when none are named: all of them (the slow cells among them need ``include_slow``).
DEFAULT_DIMENSIONS: Final = DIMENSIONS
BASELINE_CELL: Final = "batch.single"
FIXED_BATCH: Final = 4
COMPILE_SLOW_REASON: Final = (
    "torch.compile warm-up took over 100 s on this CPU host (measured, STACK.md); pass --include-slow to run it"
)


@dataclass(frozen=True)
class Schedule:
    mode: ScheduleMode = "single"
    batch_size: int | None = None  # for "fixed"
    order: Order = "given"
    subset: Subset = "all"

    def describe(self) -> str:
        what = {"single": "one at a time", "fixed": f"static batches of {self.batch_size}", "all": "all at once"}
        text = what[self.mode]
        if self.order != "given":
            text += f", {self.order} order"
        if self.subset != "all":
            text += f", {self.subset}er half of the prompts"
        return text


@dataclass(frozen=True)
class Cell:
    name: str
    dimension: str
    description: str
    engine: EngineConfig
    schedule: Schedule
    skip_reason: str | None = None

    @property
    def runnable(self) -> bool:
        return self.skip_reason is None


def _skip(cell: Cell, reason: str | None) -> Cell:
    return replace(cell, skip_reason=reason) if reason else cell


def _dimension_cells(dim: str, platform: Platform, include_slow: bool) -> list[Cell]:
    base = EngineConfig(dtype=platform.default_dtype)
    single, every = Schedule("single"), Schedule("all")
    gpu = platform.gpu_count > 0
    if dim == "batch":
        return [
            Cell("batch.single.again", dim, "one at a time, a second time: the lane's determinism", base, single),
            Cell("batch.fixed4", dim, f"static batches of {FIXED_BATCH}", base, Schedule("fixed", FIXED_BATCH)),
            Cell("batch.dynamic", dim, "all at once: dynamic batching, max 256 sequences", base, every),
        ]
    if dim == "order":
        return [
            Cell("order.reversed", dim, "all at once, reversed arrival order", base, Schedule("all", order="reversed")),
            Cell(
                "order.shuffled", dim, "all at once, shuffled arrival (seed 0)", base, Schedule("all", order="shuffled")
            ),
        ]
    if dim == "input":
        return [
            Cell(
                "input.short",
                dim,
                "all at once, the shorter half of the prompts",
                base,
                Schedule("all", subset="short"),
            ),
            Cell(
                "input.long", dim, "all at once, the longer half of the prompts", base, Schedule("all", subset="long")
            ),
        ]
    if dim == "dtype":
        other = "float32" if platform.default_dtype != "float32" else "bfloat16"
        eng = replace(base, dtype=other)
        return [
            Cell(f"dtype.{other}", dim, f"{other}, one at a time", eng, single),
            Cell(f"dtype.{other}.dynamic", dim, f"{other}, all at once", eng, every),
        ]
    if dim == "threads":
        cell = Cell(
            "threads.1", dim, "one torch thread instead of every core, one at a time", replace(base, threads=1), single
        )
        one_core = "this host has a single core: one thread is already the default"
        return [_skip(cell, one_core if platform.cpu_count < 2 else None)]
    if dim == "prefix_cache":
        cached = replace(base, prefix_caching=True)
        return [Cell("prefix_cache.on", dim, "vLLM prefix cache on, one at a time", cached, single)]
    if dim == "compile":
        cell = Cell("compile.on", dim, "torch.compile (not eager), one at a time", replace(base, compiled=True), single)
        if gpu:
            return [_skip(cell, "on a GPU, compilation comes with CUDA graphs: see cuda_graphs")]
        return [_skip(cell, None if include_slow else COMPILE_SLOW_REASON)]
    if dim == "cuda_graphs":
        graphs = replace(base, compiled=True)
        cell = Cell("cuda_graphs.on", dim, "CUDA graphs captured (not eager), one at a time", graphs, single)
        if not gpu:
            return [_skip(cell, "CUDA graphs need a CUDA GPU; this host has none (CPU: see the compile dimension)")]
        return [_skip(cell, None if include_slow else "CUDA graph capture is slow to warm up; pass --include-slow")]
    if dim == "attention":
        cell = Cell("attention.alt", dim, "another attention backend", base, single)
        reason = (
            "vLLM's CPU backend has a single attention backend (CPU_ATTN); switching backends needs a GPU"
            if not gpu
            else "switching the attention backend is not wired in this build (untested without vLLM on a GPU)"
        )
        return [_skip(cell, reason)]
    if dim == "tp":
        cell = Cell("tp.2", dim, "tensor_parallel_size=2", base, single)
        reason = (
            f"tensor_parallel_size=2 needs 2 GPUs (this host has {platform.gpu_count})"
            if platform.gpu_count < 2
            else "tensor parallelism is not wired in this build (untested without vLLM on 2 GPUs)"
        )
        return [_skip(cell, reason)]
    if dim == "engine":
        version = platform.vllm_version or "none"
        ver = Cell("engine.version_b", dim, "vLLM version A vs candidate version B", base, single)
        ver = _skip(
            ver,
            f"only one vLLM version can be installed in one environment (here: {version}); replay the golden set "
            "on each version and compare the two recorded runs with `reprolane release gate`",
        )
        alt = Cell(
            "engine.transformers",
            dim,
            "another engine (transformers float32 reference lane), not another vLLM version; one at a time",
            EngineConfig(engine="transformers", dtype="float32", threads=1),
            single,
        )
        alt = _skip(alt, None if platform.transformers_version else "transformers is not installed (lanes extra)")
        return [ver, alt]
    raise ValueError(f"unknown dimension {dim!r}; known: {', '.join(DIMENSIONS)}")


def parse_dimensions(text: str | None) -> tuple[str, ...]:
    """``"batch,dtype"`` -> ("batch", "dtype"); None or "" -> every dimension; unknown names -> ValueError."""
    if not text:
        return DEFAULT_DIMENSIONS
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in DIMENSIONS]
    if unknown:
        raise ValueError(f"unknown dimension(s) {', '.join(unknown)}; known: {', '.join(DIMENSIONS)}")
    return names


def plan_cells(platform: Platform, dimensions: tuple[str, ...], *, include_slow: bool = False) -> list[Cell]:
    """The baseline cell (one at a time, the replay lane's schedule) followed by every cell of each dimension."""
    if platform.vllm_version is None:
        reason = "vLLM is not installed (lanes extra)"
    else:
        reason = None
    baseline = Cell(
        BASELINE_CELL,
        "batch",
        "one at a time: the fixed schedule of the replay lane (reference)",
        EngineConfig(dtype=platform.default_dtype),
        Schedule("single"),
        reason,
    )
    cells = [baseline]
    for dim in dimensions:
        for cell in _dimension_cells(dim, platform, include_slow):
            if cell.engine.engine == "vllm" and reason and cell.skip_reason is None:
                cell = replace(cell, skip_reason=reason)
            cells.append(cell)
    return cells
