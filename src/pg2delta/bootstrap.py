"""Bootstrap: every published table copied into Delta exactly as of the replication slot's start.

``pg2delta bootstrap``

1. takes the slot's advisory lock and checks the publication and the lake; the slot must not
   exist yet (an existing slot resumes an interrupted bootstrap of this lake, or needs ``--resume``);
2. creates the slot on a replication connection with
   ``CREATE_REPLICATION_SLOT <slot> LOGICAL pgoutput (SNAPSHOT 'export')``: the server returns the
   slot's consistent point L and exports a snapshot that holds exactly the transactions whose commit
   record starts before L, while the slot will emit exactly those whose commit record starts at or
   after L (its ``confirmed_flush_lsn`` is L);
3. records L in the applied log as the lake's start (a ``kind = 'bootstrap'`` row without a table);
4. copies every published table with worker connections that import that snapshot
   (``REPEATABLE READ``, ``SET TRANSACTION SNAPSHOT``), several tables at once: ``COPY (SELECT
   <published columns> FROM <table> WHERE <row filter>) TO STDOUT (FORMAT binary)``, decoded
   column-wise into Arrow by the change path's own codecs, written as Parquet chunks under the
   lake's staging area (memory is bounded by two chunks per worker), then made visible in ONE Delta
   commit that replaces the table: a reader sees no table or the whole copy, never part of it;
5. records each finished table in the applied log as applied through L (``kind = 'bootstrap'``).

A table configured ``partitions = "root"`` is copied as one table (:func:`copied_tables`): its
published leaf partitions, each ``FROM ONLY`` itself under its own column list and row filter, in
one ``COPY (… UNION ALL …)`` into the root's Delta table, recorded under the root's OID: the owner
the run applies every leaf's changes to, so its applied-LSN filter covers them all.

``pg2delta run`` then applies, per table, only the changes whose commit LSN is at or after the LSN
the table was copied at (the job's applied-LSN filter), so nothing is lost or applied twice, for
keyless (insert-only) tables too.

**Copies at a later snapshot.** An exported snapshot lives only as long as the replication
connection that exported it. Tables copied later get a snapshot of their own from a TEMPORARY slot
created the same way: a resumed bootstrap (tables the interrupted one did not finish), and tables
added to the publication after the bootstrap (``run`` copies them first, before its windows). The
temporary slot's consistent point L2 is at or after the main slot's position (both come from the
same WAL; the main slot cannot be ahead of the server); the table is recorded as applied through L2
and the main slot's changes of it before L2, which the snapshot holds already, are skipped. In a
bootstrapped lake, ``run`` skips the changes of a published table that has no copy yet (one added
to the publication while the run was reading): the next run copies it at a snapshot after them.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pg2delta.apply.lakeside import Lakeside
from pg2delta.copy.copier import (
    DEFAULT_PARALLEL,
    Copier,
    CopyInto,
    LakeBootstrap,
    TableCopy,
    append_log_row,
    copy_at_new_snapshot,
    read_state,
    slot_staging,
)
from pg2delta.copy.staging import Workers
from pg2delta.errors import (
    ConfigError,
    SourceStateError,
)
from pg2delta.lsn import format_lsn
from pg2delta.source.publication import copied_tables
from pg2delta.source.slot import SlotInfo, SlotSource, connect
from pg2delta.source.snapshot import ExportedSnapshot, open_snapshot, refuse_failover

log = logging.getLogger(__name__)


@dataclass
class BootstrapReport:
    slot: str
    start_lsn: int  # the lake's start: the slot's consistent point when bootstrap created it
    created_slot: bool
    copied: list[TableCopy] = field(default_factory=list)
    already_copied: list[str] = field(default_factory=list)  # finished by an earlier, interrupted bootstrap


def bootstrap(
    into: CopyInto, *, parallel: int = DEFAULT_PARALLEL, resume: bool = False, start_engine_early: Callable[[], None] = lambda: None,
) -> BootstrapReport:
    """``pg2delta bootstrap``: create the slot and copy every published table as of its consistent point.

    On a slot that exists, resume: copy the tables the lake has no copy of (an interrupted
    bootstrap) at a new snapshot. A slot the lake knows nothing of needs ``resume=True``.
    ``into``: the configuration, the lake and its engine, the history tables the copies are made
    with; ``start_engine_early`` starts the engine in the background, once the copy is sure to come.
    """
    cfg = into.config
    if parallel < 1:
        raise ConfigError("--parallel must be at least 1")
    with SlotSource(cfg.source.dsn, cfg.source.slot, cfg.source.publication, connect_timeout=cfg.source.connect_timeout) as src:
        info = _checked(into, src)
        state = read_state(into.lake, cfg.source.slot)
        if info is not None:
            return _resumed(into, src, info, state, parallel=parallel, resume=resume)
        return _created(into, src, parallel=parallel, start_engine_early=start_engine_early)


def _checked(into: CopyInto, src: SlotSource) -> SlotInfo | None:
    """Take the slot's lock and check the source and the lake; the slot, if it exists."""
    cfg = into.config
    src.lock()
    into.lake.own_staging(cfg.source.slot)
    info = src.slot_info()
    if info is not None:
        src.check()  # the slot is usable (plugin, database, not invalidated, not in use)
    elif not src._query("SELECT 1 FROM pg_publication WHERE pubname = %s", (cfg.source.publication,)):
        (dbname,) = src._query("SELECT current_database()")[0]
        raise SourceStateError(f"publication {cfg.source.publication!r} does not exist in database {dbname!r}")
    if src.server_version < 150000:
        raise SourceStateError("pg2delta bootstrap needs PostgreSQL 15 or newer (publication column lists and row filters)")
    if cfg.source.failover:
        refuse_failover(src.server_version)
    into.lake.check_writable()
    return info


def _resumed(
    into: CopyInto, src: SlotSource, info: SlotInfo, state: LakeBootstrap, *, parallel: int, resume: bool
) -> BootstrapReport:
    """The slot exists: copy the published tables the lake has no copy of (``state``), at a new snapshot."""
    cfg = into.config
    assert info.confirmed_flush_lsn is not None
    if state.start_lsn is None and not resume:
        raise SourceStateError(
            f"replication slot {cfg.source.slot!r} already exists and the lake at {cfg.lake_root} holds no "
            "bootstrap of it: pass --resume to copy every published table at a new snapshot and keep the "
            f"slot's later changes, or drop the slot (SELECT pg_drop_replication_slot('{cfg.source.slot}')) "
            "and bootstrap again"
        )
    start = state.start_lsn
    if start is None:
        start = info.confirmed_flush_lsn
        append_log_row(into, uuid.uuid4().hex, start, None, 0, None)
        state = LakeBootstrap(start, {})
    published = copied_tables(src.conn, cfg)
    report = BootstrapReport(cfg.source.slot, start, created_slot=False)
    report.already_copied = sorted(t.qualified for t in published if t.oid in state.copied)
    missing = {t.oid for t in published if t.oid not in state.copied}
    log.info(
        "resuming the bootstrap of slot %s: %d table(s) copied already, %d to copy",
        cfg.source.slot, len(report.already_copied), len(missing),
    )
    if missing:
        report.copied = copy_at_new_snapshot(into, src, missing, parallel=parallel)
    return report


def _created(into: CopyInto, src: SlotSource, *, parallel: int, start_engine_early: Callable[[], None]) -> BootstrapReport:
    """Create the slot, exporting its snapshot, and copy every published table as of it."""
    cfg = into.config
    run_id = uuid.uuid4().hex
    # What the copy needs gets ready while the slot is created and the catalog read: the
    # engine starts in a thread, the worker processes start (the snapshot's table list,
    # read below, is what is copied; this one only says how many workers are worth starting).
    start_engine_early()
    n_workers = min(parallel, len(copied_tables(src.conn, cfg)))
    with contextlib.ExitStack() as stack:
        stack.enter_context(slot_staging(into.lake, cfg.source.slot))  # left last, once the workers have stopped
        workers = stack.enter_context(Workers(n_workers)) if n_workers > 1 else None
        exported = stack.enter_context(ExportedSnapshot(
            cfg.source.dsn, cfg.source.slot, temporary=False, connect_timeout=cfg.source.connect_timeout,
            failover=cfg.source.failover,
        ))
        snap = exported.snapshot
        report = BootstrapReport(cfg.source.slot, snap.consistent_lsn, created_slot=True)
        # The lake's start is logged before the first table's commit, while the tables are read.
        copier = Copier(
            into, snap, run_id, parallel=parallel, workers=workers,
            start_row=lambda: append_log_row(into, run_id, snap.consistent_lsn, None, 0, None),
        )
        try:
            catalog_conn = connect(
                cfg.source.dsn, application_name="pg2delta catalog", connect_timeout=cfg.source.connect_timeout
            )
            try:
                open_snapshot(catalog_conn, snap)
                tables = copied_tables(catalog_conn, cfg)
                plans = copier.plans(catalog_conn, tables)
                catalog_conn.execute("COMMIT")
                log.info(
                    "copying %d table(s) as of %s with %d worker(s)",
                    len(plans), format_lsn(snap.consistent_lsn), min(parallel, max(len(plans), 1)),
                )
                report.copied = copier.copy_all(plans)
            finally:
                catalog_conn.close()
        except Exception:
            # The slot exists now: whatever failed before the first commit (the catalog, a
            # table's key), the lake's start is still logged, so the next bootstrap resumes
            # this one instead of asking for --resume.
            try:
                copier.log_start()
            except Exception as exc:
                log.warning("could not log the lake's start: %s", exc)
            raise
    return report


def run_bootstrap(config: Any, *, parallel: int = DEFAULT_PARALLEL, resume: bool = False) -> BootstrapReport:
    """The function the CLI and jobs/ call: a lake side's engine, one bootstrap, engine stopped."""
    side = Lakeside(config)
    try:
        into = CopyInto(config, side.writer, side.history)
        report = bootstrap(into, parallel=parallel, resume=resume, start_engine_early=side.start_engine_early)
        from pg2delta.metastore import register_written

        register_written(config, side.lake, side.started_engine)  # [lake] database: the tables in the session's catalog
        return report
    finally:
        side.close()


__all__ = ["BootstrapReport", "bootstrap", "run_bootstrap"]
