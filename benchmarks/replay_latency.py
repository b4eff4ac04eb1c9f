"""How long ``reprolane replay request ID`` takes with a replayer service running, and without one.

    REPROLANE_RUN_DIR=DIR .venv/bin/python benchmarks/replay_latency.py [--lane vllm|remote] [-n 6] [--max-tokens 8]

Against a running local stack (``reprolane stack up``; ``REPROLANE_RUN_DIR`` or ``./.reprolane/stack``): records
`n` short greedy requests from the stack's vLLM server into its S3 (as the capture side lays them out), starts
``reprolane replayer serve`` on `--lane` with uuid topics and a replay-request key file, and times

- **service, fresh**: the real CLI, ``replay request ID --via service --json``, in a process of its own (Python
  start-up included), for a request the service has not replayed yet: ask, replay on the loaded lane, store,
  answer, read the result from S3;
- **service, stored**: the same request again (the service answers with the result it stored);
- **round trip in process**: the client's part alone (`replayer.on_demand.live_service`, `ask_service`, the
  result read from S3) for further fresh requests, without the CLI's start-up;
- **local fallback**: with the service stopped, ``replay request ID --json`` (``--via auto``): the CLI finds no
  heartbeat and loads the lane itself, as before.

Prints each figure (median and max over the requests) and the goal (service, fresh: 2 s or less).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra import paths
from infra.demo_services import reprolane_argv
from infra.state import StackInfo
from replayer.on_demand import ask_service, live_service
from replayer.store import EnvelopeStore
from tests.replayer.service_harness import Topics, worker_environment
from tests.replayer.support import S3Target, record_from_stack, seed_envelope, write_replay_request_keys

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is two plus two?",
    "Name a planet.",
    "What is the boiling point of water?",
    "Name a fruit.",
    "Name an ocean.",
    "What is the opposite of hot?",
    "Name a month.",
    "What colour is the sky?",
    "Name a metal.",
    "What do bees make?",
]


def cli(env: dict[str, str], *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    proc = subprocess.run([*reprolane_argv(), *args], env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if proc.returncode not in (0, 1):
        sys.exit(f"`reprolane {' '.join(args)}` exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds, proc


def start_service(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*reprolane_argv(), "replayer", "serve", "--metrics-port", "0"], env=env, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip


def figures(name: str, seconds: list[float]) -> None:
    print(f"  {name:<28} median {statistics.median(seconds):6.2f} s   max {max(seconds):6.2f} s   (n={len(seconds)})")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lane", choices=["vllm", "remote"], default="vllm")
    ap.add_argument("-n", type=int, default=6, help="requests per figure (at most 6)")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    n = max(1, min(args.n, len(QUESTIONS) // 2))
    info = StackInfo.load(paths.run_dir())
    s3 = S3Target.from_stack(info)
    topics = await Topics.create(info.kafka_bootstrap, s3)
    tmp = Path(tempfile.mkdtemp(prefix="replay-latency-"))
    settings = topics.settings(
        lane=args.lane, remote_url=info.vllm_url, served_model_name=info.model_name, model_dir=info.model_dir,
        replay_request_keys_path=write_replay_request_keys(tmp / "keys.json"),
    )  # fmt: skip
    envelopes = []
    for i, question in enumerate(QUESTIONS[: 2 * n]):
        messages = [{"role": "user", "content": question}]
        env = record_from_stack(info, f"latency-{topics.suffix}-{i}", messages, max_tokens=args.max_tokens)
        seed_envelope(s3.client(), s3.bucket, env)
        envelopes.append(env)
    environ = {**worker_environment(settings), "REPROLANE_RUN_DIR": str(info.run_dir), "HF_HUB_OFFLINE": "1"}
    print(f"replay latency: lane {args.lane}, {args.max_tokens}-token greedy requests, stack {info.run_dir}")
    started = time.perf_counter()
    service = start_service(environ, tmp / "replayer.log")
    try:
        while await live_service(settings) is None:
            if service.poll() is not None:
                sys.exit(f"the replayer exited; its log: {tmp / 'replayer.log'}")
            await asyncio.sleep(0.2)
        print(f"  service up (first heartbeat) after {time.perf_counter() - started:.1f} s")
        fresh, stored, in_process = [], [], []
        for env in envelopes[:n]:
            seconds, _ = cli(environ, "replay", "request", env.request_id, "--via", "service", "--json")
            fresh.append(seconds)
            seconds, _ = cli(environ, "replay", "request", env.request_id, "--via", "service", "--json")
            stored.append(seconds)
        store = EnvelopeStore.from_settings(settings)
        for env in envelopes[n:]:
            t0 = time.perf_counter()
            beat = await live_service(settings)
            assert beat is not None
            event = await ask_service(settings, env.request_id, lane=args.lane, timeout_s=60)
            assert store.get_result(env, event.lane_fingerprint_sha256) is not None
            in_process.append(time.perf_counter() - t0)
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(60)
    local = [cli(environ, "replay", "request", envelopes[0].request_id, "--json")[0]]
    figures("service, fresh (CLI)", fresh)
    figures("service, stored (CLI)", stored)
    figures("round trip in process", in_process)
    figures("local fallback (CLI)", local)
    goal = "met" if statistics.median(fresh) <= 2.0 else "NOT met"
    print(f"  goal: service, fresh <= 2 s (median): {goal}; host {os.cpu_count()} CPUs")


if __name__ == "__main__":
    asyncio.run(main())
