"""Soak: steady load through the real sidecar, every request verified by the real replayer service (issue 32).

    REPROLANE_RUN_DIR=DIR .venv/bin/python benchmarks/soak_verify_all.py [--minutes 20] [--interval 4] [--sample-s 60]

Against a running local stack whose vLLM records its schedule (``reprolane stack up``), the real services started
as the demo starts them (`infra.demo.services`), in consumer groups that begin at the topics' ends:
``serve capture`` (guaranteed mode; the run's tenant is a flag tenant, so every request is flagged: verify all),
``serve schedules`` and ``serve replayer`` (the schedule lane, one replay per busy period: the default).

For ``--minutes`` one client sends a greedy chat every ``--interval`` seconds (mixed output lengths behind one
shared system prompt); a consumer reads the divergence topic as the service publishes. Every ``--sample-s`` a
window closes and is printed: requests answered, verdicts read, the lag of the verdicts read in it (the time the
verdict was read minus the time the client got its answer: p50, p95), the age of the oldest request without a
verdict, and the resident memory of the sidecar's and the replayer's process groups (the replayer's engine core is
a child process). When the load stops, the last verdicts are waited for (``--drain-s``).

What it says at the end, the issue's three goals: the envelopes left without a verdict (goal 0), the lag bounded
(the last windows' p95 against the first's), memory flat (each group's RSS in the last window against the first
after the warm-up). The rate must be one the box can verify: on a 2-core machine production and the replay lane
share the cores, so a rate above what the lane replays makes the lag grow, which is what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, TopicPartition

from infra import paths
from infra.clients.connection import KafkaConnectionFields
from infra.clients.kafka import aiokafka_kwargs
from infra.demo.kafka import Mark, mark, start_group_at
from infra.demo.services import Service, start_capture, start_replayer, start_schedule_shipper, write_demo_keys
from infra.stack.launcher import LocalStack
from infra.stack.ports import allocate_ports
from infra.stack.state import StackInfo
from replayer.matrix.inputs import DEFAULT_PROMPTS
from schemas.layout import TOPIC_DIVERGENCES, TOPIC_ENVELOPES

TENANT = "soak"
SYSTEM = f"Session {uuid.uuid4().hex}. " + " ".join(
    f"Rule {i}: answer briefly, in plain words, and never guess." for i in range(12)
)
OUTPUT_LENGTHS = (8, 16, 24, 32)


def body(i: int) -> dict[str, Any]:
    question = f"{DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]} (variant {i}: be brief)"
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": OUTPUT_LENGTHS[i % len(OUTPUT_LENGTHS)],
        "temperature": 0,
    }


def group_rss_mib(pid: int) -> float:
    """Resident memory of every process in `pid`'s process group (the service and its children), MiB."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pid:  # field 5, the process group
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1024


@dataclass
class Window:
    ended_s: float
    answered: int
    verdicts: int
    lags_s: list[float]
    oldest_waiting_s: float
    rss_mib: dict[str, float]

    def line(self) -> str:
        lag = (
            f"lag p50 {statistics.median(self.lags_s):6.1f} s p95 {_p95(self.lags_s):6.1f} s"
            if self.lags_s
            else "lag      -            -    "
        )
        rss = ", ".join(f"{name} {mib:7.1f} MiB" for name, mib in self.rss_mib.items())
        return (f"{self.ended_s / 60:5.1f} min: answered {self.answered:4d}, verdicts {self.verdicts:4d}, {lag}, "
                f"oldest waiting {self.oldest_waiting_s:6.1f} s; RSS {rss}")  # fmt: skip


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


@dataclass
class Soak:
    answered_at: dict[str, float] = field(default_factory=dict)
    verdict_at: dict[str, float] = field(default_factory=dict)
    verdicts: dict[str, str] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    stop_sending: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # the load stopped and every answer has its verdict


async def send(soak: Soak, url: str, key: str, interval_s: float) -> None:
    """One request every `interval_s` until told to stop (a slow answer delays the next: one client)."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0, headers={"Authorization": f"Bearer {key}"}) as client:
        i = 0
        while not soak.stop_sending.is_set():
            began = time.monotonic()
            reply = await client.post("/v1/chat/completions", json=body(i))
            if reply.status_code == 200:
                soak.answered_at[reply.headers["x-reprolane-request-id"]] = time.monotonic()
            else:
                soak.failed.append(f"{reply.status_code}: {reply.text[:200]}")
            i += 1
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - began)))


async def read_verdicts(soak: Soak, bootstrap: str, since: Mark, done: asyncio.Event) -> None:
    """The divergence events the service publishes after `since`, keyed by request id."""
    consumer = AIOKafkaConsumer(**aiokafka_kwargs(KafkaConnectionFields(kafka_bootstrap=bootstrap)),
                                group_id=None, enable_auto_commit=False)  # fmt: skip
    await consumer.start()
    try:
        tps = [TopicPartition(since.topic, p) for p in since.offsets]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, since.offsets[tp.partition])
        while not done.is_set():
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    rid = record.key.decode("utf-8", "replace") if record.key else ""
                    if rid and rid not in soak.verdict_at and record.value is not None:
                        soak.verdict_at[rid] = time.monotonic()
                        soak.verdicts[rid] = json.loads(record.value).get("verdict", "?")
            if soak.stop_sending.is_set() and soak.answered_at.keys() <= soak.verdict_at.keys():
                soak.drained.set()
    finally:
        await consumer.stop()


def window(soak: Soak, t0: float, since: float, services: dict[str, Service]) -> Window:
    now = time.monotonic()
    closed = [rid for rid, at in soak.verdict_at.items() if since <= at < now and rid in soak.answered_at]
    waiting = [now - at for rid, at in soak.answered_at.items() if rid not in soak.verdict_at]
    return Window(
        ended_s=now - t0,
        answered=len(soak.answered_at),
        verdicts=len(soak.verdict_at),
        lags_s=[soak.verdict_at[rid] - soak.answered_at[rid] for rid in closed],
        oldest_waiting_s=max(waiting, default=0.0),
        rss_mib={name: group_rss_mib(s.ref.pid) for name, s in services.items()},
    )


async def soak_run(args: argparse.Namespace, info: StackInfo, url: str, key: str,
                   services: dict[str, Service], since: Mark) -> tuple[Soak, list[Window]]:  # fmt: skip
    soak, done = Soak(), asyncio.Event()
    reader = asyncio.create_task(read_verdicts(soak, info.kafka_bootstrap, since, done))
    sender = asyncio.create_task(send(soak, url, key, args.interval))
    t0 = last = time.monotonic()
    windows: list[Window] = []
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            await asyncio.sleep(args.sample_s)
            windows.append(window(soak, t0, last, services))
            last = time.monotonic()
            print(windows[-1].line(), flush=True)
        soak.stop_sending.set()
        await sender
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(soak.drained.wait(), args.drain_s)
        windows.append(window(soak, t0, last, services))
        print(windows[-1].line() + "  (drained)", flush=True)
    finally:
        soak.stop_sending.set()
        done.set()
        await asyncio.gather(reader, sender, return_exceptions=True)
    return soak, windows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="how long the load runs")
    parser.add_argument("--interval", type=float, default=4.0, help="seconds between requests (one client)")
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds per window")
    parser.add_argument("--drain-s", type=float, default=300.0, help="how long to wait for the last verdicts")
    parser.add_argument("--no-cache-reuse", action="store_true",
                        help="the replayer recomputes every replay's prefix-cache providers' periods (the baseline "
                             "of schedule_reuse_cache)")  # fmt: skip
    args = parser.parse_args()
    info: StackInfo = LocalStack(paths.run_dir()).info()
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    keys = write_demo_keys(work / "api-keys.json", [TENANT])
    port, shipper_port, replayer_port = allocate_ports(3)
    group = f"soak-{uuid.uuid4().hex[:8]}"
    marks = asyncio.run(mark(info.kafka_bootstrap, (TOPIC_ENVELOPES, TOPIC_DIVERGENCES)))
    asyncio.run(start_group_at(info.kafka_bootstrap, group, marks[TOPIC_ENVELOPES]))
    services: dict[str, Service] = {}
    try:
        services["sidecar"] = start_capture(
            info, port=port, spool_dir=work / "spool", sample_rate=0.0, flag_tenants=[TENANT],
            api_keys_path=work / "api-keys.json", ready_key=keys[TENANT], log=work / "capture.log",
        )  # fmt: skip
        services["shipper"] = start_schedule_shipper(info, metrics_port=shipper_port, log=work / "shipper.log")
        reuse = {"REPROLANE_REPLAYER_SCHEDULE_REUSE_CACHE": "false"} if args.no_cache_reuse else {}
        services["replayer"] = start_replayer(info, group_id=group, metrics_port=replayer_port,
                                              log=work / "replayer.log", settings_env=reuse)  # fmt: skip
        for service in services.values():
            service.wait_ready(300.0)
        print(f"soak: {args.minutes:g} min, one request every {args.interval:g} s, windows of {args.sample_s:g} s, "
              f"host CPUs {len(os.sched_getaffinity(0))}; logs in {work}", flush=True)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        soak, windows = asyncio.run(soak_run(args, info, url, keys[TENANT], services, marks[TOPIC_DIVERGENCES]))
    finally:
        for service in services.values():
            service.stop()
    missing = sorted(set(soak.answered_at) - set(soak.verdict_at))
    loaded = [w for w in windows[:-1] if w.lags_s]
    first, last = loaded[: max(1, len(loaded) // 4)], loaded[-max(1, len(loaded) // 4) :]
    warm = windows[min(2, len(windows) - 1)]  # after the replayer's first lane start
    print(f"answered {len(soak.answered_at)}, failed {len(soak.failed)}, verdicts {len(soak.verdict_at)}; without a "
          f"verdict: {len(missing)} (goal 0)")  # fmt: skip
    counts: dict[str, int] = {}
    for verdict in soak.verdicts.values():
        counts[verdict] = counts.get(verdict, 0) + 1
    print(f"verdicts: {counts}")
    if first and last:
        p95_first = _p95([x for w in first for x in w.lags_s])
        p95_last = _p95([x for w in last for x in w.lags_s])
        trend = "bounded" if p95_last <= 1.5 * p95_first else "GROWING: more arrive than this box verifies"
        print(f"lag p95: first quarter {p95_first:.1f} s, last quarter {p95_last:.1f} s ({trend})")
    for name in services:
        print(f"RSS {name}: {warm.rss_mib[name]:.1f} MiB after warm-up, {windows[-1].rss_mib[name]:.1f} MiB at the end")
    for rid in missing[:10]:
        print(f"  no verdict: {rid}")
    return 0 if not missing and not soak.failed else 1


if __name__ == "__main__":
    sys.exit(main())
