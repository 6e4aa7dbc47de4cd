"""SIGTERM (a scheduler's timeout, a pod's shutdown) ends a run promptly with exit 75.

At named points of a window (sent by the process to itself, as the fault hook does) and at random
moments from outside: the run exits 75 within seconds, the slot stands where it was or at the end
of a window the applied log records (never past the lake), and the next run converges: the lake
equals PostgreSQL, nothing lost, nothing applied twice (the keyless table would show it).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from engines import child_env
from pg2delta.errors import EXIT_RETRYABLE
from pg2delta.faults import TERM_ENV
from pg2delta.lake.applied_log import LOG_TABLE
from pg2delta.termination import GRACE_ENV
from workload import Workload, assert_lake_matches, cli, confirmed_lsn, create_schema

pytestmark = pytest.mark.e2e

# SIGTERM to exit, at most: the forced exit comes GRACE seconds after the signal where the clean-up
# hangs (a Spark Connect session's stop can), plus the child's own exit.
GRACE = "8"
PROMPT_SECONDS = 15.0


def _setup(dsn: str, lake: Path, seed: int, steps: int = 60) -> tuple[str, list[str]]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    common = ["run", "--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    with Workload(dsn, seed) as wl:
        wl.phase(30)
        first = cli(*common)
        assert first.returncode == 0, first.stderr[-2000:]
        wl.phase(steps)
    return slot, common


def _logged_ends(lake: Path, slot: str) -> set[str]:
    path = lake / LOG_TABLE
    if not (path / "_delta_log").is_dir():
        return set()
    return {r["window_end_lsn"] for r in DeltaTable(str(path)).to_pyarrow_table().to_pylist() if r["slot"] == slot}


def _terminated(dsn: str, lake: Path, slot: str, before: str | None, code: int, stderr: str, seconds: float) -> None:
    assert code == EXIT_RETRYABLE, (code, stderr[-2000:])
    assert seconds < PROMPT_SECONDS, f"took {seconds:.1f} s after SIGTERM"
    lines = [line for line in stderr.splitlines() if line.startswith("pg2delta: terminated error")]
    assert len(lines) == 1, stderr[-2000:]
    moved = confirmed_lsn(dsn, slot)
    assert moved == before or moved in _logged_ends(lake, slot), "the slot moved past what the lake holds"


def _holds_lock(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        return bool(conn.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
            "WHERE l.locktype = 'advisory' AND l.granted AND d.datname = current_database()").fetchone()[0])  # type: ignore[index]


def _wait_unlocked(dsn: str) -> None:
    deadline = time.monotonic() + 30
    while _holds_lock(dsn):
        assert time.monotonic() < deadline, "the slot's lock is still held 30 s after the run ended"
        time.sleep(0.05)


def _converges(dsn: str, lake: Path, common: list[str], context: str) -> None:
    again = cli(*common, "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["to_lsn"] is not None
    assert_lake_matches(dsn, lake, context=context)


@pytest.mark.parametrize(
    "point", ["after_read", pytest.param("between_tables", marks=pytest.mark.classic), "after_commits", "before_advance"]
)
def test_sigterm_at_a_point_then_rerun(pgdb: str, tmp_path: Path, point: str) -> None:
    lake = tmp_path / "lake"
    slot, common = _setup(pgdb, lake, seed=900 + len(point))
    before = confirmed_lsn(pgdb, slot)
    done = cli(*common, env={TERM_ENV: point, GRACE_ENV: GRACE}, child=True)
    ended = dt.datetime.now()
    # from the signal (its log line's time: the process's start, a JVM's on Apache Spark, is not counted)
    [sent] = [line[:23] for line in done.stderr.splitlines() if "fault injection: SIGTERM" in line]
    seconds = (ended - dt.datetime.strptime(sent, "%Y-%m-%d %H:%M:%S,%f")).total_seconds()
    _terminated(pgdb, lake, slot, before, done.returncode, done.stderr, seconds)
    assert confirmed_lsn(pgdb, slot) == before  # every point is before the slot's advance
    _converges(pgdb, lake, common, f"rerun after SIGTERM at {point}")


def test_sigterm_at_random_moments(pgdb: str, tmp_path: Path) -> None:
    """From outside, at random moments of runs of small windows; each rerun is interrupted again
    until one finishes, and the lake then equals PostgreSQL."""
    seed = int(os.environ.get("PG2DELTA_TEST_SEED", "4242"))
    rnd = random.Random(seed)
    lake = tmp_path / "lake"
    slot, common = _setup(pgdb, lake, seed=seed, steps=200)
    args = [*common, "--max-changes", "20"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    env.update(child_env())
    env[GRACE_ENV] = GRACE
    terminated = 0
    for attempt in range(3):
        _wait_unlocked(pgdb)  # the last attempt's backend gone
        before = confirmed_lsn(pgdb, slot)
        proc = subprocess.Popen([sys.executable, "-m", "pg2delta.cli", *args], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            # From the moment it holds the slot's lock (connected: its SIGTERM handler is in place;
            # before, the default action ends a process that has done nothing yet).
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline and not _holds_lock(pgdb):
                time.sleep(0.02)
            time.sleep(rnd.uniform(0.3, 3.0))
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            seconds = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode == 0:  # it finished before the signal arrived
            break
        terminated += 1
        print(f"seed {seed}: attempt {attempt} exit {proc.returncode} after {seconds:.1f} s, slot {before} -> {confirmed_lsn(pgdb, slot)}")
        print(err[-1500:])
        _terminated(pgdb, lake, slot, before, proc.returncode, err, seconds)
    assert terminated, f"seed {seed}: every run ended before its SIGTERM"
    _converges(pgdb, lake, common, f"seed {seed}, after {terminated} SIGTERM(s)")
