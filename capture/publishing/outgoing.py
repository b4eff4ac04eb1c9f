"""The record every sink takes: a spooled envelope with the few fields it is routed and keyed by.

`Outgoing.from_entry` reads them from the envelope's canonical JSON (only those members, `_RouteFields`); a spool
record that is not a routable envelope is a `SinkError`. The spool always holds canonical JSON; `Outgoing.compacted`
swaps the payload for its compact form (`schemas.envelope_compact`) before the sinks see it, when the sidecar stores
compact envelopes (``envelope_encoding``), and ``encoding`` says which form the payload is. The record also names
its S3 objects (`object_key`, `index_keys`, `index_body`) and whether Kafka gets a claim check instead of its
payload (`claim_checked`: over `schemas.layout.CLAIM_CHECK_BYTES`). A guaranteed stream's *started* record is not
indexed (`started`); a shadow envelope (`schemas.envelope.ShadowMarker`, `capture.request.shadow`) shares its production
request's id, so it takes only its own index entry (`schemas.layout.shadow_index_key`), never the request's
write-once ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Self

import msgspec

from capture.errors import SinkError
from capture.ledger.records import StoredRecord
from capture.spool import SpoolEntry
from schemas import sha256_hex
from schemas.envelope import STARTED_ERROR_TYPE
from schemas.envelope_compact import encode_compact, encoding_of
from schemas.layout import (
    CLAIM_CHECK_BYTES,
    ENCODING_COMPACT,
    ENCODING_JSON,
    capture_day,
    envelope_key,
    index_body,
    request_index_key,
    shadow_index_key,
    workflow_index_key,
)


class _WorkflowFields(msgspec.Struct):
    workflow_id: str
    step: int


class _OutcomeFields(msgspec.Struct):
    error_type: str | None = None


class _ShadowFields(msgspec.Struct):
    production_envelope_id: str


class _RouteFields(msgspec.Struct):
    """The members of an envelope's canonical JSON the sinks route by (msgspec skips the rest unparsed, far
    cheaper than ``json.loads`` of a whole envelope, per envelope published: benchmarks/bench_envelope.py)."""

    request_id: str
    tenant: str
    captured_at: str
    schema_version: str
    workflow: _WorkflowFields | None = None
    client_request_id: str | None = None
    outcome: _OutcomeFields | None = None
    shadow: _ShadowFields | None = None


_ROUTE_DECODER = msgspec.json.Decoder(_RouteFields)


@dataclass(frozen=True)
class Outgoing(StoredRecord):
    """A spooled envelope with the few fields the sinks route by (read from its canonical JSON): the ledger's
    (`capture.ledger.records.StoredRecord`) and the sinks' own."""

    client_request_id: str | None = None
    #: A guaranteed stream's *started* record (outcome ``incomplete``, `schemas.Envelope.is_started_record`):
    #: stored and logged like any envelope, but not indexed, so the write-once index entries go to the envelope
    #: that says how the request ended (a started record no finished one followed is found by its object key).
    started: bool = False
    #: What `payload` is: `ENCODING_JSON` (canonical, or a sealed record) or `ENCODING_COMPACT`.
    encoding: str = ENCODING_JSON
    #: A shadow envelope (a candidate's answer to a production request, `capture.request.shadow`): indexed apart.
    shadow: bool = False

    @classmethod
    def from_entry(cls, entry: SpoolEntry) -> Outgoing:
        try:
            doc = _ROUTE_DECODER.decode(entry.payload)
            return cls(
                seq=entry.seq,
                payload=entry.payload,
                envelope_id=sha256_hex(entry.payload),
                request_id=doc.request_id,
                tenant=doc.tenant,
                captured_at=datetime.fromisoformat(doc.captured_at).astimezone(UTC),
                schema_version=doc.schema_version,
                workflow_id=doc.workflow.workflow_id if doc.workflow is not None else None,
                workflow_step=doc.workflow.step if doc.workflow is not None else None,
                client_request_id=doc.client_request_id,
                started=doc.outcome is not None and doc.outcome.error_type == STARTED_ERROR_TYPE,
                shadow=doc.shadow is not None,
            )
        except (ValueError, msgspec.DecodeError) as exc:
            raise SinkError(f"spool record seq {entry.seq} is not a routable envelope: {exc!r}") from exc

    @property
    def object_key(self) -> str:
        return envelope_key(self.envelope_id, self.tenant, self.captured_at)

    def index_keys(self) -> list[str]:
        if self.started:
            return []
        if self.shadow:
            return [shadow_index_key(capture_day(self.captured_at), self.request_id)]
        keys = [request_index_key(self.request_id)]
        if self.workflow_id is not None and self.workflow_step is not None:
            keys.append(workflow_index_key(self.workflow_id, self.workflow_step, self.request_id))
        return keys

    def index_body(self) -> bytes:
        return index_body(self.envelope_id, self.object_key, self.tenant, self.captured_at)

    @property
    def claim_checked(self) -> bool:
        """True when Kafka gets a claim check instead of the payload (`capture.publishing.kafka_sink`)."""
        return len(self.payload) > CLAIM_CHECK_BYTES

    def with_payload(self, payload: bytes, schema_version: str) -> Self:
        """This record with another payload (the sealed one, `capture.ledger.sealing`): routed and keyed the same,
        its `encoding` read from the new payload."""
        return dataclasses.replace(self, payload=payload, schema_version=schema_version, encoding=encoding_of(payload))

    def compacted(self) -> Outgoing:
        """This record with its payload in compact form (the same envelope id), or as it is when it is compact
        already or the codec cannot reproduce its bytes exactly (`schemas.envelope_compact.encode_compact`)."""
        if self.encoding == ENCODING_COMPACT:
            return self
        compact = encode_compact(self.payload)
        return self if compact is None else dataclasses.replace(self, payload=compact, encoding=ENCODING_COMPACT)
