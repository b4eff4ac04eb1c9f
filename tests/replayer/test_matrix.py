"""The replay matrix without a model: cell planning and skip reasons, schedules, per-cell metrics, the reports."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime

import pytest

from replayer.lanes.batch_engine import EngineConfig, Platform
from replayer.matrix.dimensions import (
    BASELINE_CELL,
    COMPILE_SLOW_REASON,
    DIMENSIONS,
    Cell,
    Schedule,
    parse_dimensions,
    plan_cells,
)
from replayer.matrix.execution import CellJob, CellRun, arrange, batches, engine_groups
from replayer.matrix.inputs import (
    MatrixItem,
    Workload,
    item_from_envelope,
    items_from_envelopes,
    load_prompt_file,
    spread,
)
from replayer.matrix.pipeline import prepare_cells
from replayer.matrix.report import render_html, render_json, render_table
from replayer.matrix.results import MatrixReport, evaluate_cell, p95
from replayer.settings import Thresholds
from schemas import CapturedError, ReplayedOutput, SamplingContract, Timings
from tests import factories

CPU = Platform(gpu_count=0, cpu_count=2, vllm_version="0.32.0", transformers_version="5.19.0")


def _by_name(cells: list[Cell]) -> dict[str, Cell]:
    return {c.name: c for c in cells}


def test_every_dimension_plans_cells_and_the_baseline_comes_first() -> None:
    cells = plan_cells(CPU, DIMENSIONS)
    assert cells[0].name == BASELINE_CELL
    assert cells[0].runnable
    assert {c.dimension for c in cells} == set(DIMENSIONS)
    assert len({c.name for c in cells}) == len(cells)


def test_cpu_host_skips_gpu_cells_with_reasons() -> None:
    cells = _by_name(plan_cells(CPU, DIMENSIONS))
    assert "CUDA GPU" in (cells["cuda_graphs.on"].skip_reason or "")
    assert "CPU_ATTN" in (cells["attention.alt"].skip_reason or "")
    assert "2 GPUs" in (cells["tp.2"].skip_reason or "")
    assert cells["compile.on"].skip_reason == COMPILE_SLOW_REASON
    version = cells["engine.version_b"].skip_reason or ""
    assert "0.32.0" in version
    assert "reprolane release gate" in version
    runnable = {n for n, c in cells.items() if c.runnable}
    assert runnable >= {"batch.single", "batch.single.again", "batch.fixed4", "batch.dynamic", "order.reversed"}
    assert runnable >= {"dtype.float32", "threads.1", "prefix_cache.on", "engine.transformers", "input.short"}


def test_include_slow_runs_compile_on_cpu_and_gpu_host_runs_cuda_graphs() -> None:
    assert _by_name(plan_cells(CPU, ("compile",), include_slow=True))["compile.on"].runnable
    gpu = Platform(gpu_count=1, cpu_count=16, vllm_version="0.32.0", transformers_version="5.19.0")
    cells = _by_name(plan_cells(gpu, ("cuda_graphs", "tp", "compile"), include_slow=True))
    assert cells["cuda_graphs.on"].runnable
    assert cells["cuda_graphs.on"].engine.compiled
    assert "1" in (cells["tp.2"].skip_reason or "")
    assert not cells["compile.on"].runnable


def test_single_core_and_missing_engines_are_skipped_not_dropped() -> None:
    bare = Platform(gpu_count=0, cpu_count=1, vllm_version=None, transformers_version=None)
    cells = _by_name(plan_cells(bare, ("threads", "engine", "batch")))
    assert "single core" in (cells["threads.1"].skip_reason or "")
    assert "not installed" in (cells["engine.transformers"].skip_reason or "")
    assert "vLLM is not installed" in (cells["batch.dynamic"].skip_reason or "")
    assert "vLLM is not installed" in (cells[BASELINE_CELL].skip_reason or "")


def test_parse_dimensions() -> None:
    assert parse_dimensions(None) == DIMENSIONS
    assert parse_dimensions("dtype, batch,dtype") == ("dtype", "batch")
    with pytest.raises(ValueError, match="bogus"):
        parse_dimensions("batch,bogus")


def test_engine_groups_share_one_engine_per_configuration() -> None:
    cells = plan_cells(CPU, ("batch", "order", "dtype"))
    groups = engine_groups([CellJob(c, ()) for c in cells])
    keys = [cfg.key for cfg, _ in groups]
    assert keys == ["vllm/bfloat16/pc-off/t-default/eager", "vllm/float32/pc-off/t-default/eager"]
    assert [j.cell.name for j in groups[0][1]][:2] == [BASELINE_CELL, "batch.single.again"]


def _item(rid: str, n_prompt: int, recorded: bool = True) -> MatrixItem:
    env = factories.envelope(request_id=rid)
    item = item_from_envelope(env)
    return MatrixItem(
        request_id=rid,
        prompt_token_ids=tuple(range(1, n_prompt + 1)),
        sampling=item.sampling,
        max_tokens=item.max_tokens,
        top_k=item.top_k,
        recorded=item.recorded if recorded else None,
    )


def test_arrange_orders_and_subsets() -> None:
    items = [_item("a", 5), _item("b", 2), _item("c", 9), _item("d", 3)]
    ids = lambda xs: [i.request_id for i in xs]  # noqa: E731
    assert ids(arrange(items, Schedule("all"))) == ["a", "b", "c", "d"]
    assert ids(arrange(items, Schedule("all", order="reversed"))) == ["d", "c", "b", "a"]
    shuffled = ids(arrange(items, Schedule("all", order="shuffled")))
    assert sorted(shuffled) == ["a", "b", "c", "d"]
    assert shuffled == ids(arrange(items, Schedule("all", order="shuffled")))  # seeded
    assert ids(arrange(items, Schedule("all", subset="short"))) == ["b", "d"]
    assert ids(arrange(items, Schedule("all", subset="long"))) == ["a", "c"]
    assert [len(b) for b in batches(items, Schedule("single"))] == [1, 1, 1, 1]
    assert [len(b) for b in batches(items + items[:1], Schedule("fixed", 4))] == [4, 1]
    assert [len(b) for b in batches(items, Schedule("all"))] == [4]


def test_subset_cells_need_two_requests() -> None:
    cells = prepare_cells(plan_cells(CPU, ("input",)), 1)
    assert "at least 2" in (_by_name(cells)["input.short"].skip_reason or "")
    assert _by_name(prepare_cells(plan_cells(CPU, ("input",)), 2))["input.short"].runnable


def test_items_from_envelopes_keeps_rejections_with_reasons() -> None:
    ok = factories.envelope(request_id="ok-1")
    bad = factories.envelope(
        request_id="bad-1",
        outcome=CapturedError(
            error_type="timeout", message="t", timings=Timings(received_at=factories.FIXED_TIME, upstream_ms=1.0)
        ),
    )
    items, rejected = items_from_envelopes([ok, bad, ok])
    assert [i.request_id for i in items] == ["ok-1"]
    assert rejected == [("bad-1", "the request ended in an error (timeout), not a complete output")]
    assert items[0].max_tokens == 3 + 16  # replay_budget: recorded length + 16, within the contract's 256


def test_load_prompt_file_shapes(tmp_path: pytest.TempPathFactory) -> None:
    p = tmp_path / "p.json"  # type: ignore[operator]
    doc = {
        "system": "be brief",
        "prompts": ["a", {"id": "x1", "prompt": "b"}, {"messages": [{"role": "user", "content": "c"}]}],
    }
    p.write_text(json.dumps(doc))
    assert load_prompt_file(p) == Workload(("a", "b", "c"), ("000", "x1", "002"), "be brief")
    p.write_text(json.dumps([{"nothing": 1}]))
    with pytest.raises(ValueError, match="no prompt text"):
        load_prompt_file(p)


def test_p95_is_nearest_rank() -> None:
    assert p95([]) is None
    assert p95([5.0]) == 5.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0


# -- metrics and reports ------------------------------------------------------------------------------------------


def _out(ids: tuple[int, ...], *lps: float) -> ReplayedOutput:
    steps = tuple(factories.step(t, lp, (t + 1, lp - 1.0)) for t, lp in zip(ids, lps, strict=True))
    return ReplayedOutput(token_ids=ids, text="x", logprobs=steps)


def _report() -> MatrixReport:
    items = [_item("r1", 4), _item("r2", 6)]
    recorded = items[0].recorded
    assert recorded is not None
    assert recorded.logprobs is not None
    same = ReplayedOutput(token_ids=recorded.token_ids, text=recorded.text, logprobs=recorded.logprobs)
    forked = _out((504, 3575, 7), -0.01, -0.25, -0.5)
    cells = plan_cells(CPU, ("batch", "tp"))
    byname = _by_name(cells)
    runs = {
        BASELINE_CELL: CellRun(
            BASELINE_CELL, {"r1": same, "r2": same}, {"r1": 10.0, "r2": 30.0}, 0.5, 700.0, None, ("r1", "r2")
        ),
        "batch.dynamic": CellRun(
            "batch.dynamic", {"r1": same, "r2": forked}, {"r1": 20.0, "r2": 20.0}, 0.25, 710.0, None, ("r1", "r2")
        ),
        "batch.fixed4": CellRun("batch.fixed4", error="vLLM refused it"),
    }
    base = {i.request_id: i.recorded for i in items if i.recorded is not None}
    th = Thresholds()
    results = tuple(evaluate_cell(c, runs.get(c.name), base, None, th) for c in cells)
    assert byname["tp.2"].skip_reason
    return MatrixReport(
        created_at=datetime(2026, 11, 29, tzinfo=UTC),
        baseline="recorded",
        platform={"gpu_count": 0},
        source="unit",
        n_inputs=2,
        rejected=(("bad-1", "why"),),
        cells=results,
    )


def test_evaluate_cell_metrics() -> None:
    cells = {c.name: c for c in _report().cells}
    single = cells[BASELINE_CELL]
    assert (single.status, single.n, single.n_identical, single.token_identical_rate) == ("ran", 2, 2, 1.0)
    assert single.divergence_positions == ()
    assert single.max_abs_logprob_diff == 0.0
    assert single.tokens_per_s == pytest.approx(6 / 0.5)
    assert single.p95_latency_ms == 30.0
    assert single.latency_kind == "per request"
    dyn = cells["batch.dynamic"]
    assert (dyn.n_identical, dyn.token_identical_rate, dyn.divergence_positions) == (1, 0.5, (2,))
    fork = next(r for r in dyn.requests if not r.token_identical)
    assert fork.before_fork is not None
    assert fork.before_fork.position == 1
    assert fork.at_fork is not None
    assert fork.at_fork.recorded_token_id == 2
    assert fork.at_fork.replayed_token_id == 7
    assert dyn.latency_kind == "whole batch (one call)"
    assert cells["batch.fixed4"].status == "failed"
    assert cells["batch.fixed4"].reason == "vLLM refused it"
    assert cells["batch.single.again"].status == "failed"  # planned, never run: reported, not dropped
    assert cells["tp.2"].status == "skipped"


def test_baseline_error_fails_cells_instead_of_comparing_nothing() -> None:
    cell = plan_cells(CPU, ())[0]
    res = evaluate_cell(cell, CellRun(cell.name, order=()), {}, "no baseline here", Thresholds())
    assert (res.status, res.reason) == ("failed", "no baseline here")


def test_json_report_lists_every_cell_with_reasons() -> None:
    report = _report()
    data = json.loads(render_json(report))
    assert [c["name"] for c in data["cells"]] == [c.name for c in report.cells]
    skipped = [c for c in data["cells"] if c["status"] == "skipped"]
    assert skipped
    assert all(c["reason"] for c in skipped)
    assert MatrixReport.model_validate_json(render_json(report)) == report


def test_terminal_table_has_one_row_per_cell() -> None:
    report = _report()
    text = render_table(report)
    for cell in report.cells:
        assert re.search(rf"^{re.escape(cell.name)}\b", text, re.M), cell.name
    assert "1/2 50%" in text
    assert "2/2/2" in text  # fork positions min/median/max of batch.dynamic
    assert "tp.2: skipped: tensor_parallel_size=2 needs 2 GPUs" in text
    assert "batch.dynamic: p95 is whole batch (one call)" in text
    assert "bad-1: why" in text


def test_html_is_self_contained_with_one_image_per_plot() -> None:
    report = _report()
    page = render_html(report)
    assert not re.search(r"(src|href)=\"(?!data:)", page)
    assert "http://" not in page
    assert "https://" not in page
    ran = [c for c in report.cells if c.status == "ran"]
    imgs = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(imgs) == 2 + len(ran)  # identical-rate bars, throughput bars, one histogram per cell that ran
    assert {alt for alt, _ in imgs} >= {f"First-divergence positions: {c.name}" for c in ran}
    for cell in report.cells:
        assert f"<td>{cell.name}" in page
    assert "tensor_parallel_size=2 needs 2 GPUs" in page
    assert "3575:-0.250, 3576:-1.250" in page  # the top-k at the step before the fork


def test_engine_config_key_names_every_setting() -> None:
    cfg = EngineConfig(engine="vllm", dtype="float32", prefix_caching=True, threads=1, compiled=True)
    assert cfg.key == "vllm/float32/pc-on/t1/compiled"


def test_sampling_contract_of_workload_items() -> None:
    from replayer.matrix.inputs import workload_items

    items = workload_items([(1, 2, 3)], max_tokens=16)
    assert items[0].sampling == SamplingContract(temperature=0.0, max_tokens=16, seed_scope="none", logprobs=5)
    assert items[0].recorded is None


def test_spread_picks_evenly_over_the_file() -> None:
    wl = Workload(tuple("abcdefghij"), tuple(str(i) for i in range(10)))
    assert spread(wl, 4).prompts == ("a", "d", "g", "j")
    assert spread(wl, 1).prompts == ("a",)
    assert spread(wl, None) == wl
    assert spread(wl, 50) == wl
