"""The replay matrix and `explain` for real, through the commands a release engineer and an auditor run:
``reprolane replay matrix`` and ``reprolane replay explain``, each in a process of its own with ``--json``, on the
converted model, vLLM on the CPU, and the stack's vLLM server.

1. A small matrix (4 bundled prompts, 16 tokens, the ``batch`` and ``dtype`` dimensions): one at a time, one at a
   time again, in static batches of 4, all at once, and float32 one at a time and all at once. The lane must replay
   itself bitwise (the second one-at-a-time run); the other cells are measured, and their structure is asserted
   (every request judged, fork positions for exactly the diverged ones, timings, memory), in the JSON report on
   stdout and the HTML report the command wrote.
2. Eight requests sent *at once* to the stack's vLLM server (bfloat16, default scheduler, prefix cache on) and
   recorded as envelopes with ``in_flight_at_start=8``; one whose one-at-a-time replay diverges is explained
   (variations ``alone`` and ``batch``). If none diverges, that is reported and the first one is explained.
   The explanation must agree with the evidence: the alone variation must fork exactly where the one-at-a-time
   replay forked (the lane is deterministic), "reproduced" must mean token identity with the recording, and
   the conclusion must name exactly the variations that reproduced it.

The matrix sends nothing to the stack's vLLM, yet it stays in the stack group: a group of one test is handed out
last (xdist's ``loadgroup`` orders groups by their number of tests), and its minute of one-core work then ended the
suite with the other core idle.

Both commands print exactly one JSON document on stdout and the engine's logging on stderr: these runs are the ones
tests/infra/cli/test_json_output.py counts for ``replay matrix --json`` and ``replay explain --json``. Each engine
configuration starts in a process of its own, and each start is the slow part of this module.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from infra.demo.services import clean_environment
from infra.stack.state import StackInfo
from replayer.compare import compare
from replayer.lanes.batch_engine import probe_platform, render_chat
from replayer.matrix.dimensions import BASELINE_CELL, plan_cells
from replayer.matrix.execution import CellJob, run_jobs
from replayer.matrix.explain import Explanation
from replayer.matrix.inputs import DEFAULT_PROMPTS, item_from_envelope
from replayer.matrix.report import render_table
from replayer.matrix.results import MatrixReport
from replayer.settings import Thresholds
from schemas import (
    Envelope,
)
from tests.cli_process import reprolane
from tests.replayer.support import envelope_from_completion

pytestmark = pytest.mark.stack

MAX_TOKENS = 16
TOP_K = 5
N_CONCURRENT = 8


def test_small_matrix_for_real(stack: StackInfo, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(list(DEFAULT_PROMPTS[:4])), encoding="utf-8")
    html = tmp_path / "matrix.html"
    ran = reprolane(
        "replay", "matrix", "--workload-file", str(prompts), "--cells", "batch,dtype", "--max-tokens", str(MAX_TOKENS),
        "--baseline", "single", "--json", "--html", str(html), env=clean_environment(stack.run_dir), timeout=1200,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = MatrixReport.model_validate(json.loads(ran.stdout))  # the whole of stdout is one document
    assert "vllm" in ran.stderr.lower(), "the engine's own logging should be there, on stderr"
    print("\n" + render_table(report))
    by = {c.name: c for c in report.cells}
    wanted = {BASELINE_CELL, "batch.single.again", "batch.fixed4", "batch.dynamic", "dtype.float32",
              "dtype.float32.dynamic"}  # fmt: skip
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
    page = html.read_text(encoding="utf-8")
    assert len(re.findall(r'<img alt="[^"]*" src="data:image/png;base64,', page)) == 2 + len(wanted)


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


def test_explain_a_request_recorded_under_concurrent_load(stack: StackInfo, tmp_path: Path) -> None:
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

    envelopes = tmp_path / "captured.jsonl"  # what the auditor hands the command: the recorded envelopes
    envelopes.write_bytes(b"".join(e.canonical() + b"\n" for e in captured))
    ran = reprolane(
        "replay", "explain", target.request_id, "--envelopes", str(envelopes), "--variations", "alone,batch", "--json",
        env=clean_environment(stack.run_dir), timeout=1200,
    )  # fmt: skip
    assert ran.returncode in (0, 1), ran.stderr[-3000:]
    ex = Explanation.model_validate(json.loads(ran.stdout))  # the whole of stdout is one document
    assert "vllm" in ran.stderr.lower(), "the engine's own logging should be there, on stderr"
    assert ran.returncode == ex.exit_code
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
