"""The example DAGs (examples/airflow/) in a real Airflow: ``airflow dags test`` of the embedded
engine's DAGs against a throwaway PostgreSQL, with Airflow in a virtual environment of its own
(``make install-airflow`` builds ``.venv-airflow``; its metadata database is SQLite in a temporary
AIRFLOW_HOME). The tasks run the ``pg2delta`` command of the environment running this test.

Checked: bootstrap and run leave the lake (read with delta-rs) equal to PostgreSQL; a run with
nothing to do succeeds; a run while another holds the slot's advisory lock (exit 73) is skipped; an
unreachable server (exit 75) is retried; a missing publication (exit 78) fails without retries.
The SparkSubmitOperator DAGs are parsed (spark-submit itself is tested in test_spark_submit.py).

Each ``airflow dags test`` is Airflow's own command line (``airflow.__main__.main`` with that argv)
in one long-lived Python of the Airflow venv (:data:`DRIVER`), its output (the task logs) captured
per command: Airflow's start-up (seconds of imports) once for the module, not once a command.
"""

from __future__ import annotations

import json
import os
import select
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from changelog_support import write_config
from conftest import PG_VERSIONS
from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import ACCT, TABLES, Workload, assert_lake_matches, confirmed_lsn, create_schema, lake_files

REPO = Path(__file__).resolve().parents[1]
AIRFLOW_VENV = Path(os.environ.get("PG2DELTA_AIRFLOW_VENV", REPO / ".venv-airflow"))
AIRFLOW = AIRFLOW_VENV / "bin" / "airflow"
DAGS = REPO / "examples" / "airflow"
EMBEDDED_DAGS = DAGS / "pg2delta_embedded.py"
PG2DELTA = Path(sys.executable).parent / "pg2delta"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.deploy,
    pytest.mark.skipif(not AIRFLOW.exists(), reason=f"no Airflow venv at {AIRFLOW_VENV}: run make install-airflow"),
    pytest.mark.skipif(TEST_ENGINE != "embedded", reason="the DAGs under test run the embedded engine"),
    pytest.mark.skipif(not PG2DELTA.exists(), reason="the pg2delta command is not installed next to this Python"),
]


# Runs `airflow <args>` for each JSON request on stdin ({"args": [...], "env": {...}, "log": path}):
# Airflow's own main() with that argv and those environment entries, stdout and stderr (file
# descriptors 1 and 2, so the tasks' subprocesses and Airflow's log handlers too) into the log
# file; answers {"code": exit code} on the first stdout it had.
DRIVER = """
import json, os, sys, traceback
from airflow.__main__ import main
answer = os.fdopen(os.dup(1), "w")
saved = os.dup(1), os.dup(2)
for line in sys.stdin:
    request = json.loads(line)
    os.environ.update(request["env"])
    code = 0
    with open(request["log"], "w") as log:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(log.fileno(), 1); os.dup2(log.fileno(), 2)
        sys.argv = ["airflow", *request["args"]]
        try:
            main()
        except SystemExit as exc:
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
    answer.write(json.dumps({"code": code}) + "\\n")
    answer.flush()
os._exit(0)  # the commands are done: no wait for Airflow's threads and exit handlers
"""


@dataclass
class Airflow:
    home: Path
    _driver: subprocess.Popen[str] | None = None
    _calls: int = 0

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG", "AIRFLOW", "VIRTUAL_ENV"))}
        env.update(
            AIRFLOW_HOME=str(self.home),
            AIRFLOW__CORE__LOAD_EXAMPLES="False",
            AIRFLOW__CORE__DAGS_FOLDER=str(DAGS),
            AIRFLOW__CORE__UNIT_TEST_MODE="False",
            PG2DELTA_BIN=str(PG2DELTA),
            PG2DELTA_RETRY_DELAY_SECONDS="1",
        )
        env.update(extra)
        return env

    def __call__(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(AIRFLOW), *args], capture_output=True, text=True, env=self.env(**extra), cwd=self.home, timeout=600
        )

    def dags_test(self, dag_id: str, config: Path, conf: dict[str, object] | None = None) -> subprocess.CompletedProcess[str]:
        """``airflow dags test`` through :data:`DRIVER`, with ``PG2DELTA_CONFIG`` set to ``config``."""
        args = ["dags", "test", dag_id, "-f", str(EMBEDDED_DAGS)]
        if conf:
            args += ["-c", json.dumps(conf)]
        if self._driver is None:
            self._driver = subprocess.Popen(
                [str(AIRFLOW_VENV / "bin" / "python"), "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, env=self.env(), cwd=self.home,
            )
        assert self._driver.stdin is not None and self._driver.stdout is not None
        self._calls += 1
        log = self.home / f"dags-test-{self._calls}.log"
        request = {"args": args, "env": {"PG2DELTA_CONFIG": str(config)}, "log": str(log)}
        self._driver.stdin.write(json.dumps(request) + "\n")
        self._driver.stdin.flush()
        if not select.select([self._driver.stdout], [], [], 600)[0]:
            self._driver.kill()
            pytest.fail(f"airflow {' '.join(args)}: no answer in 600 s\n{log.read_text(errors='replace')[-4000:]}")
        answer = self._driver.stdout.readline()
        assert answer, f"the Airflow driver ended (exit {self._driver.poll()})"
        return subprocess.CompletedProcess(["airflow", *args], json.loads(answer)["code"], log.read_text(errors="replace"), "")

    def close(self) -> None:
        if self._driver is not None:
            assert self._driver.stdin is not None
            self._driver.stdin.close()
            try:
                self._driver.wait(60)
            except subprocess.TimeoutExpired:
                self._driver.kill()
                self._driver.wait()
            self._driver = None

    def states(self, dag_id: str) -> dict[str, str]:
        return {task: state for task, (state, _) in self.tasks(dag_id).items()}

    def tasks(self, dag_id: str) -> dict[str, tuple[str, int]]:
        """State and try number of every task of the DAG's latest run, from the metadata database."""
        with sqlite3.connect(self.home / "airflow.db") as db:
            (run_id,) = db.execute(
                "SELECT run_id FROM dag_run WHERE dag_id = ? ORDER BY id DESC LIMIT 1", (dag_id,)
            ).fetchone()
            rows = db.execute(
                "SELECT task_id, state, try_number FROM task_instance WHERE dag_id = ? AND run_id = ?", (dag_id, run_id)
            ).fetchall()
        return {task: (state, tries) for task, state, tries in rows}


def _tail(proc: subprocess.CompletedProcess[str]) -> str:
    return (proc.stdout + proc.stderr)[-4000:]


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Airflow]:
    af = Airflow(tmp_path_factory.mktemp("airflow-home"))
    migrated = af("db", "migrate")
    assert migrated.returncode == 0, _tail(migrated)
    try:
        yield af
    finally:
        af.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ThrowawayPostgres]:
    pg = ThrowawayPostgres.start(PG_VERSIONS[-1])
    try:
        yield pg
    finally:
        pg.stop()


def test_example_dags_parse(airflow: Airflow) -> None:
    script = (
        "import json, sys\n"
        "try:\n    from airflow.dag_processing.dagbag import DagBag\n"
        "except ImportError:\n    from airflow.models.dagbag import DagBag\n"
        "bag = DagBag(sys.argv[1])\n"
        "apps = {d: [getattr(t, 'application', None) for t in bag.get_dag(d).tasks] for d in bag.dag_ids}\n"
        "print(json.dumps({'errors': {k: str(v) for k, v in bag.import_errors.items()}, 'apps': apps}))\n"
    )
    proc = subprocess.run(
        [str(AIRFLOW_VENV / "bin" / "python"), "-W", "ignore", "-c", script, str(DAGS)],
        capture_output=True, text=True, env=airflow.env(PG2DELTA_JOBS=str(REPO / "jobs")), timeout=300,
    )
    assert proc.returncode == 0, _tail(proc)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["errors"] == {}, found["errors"]
    assert set(found["apps"]) == {
        f"pg2delta_{engine}_{what}" for engine in ("embedded", "spark")
        for what in ("run", "bootstrap", "backfill", "maintain")
    }
    for what in ("run", "bootstrap", "backfill", "maintain"):
        (app,) = found["apps"][f"pg2delta_spark_{what}"]
        assert Path(app) == REPO / "jobs" / f"pg2delta_{what}.py" and Path(app).exists(), app


def test_embedded_dags(airflow: Airflow, server: ThrowawayPostgres, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    dsn = server.dsn
    lake = tmp_path / "lake"
    create_schema(dsn, pub)
    wl = Workload(dsn, 2024)
    with wl:
        wl.phase(20)  # rows before the slot: the bootstrap DAG copies them
    config = write_config(tmp_path / "pg2delta.toml", dsn, slot, pub, lake)

    boot = airflow.dags_test("pg2delta_embedded_bootstrap", config)
    assert boot.returncode == 0, _tail(boot)
    assert airflow.tasks("pg2delta_embedded_bootstrap") == {"bootstrap": ("success", 1)}
    assert_lake_matches(dsn, lake, TABLES, context="bootstrap DAG")

    with wl:
        wl.phase(30)
    metrics = tmp_path / "pg2delta.prom"
    run = airflow.dags_test("pg2delta_embedded_run", config, {"metrics_file": str(metrics)})
    assert run.returncode == 0, _tail(run)
    assert airflow.tasks("pg2delta_embedded_run") == {"run": ("success", 1), "status": ("success", 1)}
    assert_lake_matches(dsn, lake, TABLES, context="run DAG")
    assert f'pg2delta_slot_invalidated{{slot="{slot}"}} 0.0' in metrics.read_text()

    # Nothing to do: the task succeeds (exit 0) and the lake is untouched.
    before = lake_files(lake)
    idle = airflow.dags_test("pg2delta_embedded_run", config)
    assert idle.returncode == 0, _tail(idle)
    assert airflow.tasks("pg2delta_embedded_run") == {"run": ("success", 1), "status": ("success", 1)}
    assert lake_files(lake) == before

    # Another run holds the slot (the advisory lock pg2delta takes): 73, the task is skipped and
    # so is the status after it; the slot does not move.
    with wl:
        wl.phase(10)
    position = confirmed_lsn(dsn, slot)
    with psycopg.connect(dsn, autocommit=True) as holder:
        (got,) = holder.execute(
            "SELECT pg_try_advisory_lock(hashtextextended('pg2delta slot ' || %s, 0))", (slot,)
        ).fetchone() or (False,)
        assert got
        busy = airflow.dags_test("pg2delta_embedded_run", config)
        assert airflow.states("pg2delta_embedded_run") == {"run": "skipped", "status": "skipped"}, _tail(busy)
        assert "exit code 73" in busy.stdout + busy.stderr
    assert confirmed_lsn(dsn, slot) == position

    # Unreachable server: 75, retried (retries=3 in the DAG, 1 s apart here), then failed.
    port = server.port
    down = write_config(tmp_path / "down.toml", dsn.replace(f"port={port}", "port=1"), slot, pub, lake)
    retried = airflow.dags_test("pg2delta_embedded_run", down)
    assert retried.returncode != 0
    assert airflow.tasks("pg2delta_embedded_run")["run"] == ("failed", 4), _tail(retried)
    assert airflow.states("pg2delta_embedded_run")["status"] == "upstream_failed"
    assert "exit code 75" in retried.stdout + retried.stderr

    # A missing publication needs a human: 78, failed at once, no retries.
    missing = write_config(tmp_path / "missing.toml", dsn, slot, f"no_such_{tag}", lake)
    refused = airflow.dags_test("pg2delta_embedded_run", missing)
    assert refused.returncode != 0
    assert airflow.tasks("pg2delta_embedded_run")["run"] == ("failed", 1), _tail(refused)
    assert confirmed_lsn(dsn, slot) == position

    # The lock gone, the next scheduled run catches up.
    again = airflow.dags_test("pg2delta_embedded_run", config)
    assert again.returncode == 0, _tail(again)
    assert_lake_matches(dsn, lake, TABLES, context="run DAG after the failures")

    # The backfill DAG: the changelog from the lake's start to its last window, into a copy.
    log = read_delta(str(lake / "_pg2delta" / "applied_log")).to_pylist()
    start = min(r["window_end"] for r in log if r["kind"] == "bootstrap")
    end = max(r["window_end"] for r in log)
    copy = tmp_path / "copy"
    back = airflow.dags_test(
        "pg2delta_embedded_backfill", config,
        {"from_lsn": _lsn(start), "to_lsn": _lsn(end), "into": str(copy), "tables": [t.qualified for t in TABLES]},
    )
    assert back.returncode == 0, _tail(back)
    assert airflow.tasks("pg2delta_embedded_backfill") == {"backfill": ("success", 1)}
    assert_lake_matches(dsn, copy, TABLES, context="backfill DAG into a copy")

    # The maintenance DAG compacts the many small files the runs left; no row changes.
    files = len(DeltaTable(str(lake / ACCT.schema / ACCT.name)).file_uris())
    maint = airflow.dags_test("pg2delta_embedded_maintain", config)
    assert maint.returncode == 0, _tail(maint)
    assert airflow.tasks("pg2delta_embedded_maintain") == {"maintain": ("success", 1)}
    assert len(DeltaTable(str(lake / ACCT.schema / ACCT.name)).file_uris()) < max(files, 2)
    assert_lake_matches(dsn, lake, TABLES, context="maintain DAG")


def _lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
