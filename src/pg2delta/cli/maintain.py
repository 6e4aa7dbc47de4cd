"""``pg2delta maintain``: compaction, vacuum, checkpoints, expiry."""

from __future__ import annotations

import argparse
import json

from pg2delta.cli.common import JSON_SCHEMA_VERSION, Command, load_config
from pg2delta.errors import EXIT_OK


def execute(args: argparse.Namespace) -> int:
    from pg2delta.maintain import maintain, report_json

    config = load_config(args)
    report = maintain(config)
    summary = {"schema_version": JSON_SCHEMA_VERSION, "command": "maintain", **report_json(report)}
    args.summary = summary  # for lineage and --metrics-file (_main)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"pg2delta maintain: {len(report.tables)} Delta tables in {report.seconds:.1f} s; "
              f"{report.staging_removed} staging entries of crashed runs removed")
        for t in report.tables:
            removed = "?" if t.files_removed < 0 else str(t.files_removed)
            print(f"  {t.name}: {t.files_before} -> {t.files_after} files, {removed} old files removed")
    return EXIT_OK


COMMAND = Command(
    "maintain",
    "compact small files, vacuum old ones, checkpoint, expire changelog rows, clean staging (see [maintain])",
    execute,
)
