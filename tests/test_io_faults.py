"""Faults outside pg2delta: the run's connection cut mid-read, PostgreSQL restarting mid-run, the
staging area's disk full. Each gives its documented exit code with one line on stderr, the slot
stays where the lake is, and the next run leaves the lake equal to PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from engines import child_env
from pg2delta.errors import EXIT_RETRYABLE, EXIT_STORAGE_FULL
from pg2delta.source.throwaway import ThrowawayPostgres, wait_ready
from workload import TableSpec, assert_lake_matches, cli, confirmed_lsn

pytestmark = pytest.mark.e2e

BIG = TableSpec("public", "big", ("id",))
_PEEK = "SELECT pid FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%%pg_logical_slot_peek_binary_changes%%' AND pid <> pg_backend_pid() AND datname = current_database()"


def _setup(dsn: str, lake: Path, rows: int, width: int) -> tuple[str, list[str]]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id int PRIMARY KEY, body text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE big")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO big VALUES (0, 'first')")
    common = ["run", "--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli(*common)
    assert first.returncode == 0, first.stderr[-2000:]
    with psycopg.connect(dsn, autocommit=True) as conn:  # one big window waits in the slot
        conn.execute(  # md5s of their own per row: text that compresses to about half
            f"INSERT INTO big SELECT g, (SELECT string_agg(md5(g::text || '.' || i::text), '') "
            f"FROM generate_series(1, {width}) i) FROM generate_series(1, {rows}) g")
        conn.execute("UPDATE big SET body = 'changed' WHERE id % 7 = 0")
    return slot, common


def _run_and(common: list[str], act: Callable[[], bool], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process; ``act()`` is called every 20 ms until it returns True (it did its fault)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    env.update(child_env())
    proc = subprocess.Popen([sys.executable, "-m", "pg2delta.cli", *common], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline and not act():
            time.sleep(0.02)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_line(done: subprocess.CompletedProcess[str], code: int, kind: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr[-3000:])
    lines = [line for line in done.stderr.splitlines() if line.startswith("pg2delta: ")]
    assert len(lines) == 1 and lines[0].startswith(f"pg2delta: {kind} error: "), done.stderr[-3000:]


def _converges(dsn: str, lake: Path, common: list[str], context: str) -> None:
    again = cli(*common)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_lake_matches(dsn, lake, [BIG], context=context)


def test_connection_cut_mid_read(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, common = _setup(pgdb, lake, rows=300_000, width=1)
    before = confirmed_lsn(pgdb, slot)
    cut: list[int] = []

    def terminate() -> bool:
        with psycopg.connect(pgdb, autocommit=True) as conn:
            for (pid,) in conn.execute(_PEEK).fetchall():
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                cut.append(pid)
        return bool(cut)

    done = _run_and(common, terminate)
    assert cut, "the run ended before its peek was seen"
    _one_line(done, EXIT_RETRYABLE, "connection")
    assert confirmed_lsn(pgdb, slot) == before
    _converges(pgdb, lake, common, "after the read's connection was cut")


@pytest.fixture
def own_server() -> Iterator[ThrowawayPostgres]:
    """A server of this test's own, restarted in the middle of a run."""
    from conftest import PG_VERSIONS

    server = ThrowawayPostgres.start(max(PG_VERSIONS))
    try:
        yield server
    finally:
        server.stop()


def test_postgres_restarting_mid_run(own_server: ThrowawayPostgres, tmp_path: Path) -> None:
    dsn = own_server.dsn
    lake = tmp_path / "lake"
    slot, common = _setup(dsn, lake, rows=300_000, width=1)
    before = confirmed_lsn(dsn, slot)
    restarted: list[bool] = []

    def restart() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            peeking = conn.execute(_PEEK).fetchall()
        if peeking:
            own_server.restart()
            restarted.append(True)
        return bool(restarted)

    done = _run_and(common, restart)
    assert restarted, "the run ended before its peek was seen"
    _one_line(done, EXIT_RETRYABLE, "connection")
    wait_ready(dsn)
    assert confirmed_lsn(dsn, slot) == before
    _converges(dsn, lake, common, "after PostgreSQL restarted mid-run")


@contextmanager
def _small_disk(path: Path, size: str) -> Iterator[None]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {mounted.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_staging_disk_full(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, common = _setup(pgdb, lake, rows=20_000, width=20)  # about 13 MB of text in one window
    before = confirmed_lsn(pgdb, slot)
    staging = lake / "_pg2delta" / "staging"
    with _small_disk(staging, "2m"):
        done = cli(*common, child=True)
        _one_line(done, EXIT_STORAGE_FULL, "storage_full")
        assert "No space left on device" in done.stderr or "os error 28" in done.stderr
        assert confirmed_lsn(pgdb, slot) == before
        subprocess.run(["mount", "-o", "remount,size=200m", str(staging)], check=True)
        _converges(pgdb, lake, common, "after the staging disk was full, then grown")
