"""``pg2delta status``: the slot's lag and the lake's tables."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pg2delta.cli.common import Command, load_config, non_negative, size_text
from pg2delta.errors import ConfigError


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-lag-bytes", type=non_negative(int), metavar="N", help="exit 10 when the lag is over N bytes")
    p.add_argument(
        "--max-lag-seconds", type=non_negative(float), metavar="S",
        help="exit 10 when the newest change in the lake is older than S seconds and the slot is behind",
    )
    p.add_argument(
        "--standby-dsn", metavar="DSN",
        help="a physical standby ([source] standby_dsn): exit 14 unless a promotion of it now would keep the slot "
        "(a failover slot, PostgreSQL 17+, its copy there sync-ready)",
    )
    p.add_argument(
        "--metrics-file", metavar="PATH",
        help="also write the report as Prometheus metrics to PATH (atomically; for node_exporter's textfile collector)",
    )


def execute(args: argparse.Namespace) -> int:
    from pg2delta.status import Thresholds, status, write_metrics

    config = load_config(args)
    report = status(config, Thresholds(args.max_lag_bytes, args.max_lag_seconds))
    if args.metrics_file:
        try:
            write_metrics(report, args.metrics_file)
        except OSError as exc:
            raise ConfigError(f"cannot write --metrics-file {args.metrics_file}: {exc}") from exc
    args.summary = report  # for lineage (_main)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        slot, server = report["slot"], report["server"]
        keep = server["max_slot_wal_keep_size_bytes"]
        lag_s = "unknown" if slot["lag_seconds"] is None else f"{slot['lag_seconds']:.0f} s"
        print(
            f"slot {slot['name']}: confirmed {slot['confirmed_flush_lsn']}, server flushed {server['flush_lsn']}; "
            f"lag {slot['lag_bytes']} bytes, {lag_s}; wal_status {slot['wal_status']}"
            + (f" ({slot['invalidation_reason']})" if slot["invalidation_reason"] else "")
        )
        print(
            f"  WAL retained {size_text(slot['retained_wal_bytes'])}, safe_wal_size "
            f"{'unlimited' if keep is None else size_text(slot['safe_wal_size_bytes'])}, "
            f"max_slot_wal_keep_size {'unlimited' if keep is None else size_text(keep)}"
        )
        _print_failover(slot, report["standby"])
        if not report["tables"]:
            print("  no table applied yet")
        for t in report["tables"]:
            cl = t["changelog"]
            print(
                f"  {t['table']}: applied through {t['applied_lsn']} at {t['last_applied_at']}, "
                f"delta version {t['delta_version']}, {t['files']} files, {size_text(t['size_bytes'])}"
                + (f"; changelog version {cl['delta_version']}, {size_text(cl['size_bytes'])}" if cl else "")
            )
            print(
                f"    {t['commits_since_checkpoint']} commits since the last checkpoint, "
                f"{t['commits_since_compaction']} since the last compaction, {t['small_files']} small files"
            )
    for p in report["problems"]:
        print(f"pg2delta status: {p['kind']}: {p['message']}", file=sys.stderr)
    return int(report["exit_code"])


def _print_failover(slot: dict[str, Any], standby: dict[str, Any] | None) -> None:
    if slot["failover"] is not None:
        print(f"  failover slot: {'yes' if slot['failover'] else 'no'}" + (" (synchronized from a former primary)" if slot["synced"] else ""))
    if standby is None:
        return
    if not standby["reachable"]:
        print("  standby: not reachable")
        return
    state = "synchronized, sync-ready" if standby["slot_sync_ready"] else "present, NOT sync-ready" if standby["slot_present"] else "absent"
    print(
        f"  standby {standby['host']}:{standby['port']}: slot {state}"
        + (f", confirmed {standby['slot_confirmed_flush_lsn']} ({standby['slot_behind_bytes']} bytes behind)"
           if standby["slot_confirmed_flush_lsn"] else "")
        + f"; {'ready' if standby['ready'] else 'NOT ready'} for a promotion"
    )


COMMAND = Command(
    "status",
    "show the slot's position, lag and WAL retention and the lake's tables; exit 9 (maintenance behind: "
    "[maintain] alert_*), 10 (lag over a threshold), 11 (wal_status unreserved), 12 (slot invalidated), 13 "
    "(a table changed behind pg2delta's back) or 14 (a promotion of the standby now would lose the slot)",
    execute,
    arguments=arguments,
    flags=lambda args: {"standby_dsn": args.standby_dsn},
)
