"""`make bench-maintain`: what `pg2delta maintain` buys a table run every few minutes.

On a throwaway PostgreSQL (15 by default) with a temporary lake: one table gets ``--windows``
small transactions (default 1,000: about three days of runs every five minutes), each of
``--rows`` inserts (default 200) and a few updates, applied by the real CLI one window each
(``pg2delta run --max-changes 1``, embedded engine), so the Delta table ends with one small
file and one log commit per window, as a scheduled job leaves it. Then ``pg2delta maintain``.

A full read of the table with delta-rs (log replay and every file, the way an independent reader
opens it) is timed before and after (best of ``--repeat``). Before the figures are printed, the
bench checks that the rows are the same, that the table equals PostgreSQL, and that a version from
before maintenance still reads as it did (time travel inside the retention).

The job itself reads the table's log in every window (the embedded engine writes no checkpoints),
so the bench also times ``--probe`` more windows (default 20) just before and just after
maintenance: ``window_seconds_before=`` / ``window_seconds_after=`` (per window).

Prints ``files_before=``, ``files_after=``, ``commits=``, ``maintain_seconds=``,
``read_seconds_before=``, ``read_seconds_after=``, the window times, ``window_speedup=`` and, last,
``read_speedup=<before / after>``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pyarrow as pa
from deltalake import DeltaTable

from pg2delta.source.throwaway import ThrowawayPostgres

SLOT, PUB = "bench_maintain", "bench_maintain"
SETUP = """
CREATE SCHEMA bench;
CREATE TABLE bench.readings (id bigint PRIMARY KEY, device int NOT NULL, value double precision,
                             note text, at timestamptz NOT NULL DEFAULT now());
CREATE PUBLICATION bench_maintain FOR TABLE bench.readings;
"""


def cli(dsn: str, lake: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    argv = [sys.executable, "-m", "pg2delta.cli", *args, "--dsn", dsn, "--slot", SLOT, "--publication", PUB,
            "--lake", str(lake), "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pg2delta {args[0]} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout)


def read_all(path: str, version: int | None = None) -> pa.Table:
    dt = DeltaTable(path, version=version) if version is not None else DeltaTable(path)
    return pa.table(dt.scan().read_all())


def best_read(path: str, repeat: int) -> tuple[float, pa.Table]:
    best, table = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        table = read_all(path)
        best = min(best, time.perf_counter() - t0)
    assert table is not None
    return best, table


def transactions(conn: psycopg.Connection, first: int, count: int, rows: int) -> None:
    """``count`` transactions of ``rows`` inserts and three updates of earlier rows, from window ``first``."""
    for w in range(first, first + count):
        lo = w * rows + 1
        with conn.transaction():
            conn.execute(
                "INSERT INTO bench.readings (id, device, value, note) "
                "SELECT g, mod(g, 97), g * 0.5, 'reading ' || g FROM generate_series(%s::bigint, %s) g",
                (lo, lo + rows - 1),
            )
            if w:
                conn.execute(
                    "UPDATE bench.readings SET value = value + 1 WHERE id IN (%s, %s, %s)",
                    (w, w * 7 % lo + 1, w * 31 % lo + 1),
                )


def timed_windows(pg: ThrowawayPostgres, lake: Path, first: int, count: int, rows: int) -> float:
    """Seconds per window of a run over ``count`` more transactions (engine start excluded: an
    idle run's time is taken off)."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        transactions(conn, first, count, rows)
    t0 = time.perf_counter()
    ran = cli(pg.dsn, lake, "run", "--max-changes", "1")
    busy = time.perf_counter() - t0
    t0 = time.perf_counter()
    cli(pg.dsn, lake, "run", "--max-changes", "1")
    idle = time.perf_counter() - t0
    if ran["windows"] < count:
        raise SystemExit(f"expected {count} windows, the run applied {ran['windows']}")
    return max(busy - idle, 0.0) / ran["windows"]


def canonical(table: pa.Table) -> pa.Table:
    """The rows to compare, in key order; string views (delta-rs 1.6 reads strings so, where
    pyarrow 26 cannot take from them) as strings."""
    picked = table.select(["id", "device", "value", "note", "at"])
    plain = pa.schema([pa.field(f.name, pa.string() if pa.types.is_string_view(f.type) else f.type) for f in picked.schema])
    return picked.cast(plain).sort_by("id")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=1000, help="small transactions, one window each (default 1,000)")
    ap.add_argument("--rows", type=int, default=200, help="inserts per transaction (default 200)")
    ap.add_argument("--probe", type=int, default=20, help="windows timed just before and after maintain (default 20)")
    ap.add_argument("--repeat", type=int, default=5, help="reads timed before and after (best of; default 5)")
    ap.add_argument("--pg", type=int, default=15, choices=(15, 18))
    args = ap.parse_args(argv)

    pg = ThrowawayPostgres.start(args.pg)
    with tempfile.TemporaryDirectory(prefix="pg2delta-bench-maintain-") as tmp:
        try:
            lake = Path(tmp) / "lake"
            first = args.windows - args.probe
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute(SETUP)
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
                t0 = time.perf_counter()
                transactions(conn, 0, first, args.rows)
            print(f"workload: PostgreSQL {args.pg}, {first:,} + 2 x {args.probe} transactions of {args.rows} inserts "
                  f"and 3 updates ({time.perf_counter() - t0:.1f} s)", flush=True)

            t0 = time.perf_counter()
            ran = cli(pg.dsn, lake, "run", "--max-changes", "1")
            print(f"pg2delta run: {ran['windows']:,} windows, {ran['changes']:,} changes "
                  f"in {time.perf_counter() - t0:.1f} s", flush=True)
            if ran["windows"] < first:
                raise SystemExit(f"expected {first} windows, the run applied {ran['windows']}")
            window_before = timed_windows(pg, lake, first, args.probe, args.rows)
            path = str(lake / "bench" / "readings")
            commits = DeltaTable(path).version() + 1
            files_before = len(DeltaTable(path).file_uris())
            middle = commits // 2
            at_middle = canonical(read_all(path, middle))
            read_before, rows_before = best_read(path, args.repeat)

            t0 = time.perf_counter()
            report = cli(pg.dsn, lake, "maintain")
            maintain_seconds = time.perf_counter() - t0
            files_after = len(DeltaTable(path).file_uris())
            read_after, rows_after = best_read(path, args.repeat)
            window_after = timed_windows(pg, lake, args.windows, args.probe, args.rows)
            rows_after = canonical(rows_after)
            rows_now = read_all(path)

            if not rows_after.equals(canonical(rows_before)):
                raise SystemExit("maintain changed the table's rows")
            if not canonical(read_all(path, middle)).equals(at_middle):
                raise SystemExit(f"version {middle} reads differently after maintain")
            with psycopg.connect(pg.dsn) as conn:
                pg_rows = conn.execute("SELECT count(*), sum(value), sum(id) FROM bench.readings").fetchone()
            assert pg_rows is not None
            lake_sums = (rows_now.num_rows, sum(rows_now.column("value").to_pylist()),
                         sum(rows_now.column("id").to_pylist()))
            if (pg_rows[0], float(pg_rows[1]), int(pg_rows[2])) != (lake_sums[0], float(lake_sums[1]), lake_sums[2]):
                raise SystemExit(f"the lake {lake_sums} differs from PostgreSQL {tuple(pg_rows)}")
            t = report["tables"]["bench.readings"]
            print(f"maintain: {len(report['tables'])} Delta tables; bench.readings {t['files_before']} -> "
                  f"{t['files_after']} files, {t['files_removed']} removed by vacuum (retention 7 days keeps "
                  f"the old ones on disk)", flush=True)
            print(f"commits={commits}")
            print(f"rows={rows_now.num_rows}")
            print(f"files_before={files_before}")
            print(f"files_after={files_after}")
            print(f"maintain_seconds={maintain_seconds:.2f}")
            print(f"read_seconds_before={read_before:.3f}")
            print(f"read_seconds_after={read_after:.3f}")
            print(f"window_seconds_before={window_before:.3f}")
            print(f"window_seconds_after={window_after:.3f}")
            print(f"window_speedup={window_before / max(window_after, 1e-3):.1f}")
            print(f"read_speedup={read_before / read_after:.1f}")
        finally:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
