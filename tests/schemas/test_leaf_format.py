"""The versioned leaf batches of the Merkle log (`schemas.merkle`): golden leaf hashes of both formats, so what a
signed checkpoint commits to can never drift silently, and the batch encoding round trip."""

from __future__ import annotations

import hashlib

import pytest

from schemas.errors import ContractError
from schemas.merkle import LEAF_BATCH_MAGIC, LeafEntry, decode_leaf_batch, encode_leaf_batch, leaf_batch_count

ID, DIGEST = "ab" * 32, "cd" * 32


def test_golden_leaf_hashes() -> None:
    assert LeafEntry(ID).data() == b"\xab" * 32
    assert LeafEntry(ID).hash() == hashlib.sha256(b"\x00" + b"\xab" * 32).digest()
    assert LeafEntry(ID, DIGEST).data() == b"\xab" * 32 + b"\xcd" * 32
    assert LeafEntry(ID, DIGEST).hash().hex() == "5873b922b2cbdf4d2001305b091512ae785677f7ac9345731ae66540f56f0acd"
    assert LeafEntry(ID).hash().hex() == "86754e71ab90f305c4faa7eee57b41b89e49ebcdf03a745c855ee611e4597237"


def test_a_batch_round_trips_and_its_size_tells_its_count() -> None:
    entries = [LeafEntry(ID, DIGEST), LeafEntry(DIGEST, ID)]
    body = encode_leaf_batch(entries)
    assert body.startswith(LEAF_BATCH_MAGIC)
    assert len(LEAF_BATCH_MAGIC) == 16
    assert decode_leaf_batch(body) == (entries, None)
    assert leaf_batch_count(len(body)) == 2
    assert leaf_batch_count(len(encode_leaf_batch([]))) == 0
    assert leaf_batch_count(3 * 32) == 3  # format 1
    assert decode_leaf_batch(bytes.fromhex(ID) * 2) == ([LeafEntry(ID), LeafEntry(ID)], None)


def test_a_format_2_leaf_needs_its_object_digest() -> None:
    with pytest.raises(ContractError, match="no object sha256"):
        encode_leaf_batch([LeafEntry(ID)])
    with pytest.raises(ContractError, match="object sha256"):
        LeafEntry(ID, "zz").data()
