"""Unit tests of `replayer.replay.replay_envelope` with a scripted in-memory lane."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from replayer.errors import NotReplayableError
from replayer.lanes import GenRequest, Lane
from replayer.replay import EXTRA_TOKENS, replay_envelope, server_view
from replayer.settings import ReplayerSettings
from schemas import (
    CapturedError,
    CapturedOutput,
    Choice,
    ReplayedOutput,
    RuntimeFingerprint,
    SamplingContract,
    StepLogprobs,
    Timings,
    TopCandidate,
)
from tests.factories import FIXED_TIME, envelope, runtime, step

REPLAYED_AT = datetime(2026, 7, 15, 8, 0, tzinfo=UTC)


@dataclass
class ScriptedLane:
    """Returns a fixed output and records how it was called."""

    output: ReplayedOutput
    fp: RuntimeFingerprint = field(default_factory=lambda: runtime(max_num_seqs=1, prefix_caching=False))
    name: str = "scripted"
    calls: list[GenRequest] = field(default_factory=list)

    def fingerprint(self) -> RuntimeFingerprint:
        return self.fp

    def replay(self, request: GenRequest) -> ReplayedOutput:
        self.calls.append(request)
        return self.output

    def close(self) -> None:
        pass


def recorded_as_replayed(**changes: object) -> ReplayedOutput:
    outcome = envelope().outcome
    assert isinstance(outcome, CapturedOutput)
    c = outcome.choices[0]
    base = ReplayedOutput(token_ids=c.token_ids, text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason)
    return base.model_copy(update=changes)


def test_bitwise_replay_builds_the_event() -> None:
    env = envelope()
    lane = ScriptedLane(recorded_as_replayed())
    assert isinstance(lane, Lane)
    result = replay_envelope(env, lane, ReplayerSettings(), now=lambda: REPLAYED_AT, reply_to="corr-1")
    ev = result.event
    assert ev.verdict == "bitwise"
    assert ev.target_met
    assert ev.cause_hint == "identical"
    assert ev.request_id == env.request_id
    assert ev.envelope_id == env.envelope_id()
    assert ev.lane == "scripted"
    assert ev.lane_fingerprint_sha256 == lane.fp.sha256()
    assert [d.field for d in ev.fingerprint_diffs] == ["max_num_seqs", "prefix_caching"]
    assert ev.replayed_at == REPLAYED_AT
    assert ev.reply_to == "corr-1"
    assert (ev.tenant, ev.workflow_id, ev.workflow_step) == ("acme-insurance", "claim-7781", 2)
    assert ev.replay_ms >= 0.0
    assert result.replayed == lane.output
    # the lane got the recorded prompt ids and contract, a bounded length and the recorded top-k
    request = lane.calls[0]
    assert env.prompt is not None
    assert request.prompt_token_ids == env.prompt.token_ids
    assert request.sampling == env.sampling
    assert request.max_tokens == 3 + EXTRA_TOKENS  # contract max_tokens 256, capped at recorded length + EXTRA_TOKENS
    assert request.top_k_logprobs == 5


def test_short_contract_max_tokens_is_used_as_is() -> None:
    env = envelope(
        sampling=SamplingContract(temperature=0.0, max_tokens=3, seed_scope="none", logprobs=None),
    )
    lane = ScriptedLane(recorded_as_replayed())
    replay_envelope(env, lane, ReplayerSettings())
    request = lane.calls[0]
    assert request.max_tokens == 3
    assert request.top_k_logprobs == 2  # no contract logprobs: the widest recorded top-k list


def test_divergence_names_fingerprint_fields() -> None:
    replayed = recorded_as_replayed(
        token_ids=(504, 9, 2), logprobs=(step(504, -0.01, (330, -4.75)), step(9, -0.1), step(2, -0.0001))
    )
    lane = ScriptedLane(replayed, fp=runtime(dtype="float32", engine="transformers"))
    ev = replay_envelope(envelope(), lane, ReplayerSettings()).event
    assert ev.verdict == "diverged"
    assert not ev.target_met
    assert ev.cause_hint == "fingerprint_changed"
    assert "engine" in ev.cause_detail
    assert "dtype" in ev.cause_detail
    assert ev.first_divergence is not None
    assert ev.first_divergence.position == 1


def test_worker_global_sample_cannot_meet_its_target() -> None:
    env = envelope(sampling=SamplingContract(temperature=0.7, seed_scope="worker_global", logprobs=5))
    ev = replay_envelope(env, ScriptedLane(recorded_as_replayed()), ReplayerSettings()).event
    assert ev.verdict == "bitwise"  # the outputs happen to agree ...
    assert not ev.target_met  # ... but a worker-global sample is not replayable evidence
    assert "worker_global" in ev.cause_detail
    assert ev.cause_hint == "identical"


def test_an_unseeded_sample_that_differs_is_blamed_on_its_missing_seed() -> None:
    """A sampled request without a seed that forks at its first token is not an input or forward-pass difference:
    its cause is the missing seed, named by field, with the remedy."""
    env = envelope(sampling=SamplingContract(temperature=0.7, seed_scope="worker_global", logprobs=5))
    replayed = recorded_as_replayed(
        token_ids=(9, 9, 2), logprobs=(step(9, -0.01), step(9, -0.1), step(2, -0.0001)), text="other"
    )
    ev = replay_envelope(env, ScriptedLane(replayed), ReplayerSettings()).event
    assert ev.verdict == "diverged"
    assert ev.first_divergence is not None
    assert ev.first_divergence.position == 0
    assert ev.cause_hint == "unseeded_sampling"
    assert ev.cause_detail.startswith("sampling.seed: ")
    assert "--inject-seed" in ev.cause_detail
    assert "forward-pass" not in ev.cause_detail.split(";")[0]


def test_a_seeded_sample_that_forks_at_its_first_token_keeps_the_forward_pass_cause() -> None:
    env = envelope(sampling=SamplingContract(temperature=0.7, seed=3, seed_scope="per_request", logprobs=5))
    replayed = recorded_as_replayed(token_ids=(9, 9, 2), logprobs=(step(9, -0.01), step(9, -0.1), step(2, -0.0001)))
    ev = replay_envelope(env, ScriptedLane(replayed, fp=runtime()), ReplayerSettings()).event
    assert ev.cause_hint == "fork_at_first_token"


def test_error_envelope_is_not_replayable() -> None:
    err = CapturedError(
        error_type="timeout", message="upstream took too long", timings=Timings(received_at=FIXED_TIME, upstream_ms=1.0)
    )
    with pytest.raises(NotReplayableError, match="timeout: upstream took too long"):
        replay_envelope(envelope(outcome=err), ScriptedLane(recorded_as_replayed()), ReplayerSettings())


def test_missing_prompt_ids_is_not_replayable() -> None:
    with pytest.raises(NotReplayableError, match="no prompt token ids"):
        replay_envelope(envelope(prompt=None), ScriptedLane(recorded_as_replayed()), ReplayerSettings())


def test_missing_sampling_is_not_replayable() -> None:
    with pytest.raises(NotReplayableError, match="no sampling contract"):
        replay_envelope(envelope(sampling=None), ScriptedLane(recorded_as_replayed()), ReplayerSettings())


def test_only_choice_zero_is_replayed() -> None:
    outcome = envelope().outcome
    assert isinstance(outcome, CapturedOutput)
    two = outcome.model_copy(
        update={"choices": (outcome.choices[0], Choice(index=1, token_ids=(7,), text="?", finish_reason="stop"))}
    )
    env = envelope(
        outcome=two,
        sampling=SamplingContract(temperature=0.7, n=2, seed=42, seed_scope="per_request", logprobs=5),
    )
    ev = replay_envelope(env, ScriptedLane(recorded_as_replayed()), ReplayerSettings()).event
    assert ev.verdict == "bitwise"
    assert "n=2" in ev.cause_detail


def test_semantic_similarity_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    import replayer.semantic

    seen: list[tuple[str, str]] = []

    def fake_similarity(a: str, b: str) -> float:
        seen.append((a, b))
        return 0.97

    monkeypatch.setattr(replayer.semantic, "similarity", fake_similarity)
    replayed = recorded_as_replayed(token_ids=(99, 3575, 2), text="Paris!", logprobs=None)
    env = envelope(target_level="semantic")
    ev = replay_envelope(env, ScriptedLane(replayed), ReplayerSettings(semantic=True)).event
    assert seen == [("Paris.", "Paris!")]
    assert ev.semantic_similarity == 0.97
    assert ev.verdict == "semantic"
    assert ev.target_met
    off = replay_envelope(env, ScriptedLane(replayed), ReplayerSettings()).event
    assert off.semantic_similarity is None
    assert off.verdict == "diverged"


def _whole_dict_step(sampled: int, sampled_lp: float, *ranked: tuple[int, float]) -> StepLogprobs:
    """A step as an in-process vLLM lane returns it: the sampled token first, then the top ranks."""
    first = TopCandidate(token=f"t{sampled}", token_id=sampled, logprob=sampled_lp, rank=len(ranked) + 1)
    rest = (TopCandidate(token=f"t{t}", token_id=t, logprob=lp, rank=i) for i, (t, lp) in enumerate(ranked, 1))
    top = (first, *rest)
    return StepLogprobs(token_id=sampled, token=f"t{sampled}", logprob=sampled_lp, top=top)


def test_the_replay_is_compared_on_the_view_the_recorded_endpoint_gave() -> None:
    """A sampled token outside the top-2: chat and responses servers list it and drop rank 2; completions list
    all three. The lane returns all three, and the replay takes the recorded endpoint's view."""
    whole = _whole_dict_step(9, -4.0, (11, -0.5), (12, -1.5))
    replayed = ReplayedOutput(token_ids=(9,), text="t9", logprobs=(whole,))
    for endpoint in ("chat.completions", "responses"):
        view = server_view(replayed, endpoint, 2)
        assert view.logprobs is not None
        assert [c.token_id for c in view.logprobs[0].top] == [9, 11]
    assert server_view(replayed, "completions", 2) == replayed

    chat_view = whole.model_copy(update={"top": whole.top[:2]})
    sampling = SamplingContract(temperature=0.8, seed=7, seed_scope="per_request", max_tokens=1, logprobs=2)
    outcome = CapturedOutput(
        choices=(Choice(index=0, token_ids=(9,), text="t9", logprobs=(chat_view,)),),
        timings=Timings(received_at=FIXED_TIME, upstream_ms=1.0),
    )
    env = envelope(sampling=sampling, outcome=outcome)
    result = replay_envelope(env, ScriptedLane(replayed), ReplayerSettings(), now=lambda: REPLAYED_AT)
    assert result.event.verdict == "bitwise"


def test_a_constrained_request_is_refused_on_another_structured_output_backend() -> None:
    """The grammar library builds the token mask: another backend or version may allow other tokens."""
    from schemas import OutputConstraint

    constraint = OutputConstraint(structured_outputs='{"choice":["a","b"]}')
    sampling = SamplingContract(temperature=0.0, seed_scope="none", logprobs=5, constraint=constraint)
    env = envelope(sampling=sampling, runtime=runtime(structured_outputs="backend=auto;xgrammar=0.2.8"))
    other = ScriptedLane(recorded_as_replayed(), fp=runtime(structured_outputs="backend=auto;xgrammar=0.2.9"))
    with pytest.raises(NotReplayableError, match=r"runtime.structured_outputs differs.*sampling.constraint"):
        replay_envelope(env, other, ReplayerSettings())
    same = ScriptedLane(recorded_as_replayed(), fp=runtime(structured_outputs="backend=auto;xgrammar=0.2.8"))
    assert replay_envelope(env, same, ReplayerSettings()).event.verdict == "bitwise"
    plain = envelope(runtime=runtime(structured_outputs="backend=auto;xgrammar=0.2.8"))
    assert replay_envelope(plain, other, ReplayerSettings()).event.verdict == "bitwise"  # nothing masked: no refusal


def test_a_fork_inside_a_tool_calls_arguments_is_named_in_the_event() -> None:
    from schemas import Choice, ToolCall

    pieces = ["<tool_call>", '{"name": "f", ', '"arguments": ', '{"a": ', "1", "}}", "</tool_call>"]
    steps = tuple(StepLogprobs(token_id=100 + i, token=t, logprob=-0.5) for i, t in enumerate(pieces))
    call = ToolCall(name="f", arguments='{"a": 1}')
    recorded = Choice(index=0, token_ids=tuple(range(100, 107)), text="", logprobs=steps, tool_calls=(call,))
    timings = Timings(received_at=FIXED_TIME, upstream_ms=1.0)
    sampling = SamplingContract(temperature=0.0, seed_scope="none", logprobs=0)
    env = envelope(outcome=CapturedOutput(choices=(recorded,), timings=timings), sampling=sampling)
    other = (*steps[:4], StepLogprobs(token_id=7, token="2", logprob=-0.4), *steps[5:])
    replayed = ReplayedOutput(token_ids=tuple(s.token_id for s in other), text="", logprobs=other)
    ev = replay_envelope(env, ScriptedLane(replayed, fp=runtime()), ReplayerSettings()).event
    assert ev.first_divergence is not None
    assert ev.first_divergence.position == 4
    assert "the fork is inside the arguments of tool call 0 (f)" in ev.cause_detail
