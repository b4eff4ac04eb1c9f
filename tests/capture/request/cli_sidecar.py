"""The real sidecar for edge tests: ``reprolane serve capture`` in a subprocess, and raw HTTP over sockets.

The edge's bounds and its parser belong to the server the CLI builds (`capture.request.http_server`), not to the ASGI
app, so these tests talk to the process a user runs, with bytes a client library would never send.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from infra.stack.ports import allocate_ports

REPO = Path(__file__).resolve().parents[3]
HOST = "127.0.0.1"
_LAUNCH = "from infra.cli.root import app; app()"


@dataclass
class RunningSidecar:
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    spool_dir: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.asynccontextmanager
async def cli_sidecar(
    upstream: str, tmp_path: Path, *, args: tuple[str, ...] = (), **env: str
) -> AsyncIterator[RunningSidecar]:
    """``reprolane serve capture --upstream <upstream> [args]`` on a free port; ``env`` adds ``REPROLANE_CAPTURE_*``
    settings (``http_parser="h11"`` sets ``REPROLANE_CAPTURE_HTTP_PARSER=h11``). Yields once it answers."""
    (port,) = allocate_ports(1)
    spool_dir = tmp_path / f"spool-{port}"
    log = tmp_path / f"sidecar-{port}.log"
    settings_env = {f"REPROLANE_CAPTURE_{name.upper()}": value for name, value in env.items()}
    full_env = {**os.environ, **settings_env, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", _LAUNCH, "serve", "capture", "--upstream", upstream, "--port", str(port)]
    argv += ["--spool-dir", str(spool_dir), *args]
    proc = _start(argv, full_env, log)
    running = RunningSidecar(port, proc, log, spool_dir)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"the sidecar exited with {proc.returncode}:\n{running.log_text()}"
            assert time.monotonic() < deadline, f"the sidecar did not start:\n{running.log_text()}"
            with contextlib.suppress(OSError):
                status, _, _ = await exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if status == 200:
                    break
            await asyncio.sleep(0.1)
        yield running
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


async def exchange(port: int, request: bytes, timeout_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Send `request` as raw bytes on a new connection and read the answer to the end of the connection (the
    request should say ``Connection: close``): status, headers (lower-case names), body."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return parse_response(raw)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), raw[:200]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


@dataclass
class Bystander:
    """A local HTTP server the sidecar must never reach: it records every connection made to it."""

    port: int = 0
    connections: int = 0
    received: list[bytes] = field(default_factory=list)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            self.received.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nBYSTANDR")
            await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def bystander() -> AsyncIterator[Bystander]:
    found = Bystander()
    server = await asyncio.start_server(found._handle, HOST, 0)
    found.port = server.sockets[0].getsockname()[1]
    try:
        yield found
    finally:
        server.close()
        await server.wait_closed()
