"""Replays per second on each lane: one warm-up replay, then N timed `replay_envelope` calls, one at a time.

    .venv/bin/python benchmarks/bench_lanes.py --lane vllm [--model-dir DIR] [-n 10] [--max-tokens 12]
    .venv/bin/python benchmarks/bench_lanes.py --lane remote --remote-url http://127.0.0.1:PORT
    .venv/bin/python benchmarks/bench_lanes.py --lane transformers

The envelope replayed is the lane's own first (warm-up) output for a fixed chat prompt, greedy, top-5 logprobs,
so every timed replay runs the full path: lane, comparison, fingerprint diff, event. Prints the lane start-up
time, replays/s, generated tokens/s and the verdicts seen.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

from replayer.gate.golden import record_envelope
from replayer.lanes import GenRequest, make_lane
from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from schemas import ArtifactHashes, SamplingContract

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's vocabulary
PROMPT = (1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lane", choices=["vllm", "remote", "transformers"], default="vllm")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--remote-url", default=None)
    ap.add_argument("-n", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()
    settings = ReplayerSettings(lane=args.lane, model_dir=args.model_dir, remote_url=args.remote_url)
    t0 = time.perf_counter()
    lane = make_lane(settings)
    startup = time.perf_counter() - t0
    try:
        sampling = SamplingContract(temperature=0.0, max_tokens=args.max_tokens, seed_scope="none", logprobs=5)
        first = lane.replay(GenRequest(PROMPT, sampling, max_tokens=args.max_tokens, top_k_logprobs=5))
        env = record_envelope(
            request_id="bench-lanes-1",
            prompt_token_ids=PROMPT,
            prompt_text=None,
            sampling=sampling,
            output=first,
            runtime=lane.fingerprint(),
            artifacts=ArtifactHashes(),
            model=settings.served_model_name,
            target_level="bitwise",
        )
        verdicts: Counter[str] = Counter()
        tokens = 0
        t0 = time.perf_counter()
        for _ in range(args.n):
            result = replay_envelope(env, lane, settings)
            verdicts[result.event.verdict] += 1
            tokens += len(result.replayed.token_ids)
        elapsed = time.perf_counter() - t0
    finally:
        lane.close()
    print(f"lane {args.lane}: start-up {startup:.1f} s")
    print(
        f"  {args.n} replays of {len(first.token_ids)} tokens in {elapsed:.2f} s: "
        f"{args.n / elapsed:.2f} replays/s, {tokens / elapsed:.1f} tokens/s; verdicts {dict(verdicts)}"
    )


if __name__ == "__main__":
    main()
