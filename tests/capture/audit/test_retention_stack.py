"""Retention per tenant, legal hold and the expiry job on the real SeaweedFS (a fresh Object Lock bucket).

S3 retention is a date, not a duration, so the expiry cases write envelopes whose retain-until is a few
seconds ahead (the S3 sink's retention set to seconds) and wait for it to pass; SeaweedFS honours it.

All tests (and runs) share one Object Lock bucket, each test with its own uuid tenant: a SeaweedFS bucket takes
volume slots, and a locked bucket cannot be removed until its retention ends, so a bucket per test would
exhaust the dev stack's volumes (see test_tamper_stack.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from capture.audit.access_log import hold_decisions
from capture.audit.retention import expire, set_hold
from capture.audit.store import AuditStore
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from schemas import Envelope, WorkflowRef, envelope_bytes
from schemas.layout import envelope_key
from tests.capture.audit.support import access_records, audit_cli, operator_keys, publish_through_s3
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]

SHORT = timedelta(seconds=15)  # the CLI calls below take ~2 s each (a fresh interpreter)


BUCKET = "reprolane-test-audit-lock"


@pytest.fixture
def bucket(stack: StackInfo) -> str:
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
    assert (
        client.get_object_lock_configuration(Bucket=BUCKET)["ObjectLockConfiguration"]["ObjectLockEnabled"] == "Enabled"
    )
    return BUCKET


@pytest.fixture
def tenant() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client(stack: StackInfo) -> Any:
    return s3_client(stack.s3_endpoint, stack.s3_credentials)


@pytest.fixture
def settings(stack: StackInfo, bucket: str, tenant: str, tmp_path: Path) -> CaptureSettings:
    return CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_bucket=bucket,
        retention_days=1,
        retention_days_by_tenant={f"{tenant}-long": 2, f"{tenant}-scratch": 0},
        audit_log=True,
    )


def key_of(env: Envelope) -> str:
    return envelope_key(env.envelope_id(), env.tenant, env.captured_at)


def fresh(**overrides: Any) -> Envelope:
    values: dict[str, Any] = {"request_id": f"req-{uuid.uuid4().hex[:10]}", "captured_at": datetime.now(UTC)}
    values.update(overrides)
    return envelope(**values)


async def publish(settings: CaptureSettings, envs: list[Envelope], retention: timedelta | None = None) -> None:
    """`publish_through_s3` into the settings' spool; `retention` overrides the sink's default days."""
    sink = S3Sink(settings)
    if retention is not None:
        sink.retention = retention
    await publish_through_s3(settings, envs, settings.spool_dir, sink=sink)


async def test_retention_is_set_per_tenant(settings: CaptureSettings, client: Any, bucket: str, tenant: str) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    default = fresh(captured_at=now, tenant=tenant)
    long = fresh(captured_at=now, tenant=f"{tenant}-long")
    scratch = fresh(tenant=f"{tenant}-scratch")
    await publish(settings, [default, long, scratch])
    got = [client.head_object(Bucket=bucket, Key=key_of(e)) for e in (default, long, scratch)]
    assert got[0]["ObjectLockRetainUntilDate"] == now + timedelta(days=1)
    assert got[1]["ObjectLockRetainUntilDate"] == now + timedelta(days=2)
    assert got[1]["ObjectLockMode"] == "COMPLIANCE"
    assert "ObjectLockRetainUntilDate" not in got[2]


async def test_compliance_refuses_deleting_a_locked_version(
    settings: CaptureSettings, client: Any, bucket: str, tenant: str
) -> None:
    env = fresh(tenant=tenant)
    await publish(settings, [env])
    version = client.head_object(Bucket=bucket, Key=key_of(env))["VersionId"]
    with pytest.raises(ClientError) as refused:
        client.delete_object(Bucket=bucket, Key=key_of(env), VersionId=version)
    assert refused.value.response["Error"]["Code"] == "AccessDenied"
    with pytest.raises(ClientError):  # shortening a COMPLIANCE retention is refused too
        client.put_object_retention(
            Bucket=bucket,
            Key=key_of(env),
            VersionId=version,
            Retention={"Mode": "COMPLIANCE", "RetainUntilDate": datetime.now(UTC) + timedelta(seconds=5)},
        )
    stored = client.get_object(Bucket=bucket, Key=key_of(env), VersionId=version)["Body"].read()
    assert envelope_bytes(stored) == env.canonical()


async def test_expiry_deletes_only_what_is_past_retention_and_not_held(
    stack: StackInfo, settings: CaptureSettings, client: Any, bucket: str, tenant: str, tmp_path: Path
) -> None:
    store = AuditStore(client, bucket)
    ops = operator_keys(tmp_path / "ops", holds=(("hold-admin",), tenant), expiry=(("retention-admin",), tenant))
    only = f"envelopes/tenant={tenant}/"  # the bucket is shared: expire this test's tenant only
    workflow = f"wf-{uuid.uuid4().hex[:8]}"
    held, free = fresh(tenant=tenant), fresh(tenant=tenant)
    steps = [fresh(tenant=tenant, workflow=WorkflowRef(workflow_id=workflow, step=i)) for i in range(2)]
    kept = fresh(tenant=tenant)
    started = time.monotonic()
    await publish(settings, [held, free, *steps], retention=SHORT)
    await publish(settings, [kept])

    holds = ("--operator-key-file", ops.key_file("holds"))
    why = ("--reason", "subpoena of\n2026-12-01", "--case", "LIT-2026/0142")
    bad_case = audit_cli(stack, bucket, "audit", "hold", "add", held.request_id, *holds, "--case", "a;b", operators=ops)
    assert bad_case.returncode == 2
    assert "--case" in bad_case.stderr
    done = audit_cli(stack, bucket, "audit", "hold", "add", held.request_id, *holds, *why, operators=ops)
    assert done.returncode == 0, done.stderr
    assert f"legal hold ON  {key_of(held)}" in done.stdout
    decisions, problems = hold_decisions(store, held.envelope_id())  # filed under the envelope, as the console reads
    assert problems == []
    assert [(d.action, d.actor_key_id, d.note, d.case) for d in decisions] == [
        ("hold.add", "holds", "subpoena of 2026-12-01", "LIT-2026/0142")
    ]
    assert [h.key for h in set_hold(store, workflow, True, tenant)] == [key_of(s) for s in steps]  # every step
    assert audit_cli(stack, bucket, "audit", "hold", "add", "no-such-id", *holds, operators=ops).returncode == 2

    early = expire(store, prefix=only)  # nothing is past retention yet
    assert time.monotonic() < started + SHORT.total_seconds(), "too slow to test 'not yet expired'"
    assert early.deleted == []
    assert len(early.retained) == 2  # free and kept
    assert len(early.held) == 3

    await asyncio.sleep(max(0.0, started + SHORT.total_seconds() + 1.5 - time.monotonic()))
    dry = expire(store, dry_run=True, prefix=only)
    assert [d["key"] for d in dry.deleted] == [key_of(free)]
    assert client.head_object(Bucket=bucket, Key=key_of(free))  # dry run deleted nothing

    done = audit_cli(stack, bucket, "audit", "expire", "--operator-key-file", ops.key_file("expiry"), operators=ops)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == "deleted 1; kept held 3, retained 1, unretained 0; refused 0"
    assert f"deleted: {key_of(free)}" in done.stdout
    assert f"held: {key_of(held)}" in done.stdout
    versions = {v.key for v in store.versions(only)}
    assert key_of(free) not in versions
    assert {key_of(held), key_of(kept), *(key_of(s) for s in steps)} <= versions

    assert audit_cli(stack, bucket, "audit", "hold", "remove", workflow, *holds, operators=ops).returncode == 0
    after = expire(store, prefix=only)
    assert sorted(d["key"] for d in after.deleted) == sorted(key_of(s) for s in steps)
    assert [h.split("?")[0] for h in after.held] == [key_of(held)]  # still held, long past its retention
    assert after.retained == [
        f"{key_of(kept)}?versionId={client.head_object(Bucket=bucket, Key=key_of(kept))['VersionId']}"
    ]
    assert after.report_key is not None

    report = store.get(after.report_key)
    assert report is not None
    assert sorted(d["envelope_id"] for d in json.loads(report)["deleted"]) == sorted(e.envelope_id() for e in steps)
    # the expiry report is what lets `verify --range` call these leaves "expired" (test_tamper_stack.py)
    set_hold(store, held.request_id, False)  # the shared bucket: leave nothing held forever


async def test_holds_act_for_a_hold_admin_key_on_one_tenants_records_and_are_logged(
    stack: StackInfo, settings: CaptureSettings, client: Any, bucket: str, tenant: str, tmp_path: Path
) -> None:
    """Two tenants send the same workflow id: a hold reaches only the named (or the key's) tenant's steps; no
    key, a key without hold-admin and a key scoped to another tenant are refused (exit 2, one line); every
    decision is an access-log record."""
    other = f"{tenant}-other"
    workflow = f"wf-{uuid.uuid4().hex[:8]}"
    mine = [fresh(tenant=tenant, workflow=WorkflowRef(workflow_id=workflow, step=i)) for i in range(2)]
    theirs = fresh(tenant=other, workflow=WorkflowRef(workflow_id=workflow, step=0))
    await publish(settings, [*mine, theirs], retention=SHORT)
    ops = operator_keys(
        tmp_path / "ops", admin=(("hold-admin",), None), scoped=(("hold-admin",), other),
        viewer=(("viewer",), None), expirer=(("retention-admin",), None),
    )  # fmt: skip

    def hold(*args: str) -> Any:
        return audit_cli(stack, bucket, "audit", "hold", *args, operators=ops)

    store = AuditStore(client, bucket)

    def held(env: Envelope) -> bool:
        version = store.current_version(key_of(env))
        assert version is not None
        return store.legal_hold(key_of(env), version)

    for refused, why in (
        (hold("add", workflow, "--tenant", tenant), "no operator key: pass --operator-key-file"),
        (hold("add", workflow, "--operator-key-file", ops.key_file("viewer")), "lacks the 'hold-admin' role"),
        (hold("add", workflow, "--tenant", tenant, "--operator-key-file", ops.key_file("scoped")),
         f"is scoped to tenant {other!r}, not tenant {tenant!r}"),
    ):  # fmt: skip
        assert (refused.returncode, refused.stderr.count("\n")) == (2, 1), refused.stderr
        assert refused.stderr.startswith("reprolane: error: hold.add refused: "), refused.stderr
        assert why in refused.stderr
    unnamed = hold("add", workflow, "--operator-key-file", ops.key_file("admin"))
    assert (unnamed.returncode, unnamed.stderr.count("\n")) == (2, 1)
    assert "is a workflow id" in unnamed.stderr
    assert "name the tenant (--tenant)" in unnamed.stderr
    assert not any(held(e) for e in (*mine, theirs))  # nothing refused touched a record

    done = hold("add", workflow, "--tenant", tenant, "--operator-key-file", ops.key_file("admin"))
    assert done.returncode == 0, done.stderr
    assert [held(e) for e in (*mine, theirs)] == [True, True, False]  # this tenant's steps only
    done = hold("add", workflow, "--operator-key-file", ops.key_file("scoped"))  # the key's tenant
    assert done.returncode == 0, done.stderr
    assert held(theirs)
    assert done.stdout.count("legal hold ON ") == 1
    expiry = audit_cli(stack, bucket, "audit", "expire", "--tenant", tenant, "--operator-key-file",
                       ops.key_file("admin"), operators=ops)  # fmt: skip
    assert expiry.returncode == 2
    assert "lacks the 'retention-admin' role" in expiry.stderr

    decisions = [(r.actor_key_id, r.action, r.tenant, r.result) for r in access_records(client, bucket, workflow)]
    assert decisions == [
        (None, "hold.add", tenant, "refused"),
        ("viewer", "hold.add", None, "refused"),
        ("scoped", "hold.add", tenant, "refused"),
        ("admin", "hold.add", tenant, "allowed"),
        ("scoped", "hold.add", other, "allowed"),
    ]
    for key, who in ((ops.key_file("admin"), tenant), (ops.key_file("scoped"), other)):
        assert hold("remove", workflow, "--tenant", who, "--operator-key-file", key).returncode == 0
    assert not any(held(e) for e in (*mine, theirs))
