"""reduce_changes and merge_statement on hand-built Arrow tables; a model-based property."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pg2delta.apply.merge import Lookup, Reduced, merge_statement, quote, reduce_changes
from pg2delta.apply.table import integer_range
from pg2delta.decode.changes import LSN_COL, META_FIELDS, OP_COL, POS_COL, TOAST_COL

DATA = [pa.field("id", pa.int64()), pa.field("v", pa.string()), pa.field("big", pa.string())]
SCHEMA = pa.schema([*DATA, *META_FIELDS])
Row = dict[str, Any]


def ch(lsn: int, pos: int, op: str, id: int, v: str | None = None, big: str | None = None, toast: Sequence[str] | None = None) -> Row:
    return {"id": id, "v": v, "big": big, LSN_COL: lsn, POS_COL: pos, OP_COL: op, TOAST_COL: list(toast) if toast else None}


def table(rows: Sequence[Row]) -> pa.Table:
    full = [{f.name: r.get(f.name) for f in SCHEMA} for r in rows]
    return pa.Table.from_pylist(full, schema=SCHEMA)


def finals(red: Reduced) -> dict[int, tuple[str, str | None, str | None, tuple[str, ...] | None]]:
    out = {}
    for r in red.table.to_pylist():
        out[r["id"]] = (r[OP_COL], r["v"], r["big"], tuple(r[TOAST_COL]) if r[TOAST_COL] else None)
    return out


def test_empty() -> None:
    red = reduce_changes(table([]), ["id"])
    assert red.table.num_rows == 0 and red.lookups == () and (red.inserts, red.updates, red.deletes) == (0, 0, 0)


def test_sequences_per_key() -> None:
    red = reduce_changes(
        table(
            [
                ch(10, 1, "I", 1, "a", "A"),
                ch(10, 3, "U", 1, "b", "B"),
                ch(10, 5, "I", 2, "x", "X"),
                ch(20, 1, "D", 1),
                ch(20, 3, "U", 3, "lake row", "L"),
                ch(30, 1, "D", 2),
                ch(30, 3, "I", 2, "again", "G"),  # delete then re-insert
                ch(30, 5, "D", 4),
            ]
        ),
        ["id"],
    )
    assert finals(red) == {
        1: ("D", None, None, None),
        2: ("I", "again", "G", None),
        3: ("U", "lake row", "L", None),
        4: ("D", None, None, None),
    }
    assert (red.inserts, red.updates, red.deletes) == (3, 2, 3)
    assert red.lookups == ()
    # Final rows keep commit order.
    assert [r[LSN_COL] for r in red.table.to_pylist()] == sorted(r[LSN_COL] for r in red.table.to_pylist())


def test_key_change_chain() -> None:
    red = reduce_changes(
        table(
            [
                ch(10, 1, "I", 1, "a", "A"),
                ch(10, 2, "D", 1),
                ch(10, 3, "U", 2, "b", "B"),
                ch(20, 2, "D", 2),
                ch(20, 3, "U", 3, "c", None, ["big"]),
            ]
        ),
        ["id"],
    )
    assert finals(red) == {1: ("D", None, None, None), 2: ("D", None, None, None), 3: ("U", "c", "B", None)}


def test_toast_from_earlier_rows_and_before_key_changes() -> None:
    red = reduce_changes(
        table(
            [
                ch(10, 1, "I", 1, "a", "A"),
                ch(20, 1, "U", 1, "b", None, ["big"]),
                ch(30, 1, "U", 1, "c", None, ["big"]),  # two hops back to the insert
                ch(40, 2, "D", 1),
                ch(40, 3, "U", 5, "moved", None, ["big"]),  # across a key change
                ch(50, 1, "I", 7, "x", "X"),
                ch(50, 3, "U", 7, "y", None, ["v", "big"]),  # several columns
            ]
        ),
        ["id"],
    )
    assert finals(red)[5] == ("U", "moved", "A", None)
    assert finals(red)[7] == ("U", "x", "X", None)
    assert red.lookups == ()


def test_toast_left_as_lookup() -> None:
    red = reduce_changes(
        table(
            [
                ch(10, 1, "U", 1, "a", None, ["big"]),  # only the lake knows
                ch(20, 2, "D", 2),
                ch(20, 3, "U", 3, "b", None, ["big"]),  # lake row under the old key 2
                ch(30, 2, "D", 4),
                ch(30, 3, "U", 5, "c", None, ["big"]),
                ch(40, 2, "D", 5),
                ch(40, 3, "U", 6, None, None, ["v", "big"]),  # chain 4 -> 5 -> 6: lake key 4
                ch(50, 1, "U", 8, "d", None, ["big"]),
                ch(50, 3, "U", 8, "e", None, ["big"]),
            ]
        ),
        ["id"],
    )
    rows = red.table.to_pylist()
    by_id = {r["id"]: i for i, r in enumerate(rows)}
    got = {(rows[lk.row]["id"], lk.key, lk.columns) for lk in red.lookups}
    assert got == {(1, (1,), ("big",)), (3, (2,), ("big",)), (6, (4,), ("big",)), (8, (8,), ("big",))}
    assert all(lk.row == by_id[rows[lk.row]["id"]] for lk in red.lookups)
    # v came from the row under key 5; big only the lake has (under key 4), and stays named.
    assert rows[by_id[6]]["v"] == "c" and rows[by_id[6]][TOAST_COL] == ["big"]


def test_partial_resolution_keeps_the_rest_named() -> None:
    red = reduce_changes(
        table([ch(10, 1, "U", 1, "a", None, ["big"]), ch(20, 1, "U", 1, None, None, ["v", "big"])]),
        ["id"],
    )
    (row,) = red.table.to_pylist()
    assert row["v"] == "a" and row[TOAST_COL] == ["big"]
    assert red.lookups == (Lookup(0, (1,), ("big",)),)


def test_composite_and_odd_keys() -> None:
    schema = pa.schema([pa.field("k 1", pa.int32()), pa.field("k`2", pa.string()), pa.field("v", pa.string()), *META_FIELDS])
    rows = [
        {"k 1": 1, "k`2": "a", "v": "x", LSN_COL: 1, POS_COL: 1, OP_COL: "I", TOAST_COL: None},
        {"k 1": 1, "k`2": "b", "v": "y", LSN_COL: 1, POS_COL: 3, OP_COL: "I", TOAST_COL: None},
        {"k 1": 1, "k`2": "a", "v": None, LSN_COL: 2, POS_COL: 1, OP_COL: "U", TOAST_COL: ["v"]},
    ]
    red = reduce_changes(pa.Table.from_pylist(rows, schema=schema), ["k 1", "k`2"])
    assert sorted((r["k`2"], r["v"], r[OP_COL]) for r in red.table.to_pylist()) == [("a", "x", "U"), ("b", "y", "I")]


def test_merge_statement_shape() -> None:
    stmt = merge_statement("delta.`/lake/t`", "src", ["id", "we`ird key"], ["id", "we`ird key", "a b", "c"], truncate=False)
    assert stmt == (
        "MERGE INTO delta.`/lake/t` AS t USING src AS s "
        "ON t.`id` = s.`id` AND t.`we``ird key` = s.`we``ird key` "
        "WHEN MATCHED AND s.`_pg2delta_op` = 'D' THEN DELETE "
        "WHEN MATCHED THEN UPDATE SET t.`id` = s.`id`, t.`we``ird key` = s.`we``ird key`, t.`a b` = s.`a b`, t.`c` = s.`c` "
        "WHEN NOT MATCHED AND s.`_pg2delta_op` <> 'D' THEN INSERT (`id`, `we``ird key`, `a b`, `c`) "
        "VALUES (s.`id`, s.`we``ird key`, s.`a b`, s.`c`)"
    )
    truncating = merge_statement("t", "s", ["id"], ["id"], truncate=True)
    assert truncating.endswith(" WHEN NOT MATCHED BY SOURCE THEN DELETE")
    null_safe = merge_statement("t", "s", ["a", "b"], ["a", "b"], truncate=False, nullable_keys=True)
    assert " ON t.`a` <=> s.`a` AND t.`b` <=> s.`b` WHEN " in null_safe
    assert quote("`") == "````" and quote("a b") == "`a b`"


def test_merge_statement_bounds_the_tables_keys_to_the_sources_range() -> None:
    """The source's key range, as a condition on the table alone in the ON clause (Delta's data
    skipping leaves out the files outside it); never with a truncate or nullable keys."""
    bounded = merge_statement("t", "s", ["id", "k"], ["id", "k"], truncate=False, key_range=(-5, 42))
    assert " ON t.`id` = s.`id` AND t.`k` = s.`k` AND t.`id` >= -5 AND t.`id` <= 42 WHEN " in bounded
    plain = merge_statement("t", "s", ["id"], ["id"], truncate=False)
    assert merge_statement("t", "s", ["id"], ["id"], truncate=True, key_range=(1, 2)).count(">=") == 0
    assert merge_statement("t", "s", ["id"], ["id"], truncate=False, nullable_keys=True, key_range=(1, 2)).count(">=") == 0
    assert plain.count(">=") == 0


def test_integer_range() -> None:
    assert integer_range(pa.chunked_array([[3, -1], [7]])) == (-1, 7)
    assert integer_range(pa.chunked_array([[3, None]])) is None  # a NULL key is in no range
    assert integer_range(pa.chunked_array([["a"]])) is None
    assert integer_range(pa.chunked_array([], type=pa.int64())) is None


def test_reduce_needs_a_key() -> None:
    with pytest.raises(ValueError):
        reduce_changes(table([ch(1, 1, "I", 1, "a")]), [])


# --- model-based: reduce + apply == apply every change ------------------------------------

Op = tuple[str, int, int, str, bool, bool]  # kind, key, new key, value, toast big, new transaction


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[int, Row], list[Op]]:
    lake_keys = draw(st.sets(st.integers(0, 6), max_size=5))
    lake = {k: {"id": k, "v": f"lake{k}", "big": f"BIG{k}"} for k in lake_keys}
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["I", "U", "D", "K"]),
                st.integers(0, 6),
                st.integers(0, 6),
                st.sampled_from(["p", "q", "r"]),
                st.booleans(),
                st.booleans(),
            ),
            max_size=25,
        )
    )
    return lake, ops


def _changes(lake: dict[int, Row], ops: list[Op]) -> tuple[list[Row], dict[int, Row]]:
    """The change rows the decoder would emit for ``ops``, and the state after applying them."""
    state = {k: dict(v) for k, v in lake.items()}
    rows: list[Row] = []
    lsn, pos = 1, 0
    for n, (kind, key, new_key, value, toast, new_txn) in enumerate(ops):
        if new_txn:
            lsn, pos = lsn + 1, 0
        big = None if toast else f"big{n}"
        if kind == "I":
            if key in state:
                continue
            state[key] = {"id": key, "v": value, "big": f"big{n}"}
            rows.append(ch(lsn, 2 * pos + 1, "I", key, value, f"big{n}"))
        elif kind == "D":
            if key not in state:
                continue
            del state[key]
            rows.append(ch(lsn, 2 * pos + 1, "D", key))
        elif kind == "U":
            if key not in state:
                continue
            state[key] = {"id": key, "v": value, "big": state[key]["big"] if toast else big}
            rows.append(ch(lsn, 2 * pos + 1, "U", key, value, big, ["big"] if toast else None))
        else:
            if key not in state or new_key in state:
                continue
            old = state.pop(key)
            state[new_key] = {"id": new_key, "v": value, "big": old["big"] if toast else big}
            rows.append(ch(lsn, 2 * pos, "D", key))
            rows.append(ch(lsn, 2 * pos + 1, "U", new_key, value, big, ["big"] if toast else None))
        pos += 1
    return rows, state


def _apply(lake: dict[int, Row], red: Reduced) -> dict[int, Row]:
    """What the job does with a Reduced: fill lookups from the lake, then MERGE."""
    out = {k: dict(v) for k, v in lake.items()}
    rows = red.table.to_pylist()
    by_key: dict[tuple[object, ...], Row] = {(k,): v for k, v in lake.items()}
    for lk in red.lookups:
        src = by_key.get(lk.key) or by_key.get((rows[lk.row]["id"],))
        assert src is not None, "lookup of a row the lake does not hold"
        for c in lk.columns:
            rows[lk.row][c] = src[c]
    for r in rows:
        if r[OP_COL] == "D":
            out.pop(r["id"], None)
        else:
            out[r["id"]] = {"id": r["id"], "v": r["v"], "big": r["big"]}
    return out


@settings(max_examples=400, deadline=None, print_blob=True)
@given(workloads())
def test_reduce_then_apply_equals_apply_all(work: tuple[dict[int, Row], list[Op]]) -> None:
    lake, ops = work
    rows, want = _changes(lake, ops)
    red = reduce_changes(table(rows), ["id"])
    assert red.table.num_rows == len({r["id"] for r in rows})
    assert _apply(lake, red) == want
    assert red.inserts + red.updates + red.deletes == len(rows)
    # A key PostgreSQL keeps unique (what the decoder emits here): the same lake.
    assert _apply(lake, reduce_changes(table(rows), ["id"], distinct_keys=True)) == want


def test_inserts_under_a_unique_key_are_their_own_final_rows() -> None:
    """``distinct_keys``: a window of inserts only is kept as it is (the caller vouches that the key
    is unique), and equals what the reduce keeps; any other operation in it, and it is reduced."""
    inserts = table([ch(10, 1, "I", 1, "a", "A"), ch(10, 3, "I", 2, "b"), ch(20, 1, "I", 3, "c", "C")])
    kept = reduce_changes(inserts, ["id"], ["id", "v"], distinct_keys=True)
    assert kept.table.equals(reduce_changes(inserts, ["id"], ["id", "v"]).table)
    assert (kept.inserts, kept.updates, kept.deletes, kept.lookups) == (3, 0, 0, ())
    # Nothing is searched for: two inserts of one key (which PostgreSQL does not send) both stay.
    twice = table([ch(10, 1, "I", 1, "a"), ch(20, 1, "I", 1, "b")])
    assert reduce_changes(twice, ["id"], distinct_keys=True).table.num_rows == 2
    assert reduce_changes(twice, ["id"]).table.num_rows == 1
    mixed = table([ch(10, 1, "I", 1, "a"), ch(20, 1, "U", 1, "b")])
    assert finals(reduce_changes(mixed, ["id"], distinct_keys=True)) == {1: ("U", "b", None, None)}


def test_unchanged_toast_of_a_nan_key() -> None:
    """Rows of a NaN float key are one key: an unchanged value comes from the window's earlier row,
    and what the window lacks is looked up under that key."""
    schema = pa.schema([pa.field("k", pa.float64()), *DATA[1:], *META_FIELDS])

    def row(lsn: int, pos: int, op: str, v: str | None, big: str | None, toast: Sequence[str] | None = None) -> Row:
        return {"k": float("nan"), "v": v, "big": big, LSN_COL: lsn, POS_COL: pos, OP_COL: op, TOAST_COL: list(toast) if toast else None}

    red = reduce_changes(pa.Table.from_pylist([row(10, 1, "I", "a", "A"), row(20, 1, "U", "b", None, ["big"])], schema=schema), ["k"])
    assert [(r["v"], r["big"], r[TOAST_COL]) for r in red.table.to_pylist()] == [("b", "A", None)]
    assert red.lookups == ()
    red = reduce_changes(pa.Table.from_pylist([row(20, 1, "U", "b", None, ["big"]), row(30, 1, "U", "c", None, ["big"])], schema=schema), ["k"])
    assert red.table.num_rows == 1 and len(red.lookups) == 1 and red.lookups[0].columns == ("big",)
