"""THE ORACLE: values decoded from real pgoutput bytes equal what the server says they are.

A table holds edge values of every supported type. Its rows go through a real pgoutput
slot, peeked in binary='true' and binary='false' mode; each column is decoded with
``codec_for(...).decode(...)`` and compared with what psycopg 3 loads for the same rows
with a plain SELECT. The comparison, per column kind:

* ``py``: Arrow ``to_pylist()`` equals psycopg's value (Decimal, int, bool, bytes,
  date, datetime as UTC, float compared bit for bit with NaN equal to NaN); a NaN
  numeric in a bounded column must be NULL (the documented rule).
* ``text``: the Arrow string equals the server's own ``col::text``.
* ``out``: the Arrow string equals ``format('%s', col)`` (the output function).
* ``textarr``: the Arrow list of strings equals the server's ``col::text[]``.
* ``ts`` / ``date``: values the server says lie inside 0001-01-01 .. 9999-12-31
  23:59:59.999999 equal psycopg's datetime; values outside must equal the bound.

Text mode and binary mode must give identical Arrow arrays.
"""

from __future__ import annotations

import collections
import datetime as dt
import math
import struct
from decimal import Decimal
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pytest

from pg2delta.decode import pgoutput
from pg2delta.decode.typemap import KIND_BINARY, KIND_NULL, KIND_TEXT, codec_for
from pg2delta.source.catalog import PgTypeCatalog

UTC = dt.UTC
TS_LO = dt.datetime(1, 1, 1)
TS_HI = dt.datetime(9999, 12, 31, 23, 59, 59, 999999)

SETUP = """
CREATE TYPE mood AS ENUM ('happy', 'sad', 'with space');
CREATE DOMAIN posnum AS numeric(10,3) CHECK (VALUE > 0);
CREATE TYPE comp AS (a int4, b text, c numeric, d timestamptz, e int4[], f float8, g bytea, h bool);
"""

# (column, type, SQL literals, comparison kind)
COLUMNS: list[tuple[str, str, list[str], str]] = [
    ("c_bool", "bool", ["true", "false"], "py"),
    ("c_int2", "int2", ["-32768", "32767", "0"], "py"),
    ("c_int4", "int4", ["-2147483648", "2147483647", "7"], "py"),
    ("c_int8", "int8", ["-9223372036854775808", "9223372036854775807"], "py"),
    ("c_oid", "oid", ["0", "4294967295"], "py"),
    (
        "c_float4",
        "float4",
        ["'NaN'", "'Infinity'", "'-Infinity'", "1.5e-7", "3.4028235e38", "'-0'", "0.1", "1e-45"],
        "py",
    ),
    (
        "c_float8",
        "float8",
        [
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "1e308",
            "5e-324",
            "0.1",
            "'-0'",
            "1e15",
            "123456789012345680",
        ],
        "py",
    ),
    (
        "c_num122",
        "numeric(12,2)",
        ["0", "-0.01", "9999999999.99", "'NaN'", "1.5", "-1234567890.12", "0.1"],
        "py",
    ),
    (
        "c_num380",
        "numeric(38,0)",
        ["99999999999999999999999999999999999999", "-99999999999999999999999999999999999999", "0", "10000"],
        "py",
    ),
    (
        "c_num3810",
        "numeric(38,10)",
        ["-9999999999999999999999999999.9999999999", "0.0000000001", "12345.6789", "1e20"],
        "py",
    ),
    (
        "c_num3838",
        "numeric(38,38)",
        ["0.12345678901234567890123456789012345678", "-0.00000000000000000000000000000000000001"],
        "py",
    ),
    ("c_numneg", "numeric(5,-3)", ["12345000", "-99999000", "0", "1500"], "py"),
    ("c_numwide", "numeric(3,5)", ["0.00123", "-0.00999", "0"], "py"),
    (
        "c_numeric",
        "numeric",
        [
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "1e-30",
            "1e100 + 0.5",
            "0",
            "1.10",
            "-0.000",
            "-12345678901234567890123456789012345678901234567890.5",
        ],
        "text",
    ),
    (
        "c_num50",
        "numeric(50,10)",
        ["1234567890123456789012345678901234567890.0123456789", "'NaN'", "-1"],
        "text",
    ),
    ("c_money", "money", ["-92233720368547758.08", "0", "1234.56", "-1.23", "92233720368547758.07"], "money"),
    ("c_text", "text", ["''", "'héllo ✓ 𝄞'", "E'a\"b\\\\c\\nd'", "'NULL'", "' lead'"], "text"),
    ("c_varchar", "varchar(10)", ["'abc'", "''"], "text"),
    ("c_bpchar", "char(5)", ["'ab'", "''", "'abcde'", "'é'"], "py"),
    ("c_name", "name", ["'pg_class'", "''"], "text"),
    ("c_char", '"char"', ["'a'", "'\\200'", "''", "'\\\\'"], "text"),
    ("c_json", "json", ["'{ \"a\" : [1, 2 ] }'", "'null'", "' [ ] '"], "text"),
    (
        "c_jsonb",
        "jsonb",
        ['\'{"b": {"c": [1, 2.50, "x", null, true]}, "a": "é"}\'', "'[]'", "'\"s\"'", "'1e3'"],
        "text",
    ),
    ("c_xml", "xml", ["'<a>x &amp; y</a>'"], "text"),
    ("c_bytea", "bytea", ["'\\x00ff00'", "''", "'\\x5c'"], "py"),
    (
        "c_date",
        "date",
        [
            "'infinity'",
            "'-infinity'",
            "'0001-01-01'",
            "'9999-12-31'",
            "'4713-01-01 BC'",
            "'10000-01-01'",
            "'2000-02-29'",
            "'1999-12-31'",
        ],
        "date",
    ),
    (
        "c_ts",
        "timestamp",
        [
            "'infinity'",
            "'-infinity'",
            "'0001-01-01 00:00:00'",
            "'9999-12-31 23:59:59.999999'",
            "'0001-12-31 23:59:59 BC'",
            "'10000-01-01 00:00:00'",
            "'2024-02-29 12:34:56.789'",
            "'1969-12-31 23:59:59.000001'",
        ],
        "ts",
    ),
    (
        "c_tstz",
        "timestamptz",
        [
            "'infinity'",
            "'-infinity'",
            "'0001-01-01 00:00:00+00'",
            "'9999-12-31 23:59:59.999999+00'",
            "'2024-06-01 12:00:00+05:30'",
            "'0001-01-01 00:30:00+01'",
            "'9999-12-31 23:00:00-05'",
            "'1000-01-01 00:00:00.5 BC'",
            "'2000-01-01 00:00:00+00'",
        ],
        "ts",
    ),
    ("c_time", "time", ["'00:00:00'", "'23:59:59.999999'", "'24:00:00'", "'12:00:00.5'"], "text"),
    (
        "c_timetz",
        "timetz",
        [
            "'12:00:00+05:30'",
            "'00:00:00-14'",
            "'23:59:59.1+00'",
            "'01:02:03+05:30:15'",
            "'04:05:06.000001-03'",
        ],
        "text",
    ),
    (
        "c_interval",
        "interval",
        [
            "'1 year 2 mons 3 days 04:05:06.5'",
            "'-00:00:01'",
            "'-1 year -2 mons +3 days -04:05:06'",
            "'0'",
            "'1 mon -1 day'",
            "'100 years'",
            "'-1 day +01:00'",
            "'1 day 00:00:00.000001'",
            "'1000000 hours'",
            "'-1 mons'",
            "'1 year -1 mons'",
            "'-0.5 seconds'",
            "'1 day -00:00:00.25'",
        ],
        "text",
    ),
    (
        "c_uuid",
        "uuid",
        ["'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'", "'00000000-0000-0000-0000-000000000000'"],
        "text",
    ),
    (
        "c_inet",
        "inet",
        [
            "'192.168.0.1'",
            "'192.168.0.1/24'",
            "'::1'",
            "'2001:db8::1/64'",
            "'::ffff:1.2.3.4'",
            "'::'",
            "'fe80::'",
            "'::1.2.3.4'",
            "'1:0:0:1:0:0:0:1'",
            "'::2'",
            "'0.0.0.0/0'",
            "'1:2:3:4:5:6:7:8/128'",
            "'1::'",
        ],
        "out",
    ),
    (
        "c_cidr",
        "cidr",
        ["'10.0.0.0/8'", "'192.168.1.1/32'", "'2001:db8::/32'", "'::/0'", "'::1/128'"],
        "text",
    ),
    ("c_macaddr", "macaddr", ["'08:00:2B:01:02:03'"], "text"),
    ("c_macaddr8", "macaddr8", ["'08:00:2b:01:02:03:04:05'"], "text"),
    ("c_bit", "bit(4)", ["B'1010'", "B'0001'"], "text"),
    ("c_varbit", "varbit", ["B''", "B'101010101'", "B'1'"], "text"),
    ("c_int4arr", "int4[]", ["'{1,NULL,3}'", "'{}'", "'[0:1]={5,6}'", "'{NULL}'"], "py"),
    ("c_int4arr2", "int4[][]", ["'{{1,2},{NULL,4}}'", "'{}'", "'{{7}}'"], "py"),
    ("c_textarr", "text[]", ['\'{"a b","","NULL",NULL,"x\\"y",é,"{}"}\'', "'{a,b}'"], "textarr"),
    ("c_numarr", "numeric(10,2)[]", ["'{1.5,NaN,-2,NULL}'"], "py"),
    ("c_tsarr", "timestamptz[]", ['\'{"2020-01-01 00:00:00+00","1999-12-31 23:59:59.5+03"}\''], "py"),
    ("c_uuidarr", "uuid[]", ["'{A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11,NULL}'"], "textarr"),
    ("c_rangearr", "int4range[]", ['\'{"[1,2)",empty,"(,5]"}\''], "textarr"),
    ("c_jsonbarr", "jsonb[]", ["ARRAY['{\"a\": [1, 2]}'::jsonb, 'null'::jsonb]"], "textarr"),
    ("c_enum", "mood", ["'happy'", "'with space'"], "text"),
    ("c_enumarr", "mood[]", ["'{happy,\"with space\"}'"], "textarr"),
    ("c_domain", "posnum", ["1.234", "99999.5"], "py"),
    (
        "c_comp",
        "comp",
        [
            "ROW(1, 'x, y', 1.50, '2020-01-01 00:00:00+00', '{1,2}', 0.1, '\\x00', true)::comp",
            "ROW(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::comp",
            "ROW(2, '', 'NaN', 'infinity', '{}', 'Infinity', '', false)::comp",
            "ROW(3, 'a\"b\\c(d)', 1e-5, '0044-03-15 12:00:00 BC', '{{1,2},{3,4}}', 1e20, '\\x5c', NULL)::comp",
        ],
        "text",
    ),
    ("c_range", "int4range", ["'[1,10)'", "'empty'", "'(,5]'", "'[3,)'", "'(,)'"], "text"),
    ("c_numrange", "numrange", ["'[1.5,2.50]'", "'(-1,)'"], "text"),
    ("c_tsrange", "tstzrange", ["'[\"2020-01-01 00:00:00+00\",infinity)'"], "text"),
    ("c_tsrange2", "tsrange", ["'[2020-01-01 10:00,2020-01-02)'"], "text"),
    ("c_daterange", "daterange", ["'[2020-01-01,2020-02-01]'"], "text"),
    ("c_multirange", "int4multirange", ["'{[1,3),[5,7)}'", "'{}'"], "text"),
    ("c_textrange", "textrange", ['\'["a b","c\\"d")\''], "text"),
    ("c_point", "point", ["'(1,2)'"], "text_only"),
]

SETUP += "CREATE TYPE textrange AS RANGE (subtype = text);\n"


def _columns(version: int) -> list[tuple[str, str, list[str], str]]:
    cols = list(COLUMNS)
    if version >= 17:
        cols.append(("c_ivinf", "interval", ["'infinity'", "'-infinity'", "'1 day'"], "text"))
    return cols


def _f(v: Any) -> Any:
    """Floats bit for bit (NaN equal to NaN, -0.0 distinct from 0.0); recurse into lists."""
    if isinstance(v, float):
        return ("float", struct.pack("!d", v) if not math.isnan(v) else b"nan")
    if isinstance(v, list):
        return [_f(x) for x in v]
    if isinstance(v, Decimal) and v.is_nan():
        return None  # bounded numeric NaN -> NULL, the documented rule
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v.astimezone(UTC)
    return v


def _decode_all(
    dsn: str, slot: str, pub: str, binary: bool, cols: list[tuple[str, str, list[str], str]]
) -> tuple[dict[str, pa.Array], collections.Counter[str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET DateStyle = ISO; SET IntervalStyle = postgres; SET TimeZone = 'UTC'")
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s, 'binary', %s)",
            (slot, pub, "true" if binary else "false"),
        ).fetchall()
        catalog = PgTypeCatalog(conn)
        relation = None
        inserts = []
        for (data,) in rows:
            msg = pgoutput.parse_message(bytes(data))
            if isinstance(msg, pgoutput.Relation):
                relation = msg
            elif isinstance(msg, pgoutput.Insert):
                inserts.append(msg)
        assert relation is not None
        ndims = catalog.attndims(relation.oid)
        chunks: list[bytes] = []
        pos = 0
        ncol = len(relation.columns)
        starts = np.zeros((ncol, len(inserts)), dtype=np.int64)
        lengths = np.zeros((ncol, len(inserts)), dtype=np.int64)
        kinds = np.full((ncol, len(inserts)), KIND_NULL, dtype=np.uint8)
        for r, ins in enumerate(inserts):
            for c, value in enumerate(ins.new):
                if isinstance(value, pgoutput.Text | pgoutput.Binary):
                    chunks.append(value.data)
                    starts[c, r] = pos
                    lengths[c, r] = len(value.data)
                    kinds[c, r] = KIND_TEXT if isinstance(value, pgoutput.Text) else KIND_BINARY
                    pos += len(value.data)
        buf = b"".join(chunks)
        notes: collections.Counter[str] = collections.Counter()
        out = {}
        want_kind = KIND_BINARY if binary else KIND_TEXT
        for c, col in enumerate(relation.columns):
            kind = next(k for n, _t, _v, k in [("id", "", [], "py"), *cols] if n == col.name)
            sent = set(kinds[c][kinds[c] != KIND_NULL].tolist())
            if kind == "text_only" and binary:
                assert sent <= {KIND_BINARY}
                continue
            assert sent <= {want_kind}, col.name
            codec = codec_for(col.type_oid, col.type_modifier, catalog, ndims=max(ndims.get(col.name, 1), 1))
            out[col.name] = codec.decode(buf, starts[c], lengths[c], kinds[c], notes)
            ref = codec.decode(buf, starts[c], lengths[c], kinds[c], reference=True)
            assert _f(ref.to_pylist()) == _f(out[col.name].to_pylist()), f"{col.name}: vectorized != reference"
            assert out[col.name].type == codec.arrow_type
        return out, notes


@pytest.fixture
def oracle_db(pgdb: str) -> tuple[str, list[tuple[str, str, list[str], str]], int]:
    with psycopg.connect(pgdb, autocommit=True) as conn:
        version = conn.info.server_version // 10000
        cols = _columns(version)
        try:
            conn.execute("SELECT '<a/>'::xml")
        except psycopg.errors.FeatureNotSupported:  # a server built without libxml
            cols = [c for c in cols if c[1] != "xml"]
        conn.execute(SETUP)
        conn.execute(
            "CREATE TABLE edge (id int PRIMARY KEY, " + ", ".join(f"{n} {t}" for n, t, _v, _k in cols) + ")"
        )
        conn.execute("CREATE PUBLICATION oracle_pub FOR TABLE edge")
        conn.execute("SELECT pg_create_logical_replication_slot('oracle_slot', 'pgoutput')")
        nrows = max(len(v) for _n, _t, v, _k in cols)
        for r in range(nrows):
            values = ", ".join(v[r] if r < len(v) else "NULL" for _n, _t, v, _k in cols)
            conn.execute(f"INSERT INTO edge VALUES ({r}, {values})")
        conn.execute("INSERT INTO edge (id) VALUES (%s)", (nrows,))  # an all-NULL row
    return pgdb, cols, version


def _expected(conn: psycopg.Connection[Any], name: str, kind: str) -> list[Any]:
    if kind in ("text", "text_only"):
        sql = f"SELECT {name}::text FROM edge ORDER BY id"
    elif kind == "out":  # the type's output function (inet::text would always show the mask)
        sql = f"SELECT CASE WHEN {name} IS NOT NULL THEN format('%s', {name}) END FROM edge ORDER BY id"
    elif kind in ("textarr", "textarr2"):
        sql = f"SELECT {name}::text[] FROM edge ORDER BY id"
    elif kind == "money":
        sql = f"SELECT {name}::numeric FROM edge ORDER BY id"
    elif kind == "ts":
        sql = (
            f"SELECT CASE WHEN {name} BETWEEN '0001-01-01 00:00:00' AND '9999-12-31 23:59:59.999999' "
            f"THEN {name} END, {name} < '0001-01-01 00:00:00', {name} > '9999-12-31 23:59:59.999999' "
            "FROM edge ORDER BY id"
        )
    elif kind == "date":
        sql = (
            f"SELECT CASE WHEN {name} BETWEEN '0001-01-01' AND '9999-12-31' THEN {name} END, "
            f"{name} < '0001-01-01', {name} > '9999-12-31' FROM edge ORDER BY id"
        )
    else:
        sql = f"SELECT {name} FROM edge ORDER BY id"
    rows = conn.execute(sql).fetchall()
    if kind not in ("ts", "date"):
        return [r[0] for r in rows]
    out = []
    for value, low, high in rows:
        lo: Any = TS_LO if kind == "ts" else TS_LO.date()
        hi: Any = TS_HI if kind == "ts" else TS_HI.date()
        if value is not None or low is None:
            out.append(value)
        else:
            assert low != high
            out.append(lo if low else hi)
    return out


def test_oracle_text_and_binary(oracle_db: tuple[str, list[tuple[str, str, list[str], str]], int]) -> None:
    dsn, cols, _version = oracle_db
    slot_pub = ("oracle_slot", "oracle_pub")
    text, text_notes = _decode_all(dsn, *slot_pub, False, cols)
    binary, binary_notes = _decode_all(dsn, *slot_pub, True, cols)
    assert text_notes == binary_notes
    assert text_notes["timestamp_clamped"] > 0 and text_notes["date_clamped"] > 0
    assert text_notes["numeric_nan_nulled"] == 2  # c_num122 and the element of c_numarr
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET DateStyle = ISO; SET IntervalStyle = postgres; SET TimeZone = 'UTC'")
        failures = []
        for name, _type, _values, kind in cols:
            expected = _expected(conn, name, kind)
            for mode, arrays in (("text", text), ("binary", binary)):
                if name not in arrays:
                    continue
                got = arrays[name].to_pylist()
                if kind in ("ts", "date") and arrays[name].type != pa.date32() and arrays[name].type.tz:
                    expected_cmp = [
                        None if v is None else (v if v.tzinfo else v.replace(tzinfo=UTC)) for v in expected
                    ]
                else:
                    expected_cmp = expected
                if kind == "py" and name == "c_float4":
                    expected_cmp = [None if v is None else float(np.float32(v)) for v in expected]
                if _f(got) != _f(expected_cmp):
                    failures.append(f"{name} ({mode}): got {got!r} expected {expected_cmp!r}")
            if name in binary and name in text:
                a, b = text[name], binary[name]
                if _f(a.to_pylist()) != _f(b.to_pylist()) or a.type != b.type:
                    failures.append(f"{name}: text mode {a.to_pylist()!r} != binary mode {b.to_pylist()!r}")
        assert not failures, "\n".join(failures)
