"""The columns and frames of a compact envelope (`schemas.envelope_compact`, whose docstring has the layout).

An int column is 1 byte (width 1-8 | 0x10 when zigzag-coded) + width byte planes; a float column is 1 byte (4 or 8)
+ that many byte planes; a string column is an int column of UTF-8 lengths + the bytes. Byte planes (all first
bytes, then all second bytes, ...) compress far better than interleaved values: the high bytes of a token id or a
logprob column hardly vary. Each column is one frame, compressed on its own (`frame`); `FrameReader` reads them
back, every length checked against what is left and the totals against `MAX_DECODED_BYTES` and `MAX_VALUES`.
Pure: no IO (pyarrow, for zstd, is imported on first use).
"""

from __future__ import annotations

import struct
import zlib
from functools import cache
from typing import Any, Final

import numpy as np

from schemas.errors import ContractError

CODEC_NONE: Final = 0
CODEC_ZLIB: Final = 1
CODEC_ZSTD: Final = 2
CODEC_COPY: Final = 3
#: What a compact record may decode to at most: bytes of frames, and values of columns (bounds on hostile length
#: fields and counts, so a reader never holds more than a few hundred MB for one record; a legitimate record is far
#: below both: an answer of 8,192 tokens at top-20 holds under 1 M values in under 3 MB of frames).
MAX_DECODED_BYTES: Final = 64 * 1024 * 1024
MAX_VALUES: Final = 16 * 1024 * 1024
FRAME: Final = struct.Struct("<BII")  # codec, length decoded (or: the copied frame's index), length stored
_ZSTD_LEVEL: Final = 3
_ZLIB_LEVEL: Final = 6
_MIN_COMPRESSED: Final = 64  # shorter columns are stored as they are
_INT64_MAX: Final = 2**63 - 1


# -- compression ------------------------------------------------------------------------------------------


@cache
def _zstd() -> Any | None:
    """pyarrow's zstd codec, or None where pyarrow was built without it (then zlib is used)."""
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        return None
    return pa.Codec("zstd", compression_level=_ZSTD_LEVEL) if pa.Codec.is_available("zstd") else None


def frame(column: bytes, earlier: dict[bytes, int], prefer: int) -> bytes:
    """One column as a frame: a copy of an earlier identical column (the chosen ids of the steps are the choice's
    token ids), else compressed when that is smaller, else as it is."""
    if column in earlier:
        return FRAME.pack(CODEC_COPY, earlier[column], 0)
    earlier[column] = len(earlier)
    codec, packed = CODEC_NONE, column
    zstd = _zstd() if prefer == CODEC_ZSTD else None
    if len(column) >= _MIN_COMPRESSED and prefer != CODEC_NONE:
        trial = bytes(zstd.compress(column, asbytes=True)) if zstd is not None else zlib.compress(column, _ZLIB_LEVEL)
        if len(trial) < len(column):
            codec, packed = (CODEC_ZSTD if zstd is not None else CODEC_ZLIB), trial
    return FRAME.pack(codec, len(column), len(packed)) + packed


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


class Unfit(Exception):
    """A value a column cannot hold exactly: the member stays in the skeleton."""


def pack_ints(values: list[int]) -> bytes:
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError as exc:
        raise Unfit from exc
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


def pack_floats(values: list[float]) -> bytes:
    arr = np.array(values, dtype="<f8")
    with np.errstate(over="ignore"):  # a double beyond float32's range becomes inf: not equal, so float64
        narrow = arr.astype("<f4")
    if np.array_equal(narrow.astype("<f8").view("<u8"), arr.view("<u8")):
        return b"\x04" + narrow.view(np.uint8).reshape(-1, 4).T.tobytes()
    return b"\x08" + arr.view(np.uint8).reshape(-1, 8).T.tobytes()


def pack_strings(values: list[str]) -> list[bytes]:
    encoded = [v.encode("utf-8") for v in values]  # a lone surrogate raises UnicodeEncodeError: unfit
    return [pack_ints([len(b) for b in encoded]), b"".join(encoded)]


class FrameReader:
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
        if self.at + FRAME.size > len(self.data):
            raise ContractError("compact envelope: truncated (a frame header is missing)")
        codec, length, stored = FRAME.unpack_from(self.data, self.at)
        column: bytes
        if codec == CODEC_COPY:
            self.at += FRAME.size
            if length >= len(self.frames):
                raise ContractError("compact envelope: a frame copies one that is not before it")
            column = self.frames[length]
        else:
            start, self.at = self.at + FRAME.size, self.at + FRAME.size + stored
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
