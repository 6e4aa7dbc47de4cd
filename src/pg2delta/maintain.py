"""``pg2delta maintain``: what running every few minutes for a year does to a lake, undone.

Every window adds at least one data file and one commit to each table it touches, to the applied
log and to the changelogs. For every Delta table of the lake (the tables the applied log names and
their SCD2 histories, the applied log itself, each changelog and the changelog log), maintenance

1. deletes changelog rows committed longer ago than ``[maintain] changelog_retention`` (if set);
2. on Apache Spark, turns deletion vectors on for the tables and their SCD2 histories (which take
   MERGEs) that do not use them yet, unless ``[lake] deletion_vectors = false``;
3. makes each table keep its log (``delta.logRetentionDuration``) as long as VACUUM keeps its files
   (:meth:`pg2delta.lake.engine_features.TableFeatures.keep_log_for`): time travel needs both, and
   Delta's 30 days of log are some 9,000 commits a reader lists on a five-minute schedule;
4. compacts the small files into large ones, in one commit that changes no row (Delta's
   ``OPTIMIZE`` on Apache Spark, delta-rs's compaction on the other engines);
5. removes the files no version younger than ``[maintain] retention`` needs (``VACUUM``; default
   7 days, so time travel, ``pg2delta versions --at-lsn`` and backfill seeds keep working inside it);
6. writes a checkpoint of the log where the engine does not (a checkpoint is also when Delta
   removes the commits older than the log's retention);

then removes what crashed runs left in the staging area (older than an hour) and records when it
maintained each table (``_pg2delta/maintain.json``).

``pg2delta run`` maintains too, by default (:func:`maintain_due`): after its windows, the tables
maintained longer ago than ``[maintain] interval`` (1 hour), at most ``tables_per_run`` of them,
the longest-waiting first, and none more once ``run_budget`` has passed. So a job run every five
minutes keeps each table's files and log bounded with nothing else scheduled, and no run pays for
the whole lake. The slot has moved past the run's windows before, so nothing maintenance does
touches exactly-once: a run killed during it reruns its windows as already applied.

It holds the slot's advisory lock, like a run, so it never overlaps one (a run started meanwhile
exits 73, and maintenance started during a run exits 73). Each step is one Delta commit or the
removal of files no version in the retention needs, so killing it at any point leaves every table
readable and equal in rows; running it again finishes the work.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from pg2delta.apply.changelog import CHANGELOG_LOG, CHANGELOG_ROOT
from pg2delta.apply.history import history_table
from pg2delta.apply.lakeside import Lakeside
from pg2delta.config import Config, duration_seconds
from pg2delta.decode.changes import TS_COL
from pg2delta.errors import LakeError
from pg2delta.faults import fault_point
from pg2delta.lake import digests
from pg2delta.lake.applied_log import DIGEST, LOG_TABLE, newest, table_names
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.sql import quote
from pg2delta.source.slot import SlotSource

log = logging.getLogger(__name__)

MARKER = "_pg2delta/maintain.json"
STAGING = "_pg2delta/staging"
STAGING_AGE = 3600  # seconds: staging entries older than this belong to runs that are over
# Test and bench hook: seconds added to the clock that schedules maintenance, so that a bench can
# run a year of five-minute runs in an hour as a scheduler would space them. Nothing else reads it.
CLOCK_ENV = "PG2DELTA_MAINTAIN_CLOCK_OFFSET"


@dataclass
class TableMaintenance:
    name: str  # "schema.table", or the lake's own table ("_pg2delta/applied_log", ...)
    uri: str
    files_before: int = 0
    files_after: int = 0
    files_removed: int = 0  # by VACUUM (-1: the engine does not say; Apache Spark on S3)
    changelog_rows_deleted: bool = False
    checkpoint: bool = False
    stats_columns_set: bool = False  # the table's statistics columns were set (an older table)
    deletion_vectors_enabled: bool = False  # the table uses deletion vectors from this run on (Apache Spark)
    log_retention_set: str | None = None  # the delta.logRetentionDuration set on the table, if it changed


@dataclass
class MaintainReport:
    tables: list[TableMaintenance] = field(default_factory=list)
    staging_removed: int = 0
    seconds: float = 0.0


def maintain(config: Config) -> MaintainReport:
    """``pg2delta maintain``: take the slot's lock, then :func:`maintain_lake`."""
    with SlotSource(
        config.source.dsn, config.source.slot, config.source.publication, connect_timeout=config.source.connect_timeout
    ) as src:
        src.lock()
        job = Lakeside(config)
        try:
            job.lake.own_staging(config.source.slot)
            job.lake.check_writable()
            return maintain_lake(config, job.engine, job.lake)
        finally:
            job.close()


def clock() -> float:
    """Now, in seconds since 1970, as maintenance schedules it (see :data:`CLOCK_ENV`)."""
    return time.time() + float(os.environ.get(CLOCK_ENV) or 0)


def read_marker(lake: Lake) -> dict[str, Any] | None:
    """``_pg2delta/maintain.json``: ``started_at`` (when runs first looked), ``finished_at`` (the
    last maintenance), ``next_due`` and per table ``maintained_at``; None when there is none."""
    try:
        with lake.fs.open_input_stream(f"{lake.path}/{MARKER}") as f:
            marker = json.loads(f.read().decode())
        if not isinstance(marker, dict):
            raise ValueError("not an object")
        return marker
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException, ValueError) as exc:
        log.warning("cannot read %s (%s): maintaining as if never done", MARKER, exc)
        return {}


def last_maintained(lake: Lake) -> float | None:
    """When maintenance last finished (seconds since 1970), None if never."""
    marker = read_marker(lake) or {}
    value = marker.get("finished_at")
    return float(value) if value is not None else None


def due(config: Config, lake: Lake, *, now: float | None = None) -> bool:
    """Whether a run has tables to maintain (``[maintain] interval``), from the marker alone."""
    if not config.maintain.interval:
        return False
    interval = duration_seconds(config.maintain.interval, "maintain.interval")
    marker = read_marker(lake)
    if marker is None:
        return True  # the first run only starts the clock (maintain_due)
    return (now if now is not None else clock()) >= _next_due(marker, interval)


def _next_due(marker: dict[str, Any], interval: int) -> float:
    if "next_due" in marker:
        return float(marker["next_due"])
    return float(marker.get("finished_at") or 0) + interval  # a marker an older version wrote


def maintain_due(config: Config, lake: Lake, engine: Callable[[], Engine]) -> MaintainReport | None:
    """Inside a run, under its lock: maintain the tables due (see the module docstring); None when
    none is. The lake's first run only records when the clock started: a new lake has nothing to
    compact, and a first run (often a bootstrap's) should not pay for it. ``engine`` is called
    only when a table is due (an idle run starts none otherwise)."""
    if not due(config, lake):
        return None
    interval = duration_seconds(config.maintain.interval, "maintain.interval")
    now = clock()
    marker = read_marker(lake)
    if marker is None:
        if lake.delta_version(lake.table_uri(LOG_TABLE)) is not None:  # else nothing written yet
            _write_marker(lake, {"started_at": now, "next_due": now + interval, "tables": {}})
        return None
    done: dict[str, Any] = marker.setdefault("tables", {})
    # A table not maintained yet waits since the clock started (or, in a marker an older version
    # wrote, since the last `pg2delta maintain`).
    since = float(marker.get("started_at") or marker.get("finished_at") or 0)

    def last(name: str) -> float:
        return float((done.get(name) or {}).get("maintained_at", since))

    tables = delta_tables(lake)
    waiting = sorted((t for t in tables if last(t[0]) + interval <= now), key=lambda t: last(t[0]))
    log.info("maintaining %d of the %d Delta tables due ([maintain] interval = %s)",
             min(len(waiting), config.maintain.tables_per_run), len(waiting), config.maintain.interval)
    budget = duration_seconds(config.maintain.run_budget, "maintain.run_budget")
    chosen = waiting[: config.maintain.tables_per_run]
    report = _maintain_tables(config, engine() if chosen else None, lake, chosen, budget=budget)
    for tm in report.tables:
        done[tm.name] = {"maintained_at": now}
    report.staging_removed = _clean_staging(lake)
    marker["finished_at"] = now
    marker["next_due"] = min((last(t[0]) + interval for t in tables), default=now + interval)
    _write_marker(lake, marker)
    return report


def maintain_lake(config: Config, engine: Engine, lake: Lake) -> MaintainReport:
    """Maintain every Delta table of the lake (see the module docstring); the caller holds the lock."""
    tables = delta_tables(lake)
    report = _maintain_tables(config, engine, lake, tables)
    report.staging_removed = _clean_staging(lake)
    now = clock()
    marker = read_marker(lake) or {}
    marker.setdefault("started_at", now)
    done = marker.setdefault("tables", {})
    for tm in report.tables:
        done[tm.name] = {"maintained_at": now}
    marker["finished_at"] = now
    if config.maintain.interval:
        interval = duration_seconds(config.maintain.interval, "maintain.interval")
        marker["next_due"] = now + interval
    _write_marker(lake, marker)
    return report


def _maintain_tables(
    config: Config, engine: Engine | None, lake: Lake, tables: Sequence[tuple[str, str, bool]], *, budget: float | None = None
) -> MaintainReport:
    """Maintain ``tables`` ((name, uri, is a changelog)) in order; none started once ``budget``
    seconds have passed."""
    t0 = time.monotonic()
    report = MaintainReport()
    # Whole hours (VACUUM's unit), rounded up; "0h" is taken at its word.
    retention_hours = -(-duration_seconds(config.maintain.retention, "maintain.retention") // 3600)
    keep_changes = (
        duration_seconds(config.maintain.changelog_retention, "maintain.changelog_retention")
        if config.maintain.changelog_retention else None
    )
    keys = _first_keys(lake) if tables else {}
    for name, uri, is_changelog in tables:
        assert engine is not None
        if budget is not None and time.monotonic() - t0 >= budget:
            log.info("maintenance stopped after %.1f s ([maintain] run_budget); the next run goes on", budget)
            break
        tm = _maintain_table(engine, lake, (name, uri, keys.get(uri)), config.maintain.target_file_size,
                             retention_hours, keep_changes if is_changelog else None)
        if tm is not None:
            report.tables.append(tm)
        fault_point("maintain_between_tables")
    report.seconds = time.monotonic() - t0
    return report


def _maintain_table(
    engine: Engine, lake: Lake, table: tuple[str, str, str | None], target_size: int, retention_hours: int,
    keep_changes: int | None,
) -> TableMaintenance | None:
    """Expire changelog rows (``keep_changes`` seconds, None: keep), keep the log as long as the
    files, compact (in the order of the key column named, if any), vacuum and checkpoint one Delta table ((name, uri, first key
    column)); None when there is no table at ``uri``."""
    name, uri, key = table
    tm = TableMaintenance(name, uri)
    found = lake.files_now(uri)
    if found is None:
        return None
    tm.files_before = len(found[1])
    if keep_changes is not None:
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=keep_changes)
        engine.delete_where(uri, f"{quote(TS_COL)} < TIMESTAMP '{cutoff.strftime('%Y-%m-%d %H:%M:%S')}+00:00'")
        tm.changelog_rows_deleted = True
    # Tables an earlier version created keep statistics of float columns, which pysail misreads
    # where a file holds NaN; from here on they do not, and the compaction rewrites the files.
    tm.stats_columns_set = engine.keep_stats_of(uri)
    if not name.startswith("_pg2delta/"):  # the tables and histories take MERGEs; changelogs and logs appends
        tm.deletion_vectors_enabled = engine.enable_deletion_vectors(uri)
    tm.log_retention_set = engine.keep_log_for(uri, retention_hours)
    engine.compact(uri, target_size=target_size, key=key)
    fault_point("maintain_after_compact")
    tm.files_removed = engine.vacuum(uri, retention_hours=retention_hours)
    tm.checkpoint = engine.checkpoint(uri)
    after = lake.files_now(uri)
    tm.files_after = len(after[1]) if after is not None else 0
    if name == LOG_TABLE and after is not None:  # the digests of the files compaction replaced
        digests.clean(lake.fs, lake.path, DIGEST, after[1].items())
    log.info(
        "maintained %s: %d files -> %d, %s files removed, checkpoint %s",
        name, tm.files_before, tm.files_after, "?" if tm.files_removed < 0 else tm.files_removed,
        "written" if tm.checkpoint else "by the engine",
    )
    return tm


def delta_tables(lake: Lake) -> list[tuple[str, str, bool]]:
    """(name, uri, is a changelog) of every Delta table pg2delta keeps in the lake."""
    out: list[tuple[str, str, bool]] = []
    applied = lake.read_delta(lake.table_uri(LOG_TABLE))
    names = table_names(applied) if applied is not None and applied.num_rows else []
    for schema, table in sorted(n for n in names if n[0] is not None and n[1] is not None):
        out.append((f"{schema}.{table}", lake.table_uri(schema, table), False))
        history = lake.table_uri(schema, history_table(table))
        if lake.delta_version(history) is not None:  # its SCD2 history (pg2delta.apply.history)
            out.append((f"{schema}.{history_table(table)}", history, False))
    for schema in _dirs(lake, CHANGELOG_ROOT):
        for table in _dirs(lake, f"{CHANGELOG_ROOT}/{schema}"):
            out.append((f"{CHANGELOG_ROOT}/{schema}/{table}", lake.table_uri(CHANGELOG_ROOT, schema, table), True))
    for own in (LOG_TABLE, CHANGELOG_LOG):
        if lake.delta_version(lake.table_uri(own)) is not None:  # the changelog log: once a changelog is kept
            out.append((own, lake.table_uri(own), False))
    return out


def _first_keys(lake: Lake) -> dict[str, str]:
    """The first column of the key each table was last merged on (the applied log's newest row
    with a key, by ``window_end``), by table URI: compaction keeps the table in its order. Reduced
    with Arrow first: a year of five-minute windows is some 105,000 rows a table."""
    import pyarrow.compute as pc

    applied = lake.read_delta(lake.table_uri(LOG_TABLE))
    if applied is None or "key_columns" not in applied.column_names or applied.num_rows == 0:
        return {}
    names, key = ["schema_name", "table_name"], applied.column("key_columns")
    keyed = pc.and_(pc.and_(pc.is_valid(applied.column(names[0])), pc.is_valid(applied.column(names[1]))),
                    pc.and_(pc.is_valid(key), pc.invert(pc.is_in(key, pa.array(["", "[]"])))))
    rows = newest(applied.select([*names, "key_columns", "window_end"]).filter(keyed), names)
    out: dict[str, str] = {}
    for schema, table, cols in zip(*(rows.column(c).to_pylist() for c in (*names, "key_columns")), strict=True):
        first = json.loads(cols)
        if first:
            out[lake.table_uri(schema, table)] = str(first[0])
    return out


def _dirs(lake: Lake, rel: str) -> list[str]:
    try:
        infos = lake.fs.get_file_info(pafs.FileSelector(f"{lake.path}/{rel}", allow_not_found=True))
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot list {rel} in the lake: {exc}") from exc
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def _clean_staging(lake: Lake) -> int:
    """Remove staging entries older than :data:`STAGING_AGE` (left by runs that were killed): in the
    shared area, and in other slots' folders (each slot's own runs empty its folder when they start,
    see :meth:`pg2delta.lake.lake_files.Lake.own_staging`; this one's was emptied then too)."""
    cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=STAGING_AGE)
    removed = 0

    def entries(folder: str) -> list[pafs.FileInfo]:
        try:
            return list(lake.fs.get_file_info(pafs.FileSelector(f"{lake.path}/{folder}", allow_not_found=True)))
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot list the staging area: {exc}") from exc

    infos = []
    for info in entries(STAGING):
        if info.type == pafs.FileType.Directory and info.base_name.startswith("slot-"):
            if f"{STAGING}/{info.base_name}" != lake.staging_rel:
                infos += entries(f"{STAGING}/{info.base_name}")
        else:
            infos.append(info)
    for info in infos:
        mtime = info.mtime
        if mtime is not None and (mtime if mtime.tzinfo else mtime.replace(tzinfo=dt.UTC)) > cutoff:
            continue  # possibly a run of another slot writing this lake right now
        try:
            if info.type == pafs.FileType.Directory:
                lake.fs.delete_dir(info.path)
            else:
                lake.fs.delete_file(info.path)
            removed += 1
        except (OSError, pa.ArrowException) as exc:
            log.warning("could not remove %s from the staging area: %s", info.path, exc)
    if removed:
        log.info("removed %d entries crashed runs left in the staging area", removed)
    return removed


def _write_marker(lake: Lake, marker: dict[str, Any]) -> None:
    body = json.dumps(marker, sort_keys=True).encode()
    tmp = f"{lake.path}/{MARKER}.tmp"
    try:
        with lake.fs.open_output_stream(tmp) as out:
            out.write(body)
        lake.fs.move(tmp, f"{lake.path}/{MARKER}")
    except (OSError, pa.ArrowException) as exc:
        raise LakeError(f"cannot write {MARKER}: {exc}") from exc


def report_json(report: MaintainReport) -> dict[str, Any]:
    return {
        "tables": {
            t.name: {
                "files_before": t.files_before, "files_after": t.files_after, "files_removed": t.files_removed,
                "changelog_rows_deleted": t.changelog_rows_deleted, "checkpoint": t.checkpoint,
                "stats_columns_set": t.stats_columns_set, "deletion_vectors_enabled": t.deletion_vectors_enabled,
                "log_retention_set": t.log_retention_set,
            }
            for t in report.tables
        },
        "staging_removed": report.staging_removed,
        "seconds": round(report.seconds, 3),
    }
