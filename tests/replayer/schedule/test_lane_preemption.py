"""Preemption: a KV cache too small for the batch makes vLLM preempt (free a request's blocks and recompute it
later); the recorded number of KV blocks is given to the replay engine, so the same step preempts the same
request, and every request still replays bitwise.

Its own production and lane engines, in float32 as test_lane_model.py's (its docstring says why), with 13 KV
blocks of 128 tokens, one of them vLLM's null block: three ~475-token prompts take 4 blocks each; 64 tokens each,
EOS ignored, so the first decode that crosses a block boundary preempts the latest arrival.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from replayer.lanes.base import GenRequest
from replayer.lanes.batch_engine import render_chat
from replayer.matrix.inputs import DEFAULT_PROMPTS
from replayer.schedule.engine import StepDriver
from replayer.schedule.lane import ScheduleLane
from replayer.settings import ReplayerSettings
from schemas import SamplingContract
from tests.replayer.schedule.test_lane_model import DTYPE, model_dir

pytestmark = pytest.mark.model

GREEDY = SamplingContract(temperature=0.0, seed_scope="none", ignore_eos=True)


@pytest.fixture(scope="module")
def prod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StepDriver]:
    driver = StepDriver(
        model_dir(),
        tmp_path_factory.mktemp("prod-preempt"),
        num_threads=2,  # a production CPU engine's; with one, a batch's neighbours do not change a sum's order
        dtype=DTYPE,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=1024,
        num_gpu_blocks_override=13,
        enable_prefix_caching=True,
        seed=0,
    )
    yield driver
    driver.close()


def test_preempted_requests_replay_bitwise(prod: StepDriver) -> None:
    text = " ".join(DEFAULT_PROMPTS) * 8
    prompts = render_chat(model_dir(), [text[i * 150 : i * 150 + 2000] for i in range(3)])
    assert all(440 < len(p) < 500 for p in prompts), [len(p) for p in prompts]
    reqs = [GenRequest(p, GREEDY, max_tokens=64, top_k_logprobs=2) for p in prompts]
    runs = prod.run([(0, reqs[0]), (0, reqs[1]), (1, reqs[2])])
    log = prod.log()
    assert log.problems() == []
    assert any(s.preempted for s in log.steps.values()), "nothing was preempted"
    assert log.engine is not None
    assert log.engine.num_kv_blocks == 13
    lane = ScheduleLane(ReplayerSettings(model_dir=model_dir()), log.engine)
    try:
        for (rid, out), req in zip(runs, reqs, strict=True):
            result = lane.replay_target(log, rid, req)
            assert result.steps.mismatch is None, result.steps.mismatch
            assert result.schedule_reproduced, result.notes
            assert result.output == out
    finally:
        lane.close()
