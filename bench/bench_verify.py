"""`make bench-verify`: how fast `pg2delta verify` compares a large table, and that it finds a difference.

On a throwaway PostgreSQL (15 by default) one table of ``PG2DELTA_BENCH_VERIFY_ROWS`` rows (default
5,000,000; ints, text, numeric, float8, timestamptz, a text array) is bootstrapped into a temporary
lake by the real CLI (embedded engine). Then:

1. ``pg2delta verify`` on the intact lake (must exit 0), timed: ``verify_rows_per_s=`` is the rows of
   both sides compared per second of that command (the source's rows + the lake's, over wall time,
   engine start and the pinning slot included);
2. one row updated behind pg2delta's back with delta-rs, a change in PostgreSQL so that verify's run
   merges on top of it, and ``pg2delta verify`` again: it must exit 20 and name exactly that key
   (``verify_differs_seconds=``).

Prints ``rows=``, ``verify_seconds=``, ``verify_differs_seconds=`` and, last, ``verify_rows_per_s=``.
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
from typing import Any

import psycopg
from deltalake import DeltaTable

from pg2delta.source.throwaway import ThrowawayPostgres

SLOT, PUB = "bench_verify", "bench_verify"
SETUP = """
CREATE SCHEMA bench;
CREATE TABLE bench.items (id bigint PRIMARY KEY, device int NOT NULL, value double precision, price numeric(12,2),
                          note text, at timestamptz NOT NULL, tags text[]);
CREATE PUBLICATION bench_verify FOR TABLE bench.items;
"""
FILL = """
INSERT INTO bench.items
SELECT g, mod(g, 97), g * 0.37, g * 0.25, 'item ' || g, '2024-01-01'::timestamptz + g * interval '1 second',
       ARRAY['t' || mod(g, 5), 'u']
FROM generate_series(%s::bigint, %s) g
"""


def cli(dsn: str, lake: Path, *args: str, ok: tuple[int, ...] = (0,)) -> tuple[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    argv = [sys.executable, "-m", "pg2delta.cli", *args, "--dsn", dsn, "--slot", SLOT, "--publication", PUB,
            "--lake", str(lake), "--json"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode not in ok:
        raise SystemExit(f"pg2delta {args[0]} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    return done.returncode, json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=int(os.environ.get("PG2DELTA_BENCH_VERIFY_ROWS", "5000000")))
    ap.add_argument("--pg", type=int, default=15, choices=(15, 18))
    args = ap.parse_args(argv)

    pg = ThrowawayPostgres.start(args.pg)
    with tempfile.TemporaryDirectory(prefix="pg2delta-bench-verify-") as tmp:
        try:
            lake = Path(tmp) / "lake"
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute(SETUP)
                t0 = time.perf_counter()
                for lo in range(1, args.rows + 1, 1_000_000):
                    conn.execute(FILL, (lo, min(lo + 999_999, args.rows)))
                conn.execute("ANALYZE bench.items")
            print(f"source: PostgreSQL {args.pg}, {args.rows:,} rows ({time.perf_counter() - t0:.1f} s)", flush=True)
            t0 = time.perf_counter()
            cli(pg.dsn, lake, "bootstrap")
            print(f"pg2delta bootstrap: {time.perf_counter() - t0:.1f} s", flush=True)

            t0 = time.perf_counter()
            _, report = cli(pg.dsn, lake, "verify")
            seconds = time.perf_counter() - t0
            t = report["tables"]["bench.items"]
            if not report["equal"] or t["source_rows"] != args.rows or t["lake_rows"] != args.rows:
                raise SystemExit(f"verify of the intact lake: {json.dumps(report)[:1500]}")

            path = str(lake / "bench" / "items")
            DeltaTable(path).update(predicate="id = 7", updates={"note": "'changed behind its back'"})
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute("UPDATE bench.items SET device = device + 1 WHERE id = 8")
            t0 = time.perf_counter()
            code, report = cli(pg.dsn, lake, "verify", ok=(20,))
            differs_seconds = time.perf_counter() - t0
            found = [(d["kind"], d["key"], d.get("columns")) for d in report["tables"]["bench.items"]["differences"]]
            if code != 20 or found != [("different_values", {"id": "7"}, ["note"])]:
                raise SystemExit(f"verify of the changed lake exited {code}: {found}")

            print(f"rows={args.rows}")
            print(f"verify_seconds={seconds:.2f}")
            print(f"verify_differs_seconds={differs_seconds:.2f}")
            print(f"verify_rows_per_s={2 * args.rows / seconds:.0f}")
        finally:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
