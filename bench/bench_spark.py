"""`make bench-spark`: the job on Apache Spark + Delta, and a window that touches 50 tables.

Runs in the Spark 3.5 venv (full pyspark with delta-spark, and pysail beside it), with Delta's
jars named by ``SPARK_CONF_DIR`` (``make install-spark``):

1. **end to end on the classic engine**: ``bench_e2e.py``'s run with ``--engine spark`` (the same
   window, the server's COPY rate measured in the same run); figure ``spark_e2e_vs_server``;
2. **50 tables**: a throwaway PostgreSQL with ``--tables`` small tables (default 50), each given
   ``--rows`` inserts and some updates and deletes in transactions spanning several tables; one
   slot per measurement, so every run reads the same window. With each engine already started
   (its start is not what this measures), ``Job.run()`` of that one window is timed with the
   tables merged one after the other (``window.parallel_tables = 1``) and with the default
   (``window.parallel_tables = 4``); every lake is read back with delta-rs and compared with
   PostgreSQL (row counts and sums per table), otherwise the run exits 1.

The last lines are ``spark_e2e_vs_server=``, ``tables50_seconds_embedded=`` and
``tables50_seconds_spark=`` (the default, concurrent apply).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import psycopg
from bench_e2e import add_e2e_args, measure
from psycopg import sql

from pg2delta import config as cfgmod
from pg2delta.engine import Engine, EngineConfig, Lake
from pg2delta.job import Job
from pg2delta.throwaway import ThrowawayPostgres

PUB = "bench_many"


def _tables(n: int) -> list[str]:
    return [f"t{i:03d}" for i in range(n)]


def _workload(dsn: str, tables: list[str], rows: int, slots: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in tables:
            conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, name text, qty bigint, at timestamptz)").format(
                sql.Identifier(t)))
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            sql.Identifier(PUB), sql.SQL(", ").join(sql.Identifier(t) for t in tables)))
        for slot in slots:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    with psycopg.connect(dsn) as conn:
        for i, t in enumerate(tables):
            ident = sql.Identifier(t)
            conn.execute(sql.SQL(
                "INSERT INTO {} SELECT g, 'row ' || g, g * %s::bigint, now() FROM generate_series(1, %s::int) g").format(ident),
                (i, rows))
            conn.execute(sql.SQL("UPDATE {} SET qty = qty + 1 WHERE id % 4 = 0").format(ident))
            conn.execute(sql.SQL("DELETE FROM {} WHERE id % 10 = 0").format(ident))
            if i % 5 == 4:
                conn.commit()
        conn.commit()


def _check(dsn: str, lake: Path, tables: list[str]) -> bool:
    from deltalake import DeltaTable

    ok = True
    with psycopg.connect(dsn) as conn:
        for t in tables:
            row = conn.execute(sql.SQL("SELECT count(*), coalesce(sum(qty), 0) FROM {}").format(sql.Identifier(t))).fetchone()
            assert row is not None
            data = DeltaTable(str(lake / "public" / t)).to_pyarrow_table(columns=["qty"])
            got = (data.num_rows, sum(v for v in data.column("qty").to_pylist() if v is not None))
            if got != (int(row[0]), int(row[1])):
                print(f"MISMATCH in {t}: PostgreSQL {tuple(row)}, Delta {got}", file=sys.stderr)
                ok = False
    return ok


def many_tables(engines: list[str], n: int, rows: int, pg_version: int) -> dict[tuple[str, int], float] | None:
    """Seconds of one window's ``Job.run()`` per (engine, parallel_tables), engines already started.

    Each engine runs in a child process of its own: a Spark Connect session (pysail) and a classic
    one do not mix in one Python process (pyspark decides per process which one its functions use).
    """
    out: dict[tuple[str, int], float] = {}
    for kind in engines:
        child = subprocess.run(
            [sys.executable, __file__, "--one-engine", kind, "--tables", str(n), "--rows", str(rows), "--pg", str(pg_version)],
            stdout=subprocess.PIPE, text=True,
        )
        print(child.stdout, end="", flush=True)
        if child.returncode != 0:
            return None
        for line in child.stdout.splitlines():
            if line.startswith("{"):
                out.update({(kind, int(p)): s for p, s in json.loads(line).items()})
    return out


def _many_tables_one_engine(kind: str, n: int, rows: int, pg_version: int) -> dict[tuple[str, int], float] | None:
    engines = [kind]
    cases = [(kind, parallel) for kind in engines for parallel in (1, 4)]
    slots = {case: f"slot_{case[0]}_{case[1]}" for case in cases}
    tables = _tables(n)
    pg = ThrowawayPostgres.start(pg_version)
    root = Path(tempfile.mkdtemp(prefix="pg2delta-bench-many-"))
    out: dict[tuple[str, int], float] = {}
    try:
        t0 = time.perf_counter()
        _workload(pg.dsn, tables, rows, list(slots.values()))
        print(f"workload: PostgreSQL {pg_version}, {n} tables of {rows} rows, inserts + updates + deletes "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        for kind in engines:
            t0 = time.perf_counter()
            engine = Engine.start(EngineConfig(kind=kind), Lake(str(root / "warm")))
            print(f"{kind}: engine started in {time.perf_counter() - t0:.1f} s", flush=True)
            try:
                for parallel in (1, 4):
                    lake = root / f"{kind}-{parallel}"
                    cfg = cfgmod.load(env={}, dsn=pg.dsn, slot=slots[(kind, parallel)], publication=PUB,
                                      lake=str(lake), engine=kind)
                    cfg = dataclasses.replace(cfg, window=dataclasses.replace(cfg.window, parallel_tables=parallel))
                    job = Job(cfg, engine_factory=engine.with_lake)
                    t0 = time.perf_counter()
                    report = job.run()
                    seconds = time.perf_counter() - t0
                    touched = len(report.windows[0].tables) if report.windows else 0
                    print(f"{kind}: one window of {touched} tables, {report.changes:,} changes, "
                          f"parallel_tables={parallel}: {seconds:.1f} s", flush=True)
                    if touched != n or not _check(pg.dsn, lake, tables):
                        return None
                    out[(kind, parallel)] = seconds
            finally:
                engine.stop()
        return out
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_e2e_args(ap)
    ap.add_argument("--tables", type=int, default=50, help="tables in the many-tables window (default 50)")
    ap.add_argument("--rows", type=int, default=200, help="rows inserted per table (default 200)")
    ap.add_argument("--one-engine", choices=("embedded", "spark"), help=argparse.SUPPRESS)
    ap.set_defaults(engine="spark")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.one_engine:
        one = _many_tables_one_engine(args.one_engine, args.tables, args.rows, args.pg)
        if one is None:
            return 1
        print(json.dumps({str(parallel): s for (_, parallel), s in one.items()}))
        return 0

    ratio = measure(args)
    if ratio is None:
        return 1
    logging.getLogger("pg2delta").setLevel(logging.WARNING)
    times = many_tables(["embedded", "spark"], args.tables, args.rows, args.pg)
    if times is None:
        return 1
    for kind in ("embedded", "spark"):
        print(f"tables{args.tables}_seconds_{kind}_one_at_a_time={times[(kind, 1)]:.1f}")
    print(f"spark_e2e_vs_server={ratio:.2f}")
    for kind in ("embedded", "spark"):
        print(f"tables{args.tables}_seconds_{kind}={times[(kind, 4)]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
