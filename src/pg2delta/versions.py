"""``pg2delta versions --at-lsn X/Y``: the Delta version of each table that holds the source's state at an LSN.

The applied log (``<lake>/_pg2delta/applied_log``) records, per table, every window a run applied
(``[window_start, window_end)``, one Delta commit: it holds every change of the table whose commit
LSN is before ``window_end``) and every copy (``kind = 'bootstrap'``: the table as of the copy's
snapshot LSN, as a bootstrap, a table added to the publication later, or a resync made it). So,
for a table and an LSN ``X``:

* ``X`` is a logged point (a window's end, a copy's LSN): the version that window or copy made;
* ``X`` lies after the table's last logged point ``P`` and before its next logged window starts
  (or anywhere up to where the lake is applied through): the table did not change in ``[P, X)``
  (every window a run applied that touched it is logged), so the version made at ``P``;
* ``X`` lies strictly inside a window that changed the table: that window's one commit holds the
  changes before and after ``X`` together, and no version holds the state at ``X`` (status
  ``inside_window``, with the window, whose start and end do have versions);
* ``X`` lies between a logged point and a later copy of the table (a resync, or a slot bootstrapped
  again): the changes in between were never applied one by one (``copied_again``);
* ``X`` lies before the table's first copy or the end of the first window that created it in the
  lake (``not_in_lake``), or after every window the lake is known to be applied through
  (``not_applied``: run ``pg2delta run --until-lsn X`` first).

"Applied through" is the largest window end the applied log holds (or the bootstrap's start), and,
when a source DSN is configured, the slot's ``confirmed_flush_lsn``, read *before* the applied log:
the slot moves only after every window up to its position is committed and logged, and a window
with no changes for the publication logs nothing.

A window that skipped a table (changes already applied) logs nothing for it; one logged without a
Delta version (all of its changes were before the table's copy) made no commit: the previous version
still holds. :func:`open_at_lsn` registers Spark temporary views of the tables at those versions, so
joins see one consistent state of the source.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pg2delta.config import Config
from pg2delta.errors import LakeError
from pg2delta.lake.applied_log import KIND_BOOTSTRAP, LOG_TABLE
from pg2delta.lsn import format_lsn

EXACT = "exact"
INSIDE_WINDOW = "inside_window"
COPIED_AGAIN = "copied_again"
NOT_IN_LAKE = "not_in_lake"
NOT_APPLIED = "not_applied"
STATUSES = (EXACT, INSIDE_WINDOW, COPIED_AGAIN, NOT_IN_LAKE, NOT_APPLIED)


@dataclass(frozen=True, slots=True)
class _Point:
    """A logged state of one Delta table: its version holds the source's state at ``lsn``."""

    lsn: int  # a window's end, or a copy's snapshot LSN
    version: int | None  # None: no Delta table yet
    copy: bool
    start: int  # a window: where its changes of the table begin (its start, or the previous point); a copy: lsn


@dataclass(frozen=True, slots=True)
class TableAt:
    """One table's answer for an LSN."""

    schema: str
    table: str
    status: str  # one of STATUSES
    delta_version: int | None  # set exactly when status == EXACT
    as_of_lsn: int | None = None  # EXACT: the logged point (window end or copy) whose version it is
    window: tuple[int, int] | None = None  # INSIDE_WINDOW: the window [start, end) that holds X
    message: str = ""

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


@dataclass
class VersionsReport:
    lsn: int
    slot: str
    lake_root: str
    applied_through: int | None
    slot_confirmed_lsn: int | None = None
    tables: list[TableAt] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(t.status == EXACT for t in self.tables)


def applied_through(rows: Iterable[Mapping[str, Any]], slot: str) -> int | None:
    """How far every change of ``slot`` is known to be in the lake, from the applied log alone:
    the largest window end, or the lake's start (a bootstrap's row without a table)."""
    ends = [
        int(r["window_end"])
        for r in rows
        if r.get("slot") == slot
        and r.get("window_end") is not None
        and ((r.get("kind") != KIND_BOOTSTRAP and r.get("relation_oid") is not None)
             or (r.get("kind") == KIND_BOOTSTRAP and r.get("relation_oid") is None))
    ]
    return max(ends, default=None)


def _points(rows: Sequence[Mapping[str, Any]]) -> list[_Point]:
    """One table's logged states in the order they were made."""

    def order(r: Mapping[str, Any]) -> tuple[int, int, int]:
        version = r.get("delta_version")
        return int(r["window_end"]), -1 if version is None else int(version), int(r.get("kind") == KIND_BOOTSTRAP)

    points: list[_Point] = []
    for r in sorted(rows, key=order):
        end = int(r["window_end"])
        version = None if r.get("delta_version") is None else int(r["delta_version"])
        if r.get("kind") == KIND_BOOTSTRAP:
            points.append(_Point(end, version, True, end))
            continue
        previous = points[-1] if points else None
        if version is None and previous is not None:
            version = previous.version  # nothing committed: the previous version still holds
        # A replayed or straddling window only applied the table's changes after its previous point.
        start = max(int(r["window_start"]), previous.lsn) if previous is not None else int(r["window_start"])
        points.append(_Point(end, version, False, start))
    return points


def table_at(schema: str, table: str, points: Sequence[_Point], lsn: int, through: int | None) -> TableAt:
    """Which version of one table holds the source's state at ``lsn`` (see the module docstring)."""
    at = format_lsn(lsn)
    for p in points:
        if not p.copy and p.start < lsn < p.lsn:
            return TableAt(
                schema, table, INSIDE_WINDOW, None, window=(p.start, p.lsn),
                message=(
                    f"{at} falls inside the window {format_lsn(p.start)}..{format_lsn(p.lsn)} that changed the table "
                    "in one Delta commit: no version holds its state at that LSN (the window's start and end do)"
                ),
            )
    before = [p for p in points if p.lsn <= lsn]
    if not before or before[-1].version is None:
        first = next((p for p in points if p.version is not None), None)
        where = f"; its first state in the lake is at {format_lsn(first.lsn)}" if first is not None else ""
        return TableAt(schema, table, NOT_IN_LAKE, None, message=f"the lake holds no state of the table at {at}{where}")
    last = before[-1]
    if last.lsn < lsn:
        after = [p for p in points if p.lsn > lsn]
        if after and after[0].copy:
            return TableAt(
                schema, table, COPIED_AGAIN, None,
                message=(
                    f"the table was copied again as of {format_lsn(after[0].lsn)}; its changes between "
                    f"{format_lsn(last.lsn)} and then were never applied one by one, so no version holds {at}"
                ),
            )
        if not after and (through is None or through < lsn):
            return TableAt(
                schema, table, NOT_APPLIED, None,
                message=(
                    f"the lake is applied through {format_lsn(through) if through is not None else 'nothing'} only: "
                    f"run pg2delta run --until-lsn {at} first"
                ),
            )
    return TableAt(schema, table, EXACT, last.version, as_of_lsn=last.lsn)


def versions_at(
    rows: Iterable[Mapping[str, Any]], slot: str, lsn: int, *, lake_root: str = "", slot_confirmed: int | None = None
) -> VersionsReport:
    """Per Delta table of ``slot`` in the applied log ``rows``: the version holding the source's state at ``lsn``.

    ``slot_confirmed``: the slot's ``confirmed_flush_lsn``, read before ``rows`` (None: unknown).
    """
    rows = [r for r in rows if r.get("slot") == slot]
    through = applied_through(rows, slot)
    if slot_confirmed is not None:
        through = slot_confirmed if through is None else max(through, slot_confirmed)
    per_table: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("relation_oid") is None or r.get("window_end") is None or not r.get("table_name"):
            continue  # a bootstrap's start
        per_table[(str(r.get("schema_name") or ""), str(r["table_name"]))].append(r)
    report = VersionsReport(lsn, slot, lake_root, through, slot_confirmed)
    for (schema, table), mine in sorted(per_table.items()):
        report.tables.append(table_at(schema, table, _points(mine), lsn, through))
    return report


def to_json(report: VersionsReport) -> dict[str, Any]:
    """The ``--json`` form (``schema_version`` 1; see docs/commands/versions.md)."""
    root = report.lake_root.rstrip("/")
    return {
        "schema_version": 1,
        "at_lsn": format_lsn(report.lsn),
        "slot": report.slot,
        "applied_through": None if report.applied_through is None else format_lsn(report.applied_through),
        "slot_confirmed_lsn": None if report.slot_confirmed_lsn is None else format_lsn(report.slot_confirmed_lsn),
        "exact": report.exact,
        "tables": {
            t.name: {
                "status": t.status,
                "delta_version": t.delta_version,
                "path": f"{root}/{t.schema}/{t.table}",
                "as_of_lsn": None if t.as_of_lsn is None else format_lsn(t.as_of_lsn),
                "window": None if t.window is None else {
                    "start_lsn": format_lsn(t.window[0]), "end_lsn": format_lsn(t.window[1]),
                },
                "message": t.message or None,
            }
            for t in report.tables
        },
    }


# --- the command and the Spark helper -----------------------------------------------------------


def versions(config: Config, lsn: int) -> VersionsReport:
    """``pg2delta versions --at-lsn``: read the slot's position (when a DSN is set), then the applied log."""
    from pg2delta.lake.engine import Engine, Lake
    confirmed: int | None = None
    if config.source.dsn:
        from pg2delta.source.slot import SlotSource

        # Before the applied log: every window up to this position is in what is read next.
        with SlotSource(
            config.source.dsn, config.source.slot, config.source.publication, connect_timeout=config.source.connect_timeout
        ) as src:
            info = src.slot_info()
        confirmed = info.confirmed_flush_lsn if info is not None else None
    lake = Lake(config.lake_root)
    uri = lake.table_uri(LOG_TABLE)
    if lake.delta_version(uri) is None:
        raise LakeError(f"no applied log at {uri}: nothing was applied to this lake yet")
    engine = Engine.start(config.engine, lake)
    try:
        rows = engine.read_table(uri)
    finally:
        engine.stop()
    return versions_at(rows, config.source.slot, lsn, lake_root=config.lake_root, slot_confirmed=confirmed)


def open_at_lsn(
    spark: Any, lake_root: str, lsn: int | str, *, slot: str = "pg2delta", tables: Sequence[str] | None = None
) -> dict[str, int]:
    """Register a temporary view ``<schema>_<table>`` of each table as of the source's state at ``lsn``.

    ``spark``: a SparkSession (classic or Spark Connect) that reads Delta; ``lsn``: ``"X/Y"`` or an
    int; ``tables``: ``"schema.table"`` names (default: every table of ``slot`` in the applied log).
    Returns the views' names with the Delta version each reads. Raises :class:`LakeError`, and
    registers nothing, when a table has no version that holds the state at ``lsn`` (see
    :func:`versions_at`); the lake alone decides, so ``lsn`` must be at most the last window end
    the applied log records. Views read with ``versionAsOf`` (or, where the engine cannot
    time-travel that far back, the files of that version, as the job itself does).
    """
    from pg2delta.lake.engine import Engine, Lake
    from pg2delta.lsn import parse_lsn

    at = parse_lsn(lsn) if isinstance(lsn, str) else lsn
    lake = Lake(lake_root)
    engine = Engine(spark, lake)
    uri = lake.table_uri(LOG_TABLE)
    if lake.delta_version(uri) is None:
        raise LakeError(f"no applied log at {uri}: nothing was applied to this lake yet")
    report = versions_at(engine.read_table(uri), slot, at, lake_root=lake_root)
    found = {t.name: t for t in report.tables}
    wanted = list(tables) if tables is not None else sorted(found)
    missing = [n for n in wanted if n not in found]
    if missing:
        raise LakeError(f"not in the applied log of slot {slot!r} at {lake_root}: {', '.join(missing)}")
    inexact = [found[n] for n in wanted if found[n].status != EXACT]
    if inexact:
        raise LakeError(
            f"no Delta version holds the source's state at {format_lsn(at)} for "
            + "; ".join(f"{t.name} ({t.status}: {t.message})" for t in inexact)
        )
    views: dict[str, int] = {}
    frames = []
    for name in wanted:
        t = found[name]
        assert t.delta_version is not None
        frames.append((f"{t.schema}_{t.table}", engine.read_version(lake.table_uri(t.schema, t.table), t.delta_version)))
        views[f"{t.schema}_{t.table}"] = t.delta_version
    for view, frame in frames:
        frame.createOrReplaceTempView(view)
    return views
