"""An in-memory stand-in for `capture.spool.Spool` with the methods the proxy uses."""

from __future__ import annotations

import asyncio

from capture.errors import SpoolFullError
from schemas import Envelope
from schemas.envelope import decode_envelope


class FakeSpool:
    def __init__(self, *, reported_bytes: int = 0, refuse_appends: bool = False) -> None:
        self.envelopes: list[Envelope] = []
        self.reported_bytes = reported_bytes
        self.refuse_appends = refuse_appends
        self.opened = False
        self.closed = False
        self._arrived = asyncio.Event()

    async def open(self) -> None:
        self.opened = True

    async def close(self) -> None:
        self.closed = True

    async def append_payload(self, payload: bytes) -> None:
        if self.refuse_appends:
            raise SpoolFullError("fake spool is full")
        envelope = decode_envelope(payload)  # what the sidecar spools must be a valid envelope...
        assert envelope.canonical() == payload  # ...in its canonical form (its id is the hash of these bytes)
        self.envelopes.append(envelope)
        self._arrived.set()

    @property
    def bytes(self) -> int:
        return self.reported_bytes

    @property
    def depth(self) -> int:
        return len(self.envelopes)

    async def wait_for(self, count: int, within_s: float = 5.0) -> list[Envelope]:
        async with asyncio.timeout(within_s):
            while len(self.envelopes) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return self.envelopes
