"""Evidence bundles (moto S3): export, then offline verification that names what was tampered with, by part
class (envelope bytes, proof, checkpoint, signature, replay result), and never trusts a key from the bundle.
The real-stack run (a request through the sidecar, the checkpointer service, the CLI) is test_evidence_stack.py."""

from __future__ import annotations

import base64
import io
import json
import socket
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from capture.audit.checkpoint import write_checkpoint
from capture.audit.evidence.bundle import ENVELOPE, MANIFEST, PROOF, parse_manifest, write_zip
from capture.audit.evidence.export import EvidenceError, export_bundle
from capture.audit.evidence.verify import PinnedKey, verify_bundle
from capture.audit.signing_keys import public_of
from capture.audit.store import AuditStore
from capture.audit.verify import verify_request
from capture.ledger.merkle_log import append_leaves
from capture.settings import CaptureSettings
from infra.cli.root import build_app
from schemas import Envelope, envelope_bytes, sha256_hex
from schemas.envelope_compact import encode_compact, is_compact
from schemas.layout import checkpoint_key, index_body, replay_key, request_index_key
from schemas.merkle import LeafEntry, leaf_hash, merkle_root, sign_checkpoint, verify_inclusion
from schemas.note import (
    VerifierKey,
    key_fingerprint,
    parse_note,
    parse_tlog_proof,
    parse_tree_head,
    sign_note,
    verifies,
)
from schemas.replay import replay_result_id
from tests.capture.audit.support import publish_through_s3
from tests.capture.audit.test_checkpoint import load_private_fresh
from tests.capture.audit.test_verify_sealed import sealed_bytes
from tests.factories import FIXED_TIME, envelope
from tests.moto_s3 import moto_client, moto_server
from tests.replayer.test_store import replay_result

KEY_NAME = "bank.example/audit"
DAY = FIXED_TIME.strftime("%Y-%m-%d")


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@dataclass
class Logged:
    store: AuditStore
    envs: list[Envelope]
    private: bytes

    @property
    def pin(self) -> PinnedKey:
        return PinnedKey(public_of(self.private))

    def export(self, i: int = 1) -> bytes:
        return export_bundle(self.store, self.envs[i].request_id, self.private, KEY_NAME).bundle


async def published(moto_endpoint: str, spool_dir: Path, envs: list[Envelope]) -> AuditStore:
    """`envs` stored in a fresh moto bucket through the real publisher, with the Merkle log."""
    bucket = f"ev-{uuid.uuid4().hex[:12]}"
    moto_client(moto_endpoint).create_bucket(Bucket=bucket)
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=spool_dir,
        s3_endpoint=moto_endpoint,
        s3_access_key="k",
        s3_secret_key="s",
        s3_bucket=bucket,
        retention_days=0,
        audit_log=True,
    )
    await publish_through_s3(settings, envs, spool_dir)
    return AuditStore(moto_client(moto_endpoint), bucket)


@pytest.fixture
async def logged(moto_endpoint: str, tmp_path: Path) -> Logged:
    envs = [envelope(request_id=f"req-ev-{uuid.uuid4().hex[:8]}-{i}") for i in range(3)]
    store = await published(moto_endpoint, tmp_path / "spool", envs)
    result = replay_result(envs[1].envelope_id(), envs[1].request_id)
    key = replay_key(
        envs[1].envelope_id(),
        replay_result_id(envs[1].envelope_id(), result.event.lane_fingerprint_sha256),
        envs[1].captured_at,
    )
    store.put_new(key, result.model_dump_json().encode())
    private = load_private_fresh()
    assert write_checkpoint(store, DAY, private, retention=None, key_name=KEY_NAME) is not None
    return Logged(store, envs, private)


def members_of(bundle: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def tampered(bundle: bytes, name: str, change: Callable[[bytes], bytes]) -> bytes:
    """The bundle with one member changed and rewritten as a valid zip (what an attacker would hand over)."""
    members = members_of(bundle)
    changed = change(members[name])
    assert changed != members[name]
    members[name] = changed
    return write_zip(members, datetime(2026, 12, 1, tzinfo=UTC))


def test_an_exported_bundle_verifies_offline_with_the_pinned_key(
    logged: Logged, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = logged.export()
    members = members_of(bundle)
    assert set(members) >= {
        MANIFEST,
        ENVELOPE,
        PROOF,
        "summary.html",
        "fingerprints.json",
        "retention.json",
        "key.vkey",
    }
    assert envelope_bytes(members[ENVELOPE]) == logged.envs[1].canonical()  # the stored (compact) bytes
    assert [n for n in members if n.startswith("replays/")] != []

    def no_network(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("verify opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    report = verify_bundle(bundle, logged.pin)
    assert report.ok, [p.line() for p in report.problems]
    assert report.subject == f"request {logged.envs[1].request_id}"
    assert any("inclusion: leaf 1 of 3" in line for line in report.lines)
    fingerprint = PinnedKey(fingerprint=key_fingerprint(public_of(logged.private)))
    assert verify_bundle(bundle, fingerprint).ok
    vkey = PinnedKey(public_of(logged.private), KEY_NAME)
    assert verify_bundle(bundle, vkey).ok


def test_the_proof_is_a_c2sp_tlog_proof_any_verifier_can_check(logged: Logged) -> None:
    """What an outside tool does with proof.tlog-proof, the vkey and the record: nothing of reprolane's but
    the spec's steps."""
    members = members_of(logged.export())
    proof = parse_tlog_proof(members[PROOF])
    note = parse_note(proof.checkpoint)
    vkey = VerifierKey(KEY_NAME, public_of(logged.private))
    assert verifies(note, vkey)
    head = parse_tree_head(note.text)
    assert head.origin == f"{KEY_NAME}/day={DAY}"
    leaf = bytes.fromhex(logged.envs[1].envelope_id()) * 2  # format 2: id || sha256(bytes), equal for plaintext
    assert proof.extra == leaf
    assert verify_inclusion(leaf_hash(leaf), proof.index, head.tree_size, proof.path, head.root_hash)
    manifest = parse_manifest(parse_note(members[MANIFEST]).text)
    assert manifest.leaf_index == 1
    assert "<script" not in members["summary.html"].decode()
    assert logged.envs[1].request_id in members["summary.html"].decode()


def _flip_b64_line(data: bytes, line_no: int) -> bytes:
    lines = data.split(b"\n")
    raw = bytearray(base64.b64decode(lines[line_no]))
    raw[-1] ^= 1
    lines[line_no] = base64.b64encode(bytes(raw))
    return b"\n".join(lines)


def _path_line(data: bytes) -> int:
    return next(i for i, line in enumerate(data.split(b"\n")) if line.startswith(b"index ")) + 1


def _root_line(data: bytes) -> int:
    return data.split(b"\n").index(b"") + 3  # the checkpoint's third line, after the blank one


def _signature(data: bytes) -> bytes:
    head, _, sig = data.rpartition(b" ")
    raw = bytearray(base64.b64decode(sig.strip()))
    raw[10] ^= 1
    return head + b" " + base64.b64encode(bytes(raw)) + b"\n"


def _lyon(stored: bytes) -> bytes:
    """The stored envelope with its answer changed, stored again in its own encoding (a forger's object)."""
    changed = envelope_bytes(stored).replace(b"Paris", b"Lyon!")
    assert changed != envelope_bytes(stored)
    return (encode_compact(changed) or changed) if is_compact(stored) else changed


def _verdict(data: bytes) -> bytes:
    doc = json.loads(data)
    doc["event"]["verdict"] = "token"
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("member", "change", "part_class", "says"),
    [
        (ENVELOPE, _lyon, "envelope", "the log committed to"),
        (PROOF, lambda b: _flip_b64_line(b, _path_line(b)), "proof", "does not lead from leaf 1"),
        (PROOF, lambda b: b.replace(b"index 1\n", b"index 2\n"), "proof", "does not lead from leaf 2"),
        (PROOF, lambda b: _flip_b64_line(b, _root_line(b)), "checkpoint", "size or root was changed"),
        (PROOF, lambda b: b.replace(b"\n3\n", b"\n4\n"), "checkpoint", "size or root was changed"),
        (PROOF, _signature, "signature", "checkpoint's signature fails"),
        ("replays/", _verdict, "replay_result", "the signed manifest lists"),
    ],
    ids=["envelope-bytes", "proof-path", "proof-index", "checkpoint-root", "checkpoint-size", "signature", "replay"],
)
def test_a_tampered_part_is_named(
    logged: Logged, member: str, change: Callable[[bytes], bytes], part_class: str, says: str
) -> None:
    bundle = logged.export()
    name = next(n for n in members_of(bundle) if n.startswith(member))
    report = verify_bundle(tampered(bundle, name, change), logged.pin)
    assert not report.ok
    assert report.classes() == {part_class}, [p.line() for p in report.problems]
    assert any(says in p.message for p in report.problems), [p.line() for p in report.problems]


def test_a_manifest_resigned_by_another_key_and_a_wrong_pin_are_refused(logged: Logged) -> None:
    bundle = logged.export()
    members = members_of(bundle)
    other = load_private_fresh()
    text = parse_note(members[MANIFEST]).text
    members[MANIFEST] = sign_note(text, KEY_NAME, other).encode()
    members["key.vkey"] = (VerifierKey(KEY_NAME, public_of(other)).encode() + "\n").encode()
    forged = write_zip(members, datetime(2026, 12, 1, tzinfo=UTC))
    assert verify_bundle(forged, logged.pin).classes() == {"signature"}
    pinned = PinnedKey(fingerprint=key_fingerprint(public_of(logged.private)))
    assert verify_bundle(forged, pinned).classes() == {"key"}  # the bundle's own key is never trusted
    wrong = verify_bundle(bundle, PinnedKey(public_of(other)))
    assert wrong.classes() == {"signature"}
    assert {p.message.split(":")[0] for p in wrong.problems} >= {
        "the manifest's signature is not signed by the pinned key"
    }


async def test_export_needs_a_c2sp_checkpoint_covering_the_leaf(moto_endpoint: str, tmp_path: Path) -> None:
    env = envelope(request_id=f"req-old-{uuid.uuid4().hex[:8]}")
    store = await published(moto_endpoint, tmp_path / "s", [env])
    private = load_private_fresh()
    with pytest.raises(EvidenceError, match="no C2SP checkpoint"):
        export_bundle(store, env.request_id, private, KEY_NAME)
    old = sign_checkpoint(private, f"day={DAY}", 1, merkle_root([bytes.fromhex(env.envelope_id()) * 2]), FIXED_TIME)
    store.put_new(checkpoint_key(DAY, 1), old.canonical())  # a JSON checkpoint of before: read, not exported
    with pytest.raises(EvidenceError, match="run `reprolane audit checkpoint`"):
        export_bundle(store, env.request_id, private, KEY_NAME)
    legacy = verify_request(store, env.request_id, public_of(private))  # today's JSON checkpoints still verify
    assert legacy.ok, [f.message for f in legacy.findings]
    assert any("signature: Ed25519 key" in line for line in legacy.lines)
    assert write_checkpoint(store, DAY, private, retention=None, key_name=KEY_NAME) is not None
    both = verify_request(store, env.request_id, public_of(private))
    assert both.ok, [f.message for f in both.findings]
    assert any(f"C2SP note, key {KEY_NAME}+" in line for line in both.lines)
    assert verify_bundle(
        export_bundle(store, env.request_id, private, KEY_NAME).bundle, PinnedKey(public_of(private))
    ).ok


def test_the_verify_command_exits_by_the_verdict(logged: Logged, tmp_path: Path) -> None:
    bundle = logged.export()
    good, bad = tmp_path / "good.zip", tmp_path / "bad.zip"
    good.write_bytes(bundle)
    bad.write_bytes(tampered(bundle, ENVELOPE, _lyon))
    pub = tmp_path / "audit.pub"
    pub.write_text(base64.b64encode(public_of(logged.private)).decode())
    app = build_app()
    runner = CliRunner()
    ok = runner.invoke(app, ["audit", "evidence", "verify", str(good), "--key", str(pub)])
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith(f"verified request {logged.envs[1].request_id}")
    failed = runner.invoke(app, ["audit", "evidence", "verify", str(bad), "--key", str(pub)])
    assert failed.exit_code == 1
    assert failed.output.startswith(f"FAILED request {logged.envs[1].request_id}: envelope bytes: ")
    vkey = VerifierKey(KEY_NAME, public_of(logged.private)).encode()
    assert runner.invoke(app, ["audit", "evidence", "verify", str(good), "--key", vkey]).exit_code == 0
    assert runner.invoke(app, ["audit", "evidence", "verify", str(good)]).exit_code == 2  # no key: never the bundle's
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"not a zip")
    assert runner.invoke(app, ["audit", "evidence", "verify", str(junk), "--key", vkey]).exit_code == 2


def test_a_sealed_envelope_is_exported_sealed_and_verifies(logged: Logged) -> None:
    overrides = {"request_id": f"req-sealed-{uuid.uuid4().hex[:8]}", "tenant": "acme-bank"}
    env = envelope(**overrides)
    key, sealed = sealed_bytes(**overrides)
    store = logged.store
    store.put_new(key, sealed)
    store.put_new(request_index_key(env.request_id), index_body(env.envelope_id(), key, env.tenant, env.captured_at))
    append_leaves(store, DAY, [LeafEntry(env.envelope_id(), sha256_hex(sealed))], None)
    assert write_checkpoint(store, DAY, logged.private, retention=None, key_name=KEY_NAME) is not None
    bundle = export_bundle(store, env.request_id, logged.private, KEY_NAME).bundle
    members = members_of(bundle)
    assert members[ENVELOPE] == sealed
    assert b"Paris" not in b"".join(members.values())  # nothing of the plaintext leaves the ciphertext
    assert "sealed" in members["summary.html"].decode()
    assert verify_bundle(bundle, logged.pin).ok
    flipped = tampered(bundle, ENVELOPE, lambda b: b.replace(b'"ciphertext":"', b'"ciphertext":"A', 1))
    assert verify_bundle(flipped, logged.pin).classes() == {"envelope"}
