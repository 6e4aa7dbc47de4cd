"""Each value's canonical text, spelled in PostgreSQL's SQL and in Spark SQL: what ``pg2delta
verify`` compares (:mod:`pg2delta.verify`).

Each column becomes, on both sides, a text that is equal exactly when the values are equal under
the documented type mapping (docs/concepts/types.md), so a documented conversion is not a difference:

* integers, oid: the decimal number; booleans ``t``/``f``; numerics (decimal in the lake) with the
  lake column's scale, NaN as NULL (the lake nulls it); strings (text, json, jsonb, unbounded
  numeric, time, interval, uuid, inet, ... every type the lake holds as text): the type's output
  function, ``format('%s', c)``, in a session with the job's settings (``DateStyle=ISO``,
  ``IntervalStyle=postgres``, ``TimeZone=UTC``, shortest-exact floats);
* floats: ``NaN``, ``Infinity``, ``-Infinity``, ``0``, else ``[-]m p e`` with the integer
  significand ``m`` and exponent ``e`` of the binary value, ``x = m * 2**e`` (both engines and
  PostgreSQL print floats differently, the bits are the same): PostgreSQL reads them from the
  bits (``float8send``), Spark computes them (``log2``, then a division by a power of two, exact,
  and a correction of one step where ``log2`` rounded); ``-0`` and ``0`` compare equal;
* dates: days since 1970-01-01; timestamps (with and without time zone): microseconds since
  1970-01-01 00:00 (UTC for timestamptz), after the documented clamp to 0001-01-01 ... 9999-12-31
  23:59:59.999999 on the source side; bytea: lower-case hex;
* arrays: the canonical texts of their elements in order, NULL elements marked. Arrays are
  flattened on both sides (the lake flattens values with more dimensions than declared and drops
  lower bounds): arrays declared with several dimensions are compared by their elements in order,
  not by their shape (a padded ``[[1, 2]]`` is the same as ``[1, 2]`` here).

A lake column type without a shared form has none (:func:`comparable`). A value is ``N`` when NULL, else ``V<bytes>:<text>``; a row's text is its columns' in name order, so
texts cannot run into each other (:func:`decode_items` reads one back).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

_2_52 = 4503599627370496
_2_53 = 9007199254740992


@dataclass(frozen=True, slots=True)
class ColumnType:
    """One compared column: its name, the lake's Spark type name and the source's base type name."""

    name: str
    delta: str  # Spark simpleString: int, decimal(10,2), array<timestamp>, ...
    pg: str  # the source's (base) type name; for arrays, the element's


_DECIMAL = re.compile(r"^decimal\((\d+),(-?\d+)\)$")
_SCALARS = {"boolean", "tinyint", "smallint", "int", "bigint", "float", "double", "string", "binary", "date",
            "timestamp", "timestamp_ntz"}
_OID_LIKE = {"oid", "regclass", "regproc", "regtype", "xid", "cid"}


def comparable(delta: str) -> bool:
    """Whether a lake column type has a canonical text on both sides."""
    inner = delta
    while inner.startswith("array<") and inner.endswith(">"):
        inner = inner[6:-1]
    return inner in _SCALARS or _DECIMAL.match(inner) is not None


def _pg_float(x: str) -> str:
    # The significand and exponent straight from the IEEE bits (float8send); Spark has no bit access
    # and computes the same numbers arithmetically (_spark_float).
    b = f"('x' || encode(float8send({x}), 'hex'))::bit(64)::bigint"
    exp = f"(({b} >> 52) & 2047)"
    frac = f"({b} & {_2_52 - 1})"
    return _float_cases(
        x, f"{x} = 'NaN'::float8", f"{x} = 'Infinity'::float8", f"{x} = '-Infinity'::float8",
        f"CASE WHEN {x} < 0 THEN '-' ELSE '' END || (CASE WHEN {exp} = 0 THEN {frac} ELSE {frac} + {_2_52} END)::text "
        f"|| 'p' || (CASE WHEN {exp} = 0 THEN -1074 ELSE {exp} - 1075 END)::text",
    )


def _spark_float(x: str) -> str:
    e0 = f"greatest(floor(log2(abs({x}))), -1022)"
    m0 = f"(abs({x}) / pow(2D, {e0} - 52))"
    e = f"({e0} + CASE WHEN {m0} >= {_2_53} THEN 1 WHEN {m0} < {_2_52} AND {e0} > -1022 THEN -1 ELSE 0 END)"
    return _float_cases(
        # isnan, not = NaN: Apache Spark says NaN = NaN, pysail does not.
        x, f"isnan({x})", f"{x} = CAST('Infinity' AS DOUBLE)", f"{x} = CAST('-Infinity' AS DOUBLE)",
        f"concat(CASE WHEN {x} < 0 THEN '-' ELSE '' END, "
        f"CAST(CAST(abs({x}) / pow(2D, {e} - 52) AS BIGINT) AS STRING), 'p', CAST({e} - 52 AS STRING))",
    )


def _float_cases(x: str, nan: str, inf: str, neg_inf: str, finite: str) -> str:
    """The canonical text of a float ``x`` on either side: NULL, the three special values and zero,
    each dialect's tests for them given, else ``finite`` (its significand ``p`` exponent)."""
    return (
        f"CASE WHEN {x} IS NULL THEN NULL WHEN {nan} THEN 'NaN' WHEN {inf} THEN 'Infinity' "
        f"WHEN {neg_inf} THEN '-Infinity' WHEN {x} = 0 THEN '0' ELSE {finite} END"
    )


def pg_scalar(c: str, delta: str, pg: str) -> str:
    """The canonical text of one non-array value ``c`` (SQL) on the source side; NULL iff NULL (or NaN numeric)."""
    if delta in ("tinyint", "smallint", "int", "bigint"):
        return f"({c})::oid::bigint::text" if pg in _OID_LIKE else f"({c})::bigint::text"
    if delta == "boolean":
        return f"CASE WHEN ({c}) THEN 't' WHEN NOT ({c}) THEN 'f' END"
    if delta in ("float", "double"):
        return _pg_float(f"({c})::float8")
    if m := _DECIMAL.match(delta):
        n = f"({c})::numeric"
        return f"CASE WHEN {n} = 'NaN'::numeric THEN NULL ELSE ({n})::numeric(1000, {max(int(m.group(2)), 0)})::text END"
    if delta == "binary":
        return f"encode(({c})::bytea, 'hex')"
    # GREATEST and LEAST ignore NULLs: the clamps keep them NULL explicitly.
    if delta == "date":
        return f"CASE WHEN ({c}) IS NULL THEN NULL ELSE (LEAST(GREATEST(({c})::date, '0001-01-01'::date), '9999-12-31'::date) - '1970-01-01'::date)::text END"
    if delta in ("timestamp", "timestamp_ntz"):
        t = "timestamptz" if delta == "timestamp" else "timestamp"
        zone = "+00" if delta == "timestamp" else ""
        clamped = (
            f"LEAST(GREATEST(({c})::{t}, '0001-01-01 00:00:00{zone}'::{t}), '9999-12-31 23:59:59.999999{zone}'::{t})"
        )
        return f"CASE WHEN ({c}) IS NULL THEN NULL ELSE (extract(epoch FROM {clamped}) * 1000000)::bigint::text END"
    # num_nulls: a composite whose fields are all NULL "IS NULL" in SQL, but is a value.
    return f"CASE WHEN num_nulls({c}) = 1 THEN NULL ELSE format('%s', {c}) END"


DecimalText = Callable[[str, int], str]  # Engine.decimal_text: SQL for a decimal's plain text


def spark_scalar(c: str, delta: str, decimal_text: DecimalText) -> str:
    """The canonical text of one non-array value ``c`` (Spark SQL) on the lake side."""
    if delta in ("tinyint", "smallint", "int", "bigint"):
        return f"CAST({c} AS STRING)"
    if m := _DECIMAL.match(delta):
        return decimal_text(c, int(m.group(2)))
    if delta == "boolean":
        return f"CASE WHEN {c} THEN 't' WHEN NOT {c} THEN 'f' END"
    if delta in ("float", "double"):
        return _spark_float(f"CAST({c} AS DOUBLE)")
    if delta == "binary":
        return f"lower(hex({c}))"
    if delta == "date":
        return f"CAST(unix_date({c}) AS STRING)"
    if delta == "timestamp":
        return f"CAST(unix_micros({c}) AS STRING)"
    if delta == "timestamp_ntz":
        # Without the session time zone: day number, then the wall-clock time of day.
        return (
            f"CAST(CAST(unix_date(CAST({c} AS DATE)) AS BIGINT) * 86400000000 + CAST(hour({c}) AS BIGINT) * 3600000000 "
            f"+ CAST(minute({c}) AS BIGINT) * 60000000 + CAST(date_part('SECOND', {c}) * 1000000 AS BIGINT) AS STRING)"
        )
    return f"CAST({c} AS STRING)"


def pg_item(k: str) -> str:
    return f"coalesce('V' || octet_length({k})::text || ':' || {k}, 'N')"


def spark_item(k: str) -> str:
    return f"coalesce(concat('V', CAST(octet_length({k}) AS STRING), ':', {k}), 'N')"


def _array_parts(delta: str) -> tuple[int, str]:
    depth = 0
    while delta.startswith("array<") and delta.endswith(">"):
        delta, depth = delta[6:-1], depth + 1
    return depth, delta


def pg_value(c: str, col: ColumnType) -> str:
    depth, elem = _array_parts(col.delta)
    if not depth:
        return pg_scalar(c, col.delta, col.pg)
    items = pg_item(pg_scalar("u.x", elem, col.pg))
    return (
        f"CASE WHEN ({c}) IS NULL THEN NULL ELSE '[' || coalesce((SELECT string_agg({items}, ',' ORDER BY u.o) "
        f"FROM unnest({c}) WITH ORDINALITY AS u(x, o)), '') || ']' END"
    )


def spark_value(c: str, col: ColumnType, decimal_text: DecimalText) -> str:
    depth, elem = _array_parts(col.delta)
    if not depth:
        return spark_scalar(c, col.delta, decimal_text)
    flat = c
    for _ in range(depth - 1):
        flat = f"flatten({flat})"
    items = spark_item(spark_scalar("pg2delta_x", elem, decimal_text))
    return f"CASE WHEN {c} IS NULL THEN NULL ELSE concat('[', array_join(transform({flat}, pg2delta_x -> {items}), ','), ']') END"


def decode_items(text: str) -> list[str | None]:
    """A row or key text back into its values (see the module docstring)."""
    out: list[str | None] = []
    data = text.encode()
    i = 0
    while i < len(data):
        if data[i : i + 1] == b"N":
            out.append(None)
            i += 1
            continue
        colon = data.index(b":", i)
        n = int(data[i + 1 : colon])
        out.append(data[colon + 1 : colon + 1 + n].decode())
        i = colon + 1 + n
    return out


__all__ = [
    "ColumnType", "DecimalText", "comparable", "decode_items", "pg_item", "pg_scalar", "pg_value", "spark_item",
    "spark_scalar", "spark_value",
]
