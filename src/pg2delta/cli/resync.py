"""``pg2delta resync``: tables copied again at a new snapshot."""

from __future__ import annotations

import argparse
import json

from pg2delta import use_bulk_allocator
from pg2delta.cli.common import Command, load_config
from pg2delta.errors import EXIT_OK
from pg2delta.lsn import format_lsn


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", action="append", default=[], required=True, help="schema.table (repeat)")
    p.add_argument("--parallel", type=int, default=2, help="tables copied at once (default 2)")


def execute(args: argparse.Namespace) -> int:
    from pg2delta.resync import resync

    use_bulk_allocator()  # before the engine and the copy's workers load mimalloc
    config = load_config(args)
    copied = resync(config, args.table, parallel=args.parallel)
    summary = {
        "slot": config.source.slot,
        "tables": {
            f"{t.schema}.{t.table}": {
                "rows": t.rows, "as_of_lsn": format_lsn(t.snapshot_lsn), "delta_version": t.delta_version,
                "seconds": round(t.seconds, 3),
            }
            for t in copied
        },
    }
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"pg2delta resync: {len(copied)} table(s) copied again; slot {config.source.slot} did not move")
        for t in copied:
            print(f"  {t.schema}.{t.table}: {t.rows} rows as of {format_lsn(t.snapshot_lsn)} -> delta version {t.delta_version}")
    return EXIT_OK


COMMAND = Command(
    "resync",
    "copy tables again at a new snapshot, online; the slot's later changes follow on",
    execute,
    arguments=arguments,
)
