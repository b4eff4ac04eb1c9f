"""Nobody without a key can hold the sidecar: the real CLI sidecar (``reprolane serve capture``, keys required) in
front of the fake upstream, flooded from loopback addresses by `tests.capture.request.flood_client` in its own process
(thousands of half-open connections and trickled bodies from one address, reopened as they are closed, and more
from a spread of addresses past ``max_connections``), while a caller with a valid key keeps being served on fresh
connections and ``/metrics`` stays reachable.

The caller's latency is measured in the same run before the flood and during it; the figures are printed (run
with ``-s``) and the loaded p99 held to a few times the unloaded one. Before the connection table, uvicorn's
``limit_concurrency`` counted the half-open connections, and the caller got 503 for as long as they were held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.capture.fake_upstream import FakeUpstream, serve
from tests.capture.keys import write_test_keys
from tests.capture.request.cli_sidecar import HOST, REPO, cli_sidecar, parse_response

FLOOD_S = 7.0
CALLER = "127.0.0.3"
KEPT_ALIVE = "127.0.0.5"
TRICKLER = "127.0.0.6"  # a tenant with a valid key that trickles its bodies
SCRAPER = "127.0.0.4"
SPREAD = [f"127.0.0.{n}" for n in range(10, 22)]
CHAT = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]})


async def exchange_from(source: str, port: int, request: bytes, timeout_s: float = 10.0) -> int:
    """The status of `request` sent on a new connection from loopback address `source`."""
    reader, writer = await asyncio.open_connection(HOST, port, local_addr=(source, 0))
    try:
        writer.write(request)
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return parse_response(raw)[0] if raw else 0


def keyed_chat(key: str) -> bytes:
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(CHAT)}\r\nConnection: close\r\n\r\n"
    )
    return (head + CHAT).encode()


METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


async def timed_calls(port: int, request: bytes, until: float, at_least: int) -> list[tuple[int, float]]:
    """Keyed calls one after another, each on a fresh connection, until `until` (and at least `at_least`)."""
    out: list[tuple[int, float]] = []
    while time.monotonic() < until or len(out) < at_least:
        t0 = time.perf_counter()
        try:
            status = await exchange_from(CALLER, port, request)
        except OSError:
            status = 0
        out.append((status, time.perf_counter() - t0))
    return out


async def kept_alive_calls(port: int, key: str, until: float, at_least: int) -> list[tuple[int, float]]:
    """Keyed calls one after another on one kept-alive connection (as an SDK client makes them)."""
    out: list[tuple[int, float]] = []
    transport = httpx.AsyncHTTPTransport(local_address=KEPT_ALIVE, limits=httpx.Limits(max_connections=1))
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", transport=transport, timeout=10) as client:
        while time.monotonic() < until or len(out) < at_least:
            t0 = time.perf_counter()
            try:
                status = (await client.post("/v1/chat/completions", content=CHAT, headers=headers)).status_code
            except httpx.HTTPError:
                status = 0
            out.append((status, time.perf_counter() - t0))
    return out


def figures(samples: list[tuple[int, float]]) -> str:
    times = sorted(t for _, t in samples)
    at = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e3  # noqa: E731
    return f"p50 {at(0.5):.1f} ms, p99 {at(0.99):.1f} ms, max {times[-1] * 1e3:.1f} ms (n={len(times)})"


def p99(samples: list[tuple[int, float]]) -> float:
    ordered = sorted(t for _, t in samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def test_a_keyed_caller_and_metrics_are_served_through_a_flood_of_half_open_connections(tmp_path: Path) -> None:
    keys = write_test_keys(tmp_path)
    env = {
        "auth_mode": "keys",
        "api_keys_path": str(keys.path),
        "max_connections": "1024",  # the spread's connections fill it: the oldest anonymous ones are shed
        "request_body_timeout_s": "2",
    }
    async with serve(FakeUpstream().app()) as up_url, cli_sidecar(up_url, tmp_path, **env) as sidecar:
        request = keyed_chat(keys.bank)
        await timed_calls(sidecar.port, request, 0, 20)  # warm up
        unloaded, unloaded_kept = await asyncio.gather(
            timed_calls(sidecar.port, request, 0, 150), kept_alive_calls(sidecar.port, keys.bank, 0, 150)
        )
        argv = [sys.executable, "-m", "tests.capture.request.flood_client", "--port", str(sidecar.port)]
        argv += ["--seconds", str(FLOOD_S), "--half-open", "3000", "--slow", "200", "--slow-keyed", "20"]
        argv += ["--key", keys.attacker, "--spread", *SPREAD, "--spread-n", "1200", "--rate", "1000"]
        argv += ["--keyed-source", TRICKLER]
        flooder = await asyncio.create_subprocess_exec(
            *argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE
        )
        try:
            await asyncio.sleep(2.5)  # the flood has opened thousands of connections and reopens what is closed
            until = time.monotonic() + FLOOD_S - 3.5
            loaded, loaded_kept, scrapes = await asyncio.gather(
                timed_calls(sidecar.port, request, until, 50),
                kept_alive_calls(sidecar.port, keys.bank, until, 50),
                scrape_metrics(sidecar.port, until),
            )
            out, _ = await asyncio.wait_for(flooder.communicate(), FLOOD_S + 30)
        finally:
            if flooder.returncode is None:
                flooder.kill()
                await flooder.wait()
    seen = json.loads(out)
    print(
        f"\nkeyed caller, kept-alive connection: unloaded {figures(unloaded_kept)}; flooded {figures(loaded_kept)}"
        f"\nkeyed caller, a fresh connection per request: unloaded {figures(unloaded)}; flooded {figures(loaded)}"
        f"\n/metrics: {len(scrapes)} scrapes; flood: {json.dumps({k: v for k, v in seen.items() if k != 'slow_keyed'})}"
        f", keyed trickled bodies answered {sorted({(s, round(t, 1)) for s, t in seen['slow_keyed']})}"
    )
    assert [s for s, _ in loaded_kept if s != 200] == []
    assert [s for s, _ in loaded if s != 200] == []
    assert [s for s in scrapes if s != 200] == []
    assert len(scrapes) >= 5
    assert seen["opened"] > 4000  # the flood was one: thousands of connections, reopened as they were closed
    assert seen["closed_by_server"] > 1000  # ... and the sidecar shed them
    assert len(seen["slow_keyed"]) == 20
    assert all(status == 408 and took < 2 + 3 for status, took in seen["slow_keyed"]), seen["slow_keyed"]
    assert p99(loaded_kept) <= 5 * p99(unloaded_kept), (figures(loaded_kept), figures(unloaded_kept))


async def scrape_metrics(port: int, until: float) -> list[int]:
    out = []
    while time.monotonic() < until:
        try:
            out.append(await exchange_from(SCRAPER, port, METRICS))
        except OSError:
            out.append(0)
        await asyncio.sleep(0.2)
    return out
