"""How fast this machine runs the engine right now: the number to read beside a test suite's or a benchmark's time.

    .venv/bin/python benchmarks/bench_engine_speed.py [--rounds 4]

The suite's time is mostly engine steps, and on the shared 2-core box the same steps cost up to a third more
CPU-seconds in one hour than in the next, which neither ``/proc/stat``'s steal nor a one-thread matrix-multiply probe
shows. This runs what the schedule lane's proofs run (tests/replayer/schedule/test_lane_model.py): an in-process
vLLM engine on the converted model, float32, two threads, 12 chat prompts generated together, 16 tokens each, and
prints the seconds of each round after the first (which warms the engine). Two suite timings are comparable only when
this reads about the same before each (docs/OPERATIONS.md, "Tests").
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the suite runs (tests/conftest.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of 12 requests, the first one warming up")
    args = parser.parse_args()

    from infra.paths import model_dir
    from replayer.lanes.base import GenRequest
    from replayer.lanes.batch_engine import render_chat
    from replayer.machine_output import engine_logs_to_stderr, machine_output
    from replayer.matrix.inputs import DEFAULT_PROMPTS
    from replayer.schedule.engine import StepDriver
    from schemas import SamplingContract

    engine_logs_to_stderr(os.environ)

    model = model_dir()  # the fetched model, $REPROLANE_CACHE_DIR honoured as `reprolane model fetch` does
    if not (model / "config.json").is_file():
        raise SystemExit("no converted model: run `reprolane model fetch` first")
    greedy = SamplingContract(temperature=0.0, seed_scope="none")
    prompts = render_chat(model, [f"{DEFAULT_PROMPTS[i % 8]} Answer variant {i}." for i in range(12)])
    requests = [GenRequest(p, greedy, max_tokens=16, top_k_logprobs=3) for p in prompts]
    with machine_output(True) as figure, tempfile.TemporaryDirectory() as log_dir:  # the engine's logs on stderr
        engine = StepDriver(model, Path(log_dir), num_threads=2, dtype="float32", max_num_seqs=256,
                            max_num_batched_tokens=256, max_model_len=2048, enable_prefix_caching=False,
                            seed=0)  # fmt: skip
        try:
            rounds = []
            for _ in range(max(2, args.rounds)):
                started = time.perf_counter()
                engine.run([(0, r) for r in requests])
                rounds.append(time.perf_counter() - started)
        finally:
            engine.close()
        warm = rounds[1:]
        figure(f"engine speed: 12 requests x 16 tokens, float32, 2 threads: median {statistics.median(warm):.2f} s "
               f"per round (rounds {', '.join(f'{r:.2f}' for r in warm)}; warm-up {rounds[0]:.2f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
