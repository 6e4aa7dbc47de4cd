"""``pg2delta maintain``: many small windows, then compaction, vacuum, checkpoints, changelog expiry.

Every table is read back with delta-rs before and after: maintenance changes no row, and a Delta
version inside the retention still reads as it did.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from changelog_support import changelog_path, changelog_rows, write_config
from conftest import newest_server_only
from engines import TEST_ENGINE
from pg2delta.faults import FAULT_ENV
from pg2delta.maintain import CLOCK_ENV
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import (
    ACCT,
    EVENTS,
    TABLES,
    TableSpec,
    assert_lake_matches,
    cli,
    create_schema,
    lake_rows,
    published_table,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    """The newest server only: maintenance reads and writes only the lake."""
    newest_server_only(pg_server, "maintenance reads and writes only the lake")
    return pgdb


def _source(dsn: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    return slot, pub


def _many_windows(dsn: str, config: Path, transactions: int) -> None:
    """``transactions`` small transactions, applied one window each (``--max-changes 1``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM acct").fetchone()
        assert row is not None
        base = int(row[0])
        for k in range(base, base + transactions):
            conn.execute("INSERT INTO acct (id, name, big) VALUES (%s, %s, %s)", (k, f"n{k}", k))
            conn.execute("INSERT INTO events (kind, n) VALUES (%s, %s)", ("e", k))
            if k % 3 == 0:
                conn.execute("UPDATE acct SET big = big + 1000 WHERE id = %s", (base + (k - base) // 2,))
    done = cli("run", "--config", str(config), "--max-changes", "1", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["windows"] >= transactions


def _files_on_disk(table: Path) -> int:
    return sum(1 for p in table.glob("*.parquet"))


def _sorted_rows(lake: Path, spec: Any, version: int | None = None) -> list[tuple[Any, ...]]:
    got = lake_rows(lake, spec, version=version)
    assert got is not None
    return sorted(got[1], key=repr)


@pytest.mark.classic
def test_maintain_compacts_and_changes_no_row(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, changelog={ACCT.qualified: True}, default=False)
    # Every insert and update is a transaction of its own, a window of its own: about 2.3 windows
    # per transaction here. A classic window costs seconds (a MERGE per table): fewer there.
    transactions = 25 if TEST_ENGINE == "embedded" else 4
    _many_windows(pgdb, config, transactions)
    acct = lake / ACCT.schema / ACCT.name
    active_before = len(DeltaTable(str(acct)).file_uris())
    assert active_before >= transactions
    middle = DeltaTable(str(acct)).version() // 2
    at_middle = _sorted_rows(lake, ACCT, middle)
    before = {spec.qualified: _sorted_rows(lake, spec) for spec in (ACCT, EVENTS)}
    changelog_before = changelog_rows(lake, ACCT)

    done = cli("maintain", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["command"] == "maintain"
    t = report["tables"][ACCT.qualified]
    assert t["files_before"] == active_before and t["files_after"] <= 2, t
    assert len(DeltaTable(str(acct)).file_uris()) == t["files_after"]
    for name in ("_pg2delta/applied_log", f"_pg2delta/changelog/{ACCT.schema}/{ACCT.name}", EVENTS.qualified):
        assert report["tables"][name]["files_after"] < report["tables"][name]["files_before"], name
    # Every table keeps its log as long as VACUUM keeps its files (7 days by default), not Delta's 30.
    assert {name: t["log_retention_set"] for name, t in report["tables"].items()} == {
        name: "interval 7 days" for name in report["tables"]
    }
    assert DeltaTable(str(acct)).metadata().configuration.get("delta.logRetentionDuration") == "interval 7 days"
    if TEST_ENGINE == "embedded":
        # The checkpoint maintain wrote is named by _last_checkpoint, which it leaves: without that
        # hint every later load of the table lists the whole log (bench-year).
        hint = json.loads((acct / "_delta_log" / "_last_checkpoint").read_text())
        assert hint["version"] == DeltaTable(str(acct)).version(), hint
    # No row changed; the version from before is still there (7 days of retention by default).
    assert {spec.qualified: _sorted_rows(lake, spec) for spec in (ACCT, EVENTS)} == before
    assert changelog_rows(lake, ACCT) == changelog_before
    assert _sorted_rows(lake, ACCT, middle) == at_middle
    assert_lake_matches(pgdb, lake)
    # The job goes on on the compacted tables.
    _many_windows(pgdb, config, 3 if TEST_ENGINE == "embedded" else 1)
    assert_lake_matches(pgdb, lake)


def test_vacuum_with_no_retention_removes_old_files(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, default=False)
    config.write_text(config.read_text() + '[maintain]\nretention = "0h"\n')
    _many_windows(pgdb, config, 20)
    acct = lake / ACCT.schema / ACCT.name
    on_disk = _files_on_disk(acct)
    done = cli("maintain", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["tables"][ACCT.qualified]["files_removed"] >= on_disk - 1
    assert _files_on_disk(acct) == len(DeltaTable(str(acct)).file_uris()) <= 2
    assert_lake_matches(pgdb, lake)


def test_maintain_waits_for_a_run_holding_the_lock(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, default=False)
    _many_windows(pgdb, config, 3)
    marker = lake / "_pg2delta" / "maintain.json"
    started = marker.read_text()  # the first run started the clock, and maintained nothing
    assert json.loads(started)["tables"] == {}
    with psycopg.connect(pgdb, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(hashtextextended('pg2delta slot ' || %s, 0))", (slot,))
        busy = cli("maintain", "--config", str(config))
        assert busy.returncode == 73, busy.stderr[-2000:]
        assert "another pg2delta run" in busy.stderr
    assert marker.read_text() == started


def test_killed_during_maintenance_then_again(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, default=False)
    _many_windows(pgdb, config, 15)
    before = {spec.qualified: _sorted_rows(lake, spec) for spec in TABLES if lake_rows(lake, spec) is not None}
    killed = cli("maintain", "--config", str(config), env={FAULT_ENV: "maintain_after_compact"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert {spec.qualified: _sorted_rows(lake, spec) for spec in TABLES if lake_rows(lake, spec) is not None} == before
    again = cli("maintain", "--config", str(config), "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert {spec.qualified: _sorted_rows(lake, spec) for spec in TABLES if lake_rows(lake, spec) is not None} == before
    assert_lake_matches(pgdb, lake)


def test_run_maintains_when_the_interval_has_passed(pgdb: str, tmp_path: Path) -> None:
    """``[maintain] interval``: the run maintains under its own lock; changelog rows past
    ``changelog_retention`` go, later ones stay; leftovers of killed runs leave the staging area."""
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, changelog={ACCT.qualified: True}, default=False)
    _many_windows(pgdb, config, 12)
    assert changelog_rows(lake, ACCT)
    old = lake / "_pg2delta" / "staging" / "crashed-run"
    old.mkdir(parents=True)
    (old / "x.parquet").write_bytes(b"left by a killed run")
    stamp = time.time() - 7200
    os.utime(old, (stamp, stamp))
    # Another slot's folder: its own next run empties it; maintenance takes only what is old there.
    other_old, other_new = (lake / "_pg2delta" / "staging" / "slot-other" / n for n in ("old-run", "live-run"))
    for d in (other_old, other_new):
        d.mkdir(parents=True)
        (d / "x.parquet").write_bytes(b"staged")
    os.utime(other_old, (stamp, stamp))
    # This slot's folder, left by a killed run of it: emptied when the run takes the lock.
    own = lake / "_pg2delta" / "staging" / f"slot-{slot}" / "killed-run"
    own.mkdir(parents=True)
    (own / "x.parquet").write_bytes(b"left by a killed run of this slot")
    time.sleep(1.1)  # the changelog's rows so far are now more than a second old
    # Every table of the lake in this one run (four a run by default).
    config.write_text(config.read_text() + '[maintain]\ninterval = "1h"\nchangelog_retention = "1s"\ntables_per_run = 20\n')
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET name = 'after' WHERE id = 1")
    # The first run started the clock; the scheduler's clock says two hours have passed.
    later = {CLOCK_ENV: "7200"}
    done = cli("run", "--config", str(config), "--json", env=later)
    assert done.returncode == 0, done.stderr[-2000:]
    maintained = json.loads(done.stdout)["maintenance"]
    assert maintained["staging_removed"] == 2 and maintained["tables"][ACCT.qualified]["files_after"] <= 2
    assert not other_old.exists() and other_new.exists() and not own.exists()
    marker = json.loads((lake / "_pg2delta" / "maintain.json").read_text())
    assert marker["finished_at"] > stamp
    assert len(DeltaTable(str(lake / ACCT.schema / ACCT.name)).file_uris()) <= 2
    assert not old.exists()
    # The rows of the first windows are gone; this run's update may be younger than the retention.
    left = changelog_rows(lake, ACCT)
    assert len(left) <= 1 and all(r["name"] == "after" for r in left)
    assert DeltaTable(str(changelog_path(lake, ACCT))).version() >= 1
    # Within the interval the next run does not maintain again.
    again = cli("run", "--config", str(config), "--json", env=later)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["maintenance"] is None
    assert json.loads((lake / "_pg2delta" / "maintain.json").read_text()) == marker
    assert_lake_matches(pgdb, lake)


@pytest.mark.classic
def test_maintain_stops_statistics_of_float_columns_of_an_older_table(
    pgdb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table an earlier version created keeps Delta statistics of its float columns, which pysail
    misreads where a file holds NaN: maintenance makes it keep them of its other columns only."""
    from pg2delta.config import load
    from pg2delta.job import run
    from pg2delta.lake import engine_writes
    from pg2delta.maintain import maintain

    slot, pub = published_table(
        pgdb, "CREATE TABLE fstats (id integer PRIMARY KEY, x double precision, v text)", "fstats",
        "INSERT INTO fstats VALUES (1, 1.5, 'a'), (2, 2.5, 'b')",
    )
    lake = tmp_path / "lake"
    cfg = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
    with monkeypatch.context() as m:  # as earlier versions created tables: statistics of every column
        m.setattr(engine_writes, "stats_properties", lambda schema, exclude=(): {})  # the creating append's too
        run(cfg)
    table = lake / "public" / "fstats"

    def stats_of_x() -> list[bool]:
        """Whether each file added (in the log's JSON commits, oldest first) has statistics of x."""
        adds = [
            json.loads(line)["add"] for commit in sorted((table / "_delta_log").glob("*.json"))
            for line in commit.read_text().splitlines() if '"add"' in line
        ]
        return ["x" in json.loads(a["stats"]).get("minValues", {}) for a in adds]

    assert engine_writes.STATS_COLUMNS not in DeltaTable(str(table)).metadata().configuration
    assert stats_of_x() == [True]
    report = maintain(cfg)
    assert [t.stats_columns_set for t in report.tables if t.name == "public.fstats"] == [True]
    assert DeltaTable(str(table)).metadata().configuration[engine_writes.STATS_COLUMNS] == "`id`,`v`"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO fstats VALUES (3, 'NaN', 'c'), (4, 4.5, 'd')")
    run(cfg)
    assert stats_of_x()[0] and not stats_of_x()[-1]  # the new file has none of x
    got = lake_rows(lake, TableSpec("public", "fstats", ("id",)))
    assert got is not None and sorted(map(repr, got[1])) == sorted(
        map(repr, [(1, 1.5, "a"), (2, 2.5, "b"), (3, float("nan"), "c"), (4, 4.5, "d")])
    )
    assert [t.stats_columns_set for t in maintain(cfg).tables if t.name == "public.fstats"] == [False]


def test_maintain_keeps_the_log_as_long_as_the_files_and_cleans_it_up(pgdb: str, tmp_path: Path) -> None:
    """``[maintain] retention = "2d"``: a table whose log retention is not set gets 2 days, one set
    shorter by someone else is raised to 2 days (with a warning), one the configuration sets keeps
    its own; the commits older than that are removed at the checkpoint, and no row changes."""
    slot, pub = _source(pgdb)
    lake = tmp_path / "lake"
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, default=False)
    config.write_text(config.read_text() + f"""[tables."{EVENTS.qualified}"]
properties = {{ "delta.logRetentionDuration" = "interval 1 day" }}
[maintain]
retention = "2d"
""")
    _many_windows(pgdb, config, 10)
    acct, events = lake / ACCT.schema / ACCT.name, lake / EVENTS.schema / EVENTS.name
    DeltaTable(str(acct)).alter.set_table_properties({"delta.logRetentionDuration": "interval 1 day"})
    first_commit = acct / "_delta_log" / f"{0:020d}.json"
    # The engine's own checkpoint at version 10: commits before a checkpoint older than the log's
    # retention can go (reading a younger version needs a checkpoint at or before it).
    assert first_commit.exists() and (acct / "_delta_log" / f"{10:020d}.checkpoint.parquet").exists()
    three_days_ago = time.time() - 3 * 86400
    for entry in acct.glob("_delta_log/0*"):
        os.utime(entry, (three_days_ago, three_days_ago))
    before = {spec.qualified: _sorted_rows(lake, spec) for spec in (ACCT, EVENTS)}

    done = cli("maintain", "--config", str(config), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    tables = json.loads(done.stdout)["tables"]
    assert tables[ACCT.qualified]["log_retention_set"] == "interval 2 days"
    assert "kept its log for interval 1 day only" in done.stderr and "raised to interval 2 days" in done.stderr
    assert tables[EVENTS.qualified]["log_retention_set"] is None
    assert tables["_pg2delta/applied_log"]["log_retention_set"] == "interval 2 days"

    def retention(table: Path) -> str | None:
        return DeltaTable(str(table)).metadata().configuration.get("delta.logRetentionDuration")

    assert (retention(acct), retention(events)) == ("interval 2 days", "interval 1 day")
    assert retention(lake / "_pg2delta" / "applied_log") == "interval 2 days"
    assert not first_commit.exists(), "the commits older than the log's retention go at the checkpoint"
    assert {spec.qualified: _sorted_rows(lake, spec) for spec in (ACCT, EVENTS)} == before
    assert_lake_matches(pgdb, lake)
    again = cli("maintain", "--config", str(config), "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert all(t["log_retention_set"] is None for t in json.loads(again.stdout)["tables"].values())
