"""Apache Spark's own Spark Connect server with Delta as a driver that outlives the runs
(docs/engines/connect.md): ``pg2delta run --engine connect --remote sc://...`` in new processes.

The server is started as the docs show it (``spark-submit --class ...SparkConnectServer``, Delta's
jars and session settings, on Spark 3.5 the ``spark-connect`` jar); against it a first run, a run
SIGKILLed between its tables' commits, then a run during which the server is SIGKILLed (the run
stopped between its tables' commits meanwhile): 75 and one line within the client's bounded
retries. The slot stays put after each kill; on the server restarted at the same address the next
run applies the window once: the lake equals PostgreSQL (read with delta-rs), no window is logged
twice, and the commits are Apache Spark's (the tables it created have deletion vectors, which
pysail's paths never set): pg2delta told the server apart from pysail's. Last, a run against a port nobody listens on ends with 75 at once. Each run is a
process of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from deltalake import DeltaTable

from engines import TEST_ENGINE, child_env, spark_properties
from lake_read import read_delta
from pg2delta.errors import EngineUnavailable
from pg2delta.faults import FAULT_ENV, STOP_ENV
from pg2delta.lake.applied_log import LOG_TABLE
from pg2delta.lake.engine import Engine, EngineConfig, Lake
from pg2delta.lake.engine_session import apache_spark
from pg2delta.source.throwaway import _free_port
from workload import TABLES, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema, lsn_int

REPO = Path(__file__).resolve().parents[1]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"


def test_a_pysail_connect_server_gets_the_embedded_engines_statements(tmp_path: Path) -> None:
    """pysail's Spark Connect server at ``remote``: told apart from Apache Spark's, it gets the
    embedded engine's paths (one shared session; deletion vectors, as the embedded engine)."""
    pysail = pytest.importorskip("pysail.spark")
    server = pysail.SparkConnectServer("127.0.0.1", 0)
    server.start(background=True)
    try:
        config = EngineConfig(kind="connect", remote=f"sc://127.0.0.1:{server.listening_address[1]}")
        engine = Engine.start(config, Lake(str(tmp_path / "lake")))
        try:
            assert not apache_spark(engine.spark)
            assert (engine.classic, engine.remote, engine.embedded, engine.deletion_vectors) == (False, False, False, True)
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


def _stopped(proc: subprocess.Popen[str], timeout: float = 300) -> None:
    """Wait until ``proc`` stopped itself (SIGSTOP at a fault point: state T)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert proc.poll() is None and time.monotonic() < deadline, ("never stopped", proc.returncode)
        time.sleep(0.2)


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

            # The next run stops between its tables' commits, the server is SIGKILLed, the run goes
            # on: 75 and one line within the client's retries (5 s of them here), the slot unmoved.
            proc = subprocess.Popen([sys.executable, "-m", "pg2delta.cli", *common], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**{k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))},
                                         **child_env(), **env, "PG2DELTA_CONNECT_RETRY_SECONDS": "5",
                                         STOP_ENV: "between_tables"})
            _stopped(proc)
            held = Engine.start(EngineConfig(kind="connect", remote=server.remote, connect_retry_seconds=60), Lake(str(lake)))
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
            lost_at = time.monotonic()
            proc.send_signal(signal.SIGCONT)
            _, err = proc.communicate(timeout=300)
            lost = time.monotonic() - lost_at
            print(f"server SIGKILLed mid-run: exit {proc.returncode} {lost:.1f} s after the run went on")
            said = [line for line in err.splitlines() if line.startswith("pg2delta:")]
            assert proc.returncode == 75 and len(said) == 1 and "lost the Spark Connect server" in said[0], (
                proc.returncode, err[-3000:])
            assert lost < 60, lost
            assert confirmed_lsn(pgdb, slot) == before, "the slot moved although the server died mid-run"

            # The server restarted at the same address (the tests' fast start): the next run applies
            # the window of both failed runs again, once.
            server = spark_start.ConnectServer.start(SPARK_SUBMIT, spark_start.SparkStart("fast", found.parent.parent),
                                                     tmp_path / "connect-2.log", port=server.port)
            again = cli(*common, env=env, child=True)
            assert again.returncode == 0, again.stderr[-3000:]
            assert json.loads(again.stdout)["from_lsn"] == before
            assert lsn_int(confirmed_lsn(pgdb, slot) or "0/0") > lsn_int(before or "0/0")
            assert_lake_matches(pgdb, lake, context="the runs after a client and then the server were killed mid-run")
            logged = [(r["relation_oid"], r["window_end"]) for r in read_delta(str(lake / LOG_TABLE)).to_pylist()
                      if r["slot"] == slot and r["kind"] == "window"]
            assert len(logged) == len(set(logged)), "a table logged twice at a window's end after the kills"
            # A session opened before the restart: the server now serves it empty (Spark 3.5 says
            # nothing), and pg2delta sends nothing more on it.
            with pytest.raises(EngineUnavailable, match="restarted during the run and lost its session"):
                held.query("SELECT 1", "a query on a server restarted since")
            held.stop()

            for spec in TABLES:  # Apache Spark's paths: the server's Delta wrote them, with deletion vectors
                table = DeltaTable(str(lake / spec.schema / spec.name))
                assert table.metadata().configuration.get("delta.enableDeletionVectors") == "true", spec.qualified
                engines = {str(c.get("engineInfo", "")) for c in table.history()}
                assert any(e.startswith("Apache-Spark/") for e in engines), (spec.qualified, engines)

            # A server that does not answer: retryable at once, not after the client's retries, the
            # slot where it was.
            wl.phase(5)
            at = confirmed_lsn(pgdb, slot)
            down = cli(*common, env={**env, "PG2DELTA_REMOTE": f"sc://127.0.0.1:{_free_port()}"}, child=True, timeout=120)
            assert down.returncode == 75 and "cannot reach the Spark Connect server" in down.stderr, (
                down.returncode, down.stderr[-3000:])
            assert confirmed_lsn(pgdb, slot) == at
    finally:
        server.stop()
