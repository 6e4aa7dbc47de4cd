"""`make bench-year`: a year of five-minute runs with the default configuration, as a scheduler leaves it.

On a throwaway PostgreSQL (15 by default) with a temporary lake per engine: one table gets a small
transaction (``--rows`` inserts, default 20, and two updates), then ``pg2delta run`` is started as
a new process, as cron or Airflow would start it, with no configuration file and nothing else run
by hand: no ``pg2delta maintain``, no OPTIMIZE, no VACUUM. Whatever keeps the table cheap must be
the defaults' doing (``[maintain] interval``, the engines' checkpoints).

The runs follow each other as fast as they go, but the clock that schedules maintenance is moved
five minutes per run (``PG2DELTA_MAINTAIN_CLOCK_OFFSET``, a test hook read by nothing else), so
2,000 runs are scheduled as a week of five-minute runs is. Delta's own clocks are not moved:
VACUUM's retention (7 days) and the log's (30 days) count real time, so files a year would remove
stay on disk here; the active files, which every window reads, are what this measures.

Engines: the embedded one (``python -m pg2delta.cli run``, ``--windows``, default 2,000, or
``BENCH_YEAR_WINDOWS``) and Apache Spark (``spark-submit jobs/pg2delta_run.py`` with the Spark 3.5
venv's ``spark-submit`` and the conf dir ``SPARK_CONF_DIR`` names, ``--spark-windows``, default
200, or ``BENCH_YEAR_SPARK_WINDOWS``; 0 skips it). Each run is timed from its process's start to
its exit.

Per engine (prefix ``embedded_`` or ``spark_``): ``window_seconds_first_100=`` and
``window_seconds_last_100=`` (medians of the first and last hundred runs, or of a fifth of them
when there are fewer than 500), ``year_growth=`` (last / first; target <= 1.2),
``active_files=`` (the table's files at the end), ``maintenance_runs=`` and
``maintenance_run_seconds_max=`` (the longest run that maintained). Before printing, the lake is
read back with delta-rs and compared with PostgreSQL (row count and sums), else exit 1.

Then ``window_seconds_aged=`` and ``window_seconds_young=``, with ``year_growth_vs_young=`` (their
ratio): ``--control`` pairs of runs after the year (default as many as the medians above take),
one into the year's table and one into a young table of the same shape (its own slot, publication
and lake, created then), alternated, so that both meet the machine as it is then. The first and
last hundred runs are an hour or more apart on a shared machine whose speed drifts by as much as
the growth measured; the pairs are not. The young table's first runs create it, as the year's did.

2,000 runs are a week of a five-minute schedule, and the applied log gains a row per run and table:
a year leaves it 105,120 rows a table. So then, unless ``--year-log-rows 0``, the year's applied log
is given older windows of its table up to ``--year-log-rows`` rows (default 105,120; one commit by
delta-rs, window ends below the slot's first, as the weeks before would have left them), and as many
pairs again are run: ``window_seconds_aged_year_log=``, ``window_seconds_young_year_log=`` and
``year_log_growth_vs_young=``.

Last, on the embedded engine, the floor of the engine underneath (unless ``--floor-writes 0``):
pysail alone, in one session, commits a one-row overwrite (``replaceWhere`` of a key no row has)
into a copy of the year's table (its log and its active files) and into a twin of it that holds
the same files, metadata and protocol with a fresh log (the newest checkpoint without its
tombstones, the commits after it), alternated, ``--floor-writes`` times each:
``engine_write_seconds_aged=``, ``engine_write_seconds_fresh_log=`` and ``engine_write_growth=``,
what a year's log costs each write of the engine whatever pg2delta does around it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from pg2delta.source.throwaway import ThrowawayPostgres

STEP = 300  # seconds between two scheduled runs
YEAR_OF_RUNS = 365 * 24 * 3600 // STEP  # 105,120
ROOT = Path(__file__).resolve().parent.parent
SETUP = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE bench.{table} (id bigint PRIMARY KEY, device int NOT NULL, value double precision,
                            note text, at timestamptz NOT NULL DEFAULT now());
CREATE PUBLICATION {table} FOR TABLE bench.{table};
"""


@dataclass
class Engine:
    name: str
    argv: list[str]  # the run's command, before its arguments
    env: dict[str, str]
    windows: int


@dataclass
class Runs:
    seconds: list[float] = field(default_factory=list)
    maintained: list[bool] = field(default_factory=list)


def transaction(conn: psycopg.Connection, table: str, w: int, rows: int) -> None:
    lo = w * rows + 1
    with conn.transaction():
        conn.execute(
            f"INSERT INTO bench.{table} (id, device, value, note) "
            "SELECT g, mod(g, 97), g * 0.5, 'reading ' || g FROM generate_series(%s::bigint, %s) g",
            (lo, lo + rows - 1),
        )
        if w:
            conn.execute(f"UPDATE bench.{table} SET value = value + 1 WHERE id IN (%s, %s)", (w, w * 7 % lo + 1))


def scheduled_run(engine: Engine, dsn: str, table: str, lake: Path, k: int) -> tuple[float, dict]:
    """One run as a scheduler starts it, ``k`` five-minute steps after the first."""
    env = {key: v for key, v in os.environ.items() if not key.startswith(("PG2DELTA_", "PG"))}
    env.update(engine.env)
    env["PG2DELTA_MAINTAIN_CLOCK_OFFSET"] = str(k * STEP)
    argv = [*engine.argv, "--dsn", dsn, "--slot", table, "--publication", table, "--lake", str(lake), "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{engine.name} run {k} exited {done.returncode}: {done.stderr.strip()[-1500:]}")
    out = done.stdout
    report = json.loads(out if out.startswith("{") else out[out.index("\n{") + 1 :])
    return seconds, report


def year(
    engine: Engine, pg: ThrowawayPostgres, tmp: Path, rows: int, times_file: Path | None, pairs: int, year_log_rows: int,
    floor_writes: int = 0,
) -> Runs:
    table = f"year_{engine.name}"
    lake = tmp / f"lake_{engine.name}"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(SETUP.format(table=table))
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (table,))
        runs = Runs()
        t_start = time.perf_counter()
        for k in range(engine.windows):
            transaction(conn, table, k, rows)
            seconds, report = scheduled_run(engine, pg.dsn, table, lake, k)
            if report.get("windows", 0) < 1:
                raise SystemExit(f"{engine.name} run {k} applied no window")
            runs.seconds.append(seconds)
            runs.maintained.append(bool((report.get("maintenance") or {}).get("tables")))
            if times_file is not None:
                with times_file.open("a") as out:
                    out.write(f"{engine.name},{k},{seconds:.3f},{int(runs.maintained[-1])}\n")
            if (k + 1) % 100 == 0:
                print(f"{engine.name}: {k + 1} runs, {time.perf_counter() - t_start:.0f} s, last {seconds:.2f} s",
                      flush=True)
    check_equal(engine.name, pg, lake, table)
    report_figures(engine.name, runs, len(DeltaTable(str(lake / "bench" / table)).file_uris()))
    if pairs:
        compare(engine, pg, tmp, rows, pairs, engine.windows, "")
    if pairs and year_log_rows:
        added = seed_year_log(lake / "_pg2delta" / "applied_log", table, year_log_rows)
        print(f"{engine.name}: {added} older windows added to the applied log, {year_log_rows} rows", flush=True)
        compare(engine, pg, tmp, rows, pairs, engine.windows + pairs, "_year_log")
        check_equal(engine.name, pg, lake, table)
    if pairs:
        check_equal(engine.name, pg, tmp / f"lake_{engine.name}_young", f"young_{engine.name}")
    if floor_writes and engine.name == "embedded":
        engine_floor(lake / "bench" / table, tmp / "floor", floor_writes)
    return runs


def check_equal(name: str, pg: ThrowawayPostgres, lake: Path, table: str) -> None:
    """Exit 1 unless the lake's table, read with delta-rs, has PostgreSQL's row count and sums."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        pg_rows = conn.execute(f"SELECT count(*), sum(value), sum(id) FROM bench.{table}").fetchone()
    assert pg_rows is not None
    got = pa.table(DeltaTable(str(lake / "bench" / table)).scan().read_all())
    lake_rows = (got.num_rows, float(sum(got.column("value").to_pylist())), int(sum(got.column("id").to_pylist())))
    if lake_rows != (pg_rows[0], float(pg_rows[1]), int(pg_rows[2])):
        raise SystemExit(f"{name}: the lake {lake_rows} differs from PostgreSQL {tuple(pg_rows)}")


def compare(engine: Engine, pg: ThrowawayPostgres, tmp: Path, rows: int, pairs: int, k0: int, suffix: str) -> None:
    """Print the medians of :func:`control`'s pairs, and their ratio (``k0``: the year's runs, and
    the pairs before, which the young table had too)."""
    aged, young = control(engine, pg, tmp, rows, pairs, k0, k0 - engine.windows)
    a, y = statistics.median(aged), statistics.median(young)
    print(f"{engine.name}: {pairs} pairs of runs after the year, the year's table and a young one alternated", flush=True)
    print(f"{engine.name}_window_seconds_aged{suffix}={a:.3f}")
    print(f"{engine.name}_window_seconds_young{suffix}={y:.3f}")
    growth = "year_growth_vs_young" if not suffix else f"{suffix[1:]}_growth_vs_young"
    print(f"{engine.name}_{growth}={a / y:.2f}", flush=True)


def seed_year_log(uri: Path, table: str, total: int) -> int:
    """Append to the applied log at ``uri`` older windows of ``table`` (copies of its first window's
    row, each ending below the slot's first window) so that it holds ``total`` rows; how many."""
    log = DeltaTable(str(uri))
    have = log.to_pyarrow_table()
    mine = [r for r in have.to_pylist() if r["table_name"] == table and r.get("kind") == "window"]
    first = min(mine, key=lambda r: r["window_start"])
    n = int(total - have.num_rows)
    if n <= 0:
        return 0
    step = first["window_start"] // (n + 1)
    if step < 2:
        raise SystemExit(f"the slot's first window starts at {first['window_start']}: no room for {n} older windows")
    us = 10**6
    stamp = first["applied_at"]
    older = []
    for i in range(n):
        start, end = (i + 1) * step, (i + 2) * step - 1
        at = stamp - dt.timedelta(seconds=(n - i) * STEP)
        older.append({**first, "run_id": f"seeded-{i:06d}", "window_start": start, "window_end": end,
                      "window_end_lsn": f"{end >> 32:X}/{end & 0xFFFFFFFF:X}", "delta_version": 0,
                      "applied_at": at, "commit_ts": at - dt.timedelta(microseconds=us)})
    write_deltalake(str(uri), pa.Table.from_pylist(older, schema=have.schema), mode="append")
    return n


def control(
    engine: Engine, pg: ThrowawayPostgres, tmp: Path, rows: int, pairs: int, k0: int, young0: int
) -> tuple[list[float], list[float]]:
    """``pairs`` runs into the year's table alternated with as many into a young one (see the
    module's docstring; created unless it had ``young0`` runs already), the first at step ``k0``:
    their seconds, aged and young."""
    aged, young = f"year_{engine.name}", f"young_{engine.name}"
    lakes = {aged: tmp / f"lake_{engine.name}", young: tmp / f"lake_{engine.name}_young"}
    out: dict[str, list[float]] = {aged: [], young: []}
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        if not young0:
            conn.execute(SETUP.format(table=young))
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (young,))
        for i in range(pairs):
            for table in (aged, young) if i % 2 == 0 else (young, aged):
                w = k0 + i if table == aged else young0 + i  # the young table's ids from 1, as the year's were
                transaction(conn, table, w, rows)
                seconds, _ = scheduled_run(engine, pg.dsn, table, lakes[table], k0 + i)
                out[table].append(seconds)
    return out[aged], out[young]


def _copy_files(table: Path, into: Path) -> None:
    """Copy the data files of the Delta table ``table``'s latest version under ``into``, at their paths."""
    for uri in DeltaTable(str(table)).file_uris():
        rel = Path(uri.removeprefix("file://")).relative_to(table)
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        (into / rel).write_bytes((table / rel).read_bytes())


def fresh_log_twin(table: Path, twin: Path) -> None:
    """Make ``twin`` the Delta table ``table`` is at its latest version (the same data files,
    metadata and protocol) with a fresh log: its newest checkpoint without the removed files'
    tombstones, and the commits after it."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    log_dir, twin_log = table / "_delta_log", twin / "_delta_log"
    twin_log.mkdir(parents=True)
    hint = json.loads((log_dir / "_last_checkpoint").read_text())
    version = int(hint["version"])
    if hint.get("parts") or "v2Checkpoint" in hint:
        raise SystemExit(f"{table}: a multi-part or V2 checkpoint; the floor's twin takes a classic one")
    state = pq.read_table(log_dir / f"{version:020d}.checkpoint.parquet")
    kept = state.filter(pc.is_null(state.column("remove")))
    pq.write_table(kept, twin_log / f"{version:020d}.checkpoint.parquet")
    (twin_log / "_last_checkpoint").write_text(json.dumps({"version": version, "size": kept.num_rows}))
    for commit in sorted(p for p in log_dir.glob("*.json") if int(p.name[:20]) > version):
        (twin_log / commit.name).write_bytes(commit.read_bytes())
    _copy_files(table, twin)


def engine_floor(table: Path, tmp: Path, writes: int) -> None:
    """Print the medians of ``writes`` one-row overwrites by pysail alone into a copy of the Delta
    table ``table`` (its log and active files) and into its fresh-log twin, alternated (see the
    module's docstring)."""
    from pysail.spark import SparkConnectServer
    from pyspark.sql import SparkSession

    aged, fresh = tmp / "aged", tmp / "fresh"
    (aged / "_delta_log").mkdir(parents=True)
    for entry in (table / "_delta_log").iterdir():
        (aged / "_delta_log" / entry.name).write_bytes(entry.read_bytes())
    _copy_files(table, aged)
    fresh_log_twin(table, fresh)
    versions = {path: DeltaTable(str(path)).version() for path in (aged, fresh)}
    server = SparkConnectServer("127.0.0.1", 0)
    server.start(background=True)
    spark = SparkSession.builder.remote(f"sc://127.0.0.1:{server.listening_address[1]}").getOrCreate()
    out: dict[Path, list[float]] = {aged: [], fresh: []}
    try:
        for i in range(writes + 1):  # the first pair warms the session
            for path in (aged, fresh) if i % 2 == 0 else (fresh, aged):
                key = -(i + 1)  # a key no row has: the one row written meets the condition
                row = spark.sql(f"SELECT * FROM delta.`{path}` LIMIT 1").selectExpr(
                    f"CAST({key} AS BIGINT) AS id", "device", "value", "note", "at")
                t0 = time.perf_counter()
                row.write.format("delta").mode("overwrite").option("replaceWhere", f"id = {key}").save(str(path))
                if i:
                    out[path].append(time.perf_counter() - t0)
    finally:
        spark.stop()
        server.stop()
    for path in (aged, fresh):
        if DeltaTable(str(path)).version() != versions[path] + writes + 1:
            raise SystemExit(f"the floor's writes into {path} did not each make a commit")
    a, y = statistics.median(out[aged]), statistics.median(out[fresh])
    print(f"embedded: the engine alone, {writes} one-row overwrites each into the year's table and its fresh-log twin",
          flush=True)
    print(f"embedded_engine_write_seconds_aged={a:.3f}")
    print(f"embedded_engine_write_seconds_fresh_log={y:.3f}")
    print(f"embedded_engine_write_growth={a / y:.2f}", flush=True)


def report_figures(name: str, runs: Runs, active_files: int) -> None:
    n = len(runs.seconds)
    k = 100 if n >= 500 else max(1, n // 5)
    first, last = statistics.median(runs.seconds[:k]), statistics.median(runs.seconds[-k:])
    maint = [s for s, m in zip(runs.seconds, runs.maintained, strict=True) if m]
    print(f"{name}: {n} runs, medians over the first and last {k}; {len(maint)} runs maintained", flush=True)
    print(f"{name}_runs={n}")
    print(f"{name}_window_seconds_first_100={first:.3f}")
    print(f"{name}_window_seconds_last_100={last:.3f}")
    print(f"{name}_active_files={active_files}")
    print(f"{name}_maintenance_runs={len(maint)}")
    print(f"{name}_maintenance_run_seconds_max={max(maint, default=0.0):.2f}")
    print(f"{name}_year_growth={last / first:.2f}", flush=True)


def engines(args: argparse.Namespace) -> list[Engine]:
    out = []
    if args.windows:
        out.append(Engine("embedded", [sys.executable, "-m", "pg2delta.cli", "run"], {}, args.windows))
    if args.spark_windows:
        if not args.spark_submit:
            raise SystemExit("--spark-windows needs --spark-submit (the Spark 3.5 venv's spark-submit)")
        venv_python = str(Path(args.spark_submit).parent / "python")
        env = {"PYSPARK_PYTHON": venv_python, "PYSPARK_DRIVER_PYTHON": venv_python}
        for key in ("JAVA_HOME", "SPARK_CONF_DIR", "SPARK_SUBMIT_OPTS"):
            if key in os.environ:
                env[key] = os.environ[key]
        out.append(Engine("spark", [args.spark_submit, str(ROOT / "jobs" / "pg2delta_run.py")], env, args.spark_windows))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=int(os.environ.get("BENCH_YEAR_WINDOWS", 2000)),
                    help="runs on the embedded engine (default 2,000, or BENCH_YEAR_WINDOWS; 0 skips)")
    ap.add_argument("--spark-windows", type=int, default=int(os.environ.get("BENCH_YEAR_SPARK_WINDOWS", 200)),
                    help="runs on Apache Spark (default 200, or BENCH_YEAR_SPARK_WINDOWS; 0 skips)")
    ap.add_argument("--spark-submit", default=os.environ.get("BENCH_YEAR_SPARK_SUBMIT", ""),
                    help="the spark-submit to start Spark runs with")
    ap.add_argument("--rows", type=int, default=20, help="inserts per transaction (default 20)")
    ap.add_argument("--pg", type=int, default=15, choices=(15, 18))
    ap.add_argument("--control", type=int, default=None,
                    help="pairs of runs after the year, its table and a young one alternated (default: as many as the medians take; 0: none)")
    ap.add_argument("--year-log-rows", type=int, default=YEAR_OF_RUNS,
                    help="then give the year's applied log older windows up to this many rows, and run the pairs again (default 105,120; 0: not)")
    ap.add_argument("--floor-writes", type=int, default=30,
                    help="then one-row overwrites by pysail alone into the year's table and its fresh-log twin, each (default 30; 0: not)")
    ap.add_argument("--times-file", type=Path, help="also append engine,run,seconds,maintained per run to this CSV")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its server

    pg = ThrowawayPostgres.start(args.pg)
    try:
        with tempfile.TemporaryDirectory(prefix="pg2delta-bench-year-") as tmp:
            for engine in engines(args):
                pairs = args.control if args.control is not None else (100 if engine.windows >= 500 else max(1, engine.windows // 5))
                year(engine, pg, Path(tmp), args.rows, args.times_file, pairs, args.year_log_rows, args.floor_writes)
    finally:
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
