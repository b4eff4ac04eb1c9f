"""What one schedule replay reads and runs as the engine's log grows (issue 22): the whole log up to the target,
as the replayer read it before `replayer.schedule.window`, against the target's busy period and its prefix-cache
provider's period only.

A synthetic engine log (`tests.schedule_segments.FakeEngine`) on the real SeaweedFS of a run dir: a provider
request computes a shared prefix at the engine's start, ``--unrelated`` busy periods follow (one segment each, as
a recorder closing a segment every 2 s on a server with short bursts writes them), then a target and a companion
read the provider's block. Each log is shipped by the real shipper (segments and index entries), then read back:

- **whole log**: `ScheduleStore.records_for` from the engine's first step (what the service read), and the steps a
  replay of that contiguous window would run (first step of the provider's period to the target's last);
- **window**: `replayer.schedule.window.read_window` and `replayer.schedule.plan.plan_replay` on it.

Printed per log length: segments read, steps a replay runs, and the read + plan time of each (a fresh store each
time, so nothing is cached), with the ratios. The engine's time per step is the same on both sides, so steps run is
what a replay costs on the lane.

Run:  .venv/bin/python benchmarks/bench_schedule_window.py --run-dir /work/devstack [--unrelated 10 100 400]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from capture.schedule.destinations import SegmentStore
from capture.schedule.shipper import Shipper
from capture.schedule.shipper_settings import ShipperSettings
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from replayer.schedule.plan import plan_replay
from replayer.schedule.replay import window_log
from replayer.schedule.store import ScheduleStore
from replayer.schedule.window import read_window
from schemas import Envelope
from schemas.schedule_delivery import ScheduleRef, external_request_id_for
from tests import factories
from tests.capture.schedule.test_shipper import FakeProducer
from tests.schedule_segments import FakeEngine, write_segment


def chat(request_id: str) -> str:
    return external_request_id_for("chat.completions", request_id)


def log_segments(unrelated: int, tag: str) -> tuple[list[list[Any]], str, str]:
    engine = FakeEngine(f"bench-{tag}")
    provider = engine.request(chat(f"rl-p-{tag}"), prompt_tokens=64, output_tokens=8)
    engine.run()
    segments = [engine.take()]
    for i in range(unrelated):
        for j in range(3):
            engine.request(chat(f"rl-x{i}-{j}-{tag}"), prompt_tokens=40, output_tokens=6 + j)
        engine.run()
        segments.append(engine.take())
    target = engine.request(chat(f"rl-t-{tag}"), prompt_tokens=80, cached_from=((provider, 2),))
    engine.request(chat(f"rl-c-{tag}"), prompt_tokens=48, cached_from=((provider, 2),))
    engine.run()
    segments.append(engine.take())
    return segments, engine.engine_id, target


async def ship(client: Any, bucket: str, engine_id: str, segments: list[list[Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for seq, records in enumerate(segments):
            write_segment(directory, engine_id, seq, records)
        settings = ShipperSettings(schedule_dir=directory, s3_bucket=bucket)
        shipper = Shipper(settings, store=SegmentStore(client, bucket, retention=None), producer=FakeProducer())  # type: ignore[arg-type]
        await shipper.ship_pending()


def envelope(request_id: str) -> Envelope:
    ref = ScheduleRef(external_request_id=chat(request_id), recorder="vllm-scheduler")
    return factories.envelope(request_id=request_id, endpoint="chat.completions", schedule=ref)


def measure(client: Any, bucket: str, unrelated: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    segments, engine_id, target = log_segments(unrelated, tag)
    asyncio.run(ship(client, bucket, engine_id, segments))
    env = envelope(f"rl-t-{tag}")

    store = ScheduleStore(client, bucket)
    started = time.perf_counter()
    whole = store.records_for(env, before_steps=1 << 40)
    plan = plan_replay(window_log(whole), target)
    whole_s = time.perf_counter() - started
    whole_read, whole_steps = store.segments_read, plan.end_step - plan.start_step + 1

    store = ScheduleStore(client, bucket)
    started = time.perf_counter()
    window = read_window(store, env)
    plan = plan_replay(window_log(window), target)
    window_s = time.perf_counter() - started
    if not window.complete or plan.notes:
        raise SystemExit(f"the window is not what a replay needs: {window.gap} {plan.notes}")
    return {
        "segments": len(segments),
        "whole_read": whole_read,
        "whole_steps": whole_steps,
        "whole_s": whole_s,
        "window_read": store.segments_read,
        "window_steps": len(plan.steps),
        "window_s": window_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--unrelated", type=int, nargs="+", default=[10, 100, 400])
    args = parser.parse_args()
    info = StackInfo.load(args.run_dir)
    client = s3_client(info.s3_endpoint, info.s3_credentials)
    bucket = f"bench-window-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    print("| periods between | segments | segments read: whole log / window | steps run | read + plan s |")
    print("|---|---|---|---|---|")
    for unrelated in args.unrelated:
        m = measure(client, bucket, unrelated)
        print(
            f"| {unrelated} | {m['segments']:.0f} | {m['whole_read']:.0f} / {m['window_read']:.0f} "
            f"({m['whole_read'] / m['window_read']:.0f}x) | {m['whole_steps']:.0f} / {m['window_steps']:.0f} "
            f"({m['whole_steps'] / m['window_steps']:.0f}x) | {m['whole_s']:.2f} / {m['window_s']:.2f} "
            f"({m['whole_s'] / m['window_s']:.0f}x) |"
        )


if __name__ == "__main__":
    main()
