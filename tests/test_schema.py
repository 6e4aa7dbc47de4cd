"""Schema evolution rules (pure): which type changes widen a Delta column, and what a window's shapes need."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pg2delta.errors import SchemaError
from pg2delta.schema import Shape, arrow_type, plan, spark_type, widens


@pytest.mark.parametrize(
    ("t", "name"),
    [
        (pa.int16(), "smallint"),
        (pa.int32(), "int"),
        (pa.int64(), "bigint"),
        (pa.float32(), "float"),
        (pa.float64(), "double"),
        (pa.decimal128(12, 2), "decimal(12,2)"),
        (pa.string(), "string"),
        (pa.binary(), "binary"),
        (pa.bool_(), "boolean"),
        (pa.date32(), "date"),
        (pa.timestamp("us", tz="UTC"), "timestamp"),
        (pa.timestamp("us"), "timestamp_ntz"),
        (pa.list_(pa.list_(pa.int32())), "array<array<int>>"),
    ],
)
def test_spark_type_names_round_trip(t: pa.DataType, name: str) -> None:
    assert spark_type(t) == name
    assert arrow_type(name) == t


@pytest.mark.parametrize(
    ("old", "new", "ok"),
    [
        ("smallint", "int", True),
        ("int", "bigint", True),
        ("smallint", "bigint", True),
        ("bigint", "int", False),
        ("float", "double", True),
        ("double", "float", False),
        ("int", "double", True),
        ("bigint", "double", False),  # not every int8 is a double
        ("int", "decimal(10,0)", True),
        ("int", "decimal(12,3)", False),  # 9 digits left of the point
        ("bigint", "decimal(19,0)", True),
        ("decimal(8,2)", "decimal(14,4)", True),
        ("decimal(8,2)", "decimal(9,3)", True),
        ("decimal(8,2)", "decimal(8,3)", False),  # loses a digit left of the point
        ("decimal(8,2)", "decimal(8,1)", False),
        ("string", "string", True),
        ("int", "string", False),
        ("string", "int", False),
        ("timestamp", "timestamp_ntz", False),
        ("date", "timestamp_ntz", False),  # pysail cannot add the table feature in a rewrite
        ("array<smallint>", "array<int>", True),
        ("array<int>", "int", False),
    ],
)
def test_widens(old: str, new: str, ok: bool) -> None:
    assert widens(old, new) is ok


def shape(*cols: tuple[str, pa.DataType], key: tuple[str, ...] = ("id",)) -> Shape:
    return Shape(tuple(cols), key)


ID = ("id", pa.int32())


def test_new_table_takes_the_widest_shape_of_the_window() -> None:
    p = plan("s.t", None, [shape(ID, ("a", pa.int16())), shape(ID, ("a", pa.int64()), ("b", pa.string()))])
    assert p.columns == (ID, ("a", pa.int64()), ("b", pa.string()))
    assert p.added == ("id", "a", "b") and p.widened == () and p.kept == ()


def test_added_widened_and_kept_columns() -> None:
    delta = {"id": "int", "a": "smallint", "gone": "string", "_pg2delta_lsn": "bigint"}
    p = plan("s.t", delta, [shape(ID, ("a", pa.int32()), ("c", pa.decimal128(5, 1)))])
    assert p.added == ("c",)
    assert p.widened == (("a", "smallint", "int"),)
    assert p.kept == ("gone",), "pg2delta's own columns are never 'kept' user columns"
    assert p.existing == frozenset(delta)


def test_narrowing_refused_or_kept_wide() -> None:
    delta = {"id": "int", "x": "bigint"}
    with pytest.raises(SchemaError) as err:
        plan("s.t", delta, [shape(ID, ("x", pa.int32()))], where=" (at 0/1)")
    msg = str(err.value)
    assert "s.t" in msg and "column x" in msg and "from bigint to int" in msg and "(at 0/1)" in msg
    assert 'narrowing = "keep"' in msg and "nothing of this window was applied" in msg
    p = plan("s.t", delta, [shape(ID, ("x", pa.int32()))], narrowing="keep")
    assert p.columns == (ID, ("x", pa.int64())) and p.widened == ()


def test_narrowing_inside_the_window_is_refused() -> None:
    with pytest.raises(SchemaError, match="from bigint to int"):
        plan("s.t", None, [shape(ID, ("x", pa.int64())), shape(ID, ("x", pa.int32()))])


def test_other_kind_refused() -> None:
    with pytest.raises(SchemaError, match="from int to string, which Delta cannot follow in place"):
        plan("s.t", {"id": "int", "x": "int"}, [shape(ID, ("x", pa.string()))])


def test_key_change_inside_the_window_refused() -> None:
    with pytest.raises(SchemaError, match=r"changed its key from \(id\) to \(code\)"):
        plan("s.t", None, [shape(ID, ("code", pa.string())), shape(ID, ("code", pa.string()), key=("code",))])
    # The same key in every shape is fine, whatever else changes.
    assert plan("s.t", None, [shape(ID), shape(ID, ("v", pa.string()))]).key == ("id",)


def test_signature_ignores_arrow_details_delta_does_not_keep() -> None:
    a = shape(ID, ("s", pa.string()))
    b = shape(ID, ("s", pa.large_string()))
    assert a.signature() == b.signature()
    assert a.signature() != shape(ID, ("s", pa.string()), key=("s",)).signature()
