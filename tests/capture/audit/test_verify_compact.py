"""Compact envelope objects verify by the canonical bytes they decode to, as JSON objects verify by theirs; a
forged or corrupt compact object is ``modified``; the Merkle-log writer commits to the canonical bytes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest

from capture.audit.checkpoint import reconcile
from capture.audit.store import AuditStore
from capture.audit.verify import check_object
from capture.ledger.merkle_log import read_leaves, stored_digest
from capture.publishing.outgoing import Outgoing
from capture.spool import SpoolEntry
from schemas import sha256_hex
from schemas.envelope_compact import encode_compact, is_compact
from schemas.layout import capture_day, envelope_key
from schemas.merkle import LeafEntry
from tests.factories import envelope
from tests.moto_s3 import moto_server


@pytest.fixture(scope="module")
def store() -> Iterator[AuditStore]:
    with moto_server() as endpoint:
        client: Any = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s"
        )
        bucket = f"compact-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        yield AuditStore(client, bucket)


@dataclass
class Stored:
    key: str
    envelope_id: str
    canonical: bytes
    compact: bytes


def stored(store: AuditStore, *, compact: bool = True) -> Stored:
    env = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}")
    canonical = env.canonical()
    packed = encode_compact(canonical)
    assert packed is not None
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    store.client.put_object(Bucket=store.bucket, Key=key, Body=packed if compact else canonical)
    return Stored(key, env.envelope_id(), canonical, packed)


def test_json_and_compact_objects_both_verify_against_their_leaf(store: AuditStore) -> None:
    for compact in (False, True):
        obj = stored(store, compact=compact)
        leaf = LeafEntry(obj.envelope_id, obj.envelope_id)  # what the writer commits to for either form
        assert check_object(store, obj.key, leaf) is None
        assert check_object(store, obj.key, LeafEntry(obj.envelope_id)) is None  # format 1 / no leaf: by the id
        assert check_object(store, obj.key) is None


def test_a_forged_compact_object_is_modified(store: AuditStore) -> None:
    """Someone with write access re-encodes an edited record compact under the original's key."""
    obj = stored(store)
    forged_canonical = obj.canonical.replace(b"Paris", b"Lyon!")
    forged = encode_compact(forged_canonical)
    assert forged is not None
    store.client.put_object(Bucket=store.bucket, Key=obj.key, Body=forged)
    for leaf in (LeafEntry(obj.envelope_id, obj.envelope_id), None):
        finding = check_object(store, obj.key, leaf)
        assert finding is not None
        assert finding.kind == "modified"
        assert f"hash to {sha256_hex(forged_canonical)} once decoded from compact" in finding.message
        assert "an envelope of request" in finding.message


def test_a_corrupt_compact_object_is_modified(store: AuditStore) -> None:
    obj = stored(store)
    store.client.put_object(Bucket=store.bucket, Key=obj.key, Body=obj.compact[:-7])
    finding = check_object(store, obj.key, LeafEntry(obj.envelope_id, obj.envelope_id))
    assert finding is not None
    assert finding.kind == "modified"
    assert "bytes of a compact envelope that do not decode (truncated or overwritten)" in finding.message


class _NoStore:
    def get(self, key: str) -> bytes | None:
        raise AssertionError("a plaintext record is never read back")

    def put_new(self, key: str, body: bytes, retain_until: datetime | None) -> bool:
        raise AssertionError("not called")

    def list_keys(self, prefix: str) -> list[tuple[str, int]]:
        raise AssertionError("not called")


def test_the_log_writer_commits_a_compact_record_to_its_canonical_bytes() -> None:
    env = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}")
    item = Outgoing.from_entry(SpoolEntry(1, env.canonical()))
    packed = item.compacted()
    assert is_compact(packed.payload)
    assert packed.envelope_id == item.envelope_id == env.envelope_id()
    assert stored_digest(_NoStore(), packed) == env.envelope_id() == stored_digest(_NoStore(), item)


def test_reconcile_logs_a_compact_object_by_its_canonical_bytes(store: AuditStore) -> None:
    """``reprolane audit reconcile`` appends what a stored-but-unlogged object is: for a compact one, what the
    writer would have logged (its id), so verify then passes."""
    captured = datetime(2400, 1, 1, tzinfo=UTC) + timedelta(days=uuid.uuid4().int % 100_000)
    env = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=captured)
    packed = encode_compact(env.canonical())
    assert packed is not None
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    store.client.put_object(Bucket=store.bucket, Key=key, Body=packed)
    day = capture_day(captured)
    assert reconcile(store, day, retention=None) == [env.envelope_id()]
    (leaf,) = read_leaves(store, day).first_entries().values()
    assert leaf == LeafEntry(env.envelope_id(), env.envelope_id())
    assert check_object(store, key, leaf) is None
