"""The audit jobs' index reading (`capture.audit.index`, `capture.audit.retention.resolve`) against moto's S3:
entries are followed only when their record agrees, a workflow id is one tenant's, and a rebuild never replaces
a valid entry."""

from __future__ import annotations

import uuid

import pytest

from capture.audit.errors import IndexMismatchError, UnknownIdError
from capture.audit.index import RepairReport, repair_entry
from capture.audit.retention import resolve
from capture.audit.store import AuditStore
from schemas import Envelope, WorkflowRef
from schemas.layout import envelope_key, index_body, request_index_key, workflow_index_key
from tests.factories import envelope


@pytest.fixture
def store(moto_store: AuditStore) -> AuditStore:
    return moto_store


def key_of(env: Envelope) -> str:
    return envelope_key(env.envelope_id(), env.tenant, env.captured_at)


def body_of(env: Envelope) -> bytes:
    return index_body(env.envelope_id(), key_of(env), env.tenant, env.captured_at)


def stored(store: AuditStore, env: Envelope, *, index: bool = True) -> Envelope:
    """`env` stored as the capture side stores it: the object, its request-id and workflow entries."""
    store.put_new(key_of(env), env.canonical())
    if index:
        store.put_new(request_index_key(env.request_id), body_of(env))
        if env.workflow is not None:
            flow = env.workflow
            store.put_new(workflow_index_key(flow.workflow_id, flow.step, env.request_id), body_of(env))
    return env


def step(tenant: str, workflow: str, n: int) -> Envelope:
    return envelope(request_id=f"r-{uuid.uuid4().hex[:8]}", tenant=tenant,
                    workflow=WorkflowRef(workflow_id=workflow, step=n))  # fmt: skip


def test_a_workflow_id_is_resolved_for_one_tenant_only(store: AuditStore) -> None:
    mine = [stored(store, step("acme", "wf-1", n)) for n in range(2)]
    theirs = stored(store, step("globex", "wf-1", 0))
    with pytest.raises(UnknownIdError, match=r"steps of tenant acme, globex\): name the tenant"):
        resolve(store, "wf-1")
    assert [e.key for e in resolve(store, "wf-1", "acme")] == [key_of(e) for e in mine]
    assert [e.key for e in resolve(store, "wf-1", "globex")] == [key_of(theirs)]
    assert [e.key for e in resolve(store, mine[0].request_id)] == [key_of(mine[0])]
    with pytest.raises(UnknownIdError, match="of tenant 'globex'"):
        resolve(store, mine[0].request_id, "globex")


def test_an_entry_that_disagrees_with_its_record_is_never_followed(store: AuditStore) -> None:
    victim, other = (
        stored(store, envelope(request_id="r-victim", tenant="acme")),
        stored(store, envelope(request_id="r-other", tenant="attacker")),
    )
    store.replace(request_index_key(victim.request_id), body_of(other))  # moved to another request's record
    with pytest.raises(IndexMismatchError, match="request id 'r-other', the entry is filed under 'r-victim'"):
        resolve(store, victim.request_id)
    lie = index_body(other.envelope_id(), key_of(other), "acme", other.captured_at)  # claims another tenant
    store.replace(request_index_key(other.request_id), lie)
    with pytest.raises(IndexMismatchError, match="tenant 'attacker', the entry says 'acme'"):
        resolve(store, other.request_id)
    flow = stored(store, step("acme", "wf-2", 3))
    store.put_new(workflow_index_key("wf-2", 4, "r-x"), body_of(flow))  # filed under another step
    with pytest.raises(IndexMismatchError, match=r"workflow \('wf-2', 3\), the entry is filed under \('wf-2', 4\)"):
        resolve(store, "wf-2", "acme")


def test_repair_writes_missing_keeps_valid_and_replaces_only_invalid_entries(store: AuditStore) -> None:
    a = stored(store, step("acme", "wf-3", 1), index=False)
    b = stored(store, step("acme", "wf-3", 1))  # the same step, recorded twice (another request)
    report = RepairReport()
    key_a, step_key = request_index_key(a.request_id), workflow_index_key("wf-3", 1, a.request_id)
    repair_entry(store, key_a, body_of(a), report, request_id=a.request_id, overwrite=True)
    assert report.written == [key_a]
    assert store.get(key_a) == body_of(a)
    store.put_new(step_key, body_of(b))  # valid (b is that step too), another envelope than the lake's row
    for overwrite in (False, True):
        repair_entry(store, key_a, body_of(a), report, request_id=a.request_id, overwrite=overwrite)
        repair_entry(store, step_key, body_of(a), report, workflow=("wf-3", 1), overwrite=overwrite)
    assert report.kept == [key_a, key_a]
    assert len(report.kept_other) == 2
    assert store.get(step_key) == body_of(b)  # never replaced, not even with overwrite

    store.replace(key_a, b"{not json")
    repair_entry(store, key_a, body_of(a), report, request_id=a.request_id)
    assert store.get(key_a) == b"{not json"
    assert report.invalid[0].startswith(f"{key_a}: index object")
    assert report.invalid[0].endswith("(pass --overwrite to repair it)")
    store.replace(key_a, body_of(b))  # valid bytes, but b is another request
    repair_entry(store, key_a, body_of(a), report, request_id=a.request_id, overwrite=True)
    assert store.get(key_a) == body_of(a)
    assert "request id" in report.repaired[0]


def test_a_lake_row_that_disagrees_with_s3_is_not_written(store: AuditStore) -> None:
    a, b = stored(store, envelope(request_id="r-a"), index=False), stored(store, envelope(request_id="r-b"))
    report = RepairReport()
    repair_entry(store, request_index_key("r-a"), body_of(b), report, request_id="r-a", overwrite=True)
    ghost = envelope(request_id="r-ghost")  # the lake names an object S3 does not hold
    repair_entry(store, request_index_key("r-ghost"), body_of(ghost), report, request_id="r-ghost")
    assert store.get(request_index_key("r-a")) is None
    assert store.get(request_index_key("r-ghost")) is None
    assert [s.split(": ", 1)[0] for s in report.skipped] == [request_index_key("r-a"), request_index_key("r-ghost")]
    assert report.counts()["written"] == 0
    assert a.request_id == "r-a"
