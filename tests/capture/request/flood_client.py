"""A hostile client of the sidecar's edge, run in its own process (so its work does not land in the measuring
client's event loop): half-open connections and trickled bodies from loopback addresses, bounded in count, rate
and time; it stops by itself and prints what it saw as one JSON line.

``python -m tests.capture.request.flood_client --port P --seconds S [--key K] ...`` (`test_edge_flood.py` runs it).
Loopback only: every socket is bound to an address of 127.0.0.0/8 and connects to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import resource
import time
from dataclasses import dataclass, field

HOST = "127.0.0.1"
HALF_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def loopback(address: str) -> str:
    if not ipaddress.ip_address(address).is_loopback:
        raise SystemExit(f"{address} is not a loopback address")
    return address


@dataclass
class Seen:
    opened: int = 0
    closed_by_server: int = 0  # shed, or its head deadline passed
    refused_503: int = 0
    connect_errors: int = 0
    slow_anonymous: dict[str, int] = field(default_factory=dict)
    slow_keyed: list[tuple[int, float]] = field(default_factory=list)  # (status, seconds to the answer)


class Pacer:
    """At most `rate` connection opens a second, all workers together."""

    def __init__(self, rate: float) -> None:
        self._gap, self._next = 1.0 / rate, time.monotonic()

    async def turn(self) -> None:
        now = time.monotonic()
        self._next = max(self._next, now) + self._gap
        if self._next - self._gap > now:
            await asyncio.sleep(self._next - self._gap - now)


async def _open(port: int, source: str, seen: Seen) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        pair = await asyncio.open_connection(HOST, port, local_addr=(source, 0))
    except OSError:
        seen.connect_errors += 1
        return None
    seen.opened += 1
    return pair


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.") else 0


async def half_open(port: int, source: str, n: int, deadline: float, pacer: Pacer, seen: Seen) -> None:
    """Hold a connection that sends part of a head (one in four sends nothing); reopen it when it is closed."""
    while time.monotonic() < deadline:
        await pacer.turn()
        if time.monotonic() >= deadline:  # a turn reserved before the deadline came after it
            return
        pair = await _open(port, source, seen)
        if pair is None:
            await asyncio.sleep(0.1)
            continue
        reader, writer = pair
        try:
            if n % 4:
                writer.write(HALF_HEAD[: 20 + n % 40])
            with contextlib.suppress(TimeoutError):
                raw = await asyncio.wait_for(reader.read(65536), max(0.0, deadline - time.monotonic()))
                if _status(raw) == 503:
                    seen.refused_503 += 1
                else:
                    seen.closed_by_server += 1
        except OSError:
            seen.closed_by_server += 1
        finally:
            writer.close()


async def slow_body(port: int, source: str, key: str | None, deadline: float, seen: Seen) -> None:
    """A whole head announcing a large body, then a byte every quarter second until the sidecar answers."""
    pair = await _open(port, source, seen)
    if pair is None:
        return
    reader, writer = pair
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    writer.write(HALF_HEAD + auth + b"Content-Length: 100000\r\n\r\n{")
    t0 = time.monotonic()
    answer = asyncio.ensure_future(reader.read(65536))  # the answer's first bytes: a reset may follow them
    try:
        while not answer.done() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                writer.write(b" ")
            await asyncio.wait([answer], timeout=0.25)
        raw = answer.result() if answer.done() and answer.exception() is None else b""
    finally:
        answer.cancel()
        writer.close()
    status = _status(raw)
    if key:
        seen.slow_keyed.append((status, time.monotonic() - t0))
    else:
        seen.slow_anonymous[str(status)] = seen.slow_anonymous.get(str(status), 0) + 1


async def flood(args: argparse.Namespace) -> Seen:
    seen = Seen()
    deadline = time.monotonic() + args.seconds
    pacer = Pacer(args.rate)
    spread = [loopback(a) for a in args.spread]
    tasks = [half_open(args.port, args.source, n, deadline, pacer, seen) for n in range(args.half_open)]
    tasks += [half_open(args.port, spread[n % len(spread)], n, deadline, pacer, seen) for n in range(args.spread_n)]
    tasks += [slow_body(args.port, args.source, None, deadline, seen) for _ in range(args.slow)]
    keyed_source = loopback(args.keyed_source or args.source)
    tasks += [slow_body(args.port, keyed_source, args.key, deadline, seen) for _ in range(args.slow_keyed)]
    await asyncio.gather(*tasks)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--source", type=loopback, default="127.0.0.2")
    parser.add_argument("--half-open", type=int, default=3000, help="half-open connections from --source")
    parser.add_argument("--spread", nargs="*", default=[], help="loopback addresses for --spread-n more")
    parser.add_argument("--spread-n", type=int, default=0)
    parser.add_argument("--slow", type=int, default=200, help="anonymous trickled bodies from --source")
    parser.add_argument("--slow-keyed", type=int, default=20, help="trickled bodies with --key from --source")
    parser.add_argument("--key", default=None)
    parser.add_argument("--keyed-source", default=None, help="the keyed trickles' address (default: --source)")
    parser.add_argument("--rate", type=float, default=2000.0, help="connection opens a second, at most")
    args = parser.parse_args()
    total = args.half_open + args.spread_n + args.slow + args.slow_keyed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < total + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, total + 256), hard))
    seen = asyncio.run(flood(args))
    print(json.dumps(seen.__dict__), flush=True)


if __name__ == "__main__":
    main()
