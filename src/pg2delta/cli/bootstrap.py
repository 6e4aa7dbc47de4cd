"""``pg2delta bootstrap``: the initial copy at the slot's start."""

from __future__ import annotations

import argparse
import json

from pg2delta import use_bulk_allocator
from pg2delta.cli.common import JSON_SCHEMA_VERSION, Command, load_config
from pg2delta.errors import EXIT_OK
from pg2delta.lsn import format_lsn


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", type=int, default=2, help="tables copied at once (default 2)")
    p.add_argument(
        "--resume", action="store_true",
        help="the slot exists but the lake holds no bootstrap of it: copy every published table at a new snapshot",
    )


def execute(args: argparse.Namespace) -> int:
    from pg2delta.bootstrap import run_bootstrap

    use_bulk_allocator()  # before the engine and the copy's workers load mimalloc
    config = load_config(args)
    report = run_bootstrap(config, parallel=args.parallel, resume=args.resume)
    summary = {
        "schema_version": JSON_SCHEMA_VERSION,
        "command": "bootstrap",
        "slot": report.slot,
        "start_lsn": format_lsn(report.start_lsn),
        "created_slot": report.created_slot,
        "already_copied": report.already_copied,
        "tables": {
            f"{t.schema}.{t.table}": {
                "rows": t.rows, "as_of_lsn": format_lsn(t.snapshot_lsn), "delta_version": t.delta_version,
                "seconds": round(t.seconds, 3),
            }
            for t in report.copied
        },
    }
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"pg2delta bootstrap: slot {report.slot} {'created' if report.created_slot else 'resumed'}, "
            f"lake starts at {summary['start_lsn']}; {len(report.copied)} table(s) copied"
            + (f", {len(report.already_copied)} copied before" if report.already_copied else "")
        )
        for t in report.copied:
            print(f"  {t.schema}.{t.table}: {t.rows} rows as of {format_lsn(t.snapshot_lsn)} -> delta version {t.delta_version}")
    return EXIT_OK


COMMAND = Command(
    "bootstrap",
    "create the slot and copy every published table into the lake as of its start",
    execute,
    arguments=arguments,
)
