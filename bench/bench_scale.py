"""`make bench-scale`: what one scheduled run costs as its table grows, on both engines.

On a throwaway PostgreSQL 15, one table per size (``--rows``: 200,000, 2,000,000 and 20,000,000
rows; ``PG2DELTA_BENCH_SCALE_MAX_ROWS`` leaves out the larger ones for a quick run) of a bigint
key and four columns, loaded in key order. Per engine, every command runs as a scheduler starts
it, in a new process: ``pg2delta bootstrap`` / ``pg2delta run`` for the embedded engine,
``spark-submit jobs/pg2delta_bootstrap.py`` / ``jobs/pg2delta_run.py`` for Apache Spark
(``local[2]``, Delta's jars from ``make install-spark``'s cache, ``--spark-cache``), and on
``spark_connect`` ``pg2delta bootstrap`` / ``pg2delta run --engine connect`` against Apache Spark's
Spark Connect server with Delta, started once before the first table (the same settings, a plain
start: the full compiler suits a driver that lives long; docs/engines/connect.md). Apache Spark's
commands start fast, as docs/engines/spark-submit.md recommends for scheduled runs: the class-data
archive that set-up trained, the client compiler, the settings as ``--properties-file``. Per table:

1. the bootstrap (the copy through COPY), timed: ``bootstrap_seconds_<engine>_<rows>=``;
2. a window of 1,000 updates to keys of the newest 1 %: ``rewritten_fraction_recent_<engine>=``
   for the largest table;
3. the window of 1,000 scattered updates, 100 inserts and 100 deletes:
   ``run_seconds_<engine>_<rows>=``, and for the largest table ``rewritten_fraction_<engine>=``;
4. for the largest table, a window of 1,200 inserts alone: ``inserts_run_seconds_<engine>_<rows>=``.

A rewritten fraction is the bytes of the data files the run's commit removed and did not add
again unchanged (a file that only got a deletion vector keeps its path), over the table's bytes
before it, from the Delta log as delta-rs reads it. Every lake is read back with delta-rs after
each run and compared with PostgreSQL (rows, sums of the key and of a column every update
changes, the updated rows' text), else exit 1.

Then, on Apache Spark: ``spark_floor_seconds=`` (a bare spark-submit of a script that starts a
session and MERGEs 10 rows into a 1,000-row Delta table), ``idle_run_seconds_spark=`` and
``small_run_seconds_spark=`` (10 updates) on the smallest table, and ``jdbc_overwrite_seconds_spark=``
(a spark-submit of a JDBC read of the 2,000,000-row table, 2 partitions on the key, 10,000 rows a
fetch, and a Delta overwrite: what a Spark user does without CDC; the PostgreSQL JDBC driver comes from Maven Central, resolved once before).
The same fast start for all three. With ``spark_connect``, beside each of them the same through the
running Connect server, each a new client process: ``spark_connect_floor_seconds=``,
``idle_run_seconds_spark_connect=``, ``small_run_seconds_spark_connect=`` and
``jdbc_overwrite_seconds_spark_connect=``, then ``run_vs_jdbc_overwrite_<engine>=`` (the
2,000,000-row table's run seconds over the JDBC overwrite's, on spark and spark_connect); for each
larger table measured, the same overwrite and ratio suffixed with its rows
(``jdbc_overwrite_seconds_spark_20000000=``, ``run_vs_jdbc_overwrite_spark_20000000=``). Then the three again as a plain ``spark-submit`` starts them
(``SPARK_CONF_DIR`` with ``spark-defaults.conf``, no JVM options): ``spark_floor_seconds_plain=``,
``jdbc_overwrite_seconds_spark_plain=`` and ``run_seconds_spark_<largest>_plain=`` (another
window like step 3). Last, ``scale_growth_<engine>=`` (largest table's run seconds / smallest's; target <= 1.5).
The machine is shared: compare figures of one run with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from psycopg.conninfo import conninfo_to_dict
from spark_start import ConnectServer, SparkStart

from pg2delta.source.throwaway import ThrowawayPostgres

REPO = Path(__file__).resolve().parents[1]
SIZES = (200_000, 2_000_000, 20_000_000)
JDBC_PACKAGE = "org.postgresql:postgresql:42.7.4"
PG_SETTINGS = {"max_wal_size": "8GB", "checkpoint_timeout": "30min", "maintenance_work_mem": "512MB"}


class Figures(dict[str, float]):
    """The figures of the run, each printed as it is measured (a long run stopped late keeps those
    measured so far); :func:`main` prints them all again at the end."""

    def __setitem__(self, name: str, value: float) -> None:
        super().__setitem__(name, value)
        print(_figure(name, value), flush=True)


def _figure(name: str, value: float) -> str:
    return f"{name}={value:.3f}" if "fraction" in name else f"{name}={value:.2f}"


def _python(spark_submit: str) -> Path:
    """The Python beside ``spark_submit`` (where pyspark and pg2delta are)."""
    return Path(spark_submit).parent / "python"


class Runner:
    """Starts pg2delta's commands in new processes, per engine, and times them."""

    def __init__(self, dsn: str, root: Path, spark_submit: str | None, start: SparkStart | None) -> None:
        self.dsn, self.root, self.spark_submit, self.start = dsn, root, spark_submit, start
        self.peak_mb = 0
        self.connect: ConnectServer | None = None  # Apache Spark's Connect server, for spark_connect

    def lake(self, engine: str, rows: int) -> Path:
        return self.root / f"lake-{engine}-{rows}"

    def command(self, engine: str, what: str, rows: int, start: SparkStart | None = None) -> float:
        """``pg2delta <what>`` (bootstrap or run) of the table of ``rows`` on ``engine``: seconds
        (``start``: how Apache Spark starts, else the runner's)."""
        common = ["--dsn", self.dsn, "--slot", f"slot_{engine}_{rows}", "--publication", f"pub_{rows}",
                  "--lake", str(self.lake(engine, rows)), "--json"]
        if engine == "embedded":
            argv = [sys.executable, "-m", "pg2delta.cli", what, *common, "--engine", "embedded"]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG", "SPARK_CONF_DIR"))}
        elif engine == "spark_connect":  # a client process of the running server, from the Spark venv
            assert self.spark_submit is not None and self.connect is not None
            argv = [str(_python(self.spark_submit)), "-m", "pg2delta.cli", what, *common, "--engine", "connect",
                    "--remote", self.connect.remote]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG", "SPARK_", "PYSPARK_"))}
        else:
            start = start or self.start
            assert self.spark_submit is not None and start is not None
            argv = [self.spark_submit, *start.flags(), str(REPO / "jobs" / f"pg2delta_{what}.py"), *common]
            env = start.env(_python(self.spark_submit))
        with tempfile.TemporaryFile("w+") as err:
            t0 = time.perf_counter()
            child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
            _, status, usage = os.wait4(child.pid, 0)
            seconds = time.perf_counter() - t0
            child.returncode = os.waitstatus_to_exitcode(status)
            if child.returncode != 0:
                err.seek(0)
                raise SystemExit(f"{engine} {what} of {rows:,} rows exited {child.returncode}: {err.read().strip()[-2000:]}")
        # The process's own peak (spark-submit's JVM is a process of its own, not counted).
        self.peak_mb = usage.ru_maxrss // 1024
        return seconds


def load(dsn: str, rows: int) -> float:
    """The table of ``rows`` rows, in key order, its publication: seconds."""
    t0 = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE scale_{rows} (id bigint NOT NULL, n int NOT NULL, v text, amount numeric(12,2), "
                     "at timestamptz)")
        conn.execute(f"INSERT INTO scale_{rows} SELECT g, g % 1000, md5(g::text), (g % 100000) / 100.0, "
                     f"timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second' FROM generate_series(1, {rows}) g")
        conn.execute(f"ALTER TABLE scale_{rows} ADD PRIMARY KEY (id)")
        conn.execute(f"VACUUM ANALYZE scale_{rows}")
        conn.execute(f"CREATE PUBLICATION pub_{rows} FOR TABLE scale_{rows}")
    return time.perf_counter() - t0


def change(dsn: str, rows: int, tag: str, *, recent: bool, seed: int) -> None:
    """One transaction: 1,000 updates to keys of the newest 1 % (``recent``), or 1,000 scattered
    updates, 100 inserts past the largest key and 100 deletes."""
    rng = random.Random(seed)
    with psycopg.connect(dsn) as conn:
        top = conn.execute(f"SELECT max(id) FROM scale_{rows}").fetchone()[0]  # type: ignore[index]
        if recent:
            updated = rng.sample(range(rows - rows // 100 + 1, rows + 1), 1000)
            deleted: list[int] = []
        else:
            picked = rng.sample(range(1, rows + 1), 1100)
            updated, deleted = picked[:1000], picked[1000:]
        conn.execute(f"UPDATE scale_{rows} SET n = n + 1, v = %s || id WHERE id = ANY(%s)", (f"{tag}-", updated))
        if not recent:
            conn.execute(f"DELETE FROM scale_{rows} WHERE id = ANY(%s)", (deleted,))
            conn.execute(f"INSERT INTO scale_{rows} SELECT g, 0, 'new', 0, now() FROM generate_series(%s::bigint, %s::bigint) g",
                         (top + 1, top + 100))
        conn.commit()


def insert_only(dsn: str, rows: int, count: int = 1200) -> None:
    """One transaction of ``count`` inserts past the largest key: a window of inserts alone."""
    with psycopg.connect(dsn) as conn:
        top = conn.execute(f"SELECT max(id) FROM scale_{rows}").fetchone()[0]  # type: ignore[index]
        conn.execute(f"INSERT INTO scale_{rows} SELECT g, 0, 'ins', 0, now() FROM generate_series(%s::bigint, %s::bigint) g",
                     (top + 1, top + count))
        conn.commit()


def files(lake: Path, rows: int) -> dict[str, int]:
    """The table's data files (path -> bytes) as the Delta log lists them."""
    adds = pa.table(DeltaTable(str(lake / "public" / f"scale_{rows}")).get_add_actions(flatten=True))
    return dict(zip(adds.column("path").to_pylist(), adds.column("size_bytes").to_pylist(), strict=True))


def rewritten(before: dict[str, int], after: dict[str, int]) -> float:
    """Bytes of the files ``before`` that ``after`` no longer lists, over the bytes of ``before``."""
    return sum(size for path, size in before.items() if path not in after) / max(1, sum(before.values()))


def read_rows(path: Path, columns: list[str]) -> pa.Table:
    """The table's rows through delta-rs's scan, which reads deletion vectors (the tables Apache
    Spark creates have them; ``to_pyarrow_table`` refuses those), its view types cast back."""
    data = pa.table(DeltaTable(str(path)).scan(columns=columns).read_all())
    plain = {pa.string_view(): pa.string(), pa.binary_view(): pa.binary()}
    return data.cast(pa.schema([pa.field(f.name, plain.get(f.type, f.type)) for f in data.schema]))


def matches(dsn: str, lake: Path, rows: int) -> bool:
    """The lake's table equals PostgreSQL's: rows, sums of the key and of n (every update changes
    it), sum of key * n, and the rows whose text an update set (per tag)."""
    data = read_rows(lake / "public" / f"scale_{rows}", ["id", "n", "v"])
    ids, ns = data.column("id").cast(pa.int64()), data.column("n").cast(pa.int64())
    tags = pc.value_counts(pc.utf8_slice_codeunits(pc.if_else(pc.match_substring(data.column("v"), "-"), data.column("v"),
                                                              pa.scalar("none")), 0, 2))
    got = (data.num_rows, pc.sum(ids).as_py() or 0, pc.sum(ns).as_py() or 0, pc.sum(pc.multiply(ids, ns)).as_py() or 0,
           sorted((t["values"], t["counts"]) for t in tags.to_pylist() if t["values"] != "no"))
    with psycopg.connect(dsn) as conn:
        want_row = conn.execute(
            f"SELECT count(*), coalesce(sum(id), 0), coalesce(sum(n), 0), coalesce(sum(id * n), 0) FROM scale_{rows}"
        ).fetchone()
        tagged = conn.execute(
            f"SELECT substr(v, 1, 2), count(*) FROM scale_{rows} WHERE v LIKE '%%-%%' GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert want_row is not None
    want = (*[int(x) for x in want_row], sorted((str(t), int(c)) for t, c in tagged))
    if got != want:
        print(f"MISMATCH in {lake.name}: PostgreSQL {want}, Delta {got}", file=sys.stderr)
    return got == want


def _session(remote: str | None) -> str:
    """The script's line that starts its session: its own, or a client of the Connect server at ``remote``."""
    return f"spark = SparkSession.builder.remote({remote!r}).getOrCreate()" if remote else "spark = SparkSession.builder.getOrCreate()"


def _client(spark_submit: str, script: Path) -> subprocess.CompletedProcess[str]:
    """``script`` as a new client process of the Connect server (the Spark venv's Python): timed by the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG", "SPARK_", "PYSPARK_"))}
    return subprocess.run([str(_python(spark_submit)), str(script)], capture_output=True, text=True, check=False, env=env)


def spark_floor(spark_submit: str, root: Path, start: SparkStart, remote: str | None = None) -> float:
    """A spark-submit of a script that starts a session and MERGEs 10 rows into a 1,000-row table
    (``remote``: the same script as a client process of that Connect server)."""
    table = root / f"floor-{'connect' if remote else start.name}"
    write_deltalake(str(table), pa.table({"id": pa.array(range(1000), pa.int64()), "v": [f"v{i}" for i in range(1000)]}))
    script = root / "floor.py"
    script.write_text(textwrap.dedent(f"""
        from pyspark.sql import SparkSession
        {_session(remote)}
        spark.range(0, 1000, 100).selectExpr("id", "'u' AS v").createOrReplaceTempView("src")
        spark.sql("MERGE INTO delta.`{table}` t USING src s ON t.id = s.id WHEN MATCHED THEN UPDATE SET *")
        spark.stop()
    """))
    t0 = time.perf_counter()
    if remote:
        done = _client(spark_submit, script)
        if done.returncode != 0:
            raise SystemExit(f"the floor through the Connect server failed: {done.stderr.strip()[-1500:]}")
    else:
        subprocess.run([spark_submit, *start.flags(), str(script)], check=True, capture_output=True, env=start.env(_python(spark_submit)))
    return time.perf_counter() - t0


def jdbc_jars(spark_submit: str, root: Path, start: SparkStart) -> tuple[str, ...]:
    """The PostgreSQL JDBC driver (and its one dependency) in the Ivy cache of ``make install-spark``,
    resolved from Maven Central by an untimed spark-submit with ``--packages`` if not there yet."""
    jars = start.cache / "ivy" / "jars"
    (root / "nothing.py").write_text("")
    subprocess.run([spark_submit, *start.flags(), "--packages", JDBC_PACKAGE, "--conf", f"spark.jars.ivy={start.cache / 'ivy'}",
                    str(root / "nothing.py")], capture_output=True, text=True, check=False, env=start.env(_python(spark_submit)))
    found = tuple(str(p) for pattern in ("org.postgresql_postgresql-*.jar", "org.checkerframework_checker-qual-*.jar")
                  for p in sorted(jars.glob(pattern))[-1:])
    if not found:
        raise RuntimeError(f"no PostgreSQL JDBC driver in {jars}")
    return found


def jdbc_overwrite(spark_submit: str, root: Path, dsn_parts: dict[str, Any], rows: int, start: SparkStart,
                   remote: str | None = None) -> float:
    """A spark-submit of a JDBC read of the table of ``rows`` (2 partitions on the key) and a Delta
    overwrite (``remote``: the same script as a client process of that Connect server, started
    with the JDBC driver)."""
    script = root / "jdbc.py"
    url = f"jdbc:postgresql://{dsn_parts['host']}:{dsn_parts['port']}/{dsn_parts['dbname']}"
    script.write_text(textwrap.dedent(f"""
        from pyspark.sql import SparkSession
        {_session(remote)}
        df = (spark.read.format("jdbc").option("url", {url!r}).option("dbtable", "scale_{rows}")
              .option("user", {dsn_parts['user']!r}).option("driver", "org.postgresql.Driver")
              .option("partitionColumn", "id").option("lowerBound", "1").option("upperBound", "{rows}")
              .option("numPartitions", "2").option("fetchsize", "10000").load())
        df.write.format("delta").mode("overwrite").save({str(root / ("jdbc-lake-connect" if remote else "jdbc-lake"))!r})
        spark.stop()
    """))
    if remote:
        t0 = time.perf_counter()
        done = _client(spark_submit, script)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-1500:])
        return time.perf_counter() - t0
    argv = [spark_submit, *start.flags(jdbc_jars(spark_submit, root, start)), str(script)]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=start.env(_python(spark_submit)))
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip()[-1500:])
    return time.perf_counter() - t0


def measure_size(runner: Runner, engines: list[str], rows: int, out: dict[str, float], largest: bool) -> bool:
    """Load, bootstrap, the recent window and the scattered one, for the table of ``rows``."""
    print(f"{rows:,} rows: loaded in {load(runner.dsn, rows):.1f} s", flush=True)
    for engine in engines:
        seconds = runner.command(engine, "bootstrap", rows)
        out[f"bootstrap_seconds_{engine}_{rows}"] = seconds
        print(f"{rows:,} rows, {engine}: bootstrap {seconds:.1f} s, {len(files(runner.lake(engine, rows), rows))} files",
              flush=True)
    for step, recent in (("r1", True), ("s1", False)):
        change(runner.dsn, rows, step, recent=recent, seed=rows + len(step))
        for engine in engines:
            lake = runner.lake(engine, rows)
            before = files(lake, rows)
            seconds = runner.command(engine, "run", rows)
            fraction = rewritten(before, files(lake, rows))
            peak = f", peak {runner.peak_mb} MB" if engine == "embedded" else ""
            print(f"{rows:,} rows, {engine}: {'recent' if recent else 'scattered'} window {seconds:.1f} s, "
                  f"rewrote {fraction:.3f} of the table's bytes ({len(before)} files before){peak}", flush=True)
            if not matches(runner.dsn, lake, rows):
                return False
            if not recent:
                out[f"run_seconds_{engine}_{rows}"] = seconds
            if largest:
                out[f"rewritten_fraction_{'recent_' if recent else ''}{engine}"] = fraction
    if largest:  # a window of 1,200 inserts alone: an append where the engine can replay one safely
        insert_only(runner.dsn, rows)
        for engine in engines:
            seconds = runner.command(engine, "run", rows)
            print(f"{rows:,} rows, {engine}: inserts-only window {seconds:.1f} s", flush=True)
            if not matches(runner.dsn, runner.lake(engine, rows), rows):
                return False
            out[f"inserts_run_seconds_{engine}_{rows}"] = seconds
    return True


def spark_extras(runner: Runner, sizes: list[int], out: dict[str, float]) -> None:
    """The floor, the idle and small runs and the JDBC overwrite: spark-submit's fast start, beside
    each the same through the Connect server (when running), then spark-submit's plain start."""
    assert runner.spark_submit is not None and runner.start is not None
    fast, plain = runner.start, SparkStart("plain", runner.start.cache)
    remote = runner.connect.remote if runner.connect is not None else None
    engines = ["spark", *(["spark_connect"] if remote else [])]
    out["spark_floor_seconds"] = spark_floor(runner.spark_submit, runner.root, fast)
    if remote:
        out["spark_connect_floor_seconds"] = spark_floor(runner.spark_submit, runner.root, fast, remote)
    small = sizes[0]
    for engine in engines:
        out[f"idle_run_seconds_{engine}"] = runner.command(engine, "run", small)
    with psycopg.connect(runner.dsn, autocommit=True) as conn:
        conn.execute(f"UPDATE scale_{small} SET n = n + 1 WHERE id <= 10")
    for engine in engines:
        out[f"small_run_seconds_{engine}"] = runner.command(engine, "run", small)
        if not matches(runner.dsn, runner.lake(engine, small), small):
            raise SystemExit(1)
    # The overwrite at 2,000,000 rows (no suffix) and at every larger size measured (suffixed).
    jdbc_sizes = [n for n in sizes if n >= 2_000_000] or sizes[-1:]
    jdbc_rows = jdbc_sizes[0]
    suffix = "" if jdbc_rows == 2_000_000 else f"_{jdbc_rows}"
    parts = conninfo_to_dict(runner.dsn)
    for rows in jdbc_sizes:
        sfx = "" if rows == 2_000_000 else f"_{rows}"
        for engine in engines:
            try:
                out[f"jdbc_overwrite_seconds_{engine}{sfx}"] = jdbc_overwrite(
                    runner.spark_submit, runner.root, parts, rows, fast, remote if engine == "spark_connect" else None)
            except (RuntimeError, subprocess.SubprocessError) as exc:
                print(f"jdbc overwrite ({engine}, {rows} rows) not measured: {exc}", file=sys.stderr)
            if f"jdbc_overwrite_seconds_{engine}{sfx}" in out and f"run_seconds_{engine}_{rows}" in out:
                out[f"run_vs_jdbc_overwrite_{engine}{sfx}"] = (
                    out[f"run_seconds_{engine}_{rows}"] / out[f"jdbc_overwrite_seconds_{engine}{sfx}"])
    # The same three as a plain spark-submit starts them, in the same run.
    largest = sizes[-1]
    change(runner.dsn, largest, "s2", recent=False, seed=largest + 3)
    out[f"run_seconds_spark_{largest}_plain"] = runner.command("spark", "run", largest, start=plain)
    if not matches(runner.dsn, runner.lake("spark", largest), largest):
        raise SystemExit(1)
    out["spark_floor_seconds_plain"] = spark_floor(runner.spark_submit, runner.root, plain)
    try:
        out[f"jdbc_overwrite_seconds_spark{suffix}_plain"] = jdbc_overwrite(runner.spark_submit, runner.root, parts, jdbc_rows, plain)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"jdbc overwrite (plain) not measured: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="embedded,spark,spark_connect",
                    help="comma-separated (default embedded,spark,spark_connect; spark_connect needs spark)")
    ap.add_argument("--spark-submit", default=str(Path(sys.executable).parent / "spark-submit"))
    ap.add_argument("--spark-cache", default=str(REPO / ".cache" / "spark35"),
                    help="make install-spark's folder of Delta's jars, settings and class-data archive")
    ap.add_argument("--pg", type=int, default=15)
    args = ap.parse_args(argv)
    # Absolute: the Connect server's set-up runs spark-submit from another folder (make passes a relative path).
    args.spark_submit = str(Path(args.spark_submit).absolute())
    top = int(os.environ.get("PG2DELTA_BENCH_SCALE_MAX_ROWS", SIZES[-1]))
    sizes = [n for n in SIZES if n <= top] or [top]
    engines = args.engines.split(",")
    if "spark_connect" in engines and "spark" not in engines:
        raise SystemExit("spark_connect is measured beside spark: --engines ...,spark,spark_connect")
    if "spark" in engines and not Path(args.spark_submit).exists():
        raise SystemExit(f"no spark-submit at {args.spark_submit} (make install-spark)")
    if "spark" in engines and not (Path(args.spark_cache) / "spark.jsa").is_file():
        raise SystemExit(f"no class-data archive in {args.spark_cache} (make install-spark)")
    # Stopped (a timeout, a kill): the server and the lakes still go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    pg = ThrowawayPostgres.start(args.pg, settings=PG_SETTINGS)
    root = Path(tempfile.mkdtemp(prefix="pg2delta-bench-scale-"))
    out = Figures()
    connect: ConnectServer | None = None
    try:
        start = SparkStart("fast", Path(args.spark_cache).resolve()) if "spark" in engines else None
        runner = Runner(pg.dsn, root, args.spark_submit if "spark" in engines else None, start)
        if "spark_connect" in engines and start is not None:
            # Started once, with the JDBC driver for its overwrite; its start is not timed.
            jars = jdbc_jars(args.spark_submit, root, start)
            connect = runner.connect = ConnectServer.start(args.spark_submit, SparkStart("plain", start.cache),
                                                           root / "connect.log", jars=jars)
        for rows in sizes:
            if not measure_size(runner, engines, rows, out, largest=rows == sizes[-1]):
                return 1
        if "spark" in engines:
            spark_extras(runner, sizes, out)
    finally:
        if connect is not None:
            connect.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)
    for engine in engines:
        out[f"scale_growth_{engine}"] = out[f"run_seconds_{engine}_{sizes[-1]}"] / out[f"run_seconds_{engine}_{sizes[0]}"]
    print(json.dumps({"sizes": sizes, "engines": engines}))
    for name, value in out.items():
        print(_figure(name, value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
