"""Tables copied into the lake at an exported snapshot: staged, committed in one Delta commit each,
recorded in the applied log as applied through the snapshot's LSN.

:class:`Copier` copies a list of tables at one snapshot; :func:`copy_at_new_snapshot` copies
tables at a temporary slot's snapshot (a resumed bootstrap, a table added to the publication, a
resync); :func:`copy_new_tables` is the run's: the published tables a bootstrapped lake has no
copy of yet. What the lake holds of a bootstrap is :func:`lake_state`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from queue import Empty
from typing import Any

import psycopg

from pg2delta.apply import rowmeta
from pg2delta.apply.history import HistoryWriter
from pg2delta.apply.lakeside import LakeWriter
from pg2delta.config import Config
from pg2delta.copy.staging import StageTask, Workers, stage_in_worker, stage_table
from pg2delta.decode.changes import LSN_COL, WindowDecoder
from pg2delta.decode.events import DELETED_COL, OP_COL, TS_COL
from pg2delta.errors import (
    ErrorKind,
    Pg2DeltaError,
    SourceStateError,
)
from pg2delta.faults import fault_point
from pg2delta.lake.applied_log import KIND_BOOTSTRAP, LoggedTable, log_row, log_rows
from pg2delta.lake.applied_log import append as append_log
from pg2delta.lake.column_records import write_record
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lsn import format_lsn
from pg2delta.progress import Progress, percent
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.copy import CopyMeta, CopyPlan
from pg2delta.source.keys import column_rules, key_resolver
from pg2delta.source.publication import PublishedTable, copied_tables
from pg2delta.source.slot import SlotSource, connect
from pg2delta.source.snapshot import ExportedSnapshot, Snapshot, open_snapshot

log = logging.getLogger(__name__)

STAGING = "_pg2delta/staging/bootstrap"
ROW_COLUMNS = frozenset({LSN_COL, TS_COL, OP_COL, DELETED_COL})  # a copy's row metadata (CopyMeta), not in the history
DEFAULT_PARALLEL = 2


@dataclass(frozen=True)
class CopyInto:
    """What a copy is handed by the operation that copies (bootstrap, resync, the run): the
    configuration (the source, each table's settings), the lake and its engine (started when first
    asked for: a copy's worker processes never ask), the history tables."""

    config: Config
    writer: LakeWriter
    history: HistoryWriter

    @property
    def lake(self) -> Lake:
        return self.writer.lake

    @property
    def engine(self) -> Engine:
        return self.writer.engine


# --- what the lake already holds ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LakeBootstrap:
    """What the applied log says about the bootstrap of one slot's lake."""

    start_lsn: int | None  # the slot's consistent point when the bootstrap created it; None: never bootstrapped
    copied: dict[int, int]  # relation OID -> LSN its copy is as of (only copies of this bootstrap)


def lake_state(rows: Sequence[dict[str, Any]], slot: str) -> LakeBootstrap:
    """Read the bootstrap rows of ``slot`` from the applied log's rows."""
    mine = [r for r in rows if r.get("slot") == slot and r.get("kind") == KIND_BOOTSTRAP]
    starts = [int(r["window_end"]) for r in mine if r.get("relation_oid") is None]
    if not starts:
        return LakeBootstrap(None, {})
    start = max(starts)  # a slot dropped and bootstrapped again starts later: older copies do not count
    copied: dict[int, int] = {}
    for r in mine:
        if r.get("relation_oid") is None or int(r["window_end"]) < start:
            continue
        oid = int(r["relation_oid"])
        copied[oid] = max(copied.get(oid, 0), int(r["window_end"]))
    return LakeBootstrap(start, copied)


# --- progress -------------------------------------------------------------------------------------


class _Progress:
    """Rows copied against ``pg_class.reltuples``, with rate and ETA: a bar on a terminal, a log
    line every few seconds otherwise (see progress.py); no row values."""

    def __init__(self, tables: Sequence[PublishedTable]) -> None:
        self.lock = threading.Lock()
        self.total_tables = len(tables)
        self.done_tables = 0
        self.current: dict[str, tuple[int, int | None]] = {}
        estimate = sum(t.estimated_rows or 0 for t in tables)
        self.bar = Progress("copy", total=estimate, unit="rows", logger=log, line=self._line)

    def _line(self, p: Progress) -> str:
        eta = p.eta()
        each = ", ".join(
            f"{name} {done}" + (f"/~{est} ({percent(done, est)})" if est else "")
            for name, (done, est) in sorted(self.current.items())
        )
        return (
            f"bootstrap: {self.done_tables}/{self.total_tables} tables done, {p.rows} of ~{p.total or 0} rows, "
            f"{p.rate():.0f} rows/s, eta {f'{eta:.0f} s' if eta is not None else 'unknown'}; copying {each}"
        )

    def update(self, table: PublishedTable, table_rows: int, new_rows: int) -> None:
        with self.lock:
            self.current[table.qualified] = (table_rows, table.estimated_rows)
            rows = self.bar.rows + new_rows
            self.bar.move_to(rows, rows=rows, note=f"{self.done_tables}/{self.total_tables} tables")

    def finished(self, table: PublishedTable) -> None:
        with self.lock:
            self.done_tables += 1
            self.current.pop(table.qualified, None)
            self.bar.move_to(self.bar.position, note=f"{self.done_tables}/{self.total_tables} tables")

    def close(self) -> None:
        self.bar.close()


# --- the copy --------------------------------------------------------------------------------------


@dataclass
class TableCopy:
    schema: str
    table: str
    relation_oid: int
    rows: int
    snapshot_lsn: int
    delta_version: int | None
    seconds: float
    path: str


class Copier:
    """Copies tables into the lake at one exported snapshot, ``parallel`` tables at a time.

    With ``parallel`` > 1 every table is read, decoded and staged in a worker process of its
    own (reading the COPY is CPU-bound Python: threads would share one core through the
    GIL); the Delta commits stay in this process, each started as soon as its table is staged
    (up to ``parallel`` at once), and the applied log takes one table's row at a time.
    """

    def __init__(
        self, into: CopyInto, snapshot: Snapshot, run_id: str, *, parallel: int, workers: Workers | None = None,
        start_row: Callable[[], None] | None = None,
    ) -> None:
        self.into = into
        self.snapshot = snapshot
        self.run_id = run_id
        self.parallel = max(1, parallel)
        self.staging = f"{STAGING}/{into.config.source.slot}/{run_id}"
        self.workers = workers  # started early by the caller, else started here when needed
        # Logs the lake's start (a fresh bootstrap): once, while the workers read the tables and
        # before the first commit, so that the engine's work overlaps the copy.
        self._start_row = start_row
        self._logging = threading.Lock()
        self._snapshot_ts: int | None = None  # PostgreSQL's time in the snapshot (CopyMeta.ts)

    def plans(self, catalog_conn: psycopg.Connection[Any], tables: Sequence[PublishedTable]) -> list[CopyPlan]:
        catalog = PgTypeCatalog(catalog_conn)
        config = self.into.config
        decoder = WindowDecoder(catalog, key_resolver(config, catalog_conn), columns=column_rules(config, catalog_conn))
        return [CopyPlan.make(t.usable(), decoder.relation_version(t.relation), self.meta(catalog_conn, t)) for t in tables]

    def meta(self, catalog_conn: psycopg.Connection[Any], table: PublishedTable) -> CopyMeta | None:
        """The row metadata of the table's copied rows (None: the table keeps none): the snapshot's
        LSN and PostgreSQL's time in it (``catalog_conn`` is in the snapshot; read once per copy)."""
        rel = table.relation
        if not rowmeta.metadata(self.into.config, rel.namespace, rel.name):
            return None
        if self._snapshot_ts is None:
            row = catalog_conn.execute(
                "SELECT floor(extract(epoch FROM transaction_timestamp()) * 1000000)::int8"
            ).fetchone()
            self._snapshot_ts = int(row[0]) if row is not None else 0
        return CopyMeta(self.snapshot.consistent_lsn, self._snapshot_ts, rowmeta.soft_deletes(self.into.config, rel.namespace, rel.name))

    def _kept(self, plan: CopyPlan) -> Any:
        """What a soft-delete table keeps of its rows beside its copy (pg2delta.apply.rowmeta.KeptRows's
        SQL builder; None: nothing, the copy replaces it)."""
        if plan.meta is None or not plan.meta.soft:
            return None
        rel = plan.table.relation
        configured = bool(self.into.config.table(rel.namespace, rel.name).key)
        return rowmeta.KeptRows(tuple(plan.version.key_names), plan.meta.lsn, plan.meta.ts, configured).sql

    def _stage_rel(self, table: PublishedTable) -> str:
        return f"{self.staging}/{table.relation.namespace}.{table.relation.name}"

    def copy_all(self, plans: Sequence[CopyPlan]) -> list[TableCopy]:
        if not plans:
            self.log_start()
            return []
        progress = _Progress([p.table for p in plans])
        todo = sorted(plans, key=lambda p: -(p.table.estimated_rows or 0))  # the largest first
        try:
            if self.parallel == 1 or len(todo) == 1:
                self.log_start()
                return self._copy_here(todo, progress)
            if self.workers is not None:
                return self._copy_in_workers(todo, progress, self.workers)
            with Workers(min(self.parallel, len(todo))) as workers:
                return self._copy_in_workers(todo, progress, workers)
        finally:
            progress.close()

    def log_start(self) -> None:
        """Log the lake's start (``start_row``) unless done already."""
        if self._start_row is not None:
            self._start_row()
            self._start_row = None

    def _copy_here(self, todo: Sequence[CopyPlan], progress: _Progress) -> list[TableCopy]:
        cfg = self.into.config
        results: list[TableCopy] = []
        conn = connect(cfg.source.dsn, application_name="pg2delta bootstrap copy", connect_timeout=cfg.source.connect_timeout)
        try:
            open_snapshot(conn, self.snapshot)
            for plan in todo:
                t0 = time.monotonic()

                def report(rows: int, new: int, plan: CopyPlan = plan) -> None:
                    progress.update(plan.table, rows, new)
                    fault_point("bootstrap_mid_table")

                stage_dir = f"{self.into.lake.path}/{self._stage_rel(plan.table)}"
                rows, notes = stage_table(conn, plan, self.into.lake, stage_dir, report)
                results.append(self._commit(plan, rows, notes, t0, progress))
        finally:
            conn.close()
        return results

    def _copy_in_workers(self, todo: Sequence[CopyPlan], progress: _Progress, workers: Workers) -> list[TableCopy]:
        """Stage every table in a worker process; commit each as soon as it is staged, in a thread
        of this process (up to ``parallel`` commits at once: one table's Delta write need not wait
        for another's)."""
        by_oid = {p.table.oid: p for p in todo}
        staging: dict[Future[Any], tuple[CopyPlan, float]] = {}
        for plan in todo:
            task = StageTask(
                self.into.config, self.snapshot, plan.table,
                f"{self.into.lake.path}/{self._stage_rel(plan.table)}", plan.meta,
            )
            staging[workers.pool.submit(stage_in_worker, task)] = (plan, time.monotonic())
        commits: list[Future[Any]] = []
        pending: set[Future[Any]] = set(staging)
        with ThreadPoolExecutor(min(self.parallel, len(todo)), thread_name_prefix="pg2delta-commit") as committing:
            try:
                self.log_start()  # while the workers copy
                while pending:
                    done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    while True:
                        try:
                            oid, rows, new = workers.queue.get_nowait()
                        except Empty:
                            break
                        progress.update(by_oid[oid].table, rows, new)
                        fault_point("bootstrap_mid_table")
                    for fut in done:
                        if fut not in staging:
                            fut.result()  # a commit: raises what it raised
                            continue
                        plan, t0 = staging[fut]
                        staged = fut.result()
                        if staged.error is not None:
                            kind, message, retryable = staged.error
                            raise Pg2DeltaError(message, kind=ErrorKind(kind), retryable=retryable)
                        commit = committing.submit(self._commit, plan, staged.rows, staged.notes, t0, progress)
                        commits.append(commit)
                        pending.add(commit)
            except BaseException:
                workers.abort.set()
                workers.pool.shutdown(wait=True, cancel_futures=True)
                raise
        return [c.result() for c in commits]

    def _commit(self, plan: CopyPlan, rows: int, notes: dict[str, int], t0: float, progress: _Progress) -> TableCopy:
        """Make the staged copy of a table visible in one Delta commit and record it in the applied log."""
        table = plan.table

        for name, count in sorted(notes.items()):
            log.warning("copy note: %s: %s = %d", table.qualified, name, count)
        rel = table.relation
        lake = self.into.lake
        stage_rel = self._stage_rel(table)
        uri = lake.table_uri(rel.namespace, rel.name)
        staged = lake.table_uri(stage_rel)
        # A new table takes the staged files as they are, where the engine allows (the history's
        # MERGE of the copy reads them afterwards: then the engine writes the table).
        history = self.into.history.enabled(rel.namespace, rel.name)
        if history or not self.into.engine.adopt_copy(uri, staged, plan.schema):
            self.into.engine.replace_table(uri, staged, keep=self._kept(plan))
        with self._logging:  # the applied log (and the history) take one table's rows at a time
            return self._log_copy(plan, rows, t0, progress, uri, stage_rel)

    def _log_copy(
        self, plan: CopyPlan, rows: int, t0: float, progress: _Progress, uri: str, stage_rel: str
    ) -> TableCopy:
        table = plan.table
        rel = table.relation
        lake = self.into.lake
        version = lake.delta_version(uri)
        # The history (history = "scd2") ends its current versions and opens the copy's rows.
        self.into.history.copied(
            self.into.engine, rel.namespace, rel.name, lake.table_uri(stage_rel), self.snapshot.consistent_lsn,
            row_columns=[f.name for f in plan.schema if f.name in ROW_COLUMNS and not (plan.keyless and f.name == LSN_COL)],
        )
        # The form its columns were landed in (hash, exclude), once the copy is the table's latest version.
        governance = plan.version.governance
        write_record(lake, rel.namespace, rel.name, governance.rules.record() if governance is not None else None)
        fault_point("copy_after_replace")  # the copy is the table's latest version, the log does not say so yet
        append_log_row(
            self.into, self.run_id, self.snapshot.consistent_lsn, table, rows, version, key=plan.version.key_names
        )
        fault_point("bootstrap_after_table")
        try:
            lake.fs.delete_dir(f"{lake.path}/{stage_rel}")
        except OSError:
            log.warning("could not remove staging folder %s", stage_rel)
        progress.finished(table)
        seconds = time.monotonic() - t0
        log.info(
            "copied %s: %d rows at %s in %.1f s (%.0f rows/s) -> delta version %s",
            table.qualified, rows, format_lsn(self.snapshot.consistent_lsn), seconds,
            rows / max(seconds, 1e-9), version,
        )
        return TableCopy(rel.namespace, rel.name, rel.oid, rows, self.snapshot.consistent_lsn, version, seconds, uri)


def append_log_row(
    into: CopyInto,
    run_id: str,
    lsn: int,
    table: PublishedTable | None,
    rows: int,
    version: int | None,
    *,
    key: Sequence[str] | None = None,
) -> None:
    """A ``kind = 'bootstrap'`` row: a table copied as of ``lsn`` (keyed on ``key``), or (no table) the lake's start."""
    logged = None if table is None else LoggedTable(
        table.oid, table.relation.namespace, table.relation.name, version, rows, 0, 0, False, None,
        None if key is None else tuple(key), table.membership, table.leaves, table.attnums, table.filenodes,
    )
    append_log(into.engine, into.lake, [log_row(into.config.source.slot, run_id, lsn, lsn, logged, kind=KIND_BOOTSTRAP)])


@contextlib.contextmanager
def slot_staging(lake: Lake, slot: str) -> Iterator[None]:
    """This slot's staging folder for a copy: emptied first of what an interrupted copy staged
    (never visible in any Delta table), and removed when the copy ends."""
    path = f"{lake.path}/{STAGING}/{slot}"

    def remove() -> bool:
        try:
            lake.fs.delete_dir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
            return False

    if remove():
        log.info("removed staging files of an interrupted copy")
    try:
        yield
    finally:
        remove()


def read_state(lake: Lake, slot: str) -> LakeBootstrap:
    """What the applied log of ``lake`` says about the bootstrap of ``slot``."""
    return lake_state(log_rows(lake), slot)


def copy_at_new_snapshot(into: CopyInto, src: SlotSource, missing: set[int], *, parallel: int) -> list[TableCopy]:
    """Copy the tables ``missing`` (OIDs) at the snapshot of a temporary slot created now."""
    cfg = into.config
    info = src.slot_info()
    tmp = f"pg2delta_tmp_{uuid.uuid4().hex[:16]}"
    run_id = uuid.uuid4().hex
    with slot_staging(into.lake, cfg.source.slot), ExportedSnapshot(
        cfg.source.dsn, tmp, temporary=True, connect_timeout=cfg.source.connect_timeout
    ) as exported:
        snap = exported.snapshot
        if info is not None and info.confirmed_flush_lsn is not None and snap.consistent_lsn < info.confirmed_flush_lsn:
            raise SourceStateError(
                f"the new snapshot ({format_lsn(snap.consistent_lsn)}) is before slot {cfg.source.slot!r} "
                f"({format_lsn(info.confirmed_flush_lsn)}); nothing was copied"
            )
        copier = Copier(into, snap, run_id, parallel=parallel)
        catalog_conn = connect(cfg.source.dsn, application_name="pg2delta catalog", connect_timeout=cfg.source.connect_timeout)
        try:
            # The publication as of the snapshot: the tables the slot publishes from its consistent point.
            open_snapshot(catalog_conn, snap)
            tables = [t for t in copied_tables(catalog_conn, cfg) if t.oid in missing]
            plans = copier.plans(catalog_conn, tables)
            catalog_conn.execute("COMMIT")
            return copier.copy_all(plans)
        finally:
            catalog_conn.close()


def copy_new_tables(into: CopyInto, src: SlotSource, *, parallel: int = DEFAULT_PARALLEL) -> bool:
    """Before a run's windows: copy the published tables a bootstrapped lake has no copy of.

    Returns whether the lake was bootstrapped for this slot (then the run skips the changes of
    tables without a copy). A lake never bootstrapped is left alone: its tables are created from
    the first changes the slot sends, as before.
    """
    bootstrapped, missing, names = tables_to_copy(into.lake, into.config, src)
    if missing:
        log.info("the publication has %d table(s) the lake has no copy of: %s; copying them first", len(names), ", ".join(names))
        copy_at_new_snapshot(into, src, missing, parallel=parallel)
    return bootstrapped


def tables_to_copy(lake: Lake, config: Config, src: SlotSource) -> tuple[bool, set[int], list[str]]:
    """Whether the lake was bootstrapped for this slot, and the published tables it has no copy of
    (OIDs, and their names sorted): what :func:`copy_new_tables` copies, without copying."""
    state = read_state(lake, config.source.slot)
    if state.start_lsn is None:
        return False, set(), []
    published = copied_tables(src.conn, config)
    missing = {t.oid for t in published if t.oid not in state.copied}
    return True, missing, sorted(t.qualified for t in published if t.oid in missing)
