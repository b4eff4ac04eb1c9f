"""CPU per captured request of the sidecar from two (or more) source trees, alternated, on one pinned core.

On this machine the sidecar's throughput drifts by 20% within minutes (other tenants of the host), so a change
is judged by the sidecar's own CPU time per request (user + system, from /proc via psutil), measured for each
tree in turn, several rounds, in one run: the same load, the same fast upstream, the same core.

    git worktree add /tmp/before HEAD~1        # or any other checkout to compare with
    .venv/bin/python benchmarks/bench_cpu_ab.py /tmp/before . [--rounds 6] [--duration 6] [--mode best_effort]

Where the CPU goes: ``TREE:PART+PART`` runs that tree with parts of the capture switched off (the answer the client
gets stays right except with ``decode``; the envelopes do not), so the differences attribute CPU in the running
process, where caches are cold, rather than in a micro-benchmark:

    .venv/bin/python benchmarks/bench_cpu_ab.py . .:spool .:build .:finish .:finish+collect \
        .:finish+collect+decode

Parts: ``finish`` (no envelope at all), ``build`` (a fixed payload spooled instead of the envelope), ``spool``
(the envelope built, not spooled), ``collect`` (upstream's answer not collected), ``decode`` (upstream's answer
forwarded as it came: neither parsed nor stripped).

``--together``: the trees' sidecars run *at the same time* on the same core, each loaded by its own share of the
clients, and each round prints every tree's CPU per request relative to the first's. Whatever the host does to
that core in a round it does to all of them, so the ratios vary by a few % where one-at-a-time runs drift by
20%: the way to judge a change of 3-10%. (Two sidecars share the core's caches, so the absolute figures are
higher than alone; compare ratios.)

    .venv/bin/python benchmarks/bench_cpu_ab.py /tmp/before . --together [--rounds 6]

``--rate R`` (with ``--together``): each sidecar is offered R requests/s (open loop) instead of its clients back
to back, and each round also prints every tree's p50 and p99 latency. Below saturation a sidecar spends more CPU
per request (fewer requests share each loop turn and each fsync), so a change can pay there and not at full load:

    .venv/bin/python benchmarks/bench_cpu_ab.py /tmp/before . --together --rate 400 --clients 200

Pieces (from `bench_capture`): its fast vLLM-shaped upstream and its load generator (N clients back to back) on
the other cores, the sidecar alone on the last core, started as ``capture.cli.serve`` of each tree with a real
spool on disk and no sinks. Prints one line per run and the median and mean per tree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_capture as bc

SERVE = (
    "import sys; sys.path.insert(0, {tree!r}); sys.path.insert(1, {here!r}); from pathlib import Path; "
    "import bench_cpu_ab; bench_cpu_ab.switch_off({parts!r}); from capture.cli import build_settings, serve; "
    "serve(build_settings(upstream={upstream!r}, port={port}, mode={mode!r}, spool_dir=Path({spool!r})))"
)
PARTS = ("finish", "build", "spool", "collect", "decode")


def switch_off(parts: list[str]) -> None:
    """Replace the named parts of the capture with no-ops, in the sidecar process (before it serves)."""
    if not parts:
        return
    import capture.protocol.output as output
    import capture.request.envelope_writer as envelope_writer
    import capture.request.non_streaming as non_streaming

    async def nothing(*_: object) -> None:
        return None

    def replace(owner: object, name: str, value: object) -> None:
        if not hasattr(owner, name):  # the code moved on: say so rather than measure the wrong thing
            raise SystemExit(f"switch_off: {owner!r} has no {name!r}")
        setattr(owner, name, value)

    real_decode = non_streaming.decode_json

    def decode_small_only(content: bytes) -> object:
        return (None, lambda _answer: content) if len(content) > 3000 else real_decode(content)

    for part in parts:
        if part == "finish":
            replace(envelope_writer.EnvelopeWriter, "finish", nothing)
        elif part == "build":
            replace(envelope_writer, "build_envelope_bytes", lambda _inputs: b'{"x":1}' * 1000)
        elif part == "spool":
            replace(envelope_writer.EnvelopeWriter, "append", nothing)
        elif part == "collect":
            replace(output.OutputCollector, "add", lambda _self, _answer: None)
        elif part == "decode":
            replace(non_streaming, "decode_json", decode_small_only)
            replace(non_streaming, "strip", lambda answer, _prepared: answer)
        else:
            raise SystemExit(f"switch_off: unknown part {part!r} (known: {', '.join(PARTS)})")


def one_run(procs: bc.Procs, spec: str, upstream: str, args: argparse.Namespace, work: Path, n: int) -> float:
    pid, port = start_sidecar(procs, "sidecar", spec, upstream, args.mode, work / f"spool-{n}")
    before = bc.cpu_s(pid)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    res = bc.load(url, args.clients, duration=args.duration, prefix=f"ab{n}", out_dir=work)
    per_request_ms = bc.cpu_ms_per_request(pid, before, res["done"])
    procs.stop("sidecar")
    rps = res["n_ok"] / res["elapsed_s"]
    print(f"{spec:<40} {rps:8.0f} req/s  {per_request_ms:6.3f} ms CPU/request  errors {res['errors']}", flush=True)
    return per_request_ms


def start_sidecar(procs: bc.Procs, name: str, spec: str, upstream: str, mode: str, spool: Path) -> tuple[int, int]:
    """Serve `spec` (``TREE`` or ``TREE:PART+PART``) as sidecar `name`: its pid and port once it answers."""
    tree, _, off = spec.partition(":")
    port = bc.free_port()
    code = SERVE.format(
        tree=tree,
        here=str(Path(__file__).resolve().parent),
        parts=[p for p in off.split("+") if p],
        upstream=upstream,
        port=port,
        mode=mode,
        spool=str(spool),
    )
    proc = procs.start(name, [sys.executable, "-c", code])
    bc.wait_http(f"http://127.0.0.1:{port}/metrics", proc, 60.0, spool.parent / f"{name}.log")
    return proc.pid, port


def together_round(
    procs: bc.Procs, specs: list[str], upstream: str, args: argparse.Namespace, work: Path, n: int
) -> list[tuple[float, float, float]]:
    """One round of ``--together``: every spec's sidecar on the one core at once, clients split evenly; CPU ms
    per request, p50 and p99 latency (ms) of each, in the order of `specs` (started in a rotating order, so no
    tree always starts first; the same tree may be given twice, to see the harness's own spread)."""
    order = [(i + n) % len(specs) for i in range(len(specs))]
    started = {
        i: start_sidecar(procs, f"sidecar{i}", specs[i], upstream, args.mode, work / f"spool-{n}-{i}") for i in order
    }
    before = {i: bc.cpu_s(pid) for i, (pid, _) in started.items()}
    results: dict[int, dict[str, Any]] = {}

    def run(i: int) -> None:
        url = f"http://127.0.0.1:{started[i][1]}/v1/chat/completions"
        share = max(args.clients // len(specs), 1)
        results[i] = bc.load(url, share, duration=args.duration, prefix=f"t{n}-{i}", out_dir=work, rate=args.rate)

    threads = [threading.Thread(target=run, args=(i,)) for i in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    per_request = [bc.cpu_ms_per_request(started[i][0], before[i], results[i]["done"]) for i in range(len(specs))]
    p50 = [bc.pct(results[i]["lat_ms"], 50) for i in range(len(specs))]
    p99 = [bc.pct(results[i]["lat_ms"], 99) for i in range(len(specs))]
    for i in order:
        procs.stop(f"sidecar{i}")
    cells = "  ".join(f"{v:.3f} ms ({v / per_request[0]:.3f})" for v in per_request)
    if args.rate:
        cells += "  p50/p99 ms " + "  ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(p50, p99, strict=True))
    print(f"round {n + 1}: {cells}", flush=True)
    return list(zip(per_request, p50, p99, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="source trees (checkouts) to compare, each TREE or TREE:PART+PART")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--mode", choices=("best_effort", "guaranteed"), default="best_effort")
    ap.add_argument("--together", action="store_true", help="all trees at once on one core; ratios per round")
    ap.add_argument("--rate", type=float, default=0.0, help="with --together: req/s offered to each sidecar (0: max)")
    args = ap.parse_args()
    if args.rate and not args.together:
        raise SystemExit("--rate needs --together")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores: the sidecar alone on one, upstream and load on the others")
    bc.PROXY_CORES, bc.CLIENT_CORES = {cores[-1]}, set(cores[:-1])
    specs = []
    for spec in args.specs:
        tree, sep, off = spec.partition(":")
        unknown = [p for p in off.split("+") if p and p not in PARTS]
        if unknown or not (Path(tree) / "capture").is_dir():
            raise SystemExit(f"{spec}: not a checkout of reprolane, or unknown parts {unknown}")
        specs.append(f"{Path(tree).resolve()}{sep}{off}")
    results: list[list[float]] = [[] for _ in specs]  # by position: the same tree may be given twice
    latencies: list[list[tuple[float, float]]] = [[] for _ in specs]
    with tempfile.TemporaryDirectory(prefix="bench-cpu-ab-") as tmp:
        work = Path(tmp)
        procs = bc.Procs(work)
        try:
            up_port = bc.free_port()
            upstream = procs.start("upstream", [sys.executable, bc.__file__, "_upstream", str(up_port)])
            bc.wait_http(f"http://127.0.0.1:{up_port}/version", upstream, 30.0, work / "upstream.log")
            n = 0
            for r in range(args.rounds):
                if args.together:
                    values = together_round(procs, specs, f"http://127.0.0.1:{up_port}", args, work, r)
                    for result, latency, (cpu, p50, p99) in zip(results, latencies, values, strict=True):
                        result.append(cpu)
                        latency.append((p50, p99))
                    continue
                for spec, result in zip(specs, results, strict=True):
                    n += 1
                    result.append(one_run(procs, spec, f"http://127.0.0.1:{up_port}", args, work, n))
                    time.sleep(0.5)
        finally:
            procs.stop_all()
    how = "together on one core" if args.together else "one at a time"
    if args.rate:
        how += f", {args.rate:g} req/s offered to each"
    print(
        f"\nCPU per request, {args.mode}, {args.clients} clients, {how}, {args.rounds} rounds of {args.duration:.0f} s:"
    )
    first = results[0]
    for spec, values in zip(specs, results, strict=True):
        ratios = [v / f for v, f in zip(values, first, strict=True)]
        print(
            f"{spec:<40} median {statistics.median(values):.3f} ms  mean {statistics.mean(values):.3f} ms  "
            f"({', '.join(f'{v:.3f}' for v in values)})  ratio to the first: median {statistics.median(ratios):.3f}"
            f" ({min(ratios):.3f}-{max(ratios):.3f})"
        )
    if args.rate:
        print("\nlatency, median of the rounds' p50 and p99:")
        for spec, latency in zip(specs, latencies, strict=True):
            p50s, p99s = [a for a, _ in latency], [b for _, b in latency]
            print(f"{spec:<40} p50 {statistics.median(p50s):.2f} ms  p99 {statistics.median(p99s):.2f} ms")


if __name__ == "__main__":
    main()
