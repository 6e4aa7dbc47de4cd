"""``pg2delta backfill``: the changelog re-applied over an LSN range."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pg2delta.cli.common import JSON_SCHEMA_VERSION, Command, idle_flag, load_config
from pg2delta.errors import EXIT_OK
from pg2delta.lsn import format_lsn, parse_lsn


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-lsn", required=True, help="first commit LSN to re-apply (X/Y)")
    p.add_argument("--to-lsn", required=True, help="re-apply changes committed before this LSN (X/Y)")
    p.add_argument("--table", action="append", default=[], help="schema.table (repeat; default: every table with a changelog)")
    p.add_argument("--into", help="write a copy under this lake root instead of the tables in place")
    p.add_argument("--max-changes", type=int, help="changelog rows per chunk (default window.max_changes)")
    idle_flag(p)


def flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that override the config."""
    return dict(
        max_changes=args.max_changes,
    )


def execute(args: argparse.Namespace) -> int:
    from pg2delta.backfill import backfill

    config = load_config(args)
    report = backfill(
        config, parse_lsn(args.from_lsn), parse_lsn(args.to_lsn), tables=args.table, into=args.into
    )
    summary = {
        "schema_version": JSON_SCHEMA_VERSION,
        "command": "backfill",
        "idle": report.nothing_to_do,
        "from_lsn": format_lsn(report.from_lsn),
        "to_lsn": format_lsn(report.to_lsn),
        "into": report.into,
        "tables": {
            f"{t.schema}.{t.table}": {
                "path": t.path, "replayed_from": format_lsn(t.start_lsn), "seed_version": t.seed_version,
                "chunks": t.chunks, "inserts": t.inserts, "updates": t.updates, "deletes": t.deletes,
                "truncated": t.truncated, "delta_version": t.delta_version, "changed": t.changed,
            }
            for t in report.tables
        },
    }
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"pg2delta backfill: {summary['from_lsn']} -> {summary['to_lsn']} into {report.into or 'the lake (in place)'}")
        for t in report.tables:
            print(f"  {t.schema}.{t.table}: from {format_lsn(t.start_lsn)}, {t.inserts} inserts, {t.updates} updates, "
                  f"{t.deletes} deletes -> delta version {t.delta_version}{'' if t.changed else ' (unchanged)'}")
    return int(args.idle_exit_code) if report.nothing_to_do else EXIT_OK


COMMAND = Command(
    "backfill",
    "re-apply the changelog's changes of an LSN range to the tables or a copy",
    execute,
    arguments=arguments,
    flags=flags,
    needs_source=False,
)
