"""The index entry's one check (`schemas.index_entry`) and the access log's record and key (`schemas.access_log`)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

import pytest

from schemas import ContractError, WorkflowRef
from schemas.access_log import ACTION_ROLES, OPERATOR_ROLES, AccessRecord, decode_access_record, role_grants
from schemas.index_entry import IndexEntry, RecordFacts, index_mismatch, parse_index_entry, record_facts
from schemas.layout import access_log_key, index_body
from schemas.sealed import new_data_key, seal_envelope
from tests.factories import envelope


def test_an_entry_is_parsed_or_refused_naming_where() -> None:
    at = datetime(2026, 1, 2, tzinfo=UTC)
    assert parse_index_entry(index_body("e" * 64, "k", "acme", at), "here") == IndexEntry("e" * 64, "k", "acme")
    for bad in (b"[]", b"{", b'{"key": 1, "tenant": "t", "envelope_id": "e"}', b'{"key": "k"}'):
        with pytest.raises(ContractError, match="index object here is malformed"):
            parse_index_entry(bad, "here")


def test_the_facts_of_a_plain_and_a_sealed_record_are_the_same() -> None:
    env = envelope(request_id="r-1", tenant="acme", workflow=WorkflowRef(workflow_id="wf", step=2))
    sealed = seal_envelope(env.canonical(), request_id="r-1", tenant="acme", captured_at=env.captured_at,
                           workflow=env.workflow, key_id="k1", data_key=new_data_key())  # fmt: skip
    plain = record_facts(env.canonical())
    assert plain == RecordFacts("acme", env.envelope_id(), "r-1", ("wf", 2)) == RecordFacts.of_envelope(env)
    assert record_facts(sealed.canonical()) == plain  # no key needed: the clear metadata
    with pytest.raises(ContractError):
        record_facts(base64.b64encode(b"junk"))


def test_every_disagreement_is_named() -> None:
    facts = RecordFacts("acme", "e1", "r-1", ("wf", 2))
    assert index_mismatch(IndexEntry("e1", "k", "acme"), facts, request_id="r-1", workflow=("wf", 2)) == []
    found = index_mismatch(IndexEntry("e2", "k", "evil"), facts, request_id="r-9", workflow=("wf", 3))
    assert found == [
        "tenant 'acme', the entry says 'evil'",
        "envelope id e1, the entry says e2",
        "request id 'r-1', the entry is filed under 'r-9'",
        "workflow ('wf', 2), the entry is filed under ('wf', 3)",
    ]


def test_access_records_and_their_keys() -> None:
    at = datetime(2026, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)
    record = AccessRecord(record_id="a" * 32, at=at, actor_key_id=None, role="key-admin", action="keys.shred",
                          target="acme", tenant="acme", result="refused", reason="no operator key")  # fmt: skip
    assert decode_access_record(record.model_dump_json()) == record
    assert (
        access_log_key(at, record.record_id) == f"audit/access/date=2026-03-04/20260304T050607890123Z-{'a' * 32}.json"
    )
    assert set(ACTION_ROLES.values()) - {None} == OPERATOR_ROLES
    assert {a for a, r in ACTION_ROLES.items() if r is None} == {"login", "logout"}
    # the one role rule: a role grants itself, hold-admin also grants viewer, nothing else is implied
    assert role_grants({"hold-admin"}, "viewer")
    assert role_grants({"viewer"}, None)
    assert not role_grants({"viewer"}, "hold-admin")
    assert not role_grants({"retention-admin", "key-admin"}, "viewer")
    assert not role_grants(set(), "viewer")
    console = record.model_copy(update={"action": "login", "role": None, "peer": "127.0.0.1"})
    assert decode_access_record(console.model_dump_json()) == console
    with pytest.raises(ContractError, match="result"):
        decode_access_record(record.model_dump_json().replace('"refused"', '"maybe"'))
