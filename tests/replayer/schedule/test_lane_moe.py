"""Mixture-of-experts on the schedule lane (issue 32): expert routing depends on every companion's content, so a
window replayed with filler companions cannot reproduce a batch, and one replayed with the real content of every
request of it can.

The model is a tiny Mixtral the test builds itself (`infra.model.tiny_moe`: random weights, a config of a family vLLM
serves, SmolLM2's tokenizer; saved locally, nothing downloaded). "Production" is an in-process vLLM engine with the
recorder (`replayer.schedule.engine.StepDriver`): four requests arrive within two steps, so they share
batches; the schedule lane replays their window once with all four (`ScheduleLane.replay_requests`), bitwise, and
refuses the window when one companion is missing, naming it.

The engines run in a process of their own (`python -m tests.replayer.schedule.test_lane_moe MODEL_DIR LOG_DIR OUT`,
which writes what it found to OUT as JSON): vLLM keeps its parallel groups per process, and a process whose first
engine was a dense model has no expert-parallel group, so an MoE engine cannot start after one (in the suite, the
dense lanes' tests run first in the same process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.model.tiny_moe import build_tiny_moe
from tests.replayer.schedule.test_lane_model import model_dir

pytestmark = pytest.mark.model


def check(moe_dir: Path, log_dir: Path) -> dict[str, Any]:
    """Production's run of four requests, the window replayed with all four, and with one missing (in this
    process: run it in one of its own)."""
    from replayer.errors import NotReplayableError
    from replayer.lanes.base import GenRequest
    from replayer.lanes.batch_engine import render_chat
    from replayer.matrix.inputs import DEFAULT_PROMPTS
    from replayer.schedule.engine import StepDriver
    from replayer.schedule.lane import ScheduleLane
    from replayer.settings import ReplayerSettings
    from schemas import SamplingContract

    greedy = SamplingContract(temperature=0.0, seed_scope="none")
    reqs = [
        GenRequest(ids, greedy, max_tokens=12, top_k_logprobs=3) for ids in render_chat(moe_dir, DEFAULT_PROMPTS[:4])
    ]
    prod = StepDriver(
        moe_dir, log_dir, num_threads=2, dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=256,
        max_model_len=1024, enable_prefix_caching=True, seed=0,
    )  # fmt: skip
    try:
        runs = prod.run([(0, reqs[0]), (0, reqs[1]), (1, reqs[2]), (1, reqs[3])])
        log = prod.log()
    finally:
        prod.close()
    assert log.engine is not None
    lane = ScheduleLane(ReplayerSettings(model_dir=moe_dir), log.engine)
    try:
        every = {rid: req for (rid, _), req in zip(runs, reqs, strict=True)}
        result = lane.replay_requests(log, every)
        missing = runs[2][0]
        try:
            lane.replay_requests(log, {rid: req for rid, req in every.items() if rid != missing})
            refusal = None
        except NotReplayableError as exc:
            refusal = str(exc)
        return {
            "moe": lane.moe,
            "shared_batches": max(len(s.scheduled) for s in log.steps.values()),
            "mismatch": None if result.steps.mismatch is None else repr(result.steps.mismatch),
            "fillers": len(result.fillers),
            "bitwise": {rid: result.outputs.get(rid) == out for rid, out in runs},
            "missing": missing,
            "refusal": refusal,
        }
    finally:
        lane.close()


def test_a_moe_window_replays_bitwise_with_every_requests_real_content_and_refuses_a_missing_one(
    tmp_path: Path,
) -> None:
    moe_dir = build_tiny_moe(model_dir(), tmp_path / "tiny-moe")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.replayer.schedule.test_lane_moe", str(moe_dir), str(tmp_path / "log"),
         str(tmp_path / "found.json")],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["moe"], "the tiny model was not taken for a mixture-of-experts one"
    assert found["shared_batches"] > 1, "the four requests never shared a batch"
    assert found["mismatch"] is None
    assert found["fillers"] == 0
    assert all(found["bitwise"].values()), found["bitwise"]  # token ids and logprobs, every request
    assert found["refusal"] is not None, "a window with a companion missing was replayed"
    assert f"not captured ({found['missing']}" in found["refusal"]


if __name__ == "__main__":
    Path(sys.argv[3]).write_text(json.dumps(check(Path(sys.argv[1]), Path(sys.argv[2]))))
