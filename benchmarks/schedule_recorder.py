"""The schedule recorder's cost on production, the log's size, and the schedule lane's replay time (issue #22).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/schedule_recorder.py [--prompts 12] [--max-tokens 32] [--repeats 3]

Two in-process engines with the same settings (the stack's vLLM: bfloat16, eager, max_num_seqs 256, prefix cache
on), one with vLLM's scheduler and one with ``RecordingScheduler``, run the same batch of chat prompts, turn about
(A B A B ...), so load on a shared host hits both alike. Printed:

- production throughput (generated tokens/s) without and with the recorder, per repeat, and their median ratio;
- the log's bytes per step and per request;
- replay time per request on the schedule lane (target + fillers through its window) and on the one-at-a-time
  vllm lane, and the bitwise count of each against the batched run;
- window replay (every request of the batch with its real content) as a ratio of production's throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from replayer.lanes.base import GenRequest
from replayer.lanes.batch_engine import render_chat
from replayer.lanes.vllm_lane import VllmLane
from replayer.matrix.inputs import DEFAULT_PROMPTS
from replayer.schedule.engine import StepDriver
from replayer.schedule.lane import ScheduleLane
from replayer.settings import ReplayerSettings
from schemas import SamplingContract
from schemas.canonical import canonical_text_of_plain

SETTINGS = {"dtype": "bfloat16", "max_num_seqs": 256, "max_model_len": 2048, "enable_prefix_caching": True, "seed": 0}


def _time_hooks(recorder: Any) -> list[float]:
    """Wrap the recorder's two per-step hooks to sum their thread CPU time: ``[seconds, calls]``."""
    total = [0.0, 0]
    for name in ("on_schedule", "on_update"):
        original = getattr(recorder, name)

        def timed(*args: Any, _original: Any = original) -> None:
            t0 = time.thread_time()
            _original(*args)
            total[0] += time.thread_time() - t0
            total[1] += 1

        setattr(recorder, name, timed)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache/reprolane/models/smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replays", type=int, default=4, help="targets replayed on each lane")
    args = ap.parse_args()
    greedy = SamplingContract(temperature=0.0, seed_scope="none")
    reqs = [
        GenRequest(p, greedy, max_tokens=args.max_tokens, top_k_logprobs=3)
        for p in render_chat(
            args.model_dir,
            [f"{DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]} (variant {i})" for i in range(args.prompts)],
        )
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-schedule-"))
    plain = StepDriver(args.model_dir, None, **SETTINGS)
    recording = StepDriver(args.model_dir, log_dir, **SETTINGS)
    for d in (plain, recording):
        d.run([(0, reqs[0])])  # warm-up
        d.engine.reset_prefix_cache()
    hook_s = _time_hooks(recording.recorder)
    with_wall = [0.0, 0]  # seconds, steps of the timed runs with the recorder
    rates: dict[str, list[float]] = {"without": [], "with": []}
    runs = []
    for _ in range(args.repeats):
        for name, d in (("without", plain), ("with", recording)):
            t0, steps0 = time.perf_counter(), d.step_count
            out = d.run([(0, r) for r in reqs])
            elapsed = time.perf_counter() - t0
            if name == "with":
                with_wall[0] += elapsed
                with_wall[1] += d.step_count - steps0
            d.engine.reset_prefix_cache()
            rates[name].append(sum(len(o.token_ids) for _, o in out) / elapsed)
            if name == "with":
                runs = out
    ratios = [w / p for w, p in zip(rates["with"], rates["without"], strict=True)]
    print("production tokens/s without recorder:", " ".join(f"{r:.1f}" for r in rates["without"]))
    print("production tokens/s with recorder:   ", " ".join(f"{r:.1f}" for r in rates["with"]))
    print(
        f"throughput ratio with/without: median {statistics.median(ratios):.3f} "
        f"(runs {', '.join(f'{r:.3f}' for r in ratios)})"
    )
    log = recording.log()
    steps_run = len(log.steps)
    lines = [
        line
        for p in sorted(Path(recording.recorder.writer.directory).glob("*.jsonl"))
        for line in p.read_bytes().splitlines()
    ]
    docs = [json.loads(line) for line in lines]
    t0 = time.thread_time()
    for doc in docs:
        canonical_text_of_plain(doc)
    encode_s = time.thread_time() - t0
    per_step_us = (hook_s[0] + encode_s) / max(steps_run, 1) * 1e6
    print(
        f"recorder CPU: hooks {hook_s[0] / max(hook_s[1], 1) * 1e6:.0f} us per call ({hook_s[1]} calls), encoding "
        f"{encode_s / max(len(docs), 1) * 1e6:.0f} us per record; {per_step_us:.0f} us per step against a "
        f"{with_wall[0] / max(with_wall[1], 1) * 1e3:.0f} ms step (wall, the timed runs with the recorder)"
    )
    engine_dir = Path(recording.recorder.writer.directory)
    total = sum(p.stat().st_size for p in engine_dir.glob("*.jsonl"))
    print(
        f"log: {total} bytes, {len(log.steps)} steps, {len(log.arrivals)} requests: "
        f"{total / max(len(log.steps), 1):.0f} B/step, {total / max(len(log.arrivals), 1):.0f} B/request"
    )
    plain.close()
    assert log.engine is not None
    lane = ScheduleLane(ReplayerSettings(model_dir=args.model_dir), log.engine)
    t0 = time.perf_counter()
    bitwise = 0
    for (rid, out), req in list(zip(runs, reqs, strict=True))[: args.replays]:
        bitwise += lane.replay_target(log, rid, req).output == out
    sched_s = (time.perf_counter() - t0) / args.replays
    print(f"schedule lane: {sched_s:.2f} s per replay, {bitwise}/{args.replays} bitwise")
    t0 = time.perf_counter()
    window = lane.replay_window(log, {rid: r for (rid, _), r in zip(runs, reqs, strict=True)}, runs[-1][0])
    window_s = time.perf_counter() - t0
    window_rate = sum(len(o.token_ids) for o in window.outputs.values()) / window_s
    same = sum(window.outputs.get(rid) == out for rid, out in runs)
    print(
        f"window replay: {window_rate:.1f} tokens/s = {window_rate / statistics.median(rates['with']):.3f} of "
        f"production, {same}/{len(runs)} bitwise"
    )
    lane.close()
    recording.close()
    vllm_lane = VllmLane(ReplayerSettings(model_dir=args.model_dir))
    t0 = time.perf_counter()
    alone = 0
    for (_, out), req in list(zip(runs, reqs, strict=True))[: args.replays]:
        alone += vllm_lane.replay(req) == out
    print(
        f"one-at-a-time lane: {(time.perf_counter() - t0) / args.replays:.2f} s per replay, "
        f"{alone}/{args.replays} bitwise"
    )
    vllm_lane.close()


if __name__ == "__main__":
    main()
