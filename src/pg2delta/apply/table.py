"""Apply: a target's changes merged into its Delta table, its history written.

:func:`merge_changes` reduces a table's changes of a window (an Arrow table, or
:class:`~pg2delta.apply.stage.StagedChanges` for a spilled window: reduced by the engine), fills unchanged
TOAST values from the Delta table as the last logged window left it (:func:`fill_lookups`), and
MERGEs them in one commit (a truncate is a ``NOT MATCHED BY SOURCE`` delete); the run and
``pg2delta backfill`` share it. :class:`TableApplier` is the run's: per target, it skips what the
applied log holds, reshapes the Delta table as the plan says, MERGEs with Delta's idempotent-write
id, and writes the window's versions into the table's SCD2 history (pg2delta.apply.history). The tables of
a window are independent; :func:`apply_tables` and :func:`map_tables` run them concurrently.
Nothing here logs a window or moves the slot: pg2delta.job does, once every table has committed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.apply.history import HistoryWriter, StagedWindow, window_versions
from pg2delta.apply.keys import key_tuple
from pg2delta.apply.lakeside import LakeWriter
from pg2delta.apply.merge import (
    Reduced,
    SoftDeletes,
    fill_toast_in_order,
    merge_statement,
    one_change_per_key,
)
from pg2delta.apply.rowmeta import row_columns, soft_deletes
from pg2delta.apply.schema import Plan, conform
from pg2delta.apply.stage import (
    StagedChanges,
    filtered,
    newest_commit_ts,
    reduce,
    stage_changes,
    table_changes,
)
from pg2delta.apply.targets import Target, live
from pg2delta.config import Config
from pg2delta.decode.changes import BEFORE_OP, LSN_COL, META_NAMES, OP_COL, POS_COL, TruncateEvent
from pg2delta.decode.events import DELETED_COL
from pg2delta.errors import DataError, SchemaError
from pg2delta.faults import fault_point
from pg2delta.lake.applied_log import Applied
from pg2delta.lake.engine import AppendRows, Engine, MergeRows, Txn, replaced_keys
from pg2delta.lake.sql import quote
from pg2delta.memory import release_memory

log = logging.getLogger(__name__)


@dataclass
class TableReport:
    schema: str
    table: str
    path: str
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    truncated: bool = False
    rows_merged: int = 0
    delta_version: int | None = None
    skipped: bool = False
    commit_ts: int | None = None  # microseconds since 1970 (UTC) of the newest transaction applied
    # The window's truncates (commit LSN, position, commit time), in order: what soft deletes mark rows with.
    truncates_at: tuple[tuple[int, int, int | None], ...] = ()

    def soft(self, meta: Sequence[str], key_names: Sequence[str]) -> SoftDeletes | None:
        """The soft deletes of a table whose row columns are ``meta`` (None: deletes remove rows) and
        key ``key_names`` (none, or the commit position: a keyless table)."""
        keyless = not key_names or LSN_COL in key_names
        return SoftDeletes(self.truncates_at, keyless) if DELETED_COL in meta else None


def merge_changes(
    to: LakeWriter,
    report: TableReport,
    run_id: str,
    changes: pa.Table | StagedChanges | None,
    key_names: list[str],
    data_columns: Sequence[str],
    *,
    meta: Sequence[str],
    nullable_keys: bool,
    lookup_version: int | None,
    optional: set[str] | None = None,
    reshape: Callable[[], frozenset[str] | None] | None = None,
    reshaped: Callable[[], None] | None = None,
    txn: Txn | None = None,
) -> None:
    """Reduce ``changes`` (commit order, after the last truncate) and MERGE them into ``report.path``.

    ``data_columns`` may name meta columns (left out); ``meta``: the table's row columns (rowmeta).
    ``report.truncated`` adds the truncate (alone when there are no changes); unchanged TOAST the changes cannot fill
    is read from the table at ``lookup_version`` (the applied log's). ``reshape`` (after those reads, before anything
    is written) changes the Delta table's shape and returns the columns it then has; ``reshaped`` runs once the table
    has every column of the MERGE. ``txn``: Delta's idempotent-write id. Shared by the run and ``pg2delta backfill``.
    """
    if isinstance(changes, StagedChanges):
        try:
            _merge_staged(
                to, report, changes, key_names, data_columns, meta=meta, nullable_keys=nullable_keys,
                lookup_version=lookup_version, optional=optional, reshape=reshape, reshaped=reshaped, txn=txn,
            )
        finally:
            if changes.name is not None:
                to.lake.unstage_dir(changes.name)
        return
    soft, (schema, name, uri) = DELETED_COL in meta, (report.schema, report.table, report.path)
    reducing = reduce(schema, name, changes, key_names, data_columns, configured_key=nullable_keys,
                      meta=[*meta[:3], POS_COL] if soft else meta, soft=soft)  # soft deletes: positions, for the truncates
    if reducing is None:
        _truncate_only(to, report, txn, meta, key_names)
        return
    reduced, key_names, data_columns = reducing
    # Unchanged TOAST comes from the table as the last logged window left it: a replay after a
    # crash between tables must not see what the crashed run already merged.
    source = fill_lookups(to.engine, uri, reduced, key_names, lookup_version, nullable_keys=nullable_keys, optional=optional)
    report.inserts, report.updates, report.deletes = reduced.inserts, reduced.updates, reduced.deletes
    report.rows_merged, key_range = source.num_rows, integer_range(source.column(key_names[0]))
    keys = replaced_keys(source.column(key_names[0])) if len(key_names) == 1 else None
    new, inserts_only = _commit_kind(to, report, lookup_version, nullable_keys=nullable_keys, soft=soft, txn=txn)
    existing = reshape() if reshape is not None else None  # after _commit_kind: reshape's commits move the version
    source, data_columns = _staged_rows(source, data_columns, key_names, soft=soft)
    staged = to.lake.stage(source, f"{run_id}/{schema}.{name}.{uuid.uuid4().hex[:8]}")
    # Staged now: the driver's reduced copies go back to the system before the engine's MERGE, which takes
    # about as much again in this process on the embedded engine (bench/README.md, "A bulk UPDATE ...").
    del source, reduced, reducing
    release_memory()
    try:
        _commit_rows(to, report, staged, key_names, data_columns, existing, reshaped, nullable_keys=nullable_keys, txn=txn,
                     key_range=key_range, new=new, inserts_only=inserts_only, keys=keys)
    finally:
        to.lake.unstage(staged)


def _staged_rows(source: pa.Table, data_columns: list[str], key_names: list[str], *, soft: bool) -> tuple[pa.Table, list[str]]:
    """The final rows :func:`merge_changes` stages, and the columns it lands: with soft deletes also
    ``_pg2delta_deleted`` (the reduce's: pg2delta.apply.merge.soft_deleted) and the positions (for
    the truncates, not landed)."""
    if soft:
        data_columns = [c for c in data_columns if c != POS_COL or c in key_names] + [DELETED_COL]
    return source.select(list(dict.fromkeys([*data_columns, OP_COL, *([POS_COL] if soft else [])]))), data_columns


def truncates_at(truncates: Sequence[TruncateEvent]) -> tuple[tuple[int, int, int | None], ...]:
    """The commit LSN, position and time of each of ``truncates``, in commit order."""
    return tuple(sorted((t.commit_lsn, t.pos, t.commit_ts) for t in truncates))


def _commit_rows(
    to: LakeWriter, report: TableReport, staged: str, key_names: list[str], data_columns: list[str],
    existing: frozenset[str] | None, reshaped: Callable[[], None] | None, *, nullable_keys: bool, txn: Txn | None,
    key_range: tuple[int, int] | None = None, new: bool = False, inserts_only: bool = False,
    keys: tuple[int, ...] | tuple[str, ...] | None = None,
) -> None:
    """Commit the staged final rows of :func:`merge_changes`: an append into a ``new`` table (which
    the append creates, in one commit), else a MERGE (the engine's to commit as it costs it least,
    ``inserts_only`` as :func:`_commit_kind` says, ``keys``: the rows' keys, one per row, or None)."""
    uri = report.path
    if not new:
        to.engine.ensure_table(uri, staged, data_columns, existing)
    if reshaped is not None:
        reshaped()
    to.engine.merge(
        uri, staged,
        lambda target, view: _statement(
            target, view, key_names, data_columns, new, report.truncated, nullable_keys, key_range,
            soft=report.soft(data_columns, key_names), inserts_only=inserts_only, keys=keys,
        ),
        txn=txn, rows=report.rows_merged,
    )
    report.delta_version = to.lake.delta_version(uri)
    log.info(
        "applied %s.%s (%s): %d inserts, %d updates, %d deletes%s -> delta version %s",
        report.schema, report.table, "appended" if new else "merged", report.inserts, report.updates,
        report.deletes, ", truncated" if report.truncated else "", report.delta_version,
    )


def _commit_kind(
    to: LakeWriter, report: TableReport, logged_version: int | None, *, nullable_keys: bool, soft: bool, txn: Txn | None
) -> tuple[bool, bool]:
    """How the window's final rows of ``report.path`` are committed, read before the table's
    reshape (whose commits move its version): whether the table is new (its rows are appended,
    creating it), and whether they are inserts alone that nothing in the table can match and a
    replay cannot land twice (:attr:`pg2delta.lake.engine_session.MergeRows.inserts_only`: the
    engine may commit them without reading the table's state).

    Nothing can match where every change is an insert under a key PostgreSQL keeps unique and not
    null (a primary key or replica identity index; a keyless table's commit position), with no
    truncate and no soft deletes (a key inserted again is a marked row of the table). A replay
    cannot land the rows twice where the table is at the version the applied log recorded for it
    (``logged_version``), so it holds none of the window's rows: any commit since (a crashed
    run's, a compaction) makes a replay a ``MERGE``, which is idempotent. Not without ``txn`` (a
    backfill, a table whose rows this run set anew), which keep the ``MERGE``."""
    version = to.lake.delta_version(report.path)
    inserts_only = (
        txn is not None and not soft and not nullable_keys and not report.truncated
        and report.inserts > 0 and report.updates == 0 and report.deletes == 0
        and logged_version is not None and version == logged_version
    )
    return version is None, inserts_only


def _truncate_only(
    to: LakeWriter, report: TableReport, txn: Txn | None, meta: Sequence[str] = (), key_names: Sequence[str] = (),
) -> None:
    """A window with no change to merge: its truncate (if any) deletes every row of the table (or
    marks them, with soft deletes)."""
    if report.truncated and to.lake.delta_version(report.path) is not None:
        soft = report.soft(meta, key_names)
        if soft is not None:
            to.engine.update(report.path, soft.update_truncated, txn=txn)
        else:
            to.engine.delete_all(report.path, txn=txn)
        report.delta_version = to.lake.delta_version(report.path)



def _merge_staged(
    to: LakeWriter,
    report: TableReport,
    staged: StagedChanges,
    key_names: list[str],
    data_columns: Sequence[str],
    *,
    meta: Sequence[str],
    nullable_keys: bool,
    lookup_version: int | None,
    optional: set[str] | None,
    reshape: Callable[[], frozenset[str] | None] | None,
    reshaped: Callable[[], None] | None,
    txn: Txn | None,
) -> None:
    """:func:`merge_changes` of staged changes: reduced and merged by the engine (pg2delta.window.spill)."""
    schema, name, uri = report.schema, report.table, report.path
    if staged.rows == 0 or staged.uri is None or staged.name is None:
        _truncate_only(to, report, txn, meta, key_names)
        return
    data_columns = [c for c in data_columns if c not in META_NAMES]
    if not key_names:
        if set(staged.ops) - {"I"}:
            raise SchemaError(
                f"table {schema}.{name} has no key but got updates or deletes; "
                f"set [tables.\"{schema}.{name}\"] key = [...] in the config"
            )
        key_names = [LSN_COL, POS_COL]
        data_columns = [*data_columns, LSN_COL, POS_COL]
    data_columns = list(dict.fromkeys([*data_columns, *meta]))  # the staged files hold _pg2delta_deleted (stage_changes)
    report.inserts, report.updates, report.deletes = staged.ops["I"], staged.ops["U"], staged.ops["D"]
    new, inserts_only = _commit_kind(to, report, lookup_version, nullable_keys=nullable_keys, soft=DELETED_COL in meta, txn=txn)
    existing = reshape() if reshape is not None else None
    distinct = one_change_per_key(staged.ops, unique_key=not nullable_keys)
    to.engine.ensure_table(uri, staged.uri, data_columns, existing)
    if reshaped is not None:
        reshaped()
    truncate, soft = report.truncated, report.soft(meta, key_names)
    report.rows_merged = to.engine.merge_reduced(
        uri, staged.uri,
        lambda target, view: _statement(
            target, view, key_names, data_columns, new, truncate, nullable_keys, soft=soft, inserts_only=inserts_only
        ),
        work=f"{staged.name}-reduce", key_names=key_names, data_columns=data_columns,
        toast_columns=staged.toast_columns, lookup_version=lookup_version, nullable_keys=nullable_keys,
        optional=optional or (), txn=txn, rows=staged.rows, bucket_files=staged.buckets,
        distinct_keys=distinct,
    )
    report.delta_version = to.lake.delta_version(uri)
    log.info(
        "applied %s.%s (%s by the engine, %d changes in %d staged files): %d inserts, %d updates, "
        "%d deletes%s -> delta version %s", schema, name, "appended" if new else "reduced and merged",
        staged.rows, staged.files, report.inserts, report.updates, report.deletes,
        ", truncated" if report.truncated else "", report.delta_version,
    )


def _statement(
    target: str, view: str, key_names: Sequence[str], data_columns: Sequence[str], append: bool, truncate: bool,
    nullable_keys: bool, key_range: tuple[int, int] | None = None, *, soft: SoftDeletes | None = None,
    inserts_only: bool = False, keys: tuple[int, ...] | tuple[str, ...] | None = None,
) -> AppendRows | MergeRows:
    """The commit of a window's final rows: a MERGE, or into a table this window created (no row
    to match, nothing a truncate could remove) an append of the rows that are not deletes. A
    replay after a crash finds the table there and merges the same rows again. ``key_range``: the
    source's first key column's smallest and largest value, when known (an integer key);
    ``inserts_only``: see :func:`_commit_kind`; ``keys``: the source's keys (one key column), when
    known (:attr:`pg2delta.lake.engine_session.MergeRows.keys`)."""
    if append:
        if soft is not None:
            return AppendRows(tuple(data_columns), soft.landed(), soft.source(view, data_columns))
        return AppendRows(tuple(data_columns), f"{quote(OP_COL)} <> 'D'")
    merge = MergeRows(
        merge_statement(target, view, key_names, data_columns, truncate=truncate, nullable_keys=nullable_keys, soft=soft),
        tuple(key_names), tuple(data_columns), truncate, nullable_keys, inserts_only=inserts_only, keys=keys,
    )
    if key_range is None or truncate or nullable_keys:
        return merge
    bounded = merge_statement(target, view, key_names, data_columns, truncate=truncate, key_range=key_range, soft=soft)
    return dataclasses.replace(merge, bounded=bounded)


def integer_range(column: pa.ChunkedArray) -> tuple[int, int] | None:
    """The smallest and largest value of an integer column without nulls (None otherwise)."""
    if not pa.types.is_integer(column.type) or column.null_count or len(column) == 0:
        return None
    bounds = pc.min_max(column)
    return int(bounds["min"].as_py()), int(bounds["max"].as_py())


def fill_lookups(
    engine: Engine,
    uri: str,
    reduced: Reduced,
    key_names: Sequence[str],
    version: int | None,
    *,
    nullable_keys: bool,
    optional: set[str] | None = None,
) -> pa.Table:
    """Unchanged-TOAST values the window does not hold, read from the Delta table at ``version``.

    ``optional`` columns (kept after a drop) are NULL when the lake does not have the row.
    """
    table = reduced.table
    if not reduced.lookups:
        return table
    columns = sorted({c for lk in reduced.lookups for c in lk.columns})
    wanted = list(dict.fromkeys(lk.key for lk in reduced.lookups))
    rows = (
        []  # a negative version: the table is new (a backfill copy), there is nothing to read
        if version is not None and version < 0
        else engine.read_rows(uri, key_names, wanted, columns, version=version, nullable_keys=nullable_keys)
    )
    found = {key_tuple(r[k] for k in key_names): r for r in rows}
    values = {c: table.column(c).to_pylist() for c in columns}
    for lk in reduced.lookups:
        row = found.get(lk.key)
        if row is None and set(lk.columns) <= (optional or set()):
            continue
        if row is None:
            raise DataError(
                f"cannot recover the unchanged TOAST value of {', '.join(lk.columns)} in {uri}: "
                "the row is neither in this window nor in the lake; run pg2delta bootstrap for this table "
                "or set REPLICA IDENTITY FULL on it"
            )
        for c in lk.columns:
            values[c][lk.row] = row[c]
    for c in columns:
        i = table.column_names.index(c)
        table = table.set_column(i, c, pa.array(values[c], type=table.schema.field(c).type))
    return table

class TableApplier:
    """The run's apply of one target per window: a MERGE per Delta table, then its history.

    It is handed what it uses, not the run: ``config`` (the tables' settings), ``to`` (the lake and
    its engine), ``history`` (the SCD2 history tables). ``app_id``: Delta's idempotent-write
    application id of this server and slot ("": none). ``bootstrapped``: the lake was bootstrapped;
    a table without a copy is skipped (the next run copies it). ``rewritten``: tables whose rows
    this run set anew (a column's default): their commits are not recognised as done by Delta's
    idempotent-write id.
    """

    def __init__(
        self, config: Config, to: LakeWriter, history: HistoryWriter, app_id: str, *,
        bootstrapped: bool, rewritten: set[int] | None = None,
    ) -> None:
        self.config, self.to, self.histories = config, to, history
        self.app_id = app_id
        self.bootstrapped = bootstrapped
        self.rewritten: set[int] = set() if rewritten is None else rewritten

    def txn(self, version: int) -> Txn | None:
        """Delta's idempotent-write id of a commit (the engine uses it where Delta has it): a table's
        MERGE carries the commit LSN of its newest change in the window. Versions only grow from
        window to window, so a replayed window's MERGE into a table that committed it before a crash
        is skipped by Delta itself (no second commit), and the applied-log rule stays the guarantee
        on every engine."""
        return Txn(self.app_id, version) if self.app_id else None

    def _nullable_keys(self, tgt: Target) -> bool:
        """Whether ``tgt`` is merged on a configured key (primary keys and identity indexes are NOT NULL)."""
        return bool(self.config.table(tgt.schema, tgt.table).key) or any(
            bool(self.config.table(*tw.latest.qualified_name).key) for tw in tgt.parts
        )

    def _skipped(self, report: TableReport, applied: Applied | None, window_end: int) -> bool:
        """Whether the window has nothing for the table: the applied log holds it, or it has no copy yet."""
        if (applied.end_lsn if applied else 0) >= window_end:
            report.skipped = True
        elif applied is None and self.bootstrapped:
            # Added to the publication after this run started: the next run copies it at a later snapshot.
            log.info("skipped %s.%s: not copied yet, the next run copies it", report.schema, report.table)
            report.skipped = True
        return report.skipped

    def _changes(
        self, run_id: str, tgt: Target, pl: Plan | None, applied_lsn: int
    ) -> tuple[pa.Table | StagedChanges | None, list[TruncateEvent], set[str]]:
        """The table's changes of the window past ``applied_lsn`` (staged as Parquet when spilled),
        its truncates, and the columns kept by an update (pg2delta.apply.stage)."""
        soft = soft_deletes(self.config, tgt.schema, tgt.table)  # the changes before a truncate too
        if pl is None or not any(b.spilled for tw in tgt.parts for b in tw.batches):
            return table_changes(tgt, pl, applied_lsn, whole=soft)
        truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
        staged, kept_by_update = stage_changes(
            self.to.lake, tgt, pl, applied_lsn, f"{run_id}/{tgt.schema}.{tgt.table}.{uuid.uuid4().hex[:8]}",
            bucket_key=list(pl.key) or [LSN_COL, POS_COL], soft=soft, whole=soft,
        )  # the MERGE's key (a keyless table's: its position)
        release_memory()
        return staged, truncates, kept_by_update

    def _reshape(self, uri: str, pl: Plan, drop: Sequence[str], fill: pa.Table | None) -> frozenset[str] | None:
        """The Delta table's shape changes of the plan, before its MERGE; the columns it then has."""
        self.to.engine.rename_columns(uri, pl.renamed)  # column mapping: a commit of its own, no file rewritten
        if pl.widened or drop or fill is not None:
            # One commit, before the MERGE: rows the window writes get their own values from it.
            self.to.engine.rewrite(uri, {c: new for c, _, new in pl.widened}, drop=drop, fill=fill)
        if not pl.existing:
            return None
        return (pl.existing - set(drop)) | frozenset(fill.column_names if fill is not None else ())

    def apply(
        self, run_id: str, tgt: Target, pl: Plan | None, applied: Applied | None, window_end: int
    ) -> TableReport:
        """MERGE the window's changes of ``tgt`` (planned as ``pl``) into its Delta table, in one commit."""
        applied_lsn = applied.end_lsn if applied else 0
        schema, name = tgt.schema, tgt.table
        uri = self.to.lake.table_uri(schema, name)
        report = TableReport(schema, name, uri)
        if self._skipped(report, applied, window_end):
            return report
        changes, truncates, kept_by_update = self._changes(run_id, tgt, pl, applied_lsn)
        report.truncated, report.truncates_at = bool(truncates), truncates_at(truncates)
        # The table's newest change in the window is its commit's idempotent-write version: a
        # replay of the window holds the same changes (or more, then a higher version) for it.
        newest = max(
            [t.commit_lsn for t in truncates] + [b.max_lsn for tw in tgt.parts for b in tw.batches if b.num_rows] or [window_end]
        )
        txn = self.txn(newest)
        report.commit_ts = newest_commit_ts(tgt, truncates, applied_lsn)
        meta = row_columns(self.config, schema, name)
        if pl is None:  # no changes to merge, perhaps a truncate
            merge_changes(self.to, report, run_id, None, [], [], meta=meta, nullable_keys=False, lookup_version=None, txn=txn)
            return report
        drop = pl.kept if self.config.table(schema, name).dropped_columns == "drop" else ()
        # Rows already in the table get the value PostgreSQL reads for columns added with a default.
        fill = pa.table({c: pa.repeat(v, 1) for c, v in pl.fills}) if pl.fill_table and pl.fills else None
        if fill is not None:
            # A replay sets the default in every row again, also in rows a crashed run's MERGEs
            # wrote: those MERGEs (this window's and the later ones of this run) must then run
            # again rather than be recognised as done.
            self.rewritten.add(tgt.owner)
        merge_changes(
            self.to, report, run_id, changes, list(pl.key), [n for n, _ in pl.columns], meta=meta,
            nullable_keys=self._nullable_keys(tgt), lookup_version=applied.delta_version if applied else None,
            optional=kept_by_update, reshape=functools.partial(self._reshape, uri, pl, drop, fill),
            reshaped=functools.partial(fault_point, "after_schema_change"),
            txn=None if tgt.owner in self.rewritten else txn,
        )
        return report

    def history(self, run_id: str, tgt: Target, pl: Plan | None, applied: Applied | None, end: int) -> None:
        """The window's versions of ``tgt`` into its history (pg2delta.apply.history), past the history's end.

        Unchanged TOAST is filled from every change of the window since the table's applied LSN (a
        replay that takes only the changes past the history's end still finds the values the changes
        before it sent), else from the table as the last logged window left it. A window spilled past
        ``window.memory_budget`` has its versions computed by the engine from staged files."""
        schema, name = tgt.schema, tgt.table
        applied_lsn = applied.end_lsn if applied else 0
        if not self.histories.enabled(schema, name) or applied_lsn >= end or (applied is None and self.bootstrapped):
            return
        uri = self.histories.uri(schema, name)
        high = self.histories.high(self.to.engine, uri)
        since = applied_lsn if high is None else max(applied_lsn, high + 1)
        truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= since]
        key_names = list(pl.key) if pl is not None else []
        columns = [(n, t) for n, t in pl.columns if n not in META_NAMES] if pl is not None else []
        nullable_keys = self._nullable_keys(tgt)
        fresh = high is None or high < applied_lsn  # nothing of this window in the history yet
        fill = pa.table({c: pa.repeat(v, 1) for c, v in pl.fills}) if pl is not None and pl.fill_table and pl.fills else None
        fill = fill if fresh else None
        table_uri = self.to.lake.table_uri(schema, name)
        lookup_version = applied.delta_version if applied else None
        if pl is not None and any(b.spilled for tw in tgt.parts for b in tw.batches):
            staging = f"{run_id}/{schema}.{name}.history.{uuid.uuid4().hex[:8]}"
            try:
                staged, kept = stage_changes(self.to.lake, tgt, pl, applied_lsn, staging, whole=True)
                if staged.rows and staged.uri is not None:
                    window = StagedWindow(
                        staged.uri, staged.rows, since,
                        tuple(t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn),
                        staged.toast_columns, table_uri,
                        lookup_version, frozenset(kept),
                    )
                    self.histories.write_staged(
                        self.to.engine, uri, run_id, window, key_names, columns, nullable_keys=nullable_keys, fill=fill
                    )
                    return
            finally:
                self.to.lake.unstage_dir(staging)
            changes: pa.Table | None = None
        else:
            changes, kept = conform(live(tgt, applied_lsn), pl) if pl is not None else (None, set())
        if changes is not None:
            changes = filtered(changes, pc.and_(
                pc.not_equal(changes.column(OP_COL), BEFORE_OP), pc.greater_equal(changes.column(LSN_COL), applied_lsn)
            ))
            if changes.num_rows and key_names:
                changes = fill_lookups(
                    self.to.engine, table_uri, fill_toast_in_order(changes, key_names), key_names, lookup_version,
                    nullable_keys=nullable_keys, optional=kept,
                )
            changes = filtered(changes, pc.greater_equal(changes.column(LSN_COL), since))
        versions = window_versions(changes, truncates, key_names, [n for n, _ in columns])
        self.histories.write(self.to.engine, uri, run_id, versions, key_names, columns, nullable_keys=nullable_keys, fill=fill)


__all__ = ["TableApplier", "TableReport", "fill_lookups", "merge_changes"]
