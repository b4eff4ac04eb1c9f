"""Benchmark of shadow traffic: the client's latency through the capture sidecar with every request shadowed.

    .venv/bin/python benchmarks/bench_shadow.py [--rounds 3] [--duration 4] [--clients 50] [--rate 50]
        [--mode guaranteed] [--slow-delay-s 2] [--shadow-timeout-s 0.5] [--shadow-queue 64]
        [--settle-s 20] [--no-pin] [--markdown] [--json FILE]

Shadowing must never delay, change or fail the client's answer (`capture.request.shadow`: the request path only hashes
the request id and ``put_nowait``s the envelope; workers send it later). This measures that promise from the
client's side. Built from bench_capture.py's parts (its fast fake upstream, load generator, process handling,
percentiles), every piece in its own process on 127.0.0.1:

- three sidecars through the real CLI (``reprolane serve capture``, the same ``--mode``, a spool on disk, no
  sinks) in front of the same fast upstream: ``off`` without shadowing; ``fast`` with ``--shadow-upstream`` a
  second fake upstream that answers the shadow's ``/v1/completions`` at once, ``--shadow-sample 1.0``; ``slow``
  with a third one that answers only after ``--slow-delay-s``, past the sidecar's shadow timeout
  (``REPROLANE_CAPTURE_SHADOW_TIMEOUT_S``, here ``--shadow-timeout-s``), so every shadow times out and, once its
  bounded queue (``--shadow-queue``) is full, the rest are dropped. The candidates run with the upstream and the
  load generator (a candidate belongs on hardware of its own), the sidecars on the proxies' core, as in
  bench_capture.py.
- ``--rounds`` rounds; in each, every sidecar takes the same open-loop load (``--clients`` at ``--rate`` req/s
  for ``--duration`` s after a 1-s warm-up; latency from each request's scheduled time), in an order rotated
  from round to round. The machine is shared and drifts within minutes, so a figure is a ratio against ``off``
  *of the same round*: per round, p50 and p99 of ``fast`` and ``slow`` over ``off``'s; reported is the median of
  the rounds' ratios (and their range), beside the pooled percentiles. ``CPU ms/req`` is the sidecar's CPU per
  request sent, its shadows' work (which runs on the same core, after the answer) included: the figure that
  contention distorts least, and what shadowing costs the sidecar's core.
- after the rounds: each sidecar's ``reprolane_capture_shadow_total{outcome}`` (scraped once the shadows have
  settled, or after a wait), then a clean stop and the spool read back: every request answered 200 must have
  its production envelope there; the shadow envelopes in it are counted too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_capture as bc  # the benchmark machinery this one shares

TARGETS = ("off", "fast", "slow")
SHADOW_METRIC = "reprolane_capture_shadow_total"


def shadow_outcomes(base: str) -> dict[str, float]:
    """``reprolane_capture_shadow_total`` of a sidecar by its ``outcome`` label."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    head = SHADOW_METRIC + '{outcome="'
    for line in text.splitlines():
        if line.startswith(head):
            label, value = line[len(head) :].split('"', 1)[0], line.rsplit(" ", 1)[1]
            out[label] = out.get(label, 0.0) + float(value)
    return out


def settle(base: str, offered: int, within_s: float) -> dict[str, float]:
    """The shadow counts once every offered shadow has an outcome, or as they stand after `within_s`."""
    deadline = time.monotonic() + within_s
    counts = shadow_outcomes(base)
    while sum(counts.values()) < offered and time.monotonic() < deadline:
        time.sleep(0.5)
        counts = shadow_outcomes(base)
    return counts


def spool_contents(directory: Path) -> tuple[set[str], int]:
    """The client request ids of a spool's production envelopes, and how many shadow envelopes it holds."""
    ids: set[str] = set()
    shadows = 0
    for payload in asyncio.run(bc._read_spool(directory)):
        doc = json.loads(payload)
        if doc.get("shadow") is not None:
            shadows += 1
        elif doc.get("client_request_id"):
            ids.add(doc["client_request_id"])
    return ids, shadows


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def summarise(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per target: pooled p50/p99, the median CPU ms/req, and per round p50/p99/CPU over ``off``'s that round
    (their median and the list)."""
    out: dict[str, dict[str, Any]] = {}
    for name in TARGETS:
        lat = [x for r in rounds for x in r[name]["lat_ms"]]
        row: dict[str, Any] = {
            "n": len(lat),
            "p50": bc.pct(lat, 50),
            "p99": bc.pct(lat, 99),
            "errors": {},
        }
        for r in rounds:
            for err, n in r[name]["errors"].items():
                row["errors"][err] = row["errors"].get(err, 0) + n
        row["cpu_ms"] = statistics.median(r[name]["cpu_ms"] for r in rounds)
        for q in ("p50", "p99", "cpu_ms"):
            per_round = [ratio(r[name][q], r["off"][q]) for r in rounds]
            values = [v for v in per_round if v is not None]
            row[f"{q}_ratios"] = values
            row[f"{q}_ratio"] = statistics.median(values) if values else None
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (each target once per round)")
    ap.add_argument("--duration", type=float, default=4.0, help="measured seconds per target per round")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--rate", type=float, default=50.0, help="offered req/s, all clients together (open loop)")
    ap.add_argument("--mode", choices=("guaranteed", "best_effort"), default="guaranteed")
    ap.add_argument("--slow-delay-s", type=float, default=2.0, help="the slow candidate's delay before it answers")
    ap.add_argument("--shadow-timeout-s", type=float, default=0.5, help="the sidecars' shadow timeout")
    ap.add_argument(
        "--shadow-queue",
        type=int,
        default=64,
        help="the sidecars' shadow queue (smaller than the default 256, so the"
        " slow candidate's backlog overflows it within a round and drops are measured too)",
    )
    ap.add_argument("--settle-s", type=float, default=20.0, help="wait at most this long for shadows to settle")
    ap.add_argument("--no-pin", action="store_true", help="let the OS place every process on any core")
    ap.add_argument("--markdown", action="store_true", help="also print the BENCHMARKS.md rows")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    if args.slow_delay_s <= args.shadow_timeout_s:
        ap.error("--slow-delay-s must exceed --shadow-timeout-s (the slow candidate answers past the timeout)")
    cores = sorted(os.sched_getaffinity(0))
    if not args.no_pin and len(cores) >= 2:
        bc.PROXY_CORES, bc.CLIENT_CORES = {cores[-1]}, set(cores[:-1])

    run_id = uuid.uuid4().hex[:8]
    work = bc.BENCH_DIR / f"shadow-{run_id}"
    (work / "logs").mkdir(parents=True)
    procs = bc.Procs(work / "logs")
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "pinned": {"sidecars": sorted(bc.PROXY_CORES), "upstream, candidates, load": sorted(bc.CLIENT_CORES)},
        "load_avg_start": os.getloadavg(),
        "args": " ".join(sys.argv[1:]),
    }
    try:
        servers: dict[str, str] = {}
        for name, delay in (("upstream", 0.0), ("candidate-fast", 0.0), ("candidate-slow", args.slow_delay_s)):
            port = bc.free_port()
            cmd = [sys.executable, bc.__file__, "_upstream", str(port), str(delay)]
            p = procs.start(name, cmd, cores=bc.CLIENT_CORES)
            servers[name] = f"http://127.0.0.1:{port}"
            bc.wait_http(servers[name] + "/version", p, 30, procs.logs / f"{name}.log")
        env = {
            **bc.sidecar_env(work / "no-stack"),
            "REPROLANE_CAPTURE_SHADOW_TIMEOUT_S": str(args.shadow_timeout_s),
            "REPROLANE_CAPTURE_SHADOW_QUEUE": str(args.shadow_queue),
        }
        sidecars: dict[str, tuple[str, Any]] = {}
        for name in TARGETS:
            port = bc.free_port()
            cmd = bc.sidecar_cmd(port, args.mode, work / f"spool-{name}", servers["upstream"])
            if name != "off":
                cmd += ["--shadow-upstream", servers[f"candidate-{name}"], "--shadow-sample", "1.0"]
            sidecars[name] = (f"http://127.0.0.1:{port}", procs.start(name, cmd, env=env))
        for name, (base, p) in sidecars.items():
            bc.wait_http(base + "/version", p, 60, procs.logs / f"{name}.log")

        rounds: list[dict[str, dict[str, Any]]] = []
        answered: dict[str, set[str]] = {name: set() for name in TARGETS}  # measured, answered 200
        sent = dict.fromkeys(TARGETS, 0)  # every request finished, warm-up included (each one is shadowed)
        for k in range(args.rounds):
            order = TARGETS[k % 3 :] + TARGETS[: k % 3]
            rounds.append({})
            for name in order:
                base, p = sidecars[name]
                prefix = f"sh-{run_id}-{name}-{k}"
                cpu0 = bc.cpu_s(p.pid)
                with bc.timed(f"round {k + 1}/{args.rounds}: {name} x{args.clients} at {args.rate:.0f} req/s"):
                    r = bc.load(
                        base + "/v1/chat/completions",
                        args.clients,
                        duration=args.duration,
                        prefix=prefix,
                        out_dir=work,
                        rate=args.rate,
                        keep_ids=True,
                    )
                answered[name] |= {f"{prefix}-{i}" for i in r["ok_ids"]}
                sent[name] += r["done"]
                lat = r["lat_ms"]
                cell = {"lat_ms": lat, "p50": bc.pct(lat, 50), "p99": bc.pct(lat, 99), "errors": r["errors"]}
                bc.wait_idle(p.pid, within_s=5.0)  # a cell's work (its shadows) must not run into the next one
                cell["cpu_ms"] = bc.cpu_ms_per_request(p.pid, cpu0, r["done"])  # its shadows' work included
                rounds[-1][name] = cell
                print(
                    f"   n={len(lat)} p50={cell['p50']:.2f} ms p99={cell['p99']:.2f} ms "
                    f"cpu/req={cell['cpu_ms']:.3f} ms errors={r['errors']}"
                )
        res["summary"] = summarise(rounds)
        res["rounds"] = [{n: {q: c[q] for q in ("p50", "p99", "cpu_ms")} for n, c in r.items()} for r in rounds]
        res["shadows"] = {}
        for name in ("fast", "slow"):
            with bc.timed(f"shadows of {name} settling (at most {args.settle_s:.0f} s)"):
                counts = settle(sidecars[name][0], sent[name], args.settle_s)
            res["shadows"][name] = {"offered": sent[name], **counts}
        res["exit"] = {name: procs.stop(name) for name in TARGETS}
        res["spool"] = {}
        for name in TARGETS:
            ids, shadows = spool_contents(work / f"spool-{name}")
            res["spool"][name] = {
                "sent": sent[name],
                "production_envelopes": len(ids),
                "answered": len(answered[name]),
                "in_spool": len(answered[name] & ids),
                "lost": len(answered[name] - ids),
                "shadow_envelopes": shadows,
            }
    finally:
        procs.stop_all()
        for spool in work.glob("spool-*"):
            shutil.rmtree(spool, ignore_errors=True)
    res["load_avg_end"] = os.getloadavg()
    print("\n".join(["", "== shadow traffic benchmark ==", *render(res, md=False)]))
    if args.markdown:
        print("\n".join(["", *render(res, md=True)]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


def render(res: dict[str, Any], *, md: bool) -> list[str]:
    def fmt(v: float | None, spec: str = "{:.2f}") -> str:
        return "-" if v is None else spec.format(v)

    def row(cells: list[str]) -> str:
        return ("| " + " | ".join(cells) + " |") if md else "  ".join(f"{c:>14}" for c in cells)

    out = [f"`bench_shadow.py {res['args']}`".replace(" `", "`") if md else f"args: {res['args']}", ""]
    head = ["sidecar", "measured", "errors", "p50 ms", "p99 ms", "p50 / off", "p99 / off", "CPU ms/req", "/ off"]
    out.append(row([*head, "sent / spooled", "lost", "shadows"]))
    if md:
        out.append(row(["---"] * 12))
    for name in TARGETS:
        s, sp = res["summary"][name], res["spool"][name]
        sh = res["shadows"].get(name)
        shadows = "-" if sh is None else ", ".join(f"{k} {v:.0f}" for k, v in sh.items())
        shadows += "" if sh is None else f"; spooled {sp['shadow_envelopes']}"
        spans = {q: s[f"{q}_ratios"] if name != "off" else [] for q in ("p50", "p99", "cpu_ms")}
        lo_hi = {q: f" ({min(v):.3f}-{max(v):.3f})" if v else "" for q, v in spans.items()}
        out.append(
            row(
                [
                    name,
                    str(s["n"]),
                    json.dumps(s["errors"]) if s["errors"] else "0",
                    fmt(s["p50"]),
                    fmt(s["p99"]),
                    fmt(s["p50_ratio"], "{:.3f}") + lo_hi["p50"],
                    fmt(s["p99_ratio"], "{:.3f}") + lo_hi["p99"],
                    fmt(s["cpu_ms"], "{:.3f}"),
                    fmt(s["cpu_ms_ratio"], "{:.3f}") + lo_hi["cpu_ms"],
                    f"{sp['sent']} / {sp['production_envelopes']}",
                    str(sp["lost"]),
                    shadows,
                ]
            )
        )
    out.append("")
    out.append(
        "ratios: per round, the sidecar's percentile over off's in the same round; median over rounds (min-max);"
        " p50/p99 ms pooled over the rounds; CPU ms/req: the sidecar's user + system CPU per request sent, its"
        " shadows' work included (median over rounds); sent / spooled: requests sent (warm-up included) / production"
        " envelopes in the spool; lost: measured requests answered 200 without one; shadows: counted by outcome"
        " (reprolane_capture_shadow_total) at the scrape, spooled: shadow envelopes in the spool after the stop"
    )
    out.append(
        f"cpus {res['cpus']}, pinned {res['pinned']}, load average at start {res['load_avg_start'][0]:.2f}, "
        f"at end {res['load_avg_end'][0]:.2f}; {res['date']}"
    )
    return out


if __name__ == "__main__":
    main()
