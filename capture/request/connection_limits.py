"""Who may hold a connection of the sidecar: caps on open connections, in all and per client address, under
which a connection that presented a valid key is never closed to make room for one that did not.

A connection is *anonymous* until one of its request heads proves a caller (a valid API key, or a trusted proxy's
address under ``trusted-proxy``: `capture.request.auth.Authenticator.vouches_for`); from then on it is *vouched for* for
as long as it stays open. The table holds two caps:

- ``max_connections``: connections open at once, all of them. A newcomer to a full table takes the place of the
  oldest anonymous connection, which is closed; when every connection is vouched for, the newcomer is refused.
- ``max_anonymous_per_source``: anonymous connections of one source address at once (an IPv6 address counts
  by its /64, what one host is given; `source_of`). A newcomer past it takes the place of that source's oldest
  anonymous connection, so one address flooding the sidecar with connections churns only its own.
  Vouched-for connections do not count here: callers behind one gateway or NAT address share it.

The oldest anonymous connection is the one idle the longest (nothing sent, half a head, or nothing since its
last answer) and, when none is idle, the one whose request has been in progress the longest (an anonymous
request: a 401 being answered, or a caller under ``anonymous-allowed``). Shedding the oldest rather than
refusing the newest is what lets a caller in while a flood goes on: its connection, the newest, sends its head
at once and is vouched for, while a flood's slots turn over.

Pure bookkeeping (no clock, no sockets): `capture.request.http_server` drives it from uvicorn's protocol callbacks and
closes what it says. The head and body deadlines that bound how long any one connection is held are elsewhere
(`capture.request.http_server`, `capture.request.edge.read_body`).
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)
_IPV6_HOST_PREFIX = 64


def source_of(host: str) -> str:
    """The source a peer address counts under: an IPv4 address itself (an IPv4-mapped IPv6 one too), the /64 of
    an IPv6 address; a host that is not an IP address (a Unix socket's) as it is."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, _IPV6_HOST_PREFIX), strict=False))
    return str(address)


@dataclass(slots=True)
class _Anonymous(Generic[C]):
    """Anonymous connections of one scope, oldest first: the idle ones, then those with a request in progress."""

    idle: OrderedDict[C, None] = field(default_factory=OrderedDict)
    busy: OrderedDict[C, None] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.idle) + len(self.busy)

    def oldest(self) -> C | None:
        for queue in (self.idle, self.busy):
            for conn in queue:
                return conn
        return None

    def add(self, conn: C, *, busy: bool) -> None:
        (self.busy if busy else self.idle)[conn] = None

    def discard(self, conn: C) -> None:
        self.idle.pop(conn, None)
        self.busy.pop(conn, None)


@dataclass(slots=True)
class _Entry:
    source: str | None
    vouched: bool = False
    busy: bool = False


class ConnectionTable(Generic[C]):
    """The open connections of one server and what each has proved (one per server, driven by its protocol)."""

    def __init__(self, max_connections: int, max_anonymous_per_source: int) -> None:
        if max_connections < 1 or max_anonymous_per_source < 1:
            raise ValueError("connection caps must be at least 1")
        self.max_connections = max_connections
        self.max_anonymous_per_source = max_anonymous_per_source
        self._entries: dict[C, _Entry] = {}
        self._anonymous: _Anonymous[C] = _Anonymous()
        self._by_source: dict[str, _Anonymous[C]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, conn: object) -> bool:
        return conn in self._entries

    def anonymous(self, source: str | None = None) -> int:
        """Anonymous connections open, in all or of `source`."""
        if source is None:
            return len(self._anonymous)
        found = self._by_source.get(source)
        return 0 if found is None else len(found)

    def open(self, conn: C, source: str | None) -> tuple[C, ...] | None:
        """Admit `conn`, a new connection from `source` (None: not capped per source, a trusted proxy's):
        the connections to close to make room for it (forgotten here already), or None when it is refused
        (the table is full of connections that are vouched for)."""
        if conn in self._entries:
            raise ValueError("connection already open")
        local = self._by_source.get(source) if source is not None else None
        victim: C | None = None
        if local is not None and len(local) >= self.max_anonymous_per_source:
            victim = local.oldest()  # frees a slot of the table too: the table's cap cannot be the one passed
        elif len(self._entries) >= self.max_connections:
            victim = self._anonymous.oldest()
            if victim is None:
                return None
        if victim is not None:
            self.close(victim)
        self._entries[conn] = _Entry(source)
        self._anonymous.add(conn, busy=False)
        if source is not None:
            self._by_source.setdefault(source, _Anonymous()).add(conn, busy=False)
        return () if victim is None else (victim,)

    def vouched(self, conn: C) -> None:
        """`conn` presented a valid credential: it is never shed from now on and no longer counts per source."""
        entry = self._entries.get(conn)
        if entry is None or entry.vouched:
            return
        entry.vouched = True
        self._forget_anonymous(conn, entry)

    def request_started(self, conn: C) -> None:
        """An anonymous request began on `conn`: it is shed after every idle anonymous connection."""
        self._move(conn, busy=True)

    def request_finished(self, conn: C) -> None:
        """`conn`'s request was answered: it is idle again, the newest of the idle (its idle time starts now)."""
        self._move(conn, busy=False)

    def close(self, conn: C) -> None:
        """`conn` is gone (closed by either side, or shed); a connection not in the table is ignored."""
        entry = self._entries.pop(conn, None)
        if entry is not None and not entry.vouched:
            self._forget_anonymous(conn, entry)

    def _move(self, conn: C, *, busy: bool) -> None:
        entry = self._entries.get(conn)
        if entry is None or entry.vouched:
            return
        self._forget_anonymous(conn, entry)
        entry.busy = busy
        self._anonymous.add(conn, busy=busy)
        if entry.source is not None:
            self._by_source.setdefault(entry.source, _Anonymous()).add(conn, busy=busy)

    def _forget_anonymous(self, conn: C, entry: _Entry) -> None:
        self._anonymous.discard(conn)
        if entry.source is None:
            return
        local = self._by_source.get(entry.source)
        if local is not None:
            local.discard(conn)
            if not local:
                del self._by_source[entry.source]
