"""``pg2delta run``: apply the slot's changes, window by window."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pg2delta.cli.common import JSON_SCHEMA_VERSION, Command, idle_flag, load_config
from pg2delta.errors import EXIT_OK
from pg2delta.lsn import format_lsn, parse_lsn


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--until-lsn", help="stop at this LSN (X/Y) instead of the server's flush LSN at start")
    p.add_argument("--create-slot", action="store_true", default=None, help="create the slot if it is missing")
    p.add_argument("--max-changes", type=int, help="changes per window (default from config)")
    p.add_argument("--max-bytes", type=int, help="bytes per window (default from config)")
    idle_flag(p)
    p.add_argument(
        "--metrics-file", metavar="PATH",
        help="also write how the run ended as Prometheus metrics to PATH (atomically, failed runs too; "
        "for node_exporter's textfile collector)",
    )


def flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that override the config."""
    return dict(
        create_slot=args.create_slot, max_changes=args.max_changes, max_bytes=args.max_bytes,
    )


def execute(args: argparse.Namespace) -> int:
    from pg2delta.job import run

    config = load_config(args)
    until = parse_lsn(args.until_lsn) if args.until_lsn is not None else None
    report = run(config, until_lsn=until, create_slot=args.create_slot)
    tables: dict[str, dict[str, Any]] = {}
    for w in report.windows:
        for t in w.tables:
            agg = tables.setdefault(f"{t.schema}.{t.table}", {"inserts": 0, "updates": 0, "deletes": 0, "truncated": False})
            agg["inserts"] += t.inserts
            agg["updates"] += t.updates
            agg["deletes"] += t.deletes
            agg["truncated"] = agg["truncated"] or t.truncated
    summary = {
        "schema_version": JSON_SCHEMA_VERSION,
        "command": "run",
        "idle": report.nothing_to_do,
        "slot": report.slot,
        "from_lsn": format_lsn(report.start_lsn),
        "to_lsn": format_lsn(report.end_lsn),
        "bound_lsn": format_lsn(report.upper_lsn),
        "windows": len(report.windows),
        "rows_read": sum(w.rows for w in report.windows),
        "changes": report.changes,
        "spilled_rows": sum(w.spilled_rows for w in report.windows),
        "tables": tables,
        "maintenance": None,
    }
    if report.maintenance is not None:
        from pg2delta.maintain import report_json

        summary["maintenance"] = report_json(report.maintenance)
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"pg2delta run: slot {report.slot} {summary['from_lsn']} -> {summary['to_lsn']} "
            f"({summary['windows']} window(s), {summary['rows_read']} rows read, {summary['changes']} changes)"
        )
        for name, agg in sorted(tables.items()):
            print(f"  {name}: {agg['inserts']} inserts, {agg['updates']} updates, {agg['deletes']} deletes")
    return int(args.idle_exit_code) if report.nothing_to_do else EXIT_OK


COMMAND = Command(
    "run",
    "apply the slot's changes to the lake, window by window, up to a bound",
    execute,
    arguments=arguments,
    flags=flags,
)
