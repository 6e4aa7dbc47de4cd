"""The user's own command line: ``spark-submit jobs/pg2delta_*.py`` exactly as docs/engines/spark-submit.md shows it.

Local master, client mode, Delta from ``--packages`` with the two Delta session configs, nothing
else: no ``SPARK_CONF_DIR`` of ours (only the Ivy cache is pointed into the checkout, so the jars
are not fetched again). The config sizes Spark's SQL for small windows in ``[engine.spark_conf]``
(:data:`SMALL_WINDOWS`), as a user's would. Exit codes 0, 3 (idle with --idle-exit-code 3), 75 and 78 as documented, and the lake equal to
PostgreSQL (read with delta-rs) after run, bootstrap and backfill.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psycopg
import pytest

from changelog_support import write_config
from conftest import PG_VERSIONS
from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import TABLES, Workload, assert_lake_matches, confirmed_lsn, create_schema

REPO = Path(__file__).resolve().parents[1]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.classic,
    pytest.mark.deploy,  # how users run it: CI's second half
    pytest.mark.skipif(
        TEST_ENGINE != "spark" or not SPARK_SUBMIT.exists(),
        reason="spark-submit comes with the full pyspark (make test-spark)",
    ),
]


# Two shuffle partitions and Delta's log read in two, not Spark's 200 and Delta's 50 (each a task
# in the window's JVM). Measured side by side at load 13: this test 114 s of CPU against 192 s,
# test_catalog's (which takes them too) 112 s against 182 s.
SMALL_WINDOWS = (
    '[engine]\nkind = "spark"\n[engine.spark_conf]\n'
    '"spark.sql.shuffle.partitions" = "2"\n"spark.databricks.delta.snapshotPartitions" = "2"\n'
)


def _delta_package() -> str:
    try:
        scala = "2.13" if int(version("pyspark").split(".")[0]) >= 4 else "2.12"
        return f"io.delta:delta-spark_{scala}:{version('delta-spark')}"
    except PackageNotFoundError:
        pytest.skip("delta-spark is not installed")


def spark_submit(job: str, *args: str, conf: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The documented command line, run the way a scheduler runs it (``conf``: more ``--conf`` settings;
    ``job``: a script of jobs/, or a path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG", "SPARK_CONF_DIR"))}
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if conf_dir and Path(conf_dir).is_dir() and not any(Path(conf_dir).iterdir()):
        # no settings, as a user without any; and the JVM may use make install-spark's class-data archive
        env["SPARK_CONF_DIR"] = conf_dir
    env["PYSPARK_PYTHON"] = sys.executable  # the Python pg2delta is installed in (docs/engines/spark-submit.md)
    flags = [
        "--master", "local[2]",
        "--packages", _delta_package(),
        "--conf", "spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension",
        "--conf", "spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog",
    ]
    for key, value in (conf or {}).items():
        flags += ["--conf", f"{key}={value}"]
    if os.environ.get("SPARK_CONF_DIR"):  # the jars make install-spark fetched: no download again
        flags += ["--conf", f"spark.jars.ivy={Path(os.environ['SPARK_CONF_DIR']).parent / 'ivy'}"]
    return subprocess.run(
        [str(SPARK_SUBMIT), *flags, str(REPO / "jobs" / job), *args],
        capture_output=True, text=True, env=env, timeout=600,
    )


@pytest.fixture
def quiet_pgdb() -> Iterator[str]:
    """A server of this test's own (the newest PostgreSQL, no autovacuum): nothing but this test
    writes to it while its spark-submits, of a minute each on a loaded machine, run."""
    pg = ThrowawayPostgres.start(PG_VERSIONS[-1], settings={"autovacuum": "off"})
    try:
        yield pg.dsn
    finally:
        pg.stop()


def test_run_bootstrap_backfill_through_spark_submit(quiet_pgdb: str, tmp_path: Path) -> None:
    pgdb = quiet_pgdb
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    wl = Workload(pgdb, 4242)
    with wl:
        wl.phase(20)  # rows before the slot: bootstrap copies them
    config = write_config(tmp_path / "spark.toml", pgdb, slot, pub, lake)
    config.write_text(config.read_text() + SMALL_WINDOWS)

    boot = spark_submit("pg2delta_bootstrap.py", "--config", str(config))
    assert boot.returncode == 0, boot.stderr[-3000:]
    assert_lake_matches(pgdb, lake, TABLES, context="spark-submit bootstrap")
    start = confirmed_lsn(pgdb, slot)
    assert start is not None

    with wl:
        wl.phase(30)
    first = spark_submit("pg2delta_run.py", "--config", str(config), "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    assert '"changes"' in first.stdout
    assert_lake_matches(pgdb, lake, TABLES, context="spark-submit run")

    # A run with nothing to do exits 0, or 3 when --idle-exit-code 3 asks for it. Bounded at the
    # slot's own position: without a bound a run goes up to the server's WAL of now, and the server
    # logs records of its own (a running-transactions snapshot every 15 s after any WAL) that such a
    # run passes over, applying nothing and exiting 0 (seen: three spark-submits in a row at load 12).
    idle = spark_submit("pg2delta_run.py", "--config", str(config), "--json", "--idle-exit-code", "3",
                        "--until-lsn", str(confirmed_lsn(pgdb, slot)))
    assert idle.returncode == 3, (idle.returncode, idle.stderr[-3000:])
    # (Without the flag an idle run exits 0 and says so: tests/test_job_e2e.py, on both engines.)

    # The changelog (on for every table in this config) replayed into a copy, up to the last
    # window the lake recorded, equals the tables.
    end = max(r["window_end"] for r in read_delta(str(lake / "_pg2delta" / "applied_log")).to_pylist())
    row = (f"{end >> 32:X}/{end & 0xFFFFFFFF:X}",)
    copy = tmp_path / "copy"
    back = spark_submit("pg2delta_backfill.py", "--config", str(config), "--from-lsn", start, "--to-lsn", row[0], "--into", str(copy))
    assert back.returncode == 0, [line for line in back.stderr.splitlines() if line.startswith("pg2delta")]
    assert_lake_matches(pgdb, copy, TABLES, context="spark-submit backfill --into a copy")

    missing = write_config(tmp_path / "missing.toml", pgdb, slot, f"no_such_{tag}", lake)
    refused = spark_submit("pg2delta_run.py", "--config", str(missing))
    assert refused.returncode == 78, (refused.returncode, refused.stderr[-3000:])
    # spark-submit's PythonRunner merges the driver's stderr into its stdout: the one-line error is there.
    assert "publication" in refused.stdout + refused.stderr

    with psycopg.connect(pgdb) as conn:
        port = conn.info.port
    unreachable = write_config(tmp_path / "down.toml", pgdb.replace(f"port={port}", "port=1"), slot, pub, lake)
    retry = spark_submit("pg2delta_run.py", "--config", str(unreachable))
    assert retry.returncode == 75, (retry.returncode, retry.stderr[-3000:])
