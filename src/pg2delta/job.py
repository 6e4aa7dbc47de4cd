"""The job: bounded windows from the slot, applied to Delta in commit order, then the slot advanced.

One run:

1. takes the per-slot advisory lock and checks the slot and publication;
2. fixes its upper bound (``--until-lsn`` or the server's flush LSN at start);
3. repeats, until the bound is reached: peek one window (capped by changes and bytes),
   decode it, and for every table reduce the window to its final state per key, stage it
   as Parquet and MERGE it into the Delta table (one data commit per table and window);
   append the window to the applied log (a Delta table under the lake root); then, and
   only then, advance the slot to the window's end.

A crash anywhere leaves the slot where it was; the next run peeks the same changes again.
Re-applying them is harmless: MERGE of final states is idempotent, a truncate is a
``NOT MATCHED BY SOURCE`` delete, and changes at or before a table's applied LSN are skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import signal
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta import pgoutput as po
from pg2delta.catalog import AddedColumn, PgTypeCatalog
from pg2delta.changelog import ChangelogWriter
from pg2delta.changes import (
    BEFORE_OP,
    LSN_COL,
    META_NAMES,
    OP_COL,
    POS_COL,
    TOAST_COL,
    ChangeBatch,
    DecodedChunk,
    RelationVersion,
    TruncateEvent,
    WindowDecoder,
)
from pg2delta.config import Config
from pg2delta.engine import Engine, Lake, Txn
from pg2delta.errors import DataError, DecodeError, SchemaError
from pg2delta.history import HistoryWriter, StagedWindow, window_versions
from pg2delta.lsn import format_lsn
from pg2delta.merge import Reduced, fill_toast_in_order, merge_statement, reduce_changes
from pg2delta.progress import Progress, percent
from pg2delta.schema import Plan, Shape, conform, conform_batches, plan, shape_cut, shape_of
from pg2delta.slot import SlotSource, WindowRead, connect
from pg2delta.spill import Batch, SpilledBatch, Spiller, newest_ts
from pg2delta.typemap import ColumnCodec, value_of_text_array

log = logging.getLogger(__name__)

LOG_TABLE = "_pg2delta/applied_log"
FAULT_ENV = "PG2DELTA_CRASH_AT"  # test hook: SIGKILL this process at the named point

LOG_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("slot", pa.string()),
        ("window_start", pa.int64()),
        ("window_end", pa.int64()),
        ("window_end_lsn", pa.string()),
        ("relation_oid", pa.int64()),
        ("schema_name", pa.string()),
        ("table_name", pa.string()),
        ("delta_version", pa.int64()),
        ("inserts", pa.int64()),
        ("updates", pa.int64()),
        ("deletes", pa.int64()),
        ("truncated", pa.bool_()),
        ("applied_at", pa.timestamp("us", tz="UTC")),
        ("key_columns", pa.string()),  # JSON list of the columns the window merged on
        ("kind", pa.string()),  # 'window', or 'bootstrap' for a table's initial copy (pg2delta.bootstrap)
        # Commit time of the newest transaction the window applied to the table (null for bootstrap
        # and backfill rows, and in lakes written before pg2delta recorded it): pg2delta status's lag
        # in time. Appended with mergeSchema, so an older applied log gains the column.
        ("commit_ts", pa.timestamp("us", tz="UTC")),
        # What put the table in the publication when the window was applied or the copy made
        # (catalog row OIDs; bootstrap._MEMBERSHIP), to notice a table removed from it and added back.
        ("publication", pa.string()),
        # A partitioned table's leaf partitions (OIDs) then, to notice one attached with rows.
        ("partitions", pa.string()),
        # JSON {column: pg_attribute.attnum} of the Delta table's columns, to tell a renamed column,
        # or one dropped and added again under its old name, from a new one.
        ("attnums", pa.string()),
    ]
)


def fault_point(name: str) -> None:
    """Kill this process for real at ``name`` when the test hook asks for it."""
    if os.environ.get(FAULT_ENV) == name:
        log.warning("fault injection: killing the process at %s", name)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class Applied:
    """Where a table's last logged window left it: the window's end and the Delta version it made."""

    end_lsn: int
    delta_version: int | None
    schema: str = ""  # the Delta table the relation's changes go to (kept across renames)
    table: str = ""
    key: tuple[str, ...] | None = None  # the columns it was last merged on (None: not logged)
    publication: str | None = None  # its publication membership as last logged (None: not logged)
    partitions: str | None = None  # a partitioned table's leaf partitions as last logged
    attnums: dict[str, int] | None = None  # its columns' attnums as last logged


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


@dataclass
class WindowReport:
    start_lsn: int
    end_lsn: int
    rows: int = 0
    bytes: int = 0
    transactions: int = 0
    tables: list[TableReport] = field(default_factory=list)
    seconds: float = 0.0
    spilled_rows: int = 0  # decoded changes the window spilled past the memory budget (pg2delta.spill)


@dataclass
class RunReport:
    slot: str
    start_lsn: int
    upper_lsn: int
    end_lsn: int
    windows: list[WindowReport] = field(default_factory=list)
    maintenance: Any = None  # the MaintainReport of `[maintain] interval`, when this run maintained the lake

    @property
    def nothing_to_do(self) -> bool:
        return self.end_lsn == self.start_lsn and not any(w.rows for w in self.windows)

    @property
    def changes(self) -> int:
        return sum(t.inserts + t.updates + t.deletes for w in self.windows for t in w.tables)


@dataclass
class _TableWindow:
    """Everything one window holds for one table."""

    oid: int
    batches: list[Batch] = field(default_factory=list)
    truncates: list[TruncateEvent] = field(default_factory=list)

    @property
    def latest(self) -> RelationVersion:
        versions = [b.relation for b in self.batches] + [v for t in self.truncates for v in t.relations if v.oid == self.oid]
        return max(versions, key=lambda v: v.version)

    def cut(self, lsn: int) -> None:
        """Keep only the changes of transactions whose commit LSN is before ``lsn``."""
        kept: list[Batch] = []
        for b in self.batches:
            if b.max_lsn < lsn:
                kept.append(b)
            elif b.first_lsn < lsn:
                batch = b.load()
                rows = batch.filter(pc.less(batch.column(LSN_COL), lsn))
                if rows.num_rows:
                    kept.append(ChangeBatch(b.relation, rows))
        self.batches = kept
        self.truncates = [t for t in self.truncates if t.commit_lsn < lsn]


@dataclass
class _Target:
    """The changes one window holds for one Delta table: of one relation, or of several partitions."""

    owner: int  # the relation OID the applied log records for this Delta table
    schema: str
    table: str
    parts: list[_TableWindow] = field(default_factory=list)


@dataclass
class StagedChanges:
    """A table's changes of a spilled window, conformed and filtered, as Parquet files in the staging
    area (``name`` there, at ``uri``), with what the run reports of them."""

    name: str | None
    uri: str | None
    rows: int = 0
    files: int = 0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    toast_columns: tuple[str, ...] = ()


@dataclass
class _Read:
    """One window as read and decoded, before anything of it is applied."""

    end: int  # where the window ends (the slot's position after it)
    tables: dict[int, _TableWindow]
    read: WindowRead
    transactions: int
    capped: bool  # ended by --max-changes / --max-bytes
    shape_cut: bool  # ended before a transaction that changes a table's shape


def _run_progress(start: int, upper: int, *, bar: bool | None = None) -> Progress:
    """A run's progress through its LSN range [start, upper): a bar on a terminal, log lines otherwise."""

    def line(p: Progress) -> str:
        eta = p.eta()
        return (
            f"reading: {p.rows} rows, {p.rate():.0f} rows/s, {percent(p.position, p.total)} of the LSN range"
            + (f", eta {eta:.0f} s" if eta is not None else "")
        )

    return Progress("run", total=upper - start, unit="B", bytes_unit=True, logger=log, line=line, bar=bar)


def _live(tgt: _Target, lsn: int) -> list[list[Batch]]:
    """The batches of each part of ``tgt`` that hold changes at or after the table's applied LSN.

    Normally all of them (a window starts where the last applied one ended); after a resync the
    table is applied through the copy's snapshot, and changes before it, in whatever shape they
    were made, are not the lake's concern any more.
    """
    return [
        [b for b in tw.batches if b.num_rows and b.max_lsn >= lsn]
        for tw in tgt.parts
    ]


class Job:
    def __init__(self, config: Config, *, engine_factory: Callable[[Lake], Engine] | None = None) -> None:
        self.config = config
        self.lake = Lake(config.lake_root)
        self._engine_factory = engine_factory or (lambda lake: Engine.start(config.engine, lake))
        self._engine: Engine | None = None
        self._catalog_conn: Any = None
        self._catalog: PgTypeCatalog | None = None
        self._progress: Progress | None = None  # the run's (None: pg2delta plan's reads log per window)
        self._memberships: dict[int, str | None] = {}  # published table OID -> membership at the run's start
        self._leaves: dict[int, str | None] = {}  # partitioned table OID -> its leaf partitions at the run's start
        self._attnums: dict[int, str] = {}  # table OID -> JSON of its Delta columns' attnums, for the log
        self._progress_start = 0
        self._roots: dict[int, tuple[int, str, str] | None] = {}
        self._bootstrapped = False  # the lake was bootstrapped: tables without a copy are not applied
        self._app_id = ""  # Delta's txnAppId for this slot's commits (see _txn)
        self._rewritten: set[int] = set()  # tables whose rows this run set anew: no Delta txn skipping
        # pg2delta plan: each Delta table's columns as the windows planned so far would leave them
        # (the lake itself does not change); None in a run.
        self.planned_types: dict[str, dict[str, str]] | None = None
        self.changelog = ChangelogWriter(config, self.lake)
        self.history = HistoryWriter(config, self.lake)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._engine_factory(self.lake)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None

    # --- the run ---------------------------------------------------------------------------

    def run(self, *, until_lsn: int | None = None, create_slot: bool | None = None) -> RunReport:
        cfg = self.config
        create = cfg.source.create_slot if create_slot is None else create_slot
        with SlotSource(cfg.source.dsn, cfg.source.slot, cfg.source.publication, connect_timeout=cfg.source.connect_timeout) as src:
            start, upper = src.locked_bounds(until_lsn, create=create)
            report = RunReport(cfg.source.slot, start, upper, start)
            if start >= upper:
                log.info("slot %s is at %s, nothing to do up to %s", cfg.source.slot, format_lsn(start), format_lsn(upper))
                self._maintain_if_due(report)
                return report
            self.lake.check_writable()
            # Per server (a new initdb starts WAL positions again) and slot: Delta's idempotent-
            # write id, with the window's end as its version.
            self._app_id = f"pg2delta/{src.system_identifier()}/{cfg.source.slot}"
            from pg2delta.bootstrap import copy_new_tables

            # Tables added to the publication since the lake's bootstrap are copied first.
            self._bootstrapped = copy_new_tables(self, src)
            applied = self._applied_lsns()
            if self._added_back(src, applied):
                applied = self._applied_lsns()
            run_id = uuid.uuid4().hex
            catalog_conn = connect(cfg.source.dsn, application_name="pg2delta catalog")
            self._catalog_conn = catalog_conn
            try:
                catalog = PgTypeCatalog(catalog_conn)
                self._catalog = catalog
                key_resolver = self._key_resolver(catalog_conn)
                position = start
                self._progress, self._progress_start = _run_progress(start, upper), start
                while position < upper:
                    window = self._window(src, run_id, position, upper, applied, catalog, key_resolver)
                    report.windows.append(window)
                    if window.end_lsn <= position:
                        break
                    position = window.end_lsn
                    report.end_lsn = position
                    self._progress.move_to(position - start)
            finally:
                self._catalog = None
                catalog_conn.close()
                if self._progress is not None:
                    self._progress.close()
                    self._progress = None
            self._maintain_if_due(report)
            return report

    def _added_back(self, src: SlotSource, applied: dict[int, Applied]) -> bool:
        """Tables removed from the publication and added back since their last logged window or
        copy (see :meth:`added_back_tables`): copied again at a new snapshot where
        ``on_unfollowable = "resync"`` (returns True); otherwise the run stops (exit 78) before
        reading, naming ``pg2delta resync``."""
        from pg2delta.bootstrap import DEFAULT_PARALLEL, copy_at_new_snapshot

        again, refusal = self.added_back_tables(src, applied)
        if refusal is not None:
            raise refusal
        for name in again.values():
            log.warning(
                "%s left publication %r and came back since its last window; on_unfollowable = \"resync\": "
                "copying it again", name, self.config.source.publication,
            )
        if again:
            copy_at_new_snapshot(self, src, set(again), parallel=DEFAULT_PARALLEL)
        return bool(again)

    def added_back_tables(self, src: SlotSource, applied: dict[int, Applied]) -> tuple[dict[int, str], SchemaError | None]:
        """Published tables none of whose publication entries of their last logged window or copy
        holds them now (what puts a table in the publication is catalog rows: a table dropped from
        it and added again has new ones): the changes made while they were out were never
        published, so the lake cannot follow them by changes alone. Returns the ones to copy again
        (``on_unfollowable = "resync"``; OID -> name) and the refusal for the others."""
        from pg2delta.bootstrap import partition_leaves, publication_memberships

        cfg = self.config
        published = publication_memberships(src.conn, cfg.source.publication)
        self._memberships = {oid: m for oid, (m, _) in published.items()}
        self._leaves = {oid: leaves for oid, (_, leaves) in published.items() if leaves is not None}
        self._leaves.update(partition_leaves(src.conn, [n for n, t in cfg.tables.items() if t.partitions == "root"]))
        again: dict[int, str] = {}
        refused: list[str] = []
        for oid, now in self._memberships.items():
            then = applied[oid].publication if oid in applied else None
            # Still held by one of the catalog rows that held it then (say an explicit entry, and
            # its schema added since): it never left.
            if then is None or now is None or set(then.split(",")) & set(now.split(",")):
                continue
            a = applied[oid]
            name = f"{a.schema}.{a.table}"
            if cfg.table(a.schema, a.table).on_unfollowable == "resync":
                again[oid] = name
            else:
                refused.append(name)
        if refused:
            return again, SchemaError(
                f"{', '.join(refused)} left publication {cfg.source.publication!r} and came back since the lake's "
                f"last window of {'it' if len(refused) == 1 else 'them'}: changes made in between were never "
                f"published, so the lake cannot follow by changes alone; copy again with pg2delta resync "
                f"{' '.join(f'--table {n}' for n in refused)} (or set on_unfollowable = \"resync\")"
            )
        return again, self._attached_with_rows(src, applied, again) or self._detached(src, applied, again)

    def _attached_with_rows(self, src: SlotSource, applied: dict[int, Applied], again: dict[int, str]) -> SchemaError | None:
        """Partitions attached, with rows in them, to a partitioned table the lake writes as one
        Delta table (published via its root, or ``partitions = "root"``) since its last logged
        window or copy: PostgreSQL never sends the rows a partition had when it was attached. A
        root published via itself is added to ``again`` where ``on_unfollowable = "resync"``;
        otherwise the refusal. Each new partition is read once (it is logged with the root's next
        window)."""
        from pg2delta.bootstrap import rows_before_attach

        for root, now in self._leaves.items():
            a = applied.get(root)
            if a is None or a.partitions is None or now is None or root in again:
                continue
            new = sorted(set(now.split(",")) - set(a.partitions.split(",")))
            holding = [name for leaf in new if (name := rows_before_attach(src.conn, int(leaf))) is not None]
            if not holding:
                continue
            name = f"{a.schema}.{a.table}"
            via_root = root in self._memberships
            if via_root and self.config.table(a.schema, a.table).on_unfollowable == "resync":
                log.warning(
                    "%s was attached to %s with rows in it; on_unfollowable = \"resync\": copying %s again",
                    ", ".join(holding), name, name,
                )
                again[root] = name
                continue
            what = f"{', '.join(holding)} {'was' if len(holding) == 1 else 'were'} attached to {name} with rows in it"
            if via_root:
                return SchemaError(
                    f"{what} since the lake's last window of it, and PostgreSQL does not send the rows a partition "
                    f"has when it is attached: copy it again with pg2delta resync --table {name} "
                    f"(or set on_unfollowable = \"resync\")"
                )
            return SchemaError(
                f"{what} since the lake's last window of it, and PostgreSQL does not send the rows a partition has "
                f"when it is attached; pg2delta does not copy partitions into their root's Delta table "
                f"(partitions = \"root\"): publish {name} with publish_via_partition_root = true and resync it, "
                f"or rewrite those rows after the attach (UPDATE … SET c = c) so that they are sent"
            )
        return None

    def _detached(self, src: SlotSource, applied: dict[int, Applied], again: dict[int, str]) -> SchemaError | None:
        """Partitions detached or dropped, since its last logged window or copy, from a partitioned
        table the lake writes as one Delta table: PostgreSQL sends nothing for their rows, so the
        lake still holds them. ``detached_partitions = "keep"`` keeps them; a root published via
        itself is added to ``again`` where ``on_unfollowable = "resync"``; otherwise the refusal."""
        from pg2delta.bootstrap import relation_name

        for root, now in self._leaves.items():
            a = applied.get(root)
            if a is None or a.partitions is None or now is None or root in again:
                continue
            gone = sorted(set(a.partitions.split(",")) - set(now.split(",")) - {""}, key=int)
            tc = self.config.table(a.schema, a.table)
            if not gone or tc.detached_partitions == "keep":
                continue
            names = [".".join(n) if (n := relation_name(src.conn, int(oid))) else f"a dropped partition (OID {oid})"
                     for oid in gone]
            name = f"{a.schema}.{a.table}"
            what = f"{', '.join(names)} left {name} (DETACH PARTITION or DROP) since the lake's last window of it"
            if root in self._memberships and tc.on_unfollowable == "resync":
                log.warning("%s; on_unfollowable = \"resync\": copying %s again", what, name)
                again[root] = name
                continue
            keep = f"or set [tables.\"{name}\"] detached_partitions = \"keep\" to keep its rows in the lake"
            if root in self._memberships:
                return SchemaError(
                    f"{what}, and PostgreSQL sends nothing for the rows that leave with it: copy it again with "
                    f"pg2delta resync --table {name} (or set on_unfollowable = \"resync\"), {keep}"
                )
            return SchemaError(
                f"{what}, and PostgreSQL sends nothing for the rows that leave with it; pg2delta does not copy "
                f"partitions into their root's Delta table (partitions = \"root\"): publish {name} with "
                f"publish_via_partition_root = true and resync it, {keep} (delete them there yourself if they should go)"
            )
        return None

    def _maintain_if_due(self, report: RunReport) -> None:
        """``[maintain] interval``: maintain the lake at the end of a run, under the run's lock."""
        from pg2delta.maintain import due, maintain_lake

        if due(self.config, self.lake):
            log.info("maintaining the lake ([maintain] interval = %s has passed)", self.config.maintain.interval)
            report.maintenance = maintain_lake(self.config, self.engine, self.lake)

    def _window(
        self,
        src: SlotSource,
        run_id: str,
        start: int,
        upper: int,
        applied: dict[int, Applied],
        catalog: PgTypeCatalog,
        key_resolver: Callable[[po.Relation], Sequence[str] | None],
    ) -> WindowReport:
        t0 = time.monotonic()
        spiller = Spiller(self.lake, run_id, self.config.window.memory_budget)
        try:
            return self._window_spilling(src, run_id, start, upper, applied, catalog, key_resolver, spiller, t0)
        finally:
            spiller.remove()

    def _window_spilling(
        self,
        src: SlotSource,
        run_id: str,
        start: int,
        upper: int,
        applied: dict[int, Applied],
        catalog: PgTypeCatalog,
        key_resolver: Callable[[po.Relation], Sequence[str] | None],
        spiller: Spiller,
        t0: float,
    ) -> WindowReport:
        rd = self._read(src, start, upper, catalog, key_resolver, spiller)
        end, tables, read, transactions = rd.end, rd.tables, rd.read, rd.transactions
        window = WindowReport(start, end, read.rows, read.bytes, transactions, spilled_rows=spiller.spilled_rows)
        fault_point("after_read")
        targets = self._targets(tables, applied)
        ordered = sorted(targets, key=lambda t: (t.schema, t.table))
        # Every table's shape is checked against its Delta table before anything is written, so a
        # change the lake cannot follow stops the run with nothing of the window applied.
        # (Reading each Delta table's schema costs a Spark job on a classic engine: concurrently too.)
        planned = self._map_tables(ordered, lambda t: self._plan_or_refusal(t, applied.get(t.owner), start, end))
        for tgt, p in zip(ordered, planned, strict=True):
            if isinstance(p, SchemaError):  # on_unfollowable = "resync": nothing written yet
                self._resync_in_run(src, tgt, p, applied)
        plans = {(t.schema, t.table): (None if isinstance(p, SchemaError) else p) for t, p in zip(ordered, planned, strict=True)}
        # The changelog next: a crash before the tables' MERGEs replays the window, and the
        # changelog takes only rows past its end (changelog.py).
        relations = sorted(tables.values(), key=lambda t: t.latest.qualified_name)
        changelog_log = self.changelog.append(
            self.engine, run_id, start, end, [(tw.latest, tw.batches, tw.truncates) for tw in relations]
        )
        fault_point("after_changelog")
        # The history next, before the tables' MERGEs: a replay takes only changes past its end (history.py).
        kept = [t for t in ordered if self.history.enabled(t.schema, t.table)]
        self._map_tables(kept, lambda t: self._write_history(run_id, t, plans[(t.schema, t.table)], applied.get(t.owner), end))
        fault_point("after_history")
        window.tables.extend(
            self._apply_tables(
                ordered,
                lambda tgt: self._apply_table(run_id, tgt, plans[(tgt.schema, tgt.table)], applied.get(tgt.owner), end),
            )
        )
        fault_point("after_commits")
        keys = {k: (p.key if p is not None else None) for k, p in plans.items()}
        applied_tables = [
            (tgt.owner, rep, keys[(tgt.schema, tgt.table)])
            for tgt, rep in zip(ordered, window.tables, strict=True)
            if not rep.skipped
        ]
        self.changelog.log(self.engine, changelog_log)
        if applied_tables:
            self._log_window(run_id, window, applied_tables, txn=self._txn(end))
        fault_point("before_advance")
        if end > start:
            src.advance(end)
        for tgt, table_report in zip(ordered, window.tables, strict=True):
            if not table_report.skipped:
                before = applied.get(tgt.owner)
                key = keys[(tgt.schema, tgt.table)]
                if key is None and before is not None:
                    key = before.key
                logged = self._attnums.get(tgt.owner)
                applied[tgt.owner] = Applied(
                    end, table_report.delta_version, tgt.schema, tgt.table, key,
                    publication=self._memberships.get(tgt.owner) or (before.publication if before else None),
                    partitions=self._leaves.get(tgt.owner) or (before.partitions if before else None),
                    attnums=json.loads(logged) if logged else (before.attnums if before else None),
                )
        window.seconds = time.monotonic() - t0
        log.info(
            "window %s..%s: %d rows, %d transactions, %d tables, %.2f s",
            format_lsn(start), format_lsn(end), read.rows, transactions, len(window.tables), window.seconds,
        )
        return window

    def _write_history(self, run_id: str, tgt: _Target, pl: Plan | None, applied: Applied | None, end: int) -> None:
        """The window's versions of ``tgt`` into its history (pg2delta.history), past the history's end.

        Unchanged TOAST is filled from every change of the window since the table's applied LSN (a
        replay that takes only the changes past the history's end still finds the values the changes
        before it sent), else from the table as the last logged window left it. A window spilled past
        ``window.memory_budget`` has its versions computed by the engine from staged files."""
        schema, name = tgt.schema, tgt.table
        applied_lsn = applied.end_lsn if applied else 0
        if not self.history.enabled(schema, name) or applied_lsn >= end or (applied is None and self._bootstrapped):
            return
        uri = self.history.uri(schema, name)
        high = self.history.high(self.engine, uri)
        since = applied_lsn if high is None else max(applied_lsn, high + 1)
        truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= since]
        key_names = list(pl.key) if pl is not None else []
        columns = [(n, t) for n, t in pl.columns if n not in META_NAMES] if pl is not None else []
        nullable_keys = bool(self.config.table(schema, name).key) or any(
            bool(self.config.table(*tw.latest.qualified_name).key) for tw in tgt.parts
        )
        fresh = high is None or high < applied_lsn  # nothing of this window in the history yet
        fill = pa.table({c: pa.repeat(v, 1) for c, v in pl.fills}) if pl is not None and pl.fill_table and pl.fills else None
        fill = fill if fresh else None
        table_uri = self.lake.table_uri(schema, name)
        lookup_version = applied.delta_version if applied else None
        if pl is not None and any(b.spilled for tw in tgt.parts for b in tw.batches):
            staging = f"{run_id}/{schema}.{name}.history.{uuid.uuid4().hex[:8]}"
            try:
                staged, kept = self._stage_changes(tgt, pl, applied_lsn, staging, whole=True)
                if staged.rows and staged.uri is not None:
                    window = StagedWindow(
                        staged.uri, staged.rows, since,
                        tuple(t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn),
                        staged.toast_columns, table_uri,
                        lookup_version, frozenset(kept),
                    )
                    self.history.write_staged(
                        self.engine, uri, run_id, window, key_names, columns, nullable_keys=nullable_keys, fill=fill
                    )
                    return
            finally:
                self.lake.unstage_dir(staging)
            changes: pa.Table | None = None
        else:
            changes, kept = conform(_live(tgt, applied_lsn), pl) if pl is not None else (None, set())
        if changes is not None:
            changes = changes.filter(pc.and_(
                pc.not_equal(changes.column(OP_COL), BEFORE_OP), pc.greater_equal(changes.column(LSN_COL), applied_lsn)
            ))
            if changes.num_rows and key_names:
                changes = self._fill_lookups(
                    table_uri, fill_toast_in_order(changes, key_names), key_names, lookup_version,
                    nullable_keys=nullable_keys, optional=kept,
                )
            changes = changes.filter(pc.greater_equal(changes.column(LSN_COL), since))
        versions = window_versions(changes, truncates, key_names, [n for n, _ in columns])
        self.history.write(self.engine, uri, run_id, versions, key_names, columns, nullable_keys=nullable_keys, fill=fill)

    def _read(
        self,
        src: SlotSource,
        start: int,
        upper: int,
        catalog: PgTypeCatalog,
        key_resolver: Callable[[po.Relation], Sequence[str] | None],
        spiller: Spiller,
    ) -> _Read:
        """Peek one window from ``src`` (capped like every window, then cut at a table's shape change)
        and decode it per relation: the part of a window the run and ``pg2delta plan`` share.
        Past the memory budget the decoded batches go to ``spiller``'s files."""
        cfg = self.config
        # Old rows of updates are kept (as 'B' rows) only for changelogs; the apply drops them.
        keep_old = cfg.changelog or any(t.changelog for t in cfg.tables.values())
        decoder = WindowDecoder(catalog, key_resolver, keep_old=keep_old, split_rows=cfg.window.split_rows)
        tables: dict[int, _TableWindow] = {}
        progress, base = self._progress, self._progress_start
        if progress is None:
            progress, base = _run_progress(start, upper, bar=False), start
        rows_before = progress.rows
        rows_read = 0
        read: WindowRead | None = None
        transactions = 0
        notes: dict[str, int] = defaultdict(int)

        def take(decoded: DecodedChunk) -> None:
            nonlocal transactions
            transactions += decoded.transactions
            for name, count in decoded.notes.items():
                notes[name] += count
            for batch in decoded.changes:
                tables.setdefault(batch.relation.oid, _TableWindow(batch.relation.oid)).batches.append(batch)
                spiller.add(batch)
            for trunc in decoded.truncates:
                for version in trunc.relations:
                    tables.setdefault(version.oid, _TableWindow(version.oid)).truncates.append(trunc)
            if decoded.retracted is not None:
                # A transaction given out in parts that did not commit in the window (it is the last).
                for tw in tables.values():
                    tw.cut(decoded.retracted)
            if spiller.over():
                spiller.spill(tw.batches for tw in tables.values())
                fault_point("after_spill")

        for item in src.read_window(upper, max_changes=cfg.window.max_changes, max_bytes=cfg.window.max_bytes):
            if isinstance(item, WindowRead):
                read = item
                continue
            take(decoder.feed(item))
            if len(item):
                rows_read += len(item)
                progress.move_to(int(item.lsns[-1]) - base, rows=rows_before + rows_read)
        take(decoder.finish())
        assert read is not None
        for name, count in sorted(notes.items()):
            log.warning("window note: %s = %d", name, count)
        end = (read.last_commit_end_lsn or start) if read.capped else upper
        cut = shape_cut([tw.batches for tw in tables.values()], [t.commit_lsn for tw in tables.values() for t in tw.truncates])
        if cut is not None and start < cut < end:
            # A table changes shape after the window's first transaction: end the window at that
            # transaction's commit (the slot then stands just before it), so each window merges
            # every table in one shape, on one key.
            log.info("a table changes shape at %s: the window ends there", format_lsn(cut))
            end = cut
            for tw in tables.values():
                tw.cut(cut)
            tables = {oid: tw for oid, tw in tables.items() if tw.batches or tw.truncates}
        return _Read(end, tables, read, transactions, read.capped and end != upper, cut is not None and start < cut == end)

    def _apply_tables(self, targets: Sequence[_Target], apply: Callable[[_Target], TableReport]) -> list[TableReport]:
        """``apply`` every target, up to ``window.parallel_tables`` at once; reports in ``targets``' order.

        The tables of one window are independent (each its own Delta table and commit), so Spark
        runs their MERGEs as concurrent jobs. The first failure stops tables not yet started and is
        raised once the running ones have finished: nothing is logged and the slot stays put, so
        the next run applies the window again (tables that did commit are recognised, see ``_txn``).
        """
        workers = min(self.config.window.parallel_tables, len(targets))
        if workers <= 1:
            reports = []
            for n, tgt in enumerate(targets):
                if n > 0:
                    fault_point("between_tables")
                reports.append(apply(tgt))
            return reports
        with ThreadPoolExecutor(workers, thread_name_prefix="pg2delta-apply") as pool:
            futures: list[Future[TableReport]] = [pool.submit(apply, tgt) for tgt in targets]
            pending: set[Future[TableReport]] = set(futures)
            first = True
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                if any(f.exception() is not None for f in done):
                    for f in pending:
                        f.cancel()
                    wait(pending)
                    break
                if first and pending:
                    first = False
                    fault_point("between_tables")  # some tables committed, others not yet
            for f in futures:  # the first failure in the targets' order
                if f.done() and not f.cancelled() and f.exception() is not None:
                    raise f.exception()  # type: ignore[misc]
            return [f.result() for f in futures]

    def _map_tables(self, targets: Sequence[_Target], fn: Callable[[_Target], Any]) -> list[Any]:
        """``fn`` of every target, up to ``window.parallel_tables`` at once, in ``targets``' order;
        the first failure in that order is raised once all have finished (the plans, which write
        nothing, and the histories, each idempotent on its own)."""
        workers = min(self.config.window.parallel_tables, len(targets))
        if workers <= 1:
            return [fn(t) for t in targets]
        with ThreadPoolExecutor(workers, thread_name_prefix="pg2delta-plan") as pool:
            futures = [pool.submit(fn, t) for t in targets]
            wait(futures)
        return [f.result() for f in futures]

    def _plan_or_refusal(self, tgt: _Target, applied: Applied | None, start: int, end: int) -> Plan | SchemaError | None:
        """:meth:`_plan`, or the refusal itself for a table whose config says ``on_unfollowable = "resync"``."""
        try:
            return self._plan(tgt, applied, start, end)
        except SchemaError as exc:
            names = {(tgt.schema, tgt.table), *(tw.latest.qualified_name for tw in tgt.parts)}
            if any(self.config.table(*n).on_unfollowable == "resync" for n in names):
                return exc
            raise

    def _resync_in_run(self, src: SlotSource, tgt: _Target, refusal: SchemaError, applied: dict[int, Applied]) -> None:
        """Copy ``tgt`` again at a new snapshot (``pg2delta resync``) instead of stopping on ``refusal``.

        The copy's snapshot is after this window's end (it is taken now, the window ended at the
        server's WAL when the run started), so the table's changes in this window and up to the
        copy are skipped by the applied-LSN rule, and the run goes on with the other tables.
        """
        from pg2delta.bootstrap import DEFAULT_PARALLEL, copy_at_new_snapshot

        if any(tw.oid != tgt.owner for tw in tgt.parts):  # partitions written into their root's table
            raise refusal
        log.warning(
            "%s.%s cannot follow by changes alone (%s); on_unfollowable = \"resync\": copying it again",
            tgt.schema, tgt.table, refusal,
        )
        copied = copy_at_new_snapshot(self, src, {tgt.owner}, parallel=DEFAULT_PARALLEL)
        if not any(c.relation_oid == tgt.owner for c in copied):  # not published any more: nothing to copy it from
            raise refusal
        applied.update(self._applied_lsns())

    def _txn(self, version: int) -> Txn | None:
        """Delta's idempotent-write id of a commit (the engine uses it where Delta has it): a table's
        MERGE carries the commit LSN of its newest change in the window, the applied log's append
        the window's end. Versions only grow from window to window, so a replayed window's MERGE
        into a table that committed it before a crash is skipped by Delta itself (no second
        commit), and the applied-log rule stays the guarantee on every engine."""
        return Txn(self._app_id, version) if self._app_id else None

    # --- which Delta table, in which shape ---------------------------------------------------

    def _partition_root(self, oid: int) -> tuple[int, str, str] | None:
        """The top partitioned table ``oid`` belongs to, when its config asks for ``partitions = "root"``."""
        if oid not in self._roots:
            self._roots[oid] = None
            if any(t.partitions == "root" for t in self.config.tables.values()) and self._catalog_conn is not None:
                row = self._catalog_conn.execute(
                    "SELECT r.oid::int8, n.nspname, r.relname FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace "
                    "WHERE r.oid = pg_partition_root(%s::oid) AND r.oid <> %s::oid",
                    (oid, oid),
                ).fetchone()
                if row is not None and self.config.table(str(row[1]), str(row[2])).partitions == "root":
                    self._roots[oid] = (int(row[0]), str(row[1]), str(row[2]))
        return self._roots[oid]

    def _targets(self, tables: dict[int, _TableWindow], applied: dict[int, Applied]) -> list[_Target]:
        """Group the window's relations by the Delta table their changes go to.

        A relation's Delta table is named after it the first time pg2delta writes it and stays the
        same for its OID afterwards (the applied log records it): a table renamed or moved to another
        schema keeps its Delta table. Partitions of a table configured with ``partitions = "root"`` go
        to the root's Delta table. A Delta table already written for another relation OID (a table
        dropped and created again under the same name) is refused rather than mixed.
        """
        owners = {(a.schema, a.table): oid for oid, a in applied.items() if a.table}
        out: dict[tuple[str, str], _Target] = {}
        for oid, tw in tables.items():
            owner = oid
            schema, name = tw.latest.qualified_name
            root = self._partition_root(oid)
            if root is not None:
                owner, schema, name = root
            known = applied.get(owner)
            if known is not None and known.table:
                if (known.schema, known.table) != (schema, name):
                    log.info("%s.%s (relation %d) keeps its Delta table %s.%s", schema, name, owner, known.schema, known.table)
                schema, name = known.schema, known.table
            elif owners.get((schema, name), owner) != owner:
                raise SchemaError(
                    f"the Delta table {self.lake.table_uri(schema, name)} holds relation OID {owners[(schema, name)]}, "
                    f"but {schema}.{name} is now relation OID {owner} (was the table dropped and created again, or "
                    "renamed and another created under its name?): move or delete that Delta table (and its rows in "
                    f"{self.lake.table_uri(LOG_TABLE)}), or name the new table differently, then run again"
                )
            tgt = out.setdefault((schema, name), _Target(owner, schema, name))
            if tgt.owner != owner:
                raise SchemaError(f"relations {tgt.owner} and {owner} both map to the Delta table {schema}.{name}")
            tgt.parts.append(tw)
        return list(out.values())

    def _check_partition_truncates(self, tgt: _Target) -> None:
        """A TRUNCATE of some partitions of a root that maps them into one Delta table is refused:
        which of its rows were in those partitions is not known. TRUNCATE of the root (every leaf) is fine."""
        if all(tw.oid == tgt.owner for tw in tgt.parts) or not any(tw.truncates for tw in tgt.parts):
            return
        leaves = {
            int(r[0])
            for r in self._catalog_conn.execute(
                "SELECT relid::oid::int8 FROM pg_partition_tree(%s::oid::regclass) WHERE isleaf", (tgt.owner,)
            ).fetchall()
        }
        for tw in tgt.parts:
            for t in tw.truncates:
                truncated = {v.oid for v in t.relations}
                if not leaves <= truncated:
                    raise SchemaError(
                        f"TRUNCATE of partition(s) {', '.join('.'.join(v.qualified_name) for v in t.relations)} at "
                        f"{format_lsn(t.commit_lsn)}, whose changes go to the Delta table of {tgt.schema}.{tgt.table} "
                        "(partitions = \"root\"): pg2delta cannot tell which rows of that Delta table were in them; "
                        "delete those rows in the lake yourself and move the slot past that transaction, or use "
                        "partitions = \"leaf\" for this table"
                    )

    def _check_full_identity_key(self, tgt: _Target, key: tuple[str, ...], applied: Applied | None) -> None:
        """REPLICA IDENTITY FULL tables are keyed on the primary key the catalog has *now*; if that is
        not the key the lake was last merged on, the pending changes may predate the change of key."""
        if applied is None or applied.key is None or applied.key == key:
            return
        full = [tw for tw in tgt.parts if any(b.relation.relation.replica_identity == "f" for b in tw.batches)]
        configured = any(self.config.table(*tw.latest.qualified_name).key for tw in tgt.parts)
        if not full or configured:
            return
        name = ".".join(full[0].latest.qualified_name)
        raise SchemaError(
            f"table {name} has REPLICA IDENTITY FULL and its primary key is now ({', '.join(key) or 'none'}), but "
            f"the lake was last merged on ({', '.join(applied.key) or 'none'}): the changes waiting in the slot may "
            "have been made under the old key, and PostgreSQL does not say which. Set [tables.\""
            f"{name}\"] key = [...] to the key they were made under (the old one if the key changed after them, "
            "running up to the change with --until-lsn), run, then remove the setting; nothing of this window was applied"
        )

    def _plan(self, tgt: _Target, applied: Applied | None, start: int, end: int) -> Plan | None:
        """How the Delta table must change for the window's changes (None when it has none to merge)."""
        if applied is not None and applied.end_lsn >= end:
            return None
        self._check_partition_truncates(tgt)
        shapes: list[Shape] = []
        for batches in _live(tgt, applied.end_lsn if applied is not None else 0):
            for b in batches:
                shape = shape_of(b.relation)
                if not shapes or shapes[-1].signature() != shape.signature():
                    shapes.append(shape)
        if not shapes:
            return None
        self._check_full_identity_key(tgt, shapes[0].key, applied)
        uri = self.lake.table_uri(tgt.schema, tgt.table)
        where = f" (in the changes from {format_lsn(start)} to {format_lsn(end)})"
        # The table as the last logged window left it: a replay after a crash plans the same
        # changes the crashed run did (they are idempotent), whatever of them it committed.
        planned = self.planned_types
        pl = plan(
            f"{tgt.schema}.{tgt.table}",
            planned[uri] if planned is not None and uri in planned
            else self.engine.table_types(uri, version=applied.delta_version if applied else None),
            shapes,
            where=where,
            narrowing=self.config.table(tgt.schema, tgt.table).narrowing,
            pg_type=lambda shape, column: self._pg_type(tgt, shape, column),
        )
        self._check_column_identity(tgt, pl, applied, uri, where)
        return self._added_column_values(tgt, pl, applied, uri, where)

    def _check_column_identity(self, tgt: _Target, pl: Plan, applied: Applied | None, uri: str, where: str) -> None:
        """Refuse columns pgoutput shows as new or unchanged that are neither (it names columns only by
        name, so a rename looks like a drop and an add, and a column dropped and added again under its
        old name looks unchanged); records the columns' ``attnum`` for the window's log row.

        ``pg_attribute.attnum`` tells them apart: ``ADD COLUMN`` takes a number above every column the
        table ever had, a rename keeps the number. Against the numbers logged with the table's last
        window, a column new to the Delta table whose number is not above them all was there before
        under another name (or outside the publication's column list): PostgreSQL holds values for
        the rows the lake has that it never sent. A Delta column whose name has a new number was
        dropped and added again: the lake's rows hold the old column's values. Either is refused
        (exit 78, or ``on_unfollowable = "resync"``). Tables written from several partitions, whose
        numbers differ, are not checked."""
        catalog = self._catalog
        if catalog is None or len(tgt.parts) != 1 or tgt.parts[0].oid != tgt.owner:
            return
        now = catalog.attnums(tgt.owner)
        before = applied.attnums if applied is not None else None
        lake_columns = set(pl.existing) | {n for n, _ in pl.columns}
        record = {n: now[n] for n in lake_columns if n in now}
        if before:  # columns gone from the table keep their number while the Delta table keeps them
            record.update({n: k for n, k in before.items() if n in lake_columns and n not in now})
        self._attnums[tgt.owner] = json.dumps(record, sort_keys=True)
        if not before:
            return
        highest = max(before.values())
        source = self._source_name(tgt)
        name = f"{tgt.schema}.{tgt.table}"
        for c, _ in pl.columns:
            if c not in now:
                continue
            if c not in pl.existing and now[c] <= highest and self._rows_before(tgt, pl, applied, uri, c):
                raise SchemaError(
                    f"column {c} of {source} is new to the lake but not to PostgreSQL (attnum {now[c]}: renamed "
                    f"from a column the lake has, or added to the publication's column list){where}: PostgreSQL "
                    f"holds values of it for rows it never sent again; copy the table again with pg2delta resync "
                    f"--table {name} (or set on_unfollowable = \"resync\"); nothing of this window was applied"
                )
            if c in pl.existing and c in before and before[c] != now[c]:
                raise SchemaError(
                    f"column {c} of {source} was dropped and added again since the lake's last window of it "
                    f"(attnum {before[c]} then, {now[c]} now){where}: the lake's rows hold the old column's values; "
                    f"copy the table again with pg2delta resync --table {name} (or set on_unfollowable = "
                    f"\"resync\"); nothing of this window was applied"
                )

    def _rows_before(self, tgt: _Target, pl: Plan, applied: Applied | None, uri: str, column: str) -> bool:
        """Whether rows need a value of ``column`` that PostgreSQL did not send: rows of the Delta table
        as the last logged window left it, or rows of the window sent in a shape without it."""
        applied_lsn = applied.end_lsn if applied is not None else 0
        for tw in tgt.parts:
            for b in tw.batches:
                if column not in b.relation.column_names and b.num_rows and b.max_lsn >= applied_lsn:
                    return True
        return bool(pl.existing) and self.engine.has_rows(
            uri, version=applied.delta_version if applied is not None else None
        )

    def _added_column_values(self, tgt: _Target, pl: Plan, applied: Applied | None, uri: str, where: str) -> Plan:
        """The value the rows written before an ``ADD COLUMN`` hold in PostgreSQL, for the columns the
        window adds to the Delta table (or adds inside its first transaction, after rows of it).

        PostgreSQL sends nothing for those rows. Which rows need a value: every row of the Delta table as
        the last logged window left it (unless the window truncates the table), and the rows the window
        itself sent in a shape from before the column was added. For them, the catalog *as it is now*
        (``pg_attribute`` of the table, or of each leaf partition of a partitioned one) decides:

        * ``atthasmissing``: the column was added with a non-volatile default (a constant, ``now()``,
          a domain's default ...) and PostgreSQL reads ``attmissingval`` for every row written before.
          That value, converted by the column's codec from its text form, is set on every row of the
          Delta table (one rewrite before the window's MERGE, see :meth:`Engine.rewrite`) and given to
          the window's rows sent before the column (:func:`~pg2delta.schema.conform`).
        * no ``atthasmissing`` and no default of any kind (no ``pg_attrdef`` row, not generated, not
          an identity, no type default): the column was added without a default, those rows read
          NULL in PostgreSQL too. Nothing to do (as before).
        * no ``atthasmissing`` but some default: PostgreSQL computed the rows' values and wrote them
          in a rewrite that logical decoding does not send (a volatile default such as
          ``clock_timestamp()`` or ``gen_random_uuid()``, an identity, a ``STORED`` generated column,
          a domain default with constraints), or a rewrite since the column was added (``VACUUM
          FULL``, ``CLUSTER``, ``ALTER … TYPE``) cleared ``attmissingval``. The values are not known
          here: refused (:class:`SchemaError`, exit 78, nothing of the window applied) asking for
          ``pg2delta resync --table s.t``. Only when rows need a value: a table that was empty in
          the lake and got no rows before the column in the window goes on.
        * partitions that disagree (different missing values, or some without one) are refused the
          same way: the Delta table mixes their rows.
        * a column the table no longer has under that name (dropped or renamed since): not knowable
          either, but nothing is lost that PostgreSQL still shows; logged, NULL as before.

        The catalog can only show the present, so some cases look alike and are refused although the
        rows do read NULL in PostgreSQL: a column added without a default and given one later
        (``ADD COLUMN c int, ALTER c SET DEFAULT 5``), or a default that evaluates to NULL. A column
        that is new to the lake without being new in PostgreSQL (renamed, or added to the
        publication's column list) was refused before this, by :meth:`_check_column_identity`.
        """
        catalog = self._catalog
        if catalog is None or (applied is None and self._bootstrapped):
            return pl  # not a run, or a table the run skips (not copied yet)
        # The Delta table as the last logged window left it (a table a crashed run created is new).
        before = pl.existing if applied is not None else frozenset()
        candidates = [n for n, _ in pl.columns if n not in before]
        if not candidates:
            return pl
        applied_lsn = applied.end_lsn if applied is not None else 0
        truncates = [(t.commit_lsn, t.pos) for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
        last_truncate = max(truncates) if truncates else None
        early: dict[str, int] = defaultdict(int)  # rows of the window sent before the column appeared
        codecs: dict[str, ColumnCodec] = {}
        for tw in tgt.parts:
            appeared: set[str] = set()
            for b in tw.batches:
                names = b.relation.column_names
                for c in candidates:
                    if c in names:
                        codecs.setdefault(c, b.relation.codecs[names.index(c)])
                lacking = [c for c in candidates if c not in names and c not in appeared]
                if lacking:
                    rows = _rows_written(b.load(), applied_lsn, last_truncate)
                    for c in lacking:
                        early[c] += rows
                appeared.update(names)
        lake_rows = bool(before) and last_truncate is None and self.engine.has_rows(
            uri, version=applied.delta_version if applied is not None else None
        )
        needed = [c for c in candidates if lake_rows or early[c]]
        if not needed:
            return pl
        found = catalog.added_columns(tgt.owner, needed)
        source = self._source_name(tgt)
        types = dict(pl.columns)
        fills: list[tuple[str, pa.Scalar]] = []
        for c in needed:
            entries = found.get(c, [])
            if not entries:
                log.warning(
                    "column %s of %s is no longer in the source table (dropped or renamed since): pg2delta cannot "
                    "tell the value rows written before it was added had there; they hold NULL in the lake", c, source,
                )
                continue
            if all(e.missing is None and not e.has_default for e in entries):
                continue  # added without a default: NULL, as PostgreSQL reads those rows
            missing = {e.missing for e in entries}
            if len(missing) != 1 or None in missing:
                raise SchemaError(_unknown_values_message(c, source, entries, where))
            fills.append((c, self._missing_value(source, c, entries[0], codecs[c], types[c])))
            log.info(
                "column %s of %s was added with a default: the rows written before hold PostgreSQL's "
                "attmissingval (%s in the lake, %d in this window)",
                c, source, "every row" if lake_rows else "none", early[c],
            )
        if not fills:
            return pl
        return dataclasses.replace(pl, fills=tuple(fills), fill_table=lake_rows)

    @staticmethod
    def _missing_value(
        source: str, column: str, entry: AddedColumn, codec: ColumnCodec, arrow_type: pa.DataType
    ) -> pa.Scalar:
        """``attmissingval`` of ``column`` as the decoder would give its text form, in the plan's type."""
        assert entry.missing is not None
        notes: collections.Counter[str] = collections.Counter()
        try:
            value = value_of_text_array(codec, entry.missing, delim=entry.delim, notes=notes)
            value = value.cast(arrow_type)
        except (DecodeError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise DataError(
                f"cannot convert the default of column {column} of {source} (pg_attribute.attmissingval, "
                f"{codec.pg_type}) to {arrow_type}: {exc}"
            ) from exc
        for name, count in sorted(notes.items()):
            log.warning("window note: %s = %d (the default of column %s of %s)", name, count, column, source)
        return value

    def _source_name(self, tgt: _Target) -> str:
        """The source table whose rows ``tgt``'s Delta table holds, as PostgreSQL names it now."""
        for tw in tgt.parts:
            if tw.oid == tgt.owner:
                return ".".join(tw.latest.qualified_name)
        root = self._partition_root(tgt.parts[0].oid) if tgt.parts else None
        return f"{root[1]}.{root[2]}" if root is not None else f"{tgt.schema}.{tgt.table}"

    def _pg_type(self, tgt: _Target, shape: Shape, column: str) -> str | None:
        """The PostgreSQL type of ``column`` as a Relation message of ``tgt`` in ``shape`` declared it."""
        if self._catalog_conn is None:
            return None
        for tw in tgt.parts:
            for b in tw.batches:
                if shape_of(b.relation).signature() == shape.signature():
                    for c in b.relation.relation.columns:
                        if c.name == column:
                            row = self._catalog_conn.execute(
                                "SELECT format_type(%s::oid, %s)", (c.type_oid, c.type_modifier)
                            ).fetchone()
                            return None if row is None else str(row[0])
        return None

    # --- one table ----------------------------------------------------------------------------

    @staticmethod
    def _table_changes(
        tgt: _Target, pl: Plan | None, applied_lsn: int
    ) -> tuple[pa.Table | None, list[TruncateEvent], set[str]]:
        """The window's changes of ``tgt`` to merge (in the plan's shape, after its applied LSN and its
        last truncate), its truncates, and the columns kept by updates (see :func:`conform`)."""
        truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
        changes, kept_by_update = conform(_live(tgt, applied_lsn), pl) if pl is not None else (None, set())
        if changes is not None and applied_lsn:
            changes = changes.filter(pc.greater_equal(changes.column(LSN_COL), applied_lsn))
        if truncates and changes is not None:
            last = max(truncates, key=lambda t: (t.commit_lsn, t.pos))
            lsn, pos = changes.column(LSN_COL), changes.column(POS_COL)
            after = pc.or_(
                pc.greater(lsn, last.commit_lsn),
                pc.and_(pc.equal(lsn, last.commit_lsn), pc.greater(pos, last.pos)),
            )
            changes = changes.filter(after)
        return changes, truncates, kept_by_update

    def _stage_changes(
        self, tgt: _Target, pl: Plan, applied_lsn: int, name: str | None, *, whole: bool = False
    ) -> tuple[StagedChanges, set[str]]:
        """:meth:`_table_changes` for a window with spilled batches: conformed and filtered batch by
        batch into Parquet files under the staging area's ``name`` (None: only counted, for
        ``pg2delta plan``), never gathered on the driver. Returns them and the columns kept by updates.
        ``whole``: the changes before the window's last truncate too (for the history)."""
        truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
        last = max(truncates, key=lambda t: (t.commit_lsn, t.pos)) if truncates and not whole else None
        kept_by_update: set[str] = set()
        staged = StagedChanges(name, self.lake.staging_uri(name) if name is not None else None)
        toast: set[str] = set()
        for t in conform_batches(_live(tgt, applied_lsn), pl, kept_by_update):
            lsn, pos = t.column(LSN_COL), t.column(POS_COL)
            keep = pc.and_(pc.not_equal(t.column(OP_COL), BEFORE_OP), pc.greater_equal(lsn, applied_lsn))
            if last is not None:
                keep = pc.and_(keep, pc.or_(
                    pc.greater(lsn, last.commit_lsn), pc.and_(pc.equal(lsn, last.commit_lsn), pc.greater(pos, last.pos))
                ))
            t = t.filter(keep)
            if not t.num_rows:
                continue
            for c in pc.value_counts(t.column(OP_COL)).to_pylist():
                staged.ops[c["values"]] += c["counts"]
            marks = pc.list_flatten(t.column(TOAST_COL))
            if len(marks):
                toast.update(x for x in pc.unique(marks).to_pylist() if x is not None)
            if name is not None:
                self.lake.stage(t, f"{name}/part-{staged.files:06d}")
                staged.files += 1
            staged.rows += t.num_rows
        staged.toast_columns = tuple(sorted(toast))
        return staged, kept_by_update

    def _apply_table(
        self, run_id: str, tgt: _Target, pl: Plan | None, applied: Applied | None, window_end: int
    ) -> TableReport:
        applied_lsn = applied.end_lsn if applied else 0
        schema, name = tgt.schema, tgt.table
        uri = self.lake.table_uri(schema, name)
        report = TableReport(schema, name, uri)
        if applied_lsn >= window_end:
            report.skipped = True
            return report
        if applied is None and self._bootstrapped:
            # Added to the publication after this run started: the next run copies it at a later snapshot.
            log.info("skipped %s.%s: not copied yet, the next run copies it", schema, name)
            report.skipped = True
            return report
        changes: pa.Table | StagedChanges | None
        if pl is not None and any(b.spilled for tw in tgt.parts for b in tw.batches):
            truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
            changes, kept_by_update = self._stage_changes(tgt, pl, applied_lsn, f"{run_id}/{schema}.{name}.{uuid.uuid4().hex[:8]}")
        else:
            changes, truncates, kept_by_update = self._table_changes(tgt, pl, applied_lsn)
        report.truncated = bool(truncates)
        # The table's newest change in the window is its commit's idempotent-write version: a
        # replay of the window holds the same changes (or more, then a higher version) for it.
        newest = max(
            [t.commit_lsn for t in truncates]
            + [b.max_lsn for tw in tgt.parts for b in tw.batches if b.num_rows]
            or [window_end]
        )
        txn = self._txn(newest)
        report.commit_ts = _newest_commit_ts(tgt, truncates, applied_lsn)
        if pl is None:  # no changes to merge, perhaps a truncate
            self.merge_changes(report, run_id, None, [], [], nullable_keys=False, lookup_version=None, txn=txn)
            return report
        nullable_keys = bool(self.config.table(schema, name).key) or any(
            bool(self.config.table(*tw.latest.qualified_name).key) for tw in tgt.parts
        )  # primary keys and identity indexes are NOT NULL
        drop = pl.kept if self.config.table(schema, name).dropped_columns == "drop" else ()
        # Rows already in the table get the value PostgreSQL reads for columns added with a default.
        fill = pa.table({c: pa.repeat(v, 1) for c, v in pl.fills}) if pl.fill_table and pl.fills else None
        if fill is not None:
            # A replay sets the default in every row again, also in rows a crashed run's MERGEs
            # wrote: those MERGEs (this window's and the later ones of this run) must then run
            # again rather than be recognised as done.
            self._rewritten.add(tgt.owner)
        if tgt.owner in self._rewritten:
            txn = None

        def reshape() -> frozenset[str] | None:
            if pl.widened or drop or fill is not None:
                # One commit, before the MERGE: rows the window writes get their own values from it.
                self.engine.rewrite(uri, {c: new for c, _, new in pl.widened}, drop=drop, fill=fill)
            if not pl.existing:
                return None
            return (pl.existing - set(drop)) | frozenset(fill.column_names if fill is not None else ())

        def reshaped() -> None:
            fault_point("after_schema_change")

        self.merge_changes(
            report, run_id, changes, list(pl.key), [n for n, _ in pl.columns],
            nullable_keys=nullable_keys, lookup_version=applied.delta_version if applied else None,
            optional=kept_by_update, reshape=reshape, reshaped=reshaped, txn=txn,
        )
        return report

    def merge_changes(
        self,
        report: TableReport,
        run_id: str,
        changes: pa.Table | StagedChanges | None,
        key_names: list[str],
        data_columns: Sequence[str],
        *,
        nullable_keys: bool,
        lookup_version: int | None,
        optional: set[str] | None = None,
        reshape: Callable[[], frozenset[str] | None] | None = None,
        reshaped: Callable[[], None] | None = None,
        txn: Txn | None = None,
    ) -> None:
        """Reduce ``changes`` (commit order, after the last truncate) and MERGE them into ``report.path``.

        ``data_columns`` may name meta columns (they are left out). ``report.truncated`` adds the
        truncate (alone when there are no changes); unchanged TOAST the changes cannot fill is read
        from the table at ``lookup_version``. ``reshape`` (after those reads, before anything is
        written) changes the Delta table's shape and returns the columns it then has;
        ``reshaped`` runs once the table has every column of the MERGE. ``txn``: Delta's
        idempotent-write id of the commit. Shared by the run and by ``pg2delta backfill``.
        """
        schema, name, uri = report.schema, report.table, report.path
        if isinstance(changes, StagedChanges):
            try:
                self._merge_staged(
                    report, changes, key_names, data_columns, nullable_keys=nullable_keys,
                    lookup_version=lookup_version, optional=optional, reshape=reshape, reshaped=reshaped, txn=txn,
                )
            finally:
                if changes.name is not None:
                    self.lake.unstage_dir(changes.name)
            return
        reducing = self.reduce(schema, name, changes, key_names, data_columns)
        if reducing is None:
            if report.truncated and self.lake.delta_version(uri) is not None:
                self.engine.delete_all(uri, txn=txn)
                report.delta_version = self.lake.delta_version(uri)
            return
        reduced, key_names, data_columns = reducing
        # Unchanged TOAST comes from the table as the last logged window left it: a replay after a
        # crash between tables must not see what the crashed run already merged.
        source = self._fill_lookups(
            uri, reduced, key_names, lookup_version, nullable_keys=nullable_keys, optional=optional
        )
        report.inserts, report.updates, report.deletes = reduced.inserts, reduced.updates, reduced.deletes
        report.rows_merged = source.num_rows
        existing = reshape() if reshape is not None else None
        staged = self.lake.stage(source.select([*data_columns, OP_COL]), f"{run_id}/{schema}.{name}.{uuid.uuid4().hex[:8]}")
        try:
            self.engine.ensure_table(uri, staged, data_columns, existing)
            if reshaped is not None:
                reshaped()
            self.engine.merge(
                uri,
                staged,
                lambda target, view: merge_statement(
                    target, view, key_names, data_columns, truncate=report.truncated, nullable_keys=nullable_keys
                ),
                txn=txn,
            )
        finally:
            self.lake.unstage(staged)
        report.delta_version = self.lake.delta_version(uri)
        log.info(
            "applied %s.%s: %d inserts, %d updates, %d deletes%s -> delta version %s",
            schema, name, report.inserts, report.updates, report.deletes,
            ", truncated" if report.truncated else "", report.delta_version,
        )

    def _merge_staged(
        self,
        report: TableReport,
        staged: StagedChanges,
        key_names: list[str],
        data_columns: Sequence[str],
        *,
        nullable_keys: bool,
        lookup_version: int | None,
        optional: set[str] | None,
        reshape: Callable[[], frozenset[str] | None] | None,
        reshaped: Callable[[], None] | None,
        txn: Txn | None,
    ) -> None:
        """:meth:`merge_changes` of staged changes: reduced and merged by the engine (pg2delta.spill)."""
        schema, name, uri = report.schema, report.table, report.path
        if staged.rows == 0 or staged.uri is None or staged.name is None:
            if report.truncated and self.lake.delta_version(uri) is not None:
                self.engine.delete_all(uri, txn=txn)
                report.delta_version = self.lake.delta_version(uri)
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
        report.inserts, report.updates, report.deletes = staged.ops["I"], staged.ops["U"], staged.ops["D"]
        existing = reshape() if reshape is not None else None
        self.engine.ensure_table(uri, staged.uri, data_columns, existing)
        if reshaped is not None:
            reshaped()
        truncate = report.truncated
        report.rows_merged = self.engine.merge_reduced(
            uri,
            staged.uri,
            lambda target, view: merge_statement(
                target, view, key_names, data_columns, truncate=truncate, nullable_keys=nullable_keys
            ),
            work=f"{staged.name}-reduce",
            key_names=key_names,
            data_columns=data_columns,
            toast_columns=staged.toast_columns,
            lookup_version=lookup_version,
            nullable_keys=nullable_keys,
            optional=optional or (),
            txn=txn,
        )
        report.delta_version = self.lake.delta_version(uri)
        log.info(
            "applied %s.%s (reduced by the engine, %d changes in %d staged files): %d inserts, %d updates, "
            "%d deletes%s -> delta version %s",
            schema, name, staged.rows, staged.files, report.inserts, report.updates, report.deletes,
            ", truncated" if report.truncated else "", report.delta_version,
        )

    @staticmethod
    def reduce(
        schema: str, name: str, changes: pa.Table | None, key_names: list[str], data_columns: Sequence[str]
    ) -> tuple[Reduced, list[str], list[str]] | None:
        """``changes`` reduced to one final state per key, with the key and data columns the MERGE
        uses (a table without a key is keyed by commit position); None when there is nothing to merge.
        What the run merges and what ``pg2delta plan`` counts."""
        if changes is not None:
            changes = changes.filter(pc.not_equal(changes.column(OP_COL), BEFORE_OP))  # changelog-only rows
        if changes is None or changes.num_rows == 0:
            return None
        data_columns = [c for c in data_columns if c not in META_NAMES]
        if not key_names:
            # No replica identity: only inserts can be published. Rows are keyed by their
            # commit position, kept in the table, so a replayed window inserts nothing twice.
            if set(changes.column(OP_COL).to_pylist()) - {"I"}:
                raise SchemaError(
                    f"table {schema}.{name} has no key but got updates or deletes; "
                    f"set [tables.\"{schema}.{name}\"] key = [...] in the config"
                )
            key_names = [LSN_COL, POS_COL]
            data_columns = [*data_columns, LSN_COL, POS_COL]
        return reduce_changes(changes, key_names), key_names, data_columns

    def _fill_lookups(
        self,
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
            else self.engine.read_rows(uri, key_names, wanted, columns, version=version, nullable_keys=nullable_keys)
        )
        found = {tuple(r[k] for k in key_names): r for r in rows}
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

    # --- keys -----------------------------------------------------------------------------

    def _key_resolver(self, conn: Any) -> Callable[[po.Relation], Sequence[str] | None]:
        def resolve(rel: po.Relation) -> Sequence[str] | None:
            configured = self.config.table(rel.namespace or "pg_catalog", rel.name).key
            if configured:
                return configured
            if rel.replica_identity != "f":
                return None  # the replica identity the message flags (primary key or index)
            rows = conn.execute(
                "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
                "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisprimary "
                "ORDER BY array_position(i.indkey::int2[], a.attnum)",
                (rel.oid,),
            ).fetchall()
            if not rows:
                raise SchemaError(
                    f"table {rel.namespace}.{rel.name} has REPLICA IDENTITY FULL and no primary key: "
                    f"set [tables.\"{rel.namespace}.{rel.name}\"] key = [...] in the config"
                )
            return [str(r[0]) for r in rows]

        return resolve

    # --- the applied log --------------------------------------------------------------------

    def _applied_lsns(self) -> dict[int, Applied]:
        """Per relation OID, the last window logged for its Delta table, the version it made, and the
        key the table was last merged on."""
        rows = self.engine.read_table(self.lake.table_uri(LOG_TABLE))
        out: dict[int, Applied] = {}
        keys: dict[int, tuple[int, tuple[str, ...]]] = {}
        memberships: dict[int, tuple[int, str]] = {}
        leaves: dict[int, tuple[int, str]] = {}
        attnums: dict[int, tuple[int, str]] = {}
        for r in rows:
            if r.get("slot") != self.config.source.slot or r.get("relation_oid") is None:
                continue
            oid, end = int(r["relation_oid"]), int(r["window_end"])
            if oid not in out or end > out[oid].end_lsn:
                version = r.get("delta_version")
                out[oid] = Applied(
                    end, None if version is None else int(version),
                    str(r.get("schema_name") or ""), str(r.get("table_name") or ""),
                )
            key = r.get("key_columns")
            if key and (oid not in keys or end > keys[oid][0]):
                keys[oid] = (end, tuple(json.loads(key)))
            member = r.get("publication")
            if member and (oid not in memberships or end >= memberships[oid][0]):
                memberships[oid] = (end, str(member))
            parts = r.get("partitions")
            if parts and (oid not in leaves or end >= leaves[oid][0]):
                leaves[oid] = (end, str(parts))
            # The newest row's, null included (a backfill's rows, or rows of older pg2delta versions,
            # carry none): numbers from before a row that did not record them judge nothing.
            nums = r.get("attnums")
            if oid not in attnums or end > attnums[oid][0] or (end == attnums[oid][0] and nums):
                attnums[oid] = (end, str(nums) if nums else "")
        for oid, (_, key_columns) in keys.items():
            out[oid] = dataclasses.replace(out[oid], key=key_columns)
        for oid, (_, member) in memberships.items():
            out[oid] = dataclasses.replace(out[oid], publication=member)
        for oid, (_, parts) in leaves.items():
            out[oid] = dataclasses.replace(out[oid], partitions=parts)
        for oid, (_, nums) in attnums.items():
            if nums:
                out[oid] = dataclasses.replace(out[oid], attnums={str(k): int(v) for k, v in json.loads(nums).items()})
        return out

    def _log_window(
        self,
        run_id: str,
        window: WindowReport,
        reports: list[tuple[int, TableReport, tuple[str, ...] | None]],
        *,
        txn: Txn | None = None,
    ) -> None:
        now = pa.scalar(int(time.time() * 1_000_000), type=pa.int64()).cast(pa.timestamp("us", tz="UTC"))
        rows = [
            {
                "run_id": run_id,
                "slot": self.config.source.slot,
                "window_start": window.start_lsn,
                "window_end": window.end_lsn,
                "window_end_lsn": format_lsn(window.end_lsn),
                "relation_oid": oid,
                "schema_name": t.schema,
                "table_name": t.table,
                "delta_version": t.delta_version,
                "inserts": t.inserts,
                "updates": t.updates,
                "deletes": t.deletes,
                "truncated": t.truncated,
                "applied_at": now.as_py(),
                "key_columns": None if key is None else json.dumps(list(key)),
                "kind": "window",
                "commit_ts": t.commit_ts,
                "publication": self._memberships.get(oid),
                "partitions": self._leaves.get(oid),
                "attnums": self._attnums.get(oid),
            }
            for oid, t, key in reports
        ]
        self.engine.append(self.lake.table_uri(LOG_TABLE), pa.Table.from_pylist(rows, schema=LOG_SCHEMA), txn=txn)


def _newest_commit_ts(tgt: _Target, truncates: Sequence[TruncateEvent], applied_lsn: int) -> int | None:
    """Commit time (microseconds since 1970, UTC) of the newest transaction the window applies to ``tgt``."""
    times = [t.commit_ts for t in truncates if t.commit_ts is not None]
    for tw in tgt.parts:
        for b in tw.batches:
            if b.max_lsn < applied_lsn or not b.num_rows:
                continue
            newest = b.newest_ts if isinstance(b, SpilledBatch) and b.first_lsn >= applied_lsn else newest_ts(b.load(), applied_lsn)
            if newest is not None:
                times.append(newest)
    return max(times) if times else None


def _rows_written(batch: pa.RecordBatch, applied_lsn: int, last_truncate: tuple[int, int] | None) -> int:
    """Inserts and updates of ``batch`` that the window applies (at or after the applied LSN, after its last truncate)."""
    lsn, pos, op = batch.column(LSN_COL), batch.column(POS_COL), batch.column(OP_COL)
    keep = pc.and_(pc.is_in(op, value_set=pa.array(["I", "U"])), pc.greater_equal(lsn, applied_lsn))
    if last_truncate is not None:
        t_lsn, t_pos = last_truncate
        keep = pc.and_(keep, pc.or_(pc.greater(lsn, t_lsn), pc.and_(pc.equal(lsn, t_lsn), pc.greater(pos, t_pos))))
    return int(pc.sum(pc.cast(keep, pa.int64())).as_py() or 0)


def _unknown_values_message(column: str, source: str, entries: Sequence[AddedColumn], where: str) -> str:
    if len({e.missing for e in entries}) > 1:
        why = (
            "its partitions hold different values for the rows written before it was added "
            "(a partition created or rewritten since, or added with its own default)"
        )
    else:
        why = (
            "PostgreSQL computed its value in the rows written before it was added and keeps no record of it "
            "(no pg_attribute.attmissingval: a volatile default such as clock_timestamp() or gen_random_uuid(), "
            "an identity or STORED generated column, a domain default with constraints, or a table rewrite "
            "since the column was added)"
        )
    return (
        f"column {column} of {source} was added with a default{where}, but {why}; pg2delta cannot know what "
        f"those rows hold there: make the lake's copy of the table again with pg2delta resync --table {source}; "
        "nothing of this window was applied"
    )


def run(config: Config, *, until_lsn: int | None = None, create_slot: bool | None = None) -> RunReport:
    """Run the job once with the configured engine; the function the CLI and jobs/ call."""
    job = Job(config)
    try:
        return job.run(until_lsn=until_lsn, create_slot=create_slot)
    finally:
        job.close()
