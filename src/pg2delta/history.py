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

from pg2delta.changes import LSN_COL, OP_COL, POS_COL, TS_COL, TruncateEvent
from pg2delta.config import Config
from pg2delta.engine import Engine, Lake
from pg2delta.merge import quote
from pg2delta.schema import spark_type, widens

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
        key_of = list(zip(*(data.column(k).to_pylist() for k in key_names), strict=True))
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


def _empty_source(columns: Sequence[tuple[str, pa.DataType]]) -> pa.Table:
    """A source without rows (a window that only truncates): the MERGE then only ends versions."""
    fields = [pa.field(n, t) for n, t in columns] + list(HISTORY_META) + [pa.field(ACTION, pa.string())]
    return pa.schema(fields).empty_table()


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
        exists = self.lake.delta_version(uri) is not None
        if rows is None and (first is None or not exists):
            return False
        source = rows if rows is not None else _empty_source(columns)
        names = [*(n for n, _ in columns), *HISTORY_META_NAMES]
        types = engine.table_types(uri) if exists else None
        if types:
            casts = {c: spark_type(t) for c, t in columns if c in types and widens(types[c], spark_type(t))}
            casts = {c: t for c, t in casts.items() if types[c] != t}
            if casts or fill is not None:  # the history follows the table (one rewrite, before the MERGE)
                engine.rewrite(uri, casts, fill=fill)
                types = engine.table_types(uri)
        staged = self.lake.stage(source, f"{run_id}/history-{uuid.uuid4().hex[:8]}")
        try:
            engine.ensure_table(uri, staged, names, set(types) if types else None)
            close_all = None if first is None else close_all_sql(first.commit_lsn, first.pos, first.commit_ts, TRUNCATE_OP)
            engine.merge(
                uri, staged,
                lambda t, s: history_statement(t, s, key_names, names, close_all=close_all, nullable_keys=nullable_keys),
            )
        finally:
            self.lake.unstage(staged)
        high = high_water(rows, first)
        if high is not None:
            before = self._high.get(uri)
            self._high[uri] = high if before is None else max(before, high)
        log.info("history %s: %d versions opened, %d ended before the window%s", uri,
                 0 if rows is None else int(pc.sum(pc.equal(rows.column(ACTION), "open")).as_py() or 0),
                 0 if rows is None else int(pc.sum(pc.equal(rows.column(ACTION), "close")).as_py() or 0),
                 ", truncated" if first is not None else "")
        return True

    def copied(self, engine: Engine, schema: str, name: str, staged_dir: str, lsn: int) -> None:
        """A copy of the table as of ``lsn`` (bootstrap, resync): every current version ends (``R``)
        and each copied row opens one, at position -1 and the copy's time, in one MERGE."""
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
            internal=(ACTION,),
        )
        self._high.pop(uri, None)
        log.info("history %s: versions of the copy at lsn %d opened, the current ones ended", uri, lsn)
