"""Checkpoints of the Merkle log, reconcile, and the signing keys (moto S3; the real-stack tests are in
*_stack.py)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from capture.audit.checkpoint import list_checkpoints, reconcile, verified_heads, write_checkpoint
from capture.audit.errors import AuditError, InconsistentLogError
from capture.audit.signing_keys import keygen, load_private, load_public, public_of
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import append_leaves, read_leaves
from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from schemas.layout import checkpoint_key, leaves_key
from schemas.merkle import LeafEntry, merkle_root, sign_checkpoint
from schemas.note import VerifierKey, parse_note, verifies
from tests.factories import FIXED_TIME, envelope
from tests.moto_s3 import capture_settings, moto_client, moto_server

DAY = FIXED_TIME.strftime("%Y-%m-%d")


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"log-{uuid.uuid4().hex[:12]}"
    moto_client(moto_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def store(moto_endpoint: str, bucket: str) -> AuditStore:
    return AuditStore(moto_client(moto_endpoint), bucket)


@pytest.fixture
def settings(moto_endpoint: str, bucket: str, tmp_path: Path) -> CaptureSettings:
    return capture_settings(moto_endpoint, bucket, tmp_path / "spool", retention_days=0)


def outgoing(seq: int, **overrides: Any) -> Outgoing:
    return Outgoing.from_entry(SpoolEntry(seq, envelope(**overrides).canonical()))


def test_a_broken_log_is_not_signed(store: AuditStore) -> None:
    store.put_new(leaves_key(DAY, 0), b"\x01" * 32)
    store.put_new(leaves_key(DAY, 5), b"\x02" * 40)
    with pytest.raises(AuditError, match="broken"):
        write_checkpoint(store, DAY, load_private_fresh(), retention=None)


def load_private_fresh() -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    return Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def test_checkpoint_signs_the_whole_log_once_per_size(store: AuditStore) -> None:
    private = load_private_fresh()
    ids = [envelope(request_id=f"req-cp-{i}").envelope_id() for i in range(3)]
    append_leaves(store, DAY, [LeafEntry(i, i) for i in ids], None)
    now = datetime(2026, 11, 29, tzinfo=UTC)
    cp = write_checkpoint(store, DAY, private, retention=None, key_name="bank.example/audit", now=now)
    assert cp is not None
    assert cp.tree_size == 3
    root = merkle_root([LeafEntry(i, i).data() for i in ids])
    assert cp.root_hash == root.hex()
    stored = store.get(f"audit/checkpoints/day={DAY}/000000000003.checkpoint")
    assert stored is not None
    note = parse_note(stored)  # a C2SP checkpoint: origin, size, base64 root, one Ed25519 signature line
    assert note.text == f"bank.example/audit/day={DAY}\n3\n{base64.b64encode(root).decode()}\n"
    assert verifies(note, VerifierKey("bank.example/audit", public_of(private)))
    assert write_checkpoint(store, DAY, private, retention=None, key_name="bank.example/audit") is None


def test_a_day_with_a_json_checkpoint_gets_a_c2sp_one_and_both_verify(store: AuditStore) -> None:
    private = load_private_fresh()
    ids = [envelope(request_id=f"req-old-{i}").envelope_id() for i in range(2)]
    append_leaves(store, DAY, [LeafEntry(i, i) for i in ids], None)
    root = merkle_root([LeafEntry(i, i).data() for i in ids])
    old = sign_checkpoint(private, f"day={DAY}", 2, root, datetime(2026, 11, 29, tzinfo=UTC))
    store.put_new(checkpoint_key(DAY, 2), old.canonical())
    cp = write_checkpoint(store, DAY, private, retention=None)
    assert cp is not None
    assert (cp.tree_size, cp.c2sp) == (2, True)
    heads, problems = verified_heads(list_checkpoints(store, DAY), DAY, public_of(private))
    assert problems == []
    assert [(h.tree_size, h.c2sp, h.root_hash) for h in heads] == [(2, True, root.hex()), (2, False, root.hex())]


def test_a_rewritten_or_truncated_log_is_not_signed(store: AuditStore) -> None:
    private = load_private_fresh()
    ids = [envelope(request_id=f"req-rw-{i}").envelope_id() for i in range(4)]
    append_leaves(store, DAY, [LeafEntry(i, i) for i in ids[:2]], None)
    assert write_checkpoint(store, DAY, private, retention=None) is not None
    store.client.delete_object(Bucket=store.bucket, Key=leaves_key(DAY, 0))  # rewrite the signed prefix
    append_leaves(store, DAY, [LeafEntry(i, i) for i in [ids[1], ids[0], ids[2]]], None)
    with pytest.raises(InconsistentLogError, match="not consistent with checkpoint"):
        write_checkpoint(store, DAY, private, retention=None)
    store.client.delete_object(Bucket=store.bucket, Key=leaves_key(DAY, 0))
    append_leaves(store, DAY, [LeafEntry(ids[0], ids[0])], None)
    with pytest.raises(InconsistentLogError, match="truncated"):
        write_checkpoint(store, DAY, private, retention=None)
    assert [k for k, _ in store.list_keys(f"audit/checkpoints/day={DAY}/")] == [
        f"audit/checkpoints/day={DAY}/000000000002.checkpoint"
    ]


async def test_reconcile_appends_stored_but_unlogged_envelopes(settings: CaptureSettings, store: AuditStore) -> None:
    sink = S3Sink(settings)  # stored without the log: the crash window between put and append
    items = [outgoing(1, request_id="req-rec-1"), outgoing(2, request_id="req-rec-2")]
    await sink.publish(items)
    await sink.close()
    append_leaves(store, DAY, [LeafEntry(items[0].envelope_id, items[0].envelope_id)], None)
    assert reconcile(store, DAY, retention=None, dry_run=True) == [items[1].envelope_id]
    assert read_leaves(store, DAY).ids == [items[0].envelope_id]
    assert reconcile(store, DAY, retention=None) == [items[1].envelope_id]
    assert read_leaves(store, DAY).ids == [items[0].envelope_id, items[1].envelope_id]
    assert read_leaves(store, DAY).entries[1].object_sha256 == items[1].envelope_id  # the bytes stored, hashed
    assert reconcile(store, DAY, retention=None) == []


def test_keys_from_pem_files_and_base64(tmp_path: Path) -> None:
    private_path = tmp_path / "signing.pem"
    public_path, public_b64 = keygen(private_path)
    assert private_path.stat().st_mode & 0o777 == 0o600
    private = load_private(str(private_path))
    assert public_of(private) == load_public(str(public_path)) == base64.b64decode(public_b64)
    assert load_private(base64.b64encode(private).decode()) == private
    assert load_public(public_b64) == base64.b64decode(public_b64)
    with pytest.raises(AuditError, match="cannot create"):
        keygen(private_path)  # never overwrites a key
    with pytest.raises(AuditError, match="32"):
        load_public(base64.b64encode(b"short").decode())
