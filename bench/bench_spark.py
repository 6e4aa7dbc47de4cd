"""`make bench-spark`: the job on Apache Spark + Delta, and a window that touches 50 tables.

Runs in the Spark 3.5 venv (full pyspark with delta-spark, and pysail beside it), with what
``make install-spark`` left in ``--spark-cache`` (Delta's jars, the settings, the class-data
archive). Every JVM starts in a child process, and starts fast unless said otherwise, as
docs/engines/spark-submit.md ("Faster starts") recommends for scheduled runs (bench/spark_start.py:
the archive, the client compiler alone, the serial collector, the settings as
``--properties-file``). Some figures are measured in the same run with the archive and the full
(tiered) compiler (``_tiered``), for a JVM that lives long, or with a plain start (``_plain``:
``SPARK_CONF_DIR`` holding ``spark-defaults.conf``, no JVM options):

1. **end to end on the classic engine**: ``bench_e2e.py``'s run with ``--engine spark`` (the same
   window, the server's COPY rate measured in the same run), once started fast and once with the
   full compiler, each in a new process with a new window; figures ``spark_e2e_vs_server`` and
   ``spark_e2e_vs_server_tiered``. After the first, the floor under it, in a new process started
   the same way: a session, and the rows that run wrote read from its Parquet files into a new Delta
   table (``spark_e2e_floor_seconds``; ``spark_e2e_floor_vs_server``: the server's COPY over it, the
   most ``spark_e2e_vs_server`` could be were the window's read, decode and staging free);
2. **50 tables**: a throwaway PostgreSQL with ``--tables`` small tables (default 50), each given
   ``--rows`` inserts and some updates and deletes in transactions spanning several tables (the
   first window, which creates the Delta tables), then a second window of changes to every table
   (what every scheduled run does); one slot per setting, so every run reads the same windows.
   With each engine already started (its start is not what this measures; each engine in a
   child process), ``Job.run()`` of each window is timed with the tables merged one after the
   other (``window.parallel_tables = 1``) and with the default (``4``); on Apache Spark once more
   with the full compiler (``4`` only); every lake is read back with delta-rs and compared with
   PostgreSQL (row counts and sums per table), else exit 1. Then, in the same session, the
   engine's floor under that window: as many Delta tables of as many rows created bare, one plain
   ``MERGE`` of a window of the same shape into each, and one plain append of its rows into each,
   4 tables at once (``tables50_floor_merge_seconds_<engine>``, ``..._append_...``);
3. **fixed costs through spark-submit**, each a new process as a scheduler starts it
   (``local[2]``): a script that only starts a session and stops it (the floor,
   ``spark_session_seconds``), and ``jobs/pg2delta_run.py`` on a slot whose window holds only WAL
   of a table outside the publication (``idle_run_seconds_spark``: the run reads the window, moves
   the slot, and needs no session), each started fast and plain, alternated, ``--fixed-rounds`` of
   each (the median counts; the machine is noisy, so they are compared within one run);
4. **a standalone cluster** (bench_cluster.py): with the lake on the S3-compatible server of the
   tests (``make s3proxy``), a run of 10 updates into a 10,000-row table through ``spark-submit``
   in ``local[2]`` and with ``--master spark://...`` to a master and one worker started from the
   pyspark install, alternated, ``--cluster-rounds`` of each (medians), the drivers started fast.

The last lines are ``spark_e2e_vs_server=`` (and ``_tiered``), ``spark_session_seconds=``,
``idle_run_seconds_spark=`` (each also ``_plain``), then ``tables50_seconds_embedded=`` and
``tables50_seconds_spark=`` (and ``_tiered``): the second window (tables in place), concurrent
apply, each with its floor and ``tables50_vs_floor_merge_<engine>=`` (the window / the bare
``MERGE``s); then ``small_run_seconds_spark_s3=`` (local[2]) and ``cluster_small_run_seconds=`` (the
cluster), each a new spark-submit process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bench_cluster
import psycopg
import pyarrow as pa
from bench_e2e import add_e2e_args, measure
from psycopg import sql
from spark_start import SparkStart

from pg2delta import config as cfgmod
from pg2delta.job import Job
from pg2delta.lake.engine import Engine, EngineConfig, Lake
from pg2delta.source.throwaway import ThrowawayPostgres

PUB = "bench_many"
REPO = Path(__file__).resolve().parents[1]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"
# What spark_session_seconds times: a session started and stopped, nothing else.
SESSION_ONLY = "from pyspark.sql import SparkSession\nSparkSession.builder.getOrCreate().stop()\n"


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
            # delta-rs's scan reads deletion vectors, which the tables Apache Spark creates have.
            data = pa.table(DeltaTable(str(lake / "public" / t)).scan(columns=["qty"]).read_all())
            got = (data.num_rows, sum(v for v in data.column("qty").to_pylist() if v is not None))
            if got != (int(row[0]), int(row[1])):
                print(f"MISMATCH in {t}: PostgreSQL {tuple(row)}, Delta {got}", file=sys.stderr)
                ok = False
    return ok


def many_tables(runs: list[tuple[str, SparkStart | None]], n: int, rows: int, pg_version: int,
                ) -> dict[tuple[str, str, int], float] | None:
    """Seconds of ``Job.run()`` per (label, window, parallel_tables), engines already started;
    ``runs``: (``embedded``, None) or (``spark``, how its JVM starts; label ``spark_<start>``
    unless fast). A start other than fast merges 4 tables at once only.

    Each engine runs in a child process of its own: a Spark Connect session (pysail) and a classic
    one do not mix in one Python process (pyspark decides per process which one its functions use).
    """
    out: dict[tuple[str, str, int], float] = {}
    for kind, start in runs:
        argv = [sys.executable, __file__, "--one-engine", kind, "--tables", str(n), "--rows", str(rows), "--pg", str(pg_version)]
        label = kind
        if start is not None and start.name != "fast":
            argv += ["--parallel", "4"]
            label = f"{kind}_{start.name}"
        env = start.env(sys.executable) if start is not None else None
        print(f"50 tables, {label}:", flush=True)
        child = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=env)
        print(child.stdout, end="", flush=True)
        if child.returncode != 0:
            return None
        for line in child.stdout.splitlines():
            if line.startswith("{"):
                for key, seconds in json.loads(line).items():
                    phase, parallel = key.split(":")
                    out[(label, phase, int(parallel))] = seconds
    return out


def _more_changes(dsn: str, tables: list[str]) -> None:
    """The next window: a few updates, inserts and deletes in every (existing) table."""
    with psycopg.connect(dsn) as conn:
        for i, t in enumerate(tables):
            ident = sql.Identifier(t)
            conn.execute(sql.SQL("UPDATE {} SET qty = qty * 2 WHERE id % 7 = 1").format(ident))
            conn.execute(sql.SQL("INSERT INTO {} SELECT g, 'new ' || g, g, now() FROM generate_series(100001, 100020) g").format(
                ident))
            conn.execute(sql.SQL("DELETE FROM {} WHERE id % 11 = 2").format(ident))
            if i % 5 == 4:
                conn.commit()
        conn.commit()


def _many_tables_one_engine(kind: str, n: int, rows: int, pg_version: int, parallels: list[int]) -> dict[str, float] | None:
    """Per "first:<parallel>" (the window that creates the 50 Delta tables) and "next:<parallel>"
    (the following window, tables in place: what every scheduled run does), seconds of Job.run()."""
    slots = {parallel: f"slot_{parallel}" for parallel in parallels}
    tables = _tables(n)
    pg = ThrowawayPostgres.start(pg_version)
    root = Path(tempfile.mkdtemp(prefix="pg2delta-bench-many-"))
    out: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        _workload(pg.dsn, tables, rows, list(slots.values()))
        with psycopg.connect(pg.dsn) as conn:
            row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
        assert row is not None
        hi, lo = str(row[0]).split("/")
        first_end = (int(hi, 16) << 32) | int(lo, 16)
        _more_changes(pg.dsn, tables)
        print(f"workload: PostgreSQL {pg_version}, {n} tables of {rows} rows, inserts + updates + deletes, then a "
              f"second window of changes to every table ({time.perf_counter() - t0:.1f} s)", flush=True)
        t0 = time.perf_counter()
        engine = Engine.start(EngineConfig(kind=kind), Lake(str(root / "warm")))
        print(f"{kind}: engine started in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            for parallel, slot in slots.items():
                lake = root / f"{kind}-{parallel}"
                cfg = cfgmod.load(env={}, dsn=pg.dsn, slot=slot, publication=PUB, lake=str(lake), engine=kind)
                cfg = dataclasses.replace(cfg, window=dataclasses.replace(cfg.window, parallel_tables=parallel))
                for phase, until in (("first", first_end), ("next", None)):
                    job = Job(cfg, engine_factory=engine.with_lake)
                    t0 = time.perf_counter()
                    report = job.run(until_lsn=until)
                    seconds = time.perf_counter() - t0
                    touched = len(report.windows[0].tables) if report.windows else 0
                    print(f"{kind}: {phase} window, {touched} tables, {report.changes:,} changes, "
                          f"parallel_tables={parallel}: {seconds:.1f} s", flush=True)
                    if touched != n:
                        return None
                    out[f"{phase}:{parallel}"] = seconds
                if not _check(pg.dsn, lake, tables):
                    return None
            if 4 in parallels:
                out.update(_floor(engine.spark, root / f"{kind}-floor", n, rows))
        finally:
            engine.stop()
        return out
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


# The floor's window per table, as _more_changes's in shape (updates of every 7th key, 20 inserts,
# deletes of every 11th key): one source of rows with the change's kind.
FLOOR_SOURCE = ("SELECT id, 'n' AS name, id * 3 AS qty, IF(id % 11 = 2, 'D', 'U') AS op FROM range(1, {rows}) "
                "WHERE id % 7 = 1 OR id % 11 = 2 UNION ALL SELECT id, 'new', id, 'I' FROM range(100001, 100021)")
FLOOR_MERGE = ("MERGE INTO delta.`{path}` t USING {view} s ON t.id = s.id WHEN MATCHED AND s.op = 'D' THEN DELETE "
               "WHEN MATCHED THEN UPDATE SET t.name = s.name, t.qty = s.qty "
               "WHEN NOT MATCHED AND s.op <> 'D' THEN INSERT (id, name, qty) VALUES (s.id, s.name, s.qty)")


def _floor(spark: Any, root: Path, n: int, rows: int) -> dict[str, float]:
    """The engine's own floor under the 50-table window, in the session that just ran it: ``n``
    Delta tables of ``rows`` rows created bare (no pg2delta), then one plain ``MERGE`` of a window
    of the same shape into each, 4 tables at once as ``parallel_tables``, then one plain append
    of the same rows into each (what a table's window costs at the least); seconds of each."""
    paths = [str(root / f"t{i:03d}") for i in range(n)]
    for path in paths:
        spark.sql(f"SELECT id, concat('row ', id) AS name, id * 2 AS qty FROM range(1, {rows + 1})").write.format(
            "delta").save(path)

    def merge(i: int) -> None:
        view = f"floor_src_{i}"
        spark.sql(FLOOR_SOURCE.format(rows=rows + 1)).createOrReplaceTempView(view)
        spark.sql(FLOOR_MERGE.format(path=paths[i], view=view)).collect()

    def append(i: int) -> None:
        spark.sql(FLOOR_SOURCE.format(rows=rows + 1)).selectExpr("id", "name", "qty").write.format("delta").mode(
            "append").save(paths[i])

    out = {}
    for name, one in (("floor_merge", merge), ("floor_append", append)):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(n)))
        out[f"{name}:4"] = time.perf_counter() - t0
        print(f"floor: {n} bare {name.split('_')[1]}s, 4 at once: {out[f'{name}:4']:.1f} s", flush=True)
    return out


def _submit(start: SparkStart, script: Path, *args: str, spark_args: tuple[str, ...] = (),
            env: dict[str, str] | None = None, s3a: bool = False) -> float:
    """Seconds of ``spark-submit [start's flags] [spark_args] script args`` in a new process started
    ``start``'s way (``s3a``: with hadoop-aws and the AWS SDK); exit 0 or 3, else SystemExit."""
    full = start.env(sys.executable, s3a=s3a)
    full.update(env or {})
    argv = [str(SPARK_SUBMIT), *start.flags(s3a=s3a), *spark_args, str(script), *args]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=full, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode not in (0, 3):
        raise SystemExit(f"spark-submit {script.name} exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    return seconds


def fixed_costs(pg_version: int, rounds: int, starts: list[SparkStart]) -> dict[str, tuple[float, float]]:
    """Per start, (spark_session_seconds, idle_run_seconds_spark): medians of ``rounds`` spark-submits,
    a session and an idle run of each start per round, alternated."""
    pg = ThrowawayPostgres.start(pg_version)
    root = Path(tempfile.mkdtemp(prefix="pg2delta-bench-idle-"))
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int)")
            conn.execute("CREATE TABLE unpublished (id int)")
            conn.execute("CREATE PUBLICATION bench_idle FOR TABLE items")
            conn.execute("SELECT pg_create_logical_replication_slot('bench_idle', 'pgoutput')")
            conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 1000) g")
        config = root / "idle.toml"
        config.write_text(
            f"[source]\ndsn = {json.dumps(pg.dsn)}\nslot = \"bench_idle\"\npublication = \"bench_idle\"\n"
            f"[lake]\nroot = {json.dumps(str(root / 'lake'))}\n"
        )
        session_script = root / "session_only.py"
        session_script.write_text(SESSION_ONLY)
        run = REPO / "jobs" / "pg2delta_run.py"
        first = _submit(starts[0], run, "--config", str(config))
        print(f"first run through spark-submit (1,000 inserts into a new table), {starts[0].name}: {first:.1f} s", flush=True)
        session: dict[str, list[float]] = {start.name: [] for start in starts}
        idle: dict[str, list[float]] = {start.name: [] for start in starts}
        for i in range(rounds):
            for start in starts if i % 2 == 0 else reversed(starts):
                session[start.name].append(_submit(start, session_script))
                with psycopg.connect(pg.dsn, autocommit=True) as conn:  # something to read, nothing to apply
                    conn.execute("INSERT INTO unpublished SELECT generate_series(1, 100)")
                idle[start.name].append(_submit(start, run, "--config", str(config)))
        for start in starts:
            print(f"spark-submit, {start.name}, session only: " + ", ".join(f"{x:.1f}" for x in session[start.name]) + " s")
            print(f"spark-submit, {start.name}, idle run:     " + ", ".join(f"{x:.1f}" for x in idle[start.name]) + " s",
                  flush=True)
        with psycopg.connect(pg.dsn) as conn:
            row = conn.execute("SELECT count(*), sum(qty) FROM items").fetchone()
        from deltalake import DeltaTable

        # delta-rs's scan reads deletion vectors (Apache Spark's tables have them), to_pyarrow_table does not
        data = pa.table(DeltaTable(str(root / "lake" / "public" / "items")).scan(columns=["qty"]).read_all())
        if row is None or (data.num_rows, sum(data.column("qty").to_pylist())) != (int(row[0]), int(row[1])):
            raise SystemExit(f"MISMATCH in items: PostgreSQL {row}, Delta {data.num_rows} rows")
        return {name: (statistics.median(session[name]), statistics.median(idle[name])) for name in session}
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


# The floor under the end-to-end window on Apache Spark: a session started, and the window's final
# rows (the Parquet files of the table the run created) written into a new Delta table: what the run
# must do at the least once its window is read, decoded and staged.
E2E_FLOOR = """import json, sys, time
t0 = time.perf_counter()
from pyspark.sql import SparkSession
spark = SparkSession.builder.getOrCreate()
t1 = time.perf_counter()
spark.read.parquet(sys.argv[1] + "/*.parquet").write.format("delta").save(sys.argv[2])
t2 = time.perf_counter()
spark.stop()
print(json.dumps({"session": t1 - t0, "write": t2 - t1}))
"""


def end_to_end(argv: list[str], starts: list[SparkStart]) -> dict[str, float] | None:
    """``spark_e2e_vs_server`` per start: bench_e2e's run in a child process started that way (a new
    window each; the idle and 10,000-change runs after it with the first start only). With the first
    start, the floor under it too (:data:`E2E_FLOOR`, a new process started the same way, on the rows
    the run wrote): ``floor_session`` and ``floor_write`` seconds, and ``server``, the server's COPY."""
    out: dict[str, float] = {}
    for i, start in enumerate(starts):
        print(f"end to end, Spark started {start.name}:", flush=True)
        child_argv = [sys.executable, __file__, *argv, "--one-e2e", *(["--no-fixed-costs"] if i else ["--keep-lake"])]
        child = subprocess.run(child_argv, stdout=subprocess.PIPE, text=True, env=start.env(sys.executable))
        print(child.stdout, end="", flush=True)
        results = [json.loads(line) for line in child.stdout.splitlines() if line.startswith('{"ratio"')]
        if child.returncode != 0 or not results:
            return None
        out[start.name] = results[-1]["ratio"]
        if i == 0:
            table = Path(results[-1]["table"])
            try:
                floor = subprocess.run([sys.executable, "-c", E2E_FLOOR, str(table), str(table.parent / "floor")],
                                       stdout=subprocess.PIPE, text=True, env=start.env(sys.executable))
                seconds = [json.loads(line) for line in floor.stdout.splitlines() if line.startswith("{")]
                if floor.returncode != 0 or not seconds:
                    return None
            finally:
                shutil.rmtree(table.parents[1], ignore_errors=True)  # the lake the run kept
            out.update(server=results[-1]["server"], floor_session=seconds[-1]["session"], floor_write=seconds[-1]["write"])
            print(f"floor: a session {out['floor_session']:.2f} s, the window's rows into a new Delta table "
                  f"{out['floor_write']:.2f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_e2e_args(ap)
    ap.add_argument("--tables", type=int, default=50, help="tables in the many-tables window (default 50)")
    ap.add_argument("--rows", type=int, default=200, help="rows inserted per table (default 200)")
    ap.add_argument("--fixed-rounds", type=int, default=3, help="spark-submits of each fixed cost and start (default 3)")
    ap.add_argument("--cluster-rounds", type=int, default=3, help="small runs of each setting in the cluster part (default 3)")
    ap.add_argument("--only", choices=("fixed", "tables", "e2e", "cluster"), help="one part of the benchmark only")
    ap.add_argument("--spark-cache", default=str(REPO / ".cache" / "spark35"),
                    help="make install-spark's folder of Delta's jars, settings and class-data archive")
    ap.add_argument("--one-engine", choices=("embedded", "spark"), help=argparse.SUPPRESS)
    ap.add_argument("--parallel", type=int, action="append", help=argparse.SUPPRESS)
    ap.add_argument("--one-e2e", action="store_true", help=argparse.SUPPRESS)
    ap.set_defaults(engine="spark")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.one_engine:
        one = _many_tables_one_engine(args.one_engine, args.tables, args.rows, args.pg, args.parallel or [1, 4])
        if one is None:
            return 1
        print(json.dumps(one))
        return 0
    if args.one_e2e:
        measured = measure(args)
        if measured is None:
            return 1
        print(json.dumps({"ratio": measured.ratio, "server": measured.server_seconds, "table": str(measured.table)}))
        return 0

    cache = Path(args.spark_cache).resolve()
    fast, tiered, plain = (SparkStart(name, cache) for name in ("fast", "tiered", "plain"))
    fast.check()
    part = args.only
    ratios = end_to_end(argv, [fast, tiered]) if part in (None, "e2e") else {}
    if ratios is None:
        return 1
    fixed = fixed_costs(args.pg, args.fixed_rounds, [fast, plain]) if part in (None, "fixed") else {}
    runs: list[tuple[str, SparkStart | None]] = [("embedded", None), ("spark", fast), ("spark", tiered)]
    times = many_tables(runs, args.tables, args.rows, args.pg) if part in (None, "tables") else {}
    if times is None:
        return 1
    small = bench_cluster.small_runs(args.pg, args.cluster_rounds, _submit, fast) if part in (None, "cluster") else None
    report(args.tables, ratios, fixed, times, small)
    return 0


def report(n: int, ratios: dict[str, float], fixed: dict[str, tuple[float, float]],
           times: dict[tuple[str, str, int], float], small: tuple[float, float] | None) -> None:
    """The figures' lines (see the module's docstring)."""
    if times:
        for kind in ("embedded", "spark"):
            print(f"tables{n}_first_window_seconds_{kind}={times[(kind, 'first', 4)]:.1f}  "
                  f"(one table at a time: {times[(kind, 'first', 1)]:.1f})")
            print(f"tables{n}_seconds_{kind}_one_at_a_time={times[(kind, 'next', 1)]:.1f}")
        print(f"tables{n}_first_window_seconds_spark_tiered={times[('spark_tiered', 'first', 4)]:.1f}")
    for name, suffix in (("fast", ""), ("tiered", "_tiered")):
        if name in ratios:
            print(f"spark_e2e_vs_server{suffix}={ratios[name]:.2f}")
    if "floor_write" in ratios:
        floor = ratios["floor_session"] + ratios["floor_write"]
        print(f"spark_e2e_floor_seconds={floor:.2f}  (a session {ratios['floor_session']:.2f} s + the window's rows "
              f"written into a new Delta table {ratios['floor_write']:.2f} s)")
        print(f"spark_e2e_floor_vs_server={ratios['server'] / floor:.2f}  (the server's COPY / that floor: the most "
              "spark_e2e_vs_server could be)")
    for name, suffix in (("fast", ""), ("plain", "_plain")):
        if name in fixed:
            session, idle = fixed[name]
            print(f"spark_session_seconds{suffix}={session:.1f}")
            print(f"idle_run_seconds_spark{suffix}={idle:.1f}  (idle / session = {idle / session:.2f})")
    if times:
        for label in ("embedded", "spark", "spark_tiered"):
            print(f"tables{n}_seconds_{label}={times[(label, 'next', 4)]:.1f}")
            merge, append = times.get((label, "floor_merge", 4)), times.get((label, "floor_append", 4))
            if merge is not None and append is not None:
                print(f"tables{n}_floor_merge_seconds_{label}={merge:.1f}")
                print(f"tables{n}_floor_append_seconds_{label}={append:.1f}")
                print(f"tables{n}_vs_floor_merge_{label}={times[(label, 'next', 4)] / merge:.2f}")
    if small is not None:
        print(f"small_run_seconds_spark_s3={small[0]:.1f}  (local[2], 10 updates, lake on the object store)")
        print(f"cluster_small_run_seconds={small[1]:.1f}  (standalone cluster / local[2] = {small[1] / small[0]:.2f})")


if __name__ == "__main__":
    sys.exit(main())
