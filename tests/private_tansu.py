"""A private in-memory Tansu for the stack tests that must cut or wrap a broker's connections (a relay that
goes down, a TLS terminator) without touching the shared stack's broker.

Tansu advertises `advertised_port`, on which nothing listens until the test puts its own server there, so every
connection a client makes after bootstrap goes through that server.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from infra.stack.probes import kafka_brokers
from infra.stack.servers import tansu_binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(port: int) -> bool:
    """True when a Kafka broker answers a metadata request on 127.0.0.1:`port`."""
    try:
        return bool(kafka_brokers("127.0.0.1", port))
    except (OSError, struct.error, UnicodeDecodeError):
        return False


@contextlib.contextmanager
def private_tansu(log: Path, advertised_host: str = "127.0.0.1") -> Iterator[tuple[int, int]]:
    """(broker port, advertised port) of a private in-memory Tansu, its output in `log`; stopped afterwards."""
    inner, outer = free_port(), free_port()
    argv = [
        tansu_binary(),
        "broker",
        f"--listener-url=tcp://127.0.0.1:{inner}",
        f"--advertised-listener-url=tcp://{advertised_host}:{outer}",
        "--storage-engine=memory://tansu/",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not answers(inner):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "tansu did not answer in 20 s"
            time.sleep(0.1)
        yield inner, outer
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
