"""``pg2delta status``: where the slot is, how far behind the server, what the lake holds, and a verdict.

Reads the server (the slot, its WAL position and retention) and the lake's own logs (the applied
log, and each table's Delta log for its version, files and size) with pyarrow: no engine is
started, so a monitoring check every minute costs a query and a few small reads.

The verdict is an exit code (the highest of the problems found): 14 a promotion of the standby now
would leave the runs without their slot (pg2delta.failover), 13 a table changed behind pg2delta's
back, 12 the slot is invalidated, 11 its ``wal_status`` is ``unreserved``, 10 the lag is over
``--max-lag-bytes`` / ``--max-lag-seconds``, 9 a table's log or small files are past a ``[maintain]
alert_*`` threshold (:func:`_maintenance_problems`), else 0. The report
(``--json``) has a stable schema, :data:`SCHEMA_VERSION`, documented in docs/commands/json-reports.md; so do the
Prometheus metrics ``--metrics-file`` writes.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from pg2delta.apply.changelog import changelog_path
from pg2delta.apply.history import history_table
from pg2delta.config import Config
from pg2delta.errors import (
    EXIT_OK,
    EXIT_STATUS_INVALIDATED,
    EXIT_STATUS_LAG,
    EXIT_STATUS_LAKE_CHANGED,
    EXIT_STATUS_MAINTENANCE,
    EXIT_STATUS_UNRESERVED,
    SourceStateError,
)
from pg2delta.failover import status_section
from pg2delta.lake.applied_log import KIND_WINDOW, LOG_TABLE, newest
from pg2delta.lake.engine import Lake
from pg2delta.lake.log_health import log_health
from pg2delta.lsn import format_lsn
from pg2delta.source.slot import ServerState, SlotInfo, SlotSource

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Thresholds:
    max_lag_bytes: int | None = None
    max_lag_seconds: float | None = None


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_US = dt.timedelta(microseconds=1)


def _iso(us: int | None) -> str | None:
    """Microseconds since 1970 as ISO 8601 in UTC (``2025-01-31T12:00:00.123456Z``)."""
    if us is None:
        return None
    return (_EPOCH + us * _US).isoformat().replace("+00:00", "Z")


def _us(value: Any) -> int | None:
    """A timestamp read from the applied log (a datetime or microseconds) as microseconds since 1970."""
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        return int((value - _EPOCH) // _US)
    return int(value)


def _lsn(value: int | None) -> str | None:
    return None if value is None else format_lsn(value)


def _delta(lake: Lake, uri: str) -> dict[str, Any] | None:
    """Version, data files and bytes of the Delta table at ``uri`` (None: no table there)."""
    found = lake.files_now(uri)
    if found is None:
        return None
    version, files = found
    return {"path": uri, "delta_version": version, "files": len(files), "size_bytes": sum(files.values())}


def _slot_section(info: SlotInfo, server: ServerState) -> dict[str, Any]:
    confirmed, restart = info.confirmed_flush_lsn, info.restart_lsn
    return {
        "name": info.name,
        "plugin": info.plugin,
        "active_pid": info.active_pid,
        "confirmed_flush_lsn": _lsn(confirmed),
        "restart_lsn": _lsn(restart),
        "wal_status": info.wal_status,
        "safe_wal_size_bytes": info.safe_wal_size,
        "invalidation_reason": info.invalidation_reason,
        "conflicting": info.conflicting,
        "invalidated": info.invalidated,
        "failover": info.failover,
        "synced": info.synced,
        "lag_bytes": max(0, server.flush_lsn - confirmed) if confirmed is not None else None,
        "retained_wal_bytes": max(0, server.current_lsn - restart) if restart is not None else None,
    }


# The kinds of change a window applies, as the applied log counts them (its columns).
_OPS = ("inserts", "updates", "deletes")


def _per_relation(applied: Any, slot: str) -> tuple[list[dict[str, Any]], dict[int, dict[str, int]], dict[int, int]]:
    """Of the applied log (a pyarrow table), per relation of ``slot``: its newest row by
    ``window_end`` (the first of a tie, in the log's order), the changes its windows applied (a
    bootstrap's or a backfill's copy is not changes applied) and the newest commit time applied.
    Reduced with Arrow: a year of five-minute windows is some 105,000 rows a table, and ``status``
    is what monitoring runs every few minutes. Rows without a table mark a bootstrap's start."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = applied.append_column("_row", pa.array(range(applied.num_rows), type=pa.int64()))
    t = t.filter(pc.and_(pc.fill_null(pc.equal(t.column("slot"), slot), False), pc.is_valid(t.column("relation_oid"))))
    if t.num_rows == 0:
        return [], {}, {}
    kind = t.column("kind") if "kind" in t.column_names else pa.nulls(t.num_rows, pa.string())
    window = pc.fill_null(pc.equal(kind, KIND_WINDOW), True)
    counted = pa.table({"relation_oid": t.column("relation_oid"), **{
        op: pc.if_else(window, pc.fill_null(t.column(op), 0), 0) if op in t.column_names else pa.array([0] * t.num_rows)
        for op in _OPS
    }})
    sums = counted.group_by("relation_oid").aggregate([(op, "sum") for op in _OPS]).to_pylist()
    totals = {int(r["relation_oid"]): {op: int(r[f"{op}_sum"] or 0) for op in _OPS} for r in sums}
    commits: dict[int, int] = {}
    if "commit_ts" in t.column_names:
        by_commit = t.select(["relation_oid", "commit_ts"]).group_by("relation_oid").aggregate([("commit_ts", "max")])
        for r in by_commit.to_pylist():
            us = _us(r["commit_ts_max"])
            if us is not None:
                commits[int(r["relation_oid"])] = us
    last = newest(t.select(["relation_oid", "window_end", "_row"]), ["relation_oid"])
    first = last.group_by("relation_oid").aggregate([("_row", "min")]).column("_row_min")
    return applied.take(first).to_pylist(), totals, commits


def _tables(config: Config, lake: Lake) -> tuple[list[dict[str, Any]], int | None, int | None]:
    """Per Delta table of this slot: its last logged window and what the lake holds now; plus the
    applied log's version and the newest commit time applied to any table."""
    log_uri = lake.table_uri(LOG_TABLE)
    found = lake.files_now(log_uri)
    log_version = None if found is None else found[0]
    applied = lake.read_delta(log_uri) if found is not None else None
    if applied is None or applied.num_rows == 0:
        return [], log_version, None
    latest, totals, commits = _per_relation(applied, config.source.slot)
    newest_commit = max(commits.values(), default=None)
    tables = []
    for row in sorted(latest, key=lambda r: (r["schema_name"], r["table_name"])):
        schema, name = row["schema_name"], row["table_name"]
        uri = lake.table_uri(schema, name)
        now = _delta(lake, uri)
        tables.append(
            {
                "table": f"{schema}.{name}",
                "catalog_name": config.catalog_name(schema, name),
                "relation_oid": int(row["relation_oid"]),
                "path": uri,
                "applied_lsn": row["window_end_lsn"],
                "last_kind": row.get("kind") or "window",
                "last_applied_at": _iso(_us(row.get("applied_at"))),
                "last_commit_ts": _iso(commits.get(int(row["relation_oid"]))),
                "logged_delta_version": row.get("delta_version"),
                "delta_version": now["delta_version"] if now else None,
                "files": now["files"] if now else None,
                "size_bytes": now["size_bytes"] if now else None,
                "rows_applied": totals[int(row["relation_oid"])],
                "changelog": _delta(lake, lake.table_uri(changelog_path(schema, name))),
                "history": _delta(lake, lake.table_uri(schema, history_table(name))),
            }
        )
        _add_log_health(config, lake, tables[-1])
    return tables, log_version, newest_commit


def _slot_problems(info: SlotInfo) -> list[dict[str, Any]]:
    """The slot invalidated (exit 12), or holding more WAL than the server lets it keep (11)."""
    if info.invalidated:
        reason = info.invalidation_reason or f"wal_status {info.wal_status}"
        return [
            {
                "kind": "invalidated",
                "exit_code": EXIT_STATUS_INVALIDATED,
                "message": f"slot {info.name} is invalidated ({reason}): the changes it held are gone; "
                "the lake needs a new bootstrap (docs: operations/guide, Recovering from an invalidated slot)",
            }
        ]
    if info.wal_status == "unreserved":
        return [
            {
                "kind": "unreserved",
                "exit_code": EXIT_STATUS_UNRESERVED,
                "message": f"slot {info.name} holds more WAL than max_slot_wal_keep_size allows "
                f"(safe_wal_size {info.safe_wal_size} bytes): the next checkpoint may invalidate it; run pg2delta now",
            }
        ]
    return []


def status(config: Config, thresholds: Thresholds | None = None) -> dict[str, Any]:
    """The report ``pg2delta status`` prints; ``report["exit_code"]`` is its verdict."""
    limits = thresholds or Thresholds()
    with SlotSource(
        config.source.dsn, config.source.slot, config.source.publication, connect_timeout=config.source.connect_timeout
    ) as src:
        info = src.slot_info()
        if info is None:
            raise SourceStateError(f"replication slot {config.source.slot!r} does not exist")
        server = src.server_state()
    slot = _slot_section(info, server)
    lake = Lake(config.lake_root)
    tables, log_version, newest_commit = _tables(config, lake)
    lag_seconds: float | None = None
    if newest_commit is not None:
        # The age of the newest change in the lake; 0 once the slot has caught up with the server.
        lag_seconds = 0.0 if slot["lag_bytes"] == 0 else max(0.0, (server.now_us - newest_commit) / 1e6)
    slot["lag_seconds"] = None if lag_seconds is None else round(lag_seconds, 3)
    standby, failover_problems = status_section(config, info, server.version_num)  # 14
    problems = _maintenance_problems(config, tables) + lake_changed(config, lake, tables) + _slot_problems(info)
    problems += failover_problems
    if limits.max_lag_bytes is not None and slot["lag_bytes"] is not None and slot["lag_bytes"] > limits.max_lag_bytes:
        problems.append(
            {
                "kind": "lag_bytes",
                "exit_code": EXIT_STATUS_LAG,
                "message": f"lag {slot['lag_bytes']} bytes is over --max-lag-bytes {limits.max_lag_bytes}",
            }
        )
    if limits.max_lag_seconds is not None and lag_seconds is not None and lag_seconds > limits.max_lag_seconds:
        problems.append(
            {
                "kind": "lag_seconds",
                "exit_code": EXIT_STATUS_LAG,
                "message": f"lag {lag_seconds:.0f} s is over --max-lag-seconds {limits.max_lag_seconds:g}",
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "status",
        "checked_at": _iso(server.now_us),
        "exit_code": max((p["exit_code"] for p in problems), default=EXIT_OK),
        "problems": problems,
        "thresholds": _thresholds(limits, config),
        "server": {
            "version_num": server.version_num,
            "in_recovery": server.in_recovery,
            "flush_lsn": format_lsn(server.flush_lsn),
            "current_lsn": format_lsn(server.current_lsn),
            "max_slot_wal_keep_size_bytes": server.max_slot_wal_keep_size,
        },
        "slot": slot,
        "lake": {
            "root": config.lake_root,
            "applied_log_version": log_version,
            "last_commit_ts": _iso(newest_commit),
        },
        "tables": tables,
        "standby": standby,
    }


# --- Maintenance: what a year of small windows does to a table, watched ----------------------

# Per-table figure -> the [maintain] key of its threshold.
_ALERTS = {
    "commits_since_checkpoint": "alert_commits_since_checkpoint",
    "commits_since_compaction": "alert_commits_since_compaction",
    "small_files": "alert_small_files",
}


def _thresholds(limits: Thresholds, config: Config) -> dict[str, Any]:
    """The report's ``thresholds``: the lag flags' and the ``[maintain] alert_*`` keys."""
    return {
        "max_lag_bytes": limits.max_lag_bytes, "max_lag_seconds": limits.max_lag_seconds,
        **{key: getattr(config.maintain, key) for key in _ALERTS.values()},
    }


def _add_log_health(config: Config, lake: Lake, entry: dict[str, Any]) -> None:
    """Add the :mod:`pg2delta.lake.log_health` figures to a table's entry, and to its changelog's
    and history's where it has them."""
    m = config.maintain
    scan = max(m.alert_commits_since_compaction, 100) + 1  # enough to tell one past the threshold

    def figures(uri: str) -> dict[str, int | None]:
        found = lake.files_now(uri)
        health = None if found is None else log_health(lake, uri, found[1], small_file_size=m.small_file_size, scan=scan)
        return {key: None if health is None else getattr(health, key) for key in _ALERTS}

    entry.update(figures(entry["path"]))
    for part in ("changelog", "history"):
        if entry.get(part) is not None:
            entry[part].update(figures(entry[part]["path"]))


def _maintenance_problems(config: Config, tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One problem (exit 9) per table part whose figure is over its ``[maintain] alert_*`` threshold."""
    problems = []
    for t in tables:
        for part, holder in (("", t), (" changelog", t.get("changelog")), (" history", t.get("history"))):
            for figure, key in _ALERTS.items():
                limit = getattr(config.maintain, key)
                value = None if holder is None else holder.get(figure)
                if limit and value is not None and value > limit:
                    problems.append({
                        "kind": "maintenance",
                        "exit_code": EXIT_STATUS_MAINTENANCE,
                        "table": t["table"],
                        "message": f"{t['table']}{part}: {figure.replace('_', ' ')} {value} is over [maintain] "
                        f"{key} = {limit}: maintenance is not keeping up (docs/operations/maintenance.md)",
                    })
    return problems


def _maintenance_gauges(reg: Any, report: dict[str, Any], slot: str) -> None:
    """The :func:`_add_log_health` figures as gauges, per table and part (table, changelog, history)."""
    from prometheus_client import Gauge

    docs = {
        "commits_since_checkpoint": "Commits after the newest checkpoint of the Delta log",
        "commits_since_compaction": "Commits after the newest compaction (OPTIMIZE), counted up to the threshold + 1",
        "small_files": "Data files of the latest version under [maintain] small_file_size",
    }
    for figure, doc in docs.items():
        g = Gauge(f"pg2delta_table_{figure}", doc, ["slot", "table", "part"], registry=reg)
        for t in report["tables"]:
            for part, holder in (("table", t), ("changelog", t.get("changelog")), ("history", t.get("history"))):
                if holder is not None and holder.get(figure) is not None:
                    g.labels(slot=slot, table=t["table"], part=part).set(holder[figure])


def lake_changed(config: Config, lake: Lake, tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each table's ``foreign_commits`` (commits another writer made since pg2delta's last one,
    newest first; pg2delta.lake.foreign), and a problem (exit 13) naming the tables that have some:
    the next run that writes one of them refuses (exit 21)."""
    from pg2delta.lake.applied_log import log_rows
    from pg2delta.lake.foreign import damaged_tables, last_logged_versions, remembered

    if not tables:
        return []
    logged = last_logged_versions(log_rows(lake), config.source.slot)
    names = {t["table"]: tuple(t["table"].split(".", 1)) for t in tables}
    known = remembered(lake, config.source.slot)
    damaged = {d.name: d for d in damaged_tables(lake, {n: logged.get(n) for n in names.values()}, known)}
    for t in tables:
        d = damaged.get(t["table"])
        t["foreign_commits"] = [c.to_json() for c in d.commits] if d is not None else []
    if not damaged:
        return []
    return [{
        "kind": "lake_changed",
        "exit_code": EXIT_STATUS_LAKE_CHANGED,
        "message": "tables changed behind pg2delta's back since its last commit (the next run writing them "
        "refuses, exit 21; pg2delta verify shows the keys, pg2delta resync repairs): "
        + "; ".join(d.describe() for d in damaged.values()),
    }]


# --- Prometheus -------------------------------------------------------------------------------

WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")


def write_metrics(report: dict[str, Any], path: str) -> None:
    """The report as Prometheus text for node_exporter's textfile collector, written atomically
    (a temporary file renamed over ``path``). Metric names are documented in docs/operations/monitoring.md."""
    from prometheus_client import CollectorRegistry, Gauge, write_to_textfile

    reg = CollectorRegistry()
    slot = report["slot"]
    name = slot["name"]

    def gauge(metric: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> None:
        if value is None:
            return  # unknown: absent, not zero
        labels = {"slot": name, **(labels or {})}
        g = Gauge(metric, doc, list(labels), registry=reg)
        g.labels(**labels).set(value)

    def table_gauge(metric: str, doc: str, key: str, source: str = "table") -> None:
        g = Gauge(metric, doc, ["slot", "table"], registry=reg)
        for t in report["tables"]:
            holder = t if source == "table" else t.get(source)
            if holder is not None and holder.get(key) is not None:
                g.labels(slot=name, table=t["table"]).set(holder[key])

    gauge("pg2delta_status_exit_code", "Exit code of pg2delta status (0, 9, 10, 11, 12, 13, 14)", report["exit_code"])
    gauge("pg2delta_status_checked_timestamp_seconds", "When pg2delta status ran (server clock)", ts(report["checked_at"]))
    gauge("pg2delta_slot_invalidated", "1 when the slot is invalidated", 1.0 if slot["invalidated"] else 0.0)
    wal = Gauge("pg2delta_slot_wal_status", "1 for the slot's current wal_status", ["slot", "wal_status"], registry=reg)
    for status_name in WAL_STATUSES:
        wal.labels(slot=name, wal_status=status_name).set(1.0 if slot["wal_status"] == status_name else 0.0)
    gauge("pg2delta_slot_lag_bytes", "Server WAL flush position minus the slot's confirmed_flush_lsn", slot["lag_bytes"])
    gauge("pg2delta_slot_lag_seconds", "Age of the newest change applied to the lake; 0 once caught up",
          slot["lag_seconds"])
    gauge("pg2delta_slot_retained_wal_bytes", "WAL the slot keeps on the server (current LSN minus restart_lsn)",
          slot["retained_wal_bytes"])
    gauge("pg2delta_slot_safe_wal_size_bytes", "WAL that can still be written before the slot is in danger",
          slot["safe_wal_size_bytes"])
    gauge("pg2delta_server_max_slot_wal_keep_size_bytes", "max_slot_wal_keep_size (absent: unlimited)",
          report["server"]["max_slot_wal_keep_size_bytes"])
    gauge("pg2delta_lake_last_commit_timestamp_seconds", "Commit time of the newest change applied to the lake",
          ts(report["lake"]["last_commit_ts"]))
    table_gauge("pg2delta_table_delta_version", "Latest Delta version of the table", "delta_version")
    table_gauge("pg2delta_table_files", "Data files in the table's latest Delta version", "files")
    table_gauge("pg2delta_table_size_bytes", "Bytes of data files in the table's latest Delta version", "size_bytes")
    _table_gauges(reg, report, name)
    _failover_gauges(gauge, report)
    table_gauge("pg2delta_changelog_delta_version", "Latest Delta version of the table's changelog", "delta_version",
                "changelog")
    table_gauge("pg2delta_changelog_size_bytes", "Bytes of data files in the table's changelog", "size_bytes",
                "changelog")
    table_gauge("pg2delta_history_delta_version", "Latest Delta version of the table's SCD2 history", "delta_version",
                "history")
    table_gauge("pg2delta_history_size_bytes", "Bytes of data files in the table's SCD2 history", "size_bytes",
                "history")
    reg.register(_RowsApplied(name, report["tables"]))
    _maintenance_gauges(reg, report, name)
    write_to_textfile(path, reg)


def ts(text: str | None) -> float | None:
    """An ISO 8601 time of the report as seconds since 1970."""
    return None if text is None else dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _table_gauges(reg: Any, report: dict[str, Any], slot: str) -> None:
    """Per table, its last logged window's end LSN and time."""
    from prometheus_client import Gauge

    applied = Gauge("pg2delta_table_applied_lsn", "Window end LSN of the table's last logged window, as a number",
                    ["slot", "table"], registry=reg)
    last = Gauge("pg2delta_table_last_applied_timestamp_seconds", "When the table's last window was applied",
                 ["slot", "table"], registry=reg)
    for t in report["tables"]:
        hi, lo = t["applied_lsn"].split("/")
        applied.labels(slot=slot, table=t["table"]).set((int(hi, 16) << 32) | int(lo, 16))
        when = ts(t["last_applied_at"])
        if when is not None:
            last.labels(slot=slot, table=t["table"]).set(when)


def _failover_gauges(gauge: Any, report: dict[str, Any]) -> None:
    """The slot a failover slot or not, and the standby's copy of it (pg2delta.failover)."""
    failover = report["slot"]["failover"]
    gauge("pg2delta_slot_failover", "1 when the slot is a failover slot (PostgreSQL 17+)",
          None if failover is None else float(failover))
    standby = report["standby"]
    if standby is not None:
        gauge("pg2delta_standby_ready", "1 when a promotion of the standby now would keep the slot", float(standby["ready"]))
        gauge("pg2delta_standby_slot_behind_bytes", "The primary's confirmed_flush_lsn minus the standby's copy's",
              standby.get("slot_behind_bytes"))


class _RowsApplied:
    """``pg2delta_table_rows_applied_total``: a counter per table and kind of change (the applied
    log's windows add up; it only grows), so that ``increase()`` over it gives rows applied per hour."""

    def __init__(self, slot: str, tables: list[dict[str, Any]]) -> None:
        self.slot, self.tables = slot, tables

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(
            "pg2delta_table_rows_applied", "Changes the table's logged windows applied, by kind (insert, update, delete)",
            labels=["slot", "table", "op"],
        )
        for t in self.tables:
            for op in _OPS:
                family.add_metric([self.slot, t["table"], op.removesuffix("s")], t["rows_applied"][op])
        yield family
