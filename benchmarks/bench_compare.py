"""Benchmark of `replayer.compare`: conversion (pydantic -> arrays) and comparison, timed separately.

    .venv/bin/python benchmarks/bench_compare.py [--tokens 8192] [--top 20] [--repeat 50]

Prints the median and best wall time of each phase for three cases: identical outputs (the common case),
token-identical with logprob drift on every step and every top-k row reordered (the slow rank-shift path),
and a confident fork half way (all-new tokens after it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from replayer.compare import compare, output_arrays
from replayer.settings import Thresholds
from schemas import StepLogprobs, TopCandidate


def make_steps(n: int, k: int, rng: random.Random) -> tuple[list[int], list[StepLogprobs]]:
    ids, steps = [], []
    for _ in range(n):
        cand = rng.sample(range(49152), k)
        lps = sorted((-rng.random() * 10 for _ in range(k)), reverse=True)
        top = tuple(
            TopCandidate(token=f"t{t}", token_id=t, logprob=lp, rank=r + 1)
            for r, (t, lp) in enumerate(zip(cand, lps, strict=True))
        )
        ids.append(cand[0])
        steps.append(StepLogprobs(token_id=cand[0], token=f"t{cand[0]}", logprob=lps[0], top=top))
    return ids, steps


def drifted(steps: list[StepLogprobs]) -> list[StepLogprobs]:
    """Every logprob nudged, the last two alternatives of each row swapped (forces the rank-shift path)."""
    out = []
    for s in steps:
        top = list(s.top)
        top[-1], top[-2] = (
            top[-2].model_copy(update={"logprob": top[-1].logprob + 1e-3}),
            top[-1].model_copy(update={"logprob": top[-2].logprob - 1e-3}),
        )
        out.append(s.model_copy(update={"logprob": s.logprob - 1e-3, "top": tuple(top)}))
    return out


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(0)
    ids, steps = make_steps(args.tokens, args.top, rng)
    half = args.tokens // 2
    f_ids, f_steps = make_steps(args.tokens - half, args.top, random.Random(1))
    forked_ids, forked_steps = ids[:half] + f_ids, steps[:half] + f_steps
    cases = {
        "identical": (ids, steps),
        "drift + rank swaps": (ids, drifted(steps)),
        "late confident fork": (forked_ids, forked_steps),
    }
    th = Thresholds()
    print(f"{args.tokens} tokens x top-{args.top}, median / best of {args.repeat} runs")
    conv_med, conv_best = timed(lambda: output_arrays(ids, steps), args.repeat)
    print(f"  output_arrays (one side, pydantic -> numpy): {conv_med:8.3f} ms / {conv_best:8.3f} ms")
    rec = output_arrays(ids, steps)
    for name, (r_ids, r_steps) in cases.items():
        rep = output_arrays(r_ids, r_steps)
        med, best = timed(lambda rep=rep: compare(rec, rep, th, "token"), args.repeat)  # type: ignore[misc]
        verdict = compare(rec, rep, th, "token").verdict
        print(f"  compare, arrays [{name:>19}] -> {verdict:8}: {med:8.3f} ms / {best:8.3f} ms")


if __name__ == "__main__":
    main()
