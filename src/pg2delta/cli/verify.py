"""``pg2delta verify``: the lake against the source at one LSN."""

from __future__ import annotations

import argparse
import json

from pg2delta.cli.common import Command, load_config, non_negative
from pg2delta.errors import EXIT_OK, EXIT_VERIFY_DIFFERS


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--table", action="append", default=[], help="schema.table (repeat; default: every table of the lake)")
    p.add_argument("--show-values", action="store_true", help="print the differing values too (default: keys only)")
    p.add_argument(
        "--max-differences", type=non_negative(int), default=1000, metavar="N",
        help="differing keys reported per table (default 1000); the report says when there were more",
    )


def execute(args: argparse.Namespace) -> int:
    from pg2delta.verify import to_json, verify

    config = load_config(args)
    report = verify(config, args.table, show_values=args.show_values, max_differences=max(1, args.max_differences))
    summary = to_json(report)
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"pg2delta verify: slot {report.slot} at {summary['at_lsn']}: "
              + ("the lake holds the source's state" if report.equal else "the lake DIFFERS from the source"))
        for t in report.tables:
            if t.skipped:
                print(f"  {t.name}: skipped ({t.skipped})")
                continue
            print(f"  {t.name} (delta version {t.delta_version}): {t.source_rows} source rows, {t.lake_rows} lake rows, "
                  f"{len(t.differences)}{'+' if t.truncated else ''} difference(s)"
                  + (f"; not compared: {', '.join(t.columns_not_compared)}" if t.columns_not_compared else ""))
            for c in t.foreign_commits:
                print(f"    commit pg2delta did not make: {c.describe()}")
            for d in t.differences:
                key = ", ".join(f"{k}={v!r}" for k, v in d.key.items())
                cols = f" columns {', '.join(d.columns)}" if d.columns else ""
                values = f" source {d.source} lake {d.lake}" if d.source is not None or d.lake is not None else ""
                print(f"    {d.kind}: ({key}){cols}{values}")
    return EXIT_OK if report.equal else EXIT_VERIFY_DIFFERS


COMMAND = Command(
    "verify",
    "compare the lake with the source at one LSN (applies the slot up to it first); exit 20 when they differ",
    execute,
    arguments=arguments,
)
