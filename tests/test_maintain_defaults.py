"""The defaults that keep a year of five-minute runs cheap, with nothing else scheduled.

* every engine writes a checkpoint of a table's log every 10 commits by itself;
* a run maintains the lake by default, a few tables a run, the longest-waiting first, and a run
  killed in the middle of that maintenance (SIGKILL) loses nothing: the rerun leaves the lake
  equal to PostgreSQL, read back with delta-rs;
* time travel and backfill work across a compaction and VACUUM at the default retention.

The clock that schedules maintenance is moved with ``PG2DELTA_MAINTAIN_CLOCK_OFFSET`` rather than
waiting an hour.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from changelog_support import write_config
from conftest import newest_server_only
from engines import TEST_ENGINE
from pg2delta.faults import FAULT_ENV
from pg2delta.lake.applied_log import DIGEST
from pg2delta.lake.digests import DIGESTS_ROOT
from pg2delta.lake.engine import Lake
from pg2delta.maintain import CLOCK_ENV, delta_tables
from pg2delta.source.throwaway import ThrowawayPostgres
from test_backfill import _backfill, _copy, _history, _main_as_of, _seed_version
from test_maintain import _many_windows, _source
from workload import ACCT, EVENTS, assert_lake_matches, cli, lake_rows

pytestmark = pytest.mark.e2e


@pytest.fixture
def pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    """The newest server only: maintenance reads and writes only the lake."""
    newest_server_only(pg_server, "maintenance reads and writes only the lake")
    return pgdb


def _hours(n: float) -> dict[str, str]:
    """The environment of a run ``n`` hours after the lake's first, as the scheduler's clock says."""
    return {CLOCK_ENV: str(int(n * 3600))}


def _marker(lake: Path) -> dict[str, Any]:
    return dict(json.loads((lake / "_pg2delta" / "maintain.json").read_text()))


def _change(dsn: str, k: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO acct (id, name, big) VALUES (%s, %s, %s)", (10_000 + k, f"m{k}", k))
        conn.execute("UPDATE acct SET big = big + 1 WHERE id = (SELECT min(id) FROM acct)")
        conn.execute("INSERT INTO events (kind, n) VALUES ('m', %s)", (k,))


def _run(config: Path, env: dict[str, str]) -> dict[str, Any]:
    done = cli("run", "--config", str(config), "--json", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout))


def _confirmed(dsn: str, slot: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn - '0/0'::pg_lsn FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _checkpoints(table: Path) -> list[int]:
    return sorted(
        int(m.group(1)) for p in (table / "_delta_log").iterdir()
        if (m := re.fullmatch(r"(\d{20})\.checkpoint(\.\d{10}\.\d{10})?\.parquet", p.name))
    )


@pytest.mark.classic
def test_the_engine_writes_a_checkpoint_every_ten_commits(pgdb: str, tmp_path: Path) -> None:
    """Without any maintenance (``interval = ""``): pysail and Delta on Apache Spark (Delta's
    ``delta.checkpointInterval``, 10 by default) each checkpoint the log of a table every 10 commits;
    so does the embedded engine's delta-rs append to the applied log."""
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, default=False)
    config.write_text(config.read_text() + '[maintain]\ninterval = ""\n')
    # About 2.3 windows a transaction, a commit of acct in 1.3 of them, of events in 1. A classic
    # window costs seconds: acct's commits only there.
    _many_windows(pgdb, config, 16 if TEST_ENGINE == "embedded" else 9)
    assert not (lake / "_pg2delta" / "maintain.json").exists()
    for spec in (ACCT, EVENTS) if TEST_ENGINE == "embedded" else (ACCT,):
        table = lake / spec.schema / spec.name
        version = DeltaTable(str(table)).version()
        assert version >= 10, (spec.qualified, version)
        assert _checkpoints(table) == list(range(10, version + 1, 10)), (spec.qualified, version)
        assert not any(t for t in DeltaTable(str(table)).history() if t.get("operation") == "OPTIMIZE")
    if TEST_ENGINE == "embedded":  # the applied log, which delta-rs appends to there, checkpointed alike
        applied = lake / "_pg2delta" / "applied_log"
        version = DeltaTable(str(applied)).version()
        assert version >= 10 and _checkpoints(applied) == list(range(10, version + 1, 10)), version
        assert {c.get("engineInfo", "")[:8] for c in DeltaTable(str(applied)).history(version)} == {"delta-rs"}
    status = cli("status", "--config", str(config), "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    entry = next(t for t in json.loads(status.stdout)["tables"] if t["table"] == ACCT.qualified)
    version = DeltaTable(str(lake / ACCT.schema / ACCT.name)).version()
    assert entry["commits_since_checkpoint"] == version % 10
    assert_lake_matches(pgdb, lake)


def test_runs_maintain_the_lake_by_default_a_few_tables_a_run(pgdb: str, tmp_path: Path) -> None:
    """No ``[maintain]`` section: the lake's first run starts the clock; an hour later each run
    maintains at most four Delta tables, the longest-waiting first, until every one had its turn;
    then none until the next hour."""
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, changelog={ACCT.qualified: True}, default=False)
    _many_windows(pgdb, config, 8)
    marker = _marker(lake)
    assert marker["tables"] == {} and marker["next_due"] == pytest.approx(marker["started_at"] + 3600)
    _change(pgdb, 1)
    assert _run(config, _hours(0.5))["maintenance"] is None
    everything = {name for name, _, _ in delta_tables(Lake(str(lake)))}
    assert {ACCT.qualified, EVENTS.qualified, "_pg2delta/applied_log"} <= everything and len(everything) > 4
    acct_files = len(DeltaTable(str(lake / ACCT.schema / ACCT.name)).file_uris())
    assert acct_files >= 8
    # Digests of applied-log files compaction replaces (pg2delta.lake.digests), and of an older
    # reduction's: gone once the applied log had its turn.
    stale = [lake / DIGESTS_ROOT / DIGEST.name / "replaced.parquet", lake / DIGESTS_ROOT / "applied_log-0" / "old.parquet"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"stale")
    turns: list[list[str]] = []
    for k in range(2, 2 + len(everything)):
        _change(pgdb, k)
        maintained = _run(config, _hours(1.1))["maintenance"]
        if maintained is None or not maintained["tables"]:
            break
        turns.append(list(maintained["tables"]))
        assert maintained["staging_removed"] == 0
    assert all(1 <= len(t) <= 4 for t in turns), turns
    done = [name for turn in turns for name in turn]
    assert sorted(done) == sorted(everything), turns  # each one once
    assert len(turns) == -(-len(everything) // 4)
    assert set(_marker(lake)["tables"]) == everything
    assert not any(p.exists() for p in stale)
    assert len(DeltaTable(str(lake / ACCT.schema / ACCT.name)).file_uris()) < acct_files
    # The next hour: maintenance again, starting with the tables that waited longest.
    _change(pgdb, 100)
    again = _run(config, _hours(2.2))["maintenance"]
    assert again is not None and list(again["tables"]) == turns[0], (again, turns)
    assert_lake_matches(pgdb, lake)


@pytest.mark.parametrize(
    "point",
    [pytest.param("maintain_after_compact", marks=pytest.mark.classic), "maintain_between_tables"],
)
def test_run_killed_in_its_maintenance_then_rerun_equals_postgres(pgdb: str, tmp_path: Path, point: str) -> None:
    """A run's windows are applied and the slot moved before its maintenance starts: a SIGKILL in
    the middle of maintenance loses nothing, and the next run maintains again."""
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, changelog={ACCT.qualified: True}, default=False)
    _many_windows(pgdb, config, 5 if TEST_ENGINE == "embedded" else 2)
    marker = _marker(lake)
    _change(pgdb, 1)
    confirmed = _confirmed(pgdb, slot)
    killed = cli("run", "--config", str(config), env={**_hours(1.5), FAULT_ENV: point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "maintaining" in killed.stderr
    assert _confirmed(pgdb, slot) > confirmed, "the window was applied and the slot moved before maintenance"
    assert_lake_matches(pgdb, lake, context="after the kill")
    assert _marker(lake) == marker  # nothing recorded as maintained
    _change(pgdb, 2)
    again = _run(config, _hours(1.5))
    assert again["windows"] >= 1 and again["maintenance"]["tables"], again
    assert set(_marker(lake)["tables"]) == set(again["maintenance"]["tables"])
    for name in again["maintenance"]["tables"]:
        if "/" not in name:
            schema, table = name.split(".")
            assert DeltaTable(str(lake / schema / table)).version() >= 0
    assert_lake_matches(pgdb, lake, context="after the rerun")
    _change(pgdb, 3)
    _run(config, _hours(1.6))
    assert_lake_matches(pgdb, lake, context="after one more run")


@pytest.mark.classic
def test_time_travel_and_backfill_across_a_vacuum_at_the_default_retention(pgdb: str, tmp_path: Path) -> None:
    """Compaction and VACUUM at the default retention (7 days) keep every version a backfill seed,
    ``pg2delta versions`` or time travel reads: they read as before, and a backfill seeded from
    before the VACUUM equals the main table."""
    config, lake, ends = _history(pgdb, tmp_path, 41, runs=3)
    acct = lake / ACCT.schema / ACCT.name
    versions = range(DeltaTable(str(acct)).version() + 1)
    before = {v: lake_rows(lake, ACCT, version=v) for v in versions}
    as_of = {b: _main_as_of(lake, ACCT, b) for b in ends}
    done = cli("maintain", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    t = json.loads(done.stdout)["tables"][ACCT.qualified]
    assert t["files_after"] < t["files_before"] and t["files_removed"] == 0, t
    assert {v: lake_rows(lake, ACCT, version=v) for v in versions} == before
    assert {b: _main_as_of(lake, ACCT, b) for b in ends} == as_of
    # pg2delta versions: the exact Delta version of a window end inside the retention.
    middle = ends[len(ends) // 2]
    found = cli("versions", "--config", str(config), "--at-lsn", f"{middle >> 32:X}/{middle & 0xFFFFFFFF:X}", "--json")
    assert found.returncode == 0, found.stderr[-3000:]
    at = json.loads(found.stdout)["tables"][ACCT.qualified]["delta_version"]
    assert at == _seed_version(lake, ACCT, middle) and lake_rows(lake, ACCT, version=at) == before[at]
    # A backfill seeded by time travel to a version from before the compaction and VACUUM.
    seeds = [a for a in ends[1:-1] if _seed_version(lake, ACCT, a) is not None]
    into = tmp_path / "copy"
    proc = _backfill(config, seeds[0], ends[-1], "--into", str(into), "--table", ACCT.qualified)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _copy(into, ACCT) == _main_as_of(lake, ACCT, ends[-1])
    assert_lake_matches(pgdb, lake)
