"""Benchmark of the capture sidecar: added latency against calling upstream directly, throughput, memory.

    .venv/bin/python benchmarks/bench_capture.py [--duration 8] [--clients 1,50,200] [--rates 50,1000]
        [--throughput-s 20]
        [--memory-requests 200000] [--memory-fit-from 100000] [--memory-budget-s 240] [--no-pin] [--no-floor]
        [--litellm-venv DIR | --no-litellm] [--sinks N] [--sinks-s3-processes 0,2]
        [--markdown] [--json FILE]

Every piece runs in its own process on 127.0.0.1: a fast OpenAI-shaped upstream (raw asyncio + httptools +
uvloop, vLLM 0.32's response shapes: ``prompt_token_ids``, ``token_ids``, logprobs when asked, spelled as vLLM
spells them under ``return_tokens_as_token_ids`` and with full-precision values, ``system_fingerprint``,
``/version``; ``/v1/completions`` too, for bench_shadow.py's shadow candidates), the sidecar started through the
real CLI (``reprolane serve capture``) once per mode with a real spool on disk and no sinks, LiteLLM's proxy from
its own venv (created on demand, skipped with a printed reason when it cannot be installed), and a load generator
(aiohttp, N clients sending back to back for a fixed time, the first second dropped as warm-up).

Phases, all in one run:

1. latency: for each client count, direct / floor / best_effort / guaranteed / LiteLLM back to back; added latency
   is pXX(through the proxy) - pXX(direct), percentiles of each distribution subtracted. The floor (``--no-floor``
   skips it) is a forwarder built from the sidecar's own parts (uvicorn, uvloop, httptools,
   ``capture.request.upstream``) that captures nothing, on the proxies' core: what it adds is this machine's price for
   any proxy on that stack, and the sidecar's added latency minus the floor's is what capturing costs. One client sends
   back to back (closed loop). More clients send at a fixed total rate for each of ``--rates`` (open loop: client i of N
   sends at t0 + i/R + k*N/R; latency is measured from that *scheduled* time, so a target that falls behind is charged
   for the wait, with no coordinated omission): back-to-back clients would only measure a queue (50 clients / the
   target's capacity), not what one request pays for going through the proxy. ``CPU ms/req`` is the CPU time (user +
   system, all threads and child processes) the target process spent per request: on a shared, loaded machine it is the
   figure that contention distorts least (latency and req/s mostly measure the scheduler). For ``direct`` it is the
   fake upstream's own cost.
2. throughput: each mode for ``--throughput-s`` at 50 clients; requests/s overall and the slowest 1-s bucket;
   then the sidecar is stopped cleanly and its spool read back: every request id answered 200 must be there.
3. memory: a best_effort sidecar whose publisher drains to a null sink (the steady state: spool written, read
   back, acked and reclaimed, as with real sinks) takes ``--memory-requests`` requests (capped by
   ``--memory-budget-s``); its RSS is sampled every 10k requests and a slope fitted from ``--memory-fit-from``
   on: the first 100k requests fill the sidecar's bounded window of recent request ids (``RecentIds``, 11 MiB
   at its 100k capacity, by design), so "flat" is judged over the 100k requests after that.

Pinning (on unless ``--no-pin``, with 2 or more cores): the proxies (sidecars, LiteLLM) run on the last core,
the upstream and the load generator on the others, so "req/s per sidecar process" is what one process does on
one core, and the load generator does not steal that core.
4. ``--sinks N`` (optional): N requests through a guaranteed sidecar publishing to the dev stack's Kafka and S3
   (``$REPROLANE_RUN_DIR`` or /work/devstack), timed until the spool is empty, then checked in Kafka (by key)
   and S3 (request-id index objects).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / ".reprolane" / "bench"
# Cores for the proxies under test and for the upstream + load generator (empty: no pinning). Set by main().
PROXY_CORES: set[int] = set()
CLIENT_CORES: set[int] = set()
MODEL = "bench-model"
PROMPT = "Write one short sentence about the sea."
REQUEST = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16, "temperature": 0.0}
).encode()

# ---------------------------------------------------------------------------------------------- fast upstream

PROMPT_IDS = [1, 9690, 198, 2683, 314, 1147, 253, 1345, 3015, 563, 260, 3756, 30, 2, 198, 1, 520, 9531, 198]
OUTPUT_IDS = [504, 3756, 314, 2020, 1128, 281, 5470, 28, 7018, 281, 4053, 288, 1456, 1002, 30, 2]
OUTPUT_TEXT = [
    "The",
    " sea",
    " is",
    " vast",
    " and",
    " full",
    " of",
    " life",
    ",",
    " a",
    " world",
    " of",
    " blue",
    " wonder",
    ".",
    "",
]


def _logprob(j: int, a: int) -> float:
    """A full-precision logprob like a model's (``-0.0013790050288662314``), not a short binary fraction: the
    float text of ~100 of them is part of what the sidecar pays per request."""
    return math.log(1.0 / (1.0 + 0.37 * j + 2.9 * a + 0.013 * j * j))


def _answer(body: dict[str, Any]) -> bytes:
    """The answer vLLM 0.32 gives: under ``return_tokens_as_token_ids`` the chosen token reads ``token_id:N``
    with its own text's bytes, and each alternative ``token_id:M`` with the bytes of that very spelling."""
    with_ids = bool(body.get("return_token_ids"))
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    k = int(body.get("top_logprobs") or 0)
    logprobs = None
    if body.get("logprobs"):
        content = []
        for j, tok in enumerate(OUTPUT_TEXT):
            top = []
            for a in range(k):
                name = f"token_id:{OUTPUT_IDS[j] + a}" if as_ids else f"t{OUTPUT_IDS[j] + a}"
                top.append({"token": name, "logprob": _logprob(j, a), "bytes": list(name.encode())})
            chosen = f"token_id:{OUTPUT_IDS[j]}" if as_ids else tok
            content.append(
                {"token": chosen, "logprob": _logprob(j, 0), "bytes": list(tok.encode()), "top_logprobs": top}
            )
        logprobs = {"content": content}
    doc: dict[str, Any] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1764400000,
        "model": body.get("model"),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(OUTPUT_TEXT), "refusal": None, "tool_calls": []},
                "logprobs": logprobs,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": OUTPUT_IDS if with_ids else None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": "vllm-0.32.0-a7512781",
        "usage": {"prompt_tokens": len(PROMPT_IDS), "total_tokens": 35, "completion_tokens": 16},
        "prompt_logprobs": None,
        "prompt_token_ids": PROMPT_IDS if with_ids else None,
        "kv_transfer_params": None,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _completion_answer(body: dict[str, Any]) -> bytes:
    """A ``/v1/completions`` answer with token ids and top-k logprobs spelled ``token_id:N``: what the shadow
    sender (`capture.request.shadow`) asks a candidate for, so bench_shadow.py's candidates answer it in full."""
    k = int(body.get("logprobs") or 0)
    logprobs = {
        "tokens": [f"token_id:{t}" for t in OUTPUT_IDS],
        "token_logprobs": [_logprob(j, 0) for j in range(len(OUTPUT_IDS))],
        "top_logprobs": [{f"token_id:{t + a}": _logprob(j, a) for a in range(k)} for j, t in enumerate(OUTPUT_IDS)],
        "text_offset": list(itertools.accumulate((len(t) for t in OUTPUT_TEXT), initial=0))[:-1],
    }
    doc = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1764400000,
        "model": body.get("model"),
        "choices": [
            {
                "index": 0,
                "text": "".join(OUTPUT_TEXT),
                "logprobs": logprobs if k else None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": OUTPUT_IDS,
                "prompt_token_ids": body.get("prompt") if body.get("return_token_ids") else None,
            }
        ],
        "system_fingerprint": "vllm-0.32.0-a7512781",
        "usage": {"prompt_tokens": len(body.get("prompt") or ()), "total_tokens": 35, "completion_tokens": 16},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def run_upstream(port: int, completions_delay_s: float = 0.0) -> None:
    """A raw asyncio HTTP/1.1 server (keep-alive, Content-Length bodies): ~0.1 ms of its own per request.
    ``/v1/completions`` answers after `completions_delay_s` (a slow shadow candidate; the rest stays fast)."""
    import httptools
    import uvloop

    cache: dict[tuple[Any, ...], bytes] = {}

    def respond(path: bytes, raw: bytes) -> tuple[bytes, bytes]:
        if path == b"/version":
            return b"200 OK", b'{"version":"0.32.0"}'
        if path == b"/v1/models":
            return b"200 OK", json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        if path == b"/tokenize":
            return b"200 OK", json.dumps({"count": len(PROMPT_IDS), "tokens": PROMPT_IDS}).encode()
        if path == b"/v1/chat/completions":
            body = json.loads(raw)
            key = (
                body.get("model"),
                bool(body.get("logprobs")),
                body.get("top_logprobs"),
                body.get("return_token_ids"),
            )
            if key not in cache:
                cache[key] = _answer(body)
            return b"200 OK", cache[key]
        if path == b"/v1/completions":
            return b"200 OK", _completion_answer(json.loads(raw))
        return b"404 Not Found", b'{"error":{"message":"not found","type":"NotFound","param":null,"code":404}}'

    class Conn(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.url = b""
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_message_begin(self) -> None:
            self.url, self.body = b"", []

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            path = self.url.split(b"?", 1)[0]
            status, out = respond(path, b"".join(self.body))
            head = b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (status, len(out))
            keep_alive = self.parser.should_keep_alive()
            if completions_delay_s and path == b"/v1/completions":
                asyncio.get_running_loop().call_later(completions_delay_s, self.reply, head + out, keep_alive)
            else:
                self.reply(head + out, keep_alive)

        def reply(self, data: bytes, keep_alive: bool) -> None:
            if self.transport.is_closing():  # the caller gave up (a shadow past its timeout)
                return
            self.transport.write(data)
            if not keep_alive:
                self.transport.close()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Conn, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------- load generator


def run_load(args: argparse.Namespace) -> None:
    import aiohttp
    import psutil
    import uvloop

    headers = {"content-type": "application/json"}
    if args.auth:
        headers["authorization"] = f"Bearer {args.auth}"
    rss_proc = psutil.Process(args.rss_pid) if args.rss_pid else None

    async def main() -> dict[str, Any]:
        counter = itertools.count()
        lat: list[float] = []
        ok: list[int] = []
        buckets: dict[int, int] = {}
        errors: dict[str, int] = {}
        rss: list[tuple[int, int]] = []
        done = 0
        start = time.perf_counter()
        measure_from = start + args.warmup
        stop_at = start + args.warmup + args.duration
        connector = aiohttp.TCPConnector(limit=args.clients, limit_per_host=args.clients, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=120)
        if rss_proc is not None:
            rss.append((0, rss_proc.memory_info().rss))

        async def client(session: aiohttp.ClientSession, index: int) -> None:
            nonlocal done
            interval = args.clients / args.rate if args.rate else 0.0
            due = start + index / args.rate if args.rate else 0.0
            while True:
                if interval:  # open loop: wait for this request's slot, charge any lateness to the target
                    wait = due - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                now = time.perf_counter()
                if now >= stop_at:
                    return
                i = next(counter)
                if args.count and i >= args.count:
                    return
                h = dict(headers)
                h["x-request-id"] = f"{args.prefix}-{i}"
                t = due if interval else time.perf_counter()
                due += interval
                try:
                    async with session.post(args.url, data=REQUEST, headers=h) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    status = -1
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                end = time.perf_counter()
                done += 1
                if rss_proc is not None and done % args.rss_every == 0:
                    rss.append((done, rss_proc.memory_info().rss))
                if t < measure_from and not args.count:
                    continue
                if status == 200:
                    lat.append((end - t) * 1000.0)
                    ok.append(i)
                    sec = int(end - measure_from)
                    buckets[sec] = buckets.get(sec, 0) + 1
                elif status != -1:
                    errors[str(status)] = errors.get(str(status), 0) + 1

        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(client(session, index) for index in range(args.clients)))
        elapsed = time.perf_counter() - (start if args.count else measure_from)
        if rss_proc is not None and (not rss or rss[-1][0] != done):
            rss.append((done, rss_proc.memory_info().rss))
        full = [n for s, n in sorted(buckets.items()) if s < int(elapsed)]
        return {
            "lat_ms": lat,
            "ok_ids": ok if args.keep_ids else [],
            "n_ok": len(ok),
            "errors": errors,
            "elapsed_s": elapsed,
            "min_bucket": min(full) if full else None,
            "rss": rss,
            "done": done,
        }

    result = uvloop.run(main())
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- null-sink sidecar


def run_sidecar_null_sink(argv: list[str]) -> None:
    """`capture.cli.serve` with a publisher draining to a sink that accepts everything (the memory phase)."""
    import uvicorn

    from capture.cli import build_settings, build_spool
    from capture.metrics import CaptureMetrics
    from capture.publishing.publisher import Publisher
    from capture.request.app import build_app
    from capture.request.http_server import uvicorn_config

    class NullSink:
        name = "null"

        async def publish(self, batch: Any) -> None:
            return None

        async def close(self) -> None:
            return None

    port, spool_dir, upstream = int(argv[0]), Path(argv[1]), argv[2]
    settings = build_settings(upstream=upstream, port=port, mode="best_effort", spool_dir=spool_dir, auth_mode="off")
    metrics = CaptureMetrics()
    spool = build_spool(settings, metrics)
    publisher = Publisher(spool, settings, metrics, sinks=[NullSink()])
    app = build_app(settings, spool=spool, metrics=metrics, publisher=publisher)
    config = uvicorn_config(app, settings)  # the server capture.cli.serve runs: its parser, bounds and deadlines
    uvicorn.Server(config).run()  # run() applies loop="auto" (uvloop), as capture.cli.serve does


# ---------------------------------------------------------------------------------------------- floor forwarder


def run_forwarder(argv: list[str]) -> None:
    """The floor: a proxy on the sidecar's own stack (uvicorn + uvloop + httptools, `capture.request.upstream.Upstream`
    over aiohttp) that forwards the client's body as is and answers upstream's bytes, capturing nothing. What it
    adds is what any proxy built from these parts adds on this machine, before a byte of capture work."""
    import uvicorn

    from capture.request.upstream import Upstream

    port, base = int(argv[0]), argv[1]
    upstream = Upstream(base, timeout_s=60.0)
    json_type = [(b"content-type", b"application/json")]

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await upstream.start()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await upstream.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        async with upstream.request(scope["method"], scope["path"], body=body, headers=json_type) as resp:
            answer = await resp.read()
            status = resp.status
        await send({"type": "http.response.start", "status": status, "headers": json_type})
        await send({"type": "http.response.body", "body": answer})

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=2048)
    uvicorn.Server(config).run()


# ---------------------------------------------------------------------------------------------- orchestration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Procs:
    """Processes this run started; stopped by pid (SIGTERM, then SIGKILL) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, cmd: list[str], env: dict[str, str] | None = None, *, cores: set[int] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `cmd` as `name`, pinned to `cores` (default: the upstream's for "upstream", else the proxies')."""
        log = (self.logs / f"{name}.log").open("wb")
        if cores is None:
            cores = PROXY_CORES if name != "upstream" else CLIENT_CORES
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "REPROLANE_CAPTURE_AUTH_MODE": "off", **(env or {})},  # measured without API keys
            cwd=ROOT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
        self.procs[name] = proc
        return proc

    def stop(self, name: str, timeout: float = 60.0) -> int | None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=20.0)


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s; see {log}")


def metric(base: str, name: str) -> float:
    return metrics(base, name)[0]


def metrics(base: str, *names: str) -> list[float]:
    """Each named metric of a sidecar's ``/metrics`` (summed over its labels), from one scrape."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    totals = [0.0] * len(names)
    for line in text.splitlines():
        for i, name in enumerate(names):
            if line.startswith(name) and (line[len(name)] in " {"):
                totals[i] += float(line.rsplit(" ", 1)[1])
    return totals


def own_added(base: str | None) -> tuple[float, float]:
    """Sum (s) and count of a sidecar's own ``added_latency_seconds`` histogram; zeros for other targets."""
    if base is None:
        return 0.0, 0.0
    name = "reprolane_capture_added_latency_seconds"
    total, count = metrics(base, name + "_sum", name + "_count")
    return total, count


def load(
    url: str,
    clients: int,
    *,
    duration: float,
    prefix: str,
    out_dir: Path,
    warmup: float = 1.0,
    count: int = 0,
    auth: str = "",
    keep_ids: bool = False,
    rss_pid: int = 0,
    rss_every: int = 10_000,
    rate: float = 0.0,
) -> dict[str, Any]:
    out = out_dir / f"load-{prefix}.json"
    cmd = [
        sys.executable,
        __file__,
        "_load",
        "--url",
        url,
        "--clients",
        str(clients),
        "--duration",
        str(duration),
        "--warmup",
        str(warmup),
        "--count",
        str(count),
        "--prefix",
        prefix,
        "--out",
        str(out),
        "--rss-pid",
        str(rss_pid),
        "--rss-every",
        str(rss_every),
        "--rate",
        str(rate),
    ]
    if auth:
        cmd += ["--auth", auth]
    if keep_ids:
        cmd.append("--keep-ids")
    pin = (lambda: os.sched_setaffinity(0, CLIENT_CORES)) if CLIENT_CORES else None
    subprocess.run(cmd, check=True, cwd=ROOT, preexec_fn=pin)
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return result


def pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def ensure_litellm(venv: Path) -> tuple[Path | None, str]:
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe, ""
    print(f"creating LiteLLM venv at {venv} (pip install 'litellm[proxy]', about a minute) ...", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True, timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        return None, f"LiteLLM could not be installed into {venv}: {exc}"
    return (exe, "") if exe.exists() else (None, f"{exe} missing after install")


def sidecar_cmd(port: int, mode: str, spool: Path, upstream: str) -> list[str]:
    return [
        str(Path(sys.executable).parent / "reprolane"),
        "capture",
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--mode",
        mode,
        "--spool-dir",
        str(spool),
    ]


async def _read_spool(directory: Path) -> list[bytes]:
    from capture.spool import Spool

    spool = Spool(directory, max_bytes=1 << 62)
    await spool.open()
    try:
        return [e.payload for e in await spool.pending(1 << 30)]
    finally:
        await spool.close()


def spooled_request_ids(directory: Path) -> set[str]:
    return {json.loads(p).get("client_request_id") for p in asyncio.run(_read_spool(directory))}  # the X-Request-Id


@contextlib.contextmanager
def timed(label: str) -> Iterator[None]:
    t0 = time.perf_counter()
    print(f"-- {label} ...", flush=True)
    yield
    print(f"   {label}: {time.perf_counter() - t0:.0f} s", flush=True)


def cpu_s(pid: int | None, *, children: bool = True) -> float:
    """CPU seconds (user + system, threads and, unless told not to, children included) a process has used so far."""
    import psutil

    if not pid:
        return 0.0
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *(proc.children(recursive=True) if children else [])]:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def cpu_ms_per_request(pid: int | None, cpu_before: float, requests: int) -> float:
    """CPU milliseconds (as `cpu_s` counts them) the process used per request since it had used `cpu_before` s."""
    return (cpu_s(pid) - cpu_before) * 1000.0 / max(requests, 1)


def wait_idle(pid: int | None, *, below: float = 0.05, within_s: float = 60.0) -> None:
    """Wait until a target uses less than ``below`` of a core (work queued in it must not run into the next cell)."""
    deadline = time.monotonic() + within_s
    while pid and time.monotonic() < deadline:
        before = cpu_s(pid)
        time.sleep(0.5)
        if cpu_s(pid) - before < below * 0.5:
            return


def cpu_children(pid: int) -> float:
    """CPU seconds of a process's children (the sidecar's S3 worker processes)."""
    return cpu_s(pid) - cpu_s(pid, children=False)


def rss_mb(proc: subprocess.Popen[bytes] | None) -> float:
    import psutil

    return psutil.Process(proc.pid).memory_info().rss / 2**20 if proc is not None and proc.poll() is None else 0.0


def sidecar_env(run_dir: Path) -> dict[str, str]:
    """No inherited ``REPROLANE_CAPTURE_*``; ``REPROLANE_RUN_DIR`` picks which stack (if any) gives defaults."""
    for key in [k for k in os.environ if k.startswith("REPROLANE_CAPTURE_")]:
        os.environ.pop(key)
    return {"REPROLANE_RUN_DIR": str(run_dir)}


def phase_latency(
    args: argparse.Namespace, targets: list[tuple[str, str, str]], pids: dict[str, int], run_id: str, work: Path
) -> tuple[list[dict[str, Any]], list[str]]:
    """The latency rows, and the cells not offered to a target (more than it can serve)."""
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    cells = [(c, 0.0) for c in args.clients if c == 1] + [(c, r) for c in args.clients if c > 1 for r in args.rates]
    for clients, rate in cells:
        for name, url, auth in targets:
            # LiteLLM is CPU-bound at ~100 req/s here: offered more, it queues without bound and keeps working (on
            # the proxies' core) long after the cell. Offer it at most 90% of what it served back to back.
            alone = next((d["rps"] for d in rows if d["target"] == name and d["rate"] == 0.0), None)
            if name == "litellm" and rate and alone is not None and rate > 0.9 * alone:
                skipped.append(f"{name} x{clients} at {rate:.0f} req/s (it served {alone:.0f} req/s back to back)")
                continue
            base = url.removesuffix("/v1/chat/completions") if name in ("best_effort", "guaranteed") else None
            own0 = own_added(base)  # scraped before the CPU count starts (and after it ends): not charged to the cell
            cpu0 = cpu_s(pids.get(name))
            with timed(f"latency {name} x{clients} at {f'{rate:.0f} req/s' if rate else 'back to back'}"):
                r = load(
                    url,
                    clients,
                    duration=args.duration,
                    prefix=f"lat-{run_id}-{name}-{clients}-{rate:.0f}",
                    out_dir=work,
                    auth=auth,
                    rate=rate,
                )
            lat = r["lat_ms"]
            cpu_ms = cpu_ms_per_request(pids.get(name), cpu0, r["done"])
            own1 = own_added(base)
            rows.append(
                {
                    "cpu_ms": cpu_ms,
                    "own_ms": 1000.0 * (own1[0] - own0[0]) / (own1[1] - own0[1]) if own1[1] > own0[1] else None,
                    "target": name,
                    "clients": clients,
                    "rate": rate,
                    "n": len(lat),
                    "rps": len(lat) / r["elapsed_s"],
                    "p50": pct(lat, 50),
                    "p99": pct(lat, 99),
                    "errors": r["errors"],
                }
            )
            print(
                f"   n={len(lat)} rps={rows[-1]['rps']:.0f} p50={rows[-1]['p50']:.2f} ms "
                f"p99={rows[-1]['p99']:.2f} ms cpu/req={cpu_ms:.3f} ms errors={r['errors']}",
                flush=True,
            )
            wait_idle(pids.get(name))
    for line in skipped:
        print(f"   not offered: {line}", flush=True)

    def cell(row: dict[str, Any], target: str) -> dict[str, Any] | None:
        key = (target, row["clients"], row["rate"])
        return next((d for d in rows if (d["target"], d["clients"], d["rate"]) == key), None)

    for row in rows:
        direct = cell(row, "direct")
        assert direct is not None
        row["added_p50"] = row["p50"] - direct["p50"]
        row["added_p99"] = row["p99"] - direct["p99"]
    for row in rows:
        peer = cell(row, "litellm")
        ok = peer is not None and row["target"] not in ("direct", "litellm")
        row["vs_litellm_p50"] = row["added_p50"] / peer["added_p50"] if ok and peer and peer["added_p50"] > 0 else None
        row["vs_litellm_p99"] = row["added_p99"] / peer["added_p99"] if ok and peer and peer["added_p99"] > 0 else None
    return rows, skipped


def phase_sinks(
    args: argparse.Namespace, procs: Procs, upstream: str, run_id: str, work: Path, s3_processes: int
) -> dict[str, Any]:
    """N requests through a guaranteed sidecar publishing to the dev stack; drain time; Kafka + S3 checked; CPU
    of the sidecar (its S3 worker processes counted apart) and of the stack's servers while it ran."""
    import boto3
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from infra.stack.state import StackInfo
    from schemas.layout import TOPIC_ENVELOPES

    info = StackInfo.load(args.stack_dir)
    prefix = f"sk-{run_id}-{s3_processes}"
    servers = {name: int((args.stack_dir / "pids" / f"{name}.pid").read_text()) for name in ("kafka", "s3")}

    async def end_offsets() -> dict[Any, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=info.kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            parts = [TopicPartition(TOPIC_ENVELOPES, p) for p in consumer.partitions_for_topic(TOPIC_ENVELOPES) or []]
            if not parts:
                await consumer.topics()
                parts = [TopicPartition(TOPIC_ENVELOPES, p) for p in consumer.partitions_for_topic(TOPIC_ENVELOPES)]
            return dict(await consumer.end_offsets(parts))
        finally:
            await consumer.stop()

    async def count_keys(start: dict[Any, int]) -> int:
        consumer = AIOKafkaConsumer(bootstrap_servers=info.kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign(list(start))
            for tp, off in start.items():
                consumer.seek(tp, off)
            end = await consumer.end_offsets(list(start))
            seen: set[bytes] = set()
            while [tp for tp in start if await consumer.position(tp) < end[tp]]:
                batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
                for records in batch.values():
                    seen.update(r.key for r in records if r.key and r.key.startswith(prefix.encode()))
            return len(seen)
        finally:
            await consumer.stop()

    before = asyncio.run(end_offsets())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = sidecar_cmd(port, "guaranteed", work / f"spool-sinks-{s3_processes}", upstream)
    proc = procs.start("sidecar-sinks", [*cmd, "--s3-processes", str(s3_processes)], env=sidecar_env(args.stack_dir))
    wait_http(base + "/version", proc, 60, procs.logs / "sidecar-sinks.log")
    cpu0 = {"sidecar": cpu_s(proc.pid, children=False), "s3 workers": cpu_children(proc.pid)}
    cpu0 |= {name: cpu_s(pid) for name, pid in servers.items()}
    with timed(f"sinks: {args.sinks} requests, s3 processes {s3_processes}"):
        t0 = time.perf_counter()
        r = load(
            base + "/v1/chat/completions",
            50,
            duration=600,
            warmup=0,
            count=args.sinks,
            prefix=prefix,
            out_dir=work,
            keep_ids=True,
        )
        t_load = time.perf_counter() - t0
        while metric(base, "reprolane_capture_spool_depth") > 0 and time.perf_counter() - t0 < args.sinks_timeout_s:
            time.sleep(0.5)
        t_drained = time.perf_counter() - t0
        depth = metric(base, "reprolane_capture_spool_depth")
        cpu1 = {"sidecar": cpu_s(proc.pid, children=False), "s3 workers": cpu_children(proc.pid)}
        cpu1 |= {name: cpu_s(pid) for name, pid in servers.items()}
    procs.stop("sidecar-sinks")
    # Tansu (S3-backed) can acknowledge a produce before a fetch sees the record: once a count came up 16 short
    # right after the drain and whole a minute later. Count again until every answered request is there (30 s).
    t_count = time.perf_counter()
    in_kafka = asyncio.run(count_keys(before))
    while in_kafka < r["n_ok"] and time.perf_counter() - t_count < 30.0:
        time.sleep(1.0)
        in_kafka = asyncio.run(count_keys(before))
    kafka_seen_after = time.perf_counter() - t_count
    s3 = boto3.client(
        "s3",
        endpoint_url=info.s3_endpoint,
        aws_access_key_id=info.s3_access_key,
        aws_secret_access_key=info.s3_secret_key,
        region_name=info.s3_region,
    )
    in_s3 = 0
    for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=info.audit_bucket, Prefix=f"index/request-id/{prefix}-"
    ):
        in_s3 += len(page.get("Contents", []))
    return {
        "s3_processes": s3_processes,
        "cpu_ms_per_envelope": {name: (cpu1[name] - cpu0[name]) * 1000.0 / args.sinks for name in cpu0},
        "requests": args.sinks,
        "ok": r["n_ok"],
        "errors": r["errors"],
        "load_s": r["elapsed_s"],
        "drain_after_load_s": t_drained - t_load,
        "drained_s": t_drained,
        "depth_left": depth,
        "in_kafka": in_kafka,
        "kafka_counted_s": kafka_seen_after,
        "in_s3_index": in_s3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per latency cell (after 1 s warm-up)")
    ap.add_argument("--clients", type=lambda s: [int(x) for x in s.split(",")], default=[1, 50, 200])
    ap.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[50.0, 1000.0],
        help="offered req/s (all clients together) of the latency cells with more than one client",
    )
    ap.add_argument("--throughput-s", type=float, default=20.0)
    ap.add_argument("--throughput-clients", type=int, default=50)
    ap.add_argument("--memory-requests", type=int, default=200_000)
    ap.add_argument("--memory-fit-from", type=int, default=100_000, help="fit the RSS slope from this request on")
    ap.add_argument("--no-pin", action="store_true", help="let the OS place every process on any core")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor forwarder's latency cells")
    ap.add_argument("--memory-budget-s", type=float, default=240.0)
    ap.add_argument("--litellm-venv", type=Path, default=BENCH_DIR / "litellm-venv")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--sinks", type=int, default=0, help="requests for the Kafka+S3 phase (0: skip)")
    ap.add_argument("--sinks-timeout-s", type=float, default=300.0)
    ap.add_argument(
        "--sinks-s3-processes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0, 2],
        help="run the sinks phase once per value of the sidecar's --s3-processes",
    )
    ap.add_argument("--stack-dir", type=Path, default=Path(os.environ.get("REPROLANE_RUN_DIR", "/work/devstack")))
    ap.add_argument("--skip", default="", help="comma list of phases to skip: latency,throughput,memory")
    ap.add_argument("--markdown", action="store_true", help="also print the BENCHMARKS.md section")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    global PROXY_CORES, CLIENT_CORES
    cores = sorted(os.sched_getaffinity(0))
    if not args.no_pin and len(cores) >= 2:
        PROXY_CORES, CLIENT_CORES = {cores[-1]}, set(cores[:-1])
    skip = set(filter(None, args.skip.split(",")))

    run_id = uuid.uuid4().hex[:8]
    work = BENCH_DIR / f"run-{run_id}"
    (work / "logs").mkdir(parents=True)
    procs = Procs(work / "logs")
    res: dict[str, Any] = {
        "run_id": run_id,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "pinned": {"proxies": sorted(PROXY_CORES), "upstream and load": sorted(CLIENT_CORES)},
        "load_avg_start": os.getloadavg(),
        "args": " ".join(sys.argv[1:]),
    }
    try:
        up_port = free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        proc = procs.start("upstream", [sys.executable, __file__, "_upstream", str(up_port)])
        wait_http(upstream + "/version", proc, 30, procs.logs / "upstream.log")
        no_stack = sidecar_env(work / "no-stack")
        sidecars: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        for mode in ("best_effort", "guaranteed"):
            port = free_port()
            p = procs.start(mode, sidecar_cmd(port, mode, work / f"spool-{mode}", upstream), env=no_stack)
            sidecars[mode] = (f"http://127.0.0.1:{port}", p)
        for mode, (base, p) in sidecars.items():
            wait_http(base + "/version", p, 60, procs.logs / f"{mode}.log")
        res["rss_start_mb"] = {m: rss_mb(p) for m, (_, p) in sidecars.items()}
        targets = [("direct", upstream + "/v1/chat/completions", "")]
        if not args.no_floor and "latency" not in skip:
            port = free_port()
            p = procs.start("floor", [sys.executable, __file__, "_forwarder", str(port), upstream])
            wait_http(f"http://127.0.0.1:{port}/version", p, 60, procs.logs / "floor.log")
            targets.append(("floor", f"http://127.0.0.1:{port}/v1/chat/completions", ""))
        targets += [(m, b + "/v1/chat/completions", "") for m, (b, _) in sidecars.items()]
        res["litellm"] = "skipped (--no-litellm)"
        if not args.no_litellm and "latency" not in skip:
            exe, why = ensure_litellm(args.litellm_venv.resolve())
            if exe is None:
                res["litellm"] = f"skipped: {why}"
            else:
                port = free_port()
                cfg = work / "litellm.yaml"
                cfg.write_text(
                    "model_list:\n"
                    f"  - model_name: {MODEL}\n"
                    "    litellm_params:\n"
                    f"      model: openai/{MODEL}\n"
                    f"      api_base: {upstream}/v1\n"
                    "      api_key: sk-bench\n"
                    "litellm_settings:\n  telemetry: false\n"
                )
                lenv = {
                    "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
                    "LITELLM_LOG": "ERROR",
                    "LITELLM_TELEMETRY": "False",
                    "NO_DOCS": "True",
                }
                p = procs.start(
                    "litellm", [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)], env=lenv
                )
                try:
                    with timed("LiteLLM start"):
                        wait_http(f"http://127.0.0.1:{port}/health/liveliness", p, 180, procs.logs / "litellm.log")
                    out = subprocess.run([str(exe.parent / "pip"), "show", "litellm"], capture_output=True, text=True)
                    version = next((ln.split()[-1] for ln in out.stdout.splitlines() if ln.startswith("Version")), "?")
                    res["litellm"] = f"litellm[proxy] {version}, 1 worker, no master key, no DB"
                    targets.append(("litellm", f"http://127.0.0.1:{port}/v1/chat/completions", ""))
                except RuntimeError as exc:
                    res["litellm"] = f"skipped: {exc}"
        if "latency" not in skip:
            pids = {"direct": procs.procs["upstream"].pid, **{m: p.pid for m, (_, p) in sidecars.items()}}
            if "floor" in procs.procs:
                pids["floor"] = procs.procs["floor"].pid
            if "litellm" in procs.procs:
                pids["litellm"] = procs.procs["litellm"].pid
            res["latency"], res["latency_not_offered"] = phase_latency(args, targets, pids, run_id, work)
            res["rss_after_latency_mb"] = {m: rss_mb(p) for m, (_, p) in sidecars.items()}
        procs.stop("litellm")
        procs.stop("floor")
        if "throughput" not in skip:
            res["throughput"] = {}
            for mode, (base, proc) in sidecars.items():
                cpu_before = cpu_s(proc.pid)
                with timed(f"throughput {mode} x{args.throughput_clients} for {args.throughput_s:.0f} s"):
                    r = load(
                        base + "/v1/chat/completions",
                        args.throughput_clients,
                        duration=args.throughput_s,
                        prefix=f"tp-{run_id}-{mode}",
                        out_dir=work,
                        keep_ids=True,
                    )
                cpu_ms = cpu_ms_per_request(proc.pid, cpu_before, r["done"])
                res["throughput"][mode] = {
                    "ok": r["n_ok"],
                    "rps": r["n_ok"] / r["elapsed_s"],
                    "cpu_ms": cpu_ms,
                    "min_1s": r["min_bucket"],
                    "errors": r["errors"],
                    "p50": pct(r["lat_ms"], 50),
                    "p99": pct(r["lat_ms"], 99),
                    "ids": r["ok_ids"],
                }
            res["rss_after_throughput_mb"] = {m: rss_mb(p) for m, (_, p) in sidecars.items()}
        for mode in sidecars:
            res.setdefault("exit", {})[mode] = procs.stop(mode)
        if "throughput" not in skip:
            for mode, tp in res["throughput"].items():
                with timed(f"read back spool of {mode}"):
                    ids = spooled_request_ids(work / f"spool-{mode}")
                wanted = {f"tp-{run_id}-{mode}-{i}" for i in tp.pop("ids")}
                tp["spooled"] = len(wanted & ids)
                tp["lost"] = len(wanted - ids)
                tp["spool_total"] = len(ids)
        if "memory" not in skip:
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            p = procs.start(
                "sidecar-null",
                [sys.executable, __file__, "_sidecar_null", str(port), str(work / "spool-null"), upstream],
                env=no_stack,
            )
            wait_http(base + "/version", p, 60, procs.logs / "sidecar-null.log")
            with timed(f"memory: {args.memory_requests} requests (budget {args.memory_budget_s:.0f} s)"):
                r = load(
                    base + "/v1/chat/completions",
                    args.throughput_clients,
                    duration=args.memory_budget_s,
                    warmup=0,
                    count=args.memory_requests,
                    prefix=f"mem-{run_id}",
                    out_dir=work,
                    rss_pid=p.pid,
                )
            time.sleep(2)
            published = metric(base, "reprolane_capture_envelopes_published_total")
            depth = metric(base, "reprolane_capture_spool_depth")
            res["memory"] = {
                "done": r["done"],
                "ok": r["n_ok"],
                "elapsed_s": r["elapsed_s"],
                "rss": r["rss"],
                "published": published,
                "depth_after": depth,
                "rss_end_mb": rss_mb(p),
                "fit_from": args.memory_fit_from,
            }
            procs.stop("sidecar-null")
        if args.sinks:
            res["sinks"] = [phase_sinks(args, procs, upstream, run_id, work, n) for n in args.sinks_s3_processes]
    finally:
        procs.stop_all()
        for spool in work.glob("spool-*"):
            shutil.rmtree(spool, ignore_errors=True)
    res["load_avg_end"] = os.getloadavg()
    print(render_table(res))
    if args.markdown:
        print(render_markdown(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


def memory_slope(rss: list[list[int]], fit_from: int) -> float | None:
    """Bytes of RSS per request, fitted from the 20k-request sample on (before it: pools, caches, allocator warm-up)."""
    import numpy as np

    pts = [p for p in rss if p[0] >= fit_from]
    if len(pts) < 2:
        return None
    return float(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[0])


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None or value != value else fmt.format(value)


def lines(res: dict[str, Any], md: bool) -> list[str]:
    out: list[str] = []
    sep = " | "

    def row(cells: list[str]) -> None:
        out.append(("| " + sep.join(cells) + " |") if md else "  ".join(f"{c:>13}" for c in cells))

    if res.get("latency"):
        out.append(
            f"Latency (ms; added = percentile through the proxy minus percentile direct; own mean = the sidecar's own"
            f" measure of what it adds, the mean of its added_latency_seconds histogram over the cell: time in its"
            f" handler minus the upstream call, so without its HTTP server and client and the network hops; floor = a"
            f" forwarder on the sidecar's stack, uvicorn + aiohttp, that captures nothing: what any proxy built"
            f" from these parts adds here)."
            f" LiteLLM: {res['litellm']}"
        )
        out.append("")
        head = ["clients", "offered", "target", "req/s", "p50", "p99", "added p50", "added p99", "own mean"]
        row([*head, "/LiteLLM p50", "/LiteLLM p99", "CPU ms/req"])
        if md:
            row(["---"] * 12)
        for r in res["latency"]:
            direct = r["target"] == "direct"
            row(
                [
                    str(r["clients"]),
                    f"{r['rate']:.0f}/s" if r.get("rate") else "max",
                    r["target"],
                    f"{r['rps']:.0f}",
                    _f(r["p50"]),
                    _f(r["p99"]),
                    "-" if direct else _f(r["added_p50"]),
                    "-" if direct else _f(r["added_p99"]),
                    _f(r.get("own_ms")),
                    _f(r["vs_litellm_p50"], "{:.3f}"),
                    _f(r["vs_litellm_p99"], "{:.3f}"),
                    _f(r.get("cpu_ms"), "{:.3f}"),
                ]
            )
            errs = r["errors"]
            if errs:
                out.append(f"  ({r['target']} x{r['clients']}: errors {errs})")
        for line in res.get("latency_not_offered") or []:
            out.append(f"Not offered (over 90% of what it served back to back with one client): {line}")
        out.append("")
    if res.get("throughput"):
        out.append(
            "Throughput (spool on disk, no sinks; spool read back after a clean stop; CPU ms/req: the sidecar's user +"
            " system CPU per request during the run; 1000/CPU: the requests/s one core gives at that cost):"
        )
        out.append("")
        row(
            [
                "mode",
                "answered 200",
                "req/s",
                "CPU ms/req",
                "1000/CPU",
                "slowest 1 s",
                "p50 ms",
                "p99 ms",
                "in spool",
                "lost",
            ]
        )
        if md:
            row(["---"] * 10)
        for mode, t in res["throughput"].items():
            row(
                [
                    mode,
                    str(t["ok"]),
                    f"{t['rps']:.0f}",
                    _f(t.get("cpu_ms"), "{:.3f}"),
                    f"{1000.0 / t['cpu_ms']:.0f}" if t.get("cpu_ms") else "-",
                    str(t["min_1s"]),
                    _f(t["p50"]),
                    _f(t["p99"]),
                    str(t.get("spooled", "-")),
                    str(t.get("lost", "-")),
                ]
            )
        out.append("")
    if res.get("memory"):
        m = res["memory"]
        slope = memory_slope(m["rss"], m["fit_from"])
        series = ", ".join(f"{n // 1000}k: {b / 2**20:.1f}" for n, b in m["rss"])
        out.append(
            f"Memory (best_effort, publisher draining to a null sink): {m['done']} requests in "
            f"{m['elapsed_s']:.0f} s ({m['done'] / m['elapsed_s']:.0f} req/s), published {m['published']:.0f}, "
            f"spool depth after {m['depth_after']:.0f}"
        )
        out.append(f"  RSS MiB by requests served: {series}")
        out.append(
            f"  slope from {m['fit_from'] // 1000}k requests on: {_f(slope, '{:.1f}')} bytes/request"
            f" ({_f(None if slope is None else slope * 100_000 / 2**20, '{:.1f}')} MiB per 100k)"
        )
        out.append("")
    for s in res.get("sinks") or []:
        cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in s["cpu_ms_per_envelope"].items())
        out.append(
            f"Sinks (guaranteed, dev stack Kafka + S3, --s3-processes {s['s3_processes']}): {s['ok']} of "
            f"{s['requests']} answered 200 in {s['load_s']:.1f} s ({s['ok'] / s['load_s']:.0f} req/s); "
            f"spool empty {s['drain_after_load_s']:.1f} s after the last answer, {s['drained_s']:.1f} s in all "
            f"({s['requests'] / s['drained_s']:.0f} envelopes/s published; depth left {s['depth_left']:.0f}); "
            f"in Kafka {s['in_kafka']} (last count {s.get('kafka_counted_s', 0.0):.0f} s after the drain), "
            f"S3 request-id index objects {s['in_s3_index']}; errors {s['errors']}"
        )
        out.append(f"  CPU ms per envelope (capture + publish): {cpu}")
        out.append("")
    for key in ("rss_start_mb", "rss_after_latency_mb", "rss_after_throughput_mb"):
        if key in res:
            out.append(f"{key}: " + ", ".join(f"{k} {v:.1f}" for k, v in res[key].items()))
    out.append(
        f"cpus {res['cpus']}, load average at start {res['load_avg_start'][0]:.2f}, "
        f"at end {res.get('load_avg_end', (float('nan'),))[0]:.2f}; {res['date']}"
    )
    return out


def render_table(res: dict[str, Any]) -> str:
    return "\n".join(["", "== capture sidecar benchmark ==", *lines(res, md=False)])


def render_markdown(res: dict[str, Any]) -> str:
    head = [
        "## Capture sidecar",
        "",
        f"`.venv/bin/python benchmarks/bench_capture.py {res['args']}`".replace(" `", "`"),
        "",
        f"Machine: {res['cpus']} cores, shared with other jobs, noisy; {res['date']}. Cores pinned: "
        f"{res.get('pinned') or 'none'} (empty lists: not pinned; every process shares every core).",
        "",
    ]
    return "\n".join(head + lines(res, md=True))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_forwarder":
        sys.path.insert(0, str(ROOT))
        run_forwarder(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_upstream":
        run_upstream(int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
    elif len(sys.argv) > 1 and sys.argv[1] == "_sidecar_null":
        sys.path.insert(0, str(ROOT))
        run_sidecar_null_sink(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "_load":
        lp = argparse.ArgumentParser()
        for flag, kind in (
            ("--url", str),
            ("--clients", int),
            ("--duration", float),
            ("--warmup", float),
            ("--count", int),
            ("--prefix", str),
            ("--out", str),
            ("--rss-pid", int),
            ("--rss-every", int),
            ("--auth", str),
            ("--rate", float),
        ):
            lp.add_argument(flag, type=kind, default="" if kind is str else 0)
        lp.add_argument("--keep-ids", action="store_true")
        run_load(lp.parse_args(sys.argv[2:]))
    else:
        sys.path.insert(0, str(ROOT))
        main()
