"""The run: bounded windows from the slot, applied to Delta in commit order, then the slot advanced.

One run:

1. takes the per-slot advisory lock and checks the slot and publication;
2. fixes its upper bound (``--until-lsn`` or the server's flush LSN at start);
3. copies the tables a bootstrapped lake has no copy of (pg2delta.copy.copier), and stops on (or
   copies again) tables the lake cannot follow by changes alone (pg2delta.apply.targets);
4. repeats, until the bound is reached, the stages of one window (:meth:`Job._window`): **read
   and decode** it (pg2delta.window.read), map its relations to Delta tables (pg2delta.apply.targets)
   and **decide** each table's shape (pg2delta.apply.tableplan) before anything is written, copying
   again where set to (pg2delta.copy.again); **commit** it (pg2delta.apply.commits): the changelog,
   the histories, then every table reduced, staged and merged (pg2delta.apply.stage,
   pg2delta.apply.table: one data commit per table and window); then **log** the window in the
   applied log (pg2delta.apply.window_log, pg2delta.lake.applied_log) and, only then, **advance**
   the slot to the window's end (:meth:`pg2delta.apply.window_log.WindowLog.log_and_advance`, the
   one place that moves the slot).

A crash anywhere leaves the slot where it was; the next run peeks the same changes again.
Re-applying them is harmless: MERGE of final states is idempotent, a truncate is a
``NOT MATCHED BY SOURCE`` delete, and changes at or before a table's applied LSN are skipped.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pg2delta.copy.copier as copying
from pg2delta.apply.changelog import ChangelogWriter
from pg2delta.apply.commits import WindowCommits
from pg2delta.apply.lakeside import Lakeside
from pg2delta.apply.table import TableApplier, TableReport
from pg2delta.apply.tableplan import TablePlanner
from pg2delta.apply.targets import (
    PublicationState,
    TargetResolver,
    added_back_tables,
    detached_published,
    publication_state,
    recorded_filenodes,
)
from pg2delta.apply.window_log import WindowLog
from pg2delta.config import Config
from pg2delta.copy.again import CopyAgain
from pg2delta.failover import run_bounds
from pg2delta.faults import fault_point
from pg2delta.lake.applied_log import Applied, applied_lsns
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.foreign_watch import ForeignWatch, Written
from pg2delta.lsn import format_lsn
from pg2delta.maintain import maintain_due
from pg2delta.metastore import register_written
from pg2delta.progress import Progress
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.keys import KeyResolver, key_resolver
from pg2delta.source.slot import SlotSource, connect
from pg2delta.window.read import read_window, run_progress
from pg2delta.window.spill import Spiller

log = logging.getLogger(__name__)


@dataclass
class WindowReport:
    start_lsn: int
    end_lsn: int
    rows: int = 0
    bytes: int = 0
    transactions: int = 0
    tables: list[TableReport] = field(default_factory=list)
    seconds: float = 0.0
    spilled_rows: int = 0  # decoded changes the window spilled past the memory budget (pg2delta.window.spill)


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
class _Run:
    """What one run's windows share: the slot, the applied log as the run has it, the stages."""

    src: SlotSource
    run_id: str
    applied: dict[int, Applied]  # updated window by window, as the applied log would read back
    publication: PublicationState
    planner: TablePlanner
    commits: WindowCommits
    catalog: PgTypeCatalog
    keys: KeyResolver
    progress: Progress
    progress_start: int
    foreign: ForeignWatch  # another writer's commits on the window's tables (pg2delta.lake.foreign_watch)
    log: WindowLog  # each window's log and the slot's advance; the leaves' relfilenodes as last read (pg2delta.apply.window_log)
    again: CopyAgain  # tables copied again after a window's read (pg2delta.copy.again)


class Job(Lakeside):
    """The run (:meth:`run`): wires the stages of pg2delta.window.read, .apply.targets, .apply.tableplan,
    .copy.again, .apply.commits and .apply.window_log window by window (:meth:`_window`); the last
    logs each window and moves the slot."""

    def __init__(self, config: Config, *, engine_factory: Callable[[Lake], Engine] | None = None) -> None:
        super().__init__(config, engine_factory=engine_factory)
        self.changelog = ChangelogWriter(config, self.lake)
        self._attnums: dict[int, str] = {}  # table OID -> JSON of its Delta columns' attnums, for the log
        self._rewritten: set[int] = set()  # tables whose rows this job set anew: no Delta txn skipping
        self.copies = copying.CopyInto(config, self.writer, self.history)  # what the run's copies are handed
        self.on_foreign = "refuse"  # or "remember" (verify): see pg2delta.lake.foreign_watch

    def run(self, *, until_lsn: int | None = None, create_slot: bool | None = None) -> RunReport:
        cfg = self.config
        create = cfg.source.create_slot if create_slot is None else create_slot
        with SlotSource(cfg.source.dsn, cfg.source.slot, cfg.source.publication, connect_timeout=cfg.source.connect_timeout) as src:
            start, upper = run_bounds(src, cfg, self.lake, until_lsn, create=create)
            self.lake.own_staging(cfg.source.slot)  # under the lock: what a killed run left goes
            report = RunReport(cfg.source.slot, start, upper, start)
            if start >= upper:
                log.info("slot %s is at %s, nothing to do up to %s", cfg.source.slot, format_lsn(start), format_lsn(upper))
                self._maintain_if_due(report)
                return report
            # The engine starts meanwhile: nothing before the first window's apply needs it.
            self.start_engine_early()
            self.lake.check_writable()
            # Per server (a new initdb starts WAL positions again) and slot: Delta's idempotent-
            # write id, with the window's end as its version.
            app_id = f"pg2delta/{src.system_identifier()}/{cfg.source.slot}"
            # Tables added to the publication since the lake's bootstrap are copied first.
            bootstrapped = copying.copy_new_tables(self.copies, src)
            applied = applied_lsns(self.lake, cfg.source.slot)
            publication = publication_state(cfg, src.conn)
            if self._added_back(src, applied, publication):
                applied = applied_lsns(self.lake, cfg.source.slot)
            detached, refusal = detached_published(cfg, src, applied, publication)
            if refusal is not None:
                raise refusal
            catalog_conn = connect(cfg.source.dsn, application_name="pg2delta catalog")
            try:
                catalog = PgTypeCatalog(catalog_conn)
                planner = TablePlanner(
                    cfg, self.lake, lambda: self.engine, TargetResolver(cfg, self.lake, catalog_conn, detached=detached),
                    catalog, catalog_conn,
                    bootstrapped=bootstrapped, attnums=self._attnums,
                )
                applier = TableApplier(
                    cfg, self.writer, self.history, app_id, bootstrapped=bootstrapped, rewritten=self._rewritten,
                )
                commits = WindowCommits(self.writer, self.changelog, applier, planner.forms, cfg.window.parallel_tables)
                logs = WindowLog(publication, planner.targets.detached, planner.attnums, applied, self.writer, self.changelog,
                                 src, recorded_filenodes(publication, applied))
                run = _Run(
                    src, uuid.uuid4().hex, applied, publication, planner, commits,
                    catalog, key_resolver(cfg, catalog_conn), run_progress(start, upper), start,
                    ForeignWatch(self.lake, cfg.source.slot, self.on_foreign), logs,
                    CopyAgain(self.copies, src, applied, planner.forms, logs),
                )
                try:
                    self._windows(run, report)
                finally:
                    run.progress.close()
                    # The run's own staging folder (each window removes its files, not the folder):
                    # else the next run would take it for what a killed run left.
                    self.lake.unstage_dir(run.run_id)
            finally:
                catalog_conn.close()
            self._maintain_if_due(report)
            return report

    def _windows(self, run: _Run, report: RunReport) -> None:
        """Apply window after window from the report's start up to its bound."""
        position, upper = report.start_lsn, report.upper_lsn
        while position < upper:
            window = self._window(run, position, upper)
            report.windows.append(window)
            if window.end_lsn <= position:
                break
            position = window.end_lsn
            report.end_lsn = position
            run.progress.move_to(position - report.start_lsn)

    def _added_back(self, src: SlotSource, applied: dict[int, Applied], publication: PublicationState) -> bool:
        """Tables removed from the publication and added back since their last logged window or
        copy (see :func:`pg2delta.apply.targets.added_back_tables`): copied again at a new snapshot where
        ``on_unfollowable = "resync"`` (returns True); otherwise the run stops (exit 78) before
        reading, naming ``pg2delta resync``."""
        again, refusal = added_back_tables(self.config, src, applied, publication)
        if refusal is not None:
            raise refusal
        for name in again.values():
            log.warning(
                "%s left publication %r and came back since its last window; on_unfollowable = \"resync\": "
                "copying it again", name, self.config.source.publication,
            )
        if again:
            copying.copy_at_new_snapshot(self.copies, src, set(again), parallel=copying.DEFAULT_PARALLEL)
        return bool(again)

    def _maintain_if_due(self, report: RunReport) -> None:
        """``[maintain] interval``: maintain the tables due at the end of a run, under the run's lock
        (after the slot moved: see :func:`pg2delta.maintain.maintain_due`)."""
        report.maintenance = maintain_due(self.config, self.lake, lambda: self.engine)

    def _window(self, run: _Run, start: int, upper: int) -> WindowReport:
        """One window, its stages in one direction: read and decode it (its spill files removed at
        the end, whatever happens), copy again the roots whose leaf was truncated alone, map it to
        its Delta tables (targets) and decide each one's shape (plan; copy again a refused one set
        to resync), check for another writer's commits, make every commit of the window
        (pg2delta.apply.commits), check what landed under them, then log it and advance the slot
        (pg2delta.apply.window_log)."""
        t0 = time.monotonic()
        spiller = Spiller(self.lake, run.run_id, self.config.window.memory_budget)
        try:
            rd = read_window(
                run.src, self.config, start, upper, run.catalog, run.keys, spiller, (run.progress, run.progress_start)
            )
            run.again.truncated_partitions()  # after the peek returned: see there
            start, end = rd.start, rd.end
            window = WindowReport(start, end, rd.read.rows, rd.read.bytes, rd.transactions, spilled_rows=rd.spilled_rows)
            fault_point("after_read")
            ordered = sorted(run.planner.targets.group(rd.tables, run.applied), key=lambda t: (t.schema, t.table))
            if ordered:  # Apache Spark's session starts while the window is planned, reduced and staged
                self.start_engine_early(work_known=True)
            plans, refused = run.planner.plan_window(ordered, run.applied, start, end, workers=self.config.window.parallel_tables)
            for tgt, refusal in refused:  # on_unfollowable = "resync": nothing written yet
                run.again.refused(tgt, refusal)
            run.foreign.look({(t.schema, t.table): run.applied.get(t.owner) for t in ordered})
            committed = run.commits.commit(run.run_id, rd.tables, ordered, plans, run.applied, start, end)
            window.tables.extend(committed.tables)
            run.foreign.landed(Written(r.schema, r.table, r.path, r.delta_version) for r in window.tables if not r.skipped)
            run.log.log_and_advance(run.run_id, ordered, committed, plans, start, end)
            window.seconds = time.monotonic() - t0
            log.info(
                "window %s..%s: %d rows, %d transactions, %d tables, %.2f s",
                format_lsn(start), format_lsn(end), rd.read.rows, rd.transactions, len(window.tables), window.seconds,
            )
            return window
        finally:
            spiller.remove()


def run(config: Config, *, until_lsn: int | None = None, create_slot: bool | None = None) -> RunReport:
    """Run the job once with the configured engine; the function the CLI and jobs/ call."""
    job = Job(config)
    try:
        report = job.run(until_lsn=until_lsn, create_slot=create_slot)
        register_written(config, job.lake, job.started_engine)  # [lake] database: the tables in the session's catalog
        return report
    finally:
        job.close()


__all__ = ["Job", "RunReport", "TableReport", "WindowReport", "run"]
