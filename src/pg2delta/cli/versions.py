"""``pg2delta versions``: the Delta versions holding the state at an LSN."""

from __future__ import annotations

import argparse
import json

from pg2delta.cli.common import Command, load_config
from pg2delta.errors import EXIT_OK
from pg2delta.lsn import parse_lsn


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--at-lsn", required=True, help="the LSN (X/Y) whose state to find")


def execute(args: argparse.Namespace) -> int:
    from pg2delta.versions import EXACT, to_json, versions

    config = load_config(args)
    report = versions(config, parse_lsn(args.at_lsn))
    summary = to_json(report)
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        through = summary["applied_through"] or "nothing"
        print(
            f"pg2delta versions: slot {report.slot} at {summary['at_lsn']} (lake applied through {through}); "
            + ("every table has a version" if report.exact else "some tables have no version holding that state")
        )
        if not report.tables:
            print("  no table in the applied log")
        for t in report.tables:
            if t.status == EXACT:
                print(f"  {t.name}: delta version {t.delta_version} (state as of {summary['tables'][t.name]['as_of_lsn']})")
            else:
                print(f"  {t.name}: no exact version ({t.status}): {t.message}")
    return EXIT_OK


COMMAND = Command(
    "versions",
    "the Delta version of every table that holds the source's state at an LSN (time travel)",
    execute,
    arguments=arguments,
    needs_source=False,
)
