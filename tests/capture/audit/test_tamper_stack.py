"""Tamper evidence on the real SeaweedFS: every tamper case is detected and named, a clean log verifies.

The tests share one bucket WITHOUT Object Lock (so a test can do what an attacker with write access would) and
each test gets its own capture day (a random date), so its log, checkpoints and objects are its own. One bucket,
not one per test: every SeaweedFS bucket is a collection that takes volume slots (68 on the dev stack), and a
bucket per test exhausted them ("No writable volumes and no free volumes left"). The log is filled through the
real code: Spool -> Publisher (S3 sink, then the Merkle log writer) -> checkpoint job.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from capture.audit.checkpoint import reconcile, write_checkpoint
from capture.audit.errors import InconsistentLogError
from capture.audit.store import AuditStore
from capture.audit.verify import verify_range, verify_request
from capture.ledger.merkle_log import read_leaves
from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from schemas import Envelope
from schemas.layout import checkpoint_key, envelope_key, leaves_key
from schemas.merkle import LEAF_BATCH_MAGIC, LeafEntry, merkle_root, sign_checkpoint
from tests.capture.audit.support import audit_cli, new_key, publish_through_s3, random_day
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]

N = 6
BUCKET = "reprolane-test-audit-tamper"


@dataclass
class Log:
    stack: StackInfo
    bucket: str
    client: Any
    store: AuditStore
    settings: CaptureSettings
    envs: list[Envelope]
    private: bytes
    public: bytes
    day: str
    captured: datetime

    def key(self, i: int) -> str:
        env = self.envs[i]
        return envelope_key(env.envelope_id(), env.tenant, env.captured_at)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        import base64

        return audit_cli(
            self.stack,
            self.bucket,
            *args,
            public_key=base64.b64encode(self.public).decode(),
            signing_key=base64.b64encode(self.private).decode(),
        )


@pytest.fixture
async def log(stack: StackInfo, tmp_path: Path) -> Log:
    bucket = BUCKET
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=bucket)  # no Object Lock: the test plays the attacker
    captured = random_day()
    day = captured.strftime("%Y-%m-%d")
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_bucket=bucket,
        retention_days=0,
        audit_log=True,
    )
    envs = [
        envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=captured + timedelta(seconds=i))
        for i in range(N)
    ]
    await publish_through_s3(settings, envs, tmp_path / "spool", batch_size=2)
    store = AuditStore(client, bucket)
    private, public = new_key()
    assert write_checkpoint(store, day, private, retention=None) is not None
    return Log(stack, bucket, client, store, settings, envs, private, public, day, captured)


def messages(verdict: Any) -> str:
    return "\n".join(f.message for f in verdict.findings)


def test_a_clean_log_verifies(log: Log) -> None:
    assert read_leaves(log.store, log.day).ids == [e.envelope_id() for e in log.envs]
    for env in log.envs:
        verdict = verify_request(log.store, env.request_id, log.public)
        assert verdict.ok, messages(verdict)
        assert any("inclusion proof" in line for line in verdict.lines)
    verdict = verify_range(log.store, log.day, log.public)
    assert verdict.ok, messages(verdict)
    done = log.cli("verify", log.envs[3].request_id)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"verified request {log.envs[3].request_id}")
    assert f"leaf: 3 of day={log.day}" in done.stdout
    done = log.cli("verify", "--range", log.day)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_modified_envelope_is_named(log: Log) -> None:
    key = log.key(2)
    forged = log.envs[2].model_copy(update={"tenant": log.envs[2].tenant}).canonical().replace(b"Paris", b"Lyon!")
    log.client.put_object(Bucket=log.bucket, Key=key, Body=forged)
    verdict = verify_request(log.store, log.envs[2].request_id, log.public)
    assert not verdict.ok
    assert "modified" in verdict.kinds()
    from schemas import sha256_hex

    expected = (
        f"modified: stored bytes of {key} hash to {sha256_hex(forged)}, the log committed to "
        f"{log.envs[2].envelope_id()}; they are an envelope of request {log.envs[2].request_id} that is not the "
        "logged one (edited or replaced)"
    )
    assert expected in messages(verdict)
    ranged = verify_range(log.store, log.day, log.public)
    assert ranged.kinds() == {"modified"}
    done = log.cli("verify", log.envs[2].request_id)
    assert done.returncode == 1
    assert done.stdout.splitlines()[0] == f"FAILED request {log.envs[2].request_id}: {expected}"
    assert verify_request(log.store, log.envs[1].request_id, log.public).ok  # the others still prove


def test_a_deleted_envelope_is_named(log: Log) -> None:
    log.client.delete_object(Bucket=log.bucket, Key=log.key(3))
    verdict = verify_range(log.store, log.day, log.public)
    assert verdict.kinds() == {"deleted"}
    assert f"deleted: leaf 3 (envelope id {log.envs[3].envelope_id()}) has no object" in messages(verdict)
    single = verify_request(log.store, log.envs[3].request_id, log.public)
    assert f"deleted: envelope object {log.key(3)} is gone" in messages(single)
    done = log.cli("verify", "--range", log.day)
    assert done.returncode == 1
    assert "deleted: leaf 3" in done.stdout.splitlines()[0]


def test_reordered_leaves_are_detected_and_the_swap_named(log: Log) -> None:
    key = leaves_key(log.day, 2)  # batch_size 2: this batch object holds leaves 2 and 3
    body = log.client.get_object(Bucket=log.bucket, Key=key)["Body"].read()
    head, leaf2, leaf3 = body[:16], body[16:80], body[80:]
    assert (head, len(leaf2), len(leaf3)) == (LEAF_BATCH_MAGIC, 64, 64)
    log.client.put_object(Bucket=log.bucket, Key=key, Body=head + leaf3 + leaf2)
    verdict = verify_range(log.store, log.day, log.public)
    assert verdict.kinds() == {"reordered"}
    assert "reordered: leaves 2 and 3" in messages(verdict)
    single = verify_request(log.store, log.envs[0].request_id, log.public)
    assert not single.ok
    assert "reordered" in single.kinds()
    # re-signing after the tamper cannot launder it: the checkpoint job refuses a log that is not consistent with
    # the checkpoint it signed before, and the chain stays broken
    more = [envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=log.captured + timedelta(minutes=5))]
    from capture.ledger.merkle_log import append_leaves

    append_leaves(log.store, log.day, [LeafEntry(more[0].envelope_id(), more[0].envelope_id())], None)
    with pytest.raises(InconsistentLogError, match="not consistent"):
        write_checkpoint(log.store, log.day, log.private, retention=None)
    again = verify_range(log.store, log.day, log.public)
    assert "reordered" in again.kinds()


def test_an_inserted_envelope_object_is_named(log: Log) -> None:
    extra = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=log.captured + timedelta(minutes=1))
    key = envelope_key(extra.envelope_id(), extra.tenant, extra.captured_at)
    log.client.put_object(Bucket=log.bucket, Key=key, Body=extra.canonical())
    verdict = verify_range(log.store, log.day, log.public)
    assert verdict.kinds() == {"inserted"}
    assert f"inserted: object {key} (envelope id {extra.envelope_id()}) is in no leaf of {log.day}" in messages(verdict)


def test_an_inserted_leaf_breaks_the_signed_root(log: Log) -> None:
    forged = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}")
    key = leaves_key(log.day, 0)
    body = log.client.get_object(Bucket=log.bucket, Key=key)["Body"].read()
    at = len(LEAF_BATCH_MAGIC) + 64  # after the first format-2 leaf
    extra = LeafEntry(forged.envelope_id(), forged.envelope_id()).data()
    log.client.put_object(Bucket=log.bucket, Key=key, Body=body[:at] + extra + body[at:])
    verdict = verify_range(log.store, log.day, log.public)
    assert {"altered", "deleted", "broken_log"} <= verdict.kinds()
    assert f"deleted: leaf 1 (envelope id {forged.envelope_id()}) has no object" in messages(verdict)


def test_a_forged_or_foreign_checkpoint_is_refused(log: Log) -> None:
    other_private, _ = new_key()
    leaves = read_leaves(log.store, log.day).entries
    fake = sign_checkpoint(
        other_private, f"day={log.day}", 4, merkle_root([e.data() for e in leaves[:4]]), log.captured
    )
    log.client.put_object(Bucket=log.bucket, Key=checkpoint_key(log.day, 4), Body=fake.canonical())
    verdict = verify_range(log.store, log.day, log.public)
    assert verdict.kinds() == {"bad_checkpoint"}
    assert "signature of" in messages(verdict)


async def test_stored_but_not_logged_is_its_own_finding_and_reconcile_repairs_it(log: Log) -> None:
    late = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=log.captured + timedelta(minutes=2))
    sink = S3Sink(log.settings)  # the envelope reached S3 but the process died before the leaf append
    await sink.publish([Outgoing.from_entry(SpoolEntry(1, late.canonical()))])
    await sink.close()
    verdict = verify_request(log.store, late.request_id, log.public)
    assert verdict.kinds() == {"not_logged"}
    done = log.cli("verify", late.request_id)
    assert done.returncode == 1
    assert "not_logged" in done.stdout.splitlines()[0]
    assert reconcile(log.store, log.day, retention=None, dry_run=True) == [late.envelope_id()]
    done = log.cli("audit", "reconcile", "--day", log.day)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"{log.day}: 1 stored envelope(s) not in the log appended",
        f"  {late.envelope_id()}",
    ]
    assert verify_request(log.store, late.request_id, log.public).kinds() == {"not_checkpointed"}
    done = log.cli("audit", "checkpoint", "--day", log.day)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{log.day}: checkpoint size {N + 1} root ")
    assert verify_request(log.store, late.request_id, log.public).ok
    assert verify_range(log.store, log.day, log.public).ok


def test_unknown_ids_and_bad_arguments_exit_2(log: Log) -> None:
    assert log.cli("verify", "req-does-not-exist").returncode == 2
    assert log.cli("verify", "--range", "not-a-day").returncode == 2
    assert log.cli("verify", "--range", f"{log.day}:1:6").returncode == 2  # no checkpoint of size 1
    assert log.cli("verify").returncode == 2


def test_a_republished_duplicate_leaf_is_harmless(log: Log) -> None:
    from capture.ledger.merkle_log import append_leaves

    # a crash after the leaf append and before the spool ack: the restarted publisher appends the id again
    append_leaves(log.store, log.day, [LeafEntry(log.envs[1].envelope_id(), log.envs[1].envelope_id())], None)
    assert write_checkpoint(log.store, log.day, log.private, retention=None) is not None
    single = verify_request(log.store, log.envs[1].request_id, log.public)
    assert single.ok, messages(single)
    assert f"  leaf: 1 of day={log.day} ({N + 1} leaves)" in single.lines  # the first occurrence is the canonical one
    ranged = verify_range(log.store, log.day, log.public)
    assert ranged.ok, messages(ranged)
    assert f"duplicate: leaf {N} repeats leaf 1 (at-least-once publishing)" in messages(ranged)
    assert any("consistent: size 6 -> 7" in line for line in ranged.lines)


def test_an_expired_envelope_is_reported_as_expired_not_deleted(log: Log) -> None:
    from capture.audit.retention import ExpiryReport
    from schemas.layout import EXPIRY_PREFIX

    key, eid = log.key(4), log.envs[4].envelope_id()
    log.client.delete_object(Bucket=log.bucket, Key=key)
    entry = {"key": key, "version_id": "null", "envelope_id": eid, "retain_until": "2026-01-01T00:00:00Z"}
    report = ExpiryReport(datetime.now(UTC), False, deleted=[entry])
    assert log.store.put_new(f"{EXPIRY_PREFIX}test-{uuid.uuid4().hex}.json", report.to_json())
    verdict = verify_range(log.store, log.day, log.public)
    assert verdict.ok, messages(verdict)
    assert f"expired: leaf 4 (envelope id {eid}) was deleted by an expiry run" in messages(verdict)
