"""`make bench-spark`'s cluster part: a small scheduled run with the lake on the object store, on a
standalone Spark cluster and in ``local[2]``, each a new ``spark-submit`` process.

On a throwaway PostgreSQL, one table of 10,000 rows and a slot per setting; the S3-compatible server
of the tests (S3Proxy, ``make s3proxy``) holds both lakes (``s3a://``); a standalone master and one
worker from the pyspark install (tests/spark_cluster.py: 2 cores, an executor of 768 MiB, on this
machine). The first run of each setting creates its Delta table (printed, not counted). Then, per
round, 10 updates in one transaction and ``spark-submit jobs/pg2delta_run.py`` once in ``local[2]``
and once with ``--master spark://...`` (``--deploy-mode client``), alternating which goes first;
the medians count. Both lakes are read back with delta-rs with the store's options and compared
with PostgreSQL (rows and ``sum(qty)``), else SystemExit.

What the cluster adds to a run is its application's start: the master grants an executor, the
worker starts its JVM, the executor fetches the application's jars from the driver (Delta,
hadoop-aws and the 280 MB AWS SDK bundle) and runs the stages local[2] runs in the driver.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa

from pg2delta.source.throwaway import ThrowawayPostgres

REPO = Path(__file__).resolve().parents[1]
ROWS = 10_000
SETTINGS = ("local", "cluster")


def small_runs(pg_version: int, rounds: int, submit: Callable[..., float], start: Any) -> tuple[float, float] | None:
    """(local[2], cluster) medians of ``rounds`` runs of 10 updates; None without S3Proxy's jar.
    ``submit`` is bench_spark's ``_submit`` (start, script, *args, spark_args=, env=, s3a=) -> seconds;
    ``start`` (a spark_start.SparkStart) is how the drivers start."""
    sys.path.insert(0, str(REPO / "tests"))
    from s3server import S3Server, s3proxy_jar
    from spark_cluster import SparkCluster

    jar = s3proxy_jar()
    if jar is None or not jar.exists():
        print("cluster small run not measured: no S3Proxy jar (make s3proxy)", file=sys.stderr)
        return None
    root = Path(tempfile.mkdtemp(prefix="pg2delta-bench-cluster-"))
    pg = ThrowawayPostgres.start(pg_version)
    store = S3Server.start(jar)
    cluster = None
    try:
        node = {"PATH": os.environ["PATH"], "JAVA_HOME": os.environ.get("JAVA_HOME", ""),
                **{k: store.env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}
        cluster = SparkCluster.start(node)
        print(f"standalone cluster (one master, one worker) up in {cluster.started_in:.1f} s", flush=True)
        configs = _source(pg.dsn, root)
        # hadoop-aws and the AWS SDK: make install-spark's spark-s3a.conf beside spark-defaults.conf (s3a=True)
        spark_args: dict[str, tuple[str, ...]] = {"local": (), "cluster": tuple(cluster.submit_args())}
        job = REPO / "jobs" / "pg2delta_run.py"

        def run(where: str) -> float:
            return submit(start, job, "--config", str(configs[where]), spark_args=spark_args[where], env=store.env, s3a=True)

        for where in SETTINGS:
            first = run(where)
            print(f"{where}: first run (creates the table, {ROWS:,} rows): {first:.1f} s", flush=True)
        times: dict[str, list[float]] = {where: [] for where in SETTINGS}
        for i in range(rounds):
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                conn.execute("UPDATE items SET qty = qty + 1 WHERE id <= 10")
            for where in SETTINGS if i % 2 == 0 else tuple(reversed(SETTINGS)):
                times[where].append(run(where))
        for where in SETTINGS:
            print(f"{where}: small runs " + ", ".join(f"{x:.1f}" for x in times[where]) + " s", flush=True)
        _check(pg.dsn, store)
        return statistics.median(times["local"]), statistics.median(times["cluster"])
    finally:
        if cluster is not None:
            cluster.stop()
        store.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


def _source(dsn: str, root: Path) -> dict[str, Path]:
    """The table, its publication, a slot and a config per setting (lake ``s3a://lake/<setting>``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int)")
        conn.execute("CREATE PUBLICATION bench_small FOR TABLE items")
        for where in SETTINGS:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"bench_{where}",))
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, %s) g", (ROWS,))
    configs = {}
    for where in SETTINGS:
        configs[where] = root / f"{where}.toml"
        configs[where].write_text(
            f"[source]\ndsn = {json.dumps(dsn)}\nslot = \"bench_{where}\"\npublication = \"bench_small\"\n"
            f"[lake]\nroot = \"s3a://lake/{where}\"\n[engine]\nkind = \"spark\"\n"
        )
    return configs


def _check(dsn: str, store: Any) -> None:
    from deltalake import DeltaTable

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*), sum(qty) FROM items").fetchone()
    assert row is not None
    for where in SETTINGS:
        # delta-rs's scan reads deletion vectors, which the tables Apache Spark creates have
        table = DeltaTable(f"s3://lake/{where}/public/items", storage_options=store.storage_options)
        data = pa.table(table.scan(columns=["qty"]).read_all())
        got = (data.num_rows, sum(data.column("qty").to_pylist()))
        if got != (int(row[0]), int(row[1])):
            raise SystemExit(f"MISMATCH in {where}'s lake: PostgreSQL {tuple(row)}, Delta {got}")

