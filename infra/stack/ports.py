"""Choosing loopback ports for the stack's servers.

Why not just bind port 0 and read the number back: SeaweedFS opens a gRPC port at ``port + 10000`` for
every HTTP port, so a port is only usable when its companions are free too. And a port taken from the
kernel's ephemeral range can be handed to some client's outgoing connection a moment later. So we draw
random ports *below* the ephemeral range (whose start we read from ``/proc``), such that every
``port + offset`` stays below it as well, and test each one by binding it.

The test binds with ``SO_REUSEADDR`` because the servers do: a port whose old connections sit in
TIME_WAIT after a restart is reusable by them, and must not look taken to us. A port with a listener
(on 127.0.0.1 or on 0.0.0.0) still fails the test.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path

from infra.errors import PortUnavailableError

HOST = "127.0.0.1"
#: Lowest port we hand out (below it live well-known services and their conventional dev ports).
LOWEST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_START = 32768
_MAX_ATTEMPTS = 2000


def ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (Linux), or the usual 32768."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_START


def is_port_free(port: int, host: str = HOST) -> bool:
    """True when nothing listens on ``host:port`` (tested by binding it, as a server would)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def ports_free(port: int, offsets: Sequence[int] = (0,), host: str = HOST) -> bool:
    """True when ``port + offset`` is free for every offset."""
    return all(is_port_free(port + offset, host) for offset in offsets)


def allocate_ports(
    count: int,
    offsets: Sequence[int] = (0,),
    *,
    exclude: frozenset[int] = frozenset(),
    rng: random.Random | None = None,
) -> list[int]:
    """``count`` distinct free ports whose ``port + offset`` are all free, distinct and unused by ``exclude``.

    Raises :class:`PortUnavailableError` when no such set is found after many tries.
    """
    if count < 0:
        raise ValueError("count must be >= 0")
    chooser = rng or random.Random()
    highest = ephemeral_start() - max(offsets) - 1
    if highest <= LOWEST_PORT:
        raise PortUnavailableError(f"no room below the ephemeral range for offsets {tuple(offsets)}")
    chosen: list[int] = []
    taken = set(exclude)
    for _ in range(_MAX_ATTEMPTS):
        if len(chosen) == count:
            return chosen
        port = chooser.randint(LOWEST_PORT, highest)
        wanted = {port + offset for offset in offsets}
        if wanted & taken or not ports_free(port, offsets):
            continue
        chosen.append(port)
        taken |= wanted
    if len(chosen) == count:
        return chosen
    raise PortUnavailableError(f"found only {len(chosen)} of {count} free ports with offsets {tuple(offsets)}")


def require_free(name: str, ports: Sequence[int], offsets: Sequence[int] = (0,)) -> None:
    """Raise :class:`PortUnavailableError` naming ``name`` when one of its ports is held."""
    for port in ports:
        for offset in offsets:
            if not is_port_free(port + offset):
                raise PortUnavailableError(f"{name}: port {port + offset} on {HOST} is held by another process")
