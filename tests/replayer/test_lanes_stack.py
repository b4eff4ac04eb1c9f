"""The lanes against the real stack: a request recorded from the stack's vLLM server, replayed on each lane.

The "recorded" side is one lone greedy request to the session stack's vLLM server (bfloat16, default scheduler
with prefix caching): token-id prompt, 12 tokens, top-5 logprobs, ids returned. It is replayed on

- the in-process vLLM lane (bfloat16, one sequence at a time, no prefix cache): measured bitwise identical;
- the remote lane pointed at the same server: bitwise identical;
- the transformers reference lane (float32): the same tokens, not the same logprobs (measured), with the
  fingerprint diff naming engine and dtype.

One engine per lane for the whole module (an engine start is the slow part of a lane test).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from infra.stack.state import StackInfo
from replayer.lanes import GenRequest, Lane, make_lane
from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from schemas import (
    Envelope,
    SamplingContract,
)
from tests.replayer.support import record_from_stack

pytestmark = pytest.mark.stack

MESSAGES = [{"role": "user", "content": "Name three primary colors and explain why."}]
MAX_TOKENS = 12
TOP_K = 5
GREEDY_TOP_K = SamplingContract(temperature=0.0, seed_scope="none", logprobs=TOP_K)


@pytest.fixture(scope="module")
def recorded(stack: StackInfo) -> Envelope:
    """One lone greedy request to the stack's vLLM server, as an envelope."""
    return record_from_stack(stack, "lanes-stack-001", MESSAGES, max_tokens=MAX_TOKENS, top_k=TOP_K)


def _lane(settings: ReplayerSettings) -> Iterator[Lane]:
    lane = make_lane(settings)
    try:
        yield lane
    finally:
        lane.close()


@pytest.fixture(scope="module")
def vllm_lane(stack: StackInfo) -> Iterator[Lane]:
    yield from _lane(ReplayerSettings(lane="vllm", model_dir=stack.model_dir, dtype="bfloat16"))


@pytest.fixture(scope="module")
def remote_lane(stack: StackInfo) -> Iterator[Lane]:
    yield from _lane(ReplayerSettings(lane="remote", remote_url=stack.vllm_url, served_model_name=stack.model_name))


@pytest.fixture(scope="module")
def transformers_lane(stack: StackInfo) -> Iterator[Lane]:
    yield from _lane(ReplayerSettings(lane="transformers", model_dir=stack.model_dir))


def test_vllm_lane_replays_the_server_bitwise(recorded: Envelope, vllm_lane: Lane) -> None:
    fp = vllm_lane.fingerprint()
    assert (fp.engine, fp.device, fp.dtype, fp.max_num_seqs, fp.prefix_caching) == ("vllm", "cpu", "bfloat16", 1, False)
    assert fp.engine_version == recorded.runtime.engine_version
    ev = replay_envelope(recorded, vllm_lane, ReplayerSettings()).event
    assert ev.verdict == "bitwise", ev.cause_detail
    assert ev.target_met
    assert ev.cause_hint == "identical"
    assert ev.max_abs_logprob_diff == 0.0
    assert [d.field for d in ev.fingerprint_diffs] == ["prefix_caching"]


def test_vllm_lane_replays_itself_bitwise(recorded: Envelope, vllm_lane: Lane) -> None:
    first = replay_envelope(recorded, vllm_lane, ReplayerSettings()).replayed
    again = replay_envelope(recorded, vllm_lane, ReplayerSettings()).replayed
    assert first == again


def test_vllm_lane_replays_alike_from_any_thread(recorded: Envelope, vllm_lane: Lane) -> None:
    """The service replays in asyncio's worker threads, whichever is free; OpenMP's thread count is per thread,
    and an engine stepped from a thread other than the one it was built on aborts in vLLM's CPU attention."""
    assert recorded.prompt is not None
    long_prompt = (recorded.prompt.token_ids * 40)[:700]  # long enough for the attention kernel to split work
    request = GenRequest(long_prompt, GREEDY_TOP_K, max_tokens=4, top_k_logprobs=TOP_K)
    here = vllm_lane.replay(request)
    with ThreadPoolExecutor(2) as pool:
        there = [pool.submit(vllm_lane.replay, request) for _ in range(2)]
        assert [f.result() for f in there] == [here, here]


def test_vllm_lane_seeded_sampling_replays_exactly(recorded: Envelope, vllm_lane: Lane) -> None:
    assert recorded.prompt is not None
    sampled = SamplingContract(temperature=0.8, seed=7, seed_scope="per_request", logprobs=TOP_K)
    request = GenRequest(recorded.prompt.token_ids, sampled, max_tokens=MAX_TOKENS, top_k_logprobs=TOP_K)
    a = vllm_lane.replay(request)
    b = vllm_lane.replay(request)
    other = vllm_lane.replay(replace(request, sampling=sampled.model_copy(update={"seed": 8})))
    assert a == b
    assert a.token_ids != other.token_ids


def test_remote_lane_replays_the_server_bitwise(recorded: Envelope, remote_lane: Lane) -> None:
    fp = remote_lane.fingerprint()
    assert fp.engine_version == recorded.runtime.engine_version
    assert fp.system_fingerprint == recorded.runtime.system_fingerprint
    ev = replay_envelope(recorded, remote_lane, ReplayerSettings()).event
    assert ev.verdict == "bitwise", ev.cause_detail
    assert ev.fingerprint_diffs == ()


def test_transformers_lane_matches_tokens_not_logprobs(recorded: Envelope, transformers_lane: Lane) -> None:
    ev = replay_envelope(recorded, transformers_lane, ReplayerSettings()).event
    assert ev.verdict == "token", ev.cause_detail
    assert "bitwise" not in ev.levels_held
    assert ev.max_abs_logprob_diff is not None
    assert ev.max_abs_logprob_diff > 0.0
    assert ev.cause_hint == "numeric_drift_no_fork"
    fields = [d.field for d in ev.fingerprint_diffs]
    assert "engine" in fields
    assert "dtype" in fields
    assert "dtype" in ev.cause_detail
