"""From a window's ordered changes of one table to one MERGE: reduce, resolve, write SQL.

Pure Arrow and strings: no database, no Spark.

* :func:`reduce_changes` keeps the final state per key in commit order (commit LSN, then
  position in the transaction), so one MERGE per table per window does inserts, updates
  and deletes without ever matching several source rows.
* Unchanged-TOAST columns (``u``) take the latest earlier value of the same row inside the
  window, following primary-key changes back to the old key; what the window cannot tell
  is listed in :attr:`Reduced.lookups`, to be read from the Delta table before the MERGE.
* :func:`merge_statement` writes the ``MERGE INTO`` for the reduced source; a truncate in
  the window becomes ``WHEN NOT MATCHED BY SOURCE THEN DELETE`` so the whole window of a
  table lands in a single Delta commit.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.apply.keys import key_tuples
from pg2delta.decode.changes import LSN_COL, OP_COL, POS_COL, TOAST_COL, TS_COL, XID_COL
from pg2delta.decode.events import DELETED_COL, DELETED_FIELD, TRUNCATE_MARK_OP
from pg2delta.lake.foreign import TRUNCATE_PREDICATE
from pg2delta.lake.sql import quote

_INDEX = "__pg2delta_index"


@dataclass(frozen=True, slots=True)
class Lookup:
    """A final row whose columns must come from the Delta table's row at ``key``."""

    row: int  # index into Reduced.table
    key: tuple[object, ...]  # values of the key columns where the value lives
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reduced:
    table: pa.Table  # one row per key, the final operation and values
    lookups: tuple[Lookup, ...]
    inserts: int
    updates: int
    deletes: int


def one_change_per_key(ops: Collection[str], *, unique_key: bool) -> bool:
    """Whether no key can have two of these changes (``ops``: their operations, after the window's
    last truncate): only inserts, under a key PostgreSQL keeps unique and not null (``unique_key``:
    the replica identity or the commit position, not a key set in the config), since a key is
    inserted again only after a delete. Such changes are their own final rows, with no reduce."""
    return unique_key and set(ops) <= {"I"}


def reduce_changes(
    changes: pa.Table,
    key_names: Sequence[str],
    columns: Sequence[str] | None = None,
    *,
    distinct_keys: bool = False,
    soft: bool = False,
) -> Reduced:
    """The final state per key of ``changes`` (rows already in commit order). ``columns``: those
    the final rows need besides the key, the operation and the unchanged-TOAST list (default: all);
    the others (commit position, xid, time) are not gathered. ``distinct_keys``: the caller knows
    that no key has two inserts (a key PostgreSQL keeps unique), so changes that are all inserts
    are their own final rows, kept as they are. ``soft``: soft deletes (:func:`soft_deleted`): the
    final rows also hold ``_pg2delta_deleted``, and a final delete the values the row had before it."""
    n = changes.num_rows
    ops = changes.column(OP_COL)
    counts = pc.value_counts(ops).to_pylist() if n else []
    by_op = {c["values"]: c["counts"] for c in counts}
    if n == 0:
        return Reduced(changes, (), 0, 0, 0)
    if not key_names:
        raise ValueError("reduce_changes needs key columns")
    wanted = None if columns is None else {*columns, *key_names, OP_COL, TOAST_COL}
    if one_change_per_key(by_op, unique_key=distinct_keys):
        kept = changes if wanted is None else changes.select([c for c in changes.column_names if c in wanted])
        if soft:
            kept = kept.append_column(DELETED_FIELD, pa.array(np.zeros(n, dtype=bool)))
        return Reduced(kept, (), n, 0, 0)
    indexed = changes.append_column(_INDEX, pa.array(np.arange(n, dtype=np.int64)))
    last = indexed.select([*key_names, _INDEX]).group_by(list(key_names), use_threads=False).aggregate(
        [(_INDEX, "max")]
    )
    keep = np.sort(last.column(f"{_INDEX}_max").to_numpy())
    # The kept rows in commit order by a mask, not a gather: a filter copies each batch's runs of
    # kept rows as they are, where a take over many batches joins them all first.
    mask = np.zeros(n, dtype=bool)
    mask[keep] = True
    final = (changes if wanted is None else changes.select([c for c in changes.column_names if c in wanted])).filter(pa.array(mask))
    deleted = None
    if soft:
        final, keep, deleted = soft_deleted(changes, final, keep, key_names, mask)
    lookups: list[Lookup] = []
    toast = final.column(TOAST_COL)
    if toast.null_count < final.num_rows:
        final, lookups = _resolve_toast(changes, final, keep, key_names)
    if deleted is not None:
        final = final.append_column(DELETED_FIELD, deleted)
    return Reduced(final, tuple(lookups), by_op.get("I", 0), by_op.get("U", 0), by_op.get("D", 0))


# The columns a final delete keeps of its own change (soft_deleted): the rest are the row's values.
_CHANGE_COLUMNS = frozenset({LSN_COL, POS_COL, OP_COL, TS_COL, XID_COL})


def soft_deleted(
    changes: pa.Table, final: pa.Table, keep: np.ndarray, key_names: Sequence[str], mask: np.ndarray
) -> tuple[pa.Table, np.ndarray, pa.Array]:
    """Soft deletes' final rows (``final``, rows ``keep`` of ``changes``; ``mask``: those rows):
    a final delete whose key's change just before it is in the window and not a delete takes that
    change's values and unchanged-TOAST list (a row inserted or updated, then deleted, in one
    window: what it held when deleted), its own commit LSN, time and op. Returns the rows, the rows
    of ``changes`` their values come from (for the unchanged TOAST) and ``_pg2delta_deleted``:
    false for a live row, true for a delete with those values, NULL for a delete the window holds
    no values of (the MERGE marks the table's row, keeping its values)."""
    is_delete = pc.equal(final.column(OP_COL), "D").to_numpy(zero_copy_only=False)
    if not is_delete.any():
        return final, keep, pa.array(np.zeros(final.num_rows, dtype=bool))
    n = changes.num_rows
    candidate = np.arange(n, dtype=np.int64)
    candidate[mask] = -1  # every key's change before its last: the largest is the one just before
    pairs = pa.table({**{f"k{i}": changes.column(k) for i, k in enumerate(key_names)},
                      "last": pa.array(np.arange(n, dtype=np.int64)), "before": pa.array(candidate)})
    pairs = pairs.group_by([f"k{i}" for i in range(len(key_names))], use_threads=False).aggregate(
        [("last", "max"), ("before", "max")]
    )
    before = np.full(len(keep), -1, dtype=np.int64)
    before[np.searchsorted(keep, pairs.column("last_max").to_numpy())] = pairs.column("before_max").to_numpy()
    was_delete = pc.equal(changes.column(OP_COL), "D").to_numpy(zero_copy_only=False)
    took = is_delete & (before >= 0) & ~was_delete[np.maximum(before, 0)]
    deleted = pa.array(is_delete, mask=is_delete & ~took)
    if not took.any():
        return final, keep, deleted
    rows = np.flatnonzero(took)
    nfinal = final.num_rows
    for name in final.column_names:
        if name in key_names or name in _CHANGE_COLUMNS:
            continue
        both = pa.concat_arrays([final.column(name).combine_chunks(), changes.column(name).combine_chunks()])
        index = np.arange(nfinal, dtype=np.int64)
        index[rows] = nfinal + before[rows]
        final = final.set_column(final.column_names.index(name), name, both.take(pa.array(index)))
    values_of = keep.copy()
    values_of[rows] = before[rows]
    return final, values_of, deleted


def fill_toast_in_order(changes: pa.Table, key_names: Sequence[str]) -> Reduced:
    """Every row of ``changes`` (commit order) with its unchanged-TOAST columns filled from the
    window's earlier rows, as :func:`reduce_changes` fills final rows; what the window cannot tell
    is in the lookups. For the history (pg2delta.apply.history), which keeps every version."""
    n = changes.num_rows
    if n == 0 or changes.column(TOAST_COL).null_count == n:
        return Reduced(changes, (), 0, 0, 0)
    filled, lookups = _resolve_toast(changes, changes, np.arange(n, dtype=np.int64), key_names)
    return Reduced(filled, tuple(lookups), 0, 0, 0)


def _resolve_toast(
    changes: pa.Table, final: pa.Table, keep: np.ndarray, key_names: Sequence[str]
) -> tuple[pa.Table, list[Lookup]]:
    """Fill unchanged-TOAST columns of final rows from earlier rows of the window."""
    keys = key_tuples(changes.column(k) for k in key_names)
    ops = changes.column(OP_COL).to_pylist()
    lsns = changes.column(LSN_COL).to_numpy()
    poss = changes.column(POS_COL).to_numpy()
    toasts = changes.column(TOAST_COL).to_pylist()
    rows_of_key: dict[tuple[object, ...], list[int]] = {}
    for i, k in enumerate(keys):
        rows_of_key.setdefault(k, []).append(i)
    final_toast = final.column(TOAST_COL).to_pylist()
    fills: dict[str, dict[int, int]] = {}  # column -> {final row: source row in changes}
    lookups: list[Lookup] = []
    remaining_toast: list[list[str] | None] = list(final_toast)
    for r, cols in enumerate(final_toast):
        if not cols:
            continue
        i = int(keep[r])
        unresolved: dict[tuple[object, ...], list[str]] = {}  # lake key -> columns to read there
        for col in cols:
            src, where_key = _find_value(i, col, keys, ops, lsns, poss, toasts, rows_of_key)
            if src is None:
                unresolved.setdefault(where_key, []).append(col)
            else:
                fills.setdefault(col, {})[r] = src
        left = [c for c in cols if any(c in v for v in unresolved.values())]
        remaining_toast[r] = left or None
        lookups.extend(Lookup(r, key, tuple(c)) for key, c in unresolved.items())
    names = final.column_names
    nfinal = final.num_rows
    for col, mapping in fills.items():
        # Take each filled value from ``changes``, the rest from ``final``, in one gather.
        both = pa.concat_arrays([final.column(col).combine_chunks(), changes.column(col).combine_chunks()])
        index = np.arange(nfinal, dtype=np.int64)
        index[np.fromiter(mapping.keys(), np.int64, len(mapping))] = nfinal + np.fromiter(
            mapping.values(), np.int64, len(mapping)
        )
        final = final.set_column(names.index(col), col, both.take(pa.array(index)))
    final = final.set_column(names.index(TOAST_COL), TOAST_COL, pa.array(remaining_toast, type=pa.list_(pa.string())))
    return final, lookups


def _find_value(
    i: int,
    col: str,
    keys: list[tuple[object, ...]],
    ops: list[str],
    lsns: np.ndarray,
    poss: np.ndarray,
    toasts: list[list[str] | None],
    rows_of_key: dict[tuple[object, ...], list[int]],
) -> tuple[int | None, tuple[object, ...]]:
    """The row of ``changes`` holding the value of ``col`` before row ``i``.

    Returns ``(row, key)``, or ``(None, key)`` when the window does not hold it and the
    value must be read from the Delta table's row at ``key``.
    """
    cur = i
    while True:
        prev = cur - 1
        if (
            ops[cur] == "U"
            and prev >= 0
            and ops[prev] == "D"
            and lsns[prev] == lsns[cur]
            and poss[prev] == poss[cur] - 1
            and keys[prev] != keys[cur]
        ):
            # Row ``cur`` came from a primary-key change: before it, the row lived under the old key.
            key, before = keys[prev], prev
        else:
            key, before = keys[cur], cur
        rows = rows_of_key.get(key, [])
        k = bisect.bisect_left(rows, before) - 1
        if k < 0:
            return None, key
        j = rows[k]
        if ops[j] == "D":
            return None, key
        t = toasts[j]
        if t and col in t:
            cur = j
            continue
        return j, key


def merge_statement(
    target: str,
    source: str,
    key_names: Sequence[str],
    columns: Sequence[str],
    *,
    truncate: bool,
    nullable_keys: bool = False,
    key_range: tuple[int, int] | None = None,
    soft: SoftDeletes | None = None,
) -> str:
    """``MERGE INTO`` applying a reduced source; ``truncate`` also deletes every row the source lacks.

    ``nullable_keys``: the key may hold NULLs (a key from the config rather than a primary key or
    replica identity index), so it is matched with null-safe equality. ``key_range``: the smallest
    and largest value of the first key column (an integer) in the source, written into the ``ON``
    clause as a condition on the table alone, which Delta's data skipping uses to leave out the
    files whose statistics put every key outside it (no row there can match). Not with a truncate
    (rows outside the range are "not matched by source" too) nor nullable keys (a NULL key is in
    no range). ``soft``: deletes (and truncates) mark the rows (:class:`SoftDeletes`) rather
    than remove them; ``columns`` then include the row metadata and ``_pg2delta_deleted``, and the
    source the changes' positions.
    """
    eq = "<=>" if nullable_keys else "="
    on = " AND ".join(f"t.{quote(k)} {eq} s.{quote(k)}" for k in key_names)
    if key_range is not None and not truncate and not nullable_keys:
        first = f"t.{quote(key_names[0])}"
        on += f" AND {first} >= {int(key_range[0])} AND {first} <= {int(key_range[1])}"
    sets = ", ".join(f"t.{quote(c)} = s.{quote(c)}" for c in columns)
    cols = ", ".join(quote(c) for c in columns)
    vals = ", ".join(f"s.{quote(c)}" for c in columns)
    op, mark = quote(OP_COL), quote(DELETED_COL)
    if soft is not None:  # a delete without values marks the table's row; every other row lands as it is
        stmt = (
            f"MERGE INTO {target} AS t USING {soft.source(source, columns)} AS s ON {on} "
            f"WHEN MATCHED AND s.{op} = 'D' AND s.{mark} IS NULL THEN UPDATE SET {soft.mark_from_source()} "
            f"WHEN MATCHED THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED AND s.{mark} IS NOT NULL THEN INSERT ({cols}) VALUES ({vals})"
        )
    else:
        stmt = (
            f"MERGE INTO {target} AS t USING {source} AS s ON {on} "
            f"WHEN MATCHED AND s.{op} = 'D' THEN DELETE "
            f"WHEN MATCHED THEN UPDATE SET {sets} "
            f"WHEN NOT MATCHED AND s.{op} <> 'D' THEN INSERT ({cols}) VALUES ({vals})"
        )
    if truncate and soft is not None:
        stmt += f" WHEN NOT MATCHED BY SOURCE AND NOT t.{quote(DELETED_COL)} THEN UPDATE SET {soft.mark_truncated()}"
    elif truncate:
        stmt += " WHEN NOT MATCHED BY SOURCE THEN DELETE"
    return stmt


@dataclass(frozen=True, slots=True)
class SoftDeletes:
    """``deletes = "soft"``: a deleted row stays, ``_pg2delta_deleted`` true, its other columns as
    they were, its row metadata the delete's; a key inserted again is matched and set anew, live.

    The source's ``_pg2delta_deleted`` (:func:`soft_deleted`) says which: false, a live row; true, a
    deleted row with the values it had (inserted or updated in the window before its delete): set
    or inserted as it is, marked; NULL, a delete the window holds no values of: the table's row is
    marked, its values kept (a key the table does not hold is not inserted: nothing to show of it).

    ``truncates``: the window's truncates of the table, in commit order, as (commit LSN, position,
    commit time in microseconds since 1970). The source then holds the changes before them too
    (pg2delta.apply.stage.table_changes ``whole``): a key whose final change is an insert or update
    before a truncate is marked by the first truncate after it (op ``T``, its values those of that
    change; inserted marked if the table does not hold it), a delete before a truncate keeps its own
    metadata, and the table's rows the window does not change are marked by the first truncate.

    ``keyless``: a table without a key, whose rows are keyed by their commit position
    (``_pg2delta_lsn``, ``_pg2delta_pos``): a truncate's mark keeps that key (rows of different
    transactions share positions: given the truncate's LSN they would share a key)."""

    truncates: tuple[tuple[int, int, int | None], ...] = ()
    keyless: bool = False

    def source(self, view: str, columns: Sequence[str]) -> str:
        """The MERGE's source: ``view`` with the keys a truncate removed marked (see the class)."""
        if not self.truncates:
            return view
        truncated = f"(s.{quote(OP_COL)} <> 'D' AND {self.before(self.truncates[-1], 's.')})"

        def first(i: int) -> str:  # the first truncate after the row's change: its LSN (0) or time (2)
            whens = " ".join(f"WHEN {self.before(t, 's.')} THEN {_value(t, i)}" for t in self.truncates)
            return f"CASE {whens} END"

        made = {
            OP_COL: f"CASE WHEN {truncated} THEN '{TRUNCATE_MARK_OP}' ELSE s.{quote(OP_COL)} END",
            **({} if self.keyless else {LSN_COL: f"CASE WHEN {truncated} THEN {first(0)} ELSE s.{quote(LSN_COL)} END"}),
            TS_COL: f"CASE WHEN {truncated} THEN {first(2)} ELSE s.{quote(TS_COL)} END",
            DELETED_COL: f"CASE WHEN {truncated} THEN true ELSE s.{quote(DELETED_COL)} END",
        }
        cols = ", ".join(f"{made.get(c, f's.{quote(c)}')} AS {quote(c)}" for c in dict.fromkeys([*columns, OP_COL]))
        return f"(SELECT {cols} FROM {view} AS s)"

    @staticmethod
    def before(t: tuple[int, int, int | None], prefix: str = "") -> str:
        """A source row's change comes before the truncate ``t``."""
        lsn, pos = f"{prefix}{quote(LSN_COL)}", f"{prefix}{quote(POS_COL)}"
        return f"({lsn} < {int(t[0])} OR ({lsn} = {int(t[0])} AND {pos} < {int(t[1])}))"

    @staticmethod
    def landed() -> str:
        """The rows of :meth:`source` a new table takes (its append): all but the deletes the window
        holds no values of (as the MERGE inserts)."""
        return f"{quote(DELETED_COL)} IS NOT NULL"

    def mark_from_source(self) -> str:
        """``SET`` of a row deleted by the source's delete."""
        return ", ".join(
            [f"t.{quote(DELETED_COL)} = true", *(f"t.{quote(c)} = s.{quote(c)}" for c in (LSN_COL, TS_COL, OP_COL))]
        )

    def mark_truncated(self, t: str = "t.") -> str:
        """``SET`` of a row the window's first truncate deleted (``t``: the target's prefix)."""
        first = self.truncates[0] if self.truncates else (0, 0, None)
        lsn = "" if self.keyless else f"{t}{quote(LSN_COL)} = {_value(first, 0)}, "
        return (
            f"{t}{quote(DELETED_COL)} = true, {lsn}"
            f"{t}{quote(TS_COL)} = {_value(first, 2)}, {t}{quote(OP_COL)} = '{TRUNCATE_MARK_OP}'"
        )

    def update_truncated(self, target: str) -> str:
        """The ``UPDATE`` of a truncate alone in its window (no source rows); the condition names
        :data:`pg2delta.lake.foreign.TRUNCATE_PREDICATE`, which marks the commit as pg2delta's on the
        embedded engine (its commits show the condition, not the ``SET``)."""
        return f"UPDATE {target} SET {self.mark_truncated('')} WHERE NOT {quote(DELETED_COL)} AND {TRUNCATE_PREDICATE}"


def _value(t: tuple[int, int, int | None], i: int) -> str:
    """Spark SQL of a truncate's commit LSN (``i`` 0) or commit time (2)."""
    if i == 0:
        return f"CAST({int(t[0])} AS BIGINT)"
    return "CAST(NULL AS TIMESTAMP)" if t[2] is None else f"timestamp_micros(CAST({int(t[2])} AS BIGINT))"
