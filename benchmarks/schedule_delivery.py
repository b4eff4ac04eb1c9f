"""Schedule-log size and the shipper's check, per step and per request (issue 22): what recording the engine's
schedule adds to what the pipeline stores and ships.

A small scheduler simulation writes the records the recorder writes (`schemas.schedule`): one `EngineStart`, one
`RequestArrival` per request, one `ScheduleStep` per engine step listing every scheduled request with its computed
and scheduled tokens, finished ids. It schedules like vLLM's v1 scheduler in the shapes that matter for size:
running requests decode one token each, waiting ones are prefilled in chunks within ``max_num_batched_tokens``,
at most ``max_num_seqs`` run at once. Ids are shaped like the real ones (``chatcmpl-rl-<32 hex>-<8 hex>``), prompt
and output lengths drawn uniformly from the given ranges, requests arriving in waves of ``--concurrency``.

Printed per concurrency: steps and requests, bytes per step (mean), bytes per arrival, schedule bytes per request
(everything / requests: its arrival plus its share of every step it ran in), the same gzip-compressed (Kafka's
codec), index bytes per request (the S3 index entry), and the shipper's check (`decode_segment`: parse, schema,
canonical form) in MB/s and segments/s on this machine.

Run:  .venv/bin/python benchmarks/schedule_delivery.py [--requests N] [--seed S] [--markdown]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from schemas.canonical import canonical_bytes
from schemas.schedule import EngineStart, RequestArrival, ScheduledRequest, ScheduleStep
from schemas.schedule_delivery import ScheduleIndexEntry, decode_segment

T0 = datetime(2026, 12, 1, tzinfo=UTC)
SEGMENT_BYTES = 4 * 1024 * 1024  # the recorder closes a segment at about this size


@dataclass
class Req:
    rid: str
    prompt: int
    output: int
    computed: int = 0
    generated: int = 0


def simulate(requests: int, concurrency: int, rng: random.Random, max_batched: int, max_seqs: int) -> list[bytes]:
    """The canonical lines of one engine's log for `requests` requests arriving `concurrency` at a time."""
    engine = "eng-bench"
    start = EngineStart(
        engine_id=engine, started_at=T0, vllm_version="0.32.0", model="m", dtype="bfloat16", max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched, max_model_len=4096, block_size=16, num_kv_blocks=20000,
        enable_chunked_prefill=True, enable_prefix_caching=True, scheduling_policy="fcfs", seed=0,
    )  # fmt: skip
    lines = [canonical_bytes(start)]
    waiting: list[Req] = []
    running: list[Req] = []
    sent, step = 0, 0
    while sent < requests or waiting or running:
        if not waiting and not running:  # the next wave arrives when the engine is idle
            for _ in range(min(concurrency, requests - sent)):
                ext = f"chatcmpl-rl-{rng.getrandbits(128):032x}"
                req = Req(f"{ext}-{rng.getrandbits(32):08x}", rng.randint(64, 1024), rng.randint(16, 256))
                arrival = RequestArrival(
                    engine_id=engine, step=step, engine_request_id=req.rid, external_request_id=ext,
                    num_prompt_tokens=req.prompt, max_tokens=req.output,
                )  # fmt: skip
                lines.append(canonical_bytes(arrival))
                waiting.append(req)
                sent += 1
        budget, scheduled, finished = max_batched, [], []
        for req in running:  # decodes first
            scheduled.append(ScheduledRequest(engine_request_id=req.rid, num_computed_tokens=req.computed,
                                              num_scheduled_tokens=1))  # fmt: skip
            req.computed += 1
            req.generated += 1
            budget -= 1
        while waiting and budget > 0 and len(running) + 1 <= max_seqs:
            req = waiting[0]
            n = min(req.prompt - req.computed, budget)
            scheduled.append(ScheduledRequest(engine_request_id=req.rid, num_computed_tokens=req.computed,
                                              num_scheduled_tokens=n))  # fmt: skip
            req.computed += n
            budget -= n
            if req.computed < req.prompt:
                break
            req.generated = 1  # the step that completes the prefill samples the first token
            running.append(waiting.pop(0))
        for req in list(running):
            if req.generated >= req.output:
                running.remove(req)
                finished.append(req.rid)
        at = T0 + timedelta(milliseconds=20 * step)
        record = ScheduleStep(engine_id=engine, step=step, at=at, scheduled=tuple(scheduled), finished=tuple(finished))
        lines.append(canonical_bytes(record))
        step += 1
    return lines


def segments(lines: list[bytes]) -> list[bytes]:
    out, current, size = [], [], 0
    for line in lines:
        current.append(line + b"\n")
        size += len(line) + 1
        if size >= SEGMENT_BYTES:
            out.append(b"".join(current))
            current, size = [], 0
    if current:
        out.append(b"".join(current))
    return out


def measure(requests: int, concurrency: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    lines = simulate(requests, concurrency, rng, max_batched=2048, max_seqs=256)
    steps = [line for line in lines if line.startswith(b'{"at"')]
    arrivals = [line for line in lines if b'"kind":"arrival"' in line]
    total = sum(len(line) + 1 for line in lines)
    segs = segments(lines)
    gz = sum(len(gzip.compress(s)) for s in segs)
    sample = ScheduleIndexEntry(
        engine_id="eng-bench", external_request_id="chatcmpl-rl-" + "0" * 32,
        engine_request_id="chatcmpl-rl-" + "0" * 32 + "-00000000", segment=0,
        segment_sha256=hashlib.sha256(b"").hexdigest(), step=0,
    )  # fmt: skip
    t = time.perf_counter()
    for seg in segs:
        decode_segment(seg, "eng-bench")
    check_s = time.perf_counter() - t
    return {
        "steps": len(steps),
        "requests": len(arrivals),
        "step_bytes": sum(len(s) + 1 for s in steps) / max(len(steps), 1),
        "arrival_bytes": sum(len(a) + 1 for a in arrivals) / max(len(arrivals), 1),
        "request_bytes": total / max(len(arrivals), 1),
        "request_gzip": gz / max(len(arrivals), 1),
        "index_bytes": len(sample.encode()),
        "check_mb_s": total / check_s / 1e6,
        "segments_s": len(segs) / check_s,
        "segment_count": len(segs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    head = ("concurrency", "steps", "requests", "B/step", "B/arrival", "B/request", "gzip B/request",
            "index B/request", "check MB/s", "segments")  # fmt: skip
    rows = []
    for concurrency in (1, 12, 64, 256):
        m = measure(args.requests, concurrency, args.seed)
        rows.append((str(concurrency), f"{m['steps']:.0f}", f"{m['requests']:.0f}", f"{m['step_bytes']:.0f}",
                     f"{m['arrival_bytes']:.0f}", f"{m['request_bytes']:.0f}", f"{m['request_gzip']:.0f}",
                     f"{m['index_bytes']:.0f}", f"{m['check_mb_s']:.1f}", f"{m['segment_count']:.0f}"))  # fmt: skip
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + " --- |" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
        for row in rows:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
