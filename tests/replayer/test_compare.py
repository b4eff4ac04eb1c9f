"""Unit tests of `replayer.compare`: hand-built recorded/replayed pairs, one per rule."""

from __future__ import annotations

import pytest

from replayer.compare import compare, output_arrays
from replayer.settings import Thresholds
from schemas import Choice, FieldDiff, ReplayedOutput, StepLogprobs, TopCandidate
from tests.factories import step

TH = Thresholds()

# Three confident steps: chosen token far ahead of the runner-up.
BASE = (
    step(10, -0.01, (11, -5.0), (12, -6.0)),
    step(20, -0.02, (21, -4.0), (22, -7.0)),
    step(30, -0.03, (31, -4.5), (32, -8.0)),
)


def rec(steps: tuple[StepLogprobs, ...] = BASE) -> Choice:
    return Choice(index=0, token_ids=tuple(s.token_id for s in steps), text="x", logprobs=steps)


def rep(steps: tuple[StepLogprobs, ...] = BASE) -> ReplayedOutput:
    return ReplayedOutput(token_ids=tuple(s.token_id for s in steps), text="x", logprobs=steps)


def nudge(s: StepLogprobs, delta: float) -> StepLogprobs:
    """Every logprob of a step shifted by delta (ids and order unchanged)."""
    top = tuple(c.model_copy(update={"logprob": c.logprob + delta}) for c in s.top)
    return s.model_copy(update={"logprob": s.logprob + delta, "top": top})


def test_identical_is_bitwise() -> None:
    c = compare(rec(), rep(), TH, "bitwise")
    assert c.verdict == "bitwise"
    assert c.levels_held == ("bitwise", "token", "numeric", "semantic")
    assert c.target_met
    assert c.cause_hint == "identical"
    assert c.first_divergence is None
    assert c.max_abs_logprob_diff == 0.0
    assert c.max_rank_shift == 0
    assert c.token_match_rate == 1.0
    assert (c.recorded_length, c.replayed_length, c.length_diff) == (3, 3, 0)


def test_token_identical_small_drift_holds_numeric() -> None:
    drifted = (BASE[0], nudge(BASE[1], -0.004), BASE[2])
    c = compare(rec(), rep(drifted), TH, "numeric")
    assert c.verdict == "token"
    assert c.levels_held == ("token", "numeric", "semantic")
    assert c.target_met
    assert c.cause_hint == "numeric_drift_no_fork"
    assert c.max_abs_logprob_diff == pytest.approx(0.004)
    assert c.first_divergence is None


def test_token_identical_drift_beyond_threshold_fails_numeric() -> None:
    drifted = (BASE[0], nudge(BASE[1], -0.2), BASE[2])
    c = compare(rec(), rep(drifted), TH, "numeric")
    assert c.verdict == "token"
    assert "numeric" not in c.levels_held
    assert not c.target_met
    assert c.max_abs_logprob_diff == pytest.approx(0.2)


def test_relative_threshold_binds_on_its_own() -> None:
    drifted = (BASE[0], nudge(BASE[1], -0.03), BASE[2])  # abs 0.03 <= 0.05; rel 0.03 / max(0.05, 0.1) = 0.3
    assert "numeric" in compare(rec(), rep(drifted), TH, "numeric").levels_held
    strict = Thresholds(max_rel_logprob_diff=0.2)
    assert "numeric" not in compare(rec(), rep(drifted), strict, "numeric").levels_held


def test_top_k_difference_alone_breaks_bitwise_only() -> None:
    alt = BASE[2].top[1].model_copy(update={"logprob": -4.5001})
    changed = (BASE[0], BASE[1], BASE[2].model_copy(update={"top": (BASE[2].top[0], alt, BASE[2].top[2])}))
    c = compare(rec(), rep(changed), TH, "bitwise")
    assert c.verdict == "token"
    assert "bitwise" not in c.levels_held
    assert c.max_abs_logprob_diff == 0.0
    assert c.cause_hint == "numeric_drift_no_fork"


def test_rank_shift_beyond_threshold_fails_numeric() -> None:
    four = (step(10, -0.01, (11, -5.0), (12, -6.0), (13, -7.0)),)
    moved = (step(10, -0.01, (13, -5.0), (11, -6.0), (12, -7.0)),)  # token 13 moves from rank 4 to rank 2
    c = compare(rec(four), rep(moved), TH, "numeric")
    assert c.max_rank_shift == 2
    assert "numeric" not in c.levels_held
    assert "numeric" in compare(rec(four), rep(moved), Thresholds(max_rank_shift=2), "numeric").levels_held


def test_fork_at_first_token_confident_flip() -> None:
    other = (step(99, -0.01, (98, -6.0)), *BASE[1:])
    c = compare(rec(), rep(other), TH, "token")
    assert c.verdict == "diverged"
    assert c.levels_held == ()
    assert c.cause_hint == "fork_at_first_token"
    fd = c.first_divergence
    assert fd is not None
    assert fd.position == 0
    assert fd.before is None
    assert fd.at.recorded_token_id == 10
    assert fd.at.replayed_token_id == 99
    assert fd.at.recorded_margin == pytest.approx(4.99)
    assert fd.at.replayed_margin == pytest.approx(5.99)
    assert not fd.near_tie
    assert c.token_match_rate == pytest.approx(2 / 3)


def test_late_fork_near_tie_flip_holds_numeric() -> None:
    recorded = (BASE[0], step(20, -0.69, (21, -0.70), (22, -5.0)), BASE[2])
    replayed = (BASE[0], step(21, -0.69, (20, -0.70), (22, -5.0)), step(40, -0.1, (41, -3.0)))
    c = compare(rec(recorded), rep(replayed), TH, "numeric")
    fd = c.first_divergence
    assert fd is not None
    assert fd.position == 1
    assert fd.near_tie
    assert fd.before is not None
    assert fd.before.position == 0
    assert fd.before.recorded_token_id == fd.before.replayed_token_id == 10
    assert c.cause_hint == "late_fork_numeric_drift"
    assert c.levels_held == ("numeric",)
    assert c.verdict == "numeric"
    assert c.target_met
    assert c.max_abs_logprob_diff == pytest.approx(0.01)
    assert c.max_rank_shift == 1


def test_late_fork_confident_flip_fails_numeric() -> None:
    replayed = (BASE[0], step(21, -0.01, (22, -6.0), (23, -7.0)), BASE[2])  # token 20 gone from the top-k
    c = compare(rec(), rep(replayed), TH, "numeric")
    fd = c.first_divergence
    assert fd is not None
    assert fd.position == 1
    assert not fd.near_tie
    assert c.verdict == "diverged"
    assert not c.target_met
    assert "missing from the other side's top-k" in c.cause_detail


def test_length_only() -> None:
    c = compare(rec(), rep(BASE[:2]), TH, "token")
    assert c.cause_hint == "length_only"
    assert c.verdict == "numeric"  # the common prefix is identical; ids differ only by length
    assert "token" not in c.levels_held
    assert c.length_diff == -1
    fd = c.first_divergence
    assert fd is not None
    assert fd.position == 2
    assert fd.at.recorded_token_id == 30
    assert fd.at.replayed_token_id is None
    assert c.token_match_rate == pytest.approx(2 / 3)


def test_fingerprint_change_is_the_hint_when_tokens_diverge() -> None:
    other = (step(99, -0.01, (98, -6.0)), *BASE[1:])
    diffs = (FieldDiff(field="dtype", recorded="bfloat16", replayed="float32"),)
    c = compare(rec(), rep(other), TH, "token", fingerprint_diffs=diffs)
    assert c.cause_hint == "fingerprint_changed"
    assert "dtype" in c.cause_detail
    same = compare(rec(), rep(), TH, "token", fingerprint_diffs=diffs)
    assert same.cause_hint == "identical"  # a changed fingerprint that still replays is not a divergence


def test_top_k_matched_by_string_when_ids_missing() -> None:
    def no_ids(s: StepLogprobs, order: tuple[int, ...]) -> StepLogprobs:
        top = tuple(TopCandidate(token=s.top[i].token, logprob=s.top[i].logprob) for i in order)
        return s.model_copy(update={"top": top})

    recorded = tuple(no_ids(s, (0, 1, 2)) for s in BASE)
    swapped = (BASE[0], BASE[1], BASE[2].model_copy(update={"top": (BASE[2].top[0], BASE[2].top[2], BASE[2].top[1])}))
    # replayed keeps its ids but its last two alternatives swap ranks (their logprobs too): a shift of 1 by string
    swapped_lp = (
        *swapped[:2],
        swapped[2].model_copy(
            update={
                "top": (
                    swapped[2].top[0],
                    swapped[2].top[1].model_copy(update={"logprob": -4.5}),
                    swapped[2].top[2].model_copy(update={"logprob": -8.0}),
                )
            }
        ),
    )
    c = compare(rec(recorded), rep(swapped_lp), TH, "numeric")
    assert c.max_rank_shift == 1
    assert "numeric" in c.levels_held
    assert "bitwise" not in c.levels_held
    assert compare(rec(recorded), rep(tuple(no_ids(s, (0, 1, 2)) for s in BASE)), TH, "bitwise").verdict == "bitwise"


def test_semantic_level_from_similarity() -> None:
    other = (step(99, -0.01, (98, -6.0)), *BASE[1:])
    assert compare(rec(), rep(other), TH, "semantic", semantic_similarity=0.95).verdict == "semantic"
    low = compare(rec(), rep(other), TH, "semantic", semantic_similarity=0.5)
    assert low.verdict == "diverged"
    assert not low.target_met


def test_without_logprobs_only_token_level_can_hold() -> None:
    plain = Choice(index=0, token_ids=(10, 20, 30), text="x")
    c = compare(plain, rep(), TH, "bitwise")
    assert c.levels_held == ("token", "semantic")
    assert not c.target_met
    assert c.max_abs_logprob_diff is None
    assert c.cause_hint == "identical"


def test_output_arrays_sorts_and_pads() -> None:
    unsorted = StepLogprobs(
        token_id=5,
        logprob=-2.0,
        top=(TopCandidate(token="a", token_id=7, logprob=-1.0), TopCandidate(token="b", token_id=5, logprob=-0.5)),
    )
    arr = output_arrays((5, 6), (unsorted, step(6, -0.1)))
    assert arr.top_ids.tolist() == [[5, 7], [6, -1]]
    assert arr.top_n.tolist() == [2, 1]
    with pytest.raises(ValueError, match="logprobs cover 1 steps"):
        output_arrays((5, 6), (unsorted,))


def test_empty_outputs() -> None:
    empty_rec = Choice(index=0, token_ids=(), text="", logprobs=())
    c = compare(empty_rec, ReplayedOutput(token_ids=(), text="", logprobs=()), TH, "token")
    assert c.verdict == "bitwise"  # nothing generated on either side: trivially identical
    assert c.levels_held == ("bitwise", "token", "numeric", "semantic")
    assert c.first_divergence is None
    assert c.token_match_rate == 1.0


def test_uneven_top_k_widths_are_padded_without_numeric_warnings() -> None:
    """Steps reporting different numbers of alternatives (3, then 1) must not produce NaN (-W error)."""

    arrays = output_arrays((1, 4), (step(1, -0.1, (2, -1.0), (3, -2.0)), step(4, -0.1)))
    assert arrays.top_n.tolist() == [3, 1]
    assert arrays.top_ids[1].tolist() == [4, -1, -1]


def test_equal_logprobs_listed_in_another_order_are_still_bitwise() -> None:
    """A server lists the sampled token first among candidates of equal logprob, a lane by vLLM's rank (measured
    on the demo's sampled requests): the same numbers, so the same level; a different id among them is not."""

    def listed(*pairs: tuple[int, float]) -> StepLogprobs:
        top = tuple(TopCandidate(token=f"t{t}", token_id=t, logprob=lp, rank=i) for i, (t, lp) in enumerate(pairs, 1))
        return StepLogprobs(token_id=808, token="t808", logprob=-3.17, top=top)

    server = listed((808, -3.17), (4211, -1.17), (768, -1.42), (1695, -3.17), (1867, -3.29))
    lane = listed((4211, -1.17), (768, -1.42), (1695, -3.17), (808, -3.17), (1867, -3.29))
    c = compare(rec((server,)), rep((lane,)), TH, "bitwise")
    assert c.verdict == "bitwise"
    assert c.max_rank_shift == 0
    other = listed((4211, -1.17), (768, -1.42), (1696, -3.17), (808, -3.17), (1867, -3.29))
    assert compare(rec((server,)), rep((other,)), TH, "bitwise").verdict == "token"


def test_equal_logprobs_matched_by_text_are_put_in_text_order_on_both_sides() -> None:
    """A client that asks its own logprobs gets text alternatives (no ids); the lane has ids. Equal logprobs must
    then be ordered by text on both sides, not by id on one and by text on the other."""
    recorded = StepLogprobs(
        token_id=33,
        token="A",
        logprob=-1.1,
        top=(TopCandidate(token="A", logprob=-1.1), TopCandidate(token="B", logprob=-1.1)),
    )
    replayed = StepLogprobs(
        token_id=33,
        token="A",
        logprob=-1.1,
        top=(TopCandidate(token="B", token_id=7, logprob=-1.1), TopCandidate(token="A", token_id=33, logprob=-1.1)),
    )
    assert compare(rec((recorded,)), rep((replayed,)), TH, "bitwise").verdict == "bitwise"


def test_either_side_may_come_as_arrays_already() -> None:
    """The benchmark converts once and compares many times: the arrays give the same comparison as the outputs."""
    forked = (BASE[0], step(21, -4.0, (20, -0.02), (22, -7.0)), BASE[2])
    for replayed in (rep(), rep(forked)):
        expected = compare(rec(), replayed, TH, "numeric")
        rec_arrays = output_arrays(rec().token_ids, rec().logprobs)
        rep_arrays = output_arrays(replayed.token_ids, replayed.logprobs)
        assert compare(rec_arrays, rep_arrays, TH, "numeric") == expected
        assert compare(rec(), rep_arrays, TH, "numeric") == expected
