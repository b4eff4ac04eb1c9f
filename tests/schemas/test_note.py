"""C2SP signed notes, checkpoints and tlog proofs against the published vectors: the examples of
c2sp.org/signed-note, golang.org/x/mod/sumdb/note's own tests (a note signed with their known key must come out
byte for byte), and a checkpoint signed by sum.golang.org under its published key."""

from __future__ import annotations

import base64

import pytest

from schemas.errors import ContractError
from schemas.note import (
    Note,
    TlogProof,
    TreeHead,
    VerifierKey,
    ed25519_key_id,
    key_fingerprint,
    key_named_in,
    parse_fingerprint,
    parse_note,
    parse_tlog_proof,
    parse_tree_head,
    parse_vkey,
    sign_checkpoint_note,
    sign_note,
    verifies,
)

# golang.org/x/mod/sumdb/note note_test.go: TestSign, TestOpen
GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
GO_PETER_SIG = (
    "\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)
GO_ENOCH_SIG = (
    "\u2014 EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox33WWd1RvMc+QQ=\n"
)
# c2sp.org/signed-note, "Example"
C2SP_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
C2SP_NOTE = (
    "This is an example message.\n\n\u2014 example.com/foo "
    "Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
)
# A checkpoint of the Go checksum database, signed by sum.golang.org (its published vkey).
SUMDB_VKEY = "sum.golang.org+033de0ae+Ac4zctda0e5eza+HJyk9SxEdh+s3Ux18htTTAD8OuAn8"
SUMDB_CHECKPOINT = (
    "go.sum database tree\n63096908\n8lHrQPRYe4KT4WQ9/Qk8/taKnD6IRHbFgfN7vQE2Y54=\n\n\u2014 sum.golang.org "
    "Az3gri/oVBN1jAhNZ/iS+W31psFAWRT20/GyrhpU6taFwulQGetBkH5S7wpGXdS935jiIGiUUAXBVHzT/P6fYhqAmAk=\n"
)


def go_seed(skey: str) -> bytes:
    """The Ed25519 seed of a Go ``PRIVATE+KEY+name+id+base64(0x01 || seed)`` signer key."""
    material = base64.b64decode(skey.split("+", 4)[4])
    assert material[0] == 1
    return material[1:]


def test_a_note_signed_with_gos_known_key_is_byte_for_byte_gos() -> None:
    note = sign_note(GO_TEXT, "PeterNeumann", go_seed(GO_SKEY))
    assert note.encode().decode() == GO_TEXT + "\n" + GO_PETER_SIG
    assert VerifierKey("PeterNeumann", parse_vkey(GO_VKEY).public_raw).encode() == GO_VKEY


def test_the_published_notes_verify_under_their_vkeys() -> None:
    assert verifies(parse_note(C2SP_NOTE.encode()), parse_vkey(C2SP_VKEY))
    peter = parse_vkey(GO_VKEY)
    both = parse_note((GO_TEXT + "\n" + GO_PETER_SIG + GO_ENOCH_SIG).encode())
    assert both.text == GO_TEXT
    assert [s.name for s in both.signatures] == ["PeterNeumann", "EnochRoot"]
    assert verifies(both, peter)  # an unknown key's signature is ignored
    assert not verifies(both, parse_vkey(C2SP_VKEY))  # a key that did not sign it


def test_a_checkpoint_signed_by_sum_golang_org_verifies() -> None:
    note = parse_note(SUMDB_CHECKPOINT.encode())
    assert verifies(note, parse_vkey(SUMDB_VKEY))
    head = parse_tree_head(note.text)
    assert head.origin == "go.sum database tree"
    assert head.tree_size == 63096908
    assert head.text() == note.text
    changed = SUMDB_CHECKPOINT.replace("63096908", "63096909")
    assert not verifies(parse_note(changed.encode()), parse_vkey(SUMDB_VKEY))


def test_key_ids_follow_the_spec() -> None:
    key = parse_vkey(C2SP_VKEY)
    assert ed25519_key_id("example.com/foo", key.public_raw) == 0x530D903A
    assert key_named_in(parse_note(C2SP_NOTE.encode()), key.public_raw) == key
    assert key_fingerprint(key.public_raw) == parse_fingerprint(key_fingerprint(key.public_raw).upper()[7:])


@pytest.mark.parametrize(
    "message",
    [
        GO_TEXT,
        GO_TEXT + "\n",
        GO_TEXT + "\n" + GO_PETER_SIG[:-1],
        "\x01" + GO_TEXT + "\n" + GO_PETER_SIG,
        GO_TEXT + "\n" + GO_PETER_SIG.replace("PeterNeumann", "Bad Name")[:-1],
        GO_TEXT + "\n" + GO_PETER_SIG + "Unexpected line.\n",
        GO_TEXT + "\n" + GO_PETER_SIG * 101,
    ],
)
def test_malformed_notes_are_refused(message: str) -> None:
    """golang.org/x/mod/sumdb/note TestOpen's bad messages (and too many signatures)."""
    with pytest.raises(ContractError):
        parse_note(message.encode())
    with pytest.raises(ContractError):
        parse_note(b"\xff" + (GO_TEXT + "\n" + GO_PETER_SIG).encode())


@pytest.mark.parametrize(
    "vkey",
    [
        GO_VKEY[:-1],
        GO_VKEY.replace("c74f20a3", "c74f20a4"),  # an id its name and key do not give
        "PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY==",  # wrong length
        "PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # unknown algorithm
        "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    ],
)
def test_mangled_vkeys_are_refused(vkey: str) -> None:
    with pytest.raises(ContractError):
        parse_vkey(vkey)


def test_checkpoint_text_is_exactly_three_lines() -> None:
    head = TreeHead("reprolane.test/audit/day=2026-12-01", 7, bytes(range(32)))
    assert parse_tree_head(head.text()) == head
    for bad in [
        "o\n07\n" + base64.b64encode(bytes(32)).decode() + "\n",  # leading zero
        "o\n7\n" + base64.b64encode(bytes(31)).decode() + "\n",
        "\n7\n" + base64.b64encode(bytes(32)).decode() + "\n",
        head.text() + "extension\n",
    ]:
        with pytest.raises(ContractError):
            parse_tree_head(bad)


def test_a_tlog_proof_round_trips_in_the_spec_layout() -> None:
    seed = go_seed(GO_SKEY)
    checkpoint = sign_checkpoint_note(TreeHead("example.com/log", 3, bytes(32)), "example.com/log", seed)
    proof = TlogProof(2, (bytes([1]) * 32, bytes([2]) * 32), checkpoint, extra=b"leaf")
    text = proof.encode().decode()
    assert text.startswith("c2sp.org/tlog-proof@v1\nextra bGVhZg==\nindex 2\n")
    assert text.split("\n\n", 1)[1] == checkpoint.decode()
    assert parse_tlog_proof(proof.encode()) == proof
    bare = TlogProof(0, (), checkpoint)
    assert parse_tlog_proof(bare.encode()) == bare
    for bad in [b"c2sp.org/tlog-proof@v2\nindex 0\n\n" + checkpoint, b"c2sp.org/tlog-proof@v1\nindex 01\n\n"]:
        with pytest.raises(ContractError):
            parse_tlog_proof(bad)
    assert isinstance(parse_note(checkpoint), Note)
