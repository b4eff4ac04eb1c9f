"""`capture.request.connection_limits`: the policy of who may hold a connection, without sockets (the real server
under a flood: `test_edge_flood.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.request.auth import Authenticator, AuthMode, load_key_file
from capture.request.connection_limits import ConnectionTable, source_of
from tests.capture.keys import write_test_keys


def test_a_newcomer_past_the_per_source_cap_closes_that_sources_oldest_anonymous_connection() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=100, max_anonymous_per_source=3)
    assert [table.open(f"a{i}", "10.0.0.1") for i in range(3)] == [(), (), ()]
    assert table.open("b0", "10.0.0.2") == ()  # another source has its own cap
    assert table.open("a3", "10.0.0.1") == ("a0",)
    assert table.open("a4", "10.0.0.1") == ("a1",)
    assert "a0" not in table
    assert table.anonymous("10.0.0.1") == 3
    assert table.anonymous("10.0.0.2") == 1
    assert len(table) == 4


def test_a_vouched_connection_is_never_shed_and_does_not_count_per_source() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=100, max_anonymous_per_source=2)
    table.open("keyed", "10.0.0.1")
    table.vouched("keyed")
    shed = [table.open(f"anon{i}", "10.0.0.1") for i in range(50)]
    assert "keyed" in table
    assert all(s == () or s[0].startswith("anon") for s in shed)
    assert table.anonymous("10.0.0.1") == 2  # the flood churns its own two slots
    assert len(table) == 3


def test_a_full_table_sheds_the_oldest_anonymous_connection_of_any_source() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=4, max_anonymous_per_source=100)
    for i, source in enumerate(["10.0.0.1", "10.0.0.2", "10.0.0.3"]):
        table.open(f"anon{i}", source)
    table.open("keyed", "10.0.0.9")
    table.vouched("keyed")
    assert table.open("new", "10.0.0.9") == ("anon0",)
    assert table.open("newer", "10.0.0.8") == ("anon1",)
    assert len(table) == 4


def test_a_table_full_of_vouched_connections_refuses_a_newcomer() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=2, max_anonymous_per_source=100)
    for conn in ("k1", "k2"):
        table.open(conn, "10.0.0.1")
        table.vouched(conn)
    assert table.open("anon", "10.0.0.2") is None
    assert "anon" not in table
    table.close("k1")
    assert table.open("anon", "10.0.0.2") == ()


def test_idle_anonymous_connections_are_shed_before_those_with_a_request_in_progress() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=3, max_anonymous_per_source=100)
    for conn in ("busy", "idle1", "idle2"):
        table.open(conn, "10.0.0.1")
    table.request_started("busy")
    assert table.open("n1", "10.0.0.2") == ("idle1",)
    assert table.open("n2", "10.0.0.2") == ("idle2",)
    table.request_finished("busy")  # answered: idle again, and idle since now, the newest of the idle
    assert table.open("n3", "10.0.0.2") == ("n1",)
    assert table.open("n4", "10.0.0.2") == ("n2",)
    assert table.open("n5", "10.0.0.2") == ("busy",)


def test_an_uncapped_source_is_not_capped_per_source_but_is_shed_when_the_table_is_full() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=5, max_anonymous_per_source=1)
    assert [table.open(f"p{i}", None) for i in range(5)] == [()] * 5
    assert table.open("x", "10.0.0.1") == ("p0",)


def test_closing_forgets_a_connection_once_and_ignores_one_it_shed() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=10, max_anonymous_per_source=1)
    table.open("a", "10.0.0.1")
    assert table.open("b", "10.0.0.1") == ("a",)
    table.close("a")  # its connection_lost comes after it was shed
    table.request_started("a")
    table.vouched("a")
    assert len(table) == 1
    table.close("b")
    assert len(table) == 0
    assert table.anonymous() == 0
    assert table.anonymous("10.0.0.1") == 0


def test_a_connection_is_opened_once_and_caps_are_positive() -> None:
    table: ConnectionTable[str] = ConnectionTable(max_connections=10, max_anonymous_per_source=1)
    table.open("a", "10.0.0.1")
    with pytest.raises(ValueError, match="already open"):
        table.open("a", "10.0.0.1")
    with pytest.raises(ValueError, match="at least 1"):
        ConnectionTable(max_connections=0, max_anonymous_per_source=1)


@pytest.mark.parametrize(
    ("host", "source"),
    [
        ("127.0.0.2", "127.0.0.2"),
        ("::ffff:10.1.2.3", "10.1.2.3"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::7", "2001:db8:1:2::/64"),  # the same host's /64
        ("fe80::1%eth0", "fe80::/64"),
        ("unix-socket", "unix-socket"),
    ],
)
def test_a_peer_counts_under_its_address_or_its_ipv6_slash_64(host: str, source: str) -> None:
    assert source_of(host) == source


def test_a_valid_key_or_a_trusted_proxy_vouches_for_a_head_and_nothing_else_does(tmp_path: Path) -> None:
    made = write_test_keys(tmp_path)
    keys = load_key_file(made.path)
    key, no_role = made.bank, made.reader
    peer = ("127.0.0.5", 1234)
    modes: tuple[AuthMode, ...] = ("keys", "anonymous-allowed")
    for mode in modes:
        auth = Authenticator(mode, keys)
        assert auth.vouches_for({b"authorization": f"Bearer {key}".encode()}, peer)
        assert auth.vouches_for({b"x-reprolane-key": no_role.encode()}, peer)  # a key: its roles are the app's
        assert not auth.vouches_for({}, peer)
        assert not auth.vouches_for({b"authorization": b"Bearer rlk_bank-1_wrong"}, peer)
        assert not auth.vouches_for({b"authorization": b"Bearer sk-upstreams"}, peer)
        assert not auth.trusted_peer("127.0.0.5")
    proxied = Authenticator("trusted-proxy", trusted_proxies=["127.0.0.0/30"])
    assert proxied.vouches_for({}, ("127.0.0.2", 1))
    assert proxied.trusted_peer("127.0.0.2")
    assert not proxied.vouches_for({b"authorization": f"Bearer {key}".encode()}, ("127.0.0.5", 1))
    assert not Authenticator("off").vouches_for({b"authorization": f"Bearer {key}".encode()}, peer)
