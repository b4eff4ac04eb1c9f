"""What the ledger reads of a record the sidecar stores: `StoredRecord`.

The sidecar's `capture.outgoing.Outgoing` (a spooled envelope with the fields it is routed by) is one; the ledger
names only what it reads, so it never imports the sidecar. The Merkle log takes the spool order, the envelope id
and the capture day; the sealer the rest, and hands the sealed record back through `with_payload`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol, Self


class StoredRecord(Protocol):
    @property
    def seq(self) -> int: ...
    @property
    def envelope_id(self) -> str: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def request_id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def captured_at(self) -> datetime: ...
    @property
    def schema_version(self) -> str: ...
    @property
    def workflow_id(self) -> str | None: ...
    @property
    def workflow_step(self) -> int | None: ...

    def with_payload(self, payload: bytes, schema_version: str) -> Self:
        """The same record (routing fields, object and index keys) with another payload (the sealed one)."""
        ...
