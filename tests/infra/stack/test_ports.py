"""Port allocation: free, distinct, companions (+10000) free, below the ephemeral range."""

from __future__ import annotations

import random
import socket

import pytest

from infra.errors import PortUnavailableError
from infra.stack.ports import HOST, allocate_ports, ephemeral_start, is_port_free, require_free


def test_allocated_ports_and_companions_are_free_distinct_and_below_ephemeral() -> None:
    ports = allocate_ports(5, (0, 10000), rng=random.Random(1))
    wanted = [p + off for p in ports for off in (0, 10000)]
    assert len(set(wanted)) == 10
    assert all(is_port_free(p) for p in wanted)
    assert max(wanted) < ephemeral_start()


def test_listening_port_is_not_free_and_require_free_names_the_server() -> None:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not is_port_free(port)
        with pytest.raises(PortUnavailableError, match=f"kafka: port {port}"):
            require_free("kafka", [port])


def test_excluded_ports_are_not_handed_out() -> None:
    first = allocate_ports(3, rng=random.Random(7))
    second = allocate_ports(3, rng=random.Random(7), exclude=frozenset(first))
    assert not set(first) & set(second)
