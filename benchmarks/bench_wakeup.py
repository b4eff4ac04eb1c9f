"""The machine's floor under a proxy's added latency: one byte's round trip between two processes over loopback TCP.

    .venv/bin/python benchmarks/bench_wakeup.py [--rate 50] [-n 300]

Back to back and at ``--rate`` round trips per second, with both processes on the same core and on two different
cores. At a low rate every core is idle between requests, and on a virtual machine waking one costs far more than
the work: a proxy pinned to its own core adds two cross-core round trips to a request that, sent directly, makes
one between processes sharing a core (how `bench_capture.py` pins them). The difference is what no proxy on this
machine can avoid.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time


def _echo(listener: socket.socket, core: int) -> None:
    os.sched_setaffinity(0, {core})
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(1):
        conn.sendall(data)


def round_trips_us(core_a: int, core_b: int, rate: float, n: int) -> list[float]:
    """`n` round trips (microseconds, sorted) from a process on `core_a` to an echo on `core_b`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    echo = mp.Process(target=_echo, args=(listener, core_b), daemon=True)
    echo.start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core_a})
    try:
        with socket.create_connection(listener.getsockname()) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out = []
            for _ in range(n):
                if rate:
                    time.sleep(1.0 / rate)
                t = time.perf_counter()
                conn.sendall(b"x")
                conn.recv(1)
                out.append((time.perf_counter() - t) * 1e6)
    finally:
        os.sched_setaffinity(0, before)
        echo.join(5)
        listener.close()
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=50.0, help="round trips per second in the paced runs")
    ap.add_argument("-n", type=int, default=300, help="round trips in each paced run (10x back to back)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    for label, a, b in (("same core", cores[0], cores[0]), ("cross core", cores[0], cores[-1])):
        for rate, n in ((0.0, args.n * 10), (args.rate, args.n)):
            rtt = round_trips_us(a, b, rate, n)
            pace = "back to back" if not rate else f"{rate:.0f}/s"
            print(
                f"{label:<10} {pace:>12}: round trip p50 {statistics.median(rtt):6.0f} us"
                f"  p99 {rtt[int(len(rtt) * 0.99)]:6.0f} us"
            )


if __name__ == "__main__":
    main()
