"""A window that touches many tables: their MERGEs run concurrently (``window.parallel_tables``).

The slot still moves only after every table and the applied log committed; a crash while some
tables committed and others not loses nothing and, on Apache Spark + Delta, commits nothing
twice (Delta recognises the replayed MERGEs by their idempotent-write id).
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable
from psycopg import sql

from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.apply.parallel import apply_tables
from pg2delta.apply.table import TableReport
from pg2delta.config import Config, WindowConfig, load
from pg2delta.faults import FAULT_ENV
from pg2delta.job import Job, run
from workload import TableSpec, assert_lake_matches, cli, confirmed_lsn

pytestmark = pytest.mark.e2e

TABLES = tuple(TableSpec("public", f"t{i:02d}", ("id",)) for i in range(12))


def _setup(dsn: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        for t in TABLES:
            conn.execute(sql.SQL("CREATE TABLE {} (id integer PRIMARY KEY, v text, n bigint)").format(t.ident))
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(pub), sql.SQL(", ").join(t.ident for t in TABLES)
            )
        )
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    return slot, pub


def _changes(dsn: str, rounds: int, first: int = 0) -> None:
    """Inserts, updates and deletes in every table, in transactions that span several tables."""
    with psycopg.connect(dsn) as conn:
        for r in range(first, first + rounds):
            for i, t in enumerate(TABLES):
                base = r * 10
                conn.execute(
                    sql.SQL("INSERT INTO {} SELECT g, md5(g::text), g * %s::bigint FROM generate_series(%s::int, %s::int) g").format(t.ident),
                    (i + 1, base, base + 9),
                )
                conn.execute(sql.SQL("UPDATE {} SET v = v || '!', n = n + 1 WHERE id % 3 = 0").format(t.ident))
                conn.execute(sql.SQL("DELETE FROM {} WHERE id %% 7 = %s::int").format(t.ident), (r % 7,))
                if i % 4 == 3:
                    conn.commit()
            conn.commit()


def _config(dsn: str, slot: str, pub: str, lake: Path, parallel: int) -> Config:
    cfg = load(None, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake))
    return Config(cfg.source, cfg.lake_root, cfg.engine, WindowConfig(parallel_tables=parallel), cfg.tables, cfg.changelog)


# On Apache Spark the first window of test_crash_while_some_tables_committed is this one's first.
def test_window_of_many_tables_applied_concurrently(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _setup(pgdb)
    lake = tmp_path / "lake"
    _changes(pgdb, 2)
    first = run(_config(pgdb, slot, pub, lake, parallel=4))
    assert len(first.windows) == 1 and len(first.windows[0].tables) == len(TABLES)
    assert [t.table for t in first.windows[0].tables] == [t.name for t in TABLES]  # reported in order
    assert_lake_matches(pgdb, lake, TABLES, context="first window, 4 tables at once")
    _changes(pgdb, 1, first=2)
    run(_config(pgdb, slot, pub, lake, parallel=4))
    assert_lake_matches(pgdb, lake, TABLES, context="second window, 4 tables at once")
    log = read_delta(str(lake / "_pg2delta" / "applied_log")).to_pylist()
    assert sorted(r["table_name"] for r in log) == sorted([t.name for t in TABLES] * 2)


@pytest.mark.classic
def test_crash_while_some_tables_committed(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _setup(pgdb)
    lake = tmp_path / "lake"
    _changes(pgdb, 1)
    first = run(_config(pgdb, slot, pub, lake, parallel=4))
    assert len(first.windows) == 1 and [t.table for t in first.windows[0].tables] == [t.name for t in TABLES]
    assert_lake_matches(pgdb, lake, TABLES, context="first window, 4 tables at once")
    _changes(pgdb, 2, first=1)
    before = confirmed_lsn(pgdb, slot)
    versions = {t.name: DeltaTable(str(lake / t.schema / t.name)).version() for t in TABLES}
    common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    crashed = cli(*common, env={FAULT_ENV: "between_tables", "PG2DELTA_PARALLEL_TABLES": "4"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before, "the slot moved although the run died between tables"
    committed = {t.name for t in TABLES if DeltaTable(str(lake / t.schema / t.name)).version() > versions[t.name]}
    assert committed, "the crash came before any table committed"

    again = cli(*common, "--json", env={"PG2DELTA_PARALLEL_TABLES": "4"})
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["from_lsn"] == before
    assert confirmed_lsn(pgdb, slot) != before
    assert_lake_matches(pgdb, lake, TABLES, context="rerun after a crash between concurrent tables")
    if TEST_ENGINE == "spark":
        # Delta itself skipped the replayed commit of every table that had committed it: one MERGE
        # (or overwrite of the window's keys), the crashed window's (the first window appended the
        # new tables' rows).
        for t in TABLES:
            history = DeltaTable(str(lake / t.schema / t.name)).history()
            merges = [h for h in history if h.get("operation") == "MERGE"
                      or (h.get("operation") == "WRITE" and h.get("operationParameters", {}).get("mode") == "Overwrite")]
            assert len(merges) == 1, (t.name, t.name in committed, [h.get("operation") for h in history])


def test_first_failure_stops_tables_not_started(tmp_path: Path) -> None:
    """The tables' apply runs on a pool: a failure is raised once running tables finished, in
    the tables' order, and tables not yet started are not started."""
    job = Job(load(None, env={}, lake=str(tmp_path), need_source=False))
    job.config = Config(job.config.source, job.config.lake_root, job.config.engine, WindowConfig(parallel_tables=2))
    started: list[str] = []
    lock = threading.Lock()

    def apply(name: str) -> TableReport:
        with lock:
            started.append(name)
        time.sleep(0.05)
        if name == "b":
            raise ValueError("b failed")
        return TableReport("s", name, name)

    with pytest.raises(ValueError, match="b failed"):
        apply_tables(job.config.window.parallel_tables, list("abcdefgh"), apply)  # type: ignore[arg-type]
    assert "b" in started and len(started) < 8
    assert [r.table for r in apply_tables(job.config.window.parallel_tables, list("acd"), apply)] == ["a", "c", "d"]  # type: ignore[arg-type]
