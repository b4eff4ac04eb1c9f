"""Recorded vs replayed output, judged against the reproducibility levels: pure and vectorised.

Two steps, timed separately (``benchmarks/bench_compare.py``; the figures are in BENCHMARKS.md):

1. `output_arrays` turns a pydantic output (token ids + per-step `StepLogprobs`) into numpy arrays once:
   chosen ids and logprobs ``(n,)``, top-k ids and logprobs ``(n, k)`` sorted by logprob (descending; equal
   logprobs by token id, `candidate_order`) and padded.
   This walks the pydantic tuples (one attribute read per candidate), so it is the cost to watch: it grows with
   steps x k in Python, and dominates the comparison.
2. `compare` decides everything with array operations; no Python loop over the sequence length, so it
   costs a small fraction of the conversion, identical outputs or not (at a fork, most of it is building the two
   `StepCandidates` records).

The levels (see `schemas.levels`):

- **bitwise**: identical token ids, identical chosen-token logprobs, identical top-k (ids and logprobs, compared
  column by column over the width both sides reported) at every step. Needs logprobs on both sides. Candidates
  with equal logprobs (frequent in bfloat16) are put in token-id order on both sides: which of two equal
  numbers a top-k kernel lists first is not a number, and servers list the sampled token first among its equals.
- **token**: identical token ids (and therefore identical lengths).
- **numeric**: over the *numeric window* = the common prefix (positions before the first divergence, or all of
  the shorter output if none) plus the fork step itself:

  * max |delta chosen logprob| <= ``max_abs_logprob_diff`` and max relative diff <= ``max_rel_logprob_diff``, where
    relative = |a - b| / max(|a|, |b|, `REL_DENOMINATOR_FLOOR`); the floor keeps near-certain tokens
    (logprob ~ 0, where bfloat16 rounding alone gives relative differences of 100%) from failing on noise;
  * at the fork, each side's chosen token is looked up in the other side's top-k and its two logprobs join the
    diffs above; a chosen token missing from the other top-k fails the level (a confident flip), while a
    near-tie flip (both tokens present, logprobs close) holds it: numeric allows ids to differ *after* the window;
  * for every token present in both top-k lists at a window step, |rank shift| <= ``max_rank_shift``
    (rank = position in the list sorted by logprob).

  Needs logprobs on both sides and a non-empty window.
- **semantic**: the caller computed a similarity and it is >= ``semantic_min_similarity``; token-identical
  outputs hold it without a similarity (identical ids decode to identical text).

Top-k alternatives are matched by ``token_id`` when every candidate on both sides carries one, else by the token
string (a slower path that interns strings in Python). The verdict is the strictest level held, in the order
bitwise > token > numeric > semantic, else ``diverged``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from replayer.settings import Thresholds
from schemas import (
    Choice,
    FieldDiff,
    FirstDivergence,
    ReplayedOutput,
    ReproLevel,
    StepCandidates,
    StepLogprobs,
    TopCandidate,
)
from schemas.replay import CauseHint, Verdict

__all__ = [
    "REL_DENOMINATOR_FLOOR",
    "Comparison",
    "OutputArrays",
    "candidate_order",
    "compare",
    "output_arrays",
]

#: Denominator floor of the relative logprob difference (nats); see the module docstring.
REL_DENOMINATOR_FLOOR = 0.1

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

_PAD_REC = -1  # padding keys differ per side so that padding never matches padding
_PAD_REP = -2


@dataclass(frozen=True, eq=False)
class OutputArrays:
    """One output as arrays (built once by `output_arrays`; treat as read-only)."""

    ids: IntArray  # (n,) chosen token ids
    chosen_lp: FloatArray | None  # (n,) chosen-token logprobs; None when the output has no logprobs
    top_ids: IntArray  # (n, k) top-k ids sorted by logprob desc; -1 = padding or id unknown
    top_lp: FloatArray  # (n, k) matching logprobs; -inf = padding
    top_n: IntArray  # (n,) how many candidates each step reported
    ids_complete: bool  # every candidate carries a token id
    steps: tuple[StepLogprobs, ...] | None  # the source records (for StepCandidates and string matching)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True)
class Comparison:
    """Everything `schemas.DivergenceEvent` needs from a comparison."""

    levels_held: tuple[ReproLevel, ...]
    verdict: Verdict
    target_level: ReproLevel
    target_met: bool
    first_divergence: FirstDivergence | None
    max_abs_logprob_diff: float | None
    max_rel_logprob_diff: float | None
    max_rank_shift: int | None
    token_match_rate: float
    recorded_length: int
    replayed_length: int
    semantic_similarity: float | None
    cause_hint: CauseHint
    cause_detail: str

    @property
    def length_diff(self) -> int:
        return self.replayed_length - self.recorded_length


def output_arrays(token_ids: Sequence[int], steps: Sequence[StepLogprobs] | None) -> OutputArrays:
    """Convert one output to arrays. ``steps`` must be aligned with ``token_ids`` when given."""
    ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    n = ids.shape[0]
    if steps is None:
        return OutputArrays(
            ids=ids,
            chosen_lp=None,
            top_ids=np.full((n, 0), -1, dtype=np.int64),
            top_lp=np.full((n, 0), -np.inf),
            top_n=np.zeros(n, dtype=np.int64),
            ids_complete=True,
            steps=None,
        )
    if len(steps) != n:
        raise ValueError(f"logprobs cover {len(steps)} steps but there are {n} token ids")
    steps = tuple(steps)
    chosen_lp = np.fromiter((s.logprob for s in steps), dtype=np.float64, count=n)
    top_n = np.fromiter((len(s.top) for s in steps), dtype=np.int64, count=n)
    k = int(top_n.max()) if n else 0
    top_ids = np.full((n, k), -1, dtype=np.int64)
    top_lp = np.full((n, k), -np.inf)
    ids_complete = True
    if k:
        # One flat pass per field over all candidates, then a single scatter into the padded arrays.
        flat = [c for s in steps for c in s.top]
        try:
            flat_ids = np.array([c.token_id for c in flat], dtype=np.int64)
        except TypeError:  # some candidate has no id: matched by string later
            ids_complete = False
            flat_ids = np.array([-1 if c.token_id is None else c.token_id for c in flat], dtype=np.int64)
        rows = np.repeat(np.arange(n), top_n)
        starts = np.cumsum(top_n) - top_n
        cols = np.arange(rows.shape[0]) - np.repeat(starts, top_n)
        top_ids[rows, cols] = flat_ids
        top_lp[rows, cols] = np.array([c.logprob for c in flat], dtype=np.float64)
        with np.errstate(invalid="ignore"):  # -inf padding minus -inf padding is NaN, and NaN > 0 is False
            step = np.diff(top_lp, axis=1)
            unsorted = bool(np.any((step > 0) | ((step == 0) & (np.diff(top_ids, axis=1) < 0))))
        if unsorted:  # not already in `candidate_order`: sort by logprob desc, then token id
            order = np.lexsort((top_ids, -top_lp), axis=1)
            top_ids = np.take_along_axis(top_ids, order, axis=1)
            top_lp = np.take_along_axis(top_lp, order, axis=1)
    return OutputArrays(ids, chosen_lp, top_ids, top_lp, top_n, ids_complete, steps)


def _string_keys(rec: OutputArrays, rep: OutputArrays) -> tuple[IntArray, IntArray]:
    """Top-k keys by token string (ids missing on some candidate): intern the strings of both sides together."""
    intern: dict[str, int] = {}

    def keys(side: OutputArrays, pad: int) -> IntArray:
        out = np.full(side.top_ids.shape, pad, dtype=np.int64)
        assert side.steps is not None
        for i, s in enumerate(side.steps):
            row = sorted(s.top, key=lambda c: (-c.logprob, c.token))  # equal logprobs by text: one side lacks ids
            for j, c in enumerate(row):
                out[i, j] = intern.setdefault(c.token, len(intern))
        return out

    return keys(rec, _PAD_REC), keys(rep, _PAD_REP)


def candidate_order(c: TopCandidate) -> tuple[float, int, str]:
    """Sort key of a step's alternatives: logprob descending, then token id (then text, where ids are missing)."""
    return (-c.logprob, -1 if c.token_id is None else c.token_id, c.token)


def _sorted_top(step: StepLogprobs | None) -> tuple[TopCandidate, ...]:
    if step is None:
        return ()
    return tuple(sorted(step.top, key=candidate_order))


def _margin(top: tuple[TopCandidate, ...]) -> float | None:
    return top[0].logprob - top[1].logprob if len(top) >= 2 else None


def _candidates(rec: OutputArrays, rep: OutputArrays, pos: int) -> StepCandidates:
    r_step = rec.steps[pos] if rec.steps is not None and pos < rec.length else None
    p_step = rep.steps[pos] if rep.steps is not None and pos < rep.length else None
    r_top, p_top = _sorted_top(r_step), _sorted_top(p_step)
    return StepCandidates(
        position=pos,
        recorded_token_id=int(rec.ids[pos]) if pos < rec.length else None,
        replayed_token_id=int(rep.ids[pos]) if pos < rep.length else None,
        recorded_top=r_top,
        replayed_top=p_top,
        recorded_margin=_margin(r_top),
        replayed_margin=_margin(p_top),
    )


def _lookup(step: StepLogprobs | None, token_id: int, token: str | None) -> float | None:
    """The logprob of a token in a step's top-k (by id, else by string), or None when absent."""
    if step is None:
        return None
    for c in step.top:
        if c.token_id is not None and c.token_id == token_id:
            return c.logprob
    if token is not None:
        for c in step.top:
            if c.token_id is None and c.token == token:
                return c.logprob
    return None


def _fork_pairs(rec: OutputArrays, rep: OutputArrays, pos: int) -> tuple[list[tuple[float, float]], bool]:
    """At the fork: (recorded, replayed) logprob of each side's chosen token, and whether both were found."""
    assert rec.steps is not None
    assert rep.steps is not None
    r_step, p_step = rec.steps[pos], rep.steps[pos]
    pairs: list[tuple[float, float]] = []
    found = True
    other = _lookup(p_step, int(rec.ids[pos]), r_step.token)  # recorded choice, as the replay saw it
    if other is None:
        found = False
    else:
        pairs.append((r_step.logprob, other))
    other = _lookup(r_step, int(rep.ids[pos]), p_step.token)  # replayed choice, as the recording saw it
    if other is None:
        found = False
    else:
        pairs.append((other, p_step.logprob))
    return pairs, found


def _max_rank_shift(rk: IntArray, pk: IntArray) -> int:
    """Largest |rank change| of a token present in both top-k rows (rows aligned; keys < 0 are padding).

    Only a key whose column differs between the sides can have moved, so the search covers those elements
    alone, probing offsets +-1, +-2, ... in the other row (a loop over offsets, at most k, never over tokens);
    each element leaves the search once found, so the usual small shifts cost a few gathers.
    """
    w = min(rk.shape[1], pk.shape[1])
    kp = pk.shape[1]
    if rk.shape[0] == 0 or w == 0:
        return 0
    flat = np.flatnonzero((rk[:, :w] != pk[:, :w]) & (rk[:, :w] >= 0))
    if flat.size == 0:
        return 0
    rows, cols = np.divmod(flat, w)
    keys = rk[rows, cols]
    shift = 0
    for d in range(1, max(rk.shape[1], kp)):
        found = np.zeros(rows.shape[0], dtype=bool)
        for other in (cols - d, cols + d):
            ok = (other >= 0) & (other < kp)
            found |= ok & (pk[rows, np.clip(other, 0, kp - 1)] == keys)
        if found.any():
            shift = d
            keep = ~found
            rows, cols, keys = rows[keep], cols[keep], keys[keep]
            if rows.size == 0:
                break
    return shift


def _top_equal(rec: OutputArrays, rep: OutputArrays, rk: IntArray, pk: IntArray) -> bool:
    """Top-k ids and logprobs equal column by column over the width both sides reported at each step."""
    if rk.shape == pk.shape and np.array_equal(rk, pk) and np.array_equal(rec.top_lp, rep.top_lp):
        return True  # the common case, without building a mask
    w = min(rk.shape[1], pk.shape[1])
    both = np.arange(w)[None, :] < np.minimum(rec.top_n, rep.top_n)[:, None]
    same = (rk[:, :w] == pk[:, :w]) & (rec.top_lp[:, :w] == rep.top_lp[:, :w])
    return bool(np.all(same | ~both))


def compare(
    recorded: Choice | OutputArrays,
    replayed: ReplayedOutput | OutputArrays,
    thresholds: Thresholds,
    target_level: ReproLevel,
    *,
    fingerprint_diffs: Sequence[FieldDiff] = (),
    semantic_similarity: float | None = None,
) -> Comparison:
    """Judge ``replayed`` against ``recorded``: see the module docstring for the rules. Either side may come as
    its `OutputArrays` already (converted once, compared many times); otherwise it is converted here."""
    rec = recorded if isinstance(recorded, OutputArrays) else output_arrays(recorded.token_ids, recorded.logprobs)
    rep = replayed if isinstance(replayed, OutputArrays) else output_arrays(replayed.token_ids, replayed.logprobs)
    n_rec, n_rep = rec.length, rep.length
    m = min(n_rec, n_rep)
    mismatch = np.flatnonzero(rec.ids[:m] != rep.ids[:m])
    fork: int | None = int(mismatch[0]) if mismatch.size else None
    token_identical = fork is None and n_rec == n_rep
    diverge_at: int | None = fork if fork is not None else (None if token_identical else m)
    prefix = fork if fork is not None else m
    matches = m - int(mismatch.size)
    token_match_rate = 1.0 if max(n_rec, n_rep) == 0 else matches / max(n_rec, n_rep)

    both_lp = rec.chosen_lp is not None and rep.chosen_lp is not None
    if rec.ids_complete and rep.ids_complete:
        rk, pk = rec.top_ids, rep.top_ids  # -1 marks padding on both sides
    else:
        rk, pk = _string_keys(rec, rep)

    bitwise = False
    max_abs: float | None = None
    max_rel: float | None = None
    rank_shift: int | None = None
    numeric = False
    fork_found = True
    if both_lp:
        assert rec.chosen_lp is not None
        assert rep.chosen_lp is not None
        a, b = rec.chosen_lp[:prefix], rep.chosen_lp[:prefix]
        if fork is not None:
            pairs, fork_found = _fork_pairs(rec, rep, fork)
            if pairs:
                a = np.concatenate([a, np.array([p[0] for p in pairs])])
                b = np.concatenate([b, np.array([p[1] for p in pairs])])
        window = prefix + (1 if fork is not None else 0)
        if a.size:
            diff = np.abs(a - b)
            denom = np.maximum(np.maximum(np.abs(a), np.abs(b)), REL_DENOMINATOR_FLOOR)
            max_abs, max_rel = float(diff.max()), float((diff / denom).max())
        rank_shift = _max_rank_shift(rk[:window], pk[:window])
        numeric = (
            window > 0
            and fork_found
            and max_abs is not None
            and max_rel is not None
            and max_abs <= thresholds.max_abs_logprob_diff
            and max_rel <= thresholds.max_rel_logprob_diff
            and rank_shift <= thresholds.max_rank_shift
        )
        if token_identical:
            bitwise = bool(np.array_equal(rec.chosen_lp, rep.chosen_lp)) and _top_equal(rec, rep, rk, pk)
            numeric = numeric or bitwise  # bitwise implies numeric (also for two empty outputs)

    sem_ok = token_identical or (
        semantic_similarity is not None and semantic_similarity >= thresholds.semantic_min_similarity
    )
    held_flags: dict[ReproLevel, bool] = {
        "bitwise": bitwise,
        "token": token_identical,
        "numeric": numeric,
        "semantic": sem_ok,
    }
    levels_held = tuple(level for level, ok in held_flags.items() if ok)
    verdict: Verdict = levels_held[0] if levels_held else "diverged"

    first: FirstDivergence | None = None
    if diverge_at is not None:
        at = _candidates(rec, rep, diverge_at)
        before = _candidates(rec, rep, diverge_at - 1) if diverge_at > 0 else None
        near_tie = at.recorded_margin is not None and at.recorded_margin < thresholds.near_tie_margin
        first = FirstDivergence(position=diverge_at, at=at, before=before, near_tie=near_tie)

    hint, detail = _cause(
        token_identical=token_identical,
        bitwise=bitwise,
        both_lp=both_lp,
        fork=fork,
        prefix=prefix,
        n_rec=n_rec,
        n_rep=n_rep,
        max_abs=max_abs,
        fork_found=fork_found,
        first=first,
        fingerprint_diffs=fingerprint_diffs,
    )
    return Comparison(
        levels_held=levels_held,
        verdict=verdict,
        target_level=target_level,
        target_met=target_level in levels_held,
        first_divergence=first,
        max_abs_logprob_diff=max_abs,
        max_rel_logprob_diff=max_rel,
        max_rank_shift=rank_shift,
        token_match_rate=token_match_rate,
        recorded_length=n_rec,
        replayed_length=n_rep,
        semantic_similarity=semantic_similarity,
        cause_hint=hint,
        cause_detail=detail,
    )


def _cause(
    *,
    token_identical: bool,
    bitwise: bool,
    both_lp: bool,
    fork: int | None,
    prefix: int,
    n_rec: int,
    n_rep: int,
    max_abs: float | None,
    fork_found: bool,
    first: FirstDivergence | None,
    fingerprint_diffs: Sequence[FieldDiff],
) -> tuple[CauseHint, str]:
    changed = ", ".join(d.field for d in fingerprint_diffs)
    drift = f"max |delta logprob| {max_abs:.3g} over the common prefix" if max_abs is not None else ""
    if token_identical:
        if bitwise or not both_lp:
            return "identical", "token ids identical" + ("" if both_lp else "; no logprobs on one side to compare")
        what = drift if max_abs else "chosen-token logprobs identical, the top-k alternatives differ"
        detail = f"token ids identical, logprobs differ: {what}"
        if changed:
            detail += f"; fingerprint differs in: {changed}"
        return "numeric_drift_no_fork", detail
    assert first is not None
    where = f"first divergence at token {first.position} of {n_rec} recorded / {n_rep} replayed"
    if first.at.recorded_margin is not None:
        where += f"; recorded top1-top2 margin {first.at.recorded_margin:.3g}" + (
            " (near tie)" if first.near_tie else ""
        )
    if fork is not None and both_lp and not fork_found:
        where += "; a chosen token at the fork is missing from the other side's top-k"
    if drift:
        where += f"; {drift}"
    if changed:
        return "fingerprint_changed", f"fingerprint differs in: {changed}; {where}"
    if fork is None:
        longer = "replayed" if n_rep > n_rec else "recorded"
        return "length_only", f"one output is a prefix of the other (the {longer} one is longer); {where}"
    if fork == 0:
        return "fork_at_first_token", f"input, chat template or forward-pass difference; {where}"
    return "late_fork_numeric_drift", f"{prefix} identical tokens, then a fork; {where}"
