"""Apache Spark's own Spark Connect server with Delta as a driver that outlives the runs
(docs/engines/connect.md): ``pg2delta run --engine connect --remote sc://...`` in new processes.

The server is started as the docs show it (``spark-submit --class ...SparkConnectServer``, Delta's
jars and session settings, on Spark 3.5 the ``spark-connect`` jar), once; against it a first run,
a run SIGKILLed between its tables' commits and the run after it, each a process of its own. The
slot stays put after the kill, the lake equals PostgreSQL (read with delta-rs) after each run that
finished, no window is logged twice, and the commits are Apache Spark's (the tables it created have
deletion vectors, which pysail's paths never set): pg2delta told the server apart from pysail's.
Last, a run against a port nobody listens on ends with 75 at once, the slot unmoved.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import uuid
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from deltalake import DeltaTable

from engines import TEST_ENGINE, spark_properties
from lake_read import read_delta
from pg2delta.faults import FAULT_ENV
from pg2delta.lake.applied_log import LOG_TABLE
from pg2delta.lake.engine import Engine, EngineConfig, Lake
from pg2delta.lake.engine_session import apache_spark
from pg2delta.source.throwaway import _free_port
from workload import TABLES, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema, lsn_int

REPO = Path(__file__).resolve().parents[1]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"


def test_a_pysail_connect_server_gets_the_embedded_engines_statements(tmp_path: Path) -> None:
    """pysail's Spark Connect server at ``remote``: told apart from Apache Spark's, it gets the
    embedded engine's paths (no deletion vectors, one shared session), as before."""
    pysail = pytest.importorskip("pysail.spark")
    server = pysail.SparkConnectServer("127.0.0.1", 0)
    server.start(background=True)
    try:
        config = EngineConfig(kind="connect", remote=f"sc://127.0.0.1:{server.listening_address[1]}")
        engine = Engine.start(config, Lake(str(tmp_path / "lake")))
        try:
            assert not apache_spark(engine.spark)
            assert (engine.classic, engine.remote, engine.embedded, engine.deletion_vectors) == (False, False, False, False)
            assert engine.query("SELECT 1 AS one", "a query")[0][0] == 1
        finally:
            engine.stop()
    finally:
        server.stop()


def _spark_start() -> ModuleType:
    """bench/spark_start.py, where the benchmarks start the same server."""
    spec = importlib.util.spec_from_file_location("spark_start", REPO / "bench" / "spark_start.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.e2e
@pytest.mark.classic
@pytest.mark.deploy  # how users run it: CI's second half
@pytest.mark.skipif(
    TEST_ENGINE != "spark" or not SPARK_SUBMIT.exists() or spark_properties() is None,
    reason="Apache Spark's Connect server comes with the full pyspark and make install-spark's jars (make test-spark)",
)
def test_runs_against_apache_spark_connect_server(pgdb: str, tmp_path: Path) -> None:
    found = spark_properties()
    assert found is not None
    spark_start = _spark_start()
    # Plain: Spark's settings from the cache's spark-defaults.conf, the full compiler for a JVM that lives long.
    server = spark_start.ConnectServer.start(SPARK_SUBMIT, spark_start.SparkStart("plain", found.parent.parent),
                                             tmp_path / "connect.log")
    try:
        tag = uuid.uuid4().hex[:8]
        slot, pub, lake = f"slot_{tag}", f"pub_{tag}", tmp_path / "lake"
        create_schema(pgdb, pub)
        with psycopg.connect(pgdb, autocommit=True) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), "--json"]
        env = {"PG2DELTA_ENGINE": "connect", "PG2DELTA_REMOTE": server.remote}
        with Workload(pgdb, 3707) as wl:
            wl.phase(40)
            first = cli(*common, env=env, child=True)
            assert first.returncode == 0, first.stderr[-3000:]
            assert json.loads(first.stdout)["changes"] > 0
            assert_lake_matches(pgdb, lake, context="first run through the Connect server")
            wl.phase(50)

            before = confirmed_lsn(pgdb, slot)
            crashed = cli(*common, env={**env, FAULT_ENV: "between_tables"}, child=True)
            assert crashed.returncode == -signal.SIGKILL, (crashed.returncode, crashed.stderr[-3000:])
            assert confirmed_lsn(pgdb, slot) == before, "the slot moved although the run died between its tables"
            again = cli(*common, env=env, child=True)
            assert again.returncode == 0, again.stderr[-3000:]
            assert json.loads(again.stdout)["from_lsn"] == before
            assert lsn_int(confirmed_lsn(pgdb, slot) or "0/0") > lsn_int(before or "0/0")
            assert_lake_matches(pgdb, lake, context="the run after one SIGKILLed between its tables")
            logged = [(r["relation_oid"], r["window_end"]) for r in read_delta(str(lake / LOG_TABLE)).to_pylist()
                      if r["slot"] == slot and r["kind"] == "window"]
            assert len(logged) == len(set(logged)), "a table logged twice at a window's end after the kill"

            for spec in TABLES:  # Apache Spark's paths: the server's Delta wrote them, with deletion vectors
                table = DeltaTable(str(lake / spec.schema / spec.name))
                assert table.metadata().configuration.get("delta.enableDeletionVectors") == "true", spec.qualified
                engines = {str(c.get("engineInfo", "")) for c in table.history()}
                assert any(e.startswith("Apache-Spark/") for e in engines), (spec.qualified, engines)

            # A server that does not answer: retryable at once (pyspark's client alone retries for
            # about ten minutes), the slot where it was.
            wl.phase(5)
            at = confirmed_lsn(pgdb, slot)
            down = cli(*common, env={**env, "PG2DELTA_REMOTE": f"sc://127.0.0.1:{_free_port()}"}, child=True, timeout=120)
            assert down.returncode == 75 and "cannot reach the Spark Connect server" in down.stderr, (
                down.returncode, down.stderr[-3000:])
            assert confirmed_lsn(pgdb, slot) == at
    finally:
        server.stop()
