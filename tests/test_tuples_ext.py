"""The C extension ``pg2delta.decode._tuples`` on its own, against the pure-Python parser and codecs.

* ``walk_changes`` against :func:`pgoutput.parse_message` (the reference): on any bytes, the
  walk accepts a message exactly when the parser does and the tuples have the relation's
  column count, and then finds the same values; edge cases one by one, each also through
  the whole :class:`WindowDecoder`, which must raise a ``DecodeError`` naming tag, offset, LSN;
* ``gather_fixed`` / ``gather_var``: byte order, empty input, ranges outside the buffer;
* ``numeric_decimal128`` against the per-value reference path of the numeric codec, on
  valid values and on random bytes;
* mutated golden windows (no server needed) through the whole decoder: only ``DecodeError``.
"""

from __future__ import annotations

import collections
import struct
from decimal import Decimal
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pg2delta.decode import _tuples
from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import RowChunk, WindowDecoder
from pg2delta.decode.tuplewalk import walk_changes
from pg2delta.decode.typemap import KIND_BINARY, KIND_NULL, KIND_TEXT, KIND_TOAST, TypeInfo, codec_for
from pg2delta.errors import DecodeError
from test_pgoutput_golden import CAPTURES
from test_typemap import EXACT, OID, int_array, numeric_send, typmod_numeric

OID_REL = 16384


# --- building messages ----------------------------------------------------------------------


def tuple_bytes(values: list[bytes | str | None], *, count: int | None = None) -> bytes:
    """TupleData: bytes are binary values, 'u' unchanged TOAST, None NULL."""
    out = bytearray((len(values) if count is None else count).to_bytes(2, "big"))
    for v in values:
        if v is None:
            out += b"n"
        elif v == "u":
            out += b"u"
        else:
            assert isinstance(v, bytes)
            out += b"b" + len(v).to_bytes(4, "big") + v
    return bytes(out)


def insert(values: list[bytes | str | None]) -> bytes:
    return b"I" + OID_REL.to_bytes(4, "big") + b"N" + tuple_bytes(values)


def update(old: list[bytes | str | None] | None, new: list[bytes | str | None], marker: bytes = b"K") -> bytes:
    head = b"U" + OID_REL.to_bytes(4, "big")
    return head + (marker + tuple_bytes(old) if old is not None else b"") + b"N" + tuple_bytes(new)


def delete(old: list[bytes | str | None], marker: bytes = b"K") -> bytes:
    return b"D" + OID_REL.to_bytes(4, "big") + marker + tuple_bytes(old)


def walk(messages: list[bytes], ncols: int) -> tuple[Any, Any, Any, Any]:
    """walk_changes over plain (not streamed) messages, as build_batch calls it."""
    chunk = RowChunk.from_messages([(i, m) for i, m in enumerate(messages)])
    u8 = np.frombuffer(chunk.buf, dtype=np.uint8)
    tags = u8[chunk.starts] if len(chunk) else np.zeros(0, np.uint8)
    return walk_changes(chunk.buf, tags, chunk.starts + 5, chunk.ends, ncols)


def column_values(kinds: Any, starts: Any, lengths: Any, buf: bytes, row: int, ncols: int) -> list[Any]:
    out: list[Any] = []
    for c in range(ncols):
        k = int(kinds[c, row])
        if k == KIND_NULL:
            out.append(po.NULL)
        elif k == KIND_TOAST:
            out.append(po.UNCHANGED_TOAST)
        else:
            data = buf[int(starts[c, row]) : int(starts[c, row]) + int(lengths[c, row])]
            out.append(po.Text(data) if k == KIND_TEXT else po.Binary(data))
    return out


# --- walk_changes: edge cases ------------------------------------------------------------------


def test_zero_rows() -> None:
    new, old, markers, bad = walk([], 3)
    assert bad is None and old is None
    assert new.kinds.shape == (3, 0) and markers.shape == (0,)


def test_good_rows_all_shapes() -> None:
    one = (1).to_bytes(4, "big")
    msgs = [
        insert([one, None, b""]),
        update(None, [one, "u", b"x"]),
        update([one, None, None], [one, b"y", b"z"], b"K"),
        update([one, b"a", b"b"], [one, "u", b"z"], b"O"),
        delete([one, None, None], b"K"),
    ]
    new, old, markers, bad = walk(msgs, 3)
    assert bad is None and old is not None
    assert bytes(markers) == b"\0\0KOK"
    buf = b"".join(msgs)
    expect = [po.parse_message(m) for m in msgs]
    for i, msg in enumerate(expect):
        got_new = column_values(new.kinds, new.starts, new.lengths, buf, i, 3)
        got_old = column_values(old.kinds, old.starts, old.lengths, buf, i, 3)
        assert got_new == list(getattr(msg, "new", None) or (po.NULL,) * 3)
        assert got_old == list(getattr(msg, "old", None) or (po.NULL,) * 3)


BAD_CASES = [
    # (what, message, reason the walk gives)
    ("truncated tuple", insert([b"abc", b"de"])[:-1], "value length past the end of the message"),
    ("cut in a length", insert([b"abc", b"de"])[:-5], "tuple ends in a value length"),
    ("cut before a column", insert([b"abc", None])[:-1], "tuple ends before its last column"),
    ("cut in the column count", insert([b"abc", None])[:7], "tuple ends in its column count"),
    ("length past the end", insert([b"abc", None])[:9] + b"\x00\x00\x01\x00abcn", "value length past the end of the message"),
    ("negative length", insert([b"abc", None])[:9] + b"\xff\xff\xff\xfdabcn", "negative value length"),
    ("bad kind byte", insert([b"abc", None])[:-1] + b"x", "unknown value kind byte"),
    ("column count mismatch", b"I" + OID_REL.to_bytes(4, "big") + b"N" + tuple_bytes([b"a"]), "tuple column count differs from the relation's"),
    ("missing N tuple", b"I" + OID_REL.to_bytes(4, "big") + b"X" + tuple_bytes([b"a", b"b"]), "missing N tuple"),
    ("update without N", update([b"a", b"b"], [b"a", b"b"])[: -len(tuple_bytes([b"a", b"b"])) - 1], "missing N tuple"),
    ("delete without K/O", b"D" + OID_REL.to_bytes(4, "big") + b"N" + tuple_bytes([b"a", b"b"]), "delete without K or O tuple"),
    ("trailing byte", insert([b"a", b"b"]) + b"\0", "trailing bytes after tuple"),
    ("message ends at the marker", b"I" + OID_REL.to_bytes(4, "big"), "message ends before its tuple"),
    ("bad old tuple", update([b"a"], [b"a", b"b"]), "tuple column count differs from the relation's"),
]


@pytest.mark.parametrize(("what", "message", "why"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_malformed_row_is_reported(what: str, message: bytes, why: str) -> None:
    good = insert([b"x", None])
    _, _, _, bad = walk([good, message, good], 2)
    assert bad is not None, what
    row, reason, at = bad
    assert (row, reason) == (1, why)
    assert len(good) <= at <= len(good) + len(message)


@pytest.mark.parametrize(("what", "message", "why"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_malformed_row_through_the_decoder(what: str, message: bytes, why: str) -> None:
    rel = (
        b"R" + OID_REL.to_bytes(4, "big") + b"public\0t\0d" + (2).to_bytes(2, "big")
        + b"\x01id\0" + (17).to_bytes(4, "big") + (-1).to_bytes(4, "big", signed=True)
        + b"\x00v\0" + (17).to_bytes(4, "big") + (-1).to_bytes(4, "big", signed=True)
    )
    begin = b"B" + (100).to_bytes(8, "big") + (0).to_bytes(8, "big") + (7).to_bytes(4, "big")
    commit = b"C\0" + (100).to_bytes(8, "big") + (108).to_bytes(8, "big") + (0).to_bytes(8, "big")
    rows = [(1, begin), (2, rel), (3, insert([b"x", None])), (4, message), (5, commit)]
    dec = WindowDecoder()
    with pytest.raises(DecodeError) as info:
        dec.feed(RowChunk.from_messages(rows))
        dec.finish()
    err = info.value
    assert err.lsn == 4, what
    assert err.tag == chr(message[0])
    assert err.offset is not None and 0 <= err.offset <= len(message)


def test_row_bounds_outside_the_buffer_are_reported_not_read() -> None:
    buf = insert([b"a"])
    tags = np.frombuffer(b"I", dtype=np.uint8)
    for offs, ends in (([5], [len(buf) + 1]), ([-1], [len(buf)]), ([len(buf)], [len(buf)]), ([9], [5])):
        _, _, _, bad = walk_changes(buf, tags, np.array(offs, np.int64), np.array(ends, np.int64), 1)
        assert bad is not None and bad[0] == 0 and bad[1] == "message ends before its tuple"


def test_walk_rejects_wrong_array_sizes() -> None:
    buf = insert([b"a"])
    tags = np.frombuffer(b"I", dtype=np.uint8)
    small = np.empty(0, np.int64)
    with pytest.raises(ValueError, match="new_starts"):
        _tuples.walk_changes(
            buf, tags, np.array([5], np.int64), np.array([len(buf)], np.int64), 1,
            np.empty(1, np.uint8), small, np.empty(1, np.int64),
            np.empty(1, np.uint8), np.empty(1, np.int64), np.empty(1, np.int64), np.empty(1, np.uint8),
        )
    with pytest.raises(ValueError, match="offs"):
        _tuples.walk_changes(
            buf, tags, np.array([5], np.int32), np.array([len(buf)], np.int64), 1,
            *(np.empty(1, t) for t in (np.uint8, np.int64, np.int64, np.uint8, np.int64, np.int64, np.uint8)),
        )


# --- walk_changes == the reference parser, on any bytes -----------------------------------------

@st.composite
def change_messages(draw: st.DrawFn) -> tuple[bytes, int]:
    """A well-formed Insert/Update/Delete, then maybe damaged; and the relation's column count."""
    ncols = draw(st.integers(0, 5))
    vals = st.lists(st.one_of(st.none(), st.just("u"), st.binary(max_size=12)), min_size=ncols, max_size=ncols)
    kind = draw(st.sampled_from(["I", "U", "UK", "UO", "DK", "DO"]))
    if kind == "I":
        msg = insert(draw(vals))
    elif kind == "U":
        msg = update(None, draw(vals))
    elif kind[0] == "U":
        msg = update(draw(vals), draw(vals), kind[1].encode())
    else:
        msg = delete(draw(vals), kind[1].encode())
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        j = draw(st.integers(5, max(len(msg), 5)))
        byte = bytes([draw(st.integers(0, 255))])
        if op == "flip" and j < len(msg):
            msg = msg[:j] + byte + msg[j + 1 :]
        elif op == "cut":
            msg = msg[:j]
        elif op == "insert":
            msg = msg[:j] + byte + msg[j:]
        elif j < len(msg):
            msg = msg[:j] + msg[j + 1 :]
    return msg, draw(st.sampled_from([ncols, ncols, ncols + 1, max(ncols - 1, 0)]))


@settings(max_examples=1500, deadline=None)
@given(st.lists(change_messages(), min_size=1, max_size=4))
def test_walk_equals_the_reference_parser(cases: list[tuple[bytes, int]]) -> None:
    for msg, ncols in cases:
        try:
            ref: po.Message | None = po.parse_message(msg)
        except DecodeError:
            ref = None
        if ref is not None:
            tuples = [t for t in (getattr(ref, "old", None), getattr(ref, "new", None)) if t is not None]
            if any(len(t) != ncols for t in tuples):
                ref = None
        new, old, _, bad = walk([msg], ncols)
        assert (bad is None) == (ref is not None), (msg, ncols, bad)
        if ref is None:
            continue
        ref_new = getattr(ref, "new", None) or (po.NULL,) * ncols
        ref_old = getattr(ref, "old", None) or (po.NULL,) * ncols
        assert column_values(new.kinds, new.starts, new.lengths, msg, 0, ncols) == list(ref_new)
        if old is None:
            assert ref_old == (po.NULL,) * ncols and not isinstance(ref, po.Delete)
        else:
            assert column_values(old.kinds, old.starts, old.lengths, msg, 0, ncols) == list(ref_old)


# --- the gathers ------------------------------------------------------------------------------


def test_gather_fixed_byte_order_and_bounds() -> None:
    buf = bytes(range(16))
    starts = np.array([0, 4, 12], np.int64)
    out = np.empty(12, np.uint8)
    _tuples.gather_fixed(buf, starts, 4, out, False)
    assert bytes(out) == bytes([0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15])
    for width in (1, 2, 3, 4, 8, 16):
        out = np.empty(width * 2, np.uint8)
        _tuples.gather_fixed(buf, np.array([0, 16 - width], np.int64), width, out, True)
        assert bytes(out) == buf[:width][::-1] + buf[16 - width :][::-1]
    empty = np.empty(0, np.uint8)
    _tuples.gather_fixed(b"", np.empty(0, np.int64), 8, empty, True)
    for bad in ([13], [-1], [1 << 62]):
        with pytest.raises(IndexError):
            _tuples.gather_fixed(buf, np.array(bad, np.int64), 4, np.empty(4, np.uint8), True)
    with pytest.raises(ValueError, match="out"):
        _tuples.gather_fixed(buf, starts, 4, np.empty(11, np.uint8), True)


def test_gather_var_offsets_and_bounds() -> None:
    buf = b"hello world"
    offsets = np.empty(4, np.int32)
    data = _tuples.gather_var(buf, np.array([6, 0, 5], np.int64), np.array([5, 5, 0], np.int64), offsets)
    assert data == b"worldhello" and offsets.tolist() == [0, 5, 10, 10]
    offsets = np.empty(1, np.int32)
    assert _tuples.gather_var(b"", np.empty(0, np.int64), np.empty(0, np.int64), offsets) == b""
    assert offsets.tolist() == [0]
    for s, n in (([7], [5]), ([-1], [1]), ([0], [-1]), ([12], [0]), ([1], [1 << 62])):
        with pytest.raises(IndexError):
            _tuples.gather_var(buf, np.array(s, np.int64), np.array(n, np.int64), np.empty(2, np.int32))
    with pytest.raises(ValueError, match="offsets"):
        _tuples.gather_var(buf, np.array([0], np.int64), np.array([1], np.int64), np.empty(1, np.int32))


# --- numeric -> decimal128 == the reference path -------------------------------------------------


def both_paths(precision: int, scale: int, wire: list[bytes]) -> tuple[Any, Any]:
    """(fast, reference) results of the numeric(p,s) codec: values and notes, or the error text."""
    return codec_paths(codec_for(OID["numeric"], typmod_numeric(precision, scale)), wire)


def codec_paths(codec: Any, wire: list[bytes]) -> tuple[Any, Any]:
    """(fast, reference) results of a codec on binary values: values and notes, or the error text."""
    buf = b"".join(wire)
    lengths = np.array([len(w) for w in wire], np.int64)
    starts = np.cumsum(lengths) - lengths
    kinds = np.full(len(wire), KIND_BINARY, np.uint8)
    out = []
    for reference in (False, True):
        notes: collections.Counter[str] = collections.Counter()
        try:
            arr = codec.decode(buf, starts, lengths, kinds, notes, reference=reference)
            out.append((arr.type, arr.to_pylist(), dict(notes)))
        except DecodeError as exc:
            out.append(("error", str(exc)))
    return out[0], out[1]


def raw_numeric(ndigits: int, weight: int, sign: int, dscale: int, digits: list[int]) -> bytes:
    return struct.pack("!hhHh", ndigits, weight, sign, dscale) + b"".join(d.to_bytes(2, "big") for d in digits)


NUMERIC_CASES = [
    ("NaN", 12, 2, [numeric_send(Decimal("NaN")), numeric_send(Decimal("1.5"))]),
    ("infinity", 12, 2, [numeric_send(Decimal("Infinity"))]),
    ("largest", 12, 2, [numeric_send(Decimal("9999999999.99")), numeric_send(Decimal("-9999999999.99"))]),
    ("one too large", 12, 2, [numeric_send(Decimal("10000000000.00"))]),
    ("38 digits", 38, 0, [numeric_send(Decimal(10**38 - 1)), numeric_send(Decimal(-(10**38) + 1))]),
    ("38 digits + 1", 38, 0, [numeric_send(Decimal(10**38))]),
    ("38 digits, scale 38", 38, 38, [numeric_send(Decimal("0." + "9" * 38))]),
    ("too many decimals", 12, 2, [numeric_send(Decimal("1.005"))]),
    ("digits beyond dscale", 12, 2, [raw_numeric(2, 0, 0, 0, [1, 5000])]),
    ("zero digits beyond dscale", 12, 4, [raw_numeric(2, 0, 0, 1, [1, 5000])]),
    ("dscale past scale", 12, 2, [raw_numeric(2, 0, 0, 6, [1, 5000])]),
    ("negative zero", 12, 2, [raw_numeric(0, 0, 0x4000, 2, [])]),
    ("leading zero digit", 12, 2, [raw_numeric(2, 1, 0, 0, [0, 7])]),
    ("huge weight", 12, 2, [raw_numeric(1, 32767, 0, 0, [1]), raw_numeric(1, 32767, 0, 0, [0])]),
    ("tiny weight", 12, 2, [raw_numeric(1, -32768, 0, 0, [1]), raw_numeric(1, -32768, 0, 0, [0])]),
    ("digit out of range", 12, 2, [raw_numeric(1, 0, 0, 0, [10000])]),
    ("digit out of range in NaN", 12, 2, [raw_numeric(1, 0, 0xC000, 0, [10000])]),
    ("bad sign", 12, 2, [raw_numeric(1, 0, 0x1234, 0, [1])]),
    ("negative dscale", 12, 2, [raw_numeric(1, 0, 0, -1, [1])]),
    ("negative ndigits", 12, 2, [raw_numeric(-1, 0, 0, 0, [])]),
    ("length mismatch", 12, 2, [raw_numeric(2, 0, 0, 0, [1])]),
    ("short header", 12, 2, [b"\x00\x01\x00"]),
    ("scale 0", 5, 0, [numeric_send(Decimal("12345")), numeric_send(Decimal("-7"))]),
    ("scale 4", 9, 4, [numeric_send(Decimal("12345.6789")), numeric_send(Decimal("0.0001"))]),
    ("scale 5", 9, 5, [numeric_send(Decimal("1234.56789")), numeric_send(Decimal("-0.00001"))]),
]


@pytest.mark.parametrize(("what", "precision", "scale", "wire"), NUMERIC_CASES, ids=[c[0] for c in NUMERIC_CASES])
def test_numeric_edge_cases_equal_the_reference(what: str, precision: int, scale: int, wire: list[bytes]) -> None:
    fast, ref = both_paths(precision, scale, wire)
    assert fast == ref, what


def test_numeric_nan_is_null_and_counted() -> None:
    fast, _ = both_paths(12, 2, [numeric_send(Decimal("NaN")), numeric_send(Decimal("1.5"))])
    assert fast[1] == [None, Decimal("1.50")] and fast[2] == {"numeric_nan_nulled": 1}


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 38), st.data())
def test_numeric_random_bytes_equal_the_reference(precision: int, data: st.DataObject) -> None:
    scale = data.draw(st.integers(0, precision))
    bound = 10 ** min(precision + 1, 40)
    decimals = st.integers(-bound, bound).map(lambda u: numeric_send(Decimal(u).scaleb(-scale - data.draw(st.integers(-1, 1)), context=EXACT)))
    damaged = st.tuples(decimals, st.integers(0, 40), st.integers(0, 255)).map(
        lambda t: t[0][: t[1]] + bytes([t[2]]) + t[0][t[1] + 1 :]
    )
    wire = data.draw(st.lists(st.one_of(decimals, damaged, st.binary(max_size=14)), min_size=1, max_size=6))
    fast, ref = both_paths(precision, scale, wire)
    assert fast == ref


def test_numeric_rejects_bad_arguments() -> None:
    buf = numeric_send(Decimal(1))
    args = (np.array([0], np.int64), np.array([len(buf)], np.int64))
    with pytest.raises(ValueError):
        _tuples.numeric_decimal128(buf, *args, 2, 39, np.empty(16, np.uint8), np.empty(1, np.uint8))
    with pytest.raises(IndexError):
        _tuples.numeric_decimal128(buf, args[0], args[1] + 1, 2, 12, np.empty(16, np.uint8), np.empty(1, np.uint8))


# --- unbounded numeric -> text, one-dimensional arrays == the reference path ----------------------

NUMERIC_TEXT_CASES = [
    numeric_send(Decimal("NaN")),
    numeric_send(Decimal("Infinity")),
    numeric_send(Decimal("-Infinity")),
    numeric_send(Decimal("0")),
    numeric_send(Decimal("0.000")),
    numeric_send(Decimal("-123456789.000100")),
    numeric_send(Decimal("1E+40")),
    numeric_send(Decimal("1E-40")),
    numeric_send(Decimal("10000")),
    raw_numeric(0, 0, 0x4000, 2, []),  # negative zero: the reference prints "-0.00"
    raw_numeric(2, 0, 0, 0, [1, 5000]),  # digits past dscale are not printed
    raw_numeric(1, -3, 0, 9, [7]),
    raw_numeric(1, 2, 0, 0, [0]),  # a leading zero digit
    raw_numeric(1, 0, 0xC000, 3, [5]),  # NaN with digits
]
NUMERIC_TEXT_BAD = [
    raw_numeric(1, 0, 0, 0, [10000]),
    raw_numeric(1, 0, 0x1234, 0, [1]),
    raw_numeric(1, 0, 0, -1, [1]),
    raw_numeric(2, 0, 0, 0, [1]),
    b"\x00\x01",
]


def test_numeric_text_edge_cases_equal_the_reference() -> None:
    codec = codec_for(OID["numeric"], -1)
    fast, ref = codec_paths(codec, NUMERIC_TEXT_CASES)
    assert fast == ref and fast[1][9] == "-0.00" and fast[1][10] == "1"
    for bad in NUMERIC_TEXT_BAD:
        fast, ref = codec_paths(codec, [numeric_send(Decimal(1)), bad])
        assert fast == ref and fast[0] == "error", bad


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_numeric_text_random_bytes_equal_the_reference(data: st.DataObject) -> None:
    decimals = st.decimals(allow_nan=True, allow_infinity=True, places=None).filter(
        lambda d: not d.is_finite() or (-60 < int(d.as_tuple().exponent) < 60 and len(d.as_tuple().digits) < 60)
    ).map(numeric_send)
    damaged = st.tuples(decimals, st.integers(0, 30), st.integers(0, 255)).map(
        lambda t: t[0][: t[1]] + bytes([t[2]]) + t[0][t[1] + 1 :]
    )
    wire = data.draw(st.lists(st.one_of(decimals, damaged, st.binary(max_size=14)), min_size=1, max_size=6))
    fast, ref = codec_paths(codec_for(OID["numeric"], -1), wire)
    assert fast == ref


ARRAY_VALUES = st.lists(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), max_size=6)


@st.composite
def int_arrays(draw: st.DrawFn) -> bytes:
    values = draw(ARRAY_VALUES)
    shape = draw(st.sampled_from(["1d", "1d", "empty", "lb0", "2d", "damaged", "other type"]))
    if shape == "empty":
        return int_array([], [])
    if shape == "lb0":
        return int_array(values, lb=0)
    if shape == "2d" and len(values) % 2 == 0:
        return int_array(values, [2, len(values) // 2])
    wire = int_array(values)
    if shape == "other type":
        return wire[:8] + OID["int8"].to_bytes(4, "big") + wire[12:]
    if shape == "damaged":
        j = draw(st.integers(0, len(wire)))
        return wire[:j] + bytes([draw(st.integers(0, 255))]) + wire[j + 1 :]
    return wire


@settings(max_examples=300, deadline=None)
@given(st.lists(int_arrays(), min_size=1, max_size=6), st.sampled_from([1, 2]))
def test_arrays_equal_the_reference(wire: list[bytes], ndims: int) -> None:
    fast, ref = codec_paths(codec_for(OID["_int4"], -1, ndims=ndims), wire)
    assert fast == ref


def test_array_walk_edge_cases() -> None:
    good = [int_array([1, None, 3]), int_array([], []), int_array([], [0])]
    buf = b"".join(good)
    lengths = np.array([len(w) for w in good], np.int64)
    starts = np.cumsum(lengths) - lengths
    counts = np.empty(3, np.int64)
    assert _tuples.array_counts(buf, starts, lengths, OID["int4"], counts) == -1
    assert counts.tolist() == [3, 0, 0]
    estarts, elens = np.empty(3, np.int64), np.empty(3, np.int64)
    assert _tuples.array_elements(buf, starts, lengths, OID["int4"], estarts, elens) == -1
    assert elens.tolist() == [4, -1, 4] and buf[int(estarts[0]) : int(estarts[0]) + 4] == (1).to_bytes(4, "big")
    # room for fewer or more elements than there are
    assert _tuples.array_elements(buf, starts, lengths, OID["int4"], np.empty(2, np.int64), np.empty(2, np.int64)) == 0
    assert _tuples.array_elements(buf, starts, lengths, OID["int4"], np.empty(4, np.int64), np.empty(4, np.int64)) == 3
    # not for the fast path: another element type, lower bound 0, two dimensions, truncated
    for i, bad in enumerate([
        int_array([1])[:8] + OID["int8"].to_bytes(4, "big") + int_array([1])[12:],
        int_array([1], lb=0),
        int_array([1, 2], [1, 2]),
        int_array([1, 2])[:-1],
        int_array([1]) + b"\0",
    ]):
        w = [good[0], bad]
        b = b"".join(w)
        ln = np.array([len(x) for x in w], np.int64)
        assert _tuples.array_counts(b, np.cumsum(ln) - ln, ln, OID["int4"], np.empty(2, np.int64)) == 1, i
    with pytest.raises(IndexError):
        _tuples.array_counts(buf, starts, lengths + 1, 0, counts)


# --- mutated golden windows through the whole decoder -------------------------------------------


class GoldenCatalog:
    """The two user types of the golden DML captures: an enum and a domain over int4."""

    def __init__(self, types: dict[str, int]) -> None:
        self._info = {
            types.get("mood", -1): TypeInfo(types.get("mood", -1), "public", "mood", "e"),
            types.get("posint", -1): TypeInfo(types.get("posint", -1), "public", "posint", "d", base_oid=OID["int4"]),
        }

    def type_info(self, oid: int) -> TypeInfo | None:
        return self._info.get(oid)


def decode_capture(rows: list[tuple[int, bytes]], types: dict[str, int], chunk: int) -> int:
    dec = WindowDecoder(GoldenCatalog(types))
    out = [dec.feed(RowChunk.from_messages(rows[i : i + chunk])) for i in range(0, len(rows), chunk)]
    out.append(dec.finish())
    return sum(b.batch.num_rows for o in out for b in o.changes)


def test_golden_windows_decode_unmutated() -> None:
    for cap in CAPTURES:
        rows = [(r.lsn, r.data) for r in cap.rows]
        assert decode_capture(rows, cap.facts.get("types", {}), len(rows)) > 0, cap.id


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(CAPTURES),
    st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=3),
    st.sampled_from([1, 5, 1000]),
)
def test_mutated_golden_windows_raise_only_decode_error(cap: Any, mutations: list[tuple[str, int, int, int]], chunk: int) -> None:
    rows = [(r.lsn, r.data) for r in cap.rows]
    changes = [i for i, (_, d) in enumerate(rows) if d[:1] in (b"I", b"U", b"D")]
    for op, r, off, byte in mutations:
        i = changes[r % len(changes)]  # damage the change messages: the walk reads those
        lsn, data = rows[i]
        j = off % len(data)
        if op == "flip":
            data = data[:j] + bytes([byte]) + data[j + 1 :]
        elif op == "cut":
            data = data[: max(j, 1)]
        elif op == "insert":
            data = data[:j] + bytes([byte]) + data[j:]
        else:
            data = data[:j] + data[j + 1 :] or data
        rows[i] = (lsn, data)
    lsns = {lsn for lsn, _ in rows}
    try:
        decode_capture(rows, cap.facts.get("types", {}), chunk)
    except DecodeError as exc:
        assert exc.lsn in lsns, str(exc)


# --- walk_copy: binary COPY rows ------------------------------------------------------------------

COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + (0).to_bytes(4, "big") + (0).to_bytes(4, "big")
COPY_TRAILER = b"\xff\xff"


def copy_row(values: list[bytes | None], *, count: int | None = None) -> bytes:
    """One binary COPY row: Int16 field count, per field Int32 length (-1: NULL) and the bytes."""
    out = bytearray((len(values) if count is None else count).to_bytes(2, "big"))
    for v in values:
        out += b"\xff\xff\xff\xff" if v is None else len(v).to_bytes(4, "big") + v
    return bytes(out)


def copy_walk(buf: bytes, ncols: int, cap: int, pos: int = 0, value_kinds: bytes | None = None) -> tuple[Any, ...]:
    kinds = np.zeros((ncols, cap), np.uint8)
    starts = np.zeros((ncols, cap), np.int64)
    lengths = np.zeros((ncols, cap), np.int64)
    vk = bytes([KIND_BINARY]) * ncols if value_kinds is None else value_kinds
    n, nxt, status, reason = _tuples.walk_copy(buf, pos, ncols, vk, kinds, starts, lengths)
    return n, nxt, status, reason, kinds, starts, lengths


def test_walk_copy_rows_nulls_and_trailer() -> None:
    rows = [[b"\x00\x00\x00\x01", None, b""], [None, b"abc", b"\x01"]]
    buf = b"".join(copy_row(r) for r in rows) + COPY_TRAILER
    n, nxt, status, reason, kinds, starts, lengths = copy_walk(buf, 3, 4, value_kinds=bytes([KIND_BINARY, KIND_TEXT, KIND_BINARY]))
    assert (n, nxt, status, reason) == (2, len(buf), 1, None)
    got = [[None if kinds[c, r] == KIND_NULL else buf[starts[c, r] : starts[c, r] + lengths[c, r]] for c in range(3)]
           for r in range(2)]
    assert got == rows
    assert kinds[:, 1].tolist() == [KIND_NULL, KIND_TEXT, KIND_BINARY]


def test_walk_copy_stops_at_cap_and_at_a_cut_row() -> None:
    rows = [copy_row([bytes([i]) * i]) for i in range(5)]
    buf = b"".join(rows)
    n, nxt, status, _, *_ = copy_walk(buf, 1, 3)
    assert (n, nxt, status) == (3, len(b"".join(rows[:3])), 0)
    n, nxt2, status, _, *_ = copy_walk(buf, 1, 3, pos=nxt)
    assert (n, nxt2, status) == (2, len(buf), 0)
    for cut in range(1, len(rows[4])):  # a row cut anywhere is not walked: it waits for its rest
        part = b"".join(rows[:4]) + rows[4][:cut]
        n, nxt, status, reason, *_ = copy_walk(part, 1, 8)
        assert (n, nxt, status, reason) == (4, len(b"".join(rows[:4])), 0, None)
    assert copy_walk(b"", 1, 8)[:3] == (0, 0, 0)


@pytest.mark.parametrize(
    ("what", "buf", "ncols", "bad_row", "why"),
    [
        ("field count", copy_row([b"a"]) + copy_row([b"a", b"b"]), 1, 1, "field count"),
        ("field count 0", copy_row([], count=0), 1, 0, "field count"),
        ("negative length", copy_row([b"a"]) + b"\x00\x01\xff\xff\xff\xfe", 1, 1, "negative field length"),
        ("length 2**31", b"\x00\x01\x80\x00\x00\x00", 1, 0, "negative field length"),
    ],
)
def test_walk_copy_malformed_rows(what: str, buf: bytes, ncols: int, bad_row: int, why: str) -> None:
    n, nxt, status, reason, *_ = copy_walk(buf, ncols, 4)
    assert status == 2, what
    assert n == bad_row and reason is not None and why in reason
    assert 0 <= nxt <= len(buf)


def test_walk_copy_rejects_bad_arguments() -> None:
    buf = copy_row([b"a"])
    one = np.zeros((1, 2), np.uint8)
    with pytest.raises(ValueError, match="ncols"):
        _tuples.walk_copy(buf, 0, 0, b"", one, np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="value_kinds"):
        _tuples.walk_copy(buf, 0, 1, b"bb", one, np.zeros(2, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="starts"):
        _tuples.walk_copy(buf, 0, 1, b"b", one, np.zeros(1, np.int64), np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="multiple"):
        _tuples.walk_copy(buf, 0, 2, b"bb", np.zeros(3, np.uint8), np.zeros(2, np.int64), np.zeros(2, np.int64))
    for pos in (-1, len(buf) + 1):
        with pytest.raises(IndexError):
            _tuples.walk_copy(buf, pos, 1, b"b", one, np.zeros(2, np.int64), np.zeros(2, np.int64))


def parse_copy_rows(buf: bytes, ncols: int) -> tuple[list[list[bytes | None]], int, bool] | None:
    """Reference walk in Python: the whole rows, where they end, whether the trailer followed; None: malformed."""
    rows: list[list[bytes | None]] = []
    pos = 0
    while True:
        if len(buf) - pos < 2:
            return rows, pos, False
        (count,) = struct.unpack_from(">h", buf, pos)
        if count == -1:
            return rows, pos + 2, True
        if count != ncols:
            return None
        q, row = pos + 2, []
        for _ in range(ncols):
            if len(buf) - q < 4:
                return rows, pos, False
            (length,) = struct.unpack_from(">i", buf, q)
            if length < -1:
                return None
            if length == -1:
                row.append(None)
                q += 4
                continue
            if len(buf) - q - 4 < length:
                return rows, pos, False
            row.append(buf[q + 4 : q + 4 + length])
            q += 4 + length
        rows.append(row)
        pos = q


@settings(max_examples=1000, deadline=None)
@given(st.integers(1, 4), st.data())
def test_walk_copy_equals_the_reference_on_any_bytes(ncols: int, data: st.DataObject) -> None:
    rows = data.draw(st.lists(st.lists(st.one_of(st.none(), st.binary(max_size=9)), min_size=ncols, max_size=ncols),
                              max_size=6))
    buf = b"".join(copy_row(r) for r in rows) + data.draw(st.sampled_from([b"", COPY_TRAILER]))
    for _ in range(data.draw(st.integers(0, 2))):  # damage: flip, cut or insert a byte
        j = data.draw(st.integers(0, len(buf)))
        byte = bytes([data.draw(st.integers(0, 255))])
        buf = data.draw(st.sampled_from([buf[:j] + byte + buf[j + 1 :], buf[:j], buf[:j] + byte + buf[j:]]))
    cap = data.draw(st.integers(1, 8))
    ref = parse_copy_rows(buf, ncols)
    got: list[list[bytes | None]] = []
    pos, status = 0, 0
    while True:
        n, nxt, status, reason, kinds, starts, lengths = copy_walk(buf, ncols, cap, pos)
        assert 0 <= nxt <= len(buf)
        if status == 2:
            assert reason
            break
        for r in range(n):
            assert all(0 <= starts[c, r] <= starts[c, r] + lengths[c, r] <= len(buf) for c in range(ncols))
            got.append([None if kinds[c, r] == KIND_NULL else buf[starts[c, r] : starts[c, r] + lengths[c, r]]
                        for c in range(ncols)])
        pos = nxt
        if status == 1 or n < cap:
            break
    if ref is None:
        assert status == 2
        return
    ref_rows, ref_end, ref_trailer = ref
    assert status != 2
    assert got == ref_rows and pos == ref_end and (status == 1) == ref_trailer


def test_hash_ranges_is_fnv1a_of_each_range() -> None:
    buf = b"aabcabc"
    out = np.empty(4, dtype=np.uint64)
    _tuples.hash_ranges(buf, np.array([0, 1, 4, 7], np.int64), np.array([1, 3, 3, 0], np.int64), out)
    assert int(out[0]) == 0xAF63DC4C8601EC8C  # FNV-1a 64 of b"a"
    assert out[1] == out[2]  # b"abc" twice, at two places
    assert int(out[3]) == 0xCBF29CE484222325  # the empty value: the offset basis
    with pytest.raises(IndexError):
        _tuples.hash_ranges(buf, np.array([5], np.int64), np.array([3], np.int64), np.empty(1, dtype=np.uint64))
    with pytest.raises(ValueError):
        _tuples.hash_ranges(buf, np.array([0], np.int64), np.array([1], np.int64), np.empty(2, dtype=np.uint64))
