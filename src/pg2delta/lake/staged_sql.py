"""The reduce of a spilled window, in the engine (see pg2delta.window.spill): the same final state
per key as :func:`pg2delta.apply.merge.reduce_changes`, as Spark SQL over the staged changes
(rows of any order; commit LSN and position order them). Pure strings: no Spark.

(rows of any order; commit LSN and position order them):

* a key's rows fall into segments, each ending at a delete of the key (``__seg`` counts the
  deletes before a row) or at a truncate; the final row is the key's last one;
* an unchanged-TOAST column of a final row takes the latest value its segment sent before, as
  ``named_struct('v', c)`` so that a NULL value differs from "not found";
* a segment that begins with the new-key half of a primary-key change (an update whose old-key
  delete sits at the position just before it) continues the row of the old key: a value not found
  in the segment is the one the old key held at that delete, resolved the same way, pointer by
  pointer (:func:`resolve_step_sql`, repeated until nothing is left to follow);
* what is still not found comes from the Delta table's row at the key where the chain began
  (``__lk``), as the in-memory reduce's lookups do.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pg2delta.decode.changes import LSN_COL, OP_COL, POS_COL, TOAST_COL, TS_COL
from pg2delta.decode.events import DELETED_COL
from pg2delta.lake.sql import key_equal, quote, sql_string

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
        f"last(CASE WHEN {op} <> 'D' AND NOT coalesce(array_contains({toast}, {sql_string(c)}), false) "
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


def soft_deletes_sql(changes: str, key_names: Sequence[str], data_columns: Sequence[str]) -> str:
    """The staged changes of a soft-delete table as :func:`pg2delta.apply.merge.soft_deleted` makes
    its final rows: a delete whose key's change just before it is not a delete takes that change's
    values and unchanged-TOAST list, ``_pg2delta_deleted`` then true (NULL for a delete without
    them, false for the other changes). Every column the reduce reads, the key and ``data_columns``."""
    lsn, pos, op, toast, mark = (quote(c) for c in (LSN_COL, POS_COL, OP_COL, TOAST_COL, DELETED_COL))
    over = f"OVER (PARTITION BY {', '.join(quote(k) for k in key_names)} ORDER BY {lsn}, {pos})"
    own = {*key_names, LSN_COL, POS_COL, OP_COL, TS_COL, DELETED_COL}
    values = [c for c in dict.fromkeys(data_columns) if c not in own]
    took = f"({op} = 'D' AND {_PREV_OP} IS NOT NULL AND {_PREV_OP} <> 'D')"
    lags = ", ".join([f"lag({op}) {over} AS {_PREV_OP}", f"lag({toast}) {over} AS {_prev(-1)}",
                      *(f"lag({quote(c)}) {over} AS {_prev(i)}" for i, c in enumerate(values))])
    cols = [
        *(quote(c) for c in dict.fromkeys([*key_names, LSN_COL, POS_COL, OP_COL, TS_COL]) if c not in values),
        *(f"CASE WHEN {took} THEN {_prev(i)} ELSE {quote(c)} END AS {quote(c)}" for i, c in enumerate(values)),
        f"CASE WHEN {took} THEN {_prev(-1)} ELSE {toast} END AS {toast}",
        f"CASE WHEN {op} <> 'D' THEN false WHEN {took} THEN true END AS {mark}",
    ]
    return f"SELECT {', '.join(cols)} FROM (SELECT *, {lags} FROM {changes}) AS c"


_PREV_OP = "__pg2delta_prev_op"


def _prev(i: int) -> str:
    return f"__pg2delta_prev{i}" if i >= 0 else "__pg2delta_prev_toast"


def toast_chain_sql(
    ordered: str, key_names: Sequence[str], toast_columns: Sequence[str], *, every_row: bool = False
) -> str:
    """The rows whose values must be resolved (final rows with unchanged TOAST, ``every_row``: every
    row with unchanged TOAST; and the old-key deletes of key changes), with a pointer to the delete
    that continues their segment."""
    lsn, pos, op, toast = quote(LSN_COL), quote(POS_COL), quote(OP_COL), quote(TOAST_COL)
    lake_key = ", ".join(f"{sql_string(k)}, v.{quote(k)}" for k in key_names)
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
                f"CASE WHEN f.{toast} IS NOT NULL AND array_contains(f.{toast}, {sql_string(c)}) THEN "
                f"(CASE WHEN r.{_v(i)} IS NOT NULL THEN r.{_v(i)}.v ELSE {from_lake} END) ELSE f.{quote(c)} END AS {quote(c)}"
            )
        else:
            cols.append(f"f.{quote(c)}")
    meta = (LSN_COL, POS_COL, OP_COL, TS_COL) if every_row else (OP_COL, POS_COL)  # soft deletes' truncates: positions
    select = ", ".join([*cols, *(f"f.{quote(c)}" for c in meta if c not in data_columns)])
    sql = f"SELECT {select}"
    if chain is not None:
        missing = [
            f"(r.{_v(i)} IS NULL AND array_contains(f.{toast}, {sql_string(c)}))" for c, i in idx.items() if c not in optional
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
