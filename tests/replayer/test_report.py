"""The human report: fork marking, near tie vs confident flip, fingerprint diffs, workflow summary."""

from __future__ import annotations

from typing import Any

from replayer.replay import replay_envelope
from replayer.report import WorkflowStep, mark_fork, render_divergence, render_request, render_workflow
from replayer.settings import ReplayerSettings
from schemas import CapturedOutput, Choice, Envelope, ReplayResult, Timings
from tests import factories
from tests.replayer.support import FakeLane, make_envelope

SETTINGS = ReplayerSettings()


def replayed(env: Envelope, diverge_at: int | None = None, lane: FakeLane | None = None) -> ReplayResult:
    lane = lane or FakeLane()
    lane.learn(env, diverge_at=diverge_at)
    return replay_envelope(env, lane, SETTINGS)


def near_tie_envelope(**overrides: Any) -> Envelope:
    steps = (
        factories.step(504, -0.01, (330, -4.75), (7, -6.0)),
        factories.step(3575, -0.70, (28, -0.72), (11, -3.0)),
        factories.step(2, -0.0001, (5, -9.0), (6, -9.5)),
    )
    outcome = CapturedOutput(
        choices=(Choice(index=0, token_ids=(504, 3575, 2), text="t504t3575t2", finish_reason="stop", logprobs=steps),),
        timings=Timings(received_at=factories.FIXED_TIME, upstream_ms=1.0),
    )
    return make_envelope(1, outcome=outcome, **overrides)


def test_mark_fork_with_token_text() -> None:
    env = make_envelope(1)
    assert isinstance(env.outcome, CapturedOutput)
    choice = env.outcome.choices[0]
    assert mark_fork(choice.token_ids, choice.logprobs, 1) == "t504⟦t3575t2⟧"
    assert mark_fork(choice.token_ids, choice.logprobs, 0) == "⟦t504t3575t2⟧"


def test_mark_fork_without_token_text_shows_ids() -> None:
    assert mark_fork((5, 6, 7), None, 2) == "[ids] 5 6 ⟦7⟧"


def test_mark_fork_truncates_long_text() -> None:
    steps = tuple(factories.step(i, -0.1) for i in range(100))
    text = mark_fork(tuple(range(100)), steps, 50)
    assert text.startswith("…")
    assert text.endswith("⟧…")
    assert "⟦t50t51t52t53t54t55t56t57⟧" in text


def test_confident_flip_report() -> None:
    env = make_envelope(1)
    out = render_request(env, replayed(env, diverge_at=1))
    assert "Verdict: diverged   target level: token — NOT MET" in out
    assert "confident flip (recorded top-1/top-2 margin 1.25)" in out
    assert "max_num_seqs     256 → 1" in out
    assert "recorded: t504⟦t3575t2⟧" in out
    assert "replayed: t504⟦t28⟧" in out
    assert "Cause: fingerprint_changed" in out


def test_near_tie_report() -> None:
    env = near_tie_envelope()
    out = render_request(env, replayed(env, diverge_at=1))
    assert "near tie (recorded top-1/top-2 margin 0.02)" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("1 ", "2 ", "3 "))]
    assert rows[0].split() == ["1", "*", '"t3575"', "#3575", "-0.7000", "*", '"t28"', "#28", "-0.7000"]
    assert rows[2].split() == ["3", '"t11"', "#11", "-3.0000", '"t11"', "#11", "-3.0000"]


def test_identical_report_has_no_fork_and_says_so() -> None:
    env = make_envelope(2, runtime=factories.runtime(max_num_seqs=1, prefix_caching=False, batch_invariant=True))
    out = render_request(env, replayed(env))
    assert "Verdict: bitwise" in out
    assert "— met" in out
    assert "Token ids: identical" in out
    assert "no known field differs" in out
    assert "⟦" not in out


def test_render_divergence_is_the_fork_block_of_the_full_report() -> None:
    env = near_tie_envelope()
    result = replayed(env, diverge_at=1)
    block = render_divergence(env, result)
    assert block.startswith("First divergence: generated token 1, near tie")
    assert "replayed: t504⟦t28⟧" in block
    assert block in render_request(env, result)
    assert "Verdict" not in block
    same = make_envelope(2)
    assert render_divergence(same, replayed(same)) == ""


def test_workflow_report_names_the_first_failing_step() -> None:
    wf = "wf-report"
    steps = [
        WorkflowStep(e, replayed(e, d))
        for e, d in (
            (make_envelope(0, workflow=wf), None),
            (make_envelope(1, workflow=wf), 2),
            (make_envelope(2, workflow=wf), 0),
        )
    ]
    failed = make_envelope(3, workflow=wf)
    steps.append(WorkflowStep(failed, None, "the request ended in an error"))
    out = render_workflow(wf, steps)
    assert f"First diverging step: 1 (request {steps[1].envelope.request_id})" in out
    assert "skipped: the request ended in an error" in out
    assert out.count("Replay of request") == 1


def test_alternatives_recorded_by_id_only_borrow_the_text_of_the_same_id() -> None:
    from replayer.report import _side_by_side
    from schemas import TopCandidate

    recorded = (TopCandidate(token="", token_id=7, logprob=-1.0), TopCandidate(token="", token_id=99, logprob=-2.0))
    replayed = (TopCandidate(token=" party", token_id=7, logprob=-1.1),)
    lines = _side_by_side(recorded, replayed, (7, 7))
    assert '" party" #7 -1.0000' in lines[1]
    assert '"" #99 -2.0000' in lines[2]  # no text anywhere for that id: shown as recorded
