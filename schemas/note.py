"""The public text formats of transparency logs (C2SP), so that tools outside this project can check our evidence.

Three specifications, implemented to the letter and tested against their published vectors (the examples of
c2sp.org/signed-note and golang.org/x/mod/sumdb/note's tests, byte for byte):

**Signed note** (c2sp.org/signed-note). A text ending in a newline, a blank line, then one or more lines
``— <key name> <base64(4-byte key id || signature)>``. Valid UTF-8, no control character but newline. A key
name is non-empty, without Unicode spaces or ``+``. Ed25519 (signature type 0x01) signs the text (final newline
included), and its key id is ``sha256(name || 0x0A || 0x01 || public key)[:4]`` (big-endian). A *verifier key*
(vkey) is ``<name>+<hex key id>+<base64(0x01 || public key)>``. A verifier ignores signatures of keys it does not
know (name and id both), must verify those it knows, and rejects a note none of its keys signed.

**Checkpoint** (c2sp.org/tlog-checkpoint). The note text is three lines: the log's *origin*, the tree size in
decimal (no leading zero), the base64 RFC 6962 root hash; further (extension) lines are optional and we write
none (Go's ``tlog.ParseTree`` rejects them, so a checkpoint with them would not interoperate).

**Proof** (c2sp.org/tlog-proof). ``c2sp.org/tlog-proof@v1``, an optional ``extra <base64>`` line, ``index <n>``,
the inclusion path (one base64 hash per line, the leaf's sibling first), a blank line, then the checkpoint
verbatim. We carry the leaf data in ``extra`` (unauthenticated by design: the verifier recomputes it from the
record and compares).

Why a fingerprint as well as key ids: the 4-byte key id is an identifier, not a commitment (an attacker can make
a key with any id). A verifier pins the whole key, or its `key_fingerprint` (sha256 of the 32 raw bytes).

Pure: parsing and encoding, Ed25519 through `cryptography`; no IO, nothing of ours but `schemas.errors`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Final

from schemas.errors import ContractError

SIG_ED25519: Final = 0x01
EM_DASH: Final = "\u2014"
#: How many signature lines a note may carry (the spec asks verifiers to take at least 16; Go's limit is 100).
MAX_SIGNATURES: Final = 100
MAX_NOTE_BYTES: Final = 1 << 20
TLOG_PROOF_HEADER: Final = "c2sp.org/tlog-proof@v1"
MAX_PROOF_HASHES: Final = 64  # a path is at most 63 hashes long for any tree of up to 2**63 leaves
_DECIMAL = re.compile(r"^(0|[1-9][0-9]{0,18})$")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_FINGERPRINT = re.compile(r"^(sha256:)?([0-9a-f]{64})$")


def _fail(message: str, what: str) -> ContractError:
    return ContractError(message, (what,))


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
        raise _fail(f"{what}: {text[:40]!r} is not base64", what) from exc


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def is_key_name(name: str) -> bool:
    """Non-empty, no Unicode space, no ``+`` (and no control character)."""
    return bool(name) and "+" not in name and not any(c.isspace() or ord(c) < 0x20 for c in name)


def ed25519_key_id(name: str, public_raw: bytes) -> int:
    """The key id of an Ed25519 key of that name (see module doc)."""
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([SIG_ED25519]) + public_raw).digest()
    return int.from_bytes(digest[:4], "big")


def key_fingerprint(public_raw: bytes) -> str:
    """``sha256:<hex>`` of the raw public key: what a verifier pins when it does not hold the key itself."""
    return "sha256:" + hashlib.sha256(public_raw).hexdigest()


def parse_fingerprint(text: str) -> str:
    """A fingerprint as given (``sha256:HEX`` or the bare 64 hex), normalised to `key_fingerprint`'s form."""
    found = _FINGERPRINT.match(text.strip().lower())
    if found is None:
        raise _fail(f"key fingerprint {text!r}: expected sha256:<64 hex>", "key_fingerprint")
    return "sha256:" + found.group(2)


@dataclass(frozen=True)
class VerifierKey:
    """An Ed25519 verifier key: the name and key id signatures carry, and the 32 raw public bytes."""

    name: str
    public_raw: bytes

    @property
    def key_id(self) -> int:
        return ed25519_key_id(self.name, self.public_raw)

    def encode(self) -> str:
        return f"{self.name}+{self.key_id:08x}+{_b64(bytes([SIG_ED25519]) + self.public_raw)}"


def parse_vkey(text: str) -> VerifierKey:
    """A vkey ``name+hex id+base64(type || key)``; its id must be the one its name and key give."""
    parts = text.strip().split("+", 2)
    if len(parts) != 3 or not is_key_name(parts[0]) or not _HEX8.match(parts[1]):
        raise _fail(f"verifier key {text[:60]!r}: expected <name>+<8 hex>+<base64>", "vkey")
    material = _b64decode(parts[2], "vkey")
    if len(material) != 33 or material[0] != SIG_ED25519:
        raise _fail("verifier key: not an Ed25519 key (type 0x01 and 32 bytes)", "vkey")
    key = VerifierKey(parts[0], material[1:])
    if key.key_id != int(parts[1], 16):
        raise _fail(f"verifier key: id {parts[1]} is not the id of its name and key ({key.key_id:08x})", "vkey")
    return key


@dataclass(frozen=True)
class NoteSignature:
    name: str
    key_id: int
    signature: bytes  # the algorithm's bytes, after the 4-byte key id

    def line(self) -> str:
        return f"{EM_DASH} {self.name} {_b64(self.key_id.to_bytes(4, 'big') + self.signature)}\n"


@dataclass(frozen=True)
class Note:
    text: str  # ends in a newline
    signatures: tuple[NoteSignature, ...]

    def encode(self) -> bytes:
        return (self.text + "\n" + "".join(s.line() for s in self.signatures)).encode()

    def signature_lines(self) -> str:
        return "".join(s.line() for s in self.signatures)


def _check_text(text: str) -> None:
    if not text.endswith("\n"):
        raise _fail("note text must end in a newline", "note")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise _fail("note text holds a control character", "note")


def parse_note(data: bytes) -> Note:
    """A signed note's text and signatures (none verified yet); `ContractError` when malformed."""
    if len(data) > MAX_NOTE_BYTES:
        raise _fail(f"note of {len(data)} bytes is over {MAX_NOTE_BYTES}", "note")
    try:
        message = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail("note is not UTF-8", "note") from exc
    split = message.rfind("\n\n")
    if split < 0:
        raise _fail("note has no blank line before its signatures", "note")
    text, sig_block = message[: split + 1], message[split + 2 :]
    _check_text(text)
    if not sig_block.endswith("\n") or any(ord(c) < 0x20 and c != "\n" for c in sig_block):
        raise _fail("note signatures must be whole lines", "note")
    lines = sig_block[:-1].split("\n")
    if len(lines) > MAX_SIGNATURES:
        raise _fail(f"note has {len(lines)} signatures, more than {MAX_SIGNATURES}", "note")
    signatures = []
    for line in lines:
        head, _, rest = line.partition(" ")
        name, _, sig_b64 = rest.partition(" ")
        if head != EM_DASH or not is_key_name(name) or not sig_b64 or " " in sig_b64:
            raise _fail(f"note signature line {line[:60]!r} is malformed", "note")
        raw = _b64decode(sig_b64, "note")
        if len(raw) < 5:
            raise _fail("note signature is shorter than a key id and a signature", "note")
        signatures.append(NoteSignature(name, int.from_bytes(raw[:4], "big"), raw[4:]))
    return Note(text, tuple(signatures))


def sign_note(text: str, name: str, private_raw: bytes) -> Note:
    """`text` signed with the Ed25519 key given as its 32 raw bytes under key `name`."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    _check_text(text)
    if not is_key_name(name):
        raise _fail(f"key name {name!r} is empty or holds a space or '+'", "key_name")
    key = Ed25519PrivateKey.from_private_bytes(private_raw)
    public_raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    signature = key.sign(text.encode())
    return Note(text, (NoteSignature(name, ed25519_key_id(name, public_raw), signature),))


def signature_by(note: Note, key: VerifierKey) -> NoteSignature | None:
    """The note's signature that names this key (name and id both), or None."""
    return next((s for s in note.signatures if s.name == key.name and s.key_id == key.key_id), None)


def verifies(note: Note, key: VerifierKey) -> bool:
    """True when `key` (a known key) signed the note and its signature verifies; False otherwise (unsigned by it,
    or a signature of it that fails)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    signature = signature_by(note, key)
    if signature is None:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(key.public_raw).verify(signature.signature, note.text.encode())
    except (InvalidSignature, ValueError):
        return False
    return True


def key_named_in(note: Note, public_raw: bytes) -> VerifierKey | None:
    """For a verifier that pinned the raw key only: the key under the name of one of the note's signature lines
    whose id that name and this key give (the name is an identifier; the key is what is trusted)."""
    for signature in note.signatures:
        key = VerifierKey(signature.name, public_raw)
        if key.key_id == signature.key_id:
            return key
    return None


# ------------------------------------------------------------------------------------- tlog checkpoints


@dataclass(frozen=True)
class TreeHead:
    """The note text of a checkpoint (c2sp.org/tlog-checkpoint)."""

    origin: str
    tree_size: int
    root_hash: bytes

    def text(self) -> str:
        return f"{self.origin}\n{self.tree_size}\n{_b64(self.root_hash)}\n"


def parse_tree_head(text: str) -> TreeHead:
    """Origin, size and root of a checkpoint's note text (extension lines are refused, see module doc)."""
    lines = text.split("\n")
    if len(lines) != 4 or lines[3] != "":
        raise _fail("checkpoint text is not exactly origin, tree size and root hash lines", "checkpoint")
    origin, size, root_b64 = lines[:3]
    if not origin:
        raise _fail("checkpoint origin is empty", "checkpoint.origin")
    if not _DECIMAL.match(size):
        raise _fail(f"checkpoint tree size {size[:30]!r} is not a decimal without leading zeros", "checkpoint.size")
    root = _b64decode(root_b64, "checkpoint.root_hash")
    if len(root) != 32:
        raise _fail(f"checkpoint root hash is {len(root)} bytes, not 32", "checkpoint.root_hash")
    return TreeHead(origin, int(size), root)


def sign_checkpoint_note(head: TreeHead, name: str, private_raw: bytes) -> bytes:
    """A C2SP checkpoint of `head`, signed under key `name`."""
    return sign_note(head.text(), name, private_raw).encode()


# ----------------------------------------------------------------------------------------- tlog proofs


@dataclass(frozen=True)
class TlogProof:
    index: int
    path: tuple[bytes, ...]
    checkpoint: bytes  # the checkpoint note, verbatim
    extra: bytes | None = None

    def proof_lines(self) -> str:
        """Everything before the checkpoint: header, extra, index and the path (each line newline-terminated)."""
        lines = [TLOG_PROOF_HEADER]
        if self.extra is not None:
            lines.append(f"extra {_b64(self.extra)}")
        lines.append(f"index {self.index}")
        lines += [_b64(h) for h in self.path]
        return "\n".join(lines) + "\n"

    def encode(self) -> bytes:
        return (self.proof_lines() + "\n").encode() + self.checkpoint


def parse_tlog_proof(data: bytes) -> TlogProof:
    """A tlog-proof's parts; its checkpoint is parsed (and verified) by the caller."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail("tlog-proof is not UTF-8", "proof") from exc
    head, sep, checkpoint = text.partition("\n\n")
    if not sep:
        raise _fail("tlog-proof has no blank line before its checkpoint", "proof")
    lines = head.split("\n")
    if lines[0] != TLOG_PROOF_HEADER:
        raise _fail(f"tlog-proof does not start with {TLOG_PROOF_HEADER}", "proof")
    rest = lines[1:]
    extra = None
    if rest and rest[0].startswith("extra "):
        extra = _b64decode(rest.pop(0)[len("extra ") :], "proof.extra")
    if not rest or not rest[0].startswith("index ") or not _DECIMAL.match(rest[0][len("index ") :]):
        raise _fail("tlog-proof has no 'index N' line", "proof.index")
    index = int(rest.pop(0)[len("index ") :])
    if len(rest) > MAX_PROOF_HASHES:
        raise _fail(f"tlog-proof path of {len(rest)} hashes is longer than {MAX_PROOF_HASHES}", "proof.path")
    path = tuple(_b64decode(line, "proof.path") for line in rest)
    if any(len(h) != 32 for h in path):
        raise _fail("tlog-proof path holds a hash that is not 32 bytes", "proof.path")
    return TlogProof(index, path, checkpoint.encode(), extra)
