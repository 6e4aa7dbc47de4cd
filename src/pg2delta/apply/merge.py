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
from pg2delta.decode.changes import LSN_COL, OP_COL, POS_COL, TOAST_COL, TS_COL

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


def quote(name: str) -> str:
    """A Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def one_change_per_key(ops: Collection[str], *, unique_key: bool) -> bool:
    """Whether no key can have two of these changes (``ops``: their operations, after the window's
    last truncate): only inserts, under a key PostgreSQL keeps unique and not null (``unique_key``:
    the replica identity or the commit position, not a key set in the config), since a key is
    inserted again only after a delete. Such changes are their own final rows, with no reduce."""
    return unique_key and set(ops) <= {"I"}


def reduce_changes(
    changes: pa.Table, key_names: Sequence[str], columns: Sequence[str] | None = None, *, distinct_keys: bool = False
) -> Reduced:
    """The final state per key of ``changes`` (rows already in commit order). ``columns``: those
    the final rows need besides the key, the operation and the unchanged-TOAST list (default: all);
    the others (commit position, xid, time) are not gathered. ``distinct_keys``: the caller knows
    that no key has two inserts (a key PostgreSQL keeps unique), so changes that are all inserts
    are their own final rows, kept as they are."""
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
    lookups: list[Lookup] = []
    toast = final.column(TOAST_COL)
    if toast.null_count < final.num_rows:
        final, lookups = _resolve_toast(changes, final, keep, key_names)
    return Reduced(final, tuple(lookups), by_op.get("I", 0), by_op.get("U", 0), by_op.get("D", 0))


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


def merge_statement(
    target: str,
    source: str,
    key_names: Sequence[str],
    columns: Sequence[str],
    *,
    truncate: bool,
    nullable_keys: bool = False,
) -> str:
    """``MERGE INTO`` applying a reduced source; ``truncate`` also deletes every row the source lacks.

    ``nullable_keys``: the key may hold NULLs (a key from the config rather than a primary key or
    replica identity index), so it is matched with null-safe equality.
    """
    eq = "<=>" if nullable_keys else "="
    on = " AND ".join(f"t.{quote(k)} {eq} s.{quote(k)}" for k in key_names)
    sets = ", ".join(f"t.{quote(c)} = s.{quote(c)}" for c in columns)
    cols = ", ".join(quote(c) for c in columns)
    vals = ", ".join(f"s.{quote(c)}" for c in columns)
    op = quote(OP_COL)
    stmt = (
        f"MERGE INTO {target} AS t USING {source} AS s ON {on} "
        f"WHEN MATCHED AND s.{op} = 'D' THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {sets} "
        f"WHEN NOT MATCHED AND s.{op} <> 'D' THEN INSERT ({cols}) VALUES ({vals})"
    )
    if truncate:
        stmt += " WHEN NOT MATCHED BY SOURCE THEN DELETE"
    return stmt


# --- the reduce of a spilled window, in the engine (see pg2delta.decode.spill) ----------------------
#
# The same final state per key as :func:`reduce_changes`, as Spark SQL over the staged changes
# (rows of any order; commit LSN and position order them):
#
# * a key's rows fall into segments, each ending at a delete of the key (``__seg`` counts the
#   deletes before a row) or at a truncate; the final row is the key's last one;
# * an unchanged-TOAST column of a final row takes the latest value its segment sent before, as
#   ``named_struct('v', c)`` so that a NULL value differs from "not found";
# * a segment that begins with the new-key half of a primary-key change (an update whose old-key
#   delete sits at the position just before it) continues the row of the old key: a value not found
#   in the segment is the one the old key held at that delete, resolved the same way, pointer by
#   pointer (:func:`resolve_step_sql`, repeated until nothing is left to follow);
# * what is still not found comes from the Delta table's row at the key where the chain began
#   (``__lk``), as the in-memory reduce's lookups do.

SEG = "__pg2delta_seg"
EPOCH = "__pg2delta_epoch"  # truncates before the row
RN = "__pg2delta_rn"
ORIGIN = "__pg2delta_origin"
PTR = "__pg2delta_ptr"
LAKE_KEY = "__pg2delta_lk"
AT_LSN = "__pg2delta_at_lsn"
AT_POS = "__pg2delta_at_pos"
PRESENT = "__pg2delta_present"  # on the lake's rows
MISSING = "__pg2delta_missing"  # a final row whose unchanged TOAST is found nowhere


def _v(i: int) -> str:
    return f"__pg2delta_v{i}"


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def ordered_changes_sql(
    changes: str, key_names: Sequence[str], toast_columns: Sequence[str], truncates: Sequence[tuple[int, int]] = ()
) -> str:
    """Every staged change with its segment, the values its segment sent for each unchanged-TOAST
    column up to it, its segment's first row and its rank from the key's last row (1: final).

    ``truncates`` (commit LSN, position) inside the changes (the history's, which keeps the changes
    before a truncate) end every key's segment too: a key gone in a truncate can come back by a key
    change, whose values are the old key's."""
    lsn, pos, op, toast = quote(LSN_COL), quote(POS_COL), quote(OP_COL), quote(TOAST_COL)
    by_key = ", ".join(quote(k) for k in key_names)
    epoch = ""
    if truncates:
        cases = " ".join(
            f"WHEN {lsn} < {int(t_lsn)} OR ({lsn} = {int(t_lsn)} AND {pos} < {int(t_pos)}) THEN {n}"
            for n, (t_lsn, t_pos) in enumerate(sorted(set(truncates)))
        )
        epoch = f"CASE {cases} ELSE {len(set(truncates))} END AS {EPOCH}, "
    seg = (
        f"SELECT *, {epoch}coalesce(sum(CASE WHEN {op} = 'D' THEN 1 ELSE 0 END) OVER (PARTITION BY {by_key} "
        f"ORDER BY {lsn}, {pos} ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS {SEG} FROM {changes}"
    )
    in_seg = f"PARTITION BY {by_key}, {f'{EPOCH}, ' if truncates else ''}{SEG} ORDER BY {lsn}, {pos}"
    values = [
        f"last(CASE WHEN {op} <> 'D' AND NOT coalesce(array_contains({toast}, {_sql_string(c)}), false) "
        f"THEN named_struct('v', {quote(c)}) END, true) OVER ({in_seg} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) "
        f"AS {_v(i)}"
        for i, c in enumerate(toast_columns)
    ]
    if toast_columns:
        values.append(
            f"first(named_struct('lsn', {lsn}, 'pos', {pos}), false) OVER ({in_seg} ROWS BETWEEN UNBOUNDED PRECEDING "
            f"AND UNBOUNDED FOLLOWING) AS {ORIGIN}"
        )
    values.append(f"row_number() OVER (PARTITION BY {by_key} ORDER BY {lsn} DESC, {pos} DESC) AS {RN}")
    return f"SELECT *, {', '.join(values)} FROM ({seg}) AS s"


def toast_chain_sql(
    ordered: str, key_names: Sequence[str], toast_columns: Sequence[str], *, every_row: bool = False
) -> str:
    """The rows whose values must be resolved (final rows with unchanged TOAST, ``every_row``: every
    row with unchanged TOAST; and the old-key deletes of key changes), with a pointer to the delete
    that continues their segment."""
    lsn, pos, op, toast = quote(LSN_COL), quote(POS_COL), quote(OP_COL), quote(TOAST_COL)
    lake_key = ", ".join(f"{_sql_string(k)}, v.{quote(k)}" for k in key_names)
    vals = ", ".join(f"v.{_v(i)}" for i in range(len(toast_columns)))
    deletes = f"SELECT {lsn}, {pos} FROM {ordered} WHERE {op} = 'D' AND {pos} % 2 = 0"
    final_only = "" if every_row else f"v.{RN} = 1 AND "
    return (
        f"SELECT v.{lsn} AS {AT_LSN}, v.{pos} AS {AT_POS}, {vals}, named_struct({lake_key}) AS {LAKE_KEY}, "
        f"CASE WHEN d.{lsn} IS NOT NULL THEN named_struct('lsn', d.{lsn}, 'pos', d.{pos}) END AS {PTR} "
        f"FROM {ordered} AS v LEFT JOIN ({deletes}) AS d ON d.{lsn} = v.{ORIGIN}.lsn AND d.{pos} = v.{ORIGIN}.pos - 1 "
        f"WHERE ({final_only}v.{toast} IS NOT NULL) OR (v.{op} = 'D' AND v.{pos} % 2 = 0)"
    )


def unresolved_sql(chain: str, toast_columns: Sequence[str]) -> str:
    """The condition of a chain row that still has a pointer to follow for some column."""
    missing = " OR ".join(f"{_v(i)} IS NULL" for i in range(len(toast_columns)))
    return f"{PTR} IS NOT NULL AND ({missing})"


def resolve_step_sql(chain: str, toast_columns: Sequence[str]) -> str:
    """One step: rows with values still missing follow their pointer (pointer jumping)."""
    follow = f"(r.{PTR} IS NOT NULL AND ({' OR '.join(f'r.{_v(i)} IS NULL' for i in range(len(toast_columns)))}))"
    vals = ", ".join(
        f"CASE WHEN r.{_v(i)} IS NULL AND {follow} THEN p.{_v(i)} ELSE r.{_v(i)} END AS {_v(i)}"
        for i in range(len(toast_columns))
    )
    return (
        f"SELECT r.{AT_LSN}, r.{AT_POS}, {vals}, "
        f"CASE WHEN {follow} THEN p.{LAKE_KEY} ELSE r.{LAKE_KEY} END AS {LAKE_KEY}, "
        f"CASE WHEN {follow} THEN p.{PTR} ELSE r.{PTR} END AS {PTR} "
        f"FROM {chain} AS r LEFT JOIN {chain} AS p ON p.{AT_LSN} = r.{PTR}.lsn AND p.{AT_POS} = r.{PTR}.pos"
    )


def final_source_sql(
    ordered: str,
    chain: str | None,
    lake: str | None,
    key_names: Sequence[str],
    data_columns: Sequence[str],
    toast_columns: Sequence[str],
    *,
    nullable_keys: bool,
    optional: Collection[str] = (),
    every_row: bool = False,
    nan_safe_keys: Collection[str] = (),
) -> str:
    """The reduced source of the MERGE: the final row per key, unchanged TOAST filled, and the op.

    With unchanged TOAST, ``MISSING`` marks final rows whose value is neither in the window nor in
    the lake (``optional`` columns excepted: NULL then), and ``LAKE_KEY`` says where it was looked for.
    ``every_row``: every change rather than the final ones (the chain built likewise), with its commit
    LSN, position and commit time: what the history (pg2delta.apply.history) makes its versions of.
    ``nan_safe_keys``: key columns matched with the lake by :func:`key_equal`'s ``nan_safe``.
    """
    toast = quote(TOAST_COL)
    idx = {c: i for i, c in enumerate(toast_columns)}
    cols = []
    for c in data_columns:
        if c in idx and chain is not None:
            i = idx[c]
            from_lake = f"l.{quote(c)}" if lake is not None else "NULL"
            cols.append(
                f"CASE WHEN f.{toast} IS NOT NULL AND array_contains(f.{toast}, {_sql_string(c)}) THEN "
                f"(CASE WHEN r.{_v(i)} IS NOT NULL THEN r.{_v(i)}.v ELSE {from_lake} END) ELSE f.{quote(c)} END AS {quote(c)}"
            )
        else:
            cols.append(f"f.{quote(c)}")
    meta = (LSN_COL, POS_COL, OP_COL, TS_COL) if every_row else (OP_COL,)
    select = ", ".join([*cols, *(f"f.{quote(c)}" for c in meta)])
    sql = f"SELECT {select}"
    if chain is not None:
        missing = [
            f"(r.{_v(i)} IS NULL AND array_contains(f.{toast}, {_sql_string(c)}))" for c, i in idx.items() if c not in optional
        ] or ["false"]
        absent = f"l.{PRESENT} IS NULL" if lake is not None else "true"
        sql += f", coalesce(({' OR '.join(missing)}) AND {absent}, false) AS {MISSING}, r.{LAKE_KEY} AS {LAKE_KEY}"
    sql += f" FROM {ordered} AS f" if every_row else f" FROM (SELECT * FROM {ordered} WHERE {RN} = 1) AS f"
    if chain is not None:
        sql += f" LEFT JOIN {chain} AS r ON r.{AT_LSN} = f.{quote(LSN_COL)} AND r.{AT_POS} = f.{quote(POS_COL)}"
        if lake is not None:
            on = " AND ".join(
                key_equal(f"l.{quote(k)}", f"r.{LAKE_KEY}.{quote(k)}", nullable=nullable_keys, nan_safe=k in nan_safe_keys)
                for k in key_names
            )
            sql += f" LEFT JOIN {lake} AS l ON {on}"
    return sql
