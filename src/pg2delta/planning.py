"""``pg2delta plan``: what a run would do now, without doing any of it.

The plan reads the pending windows exactly as a run would (same bound, same ``--max-changes`` /
``--max-bytes`` caps, same cut before a transaction that changes a table's shape), decodes them,
maps them to Delta tables and plans each table's shape change with the run's own stages
(:func:`pg2delta.window.read.read_window`, :class:`pg2delta.apply.targets.TargetResolver`,
:class:`pg2delta.apply.tableplan.TablePlanner`), and counts each table's inserts, updates and deletes
with the reduce the run merges (:func:`pg2delta.apply.stage.reduce`). It writes nothing: no
Delta commit, no staging file, no applied-log row, no write probe, and the slot does not move.

Windows after the first: a peek always starts at the slot's confirmed position, and a run moves
the slot after each window. The plan reads them from a temporary copy of the slot
(``pg_copy_logical_replication_slot``, same position), which it advances window by window as the
run would advance the slot and drops at the end; a copy reads the same changes in the same
windows as the slot, so the plan's windows are the run's. When the server cannot make the copy
(no free ``max_replication_slots`` entry, or no right to), only the first window is planned and
the report says so (``exact`` false). Between windows the plan keeps each Delta table's columns as
the planned windows would leave them (the lake itself is not changed), so a column added in one
window is not added again in the next.

A change the run would refuse (exit 78: a narrowing type change, a type change Delta cannot
follow, a key change inside a transaction, a REPLICA IDENTITY FULL table whose key changed, a
TRUNCATE of some partitions of a root, a table dropped and created again under the same name, a
table without a key getting updates ...) is reported, and planning goes on with the window's other
tables; no later window is planned, as the run stops there. Tables the publication has but a
bootstrapped lake has no copy of are listed as copied first (the run copies them at a new
snapshot, after the bound: their pending changes are then already in the copy).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pg2delta.apply.lakeside import Lakeside
from pg2delta.apply.schema import Plan
from pg2delta.apply.stage import reduce, stage_changes, table_changes
from pg2delta.apply.tableplan import TablePlanner
from pg2delta.apply.targets import (
    Target,
    TargetResolver,
    added_back_tables,
    detached_published,
    publication_state,
    recorded_filenodes,
    rewritten_partitions,
)
from pg2delta.config import Config
from pg2delta.copy.copier import tables_to_copy
from pg2delta.errors import DataError, SchemaError
from pg2delta.failover import lost, not_held
from pg2delta.lake.applied_log import Applied, applied_lsns
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.types import spark_type
from pg2delta.lsn import format_lsn
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.keys import KeyResolver, key_resolver
from pg2delta.source.slot import SlotSource, connect
from pg2delta.window.read import ReadWindow, read_window
from pg2delta.window.spill import Spiller

SCHEMA_VERSION = 1


@dataclass
class TablePlan:
    schema: str
    table: str
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    truncated: bool = False
    skipped: bool = False  # the applied log has this window for the table already
    would_copy: bool = False  # not copied into the bootstrapped lake yet: the run copies it first
    new_table: bool = False  # no Delta table yet: the run creates it
    added: list[str] = field(default_factory=list)
    widened: list[tuple[str, str, str]] = field(default_factory=list)  # (column, Delta type now, wider type)
    dropped: list[str] = field(default_factory=list)  # in the Delta table, no longer sent
    dropped_columns: str = "keep"  # what the run does with them (the table's dropped_columns setting)
    key: list[str] | None = None
    key_before: list[str] | None = None  # the key the lake was last merged on, when it differs
    refusal: str | None = None

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass
class Refusal:
    table: str | None  # None: the window as a whole (decoding it, or mapping it to Delta tables)
    window_start: int
    message: str


@dataclass
class WindowPlan:
    start_lsn: int
    end_lsn: int
    rows: int = 0
    bytes: int = 0
    transactions: int = 0
    ends_at: str = "bound"  # 'bound', 'cap' (--max-changes / --max-bytes) or 'shape_change'
    tables: list[TablePlan] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)


@dataclass
class PlanReport:
    slot: str
    start_lsn: int
    upper_lsn: int
    end_lsn: int
    windows: list[WindowPlan] = field(default_factory=list)
    would_copy: list[str] = field(default_factory=list)
    exact: bool = True  # False: only the first window could be planned (no temporary slot copy)

    @property
    def refusals(self) -> list[Refusal]:
        return [r for w in self.windows for r in w.refusals]


def plan_job(config: Config, lake: Lake, engine: Callable[[], Engine], *, until_lsn: int | None = None) -> PlanReport:
    """Plan the windows a run of ``config`` would apply now (see the module's docstring), reading
    ``lake`` and, where a table's Delta columns are needed, ``engine()`` (started on first use)."""
    with SlotSource(config.source.dsn, config.source.slot, config.source.publication, connect_timeout=config.source.connect_timeout) as src:
        if src.slot_info() is None:
            lost(lake, config)  # gone while the lake holds its changes: say so, as a run would
        start, upper = src.locked_bounds(until_lsn)
        if (info := src.slot_info()) is not None:
            not_held(src, info, start, upper)  # a read the primary would hold for its standby
        report = PlanReport(config.source.slot, start, upper, start)
        if start >= upper:
            return report  # a run would stop here too, before copying anything
        bootstrapped, _, report.would_copy = tables_to_copy(lake, config, src)
        applied = applied_lsns(lake, config.source.slot)
        publication = publication_state(config, src.conn)
        again, refusal = added_back_tables(config, src, applied, publication)
        # A partition truncated alone: the run finds it after its first peek, before applying.
        if refusal is None:
            _, _, refusal = rewritten_partitions(config, src, applied, recorded_filenodes(publication, applied), again)
        detached: dict[int, tuple[int, int]] = {}
        if refusal is None:
            detached, refusal = detached_published(config, src, applied, publication)
        report.would_copy = sorted({*report.would_copy, *again.values()})
        if refusal is not None:  # the run stops before reading anything
            stopped = WindowPlan(start, start)
            stopped.refusals.append(Refusal(None, start, str(refusal)))
            report.windows.append(stopped)
            return report
        catalog_conn = connect(config.source.dsn, application_name="pg2delta catalog", connect_timeout=config.source.connect_timeout)
        try:
            catalog = PgTypeCatalog(catalog_conn)
            planner = TablePlanner(
                config, lake, engine, TargetResolver(config, lake, catalog_conn, detached=detached),
                catalog, catalog_conn,
                bootstrapped=bootstrapped, planned_types={},
            )
            _plan_windows(planner, src, report, applied, key_resolver(config, catalog_conn))
        finally:
            catalog_conn.close()
        return report


def _plan_windows(
    planner: TablePlanner, src: SlotSource, report: PlanReport, applied: dict[int, Applied], keys: KeyResolver
) -> None:
    """The windows from the report's start up to its bound, read from ``src`` and, after the
    first, from a temporary copy of the slot advanced window by window."""
    start, upper = report.start_lsn, report.upper_lsn
    position = start
    scratch: SlotSource | None = None
    try:
        while position < upper:
            if position > start and scratch is None:
                scratch = src.scratch_copy()
                if scratch is None:
                    report.exact = False
                    break
                scratch.advance(position)
            window = _plan_window(planner, scratch or src, position, upper, applied, keys)
            report.windows.append(window)
            if window.refusals or window.end_lsn <= position:
                break
            position = window.end_lsn
            report.end_lsn = position
            if scratch is not None and position < upper:
                scratch.advance(position)
    finally:
        if scratch is not None:
            src.drop_scratch(scratch)


def _plan_window(
    planner: TablePlanner, src: SlotSource, start: int, upper: int, applied: dict[int, Applied], keys: KeyResolver
) -> WindowPlan:
    """One window read and planned table by table; the refusals of its read or its targets stop it."""
    assert planner.catalog is not None
    # A window past the memory budget spills to a scratch directory of this machine: plan writes
    # nothing to the lake.
    with tempfile.TemporaryDirectory(prefix="pg2delta-plan-") as scratch:
        spiller = Spiller(Lake(scratch), "plan", planner.config.window.memory_budget)
        try:
            rd = read_window(src, planner.config, start, upper, planner.catalog, keys, spiller)
        except (SchemaError, DataError) as exc:
            window = WindowPlan(start, start)
            window.refusals.append(Refusal(None, start, str(exc)))
            return window
        window = WindowPlan(
            start, rd.end, rd.read.rows, rd.read.bytes, rd.transactions,
            "shape_change" if rd.shape_cut else "cap" if rd.capped else "bound",
        )
        try:
            targets = planner.targets.group(rd.tables, applied)
        except SchemaError as exc:
            window.refusals.append(Refusal(None, start, str(exc)))
            return window
        for tgt in sorted(targets, key=lambda t: (t.schema, t.table)):
            window.tables.append(_plan_table(planner, rd, tgt, applied, window))
        return window


def _plan_table(planner: TablePlanner, rd: ReadWindow, tgt: Target, applied: dict[int, Applied], window: WindowPlan) -> TablePlan:
    """What the run would do to ``tgt``'s Delta table in the window ``rd``; records it in ``applied``
    and the planner's ``planned_types`` as the run would leave them."""
    start, end = rd.start, rd.end
    before = applied.get(tgt.owner)
    tp = TablePlan(tgt.schema, tgt.table)
    if before is not None and before.end_lsn >= end:
        tp.skipped = True  # as the run's TableApplier.apply
        return tp
    if before is None and planner.bootstrapped:
        tp.skipped = tp.would_copy = True  # the run copies it after the bound: nothing pending applies
        return tp
    try:
        pl = planner.plan(tgt, before, start, end)
        _count(planner, tgt, pl, before.end_lsn if before is not None else 0, tp)
    except (SchemaError, DataError) as exc:
        tp.refusal = str(exc)
        window.refusals.append(Refusal(tp.name, start, str(exc)))
        return tp
    planned = planner.planned_types
    assert planned is not None
    uri = planner.lake.table_uri(tgt.schema, tgt.table)
    known = planned.get(uri)
    tp.new_table = known is None and planner.lake.delta_version(uri) is None
    key = before.key if before is not None else None
    if pl is not None:
        settings = planner.config.table(tgt.schema, tgt.table)
        tp.added, tp.widened, tp.dropped = list(pl.added), list(pl.widened), list(pl.kept)
        tp.dropped_columns = settings.dropped_columns
        tp.key = list(pl.key)
        if before is not None and before.key is not None and before.key != pl.key:
            tp.key_before = list(before.key)
        types = dict(known if known is not None else planner.engine().table_types(
            uri, version=before.delta_version if before is not None else None
        ) or {})
        if settings.dropped_columns == "drop":
            for c in pl.kept:
                types.pop(c, None)
        arrow = dict(pl.columns)
        types.update({c: spark_type(arrow[c]) for c in pl.added})
        types.update({c: wide for c, _, wide in pl.widened})
        planned[uri] = types
        key = pl.key
    # As the run records the window for the table (its Delta version does not change here).
    applied[tgt.owner] = Applied(
        end, before.delta_version if before is not None else None, tgt.schema, tgt.table, key
    )
    return tp


def _count(planner: TablePlanner, tgt: Target, pl: Plan | None, applied_lsn: int, tp: TablePlan) -> None:
    """``tp``'s inserts, updates, deletes and truncate, counted by the run's own reduce (or, for a
    spilled window, batch by batch as the run stages them: pg2delta.window.spill)."""
    if pl is not None and any(b.spilled for tw in tgt.parts for b in tw.batches):
        staged, _ = stage_changes(planner.lake, tgt, pl, applied_lsn, None)
        tp.truncated = any(t.commit_lsn >= applied_lsn for tw in tgt.parts for t in tw.truncates)
        if not pl.key and set(staged.ops) - {"I"}:
            raise SchemaError(
                f"table {tgt.schema}.{tgt.table} has no key but got updates or deletes; "
                f"set [tables.\"{tgt.schema}.{tgt.table}\"] key = [...] in the config"
            )
        tp.inserts, tp.updates, tp.deletes = staged.ops["I"], staged.ops["U"], staged.ops["D"]
        return
    changes, truncates, _ = table_changes(tgt, pl, applied_lsn)
    tp.truncated = bool(truncates)
    if pl is not None:
        reducing = reduce(tgt.schema, tgt.table, changes, list(pl.key), [n for n, _ in pl.columns])
        if reducing is not None:
            reduced = reducing[0]
            tp.inserts, tp.updates, tp.deletes = reduced.inserts, reduced.updates, reduced.deletes


def plan(config: Any, *, until_lsn: int | None = None) -> PlanReport:
    """Plan with the configured engine (it only reads the lake); the function the CLI calls."""
    side = Lakeside(config)
    try:
        return plan_job(config, side.lake, lambda: side.engine, until_lsn=until_lsn)
    finally:
        side.close()


def to_json(report: PlanReport) -> dict[str, Any]:
    """The report as ``pg2delta plan --json`` prints it (schema_version 1, see docs/commands/plan.md)."""
    totals = _totals(report)
    return {
        "schema_version": SCHEMA_VERSION,
        "slot": report.slot,
        "from_lsn": format_lsn(report.start_lsn),
        "bound_lsn": format_lsn(report.upper_lsn),
        "to_lsn": format_lsn(report.end_lsn),
        "exact": report.exact,
        "windows": [_window_json(w) for w in report.windows],
        "window_count": len(report.windows),
        "changes": sum(t.inserts + t.updates + t.deletes for w in report.windows for t in w.tables),
        "tables": totals,
        "would_copy": report.would_copy,
        "refusals": [
            {"table": r.table, "window_start_lsn": format_lsn(r.window_start), "message": r.message}
            for r in report.refusals
        ],
    }


def _totals(report: PlanReport) -> dict[str, dict[str, Any]]:
    """Per table, its plans over every window summed up (``tables`` of the JSON report)."""
    totals: dict[str, dict[str, Any]] = {}
    for w in report.windows:
        for t in w.tables:
            agg = totals.setdefault(t.name, {
                "inserts": 0, "updates": 0, "deletes": 0, "truncated": False, "windows": 0,
                "would_copy": False, "new_table": False, "added": [], "widened": [], "dropped": [],
                "dropped_columns": t.dropped_columns, "key": None, "key_change": None, "refusal": None,
            })
            agg["inserts"] += t.inserts
            agg["updates"] += t.updates
            agg["deletes"] += t.deletes
            agg["truncated"] = agg["truncated"] or t.truncated
            agg["windows"] += 1
            agg["would_copy"] = agg["would_copy"] or t.would_copy
            agg["new_table"] = agg["new_table"] or t.new_table
            agg["added"] += [c for c in t.added if c not in agg["added"]]
            agg["widened"] += [{"column": c, "from": a, "to": b} for c, a, b in t.widened]
            agg["dropped"] += [c for c in t.dropped if c not in agg["dropped"]]
            agg["dropped_columns"] = t.dropped_columns
            if t.key is not None:
                agg["key"] = t.key
            if t.key_before is not None and agg["key_change"] is None:
                agg["key_change"] = {"from": t.key_before, "to": t.key}
            if t.refusal is not None:
                agg["refusal"] = t.refusal
    return totals


def _window_json(w: WindowPlan) -> dict[str, Any]:
    """One window of the JSON report."""
    return {
        "start_lsn": format_lsn(w.start_lsn),
        "end_lsn": format_lsn(w.end_lsn),
        "ends_at": w.ends_at,
        "rows_read": w.rows,
        "bytes_read": w.bytes,
        "transactions": w.transactions,
        "tables": {
            t.name: {
                "inserts": t.inserts, "updates": t.updates, "deletes": t.deletes, "truncated": t.truncated,
                "skipped": t.skipped, "would_copy": t.would_copy, "new_table": t.new_table,
                "added": t.added, "widened": [{"column": c, "from": a, "to": b} for c, a, b in t.widened],
                "dropped": t.dropped, "dropped_columns": t.dropped_columns, "key": t.key,
                "key_change": None if t.key_before is None else {"from": t.key_before, "to": t.key},
                "refusal": t.refusal,
            }
            for t in w.tables
        },
        "refused": bool(w.refusals),
    }


__all__ = ["SCHEMA_VERSION", "PlanReport", "TablePlan", "WindowPlan", "plan", "plan_job", "to_json"]
