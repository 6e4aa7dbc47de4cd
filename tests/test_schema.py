"""Schema evolution (pure): which type changes widen a Delta column, what a window's shapes need,
where a window ends, and how its batches are conformed to one shape."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pg2delta.apply.schema import conform, plan
from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import (
    LSN_COL,
    META_FIELDS,
    OP_COL,
    POS_COL,
    TOAST_COL,
    ChangeBatch,
    RelationVersion,
)
from pg2delta.errors import SchemaError
from pg2delta.lake.types import arrow_type, spark_type, widens
from pg2delta.window.shapes import Shape, shape_cut, shape_of


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


# --- windows of change batches ---------------------------------------------------------------

_N = 0


def version(cols: list[tuple[str, pa.DataType]], key: tuple[str, ...] = ("id",)) -> RelationVersion:
    global _N
    _N += 1
    rel = po.Relation(None, 16384, "s", "t", "d", tuple(po.RelationColumn(int(n in key), n, 23, -1) for n, _ in cols))
    idx = tuple(i for i, (n, _) in enumerate(cols) if n in key)
    return RelationVersion(_N, rel, (), idx, pa.schema([*(pa.field(n, t) for n, t in cols), *META_FIELDS]))


def batch(v: RelationVersion, rows: list[dict[str, object]]) -> ChangeBatch:
    full = [{f.name: r.get(f.name) for f in v.schema} for r in rows]
    return ChangeBatch(v, pa.RecordBatch.from_pylist(full, schema=v.schema))


def row(lsn: int, pos: int, op: str, **values: object) -> dict[str, object]:
    return {LSN_COL: lsn, POS_COL: pos, OP_COL: op, **values}


V1 = [("id", pa.int32()), ("a", pa.int16()), ("gone", pa.string())]
V2 = [("id", pa.int32()), ("a", pa.int64()), ("new", pa.string())]


def test_shape_cut_at_the_first_later_transaction_with_another_shape() -> None:
    v1, v1_again, v2 = version(V1), version(V1), version(V2)
    b1 = batch(v1, [row(100, 0, "I", id=1), row(200, 0, "U", id=1)])
    same = batch(v1_again, [row(300, 0, "U", id=1)])  # a Relation message of the same shape: no cut
    b2 = batch(v2, [row(400, 0, "U", id=1)])
    assert shape_cut([[b1, same, b2]]) == 400
    assert shape_cut([[b1, same]]) is None
    # Shapes changing inside the window's first transaction stay in the window.
    inside = batch(v2, [row(100, 1, "U", id=1)])
    first = batch(v1, [row(100, 0, "I", id=1)])
    assert shape_cut([[first, inside]]) is None
    # The earliest cut over all tables; a truncate can be the window's first transaction.
    other = [batch(version(V1), [row(150, 0, "I", id=2)]), batch(version(V2), [row(250, 0, "I", id=3)])]
    assert shape_cut([[b1, same, b2], other]) == 250
    assert shape_cut([[first, inside]], truncate_lsns=[50]) == 100


def test_conform_keeps_dropped_columns_in_updates_and_widens() -> None:
    v1, v2 = version(V1), version(V2)
    pl = plan("s.t", {"id": "int", "a": "smallint", "gone": "string"}, [shape_of(v1), shape_of(v2)])
    assert pl.widened == (("a", "smallint", "bigint"),) and pl.added == ("new",)
    parts = [[
        batch(v1, [row(100, 0, "U", id=1, a=1, gone="g1")]),
        batch(v2, [row(100, 1, "U", id=2, a=5_000_000_000, new="n"), row(100, 2, "I", id=3, a=3)]),
    ]]
    table, marked = conform(parts, pl)
    assert table is not None and marked == {"gone"}
    assert table.schema.field("a").type == pa.int64()
    rows = table.to_pylist()
    assert [r["gone"] for r in rows] == ["g1", None, None]
    # The update sent without `gone` keeps the lake's value (marked like unchanged TOAST); the insert does not.
    assert [r[TOAST_COL] for r in rows] == [None, ["gone"], None]
    assert [r["new"] for r in rows] == [None, "n", None]


def test_conform_orders_several_relations_by_commit_position() -> None:
    va, vb = version(V1), version(V1)
    pl = plan("s.root", None, [shape_of(va)])
    parts = [
        [batch(va, [row(100, 0, "D", id=1), row(300, 0, "I", id=4)])],
        [batch(vb, [row(100, 1, "I", id=1), row(200, 0, "U", id=2)])],
    ]
    table, _ = conform(parts, pl)
    assert table is not None
    assert [(r[LSN_COL], r[POS_COL], r[OP_COL]) for r in table.to_pylist()] == [
        (100, 0, "D"), (100, 1, "I"), (200, 0, "U"), (300, 0, "I"),
    ]
