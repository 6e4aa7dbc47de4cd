"""SCD type 2 history: one row per version of each key, next to the table (``<table>__history``).

Enabled per table (``[tables."s.t"] history = "scd2"``) or for all tables (``[lake] history =
"scd2"``). A version is opened by an insert or an update of a key and ended by the key's next
change (``U``), its delete (``D``, also the old key of an update that changes the key), a TRUNCATE
(``T``) or a copy of the table (``R``: ``pg2delta resync``, or a table copied again in a run).
Columns: the table's, then ``_pg2delta_valid_from_lsn`` / ``_pg2delta_valid_from_pos`` (commit LSN
and position of the change that opened the version), ``_pg2delta_valid_from`` (its commit time,
UTC), the same three ``_pg2delta_valid_to*`` of the change that ended it (NULL while current),
``_pg2delta_is_current`` and ``_pg2delta_end_op`` (NULL while current).

Each window lands in the history in ONE Delta commit, a MERGE that closes the versions current
before the window (matched by key among the rows whose ``valid_to_lsn`` is NULL; a truncate closes
every one its window's changes did not close first, ``NOT MATCHED BY SOURCE``) and inserts every
version the window opened (those it also ended, closed already). It is written before the table's
MERGE. Idempotent like the changelog: windows are applied in commit order and a transaction never
spans two, so the history holds exactly the transactions up to its largest LSN (opened or ended
at), and a replayed window takes only changes past it. Changes past it that left no trace (a
delete of a key the history does not hold) leave none again.

A window in memory gets its versions from :func:`window_versions`; a window spilled past
``window.memory_budget`` from the engine (:func:`neighbours_sql`, :func:`versions_sql`), the same rows.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.apply.keys import key_tuples
from pg2delta.config import Config
from pg2delta.decode.changes import LSN_COL, OP_COL, POS_COL, TS_COL, TruncateEvent
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.sql import quote
from pg2delta.lake.types import spark_type, widens

log = logging.getLogger(__name__)

HISTORY_SUFFIX = "__history"
FROM_LSN = "_pg2delta_valid_from_lsn"
FROM_POS = "_pg2delta_valid_from_pos"
VALID_FROM = "_pg2delta_valid_from"
TO_LSN = "_pg2delta_valid_to_lsn"
TO_POS = "_pg2delta_valid_to_pos"
VALID_TO = "_pg2delta_valid_to"
CURRENT = "_pg2delta_is_current"
END_OP = "_pg2delta_end_op"
ACTION = "__pg2delta_action"  # staged source only: 'open' (insert a version) or 'close' (end the current one)
TRUNCATE_OP = "T"
COPY_OP = "R"

_TS = pa.timestamp("us", tz="UTC")
HISTORY_META = (
    pa.field(FROM_LSN, pa.int64()),
    pa.field(FROM_POS, pa.int64()),
    pa.field(VALID_FROM, _TS),
    pa.field(TO_LSN, pa.int64()),
    pa.field(TO_POS, pa.int64()),
    pa.field(VALID_TO, _TS),
    pa.field(CURRENT, pa.bool_()),
    pa.field(END_OP, pa.string()),
)
HISTORY_META_NAMES = tuple(f.name for f in HISTORY_META)
_ENDS = (TO_LSN, TO_POS, VALID_TO, END_OP)


def history_table(table: str) -> str:
    """The Delta table name of ``table``'s history (in the same schema folder)."""
    return f"{table}{HISTORY_SUFFIX}"


@dataclass
class _Versions:
    """Builds one window's history rows (see :func:`window_versions`)."""

    data: pa.Table
    key_of: list[tuple[object, ...]]
    opened: list[int] = field(default_factory=list)  # row of ``data`` each version was opened by
    ends: list[tuple[int, int, int | None, str] | None] = field(default_factory=list)
    closes: list[tuple[int, tuple[int, int, int | None, str]]] = field(default_factory=list)  # (row, end)
    open_now: dict[tuple[object, ...], int] = field(default_factory=dict)  # key -> index into opened
    closed_before: set[tuple[object, ...]] = field(default_factory=set)  # keys whose earlier version ended
    truncated: bool = False

    def truncate(self, end: tuple[int, int, int | None, str]) -> None:
        for v in self.open_now.values():
            self.ends[v] = end
        self.open_now.clear()
        self.truncated = True

    def change(self, row: int, op: str, end: tuple[int, int, int | None, str]) -> None:
        key = self.key_of[row]
        if key in self.open_now:
            self.ends[self.open_now.pop(key)] = end
        elif op in ("U", "D") and not self.truncated and key not in self.closed_before:
            self.closes.append((row, end))  # the version current before the window, if the history has one
        self.closed_before.add(key)
        if op in ("I", "U"):
            self.open_now[key] = len(self.opened)
            self.opened.append(row)
            self.ends.append(None)


def window_versions(
    changes: pa.Table | None, truncates: Sequence[TruncateEvent], key_names: Sequence[str], data_columns: Sequence[str]
) -> tuple[pa.Table | None, TruncateEvent | None]:
    """One window's history source rows (``ACTION`` 'open' and 'close'), from ``changes`` (I, U and D
    rows in commit order, unchanged TOAST already filled) and ``truncates``; and the first truncate,
    which ends every version current before the window that no change of the window ended first.

    A table without a key (insert-only) has versions that only a truncate ends."""
    data = changes if changes is not None else pa.table({LSN_COL: pa.array([], pa.int64())})
    n = data.num_rows
    lsns = data.column(LSN_COL).to_pylist() if n else []
    poss = data.column(POS_COL).to_pylist() if n else []
    ops = data.column(OP_COL).to_pylist() if n else []
    tss = data.column(TS_COL).cast(pa.int64()).to_pylist() if n else []
    if key_names and n:
        key_of = key_tuples(data.column(k) for k in key_names)
    else:
        key_of = list(zip(lsns, poss, strict=True))
    events: list[tuple[int, int, int, Any]] = [(lsns[i], poss[i], 1, i) for i in range(n)]
    events += [(t.commit_lsn, t.pos, 0, t) for t in {(t.commit_lsn, t.pos): t for t in truncates}.values()]
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    v = _Versions(data, key_of)
    first: TruncateEvent | None = None
    for lsn, pos, kind, item in events:
        if kind == 0:
            first = first or item
            v.truncate((lsn, pos, item.commit_ts, TRUNCATE_OP))
        else:
            v.change(item, ops[item], (lsn, pos, tss[item], ops[item]))
    if not v.opened and not v.closes:
        return None, first
    return _rows(v, lsns, poss, tss, key_names, data_columns), first


def _rows(
    v: _Versions, lsns: list[int], poss: list[int], tss: list[int | None], key_names: Sequence[str], data_columns: Sequence[str]
) -> pa.Table:
    """The 'open' rows (a version each) then the 'close' rows (key columns and the end)."""
    take = pa.array(v.opened + [r for r, _ in v.closes], pa.int64())
    columns: dict[str, pa.Array | pa.ChunkedArray] = {}
    n_open, n_close = len(v.opened), len(v.closes)
    for c in data_columns:
        col = v.data.column(c).take(take)
        if c not in key_names and n_close:
            col = pa.concat_arrays([col.slice(0, n_open).combine_chunks(), pa.nulls(n_close, col.type)])
        columns[c] = col
    none: list[Any] = [None] * n_close
    ends = [e if e is not None else (None, None, None, None) for e in v.ends] + [e for _, e in v.closes]
    columns[FROM_LSN] = pa.array([lsns[r] for r in v.opened] + none, pa.int64())
    columns[FROM_POS] = pa.array([poss[r] for r in v.opened] + none, pa.int64())
    columns[VALID_FROM] = pa.array([tss[r] for r in v.opened] + none, pa.int64()).cast(_TS)
    columns[TO_LSN] = pa.array([e[0] for e in ends], pa.int64())
    columns[TO_POS] = pa.array([e[1] for e in ends], pa.int64())
    columns[VALID_TO] = pa.array([e[2] for e in ends], pa.int64()).cast(_TS)
    columns[CURRENT] = pa.array([e is None for e in v.ends] + [False] * n_close, pa.bool_())
    columns[END_OP] = pa.array([e[3] for e in ends], pa.string())
    columns[ACTION] = pa.array(["open"] * n_open + ["close"] * n_close, pa.string())
    table = pa.table(columns)
    return table.cast(pa.schema([f.with_nullable(True) for f in table.schema]))


def high_water(rows: pa.Table | None, first: TruncateEvent | None) -> int | None:
    """The largest LSN the window's history commit records (opened, ended or truncated at)."""
    values: list[int] = []
    if rows is not None and rows.num_rows:
        for c in (FROM_LSN, TO_LSN):
            m = pc.max(rows.column(c)).as_py()
            if m is not None:
                values.append(int(m))
    if first is not None:
        values.append(first.commit_lsn)
    return max(values) if values else None


def _ts_sql(micros: int | None) -> str:
    return "CAST(NULL AS TIMESTAMP)" if micros is None else f"timestamp_micros(CAST({int(micros)} AS BIGINT))"


def close_all_sql(lsn: int, pos: int, micros: int | None, op: str) -> str:
    """``SET`` of the versions a truncate or a copy ends (no source row to take the values from)."""
    return (
        f"t.{quote(TO_LSN)} = CAST({int(lsn)} AS BIGINT), t.{quote(TO_POS)} = CAST({int(pos)} AS BIGINT), "
        f"t.{quote(VALID_TO)} = {_ts_sql(micros)}, t.{quote(CURRENT)} = false, t.{quote(END_OP)} = '{op}'"
    )


def history_statement(
    target: str,
    source: str,
    key_names: Sequence[str],
    columns: Sequence[str],
    *,
    close_all: str | None,
    nullable_keys: bool = False,
) -> str:
    """The window's MERGE into the history: end the matched current versions, insert the opened
    ones, and with ``close_all`` (:func:`close_all_sql`) end every other current version."""
    eq = "<=>" if nullable_keys else "="
    act, to_lsn = quote(ACTION), quote(TO_LSN)
    on = " AND ".join([f"s.{act} = 'close'", f"t.{to_lsn} IS NULL", *(f"t.{quote(k)} {eq} s.{quote(k)}" for k in key_names)])
    if not key_names:
        on = "1 = 0"
    sets = ", ".join([*(f"t.{quote(c)} = s.{quote(c)}" for c in _ENDS), f"t.{quote(CURRENT)} = false"])
    cols = ", ".join(quote(c) for c in columns)
    vals = ", ".join(f"s.{quote(c)}" for c in columns)
    stmt = (
        f"MERGE INTO {target} AS t USING {source} AS s ON {on} "
        f"WHEN MATCHED THEN UPDATE SET {sets} "
        f"WHEN NOT MATCHED AND s.{act} = 'open' THEN INSERT ({cols}) VALUES ({vals})"
    )
    if close_all is not None:
        stmt += f" WHEN NOT MATCHED BY SOURCE AND t.{to_lsn} IS NULL THEN UPDATE SET {close_all}"
    return stmt


# --- a spilled window's versions, computed by the engine ---------------------------------------
#
# The same rows as :func:`window_versions`, as Spark SQL over the window's staged changes (every
# change with its unchanged TOAST filled, see :meth:`pg2delta.lake.engine.Engine.stage_filled`), so that
# a window spilled past ``window.memory_budget`` is never gathered on the driver:
#
# * each insert or update opens a version; it ends at the key's next change (``lead`` over the key
#   ordered by commit LSN and position, its op the end's) or at the first truncate after it,
#   whichever comes first; neither: current;
# * the key's first change in the window, an update or a delete before the window's first truncate,
#   also ends the version current before the window (a 'close' row, matched in the MERGE).
#
# A table without a key has a version per change (each its own "key": commit LSN and position).
# The truncates are few and on the driver already: the first one after a change is a CASE over them.

NEXT_LSN = "__pg2delta_next_lsn"
NEXT_POS = "__pg2delta_next_pos"
NEXT_TS = "__pg2delta_next_ts"
NEXT_OP = "__pg2delta_next_op"
RANK = "__pg2delta_rank"  # 1: the key's first change in the window
TRUNCATED_AT = "__pg2delta_truncated_at"  # the first truncate after the change (lsn, pos, ts), or NULL


def _truncates_in_order(truncates: Sequence[TruncateEvent]) -> list[TruncateEvent]:
    return sorted({(t.commit_lsn, t.pos): t for t in truncates}.values(), key=lambda t: (t.commit_lsn, t.pos))


def _before(lsn: str, pos: str, t: TruncateEvent) -> str:
    """The SQL condition of a change at ``lsn``, ``pos`` coming before the truncate ``t``."""
    return f"({lsn} < {int(t.commit_lsn)} OR ({lsn} = {int(t.commit_lsn)} AND {pos} < {int(t.pos)}))"


def neighbours_sql(changes: str, key_names: Sequence[str], truncates: Sequence[TruncateEvent], since: int) -> str:
    """The changes of the view ``changes`` at or after ``since`` (I, U and D), each with the key's next
    change, its rank among the key's changes, and the first of ``truncates`` after it."""
    lsn, pos, op, ts = quote(LSN_COL), quote(POS_COL), quote(OP_COL), quote(TS_COL)
    by_key = ", ".join(quote(k) for k in key_names) if key_names else f"{lsn}, {pos}"
    over = f"OVER (PARTITION BY {by_key} ORDER BY {lsn}, {pos})"
    cols = [
        f"lead({lsn}) {over} AS {NEXT_LSN}", f"lead({pos}) {over} AS {NEXT_POS}",
        f"lead({ts}) {over} AS {NEXT_TS}", f"lead({op}) {over} AS {NEXT_OP}", f"row_number() {over} AS {RANK}",
    ]
    ordered = _truncates_in_order(truncates)
    if ordered:
        cases = " ".join(
            f"WHEN {_before(lsn, pos, t)} THEN named_struct('lsn', CAST({int(t.commit_lsn)} AS BIGINT), "
            f"'pos', CAST({int(t.pos)} AS BIGINT), 'ts', {_ts_sql(t.commit_ts)})"
            for t in ordered
        )
        cols.append(f"CASE {cases} END AS {TRUNCATED_AT}")
    return f"SELECT *, {', '.join(cols)} FROM {changes} WHERE {lsn} >= {int(since)} AND {op} IN ('I', 'U', 'D')"


def versions_sql(
    neighbours: str, key_names: Sequence[str], data_columns: Sequence[str], truncates: Sequence[TruncateEvent]
) -> str:
    """The history's source rows (``ACTION`` 'open' and 'close', as :func:`window_versions` makes them)
    from the view ``neighbours`` (:func:`neighbours_sql`)."""
    lsn, pos, op, ts = quote(LSN_COL), quote(POS_COL), quote(OP_COL), quote(TS_COL)
    ordered = _truncates_in_order(truncates)
    t = TRUNCATED_AT
    if ordered:
        by_change = (
            f"({NEXT_LSN} IS NOT NULL AND ({t} IS NULL OR {NEXT_LSN} < {t}.lsn "
            f"OR ({NEXT_LSN} = {t}.lsn AND {NEXT_POS} < {t}.pos)))"
        )
        by_truncate = f" WHEN {t} IS NOT NULL THEN"
        current = f"(NOT {by_change} AND {t} IS NULL)"
    else:
        by_change, by_truncate, current = f"({NEXT_LSN} IS NOT NULL)", "", f"({NEXT_LSN} IS NULL)"

    def end(of_change: str, of_truncate: str) -> str:
        tail = f"{by_truncate} {of_truncate}" if ordered else ""
        return f"CASE WHEN {by_change} THEN {of_change}{tail} END"

    truncate_op = f"'{TRUNCATE_OP}'"

    data = [quote(c) for c in data_columns]
    opened = [
        *data, f"{lsn} AS {quote(FROM_LSN)}", f"{pos} AS {quote(FROM_POS)}", f"{ts} AS {quote(VALID_FROM)}",
        f"{end(NEXT_LSN, f'{t}.lsn')} AS {quote(TO_LSN)}", f"{end(NEXT_POS, f'{t}.pos')} AS {quote(TO_POS)}",
        f"{end(NEXT_TS, f'{t}.ts')} AS {quote(VALID_TO)}", f"{current} AS {quote(CURRENT)}",
        f"{end(NEXT_OP, truncate_op)} AS {quote(END_OP)}", f"'open' AS {quote(ACTION)}",
    ]
    closed = [
        *(quote(c) if c in key_names else f"CASE WHEN 1 = 0 THEN {quote(c)} END AS {quote(c)}" for c in data_columns),
        f"CAST(NULL AS BIGINT) AS {quote(FROM_LSN)}", f"CAST(NULL AS BIGINT) AS {quote(FROM_POS)}",
        f"{_ts_sql(None)} AS {quote(VALID_FROM)}", f"{lsn} AS {quote(TO_LSN)}", f"{pos} AS {quote(TO_POS)}",
        f"{ts} AS {quote(VALID_TO)}", f"false AS {quote(CURRENT)}", f"{op} AS {quote(END_OP)}", f"'close' AS {quote(ACTION)}",
    ]
    first = f" AND {_before(lsn, pos, ordered[0])}" if ordered else ""
    return (
        f"SELECT {', '.join(opened)} FROM {neighbours} WHERE {op} IN ('I', 'U') "
        f"UNION ALL SELECT {', '.join(closed)} FROM {neighbours} WHERE {RANK} = 1 AND {op} IN ('U', 'D'){first}"
    )


def versions_summary_sql(versions: str) -> str:
    """How many versions the window opens, how many current before it it ends, and its largest LSNs."""
    act = quote(ACTION)
    return (
        f"SELECT sum(CASE WHEN {act} = 'open' THEN 1 ELSE 0 END) AS opened, "
        f"sum(CASE WHEN {act} = 'close' THEN 1 ELSE 0 END) AS closed, "
        f"max({quote(FROM_LSN)}) AS high_from, max({quote(TO_LSN)}) AS high_to FROM {versions}"
    )


def _empty_source(columns: Sequence[tuple[str, pa.DataType]]) -> pa.Table:
    """A source without rows (a window that only truncates): the MERGE then only ends versions."""
    fields = [pa.field(n, t) for n, t in columns] + list(HISTORY_META) + [pa.field(ACTION, pa.string())]
    return pa.schema(fields).empty_table()


@dataclass(frozen=True)
class StagedWindow:
    """A spilled window's changes of one table for its history: Parquet files under ``uri`` (conformed
    to the plan, every change since the table's applied LSN, before and after its truncates), its
    truncates since then too, and where unchanged TOAST the window does not hold is read (the table
    at ``table_uri`` as of ``lookup_version``; ``optional`` columns NULL when it has no row)."""

    uri: str
    rows: int
    since: int  # the history takes the changes at or after it (those before only lend TOAST values)
    truncates: tuple[TruncateEvent, ...]
    toast_columns: tuple[str, ...]
    table_uri: str
    lookup_version: int | None
    optional: frozenset[str] = frozenset()


@dataclass
class HistoryWriter:
    """Writes each window's versions of the history tables, and a copy's (resync, bootstrap)."""

    config: Config
    lake: Lake
    _high: dict[str, int | None] = field(default_factory=dict)  # history uri -> its high-water LSN

    def enabled(self, schema: str, name: str) -> bool:
        return self.config.history_of(schema, name)

    def uri(self, schema: str, name: str) -> str:
        return self.lake.table_uri(schema, history_table(name))

    def high(self, engine: Engine, uri: str) -> int | None:
        """The largest LSN a window's commit recorded in the history (copies' rows, at position -1, aside)."""
        if uri not in self._high:
            self._high[uri] = engine.history_high(uri, [(FROM_LSN, FROM_POS), (TO_LSN, TO_POS)])
        return self._high[uri]

    def write(
        self,
        engine: Engine,
        uri: str,
        run_id: str,
        versions: tuple[pa.Table | None, TruncateEvent | None],
        key_names: Sequence[str],
        columns: Sequence[tuple[str, pa.DataType]],
        *,
        nullable_keys: bool,
        fill: pa.Table | None = None,
    ) -> bool:
        """One window's MERGE into the history at ``uri`` (see :func:`window_versions`); False: nothing to do.

        ``fill``: columns added with a default PostgreSQL keeps, set in every version already in the
        history (as in the table's rows; the caller passes it only while the history holds nothing
        of the window, so a replay never sets it over the window's own versions)."""
        rows, first = versions
        if rows is None and (first is None or self.lake.delta_version(uri) is None):
            return False
        staged = self.lake.stage(rows if rows is not None else _empty_source(columns), f"{run_id}/history-{uuid.uuid4().hex[:8]}")
        try:
            self._merge(engine, uri, staged, key_names, columns, first, nullable_keys=nullable_keys, fill=fill)
        finally:
            self.lake.unstage(staged)
        opened = 0 if rows is None else int(pc.sum(pc.equal(rows.column(ACTION), "open")).as_py() or 0)
        closed = 0 if rows is None else int(pc.sum(pc.equal(rows.column(ACTION), "close")).as_py() or 0)
        self._written(uri, high_water(rows, first), opened, closed, first, "")
        return True

    def write_staged(
        self,
        engine: Engine,
        uri: str,
        run_id: str,
        changes: StagedWindow,
        key_names: Sequence[str],
        columns: Sequence[tuple[str, pa.DataType]],
        *,
        nullable_keys: bool,
        fill: pa.Table | None = None,
    ) -> bool:
        """:meth:`write` of a window spilled past ``window.memory_budget``: its versions computed by the
        engine from the staged changes (:func:`neighbours_sql`, :func:`versions_sql`), never gathered on
        the driver; the same rows, and the same one MERGE."""
        truncates = _truncates_in_order([t for t in changes.truncates if t.commit_lsn >= changes.since])
        first = truncates[0] if truncates else None
        names = [n for n, _ in columns]
        work = f"{run_id}/history-{uuid.uuid4().hex[:8]}"
        try:
            staged, summary = engine.stage_filled(
                changes.table_uri, changes.uri,
                [
                    lambda view: neighbours_sql(view, key_names, truncates, changes.since),
                    lambda view: versions_sql(view, key_names, names, truncates),
                ],
                versions_summary_sql,
                out=f"{work}/versions", work=f"{work}/fill",
                key_names=key_names or [LSN_COL, POS_COL], data_columns=names,
                toast_columns=changes.toast_columns if key_names else (),
                lookup_version=changes.lookup_version, nullable_keys=nullable_keys, optional=changes.optional,
                truncates=[(t.commit_lsn, t.pos) for t in changes.truncates],
            )
            opened, closed = int(summary.get("opened") or 0), int(summary.get("closed") or 0)
            if not opened and not closed:  # nothing but truncates, if anything: as in memory
                return self.write(engine, uri, run_id, (None, first), key_names, columns, nullable_keys=nullable_keys, fill=fill)
            self._merge(engine, uri, staged, key_names, columns, first, nullable_keys=nullable_keys, fill=fill)
        finally:
            self.lake.unstage_dir(work)
        highs = [int(v) for v in (summary.get("high_from"), summary.get("high_to")) if v is not None]
        high = max([*highs, *([first.commit_lsn] if first is not None else [])], default=None)
        self._written(uri, high, opened, closed, first, f" (computed by the engine from {changes.rows} staged changes)")
        return True

    def _merge(
        self,
        engine: Engine,
        uri: str,
        staged: str,
        key_names: Sequence[str],
        columns: Sequence[tuple[str, pa.DataType]],
        first: TruncateEvent | None,
        *,
        nullable_keys: bool,
        fill: pa.Table | None,
    ) -> None:
        """The window's one MERGE of the staged source rows into the history (created, widened or
        filled first, each its own idempotent commit)."""
        names = [*(n for n, _ in columns), *HISTORY_META_NAMES]
        types = engine.table_types(uri) if self.lake.delta_version(uri) is not None else None
        if types:
            casts = {c: spark_type(t) for c, t in columns if c in types and widens(types[c], spark_type(t))}
            casts = {c: t for c, t in casts.items() if types[c] != t}
            if casts or fill is not None:  # the history follows the table (one rewrite, before the MERGE)
                engine.rewrite(uri, casts, fill=fill)
                types = engine.table_types(uri)
        engine.ensure_table(uri, staged, names, set(types) if types else None)
        close_all = None if first is None else close_all_sql(first.commit_lsn, first.pos, first.commit_ts, TRUNCATE_OP)
        engine.merge(
            uri, staged,
            lambda t, s: history_statement(t, s, key_names, names, close_all=close_all, nullable_keys=nullable_keys),
        )

    def _written(self, uri: str, high: int | None, opened: int, closed: int, first: TruncateEvent | None, how: str) -> None:
        if high is not None:
            before = self._high.get(uri)
            self._high[uri] = high if before is None else max(before, high)
        log.info("history %s: %d versions opened, %d ended before the window%s%s", uri, opened, closed,
                 ", truncated" if first is not None else "", how)

    def copied(
        self, engine: Engine, schema: str, name: str, staged_dir: str, lsn: int, *, row_columns: Sequence[str] = ()
    ) -> None:
        """A copy of the table as of ``lsn`` (bootstrap, resync): every current version ends (``R``)
        and each copied row opens one, at position -1 and the copy's time, in one MERGE.
        ``row_columns``: the copy's row metadata (pg2delta.apply.rowmeta), not the history's."""
        if not self.enabled(schema, name):
            return
        uri = self.uri(schema, name)
        now = int(time.time() * 1_000_000)
        extra = [
            f"CAST({int(lsn)} AS BIGINT) AS {quote(FROM_LSN)}", f"CAST(-1 AS BIGINT) AS {quote(FROM_POS)}",
            f"{_ts_sql(now)} AS {quote(VALID_FROM)}", f"CAST(NULL AS BIGINT) AS {quote(TO_LSN)}",
            f"CAST(NULL AS BIGINT) AS {quote(TO_POS)}", f"{_ts_sql(None)} AS {quote(VALID_TO)}",
            f"true AS {quote(CURRENT)}", f"CAST(NULL AS STRING) AS {quote(END_OP)}", f"'open' AS {quote(ACTION)}",
        ]
        close_all = close_all_sql(lsn, -1, now, COPY_OP)
        engine.merge_from_copy(
            uri, staged_dir, extra,
            lambda t, s, cols: history_statement(t, s, [], cols, close_all=close_all),
            internal=(ACTION, *row_columns),
        )
        self._high.pop(uri, None)
        log.info("history %s: versions of the copy at lsn %d opened, the current ones ended", uri, lsn)
