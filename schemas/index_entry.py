"""Index entries: what an index object says, and the one check that it agrees with the record it points at.

An index object (`schemas.layout.index_body`) is how every reader finds a record by request id, workflow step or
client request id. It is a pointer anyone with write access to the bucket could have written, so no reader
trusts it alone: `index_mismatch` compares the entry with the record it leads to (the same tenant and envelope
id as the entry, the request id and workflow step it is filed under) and says every difference. The replayer
(which opens sealed envelopes) and the audit jobs (which never do: a sealed record keeps its tenant, ids and
workflow position in clear, `schemas.sealed.SealedEnvelope`) both call it, so the rule is written once.

Pure: no IO; it imports the standard library and `schemas` only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from schemas.envelope import Envelope, decode_envelope
from schemas.errors import ContractError
from schemas.layout import workflow_index_prefix
from schemas.sealed import decode_sealed, is_sealed


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """The fields of an index object a reader acts on."""

    envelope_id: str
    key: str
    tenant: str


def parse_index_entry(body: bytes, where: str) -> IndexEntry:
    """The entry stored in `body` (an index object's bytes); `ContractError` naming `where` when it is not one."""
    try:
        doc: Any = json.loads(body)
        key, tenant, envelope_id = doc["key"], doc["tenant"], doc["envelope_id"]
        if not all(isinstance(v, str) for v in (key, tenant, envelope_id)):
            raise TypeError("key, tenant and envelope_id must be strings")
    except (ValueError, KeyError, TypeError) as exc:
        raise ContractError(f"index object {where} is malformed: {exc!r}") from None
    return IndexEntry(envelope_id=envelope_id, key=key, tenant=tenant)


@dataclass(frozen=True, slots=True)
class RecordFacts:
    """What a stored record says about itself, whichever form it is stored in."""

    tenant: str
    envelope_id: str
    request_id: str
    workflow: tuple[str, int] | None

    @classmethod
    def of_envelope(cls, envelope: Envelope) -> RecordFacts:
        flow = envelope.workflow
        return cls(
            envelope.tenant,
            envelope.envelope_id(),
            envelope.request_id,
            (flow.workflow_id, flow.step) if flow is not None else None,
        )


def record_facts(data: bytes) -> RecordFacts:
    """The facts of stored envelope bytes, plain or sealed (a sealed one's clear metadata: no key needed);
    `ContractError` when the bytes are neither."""
    if is_sealed(data):
        sealed = decode_sealed(data)
        flow = sealed.workflow
        return RecordFacts(
            sealed.tenant,
            sealed.envelope_id,
            sealed.request_id,
            (flow.workflow_id, flow.step) if flow is not None else None,
        )
    return RecordFacts.of_envelope(decode_envelope(data))


def index_mismatch(
    entry: IndexEntry,
    facts: RecordFacts,
    *,
    request_id: str | None = None,
    workflow: tuple[str, int] | None = None,
) -> list[str]:
    """Every way the record (`facts`) disagrees with the index `entry` that led to it, filed under `request_id`
    (or the workflow step `workflow`); empty when the entry can be trusted."""
    found: list[str] = []
    if facts.tenant != entry.tenant:
        found.append(f"tenant {facts.tenant!r}, the entry says {entry.tenant!r}")
    if facts.envelope_id != entry.envelope_id:
        found.append(f"envelope id {facts.envelope_id}, the entry says {entry.envelope_id}")
    if request_id is not None and facts.request_id != request_id:
        found.append(f"request id {facts.request_id!r}, the entry is filed under {request_id!r}")
    if workflow is not None and facts.workflow != workflow:
        found.append(f"workflow {facts.workflow}, the entry is filed under {workflow}")
    return found


def filed_step(workflow_id: str, key: str) -> tuple[str, int] | None:
    """(workflow id, step) a `schemas.layout.workflow_index_key` is filed under; None when the name has no step."""
    step = key.removeprefix(workflow_index_prefix(workflow_id)).split("-", 1)[0]
    return (workflow_id, int(step)) if step.isdigit() else None
