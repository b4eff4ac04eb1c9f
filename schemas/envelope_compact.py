"""Compact envelopes: a lossless, versioned binary encoding of an envelope's canonical bytes for storage and
transport, and the one function every reader decodes stored or consumed envelope bytes with (`envelope_bytes`).

Identity does not move: an envelope's id is still the sha256 of its canonical JSON (`schemas.canonical`), and
`decode_compact` gives back exactly those bytes, byte for byte (`encode_compact` proves it on every record it
encodes and returns None, "store the JSON", when it cannot). So the compact form is a way to *hold* an
envelope, not a second identity; a reader that hashes what it decoded gets the id, whichever form was stored.

Why it is small. In canonical JSON a generated token at top-k costs the member names of a step record and of
k candidate records, the ids and logprobs as decimal text, and the same id, logprob and token text written
twice (the chosen token is almost always also candidate 1). Here the bulky members are taken out of the JSON
into columns: every list of integers (token ids) becomes a packed integer column, every list of step records
(per-token logprobs) becomes columns of counts, ids, logprobs, ranks and token texts, with the chosen token
stored as "candidate j" when a candidate has its id and logprob. Integers are stored in as few bytes as their
largest value needs, floats as float32 when every value of the column is exactly a float32 (vLLM's logprobs
are; otherwise as float64), both split into byte planes, which compress far better than interleaved bytes
(the high bytes of a logprob column hardly vary). What is left of the record (the skeleton: model, contract,
fingerprint, texts, and any field added later) stays JSON. Then each column, and the skeleton, is compressed on
its own (each gets its own entropy statistics, which a single stream over all of them would share), with zstd
(through pyarrow, a dependency already; imported on first use) where pyarrow has it, else zlib, and kept as it
is when that is not smaller; a column equal to an earlier one (the chosen ids of the steps are the choice's
token ids) is stored as a copy of it.

Which members are columns is decided by shape, not by name: a dict member that is a list of ints (at least
`_MIN_INTS`), or a non-empty list of step records whose members are exactly the known step and candidate
fields with the types a validated record holds. Anything else, including an optional field added to the
contract later (or a step record that grew a field), stays in the skeleton, so the encoding never has to be
told about a new field and never loses one.

Layout (version 1; every integer little-endian):

    magic      `schemas.layout.COMPACT_MAGIC` (4 bytes)
    version    1 byte (1)
    frames     the head, then each slot's columns in order; a frame is codec (1 byte: 0 none, 1 zlib, 2 zstd,
               3 copy), u32 length decoded (for a copy: the index of the frame copied), u32 length stored, the
               stored bytes (none for a copy)
    head       JSON ``{"d": skeleton, "s": [[path, kind, count], ...]}``: a slot's path is the keys and list
               indexes to the member it fills, its kind ``ints`` (one int column) or ``steps`` (the columns of
               `schemas.compact_steps`), its count the list's length

The columns and frames are `schemas.compact_columns`'s.

Decoding writes the canonical text of the skeleton with each slot's member put back (the steps by msgspec, as
`schemas.envelope_codec.steps_canonical_text` writes them), so it is as exact as the canonical encoder itself.

Readers never trust the bytes: every length is bounded by what is left, the decoded total by
`MAX_DECODED_BYTES` and the values by `MAX_VALUES` (a record beyond them is never written: the encoder's own
decode check refuses it, and it stays JSON), counts and references must agree, and anything malformed is a
`ContractError`. Pure: no IO.
"""

from __future__ import annotations

import struct
from typing import Any, Final

import msgspec

from schemas.canonical import canonical_text, encode_string
from schemas.compact_columns import CODEC_ZSTD, MAX_VALUES, FrameReader, Unfit, frame, pack_ints
from schemas.compact_steps import decode_steps, encode_steps, is_steps, steps_dicts
from schemas.envelope_codec import steps_canonical_text
from schemas.errors import ContractError
from schemas.layout import COMPACT_MAGIC, ENCODING_COMPACT, ENCODING_JSON

VERSION: Final = 1
_MIN_INTS: Final = 8  # shorter int lists cost less as JSON text than as a column
_HEADER: Final = struct.Struct("<4sB")


# -- the record -------------------------------------------------------------------------------------------


def _slots(node: Any, path: list[Any], found: list[tuple[list[Any], str, Any]]) -> None:
    """Collect (path, kind, value) of every dict member that becomes columns (module docstring), depth first."""
    if type(node) is dict:
        for key, value in node.items():
            if type(value) is list and len(value) >= _MIN_INTS and all(type(v) is int for v in value):
                found.append(([*path, key], "ints", value))
            elif is_steps(value):
                found.append(([*path, key], "steps", value))
            else:
                _slots(value, [*path, key], found)
    elif type(node) is list:
        for i, value in enumerate(node):
            _slots(value, [*path, i], found)


def encode_compact(canonical: bytes, *, prefer: int = CODEC_ZSTD) -> bytes | None:
    """The compact form of an envelope's canonical bytes, or None when it would not decode to exactly them
    (the caller stores the JSON then). The result is checked by decoding it. `prefer`: the frames' compression
    (`CODEC_ZSTD`, falling back to zlib where pyarrow has no zstd; `CODEC_ZLIB`; `CODEC_NONE`)."""
    try:
        doc = msgspec.json.decode(canonical)
    except msgspec.DecodeError:
        return None
    found: list[tuple[list[Any], str, Any]] = []
    _slots(doc, [], found)
    slots: list[list[Any]] = []
    columns: list[bytes] = []
    for path, kind, value in found:
        try:
            columns += [pack_ints(value)] if kind == "ints" else encode_steps(value)
        except (Unfit, UnicodeEncodeError):
            continue  # stays in the skeleton
        parent = _walk(doc, path[:-1])
        del parent[path[-1]]
        slots.append([path, kind, len(value)])
    earlier: dict[bytes, int] = {}
    head = msgspec.json.encode({"d": doc, "s": slots})
    out = b"".join([_HEADER.pack(COMPACT_MAGIC, VERSION), *(frame(c, earlier, prefer) for c in [head, *columns])])
    try:
        return out if decode_compact(out) == canonical else None
    except ContractError:
        return None


def _walk(doc: Any, path: list[Any]) -> Any:
    node = doc
    for step in path:
        node = node[step]
    return node


def is_compact(data: bytes | bytearray | memoryview | str | None) -> bool:
    """True when `data` starts with the compact magic (never raises)."""
    return isinstance(data, bytes | bytearray | memoryview) and bytes(data[:4]) == COMPACT_MAGIC


def decode_compact(data: bytes) -> bytes:
    """The canonical bytes a compact record holds; `ContractError` for anything that is not one exactly."""
    if len(data) < _HEADER.size:
        raise ContractError("compact envelope: shorter than its header")
    magic, version = _HEADER.unpack_from(data)
    if magic != COMPACT_MAGIC:
        raise ContractError("compact envelope: wrong magic bytes")
    if version != VERSION:
        raise ContractError(f"compact envelope: version {version} is not known here (this reader knows {VERSION})")
    reader = FrameReader(data, _HEADER.size)
    try:
        head = msgspec.json.decode(reader.chunk())
        doc, slots = head["d"], head["s"]
        if type(doc) is not dict or type(slots) is not list:
            raise TypeError("the head is not {d: object, s: list}")
    except (msgspec.DecodeError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ContractError(f"compact envelope: the head is malformed: {exc}") from exc
    raws: list[str] = []
    values: list[Any] = []
    for slot in slots:
        _, kind, count = _checked_slot(slot)
        if kind == "ints":
            ints = reader.ints(count)
            raws.append(msgspec.json.encode(ints).decode("ascii"))
            values.append(ints)
        else:
            rows = decode_steps(reader, count)
            text = steps_canonical_text(rows)
            raws.append(text if text is not None else canonical_text(steps_dicts(rows)))
            values.append(rows)
    if not reader.done():
        raise ContractError("compact envelope: bytes after the last frame")
    try:
        return _splice(doc, slots, raws, values).encode("utf-8")
    except RecursionError as exc:  # a skeleton nested deeper than the encoder goes
        raise ContractError("compact envelope: the record is nested too deeply") from exc


def _checked_slot(slot: Any) -> tuple[list[Any], str, int]:
    if type(slot) is not list or len(slot) != 3:
        raise ContractError("compact envelope: a slot is not [path, kind, count]")
    path, kind, count = slot
    if type(path) is not list or not path or type(path[-1]) is not str or kind not in ("ints", "steps"):
        raise ContractError("compact envelope: a slot's path or kind is malformed")
    if type(count) is not int or not 0 <= count <= MAX_VALUES:
        raise ContractError("compact envelope: a slot's count is out of range")
    if any(type(p) is not str and (type(p) is not int or p < 0) for p in path):
        raise ContractError("compact envelope: a slot's path holds something that is no key or index")
    return path, kind, count


def _splice(doc: dict[str, Any], slots: list[Any], raws: list[Any], values: list[Any]) -> str:
    """The canonical text of the skeleton with each slot's member put back: as a marker string replaced by the
    slot's text (one encoding pass), or, when a marker string also occurs in the record itself, by putting the
    values back and encoding the whole record (exact either way; see `schemas.envelope_codec._joined`)."""
    marks: list[tuple[str, str]] = []
    for i, (slot, raw) in enumerate(zip(slots, raws, strict=True)):
        marker = f"\x00compact slot {i}\x00"
        _put(doc, slot[0], marker, new=True)
        marks.append((encode_string(marker), raw))
    out = canonical_text(doc)
    if all(out.count(quoted) == 1 for quoted, _ in marks):
        for quoted, raw in marks:
            out = out.replace(quoted, raw, 1)
        return out
    for slot, value in zip(slots, values, strict=True):
        _put(doc, slot[0], value if slot[1] == "ints" else steps_dicts(value))
    return canonical_text(doc)


def _put(doc: dict[str, Any], path: list[Any], value: Any, *, new: bool = False) -> None:
    try:
        parent = _walk(doc, path[:-1])
    except (KeyError, IndexError, TypeError) as exc:
        raise ContractError(f"compact envelope: a slot's path {path!r} is not in the record") from exc
    if type(parent) is not dict:
        raise ContractError(f"compact envelope: a slot's path {path!r} does not end in an object member")
    if new and path[-1] in parent:
        raise ContractError(f"compact envelope: slot {path!r} is also in the skeleton")
    parent[path[-1]] = value


# -- the one reader -------------------------------------------------------------------------------------


def envelope_bytes(data: bytes) -> bytes:
    """The canonical bytes of an envelope as stored or consumed: compact records decoded, anything else (JSON,
    a sealed record, a claim check) returned as it is. What every reader of envelope objects and envelope-topic
    values calls before it parses or hashes (`schemas.envelope.decode_envelope` does)."""
    return decode_compact(bytes(data)) if is_compact(data) else data


def encoding_of(data: bytes) -> str:
    """`schemas.layout.ENCODING_COMPACT` or `ENCODING_JSON`: what the S3 content type and Kafka header say."""
    return ENCODING_COMPACT if is_compact(data) else ENCODING_JSON
