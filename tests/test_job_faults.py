"""Crashes: the CLI killed by SIGKILL at every step of a window, then run again.

The slot must not move past anything unapplied, and the run after the crash must leave
the lake equal to PostgreSQL, with nothing lost and nothing applied twice (the keyless,
insert-only table would show a doubled window as extra rows).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from lake_read import read_delta
from pg2delta.config import load
from pg2delta.faults import FAULT_ENV
from pg2delta.job import run
from pg2delta.lake.applied_log import LOG_TABLE
from workload import TABLES, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema, lsn_int

pytestmark = pytest.mark.e2e

POINTS = ["after_read", "between_tables", "after_commits", "before_advance"]


def _setup(dsn: str, lake: Path, seed: int, steps: int = 40) -> tuple[str, str, Workload]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    wl = Workload(dsn, seed).__enter__()
    wl.phase(steps)
    # a first, clean run: the lake holds rows the crashed window's updates refer to
    run(load(None, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake)))
    assert_lake_matches(dsn, lake, context=f"seed {seed}, first run")
    return slot, pub, wl


def _versions(lake: Path) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for spec in TABLES:
        path = lake / spec.schema / spec.name
        out[spec.qualified] = DeltaTable(str(path)).version() if (path / "_delta_log").is_dir() else None
    return out


# On Apache Spark too where Delta's idempotent-write ids and concurrent tables matter: a crash
# between the tables' commits and one after all of them (the other points write nothing, or are
# caught by the applied log alone).
@pytest.mark.parametrize(
    "point", [pytest.param(p, marks=pytest.mark.classic) if p in ("between_tables", "after_commits") else p for p in POINTS]
)
def test_crash_at_point_then_rerun(pgdb: str, tmp_path: Path, point: str) -> None:
    seed = 500 + POINTS.index(point)
    lake = tmp_path / "lake"
    slot, pub, wl = _setup(pgdb, lake, seed)
    try:
        wl.phase(50)
    finally:
        wl.__exit__()
    before = confirmed_lsn(pgdb, slot)
    common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]

    crashed = cli(*common, env={FAULT_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, (point, crashed.returncode, crashed.stderr[-2000:])
    assert confirmed_lsn(pgdb, slot) == before, f"the slot moved although the run died at {point}"
    versions = _versions(lake)

    again = cli(*common, "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    report = json.loads(again.stdout)
    assert report["from_lsn"] == before
    assert lsn_int(confirmed_lsn(pgdb, slot) or "0/0") > lsn_int(before or "0/0")
    assert_lake_matches(pgdb, lake, context=f"seed {seed}, rerun after a crash at {point}")
    if point == "before_advance":
        # The applied log already names the window: the rerun skips every table.
        assert _versions(lake) == versions
    # Its append carries no idempotent-write id: a replay logs no table twice at one window's end.
    logged = [(r["relation_oid"], r["window_end"]) for r in read_delta(str(lake / LOG_TABLE)).to_pylist()
              if r["slot"] == slot and r["kind"] == "window"]
    assert len(logged) == len(set(logged)), f"a table logged twice at a window's end after a crash at {point}"


def test_crash_between_tables_with_small_windows(pgdb: str, tmp_path: Path) -> None:
    seed = 611
    lake = tmp_path / "lake"
    slot, pub, wl = _setup(pgdb, lake, seed)
    try:
        wl.phase(60)
    finally:
        wl.__exit__()
    before = confirmed_lsn(pgdb, slot)
    common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), "--max-changes", "25"]
    crashed = cli(*common, env={FAULT_ENV: "between_tables"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before
    again = cli(*common, "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["windows"] > 1
    assert_lake_matches(pgdb, lake, context=f"seed {seed}")


def test_kill_in_a_later_window(pgdb: str, tmp_path: Path) -> None:
    """SIGKILL from outside as soon as the first window has advanced the slot: mid-way through the next."""
    seed = 733
    lake = tmp_path / "lake"
    slot, pub, wl = _setup(pgdb, lake, seed)
    try:
        wl.phase(80, truncate=False)
        wl.phase(30)
    finally:
        wl.__exit__()
    start = confirmed_lsn(pgdb, slot)
    args = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), "--max-changes", "15"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    proc = subprocess.Popen([sys.executable, "-m", "pg2delta.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while confirmed_lsn(pgdb, slot) == start and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before the kill ({proc.returncode}): {err[-2000:]}"
    moved = confirmed_lsn(pgdb, slot)
    assert moved is not None and moved != start, "killed before the first window was done"
    # The slot stands exactly at the end of a window the applied log records.
    log = read_delta(str(lake / LOG_TABLE)).to_pylist()
    ends = {r["window_end_lsn"] for r in log if r["slot"] == slot}
    assert moved in ends, (moved, sorted(ends))

    again = cli(*args, "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["from_lsn"] == moved
    assert_lake_matches(pgdb, lake, context=f"seed {seed}, after a kill in a later window")


def _toast_value(n: int) -> str:
    """12 kB that does not compress: stored out of line, sent as unchanged TOAST when untouched."""
    return "".join(f"{(n * 7919 + i) ** 3 % 65521:04x}" for i in range(3000))


def _body_of(lake: Path, key: int) -> str | None:
    rows = read_delta(str(lake / "public" / "acct")).to_pylist()
    return next((r["body"] for r in rows if r["id"] == key), None)


def _key_change_setup(dsn: str, lake: Path) -> tuple[str, list[str]]:
    """Row 5 holds a large value in the lake; returns the slot and the CLI arguments."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO acct (id, name, body) VALUES (5, 'first', %s)", (_toast_value(1),))
    args = ["run", "--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    return slot, args


def test_replay_key_change_then_key_reused(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, args = _key_change_setup(pgdb, lake)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET id = 105 WHERE id = 5")  # body sent as unchanged TOAST
        conn.execute("INSERT INTO acct (id, name, body) VALUES (5, 'second', %s)", (_toast_value(2),))
        conn.execute("INSERT INTO events (kind) VALUES ('x')")  # a second table: acct is applied first
    before = confirmed_lsn(pgdb, slot)
    crashed = cli(*args, env={FAULT_ENV: "between_tables"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _body_of(lake, 105) == _toast_value(1), "row 105 took the large value of the new row 5"
    assert_lake_matches(pgdb, lake)


def test_replay_key_change_and_back(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, args = _key_change_setup(pgdb, lake)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET id = 105 WHERE id = 5")
        conn.execute("INSERT INTO events (kind) VALUES ('x')")
    before = confirmed_lsn(pgdb, slot)
    crashed = cli(*args, env={FAULT_ENV: "between_tables"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET id = 5 WHERE id = 105")  # after the crash, before the rerun
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _body_of(lake, 5) == _toast_value(1)
    assert_lake_matches(pgdb, lake)


def test_unchanged_toast_replay_across_a_delta_checkpoint(pgdb: str, tmp_path: Path) -> None:
    """The replay reads unchanged TOAST at the version the last logged window made, even when the
    crashed run's MERGE wrote a Delta checkpoint after it (pysail 0.7.2 cannot time-travel below
    its latest checkpoint; the engine then reads the files the log lists at that version)."""
    tag = uuid.uuid4().hex[:8]
    slot, pub, a, b = f"slot_{tag}", f"pub_{tag}", f"a_{tag}", f"b_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {a} (id int PRIMARY KEY, big text, n int)")
        conn.execute(f"ALTER TABLE {a} ALTER COLUMN big SET STORAGE EXTERNAL")  # stored out of line: TOAST
        conn.execute(f"CREATE TABLE {b} (id int PRIMARY KEY, n int)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE {a}, {b}")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute(f"INSERT INTO {a} SELECT g, repeat(md5(g::text), 200), 0 FROM generate_series(1, 3) g")
        conn.execute(f"INSERT INTO {b} VALUES (1, 0)")
        lake = tmp_path / "lake"
        config = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
        a_path = lake / "public" / a
        # one window per run, until table a's Delta table stands at version 9
        while not (a_path / "_delta_log").is_dir() or DeltaTable(str(a_path)).version() < 9:
            conn.execute(f"UPDATE {a} SET n = n + 1 WHERE id = 1")
            run(config)
        assert DeltaTable(str(a_path)).version() == 9
        # row 2's big value is sent as unchanged TOAST and is only in the lake
        conn.execute(f"UPDATE {a} SET n = 100 WHERE id = 2")
        conn.execute(f"UPDATE {b} SET n = 5 WHERE id = 1")
        before = confirmed_lsn(pgdb, slot)
        common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
        # One table at a time, so that the crash comes after table a (the first) committed.
        crashed = cli(*common, env={FAULT_ENV: "between_tables", "PG2DELTA_PARALLEL_TABLES": "1"})
        assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
        assert confirmed_lsn(pgdb, slot) == before
        assert DeltaTable(str(a_path)).version() == 10
        assert (a_path / "_delta_log" / f"{10:020d}.checkpoint.parquet").exists(), "no checkpoint: the case is not exercised"
        again = cli(*common)
        assert again.returncode == 0, again.stderr[-2000:]
        for name in (a, b):
            want = sorted(conn.execute(f"SELECT * FROM {name}").fetchall())
            got = read_delta(str(lake / "public" / name)).to_pylist()
            assert sorted(tuple(r.values()) for r in got) == want, name


@pytest.mark.classic
def test_crash_after_the_first_window_appended_then_rerun(pgdb: str, tmp_path: Path) -> None:
    """A table's first window is appended (the table is new: nothing to match); a crash after that
    commit and before the window is logged, then a rerun: the replay merges the same rows into the
    table it now finds, and no row is there twice."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    with Workload(pgdb, 733) as wl:
        wl.phase(60)
    point = "after_commits"  # every table of the window committed, the window not logged
    common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    crashed = cli(*common, env={FAULT_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, (point, crashed.returncode, crashed.stderr[-2000:])
    assert any(v is not None for v in _versions(lake).values()), "no table was appended before the crash"
    again = cli(*common)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_lake_matches(pgdb, lake, context="rerun after a crash once the first window was appended")
