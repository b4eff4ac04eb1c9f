"""A shared prefix's busy period replayed once, not once per reader: the schedule lane with and without the prefix
cache it keeps between replays (issue 32, ``schedule_reuse_cache``).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_prefix_reuse.py [--readers 8] [--rules 100] [--max-tokens 16]

In process, as the lane proofs run: an engine with the recorder on (`replayer.schedule.engine.StepDriver`, the stack's
vLLM settings) is production. One request computes a long shared system prompt (``--rules`` rules, a RAG context or
an agent's instructions); then ``--readers`` requests, each a busy period of its own, read it from the prefix cache.
Each reader is then replayed on two schedule lanes of production's settings, turn about, so load on a shared host
hits both alike: one keeps its prefix cache between replays (the default), the other recomputes the provider's
period for every replay (``schedule_reuse_cache=false``, as before). Printed per lane: the recorded steps it ran,
its seconds, the bitwise share against production; then the ratio of the two lanes' seconds.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from replayer.lanes.base import GenRequest, resolve_model_dir
from replayer.lanes.batch_engine import render_chat
from replayer.matrix.inputs import DEFAULT_PROMPTS
from replayer.schedule.engine import StepDriver
from replayer.schedule.lane import ScheduleLane
from replayer.settings import ReplayerSettings
from schemas import SamplingContract

SETTINGS = {"dtype": "bfloat16", "max_num_seqs": 256, "max_model_len": 4096, "enable_prefix_caching": True, "seed": 0}
GREEDY = SamplingContract(temperature=0.0, seed_scope="none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=8, help="busy periods that read the shared prefix")
    parser.add_argument("--rules", type=int, default=100, help="length of the shared system prompt, in rules")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of production and the lanes")
    args = parser.parse_args()

    settings = ReplayerSettings()
    model = resolve_model_dir(settings)
    system = " ".join(f"Rule {i}: answer briefly, cite the section, and never guess." for i in range(args.rules))
    prompts = render_chat(model, [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(args.readers + 1)],
                          system=system)  # fmt: skip
    requests = [GenRequest(p, GREEDY, max_tokens=args.max_tokens, top_k_logprobs=3) for p in prompts]
    prod = StepDriver(model, Path(tempfile.mkdtemp(prefix="bench-prefix-reuse-")), num_threads=args.threads,
                      **SETTINGS)  # fmt: skip
    runs = [prod.run([(0, r)])[0] for r in requests]  # the provider, then each reader in a busy period of its own
    log = prod.log()
    assert log.engine is not None
    provider_hits = [len(log.arrivals[rid].cached_from or ()) for rid, _ in runs[1:]]
    print(f"production: prompt {len(prompts[0])} tokens, {args.readers} readers each reading "
          f"{log.arrivals[runs[1][0]].cached_from} from the provider; {args.threads} torch thread(s)")  # fmt: skip
    assert all(provider_hits), "a reader did not read the shared prefix from the cache"

    lanes = {
        "kept cache": ScheduleLane(settings.model_copy(update={"schedule_reuse_cache": True}), log.engine),
        "recomputed": ScheduleLane(settings.model_copy(update={"schedule_reuse_cache": False}), log.engine),
    }
    seconds = dict.fromkeys(lanes, 0.0)
    steps = dict.fromkeys(lanes, 0)
    bitwise = dict.fromkeys(lanes, 0)
    try:
        for (rid, out), request in zip(runs[1:], requests[1:], strict=True):
            for name, lane in lanes.items():
                started = time.perf_counter()
                replay = lane.replay_target(log, rid, request)
                seconds[name] += time.perf_counter() - started
                steps[name] += replay.steps.compared
                bitwise[name] += replay.output == out and replay.schedule_reproduced
    finally:
        for lane in lanes.values():
            lane.close()
        prod.close()
    for name in lanes:
        print(f"{name:>10}: {steps[name]:5d} recorded steps run, {seconds[name]:7.2f} s, "
              f"{bitwise[name]}/{args.readers} bitwise with the schedule reproduced")  # fmt: skip
    print(f"lane seconds, kept cache / recomputed: {seconds['kept cache'] / seconds['recomputed']:.2f}; "
          f"steps {steps['kept cache'] / steps['recomputed']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
