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
import time
from pathlib import Path

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
    import capture.proxy as proxy
    import capture.recorder as recorder
    import capture.recording as recording

    async def nothing(*_: object) -> None:
        return None

    def replace(owner: object, name: str, value: object) -> None:
        if not hasattr(owner, name):  # the code moved on: say so rather than measure the wrong thing
            raise SystemExit(f"switch_off: {owner!r} has no {name!r}")
        setattr(owner, name, value)

    real_decode = proxy.decode_json

    def decode_small_only(content: bytes) -> object:
        return (None, lambda _answer: content) if len(content) > 3000 else real_decode(content)

    for part in parts:
        if part == "finish":
            replace(recorder.EnvelopeRecorder, "finish", nothing)
        elif part == "build":
            replace(recorder, "build_envelope_bytes", lambda _inputs: b'{"x":1}' * 1000)
        elif part == "spool":
            replace(recorder.EnvelopeRecorder, "append", nothing)
        elif part == "collect":
            replace(recording.OutputCollector, "add", lambda _self, _answer: None)
        elif part == "decode":
            replace(proxy, "decode_json", decode_small_only)
            replace(proxy, "strip", lambda answer, _prepared: answer)
        else:
            raise SystemExit(f"switch_off: unknown part {part!r} (known: {', '.join(PARTS)})")


def one_run(procs: bc.Procs, spec: str, upstream: str, args: argparse.Namespace, work: Path, n: int) -> float:
    tree, _, off = spec.partition(":")
    port = bc.free_port()
    spool = work / f"spool-{n}"
    code = SERVE.format(
        tree=tree,
        here=str(Path(__file__).resolve().parent),
        parts=[p for p in off.split("+") if p],
        upstream=upstream,
        port=port,
        mode=args.mode,
        spool=str(spool),
    )
    proc = procs.start("sidecar", [sys.executable, "-c", code])
    base = f"http://127.0.0.1:{port}"
    bc.wait_http(base + "/metrics", proc, 60.0, work / "sidecar.log")
    before = bc.cpu_s(proc.pid)
    res = bc.load(base + "/v1/chat/completions", args.clients, duration=args.duration, prefix=f"ab{n}", out_dir=work)
    used = bc.cpu_s(proc.pid) - before
    procs.stop("sidecar")
    per_request_ms = used * 1000.0 / max(res["done"], 1)
    rps = res["n_ok"] / res["elapsed_s"]
    print(f"{spec:<40} {rps:8.0f} req/s  {per_request_ms:6.3f} ms CPU/request  errors {res['errors']}", flush=True)
    return per_request_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help="source trees (checkouts) to compare, each TREE or TREE:PART+PART")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--mode", choices=("best_effort", "guaranteed"), default="best_effort")
    args = ap.parse_args()
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
    results: dict[str, list[float]] = {s: [] for s in specs}
    with tempfile.TemporaryDirectory(prefix="bench-cpu-ab-") as tmp:
        work = Path(tmp)
        procs = bc.Procs(work)
        try:
            up_port = bc.free_port()
            upstream = procs.start("upstream", [sys.executable, bc.__file__, "_upstream", str(up_port)])
            bc.wait_http(f"http://127.0.0.1:{up_port}/version", upstream, 30.0, work / "upstream.log")
            n = 0
            for _ in range(args.rounds):
                for spec in specs:
                    n += 1
                    results[spec].append(one_run(procs, spec, f"http://127.0.0.1:{up_port}", args, work, n))
                    time.sleep(0.5)
        finally:
            procs.stop_all()
    print(f"\nCPU per request, {args.mode}, {args.clients} clients, {args.rounds} rounds of {args.duration:.0f} s:")
    for spec, values in results.items():
        print(
            f"{spec:<40} median {statistics.median(values):.3f} ms  mean {statistics.mean(values):.3f} ms  "
            f"({', '.join(f'{v:.3f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
