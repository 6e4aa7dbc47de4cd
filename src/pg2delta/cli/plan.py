"""``pg2delta plan``: what a run would do, without writing."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pg2delta.cli.common import Command, load_config
from pg2delta.errors import EXIT_NEEDS_HUMAN, EXIT_OK
from pg2delta.lsn import parse_lsn


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--until-lsn", help="plan up to this LSN (X/Y) instead of the server's flush LSN")
    p.add_argument("--max-changes", type=int, help="changes per window, as the run would use (default from config)")
    p.add_argument("--max-bytes", type=int, help="bytes per window, as the run would use (default from config)")


def flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that override the config."""
    return dict(
        max_changes=args.max_changes, max_bytes=args.max_bytes,
    )


def execute(args: argparse.Namespace) -> int:
    from pg2delta.planning import plan, to_json

    config = load_config(args)
    until = parse_lsn(args.until_lsn) if args.until_lsn is not None else None
    report = plan(config, until_lsn=until)
    summary = to_json(report)
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"pg2delta plan: slot {report.slot} {summary['from_lsn']} -> {summary['to_lsn']} (bound "
            f"{summary['bound_lsn']}): {len(report.windows)} window(s), {summary['changes']} changes"
            + ("" if report.exact else "; only the first window was planned (no temporary copy of the slot)")
        )
        for w in summary["windows"]:
            print(f"  window {w['start_lsn']} -> {w['end_lsn']} (ends at {w['ends_at']}): {w['rows_read']} rows, "
                  f"{w['transactions']} transactions{', REFUSED' if w['refused'] else ''}")
        for name in report.would_copy:
            print(f"  {name}: would be copied first (in the publication, no copy in the lake)")
        for name, t in sorted(summary["tables"].items()):
            if t["would_copy"]:
                continue
            shape = []
            if t["new_table"]:
                shape.append("new Delta table")
            elif t["added"]:
                shape.append(f"adds {', '.join(t['added'])}")
            shape += [f"widens {w['column']} {w['from']} -> {w['to']}" for w in t["widened"]]
            if t["dropped"]:
                what = "drops" if t["dropped_columns"] == "drop" else "keeps dropped"
                shape.append(f"{what} {', '.join(t['dropped'])}")
            if t["key_change"]:
                shape.append(f"key ({', '.join(t['key_change']['from'])}) -> ({', '.join(t['key_change']['to'])})")
            print(f"  {name}: {t['inserts']} inserts, {t['updates']} updates, {t['deletes']} deletes"
                  + (", truncated" if t["truncated"] else "") + (f"; {'; '.join(shape)}" if shape else ""))
        for r in summary["refusals"]:
            print(f"  REFUSED ({r['table'] or 'window'} at {r['window_start_lsn']}): {' '.join(r['message'].split())}")
    return EXIT_NEEDS_HUMAN if report.refusals else EXIT_OK


COMMAND = Command(
    "plan",
    "show what a run would do now (windows, per-table changes, shape changes, refusals); writes nothing",
    execute,
    arguments=arguments,
    flags=flags,
)
