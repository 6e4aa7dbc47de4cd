"""Apache Spark on a standalone cluster: ``spark-submit --master spark://127.0.0.1:<port> --deploy-mode
client`` of the jobs, with the lake at ``s3a://`` on the S3-compatible server.

One master and one worker from this venv's pyspark install (tests/spark_cluster.py), the worker in
a folder of its own with the store's credentials (a node's role) and nothing of the driver's
settings. The driver submits as a user would: Delta's and hadoop-aws's jars named by
``spark.jars`` (``spark-s3a.conf`` of ``make install-spark``), which the executors fetch from
the driver; the lake root only ``s3a://``; ``PYSPARK_PYTHON`` names no Python at all (pg2delta runs
no Python on the executors). Where the test may create a mount namespace (root), the worker and its
executors run with the driver's folders (its config, working and temporary directories) covered by
empty ones, so nothing they read can come from the driver's disk.

A bootstrap, a run SIGKILLed between its tables' commits (the slot unmoved), a run against a store
that answers every write of s3a's ``500`` (exit 75 within pg2delta's bounded s3a retries,
pg2delta.lake.engine_session.S3A_RETRIES, one line, the slot unmoved), the run again through a store
that throttles (``503 SlowDown``) and cuts connections now and then (0), and ``verify``; the store
behind tests/s3fault.py's proxy, whose faults hit only s3a's requests (the driver's and the
executor's JVMs; the driver's pyarrow and delta-rs are tests/test_object_store_faults.py's). The
lake read back by delta-rs with the store's options equals PostgreSQL, and every application ran
its tasks on the worker's executor with the jars it fetched from the driver. This
is also the Apache Spark tier's ``s3a://`` test: the driver commits the Delta logs there and the
executor writes and reads the data files, with the store's settings pg2delta gives s3a
(pg2delta.config.s3a_settings) and the credentials only from the environment (the same commands once more
through ``spark-submit`` in ``local[2]`` cost 88 s of a quiet CI run and proved no more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engines import TEST_ENGINE, spark_properties, spark_submit_flags
from pg2delta.faults import FAULT_ENV
from s3fault import FaultProxy
from s3server import S3Server
from spark_cluster import SparkCluster, spark_home
from test_object_store import assert_s3_lake_matches
from workload import TABLES, Workload, confirmed_lsn, create_schema

REPO = Path(__file__).resolve().parents[1]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.classic,  # the Spark 3.5 tier's settings (PG2DELTA_TEST_ENGINE=spark, its properties file)
    pytest.mark.deploy,  # make test TIER=deploy
    pytest.mark.cluster,
    pytest.mark.skipif(
        TEST_ENGINE != "spark" or spark_home() is None or spark_properties(s3a=True) is None,
        reason="a standalone cluster from the pyspark install, with hadoop-aws: make install-spark (PG2DELTA_TEST_ENGINE=spark)",
    ),
]


@pytest.fixture
def driver_dir(tmp_path: Path) -> Path:
    """The driver's working folder (its config, its temporary files, Spark's local dir)."""
    (tmp_path / "driver" / "tmp").mkdir(parents=True)
    return tmp_path / "driver"


@pytest.fixture
def cluster(s3_server: S3Server, driver_dir: Path) -> Iterator[SparkCluster]:
    node_env = {
        "PATH": os.environ["PATH"],
        "JAVA_HOME": os.environ.get("JAVA_HOME") or subprocess.run(
            [str(REPO / "tools" / "java_home.sh")], capture_output=True, text=True, check=True).stdout.strip(),
        # the node's credentials for the store; its endpoint comes with the application's settings
        "AWS_ACCESS_KEY_ID": s3_server.env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": s3_server.env["AWS_SECRET_ACCESS_KEY"],
    }
    started = SparkCluster.start(node_env, hidden=[driver_dir])
    try:
        yield started
    finally:
        started.stop()


def _submit(cluster: SparkCluster, cwd: Path, job: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``spark-submit --master spark://... --deploy-mode client jobs/<job> ...`` from ``cwd``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    full.update({
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYSPARK_PYTHON": "/nonexistent/python",  # an executor that started Python would fail
        "TMPDIR": str(cwd / "tmp"),
        **(env or {}),
    })
    argv = [str(SPARK_SUBMIT), *spark_submit_flags(s3a=True), *cluster.submit_args(**{"spark.local.dir": str(cwd / "tmp")})]
    return subprocess.run([*argv, str(REPO / "jobs" / job), *args], capture_output=True, text=True, env=full, cwd=cwd, timeout=600)


def _ok(done: subprocess.CompletedProcess[str], what: str) -> None:
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _store_fails_then_throttles(
    cluster: SparkCluster, driver_dir: Path, config: Path, proxy: FaultProxy, through: dict[str, str], slot_unmoved: Callable[[], bool]
) -> None:
    """A run against a store refusing every write of s3a's: 75 within bounded retries, one line, the
    slot unmoved; then the run again through a store throttling and cutting s3a's requests: 0."""
    proxy.policy = lambda method, path, n: 500 if method in ("PUT", "POST", "DELETE") else None
    started = time.monotonic()
    failed = _submit(cluster, driver_dir, "pg2delta_run.py", "--config", str(config), env=through)
    took = time.monotonic() - started
    output = failed.stdout + failed.stderr
    lines = [line for line in output.splitlines() if line.startswith("pg2delta:")]
    assert failed.returncode == 75 and len(lines) == 1 and "object store" in lines[0], (failed.returncode, took, output[-3000:])
    assert took < 300, f"a failing store held the run {took:.0f} s: s3a's retries are not bounded"
    assert slot_unmoved(), "the slot moved past a window the store refused"
    # one s3a request in 6 throttled, one in 7 of the others' connections cut
    proxy.policy = lambda method, path, n: 503 if n % 6 == 0 else 0 if n % 7 == 0 else None
    faults = proxy.faults
    _ok(_submit(cluster, driver_dir, "pg2delta_run.py", "--config", str(config), env=through), "the run again, the store throttling")
    assert proxy.faults > faults, "s3a never met a throttled or cut request: the test proved nothing"
    proxy.policy = lambda method, path, n: None


def test_bootstrap_killed_run_and_rerun_on_a_standalone_cluster(
    pgdb: str, s3_server: S3Server, s3_lake: str, cluster: SparkCluster, driver_dir: Path
) -> None:
    root = "s3a://" + s3_lake.removeprefix("s3://")
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(pgdb, pub)
    config = driver_dir / "spark.toml"
    config.write_text(
        f'[source]\ndsn = "{pgdb}"\nslot = "{slot}"\npublication = "{pub}"\n'
        f'[lake]\nroot = "{root}"\n[engine]\nkind = "spark"\n'
    )
    proxy = FaultProxy(s3_server, agent="aws-sdk-java").start()
    through = {"AWS_ENDPOINT_URL": proxy.endpoint}
    try:
        with Workload(pgdb, 91) as wl:
            wl.phase(40, truncate=False)
            _ok(_submit(cluster, driver_dir, "pg2delta_bootstrap.py", "--config", str(config), env=through), "bootstrap on the cluster")
            wl.phase(40)
            before = confirmed_lsn(pgdb, slot)
            killed = _submit(cluster, driver_dir, "pg2delta_run.py", "--config", str(config), env={FAULT_ENV: "between_tables", **through})
            assert killed.returncode != 0 and "fault injection: killing the process at between_tables" in killed.stdout + killed.stderr, (
                killed.stdout[-2000:] + killed.stderr[-2000:])
            assert confirmed_lsn(pgdb, slot) == before, "the slot moved past a killed run"
            _store_fails_then_throttles(cluster, driver_dir, config, proxy, through, lambda: confirmed_lsn(pgdb, slot) == before)
    finally:
        proxy.stop()
    verified = _submit(cluster, driver_dir, "pg2delta_verify.py", "--config", str(config), "--json")
    _ok(verified, "verify on the cluster")
    # Spark's Python runner merges the driver's log into stdout (docs/engines/spark-submit.md): the report is the JSON object in it
    text = verified.stdout
    report, _ = json.JSONDecoder().raw_decode(text[text.index("\n{") + 1 :] if not text.startswith("{") else text)
    # the tables of the lake (one the workload never touched has none); all of them equal
    assert report["equal"] is True and report["tables"] and set(report["tables"]) <= {t.qualified for t in TABLES}, report
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "standalone cluster: bootstrap, a run killed, the run again")

    # every application (bootstrap, killed run, failed run, run, verify) ran tasks on the worker's executor,
    # with Delta's and hadoop-aws's jars fetched from the driver (spark.jars), not from a shared disk
    executors = cluster.executor_logs()
    apps = {name.split("/")[0] for name in executors}
    assert len(apps) == 5, sorted(executors)
    for app in apps:
        text = "".join(log for name, log in executors.items() if name.startswith(app + "/"))
        assert "Running task" in text, f"{app}: no task ran on the executor\n{text[-2000:]}"
        fetched = [line for line in text.splitlines() if "Fetching spark://127.0.0.1:" in line]
        for jar in ("delta-spark_", "hadoop-aws-", "aws-java-sdk-bundle-"):
            assert any(jar in line for line in fetched), f"{app}: {jar} not fetched from the driver: {fetched}"

