"""``pg2delta maintain``: what running every few minutes for a year does to a lake, undone.

Every window adds at least one data file and one commit to each table it touches, to the applied
log and to the changelogs. For every Delta table of the lake (the tables the applied log names and
their SCD2 histories, the applied log itself, each changelog and the changelog log), maintenance

1. deletes changelog rows committed longer ago than ``[maintain] changelog_retention`` (if set);
2. compacts the small files into large ones, in one commit that changes no row (Delta's
   ``OPTIMIZE`` on Apache Spark, delta-rs's compaction on the other engines);
3. removes the files no version younger than ``[maintain] retention`` needs (``VACUUM``; default
   7 days, so time travel, ``pg2delta versions --at-lsn`` and backfill seeds keep working inside it);
4. writes a checkpoint of the log where the engine does not;

then removes what crashed runs left in the staging area (older than an hour) and records when it
finished (``_pg2delta/maintain.json``), which ``run`` reads when ``[maintain] interval`` is set.

It holds the slot's advisory lock, like a run, so it never overlaps one (a run started meanwhile
exits 73, and maintenance started during a run exits 73). Each step is one Delta commit or the
removal of files no version in the retention needs, so killing it at any point leaves every table
readable and equal in rows; running it again finishes the work.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
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
from pg2delta.lake.applied_log import LOG_TABLE
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.sql import quote
from pg2delta.source.slot import SlotSource

log = logging.getLogger(__name__)

MARKER = "_pg2delta/maintain.json"
STAGING = "_pg2delta/staging"
STAGING_AGE = 3600  # seconds: staging entries older than this belong to runs that are over


@dataclass
class TableMaintenance:
    name: str  # "schema.table", or the lake's own table ("_pg2delta/applied_log", ...)
    uri: str
    files_before: int = 0
    files_after: int = 0
    files_removed: int = 0  # by VACUUM (-1: the engine does not say)
    changelog_rows_deleted: bool = False
    checkpoint: bool = False
    stats_columns_set: bool = False  # the table's statistics columns were set (an older table)


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


def due(config: Config, lake: Lake, *, now: float | None = None) -> bool:
    """Whether ``run`` should maintain the lake now (``[maintain] interval`` passed since the last time)."""
    if not config.maintain.interval:
        return False
    interval = duration_seconds(config.maintain.interval, "maintain.interval")
    last = last_maintained(lake)
    return last is None or (now if now is not None else time.time()) - last >= interval


def last_maintained(lake: Lake) -> float | None:
    """When maintenance last finished (seconds since 1970), None if never."""
    try:
        with lake.fs.open_input_stream(f"{lake.path}/{MARKER}") as f:
            return float(json.loads(f.read().decode())["finished_at"])
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException, ValueError, KeyError) as exc:
        log.warning("cannot read %s (%s): maintaining as if never done", MARKER, exc)
        return None


def maintain_lake(config: Config, engine: Engine, lake: Lake) -> MaintainReport:
    """Maintain every Delta table of the lake (see the module docstring); the caller holds the lock."""
    t0 = time.monotonic()
    report = MaintainReport()
    # Whole hours (VACUUM's unit), rounded up; "0h" is taken at its word.
    retention_hours = -(-duration_seconds(config.maintain.retention, "maintain.retention") // 3600)
    keep_changes = (
        duration_seconds(config.maintain.changelog_retention, "maintain.changelog_retention")
        if config.maintain.changelog_retention else None
    )
    keys = _first_keys(lake)
    for name, uri, is_changelog in _delta_tables(lake):
        tm = TableMaintenance(name, uri)
        found = lake.files_now(uri)
        if found is None:
            continue
        tm.files_before = len(found[1])
        if is_changelog and keep_changes is not None:
            cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=keep_changes)
            engine.delete_where(uri, f"{quote(TS_COL)} < TIMESTAMP '{cutoff.strftime('%Y-%m-%d %H:%M:%S')}+00:00'")
            tm.changelog_rows_deleted = True
        # Tables an earlier version created keep statistics of float columns, which pysail misreads
        # where a file holds NaN; from here on they do not, and the compaction rewrites the files.
        tm.stats_columns_set = engine.keep_stats_of(uri)
        engine.compact(uri, target_size=config.maintain.target_file_size, key=keys.get(uri))
        fault_point("maintain_after_compact")
        tm.files_removed = engine.vacuum(uri, retention_hours=retention_hours)
        tm.checkpoint = engine.checkpoint(uri)
        after = lake.files_now(uri)
        tm.files_after = len(after[1]) if after is not None else 0
        log.info(
            "maintained %s: %d files -> %d, %s files removed, checkpoint %s",
            name, tm.files_before, tm.files_after, "?" if tm.files_removed < 0 else tm.files_removed,
            "written" if tm.checkpoint else "by the engine",
        )
        report.tables.append(tm)
    report.staging_removed = _clean_staging(lake)
    _write_marker(lake)
    report.seconds = time.monotonic() - t0
    return report


def _delta_tables(lake: Lake) -> list[tuple[str, str, bool]]:
    """(name, uri, is a changelog) of every Delta table pg2delta keeps in the lake."""
    out: list[tuple[str, str, bool]] = []
    applied = lake.read_delta(lake.table_uri(LOG_TABLE))
    names: set[tuple[str, str]] = set()
    if applied is not None and applied.num_rows:
        names = set(zip(applied.column("schema_name").to_pylist(), applied.column("table_name").to_pylist(), strict=True))
    for schema, table in sorted(n for n in names if n[0] is not None and n[1] is not None):
        out.append((f"{schema}.{table}", lake.table_uri(schema, table), False))
        history = lake.table_uri(schema, history_table(table))
        if lake.delta_version(history) is not None:  # its SCD2 history (pg2delta.apply.history)
            out.append((f"{schema}.{history_table(table)}", history, False))
    for schema in _dirs(lake, CHANGELOG_ROOT):
        for table in _dirs(lake, f"{CHANGELOG_ROOT}/{schema}"):
            out.append((f"{CHANGELOG_ROOT}/{schema}/{table}", lake.table_uri(CHANGELOG_ROOT, schema, table), True))
    for own in (LOG_TABLE, CHANGELOG_LOG):
        out.append((own, lake.table_uri(own), False))
    return out


def _first_keys(lake: Lake) -> dict[str, str]:
    """The first column of the key each table was last merged on (the applied log), by table URI:
    compaction keeps the table in its order."""
    applied = lake.read_delta(lake.table_uri(LOG_TABLE))
    if applied is None or "key_columns" not in applied.column_names:
        return {}
    out: dict[str, str] = {}
    rows = zip(applied.column("schema_name").to_pylist(), applied.column("table_name").to_pylist(),
               applied.column("key_columns").to_pylist(), strict=True)
    for schema, table, key in rows:
        if schema is not None and table is not None and key and json.loads(key):
            out[lake.table_uri(schema, table)] = str(json.loads(key)[0])
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


def _write_marker(lake: Lake) -> None:
    body = json.dumps({"finished_at": time.time()}).encode()
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
                "stats_columns_set": t.stats_columns_set,
            }
            for t in report.tables
        },
        "staging_removed": report.staging_removed,
        "seconds": round(report.seconds, 3),
    }
