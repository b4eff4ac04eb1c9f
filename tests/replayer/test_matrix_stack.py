"""The replay matrix and `explain` for real: the converted model, vLLM on the CPU, the stack's vLLM server.

1. A small matrix (4 bundled prompts, 16 tokens): one at a time, one at a time again, all at once, float32.
   The lane must replay itself bitwise (the second one-at-a-time run); the other cells are measured, and their
   structure is asserted (every request judged, fork positions for exactly the diverged ones, timings, memory).
2. Eight requests sent *at once* to the stack's vLLM server (bfloat16, default scheduler, prefix cache on) and
   recorded as envelopes with ``in_flight_at_start=8``; one whose one-at-a-time replay diverges is explained
   (variations ``alone`` and ``batch``). If none diverges, that is reported and the first one is explained.
   The explanation must agree with the evidence: the alone variation must fork exactly where the one-at-a-time
   replay forked (the lane is deterministic), "reproduced" must mean token identity with the recording, and
   the conclusion must name exactly the variations that reproduced it.

Each engine configuration starts in its own process, and each start is the slow part of this module.
"""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from infra.stack.state import StackInfo
from replayer.compare import compare
from replayer.lanes.batch_engine import probe_platform, render_chat
from replayer.matrix.dimensions import BASELINE_CELL, plan_cells
from replayer.matrix.execution import CellJob, run_jobs
from replayer.matrix.explain import explain
from replayer.matrix.inputs import DEFAULT_PROMPTS, item_from_envelope, workload_items
from replayer.matrix.pipeline import run_matrix
from replayer.matrix.report import render_html, render_table
from replayer.settings import Thresholds
from schemas import (
    Envelope,
)
from tests.replayer.support import envelope_from_completion

pytestmark = pytest.mark.stack

MAX_TOKENS = 16
TOP_K = 5
N_CONCURRENT = 8


def test_small_matrix_for_real(stack: StackInfo) -> None:
    platform = probe_platform()
    items = workload_items(render_chat(stack.model_dir, DEFAULT_PROMPTS[:4]), max_tokens=MAX_TOKENS)
    wanted = {BASELINE_CELL, "batch.single.again", "batch.dynamic", "dtype.float32"}
    cells = [c for c in plan_cells(platform, ("batch", "dtype")) if c.name in wanted]
    report = run_matrix(items, cells, model_dir=stack.model_dir, platform=platform, baseline="single", source="test")
    print("\n" + render_table(report))
    by = {c.name: c for c in report.cells}
    assert set(by) == wanted
    for cell in report.cells:
        assert cell.status == "ran", (cell.name, cell.reason)
        assert cell.n == 4
        assert len(cell.requests) == 4
        assert len(cell.divergence_positions) == cell.n - cell.n_identical
        assert cell.tokens_per_s is not None
        assert cell.tokens_per_s > 0
        assert cell.p95_latency_ms is not None
        assert cell.p95_latency_ms > 0
        assert cell.peak_rss_mb is not None
        assert cell.peak_rss_mb > 200  # the engine is loaded in the measured process
        assert cell.fingerprint is not None
    # the fixed schedule replays itself bitwise: ids, chosen logprobs and top-k
    again = by["batch.single.again"]
    assert again.token_identical_rate == 1.0
    assert [r.verdict for r in again.requests] == ["bitwise"] * 4
    assert again.max_abs_logprob_diff == 0.0
    assert by["batch.dynamic"].order == by[BASELINE_CELL].order
    assert by["dtype.float32"].fingerprint is not None
    assert by["dtype.float32"].fingerprint["dtype"] == "float32"
    assert by[BASELINE_CELL].fingerprint is not None
    assert by[BASELINE_CELL].fingerprint["dtype"] == "bfloat16"
    page = render_html(report)
    assert len(re.findall(r'<img alt="[^"]*" src="data:image/png;base64,', page)) == 2 + 4


# -- explain --------------------------------------------------------------------------------------------------------


async def _capture_concurrently(stack: StackInfo) -> list[Envelope]:
    assert stack.vllm_url is not None
    prompts = render_chat(stack.model_dir, DEFAULT_PROMPTS[:N_CONCURRENT])
    async with httpx.AsyncClient(base_url=stack.vllm_url, timeout=300) as client:
        version = (await client.get("/version")).json()["version"]
        bodies = [
            {
                "model": stack.model_name,
                "prompt": list(ids),
                "temperature": 0.0,
                "max_tokens": MAX_TOKENS,
                "logprobs": TOP_K,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            }
            for ids in prompts
        ]
        at = datetime.now(UTC)
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    envs = []
    tag = at.strftime("%H%M%S%f")
    for i, (ids, body, resp) in enumerate(zip(prompts, bodies, responses, strict=True)):
        resp.raise_for_status()
        envs.append(
            envelope_from_completion(
                request_id=f"explain-{tag}-{i}",
                prompt_ids=list(ids),
                body=body,
                answer=resp.json(),
                received_at=at,
                engine_version=version,
                target_level="token",
                in_flight=N_CONCURRENT,
                top_k=TOP_K,
            )
        )
    return envs


def test_explain_a_request_recorded_under_concurrent_load(stack: StackInfo) -> None:
    captured = asyncio.run(_capture_concurrently(stack))
    items = [item_from_envelope(e) for e in captured]
    lone = run_jobs(stack.model_dir, [CellJob(plan_cells(probe_platform(), ())[0], tuple(items))])[BASELINE_CELL]
    assert lone.error is None
    forks: dict[str, int | None] = {}
    for item in items:
        assert item.recorded is not None
        cmp = compare(item.recorded, lone.outputs[item.request_id], Thresholds(), "token")
        forks[item.request_id] = cmp.first_divergence.position if cmp.first_divergence else None
    diverged = [rid for rid, pos in forks.items() if pos is not None]
    print(f"\n{len(diverged)} of {len(items)} requests recorded 8-at-once diverge when replayed alone: {forks}")
    target = next((e for e in captured if e.request_id in diverged), captured[0])

    def no_padding(n: int) -> list[Any]:
        raise AssertionError(f"the 7 other recorded requests should have been enough, asked to pad {n}")

    ex = explain(
        target,
        captured,
        model_dir=stack.model_dir,
        platform=probe_platform(),
        padding_factory=no_padding,
        only=("alone", "batch"),
    )
    print(ex.conclusion)
    assert ex.batch_size == N_CONCURRENT
    assert len(ex.companions) == N_CONCURRENT - 1
    assert ex.padded_with_workload == 0
    by = {v.name: v for v in ex.variations}
    assert set(by) == {"alone", "batch"}
    for v in ex.variations:
        assert v.status == "ran", v.reason
        assert v.reproduced == (v.first_divergence is None)
        assert len(v.batch) == (N_CONCURRENT if v.name == "batch" else 1)
    # the alone variation is the deterministic lane: it forks exactly where the one-at-a-time replay forked
    assert by["alone"].first_divergence == forks[target.request_id]
    assert ex.reproducing == tuple(v.name for v in ex.variations if v.reproduced)
    assert ex.exit_code == (0 if ex.reproducing else 1)
    if not ex.reproducing:
        assert ex.conclusion.startswith("no variation reproduced")
    elif "alone" in ex.reproducing:
        assert ex.conclusion.startswith("the fixed schedule reproduces")
    else:
        assert "dimension(s) batch" in ex.conclusion
    assert by["alone"].replayed_text == lone.outputs[target.request_id].text
