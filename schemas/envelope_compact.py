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
               `_encode_steps`), its count the list's length

Columns: an int column is 1 byte (width 1-8 | 0x10 when zigzag-coded) + width byte planes; a float column is
1 byte (4 or 8) + that many byte planes; a string column is an int column of UTF-8 lengths + the bytes.

Decoding writes the canonical text of the skeleton with each slot's member put back (the steps by msgspec, as
`schemas.envelope_codec.steps_canonical_text` writes them), so it is as exact as the canonical encoder itself.

Readers never trust the bytes: every length is bounded by what is left, the decoded total by
`MAX_DECODED_BYTES` and the values by `MAX_VALUES` (a record beyond them is never written: the encoder's own
decode check refuses it, and it stays JSON), counts and references must agree, and anything malformed is a
`ContractError`. Pure: no IO.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from functools import cache
from typing import Any, Final

import msgspec
import numpy as np

from schemas.canonical import canonical_text, encode_string
from schemas.envelope_codec import StepRow, TopRow, steps_canonical_text
from schemas.errors import ContractError
from schemas.layout import COMPACT_MAGIC, ENCODING_COMPACT, ENCODING_JSON

VERSION: Final = 1
CODEC_NONE: Final = 0
CODEC_ZLIB: Final = 1
CODEC_ZSTD: Final = 2
CODEC_COPY: Final = 3
#: What a compact record may decode to at most: bytes of frames, and values of columns (bounds on hostile length
#: fields and counts, so a reader never holds more than a few hundred MB for one record; a legitimate record is far
#: below both: an answer of 8,192 tokens at top-20 holds under 1 M values in under 3 MB of frames).
MAX_DECODED_BYTES: Final = 64 * 1024 * 1024
MAX_VALUES: Final = 16 * 1024 * 1024
_MIN_INTS: Final = 8  # shorter int lists cost less as JSON text than as a column
_ZSTD_LEVEL: Final = 3
_ZLIB_LEVEL: Final = 6
_HEADER: Final = struct.Struct("<4sB")
_FRAME: Final = struct.Struct("<BII")  # codec, length decoded (or: the copied frame's index), length stored
_MIN_COMPRESSED: Final = 64  # shorter columns are stored as they are
_STEP_KEYS: Final = frozenset({"logprob", "token", "token_id", "top"})
_CAND_KEYS: Final = frozenset({"logprob", "rank", "token", "token_id"})
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# -- compression ------------------------------------------------------------------------------------------


@cache
def _zstd() -> Any | None:
    """pyarrow's zstd codec, or None where pyarrow was built without it (then zlib is used)."""
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        return None
    return pa.Codec("zstd", compression_level=_ZSTD_LEVEL) if pa.Codec.is_available("zstd") else None


def _frame(column: bytes, earlier: dict[bytes, int], prefer: int) -> bytes:
    """One column as a frame: a copy of an earlier identical column (the chosen ids of the steps are the choice's
    token ids), else compressed when that is smaller, else as it is."""
    if column in earlier:
        return _FRAME.pack(CODEC_COPY, earlier[column], 0)
    earlier[column] = len(earlier)
    codec, packed = CODEC_NONE, column
    zstd = _zstd() if prefer == CODEC_ZSTD else None
    if len(column) >= _MIN_COMPRESSED and prefer != CODEC_NONE:
        trial = bytes(zstd.compress(column, asbytes=True)) if zstd is not None else zlib.compress(column, _ZLIB_LEVEL)
        if len(trial) < len(column):
            codec, packed = (CODEC_ZSTD if zstd is not None else CODEC_ZLIB), trial
    return _FRAME.pack(codec, len(column), len(packed)) + packed


def _unframe(codec: int, data: bytes, length: int) -> bytes:
    try:
        if codec == CODEC_NONE:
            body = data
        elif codec == CODEC_ZLIB:
            inflater = zlib.decompressobj()
            body = inflater.decompress(data, length + 1)  # never more than declared (+1 to notice more)
            if not inflater.eof or inflater.unused_data:
                raise ContractError("compact envelope: a zlib frame does not end where it should")
        elif codec == CODEC_ZSTD:
            zstd = _zstd()
            if zstd is None:
                raise ContractError("compact envelope: a zstd frame, and this pyarrow has no zstd codec")
            body = bytes(zstd.decompress(data, decompressed_size=length, asbytes=True))
        else:
            raise ContractError(f"compact envelope: unknown frame codec {codec}")
    except ContractError:
        raise
    except Exception as exc:  # zlib.error, pyarrow's OSError/ArrowInvalid: corrupt bytes either way
        raise ContractError(f"compact envelope: a frame does not decompress: {exc}") from exc
    if len(body) != length:
        raise ContractError(f"compact envelope: a frame is {len(body)} bytes, its header says {length}")
    return body


# -- columns ----------------------------------------------------------------------------------------------


class _Unfit(Exception):
    """A value a column cannot hold exactly: the member stays in the skeleton."""


def _pack_ints(values: list[int]) -> bytes:
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError as exc:
        raise _Unfit from exc
    flags = 0
    if arr.size and int(arr.min()) < 0:
        flags = 0x10
        u = (arr.astype(np.uint64) << np.uint64(1)) ^ (arr >> np.int64(63)).astype(np.uint64)
    else:
        u = arr.astype(np.uint64)
    top = int(u.max()) if u.size else 0
    width = max(1, (top.bit_length() + 7) // 8)
    planes = u.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width].T
    return bytes([width | flags]) + planes.tobytes()


def _pack_floats(values: list[float]) -> bytes:
    arr = np.array(values, dtype="<f8")
    with np.errstate(over="ignore"):  # a double beyond float32's range becomes inf: not equal, so float64
        narrow = arr.astype("<f4")
    if np.array_equal(narrow.astype("<f8").view("<u8"), arr.view("<u8")):
        return b"\x04" + narrow.view(np.uint8).reshape(-1, 4).T.tobytes()
    return b"\x08" + arr.view(np.uint8).reshape(-1, 8).T.tobytes()


def _pack_strings(values: list[str]) -> list[bytes]:
    encoded = [v.encode("utf-8") for v in values]  # a lone surrogate raises UnicodeEncodeError: unfit
    return [_pack_ints([len(b) for b in encoded]), b"".join(encoded)]


class _Reader:
    """Reads the frames of a record in order (module docstring), every length checked against what is left and
    the decoded total against `MAX_DECODED_BYTES`."""

    def __init__(self, data: bytes, at: int) -> None:
        self.data, self.at = data, at
        self.frames: list[bytes] = []
        self.decoded = 0
        self.values = 0

    def count(self, n: int) -> None:
        self.values += n
        if self.values > MAX_VALUES:
            raise ContractError(f"compact envelope: holds more than {MAX_VALUES} values")

    def done(self) -> bool:
        return self.at == len(self.data)

    def chunk(self) -> bytes:
        if self.at + _FRAME.size > len(self.data):
            raise ContractError("compact envelope: truncated (a frame header is missing)")
        codec, length, stored = _FRAME.unpack_from(self.data, self.at)
        column: bytes
        if codec == CODEC_COPY:
            self.at += _FRAME.size
            if length >= len(self.frames):
                raise ContractError("compact envelope: a frame copies one that is not before it")
            column = self.frames[length]
        else:
            start, self.at = self.at + _FRAME.size, self.at + _FRAME.size + stored
            if self.at > len(self.data):
                raise ContractError("compact envelope: truncated (a frame is shorter than its length)")
            if length > MAX_DECODED_BYTES - self.decoded:
                raise ContractError(f"compact envelope: decodes to more than {MAX_DECODED_BYTES} bytes")
            column = _unframe(codec, self.data[start : self.at], length)
            self.frames.append(column)
        self.decoded += len(column)
        return column

    def ints(self, count: int) -> list[int]:
        self.count(count)
        data = self.chunk()
        if not data:
            raise ContractError("compact envelope: an int column has no header")
        width, zigzag = data[0] & 0x0F, bool(data[0] & 0x10)
        if not 1 <= width <= 8 or data[0] & 0xE0 or len(data) != 1 + width * count:
            raise ContractError(f"compact envelope: an int column of {count} values is malformed")
        planes = np.frombuffer(data, dtype=np.uint8, offset=1).reshape(width, count)
        full = np.zeros((count, 8), dtype=np.uint8)
        full[:, :width] = planes.T
        u = full.view("<u8").reshape(count)
        if not zigzag:
            if width == 8 and count and int(u.max()) > _INT64_MAX:
                raise ContractError("compact envelope: an int column holds a value beyond int64")
            return [int(v) for v in u.tolist()]
        signed = (u >> np.uint64(1)).astype(np.int64) ^ -(u & np.uint64(1)).astype(np.int64)
        return [int(v) for v in signed.tolist()]

    def floats(self, count: int) -> list[float]:
        self.count(count)
        data = self.chunk()
        if not data or data[0] not in (4, 8) or len(data) != 1 + data[0] * count:
            raise ContractError(f"compact envelope: a float column of {count} values is malformed")
        width = data[0]
        planes = np.frombuffer(data, dtype=np.uint8, offset=1).reshape(width, count)
        values = np.ascontiguousarray(planes.T).view("<f4" if width == 4 else "<f8").reshape(count)
        out = [float(v) for v in values.astype("<f8").tolist()]
        if not np.isfinite(values).all():
            raise ContractError("compact envelope: a float column holds NaN or an infinity")
        return out

    def strings(self, count: int) -> list[str]:
        lengths = self.ints(count)
        blob = self.chunk()
        if any(n < 0 for n in lengths) or sum(lengths) != len(blob):
            raise ContractError("compact envelope: a string column's lengths do not add up")
        out, at = [], 0
        try:
            for n in lengths:
                out.append(blob[at : at + n].decode("utf-8"))
                at += n
        except UnicodeDecodeError as exc:
            raise ContractError(f"compact envelope: a string column is not UTF-8: {exc}") from exc
        return out


# -- step records -----------------------------------------------------------------------------------------


def _is_steps(value: Any) -> bool:
    """A non-empty list of step records exactly as a validated envelope dumps them (module docstring)."""
    if type(value) is not list or not value:
        return False
    for step in value:
        if type(step) is not dict or not (step.keys() <= _STEP_KEYS) or len(step) < 3:
            return False
        if type(step.get("token_id")) is not int or type(step.get("logprob")) is not float:
            return False
        if type(step.get("top")) is not list or ("token" in step and type(step["token"]) is not str):
            return False
        for cand in step["top"]:
            if type(cand) is not dict or not (cand.keys() <= _CAND_KEYS) or not ({"logprob", "token"} <= cand.keys()):
                return False
            if type(cand["logprob"]) is not float or type(cand["token"]) is not str:
                return False
            for name in ("rank", "token_id"):
                if name in cand and type(cand[name]) is not int:
                    return False
    return True


def _encode_steps(steps: list[dict[str, Any]]) -> list[bytes]:
    """The columns of a list of step records (`_is_steps`)."""
    counts, chosen_ids, refs, states, chosen_tokens, chosen_lps = [], [], [], [], [], []
    cand_tokens, cand_ids, cand_lps, cand_ranks = [], [], [], []
    for step in steps:
        top, tid, lp, token = step["top"], step["token_id"], step["logprob"], step.get("token")
        counts.append(len(top))
        chosen_ids.append(tid)
        ref = 0
        for j, cand in enumerate(top):
            if cand.get("token_id") == tid and type(cand.get("token_id")) is int and _same_float(cand["logprob"], lp):
                ref = j + 1
                break
        refs.append(ref)
        if ref == 0:
            chosen_lps.append(lp)
        if token is None:
            states.append(0)
        elif ref and top[ref - 1]["token"] == token:
            states.append(2)
        else:
            states.append(1)
            chosen_tokens.append(token)
        for j, cand in enumerate(top):
            cand_tokens.append(cand["token"])
            cand_lps.append(cand["logprob"])
            rank = cand.get("rank")
            cand_ranks.append(0 if rank is None else _zigzag(rank - (j + 1)) + 1)
            if j + 1 != ref:
                cid = cand.get("token_id")
                cand_ids.append(0 if cid is None else cid + 1 if cid >= 0 else cid)
    return [
        _pack_ints(counts),
        _pack_ints(chosen_ids),
        _pack_ints(refs),
        _pack_ints(states),
        *_pack_strings(chosen_tokens),
        _pack_floats(chosen_lps),
        *_pack_strings(cand_tokens),
        _pack_ints(cand_ids),
        _pack_floats(cand_lps),
        _pack_ints(cand_ranks),
    ]


def _same_float(a: float, b: float) -> bool:
    return a == b and struct.pack("<d", a) == struct.pack("<d", b)  # -0.0 and 0.0 differ in text


def _zigzag(n: int) -> int:
    return 2 * n if n >= 0 else -2 * n - 1


def _unzigzag(n: int) -> int:
    return n // 2 if n % 2 == 0 else -(n + 1) // 2


def _decode_steps(reader: _Reader, n: int) -> list[StepRow]:
    """The rows of `n` step records (`_encode_steps` in reverse), every count and reference checked."""
    counts = reader.ints(n)
    chosen_ids = reader.ints(n)
    refs = reader.ints(n)
    states = reader.ints(n)
    if any(c < 0 for c in counts) or sum(counts) > MAX_VALUES:
        raise ContractError("compact envelope: a step count is out of range")
    if any(not 0 <= r <= c for r, c in zip(refs, counts, strict=True)) or any(s not in (0, 1, 2) for s in states):
        raise ContractError("compact envelope: a step reference is out of range")
    if any(s == 2 and not r for s, r in zip(states, refs, strict=True)):
        raise ContractError("compact envelope: a step's token refers to no candidate")
    chosen_tokens = iter(reader.strings(states.count(1)))
    chosen_lps = iter(reader.floats(refs.count(0)))
    total = sum(counts)
    cand_tokens = reader.strings(total)
    cand_ids = iter(reader.ints(total - sum(1 for r in refs if r)))
    cand_lps = reader.floats(total)
    cand_ranks = reader.ints(total)
    rows: list[StepRow] = []
    at = 0
    for count, tid, ref, state in zip(counts, chosen_ids, refs, states, strict=True):
        top: list[TopRow] = []
        for j in range(count):
            if j + 1 == ref:
                cid: int | None = tid
            else:
                code = next(cand_ids)
                cid = None if code == 0 else code - 1 if code > 0 else code
            rank_code = cand_ranks[at]
            rank = None if rank_code == 0 else _unzigzag(rank_code - 1) + j + 1
            top.append(TopRow(cand_lps[at], rank, cand_tokens[at], cid))
            at += 1
        lp = cand_lps[at - count + ref - 1] if ref else next(chosen_lps)
        token = None if state == 0 else next(chosen_tokens) if state == 1 else cand_tokens[at - count + ref - 1]
        rows.append(StepRow(lp, token, tid, top))
    return rows


def _steps_dicts(rows: list[StepRow]) -> list[dict[str, Any]]:
    """Rows as the JSON-mode dicts they stand for (the generic path, for what msgspec may not write)."""
    out = []
    for row in rows:
        top = [
            {k: v for k, v in zip(TopRow.__struct_fields__, (c.logprob, c.rank, c.token, c.token_id), strict=True)
             if v is not None}
            for c in row.top
        ]  # fmt: skip
        step = {"logprob": row.logprob, "token": row.token, "token_id": row.token_id, "top": top}
        out.append({k: v for k, v in step.items() if v is not None})
    return out


# -- the record -------------------------------------------------------------------------------------------


def _slots(node: Any, path: list[Any], found: list[tuple[list[Any], str, Any]]) -> None:
    """Collect (path, kind, value) of every dict member that becomes columns (module docstring), depth first."""
    if type(node) is dict:
        for key, value in node.items():
            if type(value) is list and len(value) >= _MIN_INTS and all(type(v) is int for v in value):
                found.append(([*path, key], "ints", value))
            elif _is_steps(value):
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
            columns += [_pack_ints(value)] if kind == "ints" else _encode_steps(value)
        except (_Unfit, UnicodeEncodeError):
            continue  # stays in the skeleton
        parent = _walk(doc, path[:-1])
        del parent[path[-1]]
        slots.append([path, kind, len(value)])
    earlier: dict[bytes, int] = {}
    head = msgspec.json.encode({"d": doc, "s": slots})
    out = b"".join([_HEADER.pack(COMPACT_MAGIC, VERSION), *(_frame(c, earlier, prefer) for c in [head, *columns])])
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
    reader = _Reader(data, _HEADER.size)
    try:
        head = msgspec.json.decode(reader.chunk())
        doc, slots = head["d"], head["s"]
        if type(doc) is not dict or type(slots) is not list:
            raise TypeError("the head is not {d: object, s: list}")
    except (msgspec.DecodeError, KeyError, TypeError) as exc:
        raise ContractError(f"compact envelope: the head is malformed: {exc}") from exc
    raws: list[Callable[[], str] | str] = []
    values: list[Any] = []
    for slot in slots:
        _, kind, count = _checked_slot(slot)
        if kind == "ints":
            ints = reader.ints(count)
            raws.append(msgspec.json.encode(ints).decode("ascii"))
            values.append(ints)
        else:
            rows = _decode_steps(reader, count)
            text = steps_canonical_text(rows)
            raws.append(text if text is not None else canonical_text(_steps_dicts(rows)))
            values.append(rows)
    if not reader.done():
        raise ContractError("compact envelope: bytes after the last frame")
    return _splice(doc, slots, raws, values).encode("utf-8")


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
        _put(doc, slot[0], value if slot[1] == "ints" else _steps_dicts(value))
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
