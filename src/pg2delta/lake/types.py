"""Spark SQL type names of Arrow types, as Delta tables report their columns, and which widen which.

Pure: no Spark. The apply stage plans a table's schema with these; the window compares shapes by them.
"""

from __future__ import annotations

import re

import pyarrow as pa

# Digits an integer type needs left of the decimal point to fit in a decimal.
_INT_DIGITS = {"smallint": 5, "int": 10, "bigint": 19}
_INT_ORDER = ("smallint", "int", "bigint")
_DECIMAL = re.compile(r"decimal\((\d+),\s*(-?\d+)\)")


def spark_type(t: pa.DataType) -> str:
    """The Spark SQL type name (``DataType.simpleString()``) a column of Arrow type ``t`` has in Delta."""
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_int8(t):
        return "tinyint"
    if pa.types.is_int16(t):
        return "smallint"
    if pa.types.is_int32(t):
        return "int"
    if pa.types.is_int64(t):
        return "bigint"
    if pa.types.is_float32(t):
        return "float"
    if pa.types.is_float64(t):
        return "double"
    if pa.types.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "binary"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"array<{spark_type(t.value_type)}>"
    return str(t)


_SIMPLE = {
    "boolean": pa.bool_(),
    "smallint": pa.int16(),
    "int": pa.int32(),
    "bigint": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
}


def arrow_type(spark: str) -> pa.DataType | None:
    """The Arrow type of a Delta column of Spark type ``spark`` (the inverse of :func:`spark_type`)."""
    if spark in _SIMPLE:
        return _SIMPLE[spark]
    m = _DECIMAL.fullmatch(spark)
    if m:
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    if spark.startswith("array<") and spark.endswith(">"):
        inner = arrow_type(spark[6:-1])
        return None if inner is None else pa.list_(inner)
    return None


def widens(old: str, new: str) -> bool:
    """True when a Delta column of Spark type ``old`` can become ``new`` keeping every value exactly."""
    if old == new:
        return True
    if old in _INT_ORDER and new in _INT_ORDER:
        return _INT_ORDER.index(old) <= _INT_ORDER.index(new)
    if old in ("smallint", "int", "float") and new == "double":
        return True
    m_new = _DECIMAL.fullmatch(new)
    if old in _INT_DIGITS and m_new:
        p, s = int(m_new.group(1)), int(m_new.group(2))
        return p - s >= _INT_DIGITS[old]
    m_old = _DECIMAL.fullmatch(old)
    if m_old and m_new:
        p1, s1, p2, s2 = (int(m_old.group(1)), int(m_old.group(2)), int(m_new.group(1)), int(m_new.group(2)))
        return s2 >= s1 and p2 - s2 >= p1 - s1
    if old.startswith("array<") and new.startswith("array<"):
        return widens(old[6:-1], new[6:-1])
    return False
