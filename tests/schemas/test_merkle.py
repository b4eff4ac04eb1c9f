"""RFC 9162 Merkle math and signed checkpoints, checked against plain independent computations."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest

from schemas.errors import ContractError
from schemas.merkle import (
    Checkpoint,
    consistency_proof,
    decode_checkpoint,
    inclusion_proof,
    leaf_data,
    leaf_hash,
    merkle_root,
    root_from_hashes,
    sign_checkpoint,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)

# The RFC 6962 test leaves used by certificate-transparency implementations.
CT_LEAVES = [
    bytes.fromhex(h)
    for h in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657", "606162636465666768696a6b6c6d6e6f")
]


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def plain_root(leaves: list[bytes]) -> bytes:
    """Bottom-up, level by level, an odd last node promoted unchanged: equal to RFC 6962's MTH."""
    if not leaves:
        return sha(b"")
    level = [sha(b"\x00" + d) for d in leaves]
    while len(level) > 1:
        nxt = [sha(b"\x01" + level[i] + level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def ids(n: int) -> list[bytes]:
    return [sha(f"envelope-{i}".encode()) for i in range(n)]


def test_leaf_and_node_hashes_are_domain_separated() -> None:
    a, b = b"a" * 32, b"b" * 32
    assert leaf_hash(a) == sha(b"\x00" + a)
    assert merkle_root([a, b]) == sha(b"\x01" + sha(b"\x00" + a) + sha(b"\x00" + b))
    h = [sha(b"\x00" + x) for x in (a, b, a)]
    assert merkle_root([a, b, a]) == sha(b"\x01" + sha(b"\x01" + h[0] + h[1]) + h[2])
    assert merkle_root([]) == sha(b"")


def test_ct_reference_vectors() -> None:
    assert merkle_root(CT_LEAVES[:1]).hex() == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    assert merkle_root(CT_LEAVES).hex() == "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"


@pytest.mark.parametrize("n", range(1, 17))
def test_root_matches_the_plain_bottom_up_computation(n: int) -> None:
    assert merkle_root(ids(n)) == plain_root(ids(n))


@pytest.mark.parametrize("n", range(1, 10))
def test_every_inclusion_proof_verifies_and_no_other_position_does(n: int) -> None:
    hashes = [leaf_hash(d) for d in ids(n)]
    root = root_from_hashes(hashes)
    for i in range(n):
        proof = inclusion_proof(hashes, i)
        assert verify_inclusion(hashes[i], i, n, proof, root)
        assert not verify_inclusion(hashes[i], i, n, proof, sha(b"other root"))
        assert not verify_inclusion(leaf_hash(b"x" * 32), i, n, proof, root)
        for j in range(n):
            if j != i and hashes[j] != hashes[i]:
                assert not verify_inclusion(hashes[i], j, n, proof, root)
        if proof:
            broken = [*proof[:-1], sha(proof[-1])]
            assert not verify_inclusion(hashes[i], i, n, broken, root)
            assert not verify_inclusion(hashes[i], i, n, proof[:-1], root)
        assert not verify_inclusion(hashes[i], i, n, [*proof, root], root)


@pytest.mark.parametrize("n", range(1, 10))
def test_every_consistency_proof_verifies_and_tampering_fails(n: int) -> None:
    leaves = ids(n)
    hashes = [leaf_hash(d) for d in leaves]
    new_root = root_from_hashes(hashes)
    for m in range(1, n + 1):
        old_root = root_from_hashes(hashes[:m])
        proof = consistency_proof(hashes, m)
        assert verify_consistency(m, n, old_root, new_root, proof), (m, n)
        assert not verify_consistency(m, n, sha(b"forged"), new_root, proof)
        if m < n:
            assert not verify_consistency(m, n, old_root, sha(b"forged"), proof)
            assert not verify_consistency(m, n, old_root, new_root, [])
            assert not verify_consistency(m, n, old_root, new_root, [*proof[:-1], sha(proof[-1])])
            # the old tree reordered: two leaves swapped inside the committed prefix
            if m >= 2:
                swapped = [hashes[1], hashes[0], *hashes[2:]]
                assert not verify_consistency(m, n, old_root, root_from_hashes(swapped), consistency_proof(swapped, m))
            # a leaf inserted inside the committed prefix
            inserted = [leaf_hash(b"i" * 32), *hashes]
            assert not verify_consistency(
                m, n + 1, old_root, root_from_hashes(inserted), consistency_proof(inserted, m)
            )


def test_proof_arguments_out_of_range_are_refused() -> None:
    hashes = [leaf_hash(d) for d in ids(3)]
    with pytest.raises(ValueError, match="outside"):
        inclusion_proof(hashes, 3)
    with pytest.raises(ValueError, match="old size"):
        consistency_proof(hashes, 0)
    assert not verify_inclusion(hashes[0], 5, 3, [], root_from_hashes(hashes))
    assert not verify_consistency(4, 3, b"", b"", [])


def test_leaf_data_is_the_raw_envelope_id() -> None:
    assert leaf_data("ab" * 32) == b"\xab" * 32
    with pytest.raises(ContractError, match="not 32 bytes"):
        leaf_data("abcd")
    with pytest.raises(ContractError, match="not hex"):
        leaf_data("zz" * 32)


def keypair() -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return private, key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def test_checkpoint_signature_round_trips_and_covers_every_field() -> None:
    private, public = keypair()
    issued = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    cp = sign_checkpoint(private, "day=2026-11-29", 5, merkle_root(ids(5)), issued)
    assert verify_checkpoint(cp, public)
    assert verify_checkpoint(decode_checkpoint(cp.canonical()), public)
    for change in (
        {"tree_size": 4},
        {"root_hash": "0" * 64},
        {"log_id": "day=2026-11-30"},
        {"issued_at": issued.replace(hour=1)},
    ):
        assert not verify_checkpoint(cp.model_copy(update=change), public), change
    _, other_public = keypair()
    assert not verify_checkpoint(cp, other_public)
    assert not verify_checkpoint(cp.model_copy(update={"signature": "not base64!"}), public)


def test_checkpoint_body_is_canonical_json_without_the_signature() -> None:
    private, _ = keypair()
    cp = sign_checkpoint(private, "partition=3", 0, merkle_root([]), datetime(2026, 1, 1, tzinfo=UTC))
    assert cp.signed_body() == (
        b'{"issued_at":"2026-01-01T00:00:00Z","key_id":"' + cp.key_id.encode() + b'","log_id":"partition=3",'
        b'"root_hash":"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",'
        b'"schema_version":"reprolane.checkpoint/1","tree_size":0}'
    )


def test_a_bad_checkpoint_names_its_field() -> None:
    with pytest.raises(ContractError, match="tree_size"):
        decode_checkpoint(
            b'{"log_id":"day=x","tree_size":-1,"root_hash":"'
            + b"0" * 64
            + b'","issued_at":"2026-01-01T00:00:00Z","key_id":"'
            + b"0" * 16
            + b'"}'
        )
    assert isinstance(Checkpoint.model_fields["signature"].default, str)
