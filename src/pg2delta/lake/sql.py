"""Spark SQL spelled once: identifiers and key equality, for every statement pg2delta writes.

Pure strings: no Spark. The lake's engine, the apply stage and the commands all quote through here.
"""

from __future__ import annotations


def quote(name: str) -> str:
    """A Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def sql_string(text: str) -> str:
    """A Spark SQL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def key_equal(a: str, b: str, *, nullable: bool, nan_safe: bool = False) -> str:
    """Spark SQL: the key column expressions ``a`` and ``b`` are equal (``nullable``: NULL equals NULL).

    ``nan_safe`` (a float key on pysail): compared through ``nanvl``, so that a join looking for a
    NaN key cannot skip a file by the column's Parquet statistics, which leave NaN out (see
    pg2delta.lake.engine_writes.STATS_COLUMNS); NaN still equals NaN and nothing else.
    """
    eq = "<=>" if nullable else "="
    if not nan_safe:
        return f"{a} {eq} {b}"
    return f"nanvl({a}, 0) {eq} nanvl({b}, 0) AND isnan({a}) {eq} isnan({b})"
