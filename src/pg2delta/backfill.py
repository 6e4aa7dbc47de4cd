"""``pg2delta backfill``: re-apply the changelog's changes of an LSN range to Delta tables.

``backfill(config, A, B, tables, into)`` replays, table by table, the changelog rows whose
commit LSN is in ``[A, B)``, in commit order, through the same reduce and MERGE as the run
(:func:`pg2delta.apply.table.merge_changes`), in chunks of about ``window.max_changes`` rows that
follow the windows the changelog log recorded. No database connection is needed.

Where the changes land, and from which state:

* ``into=PATH``: a copy at ``PATH/<schema>/<table>``. A missing copy is first seeded with the
  main table as of the last window the applied log recorded for it ending at or before ``A``
  (Delta time travel to that window's version; empty when there is none), and the changelog is
  replayed from that window's end. So the copy equals the main table as of ``B`` whenever ``B``
  is a window end. Every chunk is recorded in ``PATH/_pg2delta/applied_log``, so a backfill that
  stopped half-way continues, and the same backfill run again changes nothing.
* in place (no ``into``): the main table, only when that cannot produce a state the table never
  had. Its current Delta version must be the one the applied log recorded for its latest window
  (nothing outside pg2delta wrote to it since), and that window's end ``P`` must lie in
  ``[A, B]``: a table behind ``A`` would miss the changes in ``[P, A)``, a table past ``B`` would
  have some rows moved back in time. Only changes at or after ``P`` are applied (those before
  are in the table), so on a lake the job keeps current this changes nothing; it brings forward
  a table whose last MERGE failed after its changelog commit.

Refused with a one-line error before anything is written (exit 78): ``A >= B``; ``A`` before the
lake's start (the first window the lake recorded); ``B`` past the last window it recorded; a
table without a changelog; a range in which the applied log names a window that changed the
table but the changelog log does not (the changelog was off then, or started later).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.apply.changelog import CHANGELOG_LOG, TRUNCATE_OP, changelog_path
from pg2delta.apply.lakeside import Lakeside, LakeWriter
from pg2delta.apply.rowmeta import row_columns, soft_deletes
from pg2delta.apply.table import TableReport, merge_changes
from pg2delta.config import Config
from pg2delta.decode.changes import LSN_COL, META_NAMES, OP_COL, POS_COL, TS_COL
from pg2delta.errors import ConfigError, LakeError
from pg2delta.faults import fault_point
from pg2delta.lake.applied_log import KIND_BACKFILL, LOG_SCHEMA, LOG_TABLE, LoggedTable, log_row
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.types import spark_type, widens
from pg2delta.lsn import format_lsn
from pg2delta.progress import Progress, percent

log = logging.getLogger(__name__)


@dataclass
class TableBackfill:
    schema: str
    table: str
    path: str
    start_lsn: int  # where the replay started (the copy's seed, or the table's applied LSN)
    end_lsn: int
    seed_version: int | None = None  # the main table's version the copy was seeded from
    chunks: int = 0
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    truncated: bool = False
    delta_version: int | None = None
    changed: bool = False


@dataclass
class BackfillReport:
    from_lsn: int
    to_lsn: int
    into: str | None
    tables: list[TableBackfill] = field(default_factory=list)

    @property
    def nothing_to_do(self) -> bool:
        return not any(t.changed for t in self.tables)


@dataclass(frozen=True)
class _Plan:
    schema: str
    table: str
    oid: int
    key_names: tuple[str, ...]
    start: int  # replay changelog rows with LSN in [start, B)
    seed_version: int | None  # copy the main table at this version first (into, missing copy)
    seed: bool
    lookup: int  # the version unchanged TOAST is first read at (-1: the table is new, nothing)
    windows: tuple[tuple[int, int, int, tuple[str, ...], tuple[str, ...]], ...]  # changelog windows (start, end, rows, columns, key)


def _same_place(a: str, b: str) -> bool:
    """Whether two lake roots name the same place (local paths compared after resolving them)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _rows_of(engine: Engine, uri: str, slot: str) -> list[dict[str, Any]]:
    return [r for r in engine.read_table(uri) if r.get("slot") == slot and r.get("relation_oid") is not None]


def _latest(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The row of the latest window (ties: the latest written)."""
    if not rows:
        return None
    return max(rows, key=lambda r: (int(r["window_end"]), str(r.get("applied_at") or "")))


def backfill(
    config: Config,
    from_lsn: int,
    to_lsn: int,
    *,
    tables: Sequence[str] = (),
    into: str | None = None,
    engine: Engine | None = None,
) -> BackfillReport:
    """Re-apply the changelog's changes in ``[from_lsn, to_lsn)``; see the module docstring."""
    if from_lsn >= to_lsn:
        raise ConfigError(f"--from-lsn {format_lsn(from_lsn)} must be before --to-lsn {format_lsn(to_lsn)}")
    for name in tables:
        if name.count(".") < 1 or name.startswith(".") or name.endswith("."):
            raise ConfigError(f"--table {name!r} must be schema.table")
    lake = Lake(config.lake_root)
    target_lake = Lake(into) if into else lake
    if into and _same_place(target_lake.root, lake.root):
        raise ConfigError("--into must be another path than the lake itself (leave it out to backfill in place)")
    own_engine = engine is None
    eng = engine or Engine.start(config.engine, lake)
    try:
        plans = _plan(config, eng, lake, target_lake, from_lsn, to_lsn, tables, into is not None)
        if into:
            target_lake.check_writable()
        return _apply(config, eng, lake, target_lake, from_lsn, to_lsn, plans, into)
    finally:
        if own_engine:
            eng.stop()


def _plan(
    config: Config,
    engine: Engine,
    lake: Lake,
    target_lake: Lake,
    a: int,
    b: int,
    wanted: Sequence[str],
    into: bool,
) -> list[_Plan]:
    """Every check, before anything is written."""
    slot = config.source.slot
    applied = _rows_of(engine, lake.table_uri(LOG_TABLE), slot)
    cl_log = _rows_of(engine, lake.table_uri(CHANGELOG_LOG), slot)
    lake_start = _check_range(lake, slot, applied + cl_log, a, b)
    names = _tables_wanted(lake, cl_log, wanted)
    target_log = _rows_of(engine, target_lake.table_uri(LOG_TABLE), slot) if into else applied
    plans = []
    for schema, table in names:
        mine_cl = [r for r in cl_log if (r["schema_name"], r["table_name"]) == (schema, table)]
        mine_applied = [r for r in applied if (r["schema_name"], r["table_name"]) == (schema, table)]
        mine_target = [r for r in target_log if (r["schema_name"], r["table_name"]) == (schema, table)]
        start, seed_version, lookup = _starting_point(
            engine, lake, target_lake, schema, table, mine_applied, mine_target, lake_start, a, b, into
        )
        _check_changelog_covers(f"{schema}.{table}", mine_cl, mine_applied, start, b)
        windows = tuple(
            sorted(
                {
                    (
                        int(r["window_start"]), int(r["window_end"]), int(r["rows"] or 0),
                        tuple(r.get("columns") or ()), tuple(r.get("key_names") or ()),
                    )
                    for r in mine_cl
                    if int(r["window_end"]) > start and int(r["window_start"]) < b
                }
            )
        )
        latest_cl = _latest(mine_cl)
        assert latest_cl is not None
        plans.append(
            _Plan(
                schema, table, int(latest_cl["relation_oid"]), tuple(latest_cl["key_names"] or ()),
                start, seed_version, seed_version is not None, lookup, windows,
            )
        )
    return plans


def _check_range(lake: Lake, slot: str, everything: list[dict[str, Any]], a: int, b: int) -> int:
    """[a, b) within the windows the lake recorded; the lake's start."""
    if not everything:
        raise LakeError(f"the lake at {lake.root} has recorded no window for slot {slot!r}: nothing to backfill from")
    lake_start = min(int(r["window_start"]) for r in everything)
    lake_end = max(int(r["window_end"]) for r in everything)
    if a < lake_start:
        raise LakeError(
            f"--from-lsn {format_lsn(a)} is earlier than the lake's start {format_lsn(lake_start)} "
            "(the first window it recorded): the changes before it were never read"
        )
    if b > lake_end:
        raise LakeError(
            f"--to-lsn {format_lsn(b)} is past the last window the lake recorded ({format_lsn(lake_end)}): "
            "run pg2delta run first"
        )
    return lake_start


def _tables_wanted(lake: Lake, cl_log: list[dict[str, Any]], wanted: Sequence[str]) -> list[tuple[str, str]]:
    """The tables asked for (all with a changelog when none is), each with a changelog."""
    with_changelog = sorted({(str(r["schema_name"]), str(r["table_name"])) for r in cl_log})
    if not wanted:
        if not with_changelog:
            raise LakeError(f"no table of the lake at {lake.root} has a changelog")
        return with_changelog
    names: list[tuple[str, str]] = []
    for w in wanted:
        schema, table = w.split(".", 1)
        if (schema, table) not in with_changelog:
            raise LakeError(
                f"table {w} has no changelog in {lake.root} (set [tables.\"{w}\"] changelog = true; "
                "it covers changes from then on)"
            )
        if (schema, table) not in names:
            names.append((schema, table))
    return names


def _starting_point(
    engine: Engine,
    lake: Lake,
    target_lake: Lake,
    schema: str,
    table: str,
    mine_applied: list[dict[str, Any]],
    mine_target: list[dict[str, Any]],
    lake_start: int,
    a: int,
    b: int,
    into: bool,
) -> tuple[int, int | None, int]:
    """Where the table's replay starts: (LSN, the main table's version a new copy is seeded from,
    the target's version unchanged TOAST is looked up in, -1 for none)."""
    qualified = f"{schema}.{table}"
    target_uri = target_lake.table_uri(schema, table)
    current = target_lake.delta_version(target_uri)
    if current is None:
        if not into:
            raise LakeError(
                f"table {qualified} does not exist at {target_uri}: backfill in place needs it; "
                "rebuild it with --into PATH"
            )
        # Seed from the main table as the last window at or before A left it.
        before = [r for r in mine_applied if int(r["window_end"]) <= a and r.get("delta_version") is not None]
        base = _latest(before)
        seed_version = int(base["delta_version"]) if base else None
        if seed_version is not None:
            engine.check_version(lake.table_uri(schema, table), seed_version)
        return (int(base["window_end"]) if base else lake_start), seed_version, -1
    last = _latest(mine_target)
    logged_version = None if last is None or last.get("delta_version") is None else int(last["delta_version"])
    # A copy is pg2delta's own: commits after its last logged chunk can only be the next
    # chunk's, interrupted, and re-applying that chunk from its start is idempotent. A table
    # in place must be exactly where the applied log says.
    resumable = into and last is not None and (logged_version is None or logged_version <= current)
    if not resumable and logged_version != current:
        where = "not made by pg2delta backfill, or its seed was interrupted; remove it and run again" if into else (
            "changed outside pg2delta, or a run stopped after its MERGE; run pg2delta run first"
        )
        raise LakeError(
            f"table {qualified} at {target_uri} is at Delta version {current}, which the applied log "
            f"does not record: {where}"
        )
    assert last is not None
    start = int(last["window_end"])
    # A copy was seeded at or before A and is replayed from where it stands.
    if start < a and not into:
        raise LakeError(
            f"table {qualified} is at {format_lsn(start)}, before --from-lsn {format_lsn(a)}: re-applying "
            f"from there would skip the changes in between; use --from-lsn {format_lsn(start)} or earlier"
        )
    if start > b:
        raise LakeError(
            f"table {qualified} is already at {format_lsn(start)}, past --to-lsn {format_lsn(b)}: re-applying "
            "older changes would move rows back in time; backfill --into a fresh path instead"
        )
    return start, None, (-1 if logged_version is None else logged_version)


def _check_changelog_covers(
    qualified: str, mine_cl: list[dict[str, Any]], mine_applied: list[dict[str, Any]], start: int, b: int
) -> None:
    """The changelog must hold every window that changed the table in [start, b)."""
    logged = {(str(r["run_id"]), int(r["window_end"])) for r in mine_cl}
    for r in sorted(mine_applied, key=lambda r: int(r["window_end"])):
        ws, we = int(r["window_start"]), int(r["window_end"])
        if we > start and ws < b and (str(r["run_id"]), we) not in logged:
            first = min((int(c["window_start"]) for c in mine_cl), default=None)
            since = f"; its changelog starts at {format_lsn(first)}" if first is not None else ""
            raise LakeError(
                f"the changelog of {qualified} does not cover {format_lsn(max(ws, start))}..{format_lsn(min(we, b))}: "
                f"the window {format_lsn(ws)}..{format_lsn(we)} changed the table but is not in its changelog{since}"
            )


def _chunks(plan: _Plan, b: int, max_rows: int) -> list[tuple[int, int, tuple[str, ...], tuple[str, ...]]]:
    """[lo, hi) LSN ranges from ``plan.start`` to ``b`` along window ends, about ``max_rows`` rows each
    (1 for soft deletes: window by window, as the run applied them, a row inserted and deleted in one never lands),
    with the columns their MERGEs set and the key they merged on: a chunk never spans windows whose
    MERGEs set different columns or used different keys (a delete sent before a primary-key change
    carries only the old key's columns)."""
    out: list[tuple[int, int, tuple[str, ...], tuple[str, ...]]] = []
    lo, rows = plan.start, 0
    columns: tuple[str, ...] = ()
    key: tuple[str, ...] | None = None
    for ws, end, n, cols, wkey in plan.windows:
        # A window replayed after a crash that came after its changelog commit is logged with 0
        # rows appended (they were appended before the crash) but with its columns and key.
        if cols and columns and (cols, wkey) != (columns, key) and lo < ws < b:
            out.append((lo, ws, columns, plan.key_names if key is None else key))
            lo, rows = ws, 0
        if cols:
            columns, key = cols, wkey
        rows += n
        if rows >= max_rows and lo < end < b:
            out.append((lo, end, columns, plan.key_names if key is None else key))
            lo, rows = end, 0
    out.append((lo, b, columns, plan.key_names if key is None else key))
    return out


def _apply(
    config: Config,
    engine: Engine,
    lake: Lake,
    target_lake: Lake,
    a: int,
    b: int,
    plans: list[_Plan],
    into: str | None,
) -> BackfillReport:
    report = BackfillReport(a, b, into)
    run_id = f"backfill-{uuid.uuid4().hex}"
    target_config = dataclasses.replace(config, lake_root=target_lake.root)
    # The target's engine: staging (changelog slices, MERGE sources) goes under the target lake,
    # so a backfill --into writes nothing into the lake it reads.
    side = Lakeside(target_config, engine_factory=engine.with_lake)
    try:
        with _progress(plans, b) as progress:
            for plan in plans:
                _apply_one(config, engine, lake, target_lake, b, plan, into, side.writer, run_id, report, progress)
    finally:
        side.lake.unstage_dir(run_id)  # the backfill's staging folder: its files go as they are used
    return report


def _progress(plans: Sequence[_Plan], b: int) -> Progress:
    """Through the LSN ranges replayed, table after table: a bar on a terminal, log lines otherwise."""

    def line(p: Progress) -> str:
        eta = p.eta()
        return (
            f"backfill: {p.rows} changelog rows replayed, {p.rate():.0f} rows/s, {percent(p.position, p.total)} "
            f"of the LSN ranges" + (f", eta {eta:.0f} s" if eta is not None else "")
        )

    total = sum(b - plan.start for plan in plans if plan.start < b)
    return Progress("backfill", total=total, unit="B", bytes_unit=True, logger=log, line=line)


def _apply_one(
    config: Config,
    engine: Engine,
    lake: Lake,
    target_lake: Lake,
    b: int,
    plan: _Plan,
    into: str | None,
    to: LakeWriter,
    run_id: str,
    report: BackfillReport,
    progress: Progress,
) -> None:
    uri = target_lake.table_uri(plan.schema, plan.table)
    result = TableBackfill(plan.schema, plan.table, uri, plan.start, b, plan.seed_version)
    report.tables.append(result)
    if plan.seed:
        _seed(engine, lake, to, config.source.slot, uri, plan, run_id)
        result.changed = True
    # A new copy is marked as this backfill's in its log before its first write (see _plan).
    unmarked = into is not None and target_lake.delta_version(uri) is None
    lookup = target_lake.delta_version(uri) if plan.seed else plan.lookup
    cl_uri = lake.table_uri(changelog_path(plan.schema, plan.table))
    nullable_keys, soft = bool(config.table(plan.schema, plan.table).key), soft_deletes(config, plan.schema, plan.table)
    for lo, hi, columns, key in _chunks(plan, b, 1 if soft else config.window.max_changes) if plan.start < b else []:
        rows = to.engine.read_arrow(cl_uri, f"`{LSN_COL}` >= {lo} AND `{LSN_COL}` < {hi}")
        if rows.num_rows and columns:
            rows = rows.select([c for c in rows.column_names if c in META_NAMES or c in columns])
        tr = TableReport(plan.schema, plan.table, uri)
        before = target_lake.delta_version(uri)
        changes: pa.Table | None = None
        if rows.num_rows:
            rows = rows.sort_by([(LSN_COL, "ascending"), (POS_COL, "ascending")])
            changes, tr.truncates_at = _after_last_truncate(rows, whole=soft)
            tr.truncated = bool(tr.truncates_at)
            if unmarked:
                _log(to, config.source.slot, run_id, plan, plan.start, plan.start, TableReport(plan.schema, plan.table, uri))
                unmarked = False
            merge_changes(
                to, tr, run_id, changes, list(key), [c for c in rows.column_names],
                meta=row_columns(config, plan.schema, plan.table), nullable_keys=nullable_keys, lookup_version=lookup,
                reshape=functools.partial(_widen, to.engine, uri, rows.schema),
            )
            fault_point("backfill_after_merge")
            tr.delta_version = target_lake.delta_version(uri)
            if tr.delta_version != before:
                result.changed = True
        else:
            tr.delta_version = target_lake.delta_version(uri)
        _add_chunk(result, tr)
        if tr.delta_version is not None and (into or tr.delta_version != before):
            _log(to, config.source.slot, run_id, plan, lo, hi, tr)
            lookup = tr.delta_version
        progress.advance(hi - lo, rows=progress.rows + rows.num_rows)
    result.delta_version = target_lake.delta_version(uri)
    log.info(
        "backfilled %s.%s %s..%s into %s: %d inserts, %d updates, %d deletes -> delta version %s",
        plan.schema, plan.table, format_lsn(plan.start), format_lsn(b), uri,
        result.inserts, result.updates, result.deletes, result.delta_version,
    )


def _seed(engine: Engine, lake: Lake, to: LakeWriter, slot: str, uri: str, plan: _Plan, run_id: str) -> None:
    """Start the copy at ``uri`` (in ``to``'s lake) from the table's version ``plan.seed_version``
    in ``lake`` (read by ``engine``), and log it in ``slot``'s rows of ``to``'s applied log."""
    assert plan.seed_version is not None
    # Created by the copy's lake's engine: with the table's configured partitions and properties.
    engine.copy_table(lake.table_uri(plan.schema, plan.table), plan.seed_version, uri, creator=to.engine)
    log.info("seeded %s from %s.%s at version %d", uri, plan.schema, plan.table, plan.seed_version)
    _log(to, slot, run_id, plan, plan.start, plan.start, TableReport(plan.schema, plan.table, uri))


def _after_last_truncate(rows: pa.Table, *, whole: bool = False) -> tuple[pa.Table, tuple[tuple[int, int, int | None], ...]]:
    """The changes of ``rows`` (changelog rows in commit order) after its last truncate (``whole``:
    all of them, for soft deletes), and its truncates' commit LSNs, positions and times."""
    is_trunc = pc.equal(rows.column(OP_COL), TRUNCATE_OP)
    truncs = rows.filter(is_trunc)
    changes = rows.filter(pc.invert(is_trunc))
    at = tuple(zip(truncs.column(LSN_COL).to_pylist(), truncs.column(POS_COL).to_pylist(),
                   truncs.column(TS_COL).cast(pa.int64()).to_pylist(), strict=True))
    if not at or whole:
        return changes, at
    last_lsn, last_pos, _ = at[-1]
    lsn, pos = changes.column(LSN_COL), changes.column(POS_COL)
    after = pc.or_(pc.greater(lsn, last_lsn), pc.and_(pc.equal(lsn, last_lsn), pc.greater(pos, last_pos)))
    return changes.filter(after), at


def _add_chunk(result: TableBackfill, tr: TableReport) -> None:
    """Count one chunk's changes in the table's result."""
    result.chunks += 1
    result.inserts += tr.inserts
    result.updates += tr.updates
    result.deletes += tr.deletes
    result.truncated |= tr.truncated


def _widen(engine: Engine, uri: str, schema: pa.Schema) -> frozenset[str] | None:
    """Widen the copy's columns the changelog slice holds wider (the changelog follows the source's
    widenings by rewriting, so older slices carry the newer, wider types): one rewrite, as the run
    widens the main table; a MERGE or ``mergeSchema`` append cannot widen a Delta column."""
    current = engine.table_types(uri)
    if current is None:
        return None
    casts = {
        f.name: new
        for f in schema
        if f.name in current and (new := spark_type(f.type)) != current[f.name] and widens(current[f.name], new)
    }
    if casts:
        engine.rewrite(uri, casts)
    return frozenset(current)


def _log(to: LakeWriter, slot: str, run_id: str, plan: _Plan, lo: int, hi: int, tr: TableReport) -> None:
    """Record a chunk in the applied log of ``to``'s lake, the target's (the seed as an empty window at its LSN)."""
    logged = LoggedTable(plan.oid, plan.schema, plan.table, to.lake.delta_version(tr.path), tr.inserts,
                         tr.updates, tr.deletes, tr.truncated, None, None, None, None, None)
    row = log_row(slot, run_id, lo, hi, logged, kind=KIND_BACKFILL)
    to.engine.append(to.lake.table_uri(LOG_TABLE), pa.Table.from_pylist([row], schema=LOG_SCHEMA))
