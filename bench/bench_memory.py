"""`make bench-memory`: peak memory of `pg2delta run` against the size of one transaction.

Windows of the mixed 10-column table of ``bench_decode.py``, each on a throwaway
PostgreSQL (15 by default) with a temporary lake:

(a) ``--changes`` inserts (default 1,000,000) in transactions of 10,000 rows;
(b) the same number of inserts in **one** transaction;
(c) ``--big`` inserts (default 5,000,000) in one transaction;
(d) ``--updated`` rows (default 1,000,000) already in the lake, then **one** ``UPDATE`` of every
    one of them: the peak of the run that applies it (a commit into a populated table, where
    (a) to (c) create theirs: on the embedded engine, past 100,000 rows, an overwrite of the
    window's key range rather than a ``MERGE``, see pg2delta.lake.engine_commits). Skipped with
    ``--updated 0``.
(e) **one** transaction of ``--big`` changes that inserts 80 % of its rows and updates a quarter of
    those: spilled, and reduced to one row per key by the engine, in buckets of the key (a window
    of inserts only, as (c), has one change per key and skips the reduce). Skipped with ``--mixed 0``.

Each is applied by the real CLI (``python -m pg2delta.cli run``, embedded engine, default
settings unless ``--memory-budget`` is given) in a child process whose peak resident set size
(``ru_maxrss`` from ``wait4``) is printed; the embedded engine runs inside that process, so its
memory counts. The Delta table is then read with deltalake and must hold every row.

Then ``update_growth=<peak of (d) / peak of (a)>`` (no target: what a bulk update into a table
that has rows costs, see bench/README.md) and ``reduce_growth=<peak of (e) / peak
of (a)>`` (the spilled reduce's share, held to the same 1.3 as ``memory_growth``). Last line: ``memory_growth=<peak of (c) /
peak of (a)>`` (target at most 1.3).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pyarrow as pa
from bench_decode import INSERT, PUB, SETUP, SLOT, TABLE, UPDATE, Window, make_window

from pg2delta.source.throwaway import ThrowawayPostgres


def run_cli(dsn: str, lake: Path, memory_budget: int | None) -> tuple[float, float, str]:
    """``pg2delta run`` in a child process: (peak RSS in MB, seconds, its stderr's last line)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    if memory_budget is not None:
        env["PG2DELTA_MEMORY_BUDGET"] = str(memory_budget)
    args = [sys.executable, "-m", "pg2delta.cli", "run", "--dsn", dsn, "--slot", SLOT, "--publication", PUB,
            "--lake", str(lake), "--json"]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        err.seek(0)
        lines = err.read().strip().splitlines()
        out.seek(0)
        report = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"pg2delta run exited {proc.returncode}: {' | '.join(lines[-5:])}")
    spilled = next((ln.strip() for ln in report.splitlines() if '"spilled_rows"' in ln), "")
    return usage.ru_maxrss / 1024, seconds, spilled


@contextmanager
def window_and_lake(pg: int, rows: int, txn_rows: int) -> Iterator[tuple[Window, Path]]:
    """A throwaway server whose slot holds ``rows`` inserts, and an empty lake; both gone afterwards."""
    win = make_window(pg, rows, txn_rows=txn_rows, update_share=0.0)
    try:
        with empty_lake() as lake:
            yield win, lake
    finally:
        win.pg.stop()


@contextmanager
def empty_lake() -> Iterator[Path]:
    """A temporary lake folder, removed afterwards."""
    lake = Path(tempfile.mkdtemp(prefix="pg2delta-bench-memory-"))
    try:
        yield lake
    finally:
        shutil.rmtree(lake, ignore_errors=True)


def delta_column(lake: Path, column: str) -> list[object]:
    """One column of the bench table's Delta table, read with deltalake (not the engine that wrote it)."""
    from deltalake import DeltaTable

    schema, name = TABLE.split(".")
    return pa.table(DeltaTable(str(lake / schema / name)).scan(columns=[column]).read_all()).column(column).to_pylist()


def updated_rows(lake: Path) -> tuple[int, int]:
    """The bench table's rows in Delta (read with deltalake) and how many carry the UPDATE's note."""
    notes = delta_column(lake, "note")
    return len(notes), sum(1 for n in notes if isinstance(n, str) and n.startswith("updated "))


def measured(label: str, peak: float, what: str) -> float:
    """Print what case ``label`` ran and its peak (``peak_rss_mb_<label>=``); return the peak."""
    print(f"({label}) {what}", flush=True)
    print(f"peak_rss_mb_{label}={peak:.0f}", flush=True)
    return peak


def scenario(label: str, pg: int, rows: int, txn_rows: int, memory_budget: int | None) -> float:
    with window_and_lake(pg, rows, txn_rows) as (win, lake):
        peak, seconds, spilled = run_cli(win.pg.dsn, lake, memory_budget)
        held = len(delta_column(lake, "id"))
        if held != rows:
            raise SystemExit(f"({label}): the Delta table holds {held:,} rows, PostgreSQL {rows:,}")
        return measured(label, peak, f"{rows:,} inserts in transactions of {txn_rows:,}: run {seconds:.1f} s, "
                        f"{held:,} rows in Delta, {spilled or 'spilled_rows: ?'}")


def update_scenario(pg: int, rows: int, memory_budget: int | None) -> float:
    """(d): ``rows`` rows brought into the lake by a first run, then one UPDATE of them all; the peak
    resident set of the second run, which merges it."""
    with window_and_lake(pg, rows, 10_000) as (win, lake):
        run_cli(win.pg.dsn, lake, memory_budget)
        with psycopg.connect(win.pg.dsn, autocommit=True) as conn:
            conn.execute(UPDATE, (1, rows))
        peak, seconds, spilled = run_cli(win.pg.dsn, lake, memory_budget)
        held, updated = updated_rows(lake)
        if held != rows or updated != rows:
            raise SystemExit(f"(d): the Delta table holds {held:,} rows, {updated:,} updated; PostgreSQL {rows:,}")
        return measured("d", peak, f"one UPDATE of {rows:,} rows in a table of {rows:,}: run {seconds:.1f} s, "
                        f"{updated:,} rows updated in Delta, {spilled or 'spilled_rows: ?'}")


def mixed_scenario(pg: int, changes: int, memory_budget: int | None) -> float:
    """(e): one transaction of ``changes`` changes, inserts then updates of a quarter of them, into
    a new table; the peak of the run that applies it."""
    updates = changes // 5
    inserts = changes - updates
    server = ThrowawayPostgres.start(pg)
    try:
        with psycopg.connect(server.dsn) as conn:
            conn.execute(SETUP)
            conn.commit()
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
            conn.commit()
            conn.execute(INSERT, (1, inserts))
            conn.execute(UPDATE, (1, updates))
            conn.commit()
        with empty_lake() as lake:
            peak, seconds, spilled = run_cli(server.dsn, lake, memory_budget)
            held, updated = updated_rows(lake)
        if held != inserts or updated != updates:
            raise SystemExit(f"(e): the Delta table holds {held:,} rows, {updated:,} updated; "
                             f"PostgreSQL {inserts:,}, {updates:,}")
        return measured("e", peak, f"one transaction of {inserts:,} inserts and {updates:,} updates: run "
                        f"{seconds:.1f} s, {held:,} rows in Delta, {updated:,} updated, {spilled or 'spilled_rows: ?'}")
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--changes", type=int, default=1_000_000, help="rows of (a) and (b) (default 1,000,000)")
    ap.add_argument("--big", type=int, default=5_000_000, help="rows of (c) (default 5,000,000)")
    ap.add_argument("--updated", type=int, default=1_000_000, help="rows of (d), 0 to skip (default 1,000,000)")
    ap.add_argument("--mixed", type=int, default=5_000_000,
                    help="changes of (e), in one transaction, 0 to skip (default 5,000,000)")
    ap.add_argument("--pg", type=int, default=15, choices=(15, 18))
    ap.add_argument("--memory-budget", type=int, default=None, help="window.memory_budget in bytes (default: the job's)")
    args = ap.parse_args(argv)
    a = scenario("a", args.pg, args.changes, 10_000, args.memory_budget)
    scenario("b", args.pg, args.changes, args.changes, args.memory_budget)
    c = scenario("c", args.pg, args.big, args.big, args.memory_budget)
    if args.updated:
        d = update_scenario(args.pg, args.updated, args.memory_budget)
        print(f"update_growth={d / a:.2f}", flush=True)
    if args.mixed:
        e = mixed_scenario(args.pg, args.mixed, args.memory_budget)
        print(f"reduce_growth={e / a:.2f}", flush=True)
    print(f"memory_growth={c / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
