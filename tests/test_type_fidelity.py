"""THE TYPE MATRIX, end to end: every type through the real job into Delta and back.

One table holds edge values of every type the decoder knows (and of types it does not:
geometric and text-search types, an extension-like base type with a binary send function
of its own, one without any), on PostgreSQL 15 and 18. Three phases go through the real
job (binary pgoutput, the embedded engine, MERGE into Delta), each followed by a check:

1. inserts of every edge value and an all-NULL row;
2. updates that rotate every value to another row while a large TOASTed text and a large
   TOASTed array stay unchanged (sent as ``u``, filled from the lake), plus deletes;
3. TRUNCATE, the rows inserted again, an update leaving the TOASTed columns unchanged
   (filled from the same window), a delete.

After each phase the Delta table is read back twice, with delta-rs (independent of the
engine) and with the engine's own Spark session, and both must equal what PostgreSQL
returns for the same rows under the documented type rules (docs/concepts/types.md): the expected
values come from PostgreSQL itself (psycopg's values, ``col::text``, the output function,
``col::text[]``), never written by hand. PostgreSQL 18 also publishes a stored generated
column (``publish_generated_columns = stored``), which must arrive like any other.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import psycopg
import pytest

from lake_read import read_delta
from pg2delta.config import load
from pg2delta.decode import pgoutput
from pg2delta.job import Job, RunReport
from pg2delta.source.throwaway import ThrowawayPostgres

# The compat tier (make test-compat) runs this file again on the oldest supported stack.
pytestmark = pytest.mark.compat

UTC = dt.UTC
TS_LO = dt.datetime(1, 1, 1)
TS_HI = dt.datetime(9999, 12, 31, 23, 59, 59, 999999)

SETUP = r"""
CREATE TYPE mood AS ENUM ('happy', 'sad', 'with space');
CREATE DOMAIN posnum AS numeric(10,3) CHECK (VALUE > 0);
CREATE DOMAIN shorttext AS varchar(20);
CREATE DOMAIN place AS point;
CREATE TYPE comp AS (a int4, b text, c numeric, d timestamptz, e int4[], f float8, g bytea, h bool, i point);
CREATE TYPE textrange AS RANGE (subtype = text);
-- An extension-like base type with a binary send function of its own (int4's), unknown to
-- pg2delta: pgoutput sends it in binary, and only the server knows how to print it.
CREATE TYPE extint;
CREATE FUNCTION extint_in(cstring) RETURNS extint AS 'int4in' LANGUAGE internal IMMUTABLE STRICT;
CREATE FUNCTION extint_out(extint) RETURNS cstring AS 'int4out' LANGUAGE internal IMMUTABLE STRICT;
CREATE FUNCTION extint_recv(internal) RETURNS extint AS 'int4recv' LANGUAGE internal IMMUTABLE STRICT;
CREATE FUNCTION extint_send(extint) RETURNS bytea AS 'int4send' LANGUAGE internal IMMUTABLE STRICT;
CREATE TYPE extint (INPUT = extint_in, OUTPUT = extint_out, RECEIVE = extint_recv, SEND = extint_send,
                    LIKE = int4);
-- One without a send function: pgoutput falls back to the text format for it.
CREATE TYPE exttext;
CREATE FUNCTION exttext_in(cstring) RETURNS exttext AS 'textin' LANGUAGE internal IMMUTABLE STRICT;
CREATE FUNCTION exttext_out(exttext) RETURNS cstring AS 'textout' LANGUAGE internal IMMUTABLE STRICT;
CREATE TYPE exttext (INPUT = exttext_in, OUTPUT = exttext_out, INTERNALLENGTH = VARIABLE, STORAGE = extended);
"""

# (column, type, SQL literals (row r gets the r-th, NULL past the end), comparison kind):
#   py       psycopg's value (Decimal, int, bool, bytes, date, lists ...); a NaN in a
#            bounded numeric must be NULL (the rule), floats bit for bit
#   f4       float4: psycopg's value as a float32
#   ts/tstz/date  psycopg's value when inside 0001-01-01 .. 9999-12-31 23:59:59.999999
#            (UTC for tstz), otherwise the nearest bound (the clamping rule)
#   text     the server's col::text
#   out      the type's output function (format('%s', col)); inet::text would add /32
#   clamparr one-dimensional arrays of those three: every element clamped the same way (in SQL)
#   textarr  the server's col::text[] (arrays of text-mapped types)
#   dims / dimstext  arrays whose values have more or fewer dimensions than declared: more are
#            flattened in order (unnest), fewer wrapped in outer lists (ARRAY[col]); as psycopg
#            loads them / as text elements
#   money    col::numeric (money -> decimal(19,2))
COLUMNS: list[tuple[str, str, list[str], str]] = [
    ("c_bool", "bool", ["true", "false"], "py"),
    ("c_int2", "int2", ["-32768", "32767", "0"], "py"),
    ("c_int4", "int4", ["-2147483648", "2147483647", "7", "0"], "py"),
    ("c_int8", "int8", ["-9223372036854775808", "9223372036854775807", "1"], "py"),
    ("c_oid", "oid", ["0", "4294967295", "1"], "py"),
    ("c_float4", "float4", ["'NaN'", "'Infinity'", "'-Infinity'", "3.4028235e38", "'-0'", "0.1", "1e-45"], "f4"),
    ("c_float8", "float8", ["'NaN'", "'Infinity'", "'-Infinity'", "1e308", "5e-324", "0.1", "'-0'"], "py"),
    ("c_num122", "numeric(12,2)", ["0", "-0.01", "9999999999.99", "'NaN'", "1.5", "-1234567890.12"], "py"),
    ("c_num380", "numeric(38,0)", ["99999999999999999999999999999999999999", "-1", "0"], "py"),
    ("c_num3838", "numeric(38,38)", ["0.12345678901234567890123456789012345678", "-0.00000000000000000000000000000000000001"], "py"),
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
            "repeat('9', 1000)::numeric / 7",
        ],
        "text",
    ),
    ("c_num50", "numeric(50,10)", ["1234567890123456789012345678901234567890.0123456789", "'NaN'", "-1"], "text"),
    ("c_money", "money", ["-92233720368547758.08", "0", "1234.56", "92233720368547758.07"], "money"),
    ("c_text", "text", ["''", "'héllo ✓ 𝄞'", "E'a\"b\\\\c\\nd'", "'NULL'", "' lead'"], "text"),
    ("c_varchar", "varchar(10)", ["'abc'", "''", "'ü'"], "text"),
    ("c_bpchar", "char(5)", ["'ab'", "''", "'abcde'", "'é'"], "py"),
    ("c_name", "name", ["'pg_class'", "''", "'Ä b'"], "text"),
    ("c_char", '"char"', ["'a'", "'\\200'", "''", "'\\\\'"], "text"),
    (
        "c_json",
        "json",
        [
            "'{ \"b\" : [1, 2 ], \"a\":1, \"a\" : 2 }'",
            "'null'",
            "' [ ] '",
            "'{\"\\u00e9\": 1.50e0}'",
            "E'{\\n\\t\"z\": {}, \"y\": \"\"}'",
        ],
        "text",
    ),
    (
        "c_jsonb",
        "jsonb",
        ['\'{"b": {"c": [1, 2.50, "x", null, true]}, "a": "é", "a": 3}\'', "'[]'", "'\"s\"'", "'1e3'"],
        "text",
    ),
    ("c_xml", "xml", ["'<a>x &amp; y</a>'", "'<b/>'"], "text"),
    ("c_bytea", "bytea", ["'\\x00ff00'", "''", "'\\x5c'"], "py"),
    (
        "c_date",
        "date",
        ["'infinity'", "'-infinity'", "'0001-01-01'", "'9999-12-31'", "'4713-01-01 BC'", "'10000-01-01'", "'2000-02-29'"],
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
        "tstz",
    ),
    ("c_time", "time", ["'00:00:00'", "'23:59:59.999999'", "'24:00:00'", "'12:00:00.5'"], "text"),
    ("c_timetz", "timetz", ["'12:00:00+05:30'", "'00:00:00-14'", "'01:02:03+05:30:15'"], "text"),
    (
        "c_interval",
        "interval",
        ["'1 year 2 mons 3 days 04:05:06.5'", "'-00:00:01'", "'-1 year -2 mons +3 days -04:05:06'", "'0'", "'1000000 hours'"],
        "text",
    ),
    ("c_uuid", "uuid", ["'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'", "'00000000-0000-0000-0000-000000000000'"], "text"),
    ("c_inet", "inet", ["'192.168.0.1'", "'192.168.0.1/24'", "'::1'", "'2001:db8::1/64'", "'::ffff:1.2.3.4'"], "out"),
    ("c_cidr", "cidr", ["'10.0.0.0/8'", "'192.168.1.1/32'", "'2001:db8::/32'", "'::/0'"], "text"),
    ("c_macaddr", "macaddr", ["'08:00:2B:01:02:03'", "'ff:ff:ff:ff:ff:ff'"], "text"),
    ("c_macaddr8", "macaddr8", ["'08:00:2b:01:02:03:04:05'"], "text"),
    ("c_bit", "bit(4)", ["B'1010'", "B'0001'"], "text"),
    ("c_varbit", "varbit", ["B''", "B'101010101'", "B'1'"], "text"),
    ("c_enum", "mood", ["'happy'", "'with space'", "'sad'"], "text"),
    ("c_domain", "posnum", ["1.234", "99999.5"], "py"),
    ("c_domtext", "shorttext", ["'short'", "''"], "text"),
    ("c_int4arr", "int4[]", ["'{1,NULL,3}'", "'{}'", "'[0:1]={5,6}'", "'{NULL}'"], "py"),
    ("c_int4arr2", "int4[][]", ["'{{1,2},{NULL,4}}'", "'{}'", "'{{7}}'", "'{{1,NULL,3},{4,5,6}}'", "'{8,NULL}'"], "dims"),
    # declared one-dimensional, holding more (PostgreSQL does not enforce declared dimensions)
    ("c_int4flat", "int4[]", ["'{{1,2},{3,NULL}}'", "'{1,2}'", "'{{{1}},{{2}}}'", "'{}'"], "dims"),
    ("c_int8arr3", "int8[][][]", ["'{{{1,NULL},{3,4}},{{5,6},{7,8}}}'", "'{{{9}}}'"], "py"),
    ("c_textarr", "text[]", ['\'{"a b","","NULL",NULL,"x\\"y",é,"{}"}\'', "'{a,b}'"], "textarr"),
    ("c_textarr2", "text[][]", ["'{{a,NULL},{\"c d\",\"\"}}'"], "textarr"),
    ("c_numarr", "numeric(10,2)[]", ["'{1.5,NaN,-2,NULL}'", "'{}'"], "py"),
    ("c_unumarr", "numeric[]", ["'{1.5,NaN,Infinity,NULL,1e-20}'"], "textarr"),
    ("c_f8arr", "float8[]", ["'{1.5,-Infinity,NULL,NaN}'", "'{NaN}'"], "py"),
    ("c_f4arr", "float4[]", ["'{NaN,0.1,Infinity,NULL}'"], "f4"),
    ("c_boolarr", "bool[]", ["'{t,NULL,f}'"], "py"),
    ("c_tsarr", "timestamptz[]", ['\'{"2020-01-01 00:00:00+00","1999-12-31 23:59:59.5+03",NULL,infinity}\''], "clamparr"),
    ("c_tsntzarr", "timestamp[]", ["'{-infinity,\"10000-01-01 00:00:00\",NULL,\"2020-01-01 10:00:00\"}'"], "clamparr"),
    ("c_datearr1", "date[]", ["'{infinity,\"0044-03-15 BC\",2020-01-01,NULL}'"], "clamparr"),
    ("c_datearr", "date[][]", ["'{{2020-01-01,NULL},{1999-12-31,0001-01-01}}'"], "py"),
    ("c_bytearr", "bytea[]", ["'{\"\\\\\\\\x00ff\",NULL}'"], "py"),
    ("c_uuidarr", "uuid[]", ["'{A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11,NULL}'"], "textarr"),
    ("c_intervalarr", "interval[]", ["'{\"1 day\",NULL,\"-00:00:01\"}'"], "textarr"),
    ("c_rangearr", "int4range[]", ['\'{"[1,2)",empty,"(,5]"}\''], "textarr"),
    ("c_jsonbarr", "jsonb[]", ["ARRAY['{\"a\": [1, 2]}'::jsonb, 'null'::jsonb, NULL]"], "textarr"),
    ("c_enumarr", "mood[]", ["'{happy,\"with space\",NULL}'"], "textarr"),
    ("c_pointarr", "point[]", ["ARRAY[point(1,2), NULL, point(-0.5, 1e300)]"], "textarr"),
    (
        "c_comp",
        "comp",
        [
            "ROW(1, 'x, y', 1.50, '2020-01-01 00:00:00+00', '{1,2}', 0.1, '\\x00', true, '(1,2)')::comp",
            "ROW(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)::comp",
            "ROW(2, '', 'NaN', 'infinity', '{}', 'Infinity', '', false, '(0,-1.5)')::comp",
            "ROW(3, 'a\"b\\c(d)', 1e-5, '0044-03-15 12:00:00 BC', '{{1,2},{3,4}}', 1e20, '\\x5c', NULL, NULL)::comp",
        ],
        "text",
    ),
    ("c_range", "int4range", ["'[1,10)'", "'empty'", "'(,5]'", "'[3,)'", "'(,)'"], "text"),
    ("c_numrange", "numrange", ["'[1.5,2.50]'", "'(-1,)'"], "text"),
    ("c_tstzrange", "tstzrange", ["'[\"2020-01-01 00:00:00+00\",infinity)'"], "text"),
    ("c_daterange", "daterange", ["'[2020-01-01,2020-02-01]'"], "text"),
    ("c_multirange", "int4multirange", ["'{[1,3),[5,7)}'", "'{}'"], "text"),
    ("c_textrange", "textrange", ['\'["a b","c\\"d")\''], "text"),
    # types without a binary decoder in pg2delta (sent in binary by pgoutput all the same)
    ("c_point", "point", ["'(1,2)'", "'(-0.5,1e300)'", "'(NaN,Infinity)'"], "text"),
    ("c_box", "box", ["'((0,0),(1,1))'"], "text"),
    ("c_polygon", "polygon", ["'((0,0),(1,1),(1,0))'"], "text"),
    ("c_circle", "circle", ["'<(1,2),3>'"], "text"),
    ("c_line", "line", ["'{1,-1,0}'"], "text"),
    ("c_lseg", "lseg", ["'[(0,0),(1,1)]'"], "text"),
    ("c_path", "path", ["'[(0,0),(1,1),(2,0)]'", "'((0,0),(1,1))'"], "text"),
    ("c_tsvector", "tsvector", ["to_tsvector('simple', 'the quick brown fox')", "'a:1A b:2'"], "text"),
    ("c_tsquery", "tsquery", ["'fat & (rat | cat)'"], "text"),
    ("c_pglsn", "pg_lsn", ["'16/B374D848'", "'0/0'"], "text"),
    ("c_jsonpath", "jsonpath", ["'$.a[*] ? (@ > 1)'"], "text"),
    ("c_xid8", "xid8", ["'18446744073709551615'"], "text"),
    ("c_regtype", "regtype", ["'int4'", "'mood'"], "text"),
    ("c_aclitem", "aclitem", ["'postgres=arwdDxt/postgres'"], "text"),
    ("c_extint", "extint", ["'42'", "'-2147483648'"], "text"),
    ("c_exttext", "exttext", ["'anything, as text'", "''"], "text"),
    ("c_extintarr", "extint[]", ["'{1,NULL,-3}'", "'{{1,2},{3,4}}'"], "dimstext"),
    ("c_place", "place", ["'(3,4)'"], "text"),
]

# Large values that PostgreSQL keeps out of line (TOAST): an update that does not touch them
# sends them as 'u' (unchanged), and the job must fill them from the window or the lake.
TOAST_COLUMNS = [
    ("c_big", "text", "(SELECT string_agg(md5(g::text || {seed}), '') FROM generate_series(1, 800) g)", "text"),
    ("c_bigarr", "int8[]", "(SELECT array_agg(g * {seed}) FROM generate_series(1, 3000) g)", "py"),
]
GENERATED = ("c_gen", "int8", "GENERATED ALWAYS AS (c_int8 / 2 + c_int4) STORED", "py")


INFINITE_INTERVAL = ("c_ivinf", "interval", ["'infinity'", "'-infinity'", "'1 day'"], "text")  # PG 17+


def _literal_columns(version: int, xml: bool) -> list[tuple[str, str, list[str], str]]:
    """COLUMNS, without xml on a server built without libxml (the PostgreSQL 18 wheel)."""
    cols = [c for c in COLUMNS if xml or c[1] != "xml"]
    return [*cols, INFINITE_INTERVAL] if version >= 17 else cols


def _columns(version: int, xml: bool) -> list[tuple[str, str, str]]:
    """(name, type, kind) of every column but id, in table order."""
    cols = [(n, t, k) for n, t, _v, k in _literal_columns(version, xml)] + [(n, t, k) for n, t, _e, k in TOAST_COLUMNS]
    if version >= 18:
        cols.append((GENERATED[0], GENERATED[1], GENERATED[3]))
    return cols


# --- values ---------------------------------------------------------------------------------


def _norm(v: Any) -> Any:
    """One comparable form: floats bit for bit (all NaNs equal), bytes for binary, UTC datetimes."""
    if isinstance(v, float):
        return ("float", b"nan" if math.isnan(v) else struct.pack("!d", v))
    if isinstance(v, list | tuple):
        return [_norm(x) for x in v]
    if isinstance(v, bytearray | memoryview):
        return bytes(v)
    if isinstance(v, Decimal) and v.is_nan():
        return None  # a NaN in a bounded numeric column is NULL in the lake (the documented rule)
    if isinstance(v, dt.datetime) and v.tzinfo is not None:
        return v.astimezone(UTC)
    return v


def _float32(v: Any) -> Any:
    if isinstance(v, list):
        return [_float32(x) for x in v]
    return None if v is None else float(np.float32(v))


def _expected_column(conn: psycopg.Connection[Any], name: str, typ: str, kind: str) -> list[Any]:
    """What the lake must hold for column ``name``, row by row in id order, asked of PostgreSQL."""
    if kind == "clamparr":
        elem = typ.removesuffix("[]")
        lo, hi = ("0001-01-01", "9999-12-31") if elem == "date" else ("0001-01-01 00:00:00", "9999-12-31 23:59:59.999999")
        q = (
            f"SELECT CASE WHEN {name} IS NOT NULL THEN ARRAY(SELECT CASE WHEN v < '{lo}'::{elem} THEN '{lo}'::{elem} "
            f"WHEN v > '{hi}'::{elem} THEN '{hi}'::{elem} ELSE v END FROM unnest({name}) WITH ORDINALITY AS u(v, i) "
            "ORDER BY i) END FROM matrix ORDER BY id"
        )
    elif kind in ("dims", "dimstext"):
        declared = typ.count("[]")
        elem_cast, cast = ("::text", "::text[]") if kind == "dimstext" else ("", "")
        flat = f"ARRAY(SELECT v{elem_cast} FROM unnest({name}) WITH ORDINALITY AS u(v, i) ORDER BY i)"
        pads = declared - 1  # the values here that have fewer dimensions have one
        padded = "ARRAY[" * pads + f"{name}{cast}" + "]" * pads
        q = (
            f"SELECT CASE WHEN array_ndims({name}) > {declared} THEN {flat} "
            f"WHEN array_ndims({name}) < {declared} THEN {padded} ELSE {name}{cast} END "
            "FROM matrix ORDER BY id"
        )
    elif kind == "text":
        q = f"SELECT {name}::text FROM matrix ORDER BY id"
    elif kind == "out":
        q = f"SELECT CASE WHEN {name} IS NOT NULL THEN format('%s', {name}) END FROM matrix ORDER BY id"
    elif kind == "textarr":
        q = f"SELECT {name}::text[] FROM matrix ORDER BY id"
    elif kind == "money":
        q = f"SELECT {name}::numeric FROM matrix ORDER BY id"
    elif kind in ("ts", "tstz", "date"):
        lo, hi = ("'0001-01-01'", "'9999-12-31'") if kind == "date" else ("'0001-01-01 00:00:00'", "'9999-12-31 23:59:59.999999'")
        if kind == "tstz":
            lo, hi = f"{lo}::timestamptz", f"{hi}::timestamptz"  # the session is in UTC
        q = (
            f"SELECT CASE WHEN {name} BETWEEN {lo} AND {hi} THEN {name} END, {name} < {lo}, {name} > {hi} "
            "FROM matrix ORDER BY id"
        )
    else:
        q = f"SELECT {name} FROM matrix ORDER BY id"
    rows = conn.execute(q).fetchall()
    if kind == "f4":
        return [_float32(r[0]) for r in rows]
    if kind not in ("ts", "tstz", "date"):
        return [r[0] for r in rows]
    low_bound: Any = {"ts": TS_LO, "tstz": TS_LO.replace(tzinfo=UTC), "date": TS_LO.date()}[kind]
    high_bound: Any = {"ts": TS_HI, "tstz": TS_HI.replace(tzinfo=UTC), "date": TS_HI.date()}[kind]
    out = []
    for value, below, _above in rows:
        if value is not None or below is None:
            out.append(value)
        else:
            out.append(low_bound if below else high_bound)
    return out


@dataclass
class Snapshot:
    """One phase: what PostgreSQL holds and what the lake holds, read two ways."""

    phase: str
    version: int
    ids: list[int]
    expected: dict[str, list[Any]]
    types: dict[str, str]
    delta_rs: dict[str, list[Any]]
    spark: dict[str, list[Any]]
    spark_ids: list[int]
    notes: dict[str, int]
    rule_counts: dict[str, int]
    unchanged_toast: int
    report: RunReport
    arrow_types: dict[str, str] = field(default_factory=dict)


def _expected(dsn: str, version: int, xml: bool) -> tuple[list[int], dict[str, list[Any]]]:
    with psycopg.connect(dsn) as conn:
        conn.execute("SET DateStyle = ISO; SET IntervalStyle = postgres; SET TimeZone = 'UTC'")
        conn.execute("SET extra_float_digits = 3")
        ids = [r[0] for r in conn.execute("SELECT id FROM matrix ORDER BY id").fetchall()]
        return ids, {name: _expected_column(conn, name, typ, kind) for name, typ, kind in _columns(version, xml)}


def _rule_counts(dsn: str, version: int, xml: bool) -> dict[str, int]:
    """How many values of the table each rule applies to, as PostgreSQL counts them."""
    parts: dict[str, list[str]] = {
        "timestamp_clamped": [],
        "date_clamped": [],
        "numeric_nan_nulled": [],
        "array_dims_flattened": [],
        "array_dims_padded": [],
    }
    for name, typ, _kind in _columns(version, xml):
        base = typ.replace("[]", "")
        if "[]" in typ:
            k = typ.count("[]")
            parts["array_dims_flattened"].append(f"(SELECT count(*) FROM matrix WHERE array_ndims({name}) > {k})")
            parts["array_dims_padded"].append(f"(SELECT count(*) FROM matrix WHERE array_ndims({name}) < {k})")
        if "[]" in typ:  # every element of the arrays
            value, target = f"(SELECT count(*) FROM matrix, unnest({name}) v WHERE {{cond}})", "v"
        else:
            value, target = "(SELECT count(*) FROM matrix WHERE {cond})", name
        if base in ("timestamp", "timestamptz"):
            cond = f"NOT {target} BETWEEN '0001-01-01 00:00:00' AND '9999-12-31 23:59:59.999999'"
            parts["timestamp_clamped"].append(value.format(cond=cond))
        elif base == "date":
            parts["date_clamped"].append(value.format(cond=f"NOT {target} BETWEEN '0001-01-01' AND '9999-12-31'"))
        elif DOCUMENTED.get(base, "").startswith("decimal") and base != "money":  # bounded numerics
            parts["numeric_nan_nulled"].append(value.format(cond=f"{target} = 'NaN'"))
    with psycopg.connect(dsn) as conn:
        conn.execute("SET TimeZone = 'UTC'")
        return {k: int(conn.execute("SELECT " + " + ".join(v)).fetchone()[0]) for k, v in parts.items()}  # type: ignore[index]


class _Notes(logging.Handler):
    """Collects the job's per-window notes (``window note: name = count``) from its log."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        m = re.fullmatch(r"window note: (\w+) = (\d+)", record.getMessage())
        if m:
            self.counts[m.group(1)] = self.counts.get(m.group(1), 0) + int(m.group(2))


def _count_unchanged_toast(dsn: str, slot: str, pub: str) -> int:
    """How many 'u' values the slot holds right now for updates (peeked, binary, as the job reads)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s, 'binary', 'true')",
            (slot, pub),
        ).fetchall()
    count = 0
    for (data,) in rows:
        msg = pgoutput.parse_message(bytes(data))
        if isinstance(msg, pgoutput.Update):
            count += sum(1 for v in msg.new if v is pgoutput.UNCHANGED_TOAST)
    return count


# --- the scenario -----------------------------------------------------------------------------


def _phases(conn: psycopg.Connection[Any], literal: list[tuple[str, str, list[str], str]]) -> Iterator[str]:
    names = [n for n, _t, _v, _k in literal]
    nrows = max(len(v) for _n, _t, v, _k in literal)
    # 1. inserts: row r gets the r-th literal of every column (NULL past the end), one all-NULL row
    for r in range(nrows):
        values = [v[r] if r < len(v) else "NULL" for _n, _t, v, _k in literal]
        values += [expr.format(seed=r + 1) for _n, _t, expr, _k in TOAST_COLUMNS]
        toast = [n for n, _t, _e, _k in TOAST_COLUMNS]
        conn.execute(f"INSERT INTO matrix (id, {', '.join(names + toast)}) VALUES ({r}, {', '.join(values)})")
    conn.execute("INSERT INTO matrix (id) VALUES (%s)", (nrows,))
    yield "inserts"
    # 2. every value moves to the next row, TOASTed columns untouched ('u', filled from the lake);
    #    then a second update of one row in the same window, and deletes
    assignments = ", ".join(f"{n} = src.{n}" for n in names)
    conn.execute(
        f"UPDATE matrix SET {assignments} FROM matrix AS src "
        f"WHERE src.id = (matrix.id + 1) % {nrows + 1} AND matrix.id % 3 <> 2"
    )
    conn.execute("UPDATE matrix SET c_int4 = c_int4 + 1 WHERE id = 1")
    conn.execute("DELETE FROM matrix WHERE id % 3 = 2")
    yield "updates and deletes"
    # 3. truncate and insert again (rows as they were, under new ids), then an update that
    #    leaves the TOASTed columns unchanged (filled from the same window), and a delete
    conn.execute("CREATE TEMP TABLE keep AS SELECT * FROM matrix")
    conn.execute("TRUNCATE matrix")
    cols = ", ".join(names + [n for n, _t, _e, _k in TOAST_COLUMNS])
    conn.execute(f"INSERT INTO matrix (id, {cols}) SELECT id + 100, {cols} FROM keep")
    conn.execute(f"INSERT INTO matrix (id, {cols}) SELECT id + 200, {cols} FROM keep WHERE id < 3")
    conn.execute("UPDATE matrix SET c_text = coalesce(c_text, '') || ' again', c_int2 = 1 WHERE id % 2 = 0")
    conn.execute("DELETE FROM matrix WHERE id = 201")
    yield "truncate and reinsert"


def _spark_rows(job: Job, uri: str) -> tuple[list[int], dict[str, list[Any]]]:
    """The table as the engine's Spark session reads it, in id order.

    Spark hands out timestamps (with time zone) as naive datetimes in the session time zone;
    they get that zone back here so that they compare as instants.
    """
    from pyspark.sql.types import ArrayType, DataType, TimestampType

    spark = job.engine.spark
    zone = ZoneInfo(spark.conf.get("spark.sql.session.timeZone") or "UTC")

    def fix(v: Any, t: DataType) -> Any:
        if v is None:
            return None
        if isinstance(t, ArrayType):
            return [fix(x, t.elementType) for x in v]
        if isinstance(t, TimestampType):
            return v.replace(tzinfo=zone)
        return v

    df = spark.read.format("delta").load(uri)
    if type(spark).__module__.startswith("pyspark.sql.session"):
        # Classic pyspark turns a timestamp into a datetime in the Python process's local time
        # zone (and fails near year 1): its microseconds since the epoch come out instead.
        return _classic_spark_rows(df)
    rows = df.orderBy("id").collect()
    data = {f.name: [fix(r[f.name], f.dataType) for r in rows] for f in df.schema.fields}
    return [int(i) for i in data.pop("id")], data


def _classic_spark_rows(df: Any) -> tuple[list[int], dict[str, list[Any]]]:
    from pyspark.sql.types import ArrayType, TimestampType

    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

    def expr(name: str, t: Any) -> str:
        q = f"`{name}`"
        if isinstance(t, TimestampType):
            return f"unix_micros({q}) AS {q}"
        if isinstance(t, ArrayType) and isinstance(t.elementType, TimestampType):
            return f"transform({q}, x -> unix_micros(x)) AS {q}"
        return q

    def back(v: Any, t: Any) -> Any:
        if v is None:
            return None
        if isinstance(t, ArrayType) and isinstance(t.elementType, TimestampType):
            return [back(x, t.elementType) for x in v]
        if isinstance(t, TimestampType):
            return epoch + dt.timedelta(microseconds=v)
        return v

    fields = df.schema.fields
    rows = df.selectExpr(*[expr(f.name, f.dataType) for f in fields]).orderBy("id").collect()
    data = {f.name: [back(r[f.name], f.dataType) for r in rows] for f in fields}
    return [int(i) for i in data.pop("id")], data


def _scenario(server: ThrowawayPostgres, tmp: Path) -> list[Snapshot]:
    db = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    dsn = server.dsn_for(db)
    slot, pub = f"slot_{uuid.uuid4().hex[:8]}", f"pub_{uuid.uuid4().hex[:8]}"
    snapshots: list[Snapshot] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = conn.info.server_version // 10000
            conn.execute(SETUP)
            try:
                conn.execute("SELECT '<a/>'::xml")
                xml = True
            except psycopg.errors.FeatureNotSupported:
                xml = False
            literal = _literal_columns(version, xml)
            cols = [f"{n} {t}" for n, t, _v, _k in literal] + [f"{n} {t}" for n, t, _e, _k in TOAST_COLUMNS]
            if version >= 18:
                cols.append(" ".join(GENERATED[:3]))
            conn.execute(f"CREATE TABLE matrix (id int PRIMARY KEY, {', '.join(cols)})")
            for n, _t, _e, _k in TOAST_COLUMNS:
                conn.execute(f"ALTER TABLE matrix ALTER {n} SET STORAGE EXTERNAL")
            with_gen = " WITH (publish_generated_columns = stored)" if version >= 18 else ""
            conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE matrix{with_gen}")
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            lake = tmp / "lake"
            job = Job(load(None, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake)))
            try:
                for phase in _phases(conn, literal):
                    toast = _count_unchanged_toast(dsn, slot, pub)
                    handler = _Notes()
                    job_log = logging.getLogger("pg2delta.window.read")
                    job_log.addHandler(handler)
                    try:
                        report = job.run()
                    finally:
                        job_log.removeHandler(handler)
                    notes = handler.counts
                    ids, expected = _expected(dsn, version, xml)
                    path = lake / "public" / "matrix"
                    table = read_delta(str(path)).sort_by("id")
                    spark_ids, spark = _spark_rows(job, job.lake.table_uri("public", "matrix"))
                    snapshots.append(
                        Snapshot(
                            phase=phase,
                            version=version,
                            ids=ids,
                            expected=expected,
                            types={n: t for n, t, _k in _columns(version, xml)},
                            delta_rs={n: table.column(n).to_pylist() for n in expected} | {"id": table.column("id").to_pylist()},
                            spark=spark,
                            spark_ids=spark_ids,
                            notes=notes,
                            rule_counts=_rule_counts(dsn, version, xml),
                            unchanged_toast=toast,
                            report=report,
                            arrow_types={n: str(table.schema.field(n).type) for n in expected},
                        )
                    )
            finally:
                job.close()
    finally:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(f'DROP DATABASE "{db}" WITH (FORCE)')
    return snapshots


@pytest.fixture(scope="module")
def matrix(pg_server: ThrowawayPostgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Snapshot]]:
    """The whole scenario once per server version; the tests below check what it recorded."""
    yield _scenario(pg_server, tmp_path_factory.mktemp("matrix"))


def _diff(snap: Snapshot, got_ids: list[int], got: dict[str, list[Any]], reader: str) -> list[str]:
    """Every column where ``got`` differs from PostgreSQL, one line each (row ids named)."""
    if got_ids != snap.ids:
        return [f"{snap.phase}, {reader}: ids {got_ids} != PostgreSQL ids {snap.ids}"]
    failures = []
    for name, expected in snap.expected.items():
        values = got[name]
        bad = []
        for rid, g, e in zip(snap.ids, values, expected, strict=True):
            if _norm(g) != _norm(e):
                bad.append(f"id {rid}: got {g!r:.120} expected {e!r:.120}")
        if bad:
            failures.append(f"{snap.phase}, {reader}, {name} ({snap.types[name]}): " + "; ".join(bad[:3]))
    return failures


@pytest.mark.e2e
@pytest.mark.classic
def test_scenario_exercises_the_rules(matrix: list[Snapshot]) -> None:
    """The phases did what they claim: TOAST sent unchanged, values clamped and nulled, a truncate."""
    inserts, updates, truncate = matrix
    # the inserts decode every value of the table once: the job's counts are PostgreSQL's
    for rule, count in inserts.rule_counts.items():
        assert count > 0 and inserts.notes.get(rule) == count, (rule, inserts.notes, inserts.rule_counts)
    assert inserts.unchanged_toast == 0
    assert updates.unchanged_toast > 0, "the rotating update should send the TOASTed columns as unchanged"
    assert truncate.unchanged_toast > 0
    assert any(t.truncated for w in truncate.report.windows for t in w.tables)
    assert len(updates.ids) < len(inserts.ids) and truncate.ids[0] >= 100


@pytest.mark.e2e
@pytest.mark.classic
def test_delta_rs_reads_what_postgres_holds(matrix: list[Snapshot]) -> None:
    """delta-rs (independent of the engine) reads every value as PostgreSQL has it, under the rules."""
    failures = [f for snap in matrix for f in _diff(snap, snap.delta_rs["id"], snap.delta_rs, "delta-rs")]
    assert not failures, "\n".join(failures)


@pytest.mark.e2e
@pytest.mark.classic
def test_spark_reads_what_postgres_holds(matrix: list[Snapshot]) -> None:
    """The engine's own read (Spark) gives the same values."""
    failures = [f for snap in matrix for f in _diff(snap, snap.spark_ids, snap.spark, "spark")]
    assert not failures, "\n".join(failures)



@pytest.mark.e2e
@pytest.mark.classic
def test_generated_columns_arrive_like_any_other(matrix: list[Snapshot]) -> None:
    """PostgreSQL 18 publishes stored generated columns (publish_generated_columns = stored)."""
    if matrix[0].version < 18:
        pytest.skip("publish_generated_columns exists from PostgreSQL 18 on")
    for snap in matrix:
        values = snap.delta_rs[GENERATED[0]]
        assert any(v is not None for v in values), f"{snap.phase}: the generated column is empty in the lake"
        assert _norm(values) == _norm(snap.expected[GENERATED[0]])
        assert _norm(snap.spark[GENERATED[0]]) == _norm(snap.expected[GENERATED[0]])


# Arrow types of the Delta table, as docs/concepts/types.md documents them (per PostgreSQL type).
DOCUMENTED = {
    "bool": "bool", "int2": "int16", "int4": "int32", "int8": "int64", "oid": "int64",
    "float4": "float", "float8": "double", "money": "decimal128(19, 2)", "bytea": "binary",
    "date": "date32[day]", "timestamp": "timestamp[us]", "timestamptz": "timestamp[us, tz=UTC]",
    "numeric(12,2)": "decimal128(12, 2)", "numeric(38,0)": "decimal128(38, 0)",
    "numeric(38,38)": "decimal128(38, 38)", "numeric(5,-3)": "decimal128(8, 0)",
    "numeric(3,5)": "decimal128(5, 5)", "numeric(10,2)": "decimal128(10, 2)",
    "posnum": "decimal128(10, 3)", "char(5)": "string", "numeric": "string", "numeric(50,10)": "string",
}


@pytest.mark.e2e
@pytest.mark.classic
def test_delta_schema_follows_the_documented_mapping(matrix: list[Snapshot]) -> None:
    """Every other type is a string; arrays are (nested) lists of their element type."""
    snap = matrix[0]
    for name, arrow in snap.arrow_types.items():
        typ = snap.types[name]
        base, dims = typ.replace("[]", ""), typ.count("[]")
        want = DOCUMENTED.get(base, "string")
        for _ in range(dims):
            want = f"list<element: {want}>"
        assert arrow == want, f"{name} ({typ}): {arrow} in Delta, documented {want}"


@pytest.mark.integration
def test_types_without_a_decoder_are_printed_by_the_server(pgdb: str) -> None:
    """Binary values of types pg2delta cannot decode: the server's own text, in order, or a DecodeError."""
    from pg2delta.decode.typemap import KIND_BINARY, KIND_NULL, codec_for
    from pg2delta.errors import DecodeError
    from pg2delta.source.catalog import PgTypeCatalog

    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(SETUP)
        n = 2500  # more than one statement's worth of parameters, with repeats
        texts = [f"({i % 1700},-{i}.5)" for i in range(n)]
        rows = conn.execute(
            "SELECT p::text, point_send(p) FROM unnest(%s::point[]) WITH ORDINALITY AS u(p, i) ORDER BY i",
            (texts,),
        ).fetchall()
        extint = conn.execute("SELECT extint_send('-7'::extint), 'extint'::regtype::oid::int").fetchone()
        assert extint is not None
        catalog = PgTypeCatalog(conn)
        point_oid = 600
        values = [bytes(r[1]) for r in rows]
        buf = b"".join(values)
        lengths = np.array([len(v) for v in values], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        kinds = np.full(n, KIND_BINARY, dtype=np.uint8)
        kinds[3] = KIND_NULL
        got = codec_for(point_oid, -1, catalog).decode(buf, starts, lengths, kinds).to_pylist()
        assert got == [None if i == 3 else r[0] for i, r in enumerate(rows)]
        ext = codec_for(int(extint[1]), -1, catalog)
        raw = bytes(extint[0])
        one = np.zeros(1, np.int64)
        assert ext.decode(raw, one, np.array([len(raw)]), np.array([KIND_BINARY], np.uint8)).to_pylist() == ["-7"]
        assert ext.decode(raw, one, np.array([len(raw)]), np.array([KIND_BINARY], np.uint8), reference=True).to_pylist() == ["-7"]
        with pytest.raises(DecodeError, match="extint value at row 0: the server cannot read this binary value"):
            ext.decode(b"\x00\x01", one, np.array([2]), np.array([KIND_BINARY], np.uint8))
        # the connection is still usable after the refusal
        assert conn.execute("SELECT 1").fetchone() == (1,)
        with pytest.raises(DecodeError, match="no binary decoder for type point and no source server"):
            codec_for(point_oid, -1).decode(raw, one, np.array([len(raw)]), np.array([KIND_BINARY], np.uint8))
