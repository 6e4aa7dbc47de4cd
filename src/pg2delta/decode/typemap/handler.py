"""What every type family shares: the handler contract, a column chunk's values, the byte gathers.

A :class:`Handler` turns the values of one PostgreSQL type into Arrow: ``vec_text`` /
``vec_binary`` decode a whole :class:`Part` (one wire format of one column chunk) in bulk or
return None, ``ref_text`` / ``ref_binary`` decode one value (the reference path the bulk path
is tested against, and the fallback that names the bad row), ``pg_text`` prints a binary value
as PostgreSQL would (for composites, ranges and arrays of the type). :class:`TextLike` and
:class:`Printed` are the two string-typed bases most families build on. A value that is not a
value of its type raises :class:`Bad` (or :class:`BadAt` with the index of the value in the
part); :class:`~pg2delta.decode.typemap.codec.ColumnCodec` turns both into DecodeError.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from pg2delta.decode import _tuples

Notes = collections.Counter[str]
I64 = NDArray[np.int64]
U8 = NDArray[np.uint8]

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


class Bad(ValueError):
    """A value that is not a valid value of its type (reason only, no value)."""


class BadAt(Exception):
    """The value at ``index`` of a :class:`Part` is not a valid value of its type."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


_SWAP = sys.byteorder == "little"  # wire values are big-endian


def gather_fixed(raw: U8, starts: I64, width: int) -> U8:
    """The ``width`` bytes at each start, as an (n, width) C-contiguous array."""
    out = np.empty(len(starts) * width, dtype=np.uint8)
    _tuples.gather_fixed(raw, np.ascontiguousarray(starts, dtype=np.int64), width, out, False)
    return out.reshape(-1, width)


def gather_be(raw: U8, starts: I64, dtype: str) -> NDArray[Any]:
    """The big-endian numbers of ``dtype`` (e.g. ``>i4``) at each start, in native byte order."""
    native = np.dtype(dtype).newbyteorder("=")
    out = np.empty(len(starts) * native.itemsize, dtype=np.uint8)
    _tuples.gather_fixed(raw, np.ascontiguousarray(starts, dtype=np.int64), native.itemsize, out, _SWAP)
    return out.view(native)


def gather_strings(raw: U8, starts: I64, lengths: I64, *, binary: bool = False) -> pa.Array:
    """The byte ranges as an Arrow string (not validated) or binary array."""
    offsets = np.empty(len(starts) + 1, dtype=np.int32)
    try:
        data = _tuples.gather_var(
            raw, np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64), offsets
        )
    except OverflowError:
        raise Bad("more than 2 GiB of values in one column chunk") from None
    t = pa.binary() if binary else pa.string()
    return pa.Array.from_buffers(t, len(starts), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def string_array(data: U8, offsets: I64, *, binary: bool = False) -> pa.Array:
    if offsets[-1] > INT32_MAX:
        raise Bad("more than 2 GiB of values in one column chunk")
    n = len(offsets) - 1
    t = pa.binary() if binary else pa.string()
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)])


def utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise Bad("invalid UTF-8") from None


class Part:
    """The non-null values of one wire format of one column chunk."""

    __slots__ = ("buf", "lengths", "notes", "raw", "rows", "starts")

    def __init__(self, buf: bytes, raw: U8, starts: I64, lengths: I64, rows: I64, notes: Notes) -> None:
        self.buf = buf
        self.raw = raw
        self.starts = starts
        self.lengths = lengths
        self.rows = rows
        self.notes = notes

    def values(self) -> list[bytes]:
        buf = self.buf
        return [buf[s : s + n] for s, n in zip(self.starts.tolist(), self.lengths.tolist(), strict=True)]


class Handler:
    """How one PostgreSQL type becomes Arrow. Subclasses override what they need."""

    arrow_type: pa.DataType = pa.string()
    server_printed = False  # values are the source server's text of them (see opaque)

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        return utf8(data)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return utf8(data)

    def pg_text(self, data: bytes) -> str:
        """PostgreSQL's text output of a binary value (for composites, ranges, arrays)."""
        return str(self.ref_binary(data, collections.Counter()))

    def vec_text(self, part: Part) -> pa.Array | None:
        return None

    def vec_binary(self, part: Part) -> pa.Array | None:
        return None

    def from_python(self, values: list[Any]) -> pa.Array:
        return pa.array(values, type=self.arrow_type)

    def build(self, part: Part, binary: bool, reference: bool) -> pa.Array | None:
        """The whole part decoded by the handler itself (arrays); None: the bulk and per-value paths."""
        return None


def check_len(part: Part, width: int) -> None:
    bad = np.flatnonzero(part.lengths != width)
    if len(bad):
        raise BadAt(int(bad[0]), f"binary value is not {width} bytes long")


def check_len1(data: bytes, width: int) -> None:
    if len(data) != width:
        raise Bad(f"binary value is not {width} bytes long")


def validated_strings(part: Part, starts: I64, lengths: I64) -> pa.Array:
    arr = gather_strings(part.raw, starts, lengths)
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            try:
                part.buf[start : start + length].decode("utf-8")
            except UnicodeDecodeError:
                raise BadAt(i, "invalid UTF-8") from None
        raise BadAt(0, "invalid UTF-8") from None
    return arr


class TextLike(Handler):
    """Types whose text and binary forms are the same UTF-8 text."""

    def vec_text(self, part: Part) -> pa.Array:
        return validated_strings(part, part.starts, part.lengths)

    def vec_binary(self, part: Part) -> pa.Array:
        return validated_strings(part, part.starts, part.lengths)

    def pg_text(self, data: bytes) -> str:
        return utf8(data)


class Printed(TextLike):
    """Types stored as PostgreSQL's text of them: text passes through, binary values are
    printed one by one by ``ref_binary`` (no bulk binary path)."""

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: Part) -> None:
        return None
