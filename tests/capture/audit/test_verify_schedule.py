"""The schedule as evidence, on the audit side (moto S3): the real shipper logs each segment it stores, the
checkpointer signs every engine's schedule log beside the day logs, and ``reprolane audit verify --schedule``
(`capture.audit.verify.verify_schedule_log`) holds every stored segment to its leaf: a segment changed, deleted or
never logged is named. The bundle's side of the proof: tests/infra/reexecution/test_window.py; the real stack:
tests/infra/reexecution/test_reexecute_stack.py."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from capture.audit.checkpointer import Checkpointer
from capture.audit.signing_keys import public_of
from capture.audit.store import AuditStore
from capture.audit.verify import verify_schedule_log
from schemas.layout import schedule_log, schedule_segment_key
from tests.capture.audit.test_checkpoint import load_private_fresh
from tests.capture.schedule.test_shipper import _shipper, _two_engines, s3  # noqa: F401
from tests.schedule_segments import FakeEngine, encode

KEY = "test.example/audit"


@pytest.fixture
async def shipped(s3: Any, tmp_path: Path) -> tuple[Any, AuditStore, bytes]:  # noqa: F811
    """Two engines' segments shipped by the real shipper, their logs signed by the checkpointer: (client, store,
    the signing key)."""
    bucket = f"sched-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    shipper, _ = _shipper(s3, bucket, tmp_path)
    _two_engines(shipper.directory)
    assert await shipper.ship_pending() == 3
    store, private = AuditStore(s3, bucket), load_private_fresh()
    report = Checkpointer(store, private, key_name=KEY, retention=None).run_round()
    assert sorted(h.key.split("/")[3] for h in report.signed) == ["engine=eng-a", "engine=eng-b"]
    return s3, store, private


def test_every_segment_verifies_against_its_signed_leaf(shipped: tuple[Any, AuditStore, bytes]) -> None:
    _, store, private = shipped
    verdict = verify_schedule_log(store, "eng-a", public_of(private))
    assert verdict.ok, verdict.findings
    assert "  leaves: 2; segments: 2" in verdict.lines
    assert verdict.subject == schedule_log("eng-a")


def _kinds(store: AuditStore, private: bytes) -> set[str]:
    return verify_schedule_log(store, "eng-a", public_of(private)).kinds()


def test_a_changed_segment_is_modified(shipped: tuple[Any, AuditStore, bytes]) -> None:
    client, store, private = shipped
    other = FakeEngine("eng-a")  # a valid segment of the same engine, other shapes
    other.request("chatcmpl-rl-9", prompt_tokens=7)
    other.run()
    client.put_object(Bucket=store.bucket, Key=schedule_segment_key("eng-a", 1), Body=encode(other.take()[1:]))
    assert _kinds(store, private) == {"modified"}
    client.put_object(Bucket=store.bucket, Key=schedule_segment_key("eng-a", 1), Body=b"junk\n")
    assert _kinds(store, private) == {"modified"}


def test_a_deleted_and_an_unlogged_segment_are_named(shipped: tuple[Any, AuditStore, bytes]) -> None:
    client, store, private = shipped
    data = client.get_object(Bucket=store.bucket, Key=schedule_segment_key("eng-a", 1))["Body"].read()
    client.delete_object(Bucket=store.bucket, Key=schedule_segment_key("eng-a", 1))
    assert _kinds(store, private) == {"deleted"}
    client.put_object(Bucket=store.bucket, Key=schedule_segment_key("eng-a", 1), Body=data)
    client.put_object(Bucket=store.bucket, Key=schedule_segment_key("eng-a", 5), Body=data)
    assert _kinds(store, private) == {"inserted"}
