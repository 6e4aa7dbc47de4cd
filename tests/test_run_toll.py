"""What a run costs when it has little or nothing to do (issue 37, item 2).

* A run whose window holds no published change (only WAL of other tables) reads the slot, moves
  it, and never starts an engine: on Apache Spark no SparkSession, through ``spark-submit`` too.
* A new table's first window creates it with its append: one commit, version 0; on Apache Spark a
  later window of inserts alone is an append too.

Every lake is read back with delta-rs and compared with PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.config import load
from pg2delta.job import Job, run
from pg2delta.lake.engine import Engine, Lake
from workload import cli, confirmed_lsn, lsn_int, published_table

pytestmark = pytest.mark.e2e

ITEMS = "CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int)"


def _rows(dsn: str) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return sorted(conn.execute("SELECT id, name, qty FROM items").fetchall())


def _lake_rows(lake: Path) -> list[tuple[object, ...]]:
    # lake_read: the table may have deletion vectors (Apache Spark's default), which to_pyarrow_table refuses.
    got = read_delta(lake / "public" / "items", columns=["id", "name", "qty"]).to_pylist()
    return sorted((r["id"], r["name"], r["qty"]) for r in got)


def _last_commit(lake: Path) -> tuple[int, int, int]:
    """The items table's newest commit: its version, the files it added and the files it removed
    (an append removes none; a MERGE, or the embedded engine's rewrite, removes what it rewrote)."""
    version = DeltaTable(str(lake / "public" / "items")).version()
    text = (lake / "public" / "items" / "_delta_log" / f"{version:020d}.json").read_text()
    actions = [json.loads(line) for line in text.splitlines() if line.strip()]
    return version, sum("add" in a for a in actions), sum("remove" in a for a in actions)


def _insert(dsn: str, lo: int, hi: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO items SELECT g, 'item ' || g, g %% 7 FROM generate_series(%s::bigint, %s::bigint) g", (lo, hi)
        )


def _other_wal(dsn: str) -> None:
    """WAL of a table outside the publication: the slot has something to read, nothing to apply."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS unpublished (id int)")
        conn.execute("INSERT INTO unpublished SELECT generate_series(1, 100)")


def _no_engine(lake: Lake) -> Engine:
    raise AssertionError("the run asked for an engine although its window held nothing to apply")


def test_idle_window_starts_no_engine(pgdb: str, tmp_path: Path) -> None:
    slot, pub = published_table(pgdb, ITEMS, "items")
    _insert(pgdb, 1, 50)
    lake = tmp_path / "lake"
    cfg = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
    assert run(cfg).changes == 50
    _other_wal(pgdb)
    before = lsn_int(confirmed_lsn(pgdb, slot) or "0/0")
    job = Job(cfg, engine_factory=_no_engine)
    try:
        report = job.run()
    finally:
        job.close()
    assert report.windows and report.changes == 0, report
    assert report.end_lsn > before, "the window of other tables' WAL was not passed over"
    assert lsn_int(confirmed_lsn(pgdb, slot) or "0/0") == report.end_lsn
    assert _lake_rows(lake) == _rows(pgdb)


@pytest.mark.classic
def test_first_window_and_inserts_alone_are_appends(pgdb: str, tmp_path: Path) -> None:
    """A new table's first window creates it with its append; on Apache Spark a later window of
    inserts alone is an append too (no file removed), spilled or not. Its replay after a kill (a MERGE: the table
    is past the version the applied log recorded) is test_job_faults': its keyless table gets
    inserts alone."""
    slot, pub = published_table(pgdb, ITEMS, "items")
    _insert(pgdb, 1, 100)
    lake = tmp_path / "lake"
    cfg = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
    run(cfg)
    assert _last_commit(lake)[0::2] == (0, 0), "the new table is not version 0, made by its first window's append"
    assert _lake_rows(lake) == _rows(pgdb)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE items SET qty = qty + 1 WHERE id % 10 = 0")
    run(cfg)
    assert _lake_rows(lake) == _rows(pgdb)
    before = _last_commit(lake)[0]
    _insert(pgdb, 101, 150)
    run(cfg)
    version, added, removed = _last_commit(lake)
    assert version == before + 1 and added >= 1
    if TEST_ENGINE == "spark":
        assert removed == 0, "a window of inserts alone into the table was not appended"
    assert _lake_rows(lake) == _rows(pgdb)
    if TEST_ENGINE == "spark":  # the same, spilled past the memory budget (staged, the engine's reduce)
        _insert(pgdb, 151, 200)
        run(load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake), memory_budget=1, split_rows=7))
        assert _last_commit(lake)[0::2] == (version + 1, 0), "a spilled window of inserts alone was not appended"
        assert _lake_rows(lake) == _rows(pgdb)


@pytest.mark.classic
@pytest.mark.skipif(TEST_ENGINE != "spark", reason="the classic engine's session (make test-spark)")
def test_idle_run_through_the_cli_starts_no_session(pgdb: str, tmp_path: Path) -> None:
    """In a new process, as a scheduler starts it: the run says it started no engine, and no
    SparkContext (Spark's own log line of one starting) appears."""
    slot, pub = published_table(pgdb, ITEMS, "items")
    _insert(pgdb, 1, 20)
    lake = tmp_path / "lake"
    common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), "--json"]
    first = cli(*common, child=True, timeout=1200)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "engine spark started" in first.stderr
    _other_wal(pgdb)
    before = lsn_int(confirmed_lsn(pgdb, slot) or "0/0")
    idle = cli(*common, "-v", child=True, timeout=1200)
    assert idle.returncode == 0, idle.stderr[-2000:]
    report = json.loads(idle.stdout)
    assert report["changes"] == 0 and report["windows"] >= 1, report
    assert lsn_int(report["to_lsn"]) > before
    assert "engine spark started" not in idle.stderr
    assert "SparkContext" not in idle.stderr, idle.stderr[-2000:]
    assert _lake_rows(lake) == _rows(pgdb)
