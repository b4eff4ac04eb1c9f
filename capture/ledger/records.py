"""What the ledger reads of a record the sidecar stores: `StoredRecord`.

The sidecar's `capture.publishing.outgoing.Outgoing` (a spooled envelope with the fields it is routed by) extends it;
the ledger declares the fields it reads, once, here, so it never imports the sidecar and the sidecar does not declare
them again. The Merkle log takes the spool order, the envelope id and the capture day; the sealer the rest, and
hands the sealed record back through `with_payload`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Self


@dataclass(frozen=True)
class StoredRecord:
    seq: int
    payload: bytes
    envelope_id: str
    request_id: str
    tenant: str
    captured_at: datetime
    schema_version: str
    workflow_id: str | None
    workflow_step: int | None

    def with_payload(self, payload: bytes, schema_version: str) -> Self:
        """The same record (routing fields, object and index keys) with another payload (the sealed one)."""
        return dataclasses.replace(self, payload=payload, schema_version=schema_version)
