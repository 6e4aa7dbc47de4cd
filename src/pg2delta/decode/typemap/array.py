"""Arrays: ``T[]`` as Arrow lists of the element codec's type, nested ``ndims`` deep.

Binary arrays are array_send's layout (``_parse_binary_array``; one-dimensional ones with lower
bound 1 are walked in the C extension), text arrays array_in's syntax (``_parse_text_array``).
Every element of a column chunk is decoded in one call of the element's codec, then the
values are nested by the arrays' shapes (flattened or padded to the column's ``ndims``, counted
in notes). Also int2vector and oidvector (array_send on the wire, space separated in text), and
:func:`value_of_text_array` for catalog values held as a one-element array.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from pg2delta.decode import _tuples
from pg2delta.decode.typemap.codec import KIND_BINARY, KIND_NULL, KIND_TEXT, ColumnCodec
from pg2delta.decode.typemap.handler import INT32_MAX, Bad, BadAt, Handler, Notes, Part, Printed, utf8
from pg2delta.errors import DecodeError

_ARRAY_HEAD = struct.Struct("!iiI")
_I32 = struct.Struct("!i")
_I32I32 = struct.Struct("!ii")


def _parse_binary_array(
    data: bytes, offset: int = 0
) -> tuple[list[int], list[int], int, list[tuple[int, int]]]:
    """array_recv layout: dims, lower bounds, element oid and (start, length) of each element (-1 NULL)."""
    end = len(data)
    try:
        ndim, _flags, elem = _ARRAY_HEAD.unpack_from(data, offset)
        if ndim < 0 or ndim > 6:
            raise Bad("array has an invalid dimension count")
        pos = offset + 12
        dims, lbs = [], []
        for _ in range(ndim):
            d, lb = _I32I32.unpack_from(data, pos)
            if d < 0:
                raise Bad("array has a negative dimension")
            dims.append(d)
            lbs.append(lb)
            pos += 8
        count = 1
        for d in dims:
            count *= d
        if ndim == 0:
            count = 0
        if count > end:
            raise Bad("array claims more elements than it has bytes")
        items = []
        for _ in range(count):
            (n,) = _I32.unpack_from(data, pos)
            pos += 4
            if n < -1 or pos + max(n, 0) > end:
                raise Bad("array element overruns the value")
            items.append((pos, n))
            pos += max(n, 0)
    except struct.error:
        raise Bad("array value is truncated") from None
    if pos != end:
        raise Bad("array value has trailing bytes")
    return dims, lbs, elem, items


def _array_text(dims: list[int], items: list[str | None], delim: str = ",") -> str:
    if not dims:
        return "{}"

    def quote(v: str | None) -> str:
        if v is None:
            return "NULL"
        if v == "" or v.upper() == "NULL" or any(c in '"\\{}' or c == delim or c.isspace() for c in v):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return v

    it = iter(items)

    def level(k: int) -> str:
        if k == len(dims) - 1:
            return "{" + delim.join(quote(next(it)) for _ in range(dims[k])) + "}"
        return "{" + delim.join(level(k + 1) for _ in range(dims[k])) + "}"

    return level(0)


def _parse_text_array(text: str, delim: str = ",") -> tuple[list[int], list[int], list[str | None]]:
    """array_in's syntax: optional '[lb:ub]...=' prefix, nested braces, quoted elements.

    ``delim`` separates elements: the element type's ``pg_type.typdelim`` (``;`` for box).
    Returns the dimensions, the lower bounds and the elements in row-major order.
    """
    pos = 0
    lbs: list[int] = []
    if text.startswith("["):
        m = re.match(r"((?:\[-?\d+:-?\d+\])+)=", text)
        if m is None:
            raise Bad("bad array dimension prefix")
        lbs = [int(a) for a, _ in re.findall(r"\[(-?\d+):(-?\d+)\]", m.group(1))]
        pos = m.end()
    nested, end = _braces(text, pos, delim)
    if text[end:].strip():
        raise Bad("trailing text after array")
    dims = _dims_of(nested)
    if dims == [0]:
        return [], [], []
    flat: list[str | None] = []
    _flatten(nested, dims, 0, flat)
    if lbs and len(lbs) != len(dims):
        raise Bad("array dimension prefix does not match")
    return dims, lbs or [1] * len(dims), flat


def _braces(text: str, p: int, delim: str) -> tuple[list[Any], int]:
    """The brace-enclosed level at ``text[p]``: its items (lists for inner levels) and the position after it."""
    n = len(text)
    if p >= n or text[p] != "{":
        raise Bad("array text is missing a brace")
    p += 1
    out: list[Any] = []
    if p < n and text[p] == "}":
        return out, p + 1
    while True:
        while p < n and text[p].isspace():
            p += 1
        item: Any
        if p < n and text[p] == "{":
            item, p = _braces(text, p, delim)
        elif p < n and text[p] == '"':
            item, p = _quoted_element(text, p + 1)
        else:
            item, p = _bare_element(text, p, delim)
        out.append(item)
        while p < n and text[p].isspace():
            p += 1
        if p >= n:
            raise Bad("unterminated array")
        if text[p] == delim:
            p += 1
            continue
        if text[p] == "}":
            return out, p + 1
        raise Bad("bad array text")


def _quoted_element(text: str, p: int) -> tuple[str, int]:
    """A double-quoted element whose text starts at ``text[p]``, a backslash taking the next
    character as it is; and the position after its closing quote."""
    n = len(text)
    buf = []
    while p < n and text[p] != '"':
        if text[p] == "\\":
            p += 1
        if p >= n:
            raise Bad("unterminated array element")
        buf.append(text[p])
        p += 1
    if p >= n:
        raise Bad("unterminated array element")
    return "".join(buf), p + 1


def _bare_element(text: str, p: int, delim: str) -> tuple[str | None, int]:
    """An unquoted element from ``text[p]`` to the next delimiter or closing brace, trimmed (None
    for NULL unless a backslash made it literal); and the position after it."""
    n = len(text)
    buf = []
    quoted = False
    while p < n and text[p] != delim and text[p] != "}":
        if text[p] == "\\":
            p += 1
            quoted = True
            if p >= n:
                raise Bad("unterminated array element")
        buf.append(text[p])
        p += 1
    raw_el = "".join(buf).strip()
    return (None if raw_el.upper() == "NULL" and not quoted else raw_el), p


def _dims_of(nested: list[Any]) -> list[int]:
    """The dimensions as the first item of each level has them (:func:`_flatten` checks the rest)."""
    dims: list[int] = []
    probe: Any = nested
    while isinstance(probe, list):
        dims.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    return dims


def _flatten(v: Any, dims: list[int], k: int, flat: list[str | None]) -> None:
    """Append the elements under level ``k`` of ``v`` to ``flat``, row-major; Bad unless rectangular."""
    if k == len(dims):
        if isinstance(v, list):
            raise Bad("array is not rectangular")
        flat.append(v)
        return
    if not isinstance(v, list) or len(v) != dims[k]:
        raise Bad("array is not rectangular")
    for x in v:
        _flatten(x, dims, k + 1, flat)


class PgArray(Handler):
    def __init__(self, elem: ColumnCodec, ndims: int, elem_oid: int) -> None:
        self.elem = elem
        self.ndims = ndims
        self.elem_oid = elem_oid
        t: pa.DataType = elem.arrow_type
        for _ in range(ndims):
            t = pa.list_(t)
        self.arrow_type = t

    def pg_text(self, data: bytes) -> str:
        dims, _lbs, _elem, items = _parse_binary_array(data)
        h = self.elem.handler
        return _array_text(dims, [None if n < 0 else h.pg_text(data[s : s + n]) for s, n in items])

    def _shape(self, dims: list[int], lbs: list[int], notes: Notes) -> list[int]:
        if any(lb != 1 for lb in lbs):
            notes["array_lower_bound_dropped"] += 1
        if not dims or 0 in dims:
            return []
        if len(dims) > self.ndims:  # PostgreSQL does not enforce declared dimensions
            notes["array_dims_flattened"] += 1
            extra = len(dims) - self.ndims
            lead = 1
            for d in dims[: extra + 1]:
                lead *= d
            return [lead, *dims[extra + 1 :]]
        if len(dims) < self.ndims:
            notes["array_dims_padded"] += 1
            return [1] * (self.ndims - len(dims)) + dims
        return dims

    def _build_1d(self, part: Part) -> pa.Array | None:
        """Binary one-dimensional arrays with lower bound 1 (the usual case), walked in C;
        None when a value is anything else (the general path then handles it)."""
        starts = np.ascontiguousarray(part.starts, dtype=np.int64)
        lengths = np.ascontiguousarray(part.lengths, dtype=np.int64)
        counts = np.empty(len(starts), dtype=np.int64)
        if _tuples.array_counts(part.raw, starts, lengths, self.elem_oid, counts) >= 0:
            return None
        total = int(counts.sum())
        estarts = np.empty(total, dtype=np.int64)
        elens = np.empty(total, dtype=np.int64)
        if _tuples.array_elements(part.raw, starts, lengths, self.elem_oid, estarts, elens) >= 0:
            return None
        kinds = np.where(elens < 0, KIND_NULL, KIND_BINARY).astype(np.uint8)
        try:
            values = self.elem.decode(part.buf, estarts, np.maximum(elens, 0), kinds, part.notes)
        except DecodeError as exc:
            raise BadAt(0, f"bad array element: {exc.reason}") from None
        offsets = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        if offsets[-1] > INT32_MAX:
            raise Bad("more than 2**31 array elements in one column chunk")
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)

    def build(self, part: Part, binary: bool, reference: bool) -> pa.Array:
        """Decode all arrays of the part: elements in one call of the element codec."""
        if binary and self.ndims == 1 and not reference:
            fast = self._build_1d(part)
            if fast is not None:
                return fast
        shapes: list[list[int]] = []
        if binary:
            ebuf = part.buf
            estarts: list[int] = []
            elens: list[int] = []
            for i, (s, n) in enumerate(zip(part.starts.tolist(), part.lengths.tolist(), strict=True)):
                try:
                    dims, lbs, elem, items = _parse_binary_array(part.buf[s : s + n])
                    if items and elem != self.elem_oid and self.elem_oid:
                        raise Bad("array element type does not match the column type")
                    shapes.append(self._shape(dims, lbs, part.notes))
                except Bad as exc:
                    raise BadAt(i, str(exc)) from None
                for es, en in items:
                    estarts.append(s + es)
                    elens.append(en)
            lens = np.asarray(elens, dtype=np.int64)
            kinds = np.where(lens < 0, KIND_NULL, KIND_BINARY).astype(np.uint8)
            starts = np.asarray(estarts, dtype=np.int64)
        else:
            pieces: list[bytes | None] = []
            for i, data in enumerate(part.values()):
                try:
                    dims, lbs, flat = _parse_text_array(utf8(data))
                    shapes.append(self._shape(dims, lbs, part.notes))
                except Bad as exc:
                    raise BadAt(i, str(exc)) from None
                pieces.extend(None if v is None else v.encode() for v in flat)
            lens = np.asarray([-1 if p is None else len(p) for p in pieces], dtype=np.int64)
            starts = np.zeros(len(pieces), dtype=np.int64)
            if len(pieces):
                np.cumsum(np.maximum(lens, 0)[:-1], out=starts[1:])
            ebuf = b"".join(p for p in pieces if p is not None)
            kinds = np.where(lens < 0, KIND_NULL, KIND_TEXT).astype(np.uint8)
        try:
            values = self.elem.decode(
                ebuf, starts, np.maximum(lens, 0), kinds, part.notes, reference=reference
            )
        except DecodeError as exc:
            raise BadAt(0, f"bad array element: {exc.reason}") from None
        return _nested(values, shapes, self.ndims)


def _nested(values: pa.Array, shapes: list[list[int]], ndims: int) -> pa.Array:
    """The flat element ``values`` as ``ndims`` levels of lists, one array per entry of ``shapes``
    (its dimensions; empty: an empty array)."""
    # nest: innermost level first
    levels: list[list[int]] = [[0] for _ in range(ndims)]
    for dims in shapes:
        if not dims:
            levels[0].append(levels[0][-1])
            continue
        count = 1
        for k, d in enumerate(dims):
            for _ in range(count):
                levels[k].append(levels[k][-1] + d)
            count *= d
    arr: pa.Array = values
    for k in range(ndims - 1, -1, -1):
        arr = pa.ListArray.from_arrays(pa.array(levels[k], type=pa.int32()), arr)
    return arr


class _IntVector(Printed):
    """int2vector / oidvector: array_send on the wire, space separated in text."""

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _ndim, _lb, _elem, items = _parse_binary_array(data)
        return " ".join(str(int.from_bytes(data[s : s + n], "big", signed=True)) for s, n in items if n >= 0)


def value_of_text_array(codec: ColumnCodec, text: str, *, delim: str = ",", notes: Notes | None = None) -> pa.Scalar:
    """The one element of a one-element array in PostgreSQL's text form, as ``codec`` decodes it.

    For values the catalog holds as such an array, e.g. ``pg_attribute.attmissingval::text``
    (``{7}``, ``{"a b"}``, ``{"{1,2}"}`` for an ``int4[]`` column): the element goes through the
    codec's text path, as a text-format wire value of the column would (same Arrow type, same
    clamping and notes). ``delim`` is the element type's ``pg_type.typdelim``. The text must be
    printed with the settings text forms assume (see the module docstring). Raises
    :class:`~pg2delta.errors.DecodeError` for text that is not a one-element array of the type.
    """
    try:
        dims, _lbs, items = _parse_text_array(text, delim)
    except Bad as exc:
        raise DecodeError(f"{codec.pg_type}: {exc}") from None
    if dims != [1] or items[0] is None:
        raise DecodeError(f"{codec.pg_type}: expected a one-element array, got {len(items)} elements")
    data = items[0].encode()
    array = codec.decode(
        data,
        np.zeros(1, dtype=np.int64),
        np.array([len(data)], dtype=np.int64),
        np.array([KIND_TEXT], dtype=np.uint8),
        notes,
    )
    return array[0]


BUILTIN: dict[str, Callable[[], Handler]] = {"int2vector": _IntVector, "oidvector": _IntVector}
