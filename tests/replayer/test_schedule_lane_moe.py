"""Mixture-of-experts on the schedule lane (issue 32): expert routing depends on every companion's content, so a
window replayed with filler companions cannot reproduce a batch, and one replayed with the real content of every
request of it can.

The model is a tiny Mixtral the test builds itself (`infra.tiny_moe`: random weights, a config of a family vLLM
serves, SmolLM2's tokenizer; saved locally, nothing downloaded). "Production" is an in-process vLLM engine with the
recorder (`replayer.lanes.schedule_engine.StepDriver`): four requests arrive within two steps, so they share
batches; the schedule lane replays their window once with all four (`ScheduleLane.replay_requests`), bitwise, and
refuses the window when one companion is missing, naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.tiny_moe import build_tiny_moe
from replayer.errors import NotReplayableError
from replayer.lanes.base import GenRequest
from replayer.lanes.batch_engine import render_chat
from replayer.lanes.schedule_engine import StepDriver
from replayer.lanes.schedule_lane import ScheduleLane
from replayer.matrix.inputs import DEFAULT_PROMPTS
from replayer.settings import ReplayerSettings
from schemas import SamplingContract
from tests.replayer.test_schedule_lane_model import model_dir

pytestmark = pytest.mark.model

GREEDY = SamplingContract(temperature=0.0, seed_scope="none")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Mixtral with four experts (two per token), random weights in bfloat16, SmolLM2's tokenizer."""
    return build_tiny_moe(model_dir(), tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="module")
def prod(moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StepDriver]:
    driver = StepDriver(
        moe_dir, tmp_path_factory.mktemp("moe-schedule"), num_threads=2, dtype="bfloat16", max_num_seqs=16,
        max_num_batched_tokens=256, max_model_len=1024, enable_prefix_caching=True, seed=0,
    )  # fmt: skip
    yield driver
    driver.close()


def test_a_moe_window_replays_bitwise_with_every_requests_real_content_and_refuses_a_missing_one(
    moe_dir: Path, prod: StepDriver
) -> None:
    reqs = [
        GenRequest(ids, GREEDY, max_tokens=12, top_k_logprobs=3) for ids in render_chat(moe_dir, DEFAULT_PROMPTS[:4])
    ]
    runs = prod.run([(0, reqs[0]), (0, reqs[1]), (1, reqs[2]), (1, reqs[3])])
    log = prod.log()
    assert log.engine is not None
    lane = ScheduleLane(ReplayerSettings(model_dir=moe_dir), log.engine)
    try:
        assert lane.moe, "the tiny model was not taken for a mixture-of-experts one"
        every = {rid: req for (rid, _), req in zip(runs, reqs, strict=True)}
        result = lane.replay_requests(log, every)
        assert result.steps.mismatch is None, result.steps.mismatch
        assert result.fillers == {}
        assert {rid: result.outputs[rid] for rid, _ in runs} == dict(runs)  # token ids and logprobs, bitwise

        missing = runs[2][0]
        with pytest.raises(NotReplayableError, match=f"not captured \\({missing}"):
            lane.replay_requests(log, {rid: req for rid, req in every.items() if rid != missing})
    finally:
        lane.close()
