"""Unit and property tests of the value layer (no server).

Wire bytes are built here from the documented send formats; every decode runs through
both the vectorized path and the per-value reference path, which must agree.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import decimal
import math
import struct
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pg2delta.decode import _oids
from pg2delta.decode.typemap import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_TOAST,
    TypeInfo,
    arrow_schema,
    codec_for,
    numeric_typmod,
    value_of_text_array,
)
from pg2delta.errors import DecodeError

OID = {t.name: t.oid for t in _oids.TYPES}
PG_EPOCH = dt.datetime(2000, 1, 1)
EXACT = decimal.Context(prec=100)


def typmod_numeric(p: int, s: int) -> int:
    return ((p << 16) | (s & 0x7FF)) + 4


def run(
    oid: int, values: Sequence[bytes | None], kind: int, typmod: int = -1, catalog: Any = None, ndims: int = 1
) -> tuple[list[Any], collections.Counter[str]]:
    """Decode values (None -> NULL) laid out with junk between them; vectorized == reference."""
    buf = bytearray(b"\xee\xee")
    starts, lengths, kinds = [], [], []
    for v in values:
        starts.append(len(buf))
        lengths.append(0 if v is None else len(v))
        kinds.append(KIND_NULL if v is None else kind)
        buf += (v or b"") + b"\xee"
    codec = codec_for(oid, typmod, catalog, ndims=ndims)
    args = (
        bytes(buf),
        np.array(starts, dtype=np.int64),
        np.array(lengths, dtype=np.int64),
        np.array(kinds, dtype=np.uint8),
    )
    notes: collections.Counter[str] = collections.Counter()
    fast = codec.decode(*args, notes)
    ref_notes: collections.Counter[str] = collections.Counter()
    ref = codec.decode(*args, ref_notes, reference=True)
    assert fast.type == codec.arrow_type == ref.type
    assert norm(fast.to_pylist()) == norm(ref.to_pylist())
    assert notes == ref_notes
    return fast.to_pylist(), notes


def norm(v: Any) -> Any:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else struct.pack("!d", v)
    if isinstance(v, list):
        return [norm(x) for x in v]
    return v


def numeric_send(d: Decimal) -> bytes:
    if d.is_nan():
        return struct.pack("!hhHh", 0, 0, 0xC000, 0)
    if d.is_infinite():
        return struct.pack("!hhHh", 0, 0, 0xF000 if d < 0 else 0xD000, 0)
    sign, digits, exp = d.as_tuple()
    assert isinstance(exp, int)
    dscale = max(-exp, 0)
    n = int("".join(map(str, digits)) or "0")
    pad = exp % 4
    n *= 10**pad
    e = exp - pad
    groups = []
    while n:
        groups.append(n % 10000)
        n //= 10000
    groups.reverse()
    weight = len(groups) - 1 + e // 4
    while groups and groups[-1] == 0:
        groups.pop()
    while groups and groups[0] == 0:
        groups.pop(0)
        weight -= 1
    if not groups:
        weight = 0
    head = struct.pack("!hhHh", len(groups), weight, 0x4000 if sign else 0, dscale)
    return head + struct.pack(f"!{len(groups)}H", *groups)


# ------------------------------------------------------------------ unit tests


def test_kinds_nulls_toast_and_mixed_formats() -> None:
    values = [b"\x00\x00\x00\x07", None, b"12"]
    buf = b"".join(v or b"" for v in values) + b"x"
    codec = codec_for(OID["int4"], -1)
    out = codec.decode(
        buf,
        np.array([0, 4, 4, 6], dtype=np.int64),
        np.array([4, 0, 2, 0], dtype=np.int64),
        np.array([KIND_BINARY, KIND_NULL, KIND_TEXT, KIND_TOAST], dtype=np.uint8),
    )
    assert out.to_pylist() == [7, None, 12, None]
    assert (
        codec.decode(
            b"", np.zeros(2, np.int64), np.zeros(2, np.int64), np.full(2, KIND_NULL, np.uint8)
        ).null_count
        == 2
    )


def test_errors_name_type_and_row() -> None:
    with pytest.raises(DecodeError, match=r"int4 value at row 1: binary value is not 4 bytes long"):
        run(OID["int4"], [b"\x00\x00\x00\x01", b"\x00\x01"], KIND_BINARY)
    with pytest.raises(DecodeError, match=r"text value at row 2: invalid UTF-8"):
        run(OID["text"], [b"a", b"b", b"\xff"], KIND_TEXT)
    with pytest.raises(DecodeError, match="unknown value kind"):
        codec_for(OID["int4"], -1).decode(
            b"", np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([ord("x")], np.uint8)
        )
    with pytest.raises(DecodeError, match="outside the buffer"):
        codec_for(OID["int4"], -1).decode(
            b"ab", np.array([1]), np.array([4]), np.array([KIND_BINARY], np.uint8)
        )
    with pytest.raises(DecodeError, match="no binary decoder for type point"):
        run(OID["point"], [b"\x00" * 16], KIND_BINARY)
    assert run(OID["point"], [b"(1,2)"], KIND_TEXT)[0] == ["(1,2)"]
    assert run(99999, [b"anything"], KIND_TEXT)[0] == ["anything"]


def test_ints_bool_float() -> None:
    assert run(OID["int2"], [b"\x80\x00", b"\x7f\xff"], KIND_BINARY)[0] == [-32768, 32767]
    assert run(OID["int8"], [b"-9223372036854775808", b"0"], KIND_TEXT)[0] == [-(2**63), 0]
    assert run(OID["oid"], [b"\xff\xff\xff\xff", None], KIND_BINARY)[0] == [2**32 - 1, None]
    assert run(OID["oid"], [b"4294967295"], KIND_TEXT)[0] == [2**32 - 1]
    assert run(OID["bool"], [b"t", b"f"], KIND_TEXT)[0] == [True, False]
    assert run(OID["bool"], [b"\x01", b"\x00"], KIND_BINARY)[0] == [True, False]
    got = run(OID["float8"], [b"NaN", b"Infinity", b"-Infinity", b"-0", b"1e+308"], KIND_TEXT)[0]
    assert math.isnan(got[0]) and got[1:4] == [math.inf, -math.inf, -0.0] and got[4] == 1e308
    assert run(OID["float4"], [struct.pack("!f", 0.1)], KIND_BINARY)[0] == [float(np.float32(0.1))]
    with pytest.raises(DecodeError, match="int2 value at row 0"):
        run(OID["int2"], [b"32768"], KIND_TEXT)
    with pytest.raises(DecodeError, match="bool value at row 0"):
        run(OID["bool"], [b"x"], KIND_TEXT)


def test_numeric_mapping_rules() -> None:
    assert codec_for(OID["numeric"], typmod_numeric(12, 2)).arrow_type == pa.decimal128(12, 2)
    assert codec_for(OID["numeric"], typmod_numeric(5, -3)).arrow_type == pa.decimal128(8, 0)
    assert codec_for(OID["numeric"], typmod_numeric(3, 5)).arrow_type == pa.decimal128(5, 5)
    assert codec_for(OID["numeric"], typmod_numeric(39, 2)).arrow_type == pa.string()
    assert codec_for(OID["numeric"], -1).arrow_type == pa.string()
    assert numeric_typmod(typmod_numeric(5, -3)) == (5, -3)
    assert numeric_typmod(-1) is None
    values = [Decimal("1.50"), Decimal("-0.01"), Decimal("NaN"), Decimal("9999999999.99"), Decimal(0)]
    tm = typmod_numeric(12, 2)
    got, notes = run(OID["numeric"], [numeric_send(v) for v in values], KIND_BINARY, tm)
    assert got == [Decimal("1.50"), Decimal("-0.01"), None, Decimal("9999999999.99"), Decimal("0.00")]
    assert notes["numeric_nan_nulled"] == 1
    got, notes = run(OID["numeric"], [str(v).encode() for v in values], KIND_TEXT, tm)
    assert got[2] is None and got[0] == Decimal("1.50") and notes["numeric_nan_nulled"] == 1
    with pytest.raises(DecodeError, match="more fractional digits"):
        run(OID["numeric"], [numeric_send(Decimal("1.005"))], KIND_BINARY, tm)
    with pytest.raises(DecodeError, match="infinity"):
        run(OID["numeric"], [numeric_send(Decimal("Infinity"))], KIND_BINARY, tm)
    with pytest.raises(DecodeError, match="precision"):
        run(OID["numeric"], [numeric_send(Decimal("10000000000"))], KIND_BINARY, tm)
    text = [b"NaN", b"Infinity", b"-Infinity", b"1.10", b"-0.0001"]
    assert run(OID["numeric"], text, KIND_TEXT)[0] == [t.decode() for t in text]
    bins = [numeric_send(Decimal(t.decode())) for t in text]
    assert run(OID["numeric"], bins, KIND_BINARY)[0] == [t.decode() for t in text]


def test_money_bytea_uuid_jsonb_char() -> None:
    assert run(OID["money"], [struct.pack("!q", -123)], KIND_BINARY)[0] == [Decimal("-1.23")]
    assert run(OID["money"], [b"-$1,234.56", b"$0.00"], KIND_TEXT)[0] == [
        Decimal("-1234.56"),
        Decimal("0.00"),
    ]
    assert run(OID["bytea"], [b"\x00\xff", b""], KIND_BINARY)[0] == [b"\x00\xff", b""]
    assert run(OID["bytea"], [b"\\x00ff", b"a\\\\b\\000"], KIND_TEXT)[0] == [b"\x00\xff", b"a\\b\x00"]
    u = bytes(range(16))
    assert run(OID["uuid"], [u], KIND_BINARY)[0] == ["00010203-0405-0607-0809-0a0b0c0d0e0f"]
    assert run(OID["jsonb"], [b'\x01{"a": 1}'], KIND_BINARY)[0] == ['{"a": 1}']
    with pytest.raises(DecodeError, match="jsonb binary version"):
        run(OID["jsonb"], [b"\x02{}"], KIND_BINARY)
    assert run(OID["char"], [b"a", b"\x80", b"\x00"], KIND_BINARY)[0] == ["a", "\\200", ""]
    assert run(OID["bpchar"], [b"ab   "], KIND_BINARY)[0] == ["ab   "]


def test_dates_and_timestamps_clamp() -> None:
    got, notes = run(
        OID["date"],
        [struct.pack("!i", 2**31 - 1), struct.pack("!i", -(2**31)), struct.pack("!i", 0)],
        KIND_BINARY,
    )
    assert got == [dt.date(9999, 12, 31), dt.date(1, 1, 1), dt.date(2000, 1, 1)]
    assert notes["date_clamped"] == 2
    got, notes = run(OID["date"], [b"0044-03-15 BC", b"10000-01-01", b"2000-02-29"], KIND_TEXT)
    assert (
        got == [dt.date(1, 1, 1), dt.date(9999, 12, 31), dt.date(2000, 2, 29)] and notes["date_clamped"] == 2
    )
    got, notes = run(
        OID["timestamptz"], [b"2024-06-01 12:00:00+05:30", b"infinity", b"0001-01-01 00:30:00+01"], KIND_TEXT
    )
    assert got[0] == dt.datetime(2024, 6, 1, 6, 30, tzinfo=dt.UTC)
    assert got[1] == dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC)
    assert got[2] == dt.datetime(1, 1, 1, tzinfo=dt.UTC) and notes["timestamp_clamped"] == 2
    got, notes = run(OID["timestamp"], [struct.pack("!q", 2**63 - 1), struct.pack("!q", 1)], KIND_BINARY)
    assert got == [dt.datetime(9999, 12, 31, 23, 59, 59, 999999), dt.datetime(2000, 1, 1, 0, 0, 0, 1)]
    with pytest.raises(DecodeError, match="timestamp value at row 0"):
        run(OID["timestamp"], [b"yesterday"], KIND_TEXT)


def test_text_forms_of_binary_values() -> None:
    assert run(OID["time"], [struct.pack("!q", 86_400_000_000), struct.pack("!q", 500_000)], KIND_BINARY)[
        0
    ] == [
        "24:00:00",
        "00:00:00.5",
    ]
    assert run(OID["timetz"], [struct.pack("!qi", 0, -19800)], KIND_BINARY)[0] == ["00:00:00+05:30"]
    iv = [
        struct.pack("!qii", *v)
        for v in ((14706_500_000, 3, 14), (-1_000_000, 0, 0), (0, 0, 0), (3_600_000_000, -1, 0))
    ]
    assert run(OID["interval"], iv, KIND_BINARY)[0] == [
        "1 year 2 mons 3 days 04:05:06.5",
        "-00:00:01",
        "00:00:00",
        "-1 days +01:00:00",
    ]
    inet = [
        bytes([2, 32, 0, 4, 10, 0, 0, 1]),
        bytes([3, 64, 0, 16]) + bytes.fromhex("20010db8" + "0" * 23 + "1"),
    ]
    assert run(OID["inet"], inet, KIND_BINARY)[0] == ["10.0.0.1", "2001:db8::1/64"]
    assert run(OID["cidr"], [bytes([2, 32, 1, 4, 10, 0, 0, 1])], KIND_BINARY)[0] == ["10.0.0.1/32"]
    assert run(OID["macaddr"], [bytes.fromhex("08002b010203")], KIND_BINARY)[0] == ["08:00:2b:01:02:03"]
    assert run(OID["varbit"], [struct.pack("!i", 3) + b"\xa0", struct.pack("!i", 0)], KIND_BINARY)[0] == [
        "101",
        "",
    ]


def int_array(values: list[int | None], dims: list[int] | None = None, lb: int = 1) -> bytes:
    dims = [len(values)] if dims is None else dims
    out = struct.pack("!iiI", len(dims), int(None in values), OID["int4"])
    for d in dims:
        out += struct.pack("!ii", d, lb)
    for v in values:
        out += struct.pack("!i", -1) if v is None else struct.pack("!ii", 4, v)
    return out


def test_arrays() -> None:
    got, notes = run(
        OID["_int4"], [int_array([1, None, 3]), int_array([], []), int_array([5], lb=0)], KIND_BINARY
    )
    assert got == [[1, None, 3], [], [5]] and notes["array_lower_bound_dropped"] == 1
    got, _ = run(OID["_int4"], [b"{1,NULL,3}", b"{}", b"[0:0]={5}"], KIND_TEXT)
    assert got == [[1, None, 3], [], [5]]
    assert codec_for(OID["_int4"], -1, ndims=2).arrow_type == pa.list_(pa.list_(pa.int32()))
    got, _ = run(OID["_int4"], [int_array([1, 2, None, 4], [2, 2]), b"\x00" * 12], KIND_BINARY, ndims=2)
    assert got == [[[1, 2], [None, 4]], []]
    # PostgreSQL does not enforce declared dimensions: more are flattened, fewer padded (counted)
    got, notes = run(OID["_int4"], [b"{{1},{2}}", b"{{{1,2},{3,4}},{{5,6},{7,NULL}}}"], KIND_TEXT)
    assert got == [[1, 2], [1, 2, 3, 4, 5, 6, 7, None]] and notes["array_dims_flattened"] == 2
    got, notes = run(OID["_int4"], [int_array([1, 2, 3, 4, 5, 6], [1, 2, 3]), int_array([7, 8])], KIND_BINARY, ndims=2)
    assert got == [[[1, 2, 3], [4, 5, 6]], [[7, 8]]]
    assert notes["array_dims_flattened"] == 1 and notes["array_dims_padded"] == 1
    got, _ = run(OID["_text"], [b'{"a b","",NULL,"NULL","x\\"y"}'], KIND_TEXT)
    assert got == [["a b", "", None, "NULL", 'x"y']]
    got, notes = run(OID["_numeric"], [b"{1.5,NaN}"], KIND_TEXT, typmod_numeric(5, 1))
    assert got == [[Decimal("1.5"), None]] and notes["numeric_nan_nulled"] == 1


def test_value_of_a_one_element_text_array() -> None:
    """pg_attribute.attmissingval as PostgreSQL prints it: the element goes through the codec's text path."""
    assert value_of_text_array(codec_for(OID["int4"], -1), "{7}").as_py() == 7
    assert value_of_text_array(codec_for(OID["text"], -1), '{"a, \\"b\\" \\\\ {c}"}').as_py() == 'a, "b" \\ {c}'
    assert value_of_text_array(codec_for(OID["numeric"], typmod_numeric(8, 2)), "{12.50}").as_py() == Decimal("12.50")
    assert value_of_text_array(codec_for(OID["_int4"], -1), '{"{1,NULL,3}"}').as_py() == [1, None, 3]
    assert value_of_text_array(codec_for(OID["_int4"], -1, ndims=2), '{"{{1,2},{3,4}}"}').as_py() == [[1, 2], [3, 4]]
    ts = value_of_text_array(codec_for(OID["timestamptz"], -1), '{"2020-01-01 08:00:00+00"}')
    assert ts.as_py() == dt.datetime(2020, 1, 1, 8, tzinfo=dt.UTC)
    # box separates array elements with ';' (pg_type.typdelim), and its text has commas
    assert value_of_text_array(codec_for(OID["box"], -1), "{(1,1),(0,0)}", delim=";").as_py() == "(1,1),(0,0)"
    notes: collections.Counter[str] = collections.Counter()
    assert value_of_text_array(codec_for(OID["date"], -1), "{infinity}", notes=notes).as_py() == dt.date(9999, 12, 31)
    assert notes["date_clamped"] == 1
    for bad in ("7", "{}", "{1,2}", "{NULL}", "{x}"):
        with pytest.raises(DecodeError):
            value_of_text_array(codec_for(OID["int4"], -1), bad)


class Catalog:
    def __init__(self, *infos: TypeInfo) -> None:
        self.infos = {i.oid: i for i in infos}

    def type_info(self, oid: int) -> TypeInfo | None:
        return self.infos.get(oid)


def test_catalog_types() -> None:
    cat = Catalog(
        TypeInfo(70000, "public", "posnum", "d", base_oid=OID["numeric"], base_typmod=typmod_numeric(10, 3)),
        TypeInfo(70001, "public", "mood", "e"),
        TypeInfo(70002, "public", "_mood", "b", elem_oid=70001),
        TypeInfo(70003, "public", "citext", "b", send_proc="textsend"),
        TypeInfo(70004, "public", "hstore", "b", send_proc="hstore_send"),
        TypeInfo(70005, "public", "floatrange", "r", subtype_oid=OID["float8"]),
        TypeInfo(70006, "public", "comp", "c"),
    )
    assert codec_for(70000, -1, cat).arrow_type == pa.decimal128(10, 3)
    assert run(70001, [b"happy"], KIND_BINARY, catalog=cat)[0] == ["happy"]
    assert run(70002, [b'{happy,"with space"}'], KIND_TEXT, catalog=cat)[0] == [["happy", "with space"]]
    assert run(70003, [b"MiXed"], KIND_BINARY, catalog=cat)[0] == ["MiXed"]
    with pytest.raises(DecodeError, match=r"public\.hstore"):
        run(70004, [b"\x00"], KIND_BINARY, catalog=cat)
    rng = (
        bytes([0x02])
        + struct.pack("!i", 8)
        + struct.pack("!d", 1.5)
        + struct.pack("!i", 8)
        + struct.pack("!d", 1e20)
    )
    assert run(70005, [rng, b"\x01"], KIND_BINARY, catalog=cat)[0] == ["[1.5,1e+20)", "empty"]
    rec = (
        struct.pack("!i", 3)
        + struct.pack("!Ii", OID["text"], 4)
        + b"a, b"
        + struct.pack("!Ii", OID["int4"], -1)
    )
    rec += struct.pack("!Ii", OID["float4"], 4) + struct.pack("!f", 0.1)
    assert run(70006, [rec], KIND_BINARY, catalog=cat)[0] == ['("a, b",,0.1)']
    schema = arrow_schema([("a", 70000, -1), ("b", OID["_int4"], -1, 2), ("c", OID["timestamptz"], -1)], cat)
    assert schema.types == [
        pa.decimal128(10, 3),
        pa.list_(pa.list_(pa.int32())),
        pa.timestamp("us", tz="UTC"),
    ]
    assert schema.field("a").metadata == {b"pg_type": b"public.posnum (numeric(10,3))"}


def test_generated_oid_table() -> None:
    assert OID["int4"] == 23 and OID["numeric"] == 1700 and OID["jsonb"] == 3802
    assert _oids.BY_NAME["_int4"].typelem == 23 and _oids.BY_NAME["int4range"].subtype_oid == 23
    assert len(_oids.TYPES) > 150


# --------------------------------------------------------------- properties

INT_TYPES = {"int2": (2, 16), "int4": (4, 32), "int8": (8, 64)}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(INT_TYPES)), st.data())
def test_prop_ints(name: str, data: st.DataObject) -> None:
    width, bits = INT_TYPES[name]
    values = data.draw(
        st.lists(st.one_of(st.none(), st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)), max_size=30)
    )
    wire = [None if v is None else v.to_bytes(width, "big", signed=True) for v in values]
    assert run(OID[name], wire, KIND_BINARY)[0] == values
    assert run(OID[name], [None if v is None else str(v).encode() for v in values], KIND_TEXT)[0] == values


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=30))
def test_prop_float8(values: list[float]) -> None:
    got = run(OID["float8"], [struct.pack("!d", v) for v in values], KIND_BINARY)[0]
    assert norm(got) == norm(values)
    text = [repr(v).replace("inf", "Infinity").replace("nan", "NaN").encode() for v in values]
    assert norm(run(OID["float8"], text, KIND_TEXT)[0]) == norm(values)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 38), st.data())
def test_prop_numeric_decimal128(precision: int, data: st.DataObject) -> None:
    scale = data.draw(st.integers(0, precision))
    bound = 10**precision - 1
    units = data.draw(st.lists(st.one_of(st.none(), st.integers(-bound, bound)), max_size=20))
    values = [None if u is None else Decimal(u).scaleb(-scale, context=EXACT) for u in units]
    tm = typmod_numeric(precision, scale)
    wire = [None if v is None else numeric_send(v) for v in values]
    got = run(OID["numeric"], wire, KIND_BINARY, tm)[0]
    assert got == values
    text = [None if v is None else format(v, "f").encode() for v in values]
    assert run(OID["numeric"], text, KIND_TEXT, tm)[0] == values


def _plain(d: Decimal) -> bool:
    exp = d.as_tuple().exponent
    return not d.is_finite() or (isinstance(exp, int) and -60 < exp < 60 and len(d.as_tuple().digits) < 60)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(st.none(), st.decimals(allow_nan=True, allow_infinity=True).filter(_plain)), max_size=20
    )
)
def test_prop_numeric_text_unbounded(values: list[Decimal | None]) -> None:
    values = [None if v is None else (v.copy_abs() if v.is_zero() else v) for v in values]  # PG has no -0
    expected = [
        None if v is None else ("NaN" if v.is_nan() else format(v, "f").replace("inf", "Infinity"))
        for v in values
    ]
    got = run(OID["numeric"], [None if v is None else numeric_send(v) for v in values], KIND_BINARY)[0]
    assert got == expected


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text()), max_size=30))
def test_prop_text_jsonb_bytea(values: list[str | None]) -> None:
    wire = [None if v is None else v.encode() for v in values]
    assert run(OID["text"], wire, KIND_TEXT)[0] == values
    assert run(OID["varchar"], wire, KIND_BINARY)[0] == values
    assert run(OID["jsonb"], [None if w is None else b"\x01" + w for w in wire], KIND_BINARY)[0] == values
    assert run(OID["bytea"], wire, KIND_BINARY)[0] == wire
    assert (
        run(OID["bytea"], [None if w is None else b"\\x" + w.hex().encode() for w in wire], KIND_TEXT)[0]
        == wire
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.none(),
            st.datetimes(
                min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59, 999999)
            ),
        ),
        max_size=20,
    )
)
def test_prop_timestamps(values: list[dt.datetime | None]) -> None:
    def us(v: dt.datetime) -> int:
        return (v - PG_EPOCH) // dt.timedelta(microseconds=1)

    wire = [None if v is None else struct.pack("!q", us(v)) for v in values]
    assert run(OID["timestamp"], wire, KIND_BINARY)[0] == values
    text = [None if v is None else v.isoformat(" ").encode() for v in values]
    assert run(OID["timestamp"], text, KIND_TEXT)[0] == values
    tz = [None if v is None else v.replace(tzinfo=dt.UTC) for v in values]
    assert run(OID["timestamptz"], wire, KIND_BINARY)[0] == tz
    dates = [None if v is None else v.date() for v in values]
    dwire = [None if d is None else struct.pack("!i", (d - PG_EPOCH.date()).days) for d in dates]
    assert run(OID["date"], dwire, KIND_BINARY)[0] == dates
    assert (
        run(OID["date"], [None if d is None else d.isoformat().encode() for d in dates], KIND_TEXT)[0]
        == dates
    )


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.uuids()), max_size=20),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=10),
)
def test_prop_uuid_money(uuids: list[Any], cents: list[int]) -> None:
    assert run(OID["uuid"], [None if u is None else u.bytes for u in uuids], KIND_BINARY)[0] == [
        None if u is None else str(u) for u in uuids
    ]
    assert run(OID["money"], [struct.pack("!q", c) for c in cents], KIND_BINARY)[0] == [
        Decimal(c).scaleb(-2, context=EXACT) for c in cents
    ]


BUILTIN_NAMES = sorted(
    t.name for t in _oids.TYPES if t.typtype in "bdrm" and not t.name.startswith("pg_") and t.typtype != "p"
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(BUILTIN_NAMES),
    st.sampled_from([KIND_TEXT, KIND_BINARY]),
    st.lists(st.binary(max_size=24), min_size=1, max_size=4),
)
def test_prop_bad_bytes_raise_decode_error_only(name: str, kind: int, values: list[bytes]) -> None:
    """Arbitrary bytes either decode (identically on both paths) or raise DecodeError."""
    with contextlib.suppress(DecodeError):
        run(OID[name], list(values), kind, typmod_numeric(10, 2) if name == "numeric" else -1)
