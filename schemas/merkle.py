"""Tamper evidence, the pure part: RFC 9162 (RFC 6962) Merkle tree math and the signed checkpoint record.

The log of a day is the sequence of stored envelopes in the order the publisher stored them. What a leaf commits
to is versioned by its leaf batch (`encode_leaf_batch`, `decode_leaf_batch`):

    format 2  the batch starts with the 16 bytes ``reprolane.leaf/2``, then 64 bytes per leaf: the envelope id and
              the sha256 of the object's stored bytes (both raw). Leaf data = those 64 bytes. For a plaintext
              envelope the two are equal (its id is the hash of its bytes; a compact one's leaf commits to the
              canonical bytes it decodes to, `object_digest`, so also the id); for a sealed one
              (`schemas.sealed`) the second binds the exact ciphertext, nonce, key id and metadata stored.
    format 1  (logs written before format 2) 32 bytes per leaf, the envelope id; leaf data = those 32 bytes. It
              binds a plaintext object's bytes (through its id) but only the *claimed* id of a sealed one: junk
              or a re-sealing under that id cannot be told from the original under format 1.

A batch's format is told from its length alone (format 1: a multiple of 32; format 2: 16 more than a multiple of
64), so a log's size is known from a listing; both formats can follow one another in one day's log, and the leaf
data of the two never collide (32 and 64 bytes). Hashes, exactly as in RFC 9162 section 2.1:

    leaf hash   = sha256(0x00 || data)
    node hash   = sha256(0x01 || left || right)
    MTH([])     = sha256("")
    MTH(D[n])   = node(MTH(D[0:k]), MTH(D[k:n]))   k = the largest power of two smaller than n

An inclusion proof shows that one leaf sits at index ``i`` of a tree of ``n`` leaves with a given root; a
consistency proof shows that the tree of ``m`` leaves is a prefix of the tree of ``n`` leaves (nothing that a
checkpoint committed to was modified, removed, reordered or had something inserted before it). Verification
follows the RFC's iterative algorithms (2.1.3.2 and 2.1.4.2), which are independent of the recursive proof
construction here, so a test that round-trips the two checks one against the other. Both algorithms walk up the
tree the same way, with the bits of a leaf index and of the last index; that walk is written once
(`_path_sides`), and each check hashes along it.

A `Checkpoint` commits to ``(log_id, tree_size, root_hash)`` with an Ed25519 signature over the canonical
JSON (`schemas.canonical`) of every field but the signature. Signing is pure computation (no IO), so it lives
here; loading keys from files is the caller's business.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Final, NamedTuple

from pydantic import Field

from schemas.base import Record, UtcDatetime, decode_record
from schemas.canonical import canonical_bytes
from schemas.envelope_compact import decode_compact, is_compact
from schemas.errors import ContractError

CHECKPOINT_SCHEMA_VERSION: Final = "reprolane.checkpoint/1"
HASH_SIZE: Final = 32
LEAF_BATCH_MAGIC: Final = b"reprolane.leaf/2"  # 16 bytes: a format-2 leaf batch starts with it
FORMAT_1_SIZE: Final = HASH_SIZE
FORMAT_2_SIZE: Final = 2 * HASH_SIZE

Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def object_digest(body: bytes) -> str:
    """The sha256 (hex) a format-2 leaf commits to for an envelope object's stored bytes: of the bytes, or, for a
    compact envelope, of the canonical bytes it decodes to (so also its id); compact bytes that do not decode are
    hashed as they are (no leaf commits to those)."""
    if is_compact(body):
        with contextlib.suppress(ContractError):
            return hashlib.sha256(decode_compact(body)).hexdigest()
    return hashlib.sha256(body).hexdigest()


def leaf_data(envelope_id: str) -> bytes:
    """The format-1 leaf data of an envelope (and the first half of format 2's): the 32 raw bytes of its id."""
    return _raw_hash(envelope_id, "envelope id")


def _raw_hash(value: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(value)
    except ValueError as exc:
        raise ContractError(f"{what} {value!r} is not hex", (what.replace(" ", "_"),)) from exc
    if len(raw) != HASH_SIZE:
        raise ContractError(f"{what} {value!r} is not 32 bytes", (what.replace(" ", "_"),))
    return raw


class LeafEntry(NamedTuple):
    """One leaf: the envelope id and (format 2) the sha256 hex of the object's stored bytes, None in format 1."""

    envelope_id: str
    object_sha256: str | None = None

    def data(self) -> bytes:
        """The leaf data its hash is taken over (see module doc)."""
        if self.object_sha256 is None:
            return leaf_data(self.envelope_id)
        return leaf_data(self.envelope_id) + _raw_hash(self.object_sha256, "object sha256")

    def hash(self) -> bytes:
        return leaf_hash(self.data())


def encode_leaf_batch(entries: Sequence[LeafEntry]) -> bytes:
    """A format-2 leaf batch of `entries` (each must name its object's sha256)."""
    parts = [LEAF_BATCH_MAGIC]
    for entry in entries:
        if entry.object_sha256 is None:
            raise ContractError(f"leaf of {entry.envelope_id} has no object sha256", ("object_sha256",))
        parts.append(entry.data())
    return b"".join(parts)


def leaf_batch_count(nbytes: int) -> int:
    """How many leaves a batch of `nbytes` holds, whole ones only (from a listing's size: see module doc)."""
    if nbytes % FORMAT_2_SIZE == len(LEAF_BATCH_MAGIC):
        return (nbytes - len(LEAF_BATCH_MAGIC)) // FORMAT_2_SIZE
    return nbytes // FORMAT_1_SIZE


def decode_leaf_batch(body: bytes) -> tuple[list[LeafEntry], str | None]:
    """The whole leaves of a batch, and what is wrong with it (a torn length) or None."""
    if body.startswith(LEAF_BATCH_MAGIC):
        rest, size = body[len(LEAF_BATCH_MAGIC) :], FORMAT_2_SIZE
    else:
        rest, size = body, FORMAT_1_SIZE
    entries = []
    for off in range(0, len(rest) - len(rest) % size, size):
        raw = rest[off : off + size]
        if size == FORMAT_1_SIZE:
            entries.append(LeafEntry(raw.hex()))
        else:
            entries.append(LeafEntry(raw[:HASH_SIZE].hex(), raw[HASH_SIZE:].hex()))
    problem = None
    if len(rest) % size:
        fmt = 1 if size == FORMAT_1_SIZE else 2
        problem = f"is {len(body)} bytes, not a whole number of format-{fmt} leaves of {size} bytes"
    return entries, problem


def _split(n: int) -> int:
    """The largest power of two strictly smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root_from_hashes(hashes: Sequence[bytes]) -> bytes:
    """MTH over leaf *hashes* (each already `leaf_hash`-ed)."""
    n = len(hashes)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return hashes[0]
    k = _split(n)
    return node_hash(root_from_hashes(hashes[:k]), root_from_hashes(hashes[k:]))


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """MTH over leaf *data*."""
    return root_from_hashes([leaf_hash(d) for d in leaves])


def inclusion_proof(hashes: Sequence[bytes], index: int) -> list[bytes]:
    """PATH(index, D[n]) over leaf hashes: the audit path, leaf side first."""
    n = len(hashes)
    if not 0 <= index < n:
        raise ValueError(f"leaf index {index} outside a tree of {n}")
    if n == 1:
        return []
    k = _split(n)
    if index < k:
        return [*inclusion_proof(hashes[:k], index), root_from_hashes(hashes[k:])]
    return [*inclusion_proof(hashes[k:], index - k), root_from_hashes(hashes[:k])]


def _path_sides(fn: int, sn: int, path: Sequence[bytes]) -> list[bool] | None:
    """The walk both RFC 9162 checks make from node ``fn`` up to the root (``sn``: the last node at that level):
    for each node of ``path``, whether it is the left sibling (hash it before the running value) or the right.

    None when the path does not fit the tree: longer than the way up (``sn`` reaches 0 first) or shorter.
    """
    sides = []
    for _ in path:
        if sn == 0:
            return None
        left = bool(fn & 1) or fn == sn
        sides.append(left)
        if left and not fn & 1:
            while fn and not fn & 1:
                fn >>= 1
                sn >>= 1
        fn >>= 1
        sn >>= 1
    return sides if sn == 0 else None


def verify_inclusion(leaf: bytes, index: int, tree_size: int, proof: Sequence[bytes], root: bytes) -> bool:
    """RFC 9162 2.1.3.2: does `leaf` (a leaf *hash*) sit at `index` of the tree of `tree_size` with `root`?"""
    if not 0 <= index < tree_size:
        return False
    sides = _path_sides(index, tree_size - 1, proof)
    if sides is None:
        return False
    r = leaf
    for p, left in zip(proof, sides, strict=True):
        r = node_hash(p, r) if left else node_hash(r, p)
    return r == root


def consistency_proof(hashes: Sequence[bytes], old_size: int) -> list[bytes]:
    """PROOF(m, D[n]) over leaf hashes: that the first `old_size` leaves are a prefix of all of them."""
    n = len(hashes)
    if not 0 < old_size <= n:
        raise ValueError(f"old size {old_size} must be in 1..{n}")
    return _subproof(old_size, hashes, True)


def _subproof(m: int, hashes: Sequence[bytes], complete: bool) -> list[bytes]:
    n = len(hashes)
    if m == n:
        return [] if complete else [root_from_hashes(hashes)]
    k = _split(n)
    if m <= k:
        return [*_subproof(m, hashes[:k], complete), root_from_hashes(hashes[k:])]
    return [*_subproof(m - k, hashes[k:], False), root_from_hashes(hashes[:k])]


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> bool:
    """RFC 9162 2.1.4.2: is the tree (old_size, old_root) a prefix of (new_size, new_root)?"""
    if not 0 < old_size <= new_size:
        return False
    if old_size == new_size:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root is the first node of the path
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    sides = _path_sides(fn, sn, path[1:])
    if sides is None:
        return False
    fr = sr = path[0]
    for c, left in zip(path[1:], sides, strict=True):
        if left:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
        else:
            sr = node_hash(sr, c)
    return fr == old_root and sr == new_root


class Checkpoint(Record):
    """A signed commitment to the first `tree_size` leaves of one log (e.g. ``day=2026-11-29``)."""

    schema_version: str = CHECKPOINT_SCHEMA_VERSION
    log_id: str = Field(pattern=r"^[A-Za-z0-9=._:\-]{1,128}$")
    tree_size: int = Field(ge=0)
    root_hash: Sha256Hex
    issued_at: UtcDatetime
    key_id: str = Field(pattern=r"^[0-9a-f]{16}$", description="first 16 hex of sha256(raw public key)")
    signature: str = Field(default="", description="base64 Ed25519 signature over `signed_body`")

    def signed_body(self) -> bytes:
        """The bytes the signature covers: canonical JSON of every field except the signature."""
        return canonical_bytes(self, exclude={"signature"})

    def canonical(self) -> bytes:
        return canonical_bytes(self)


def key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]


def sign_checkpoint(private_raw: bytes, log_id: str, tree_size: int, root: bytes, issued_at: datetime) -> Checkpoint:
    """Sign ``(log_id, tree_size, root)`` with the Ed25519 private key given as its 32 raw bytes."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = Ed25519PrivateKey.from_private_bytes(private_raw)
    public_raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    unsigned = Checkpoint(
        log_id=log_id, tree_size=tree_size, root_hash=root.hex(), issued_at=issued_at, key_id=key_id(public_raw)
    )
    signature = base64.b64encode(key.sign(unsigned.signed_body())).decode()
    return unsigned.model_copy(update={"signature": signature})


def verify_checkpoint(checkpoint: Checkpoint, public_raw: bytes) -> bool:
    """True when the signature is a valid Ed25519 signature of `signed_body` by this public key."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    if checkpoint.key_id != key_id(public_raw):
        return False
    try:
        signature = base64.b64decode(checkpoint.signature, validate=True)
        Ed25519PublicKey.from_public_bytes(public_raw).verify(signature, checkpoint.signed_body())
    except (InvalidSignature, ValueError):
        return False
    return True


def decode_checkpoint(data: bytes | str) -> Checkpoint:
    return decode_record(Checkpoint, "checkpoint", data)
