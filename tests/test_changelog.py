"""The changelog: every change of a changelog table, in the lake, exactly once.

The oracle is PostgreSQL's own audit trail (triggers writing each change to a table outside the
publication, see ``changelog_support.py``); the changelog is read with delta-rs.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from changelog_support import (
    assert_changelog_matches,
    changelog_path,
    changelog_rows,
    setup_source,
    write_config,
)
from lake_read import read_delta
from pg2delta.faults import FAULT_ENV
from workload import ACCT, EVENTS, FULLID, PAIR, TABLES, Workload, assert_lake_matches, cli, confirmed_lsn

pytestmark = pytest.mark.e2e


def _run(config: Path, *extra: str, env: dict[str, str] | None = None) -> None:
    proc = cli("run", "--config", str(config), *extra, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_changelog_equals_the_changes(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=40)
    with Workload(pgdb, 4242) as wl:
        wl.phase(60)
        _run(config)
        wl.phase(60)
    with psycopg.connect(pgdb, autocommit=True) as conn:  # every kind of change, whatever the seed did
        conn.execute("INSERT INTO fullid (id, val, body) SELECT g, 'v' || g, repeat('x', g) FROM generate_series(900001, 900006) g")
        conn.execute("UPDATE fullid SET val = 'changed' WHERE id BETWEEN 900001 AND 900003")
        conn.execute("UPDATE fullid SET id = 900100 WHERE id = 900004")
        conn.execute("DELETE FROM fullid WHERE id = 900005")
        _run(config)
        conn.execute("TRUNCATE shop.pair, fullid")
        conn.execute("INSERT INTO fullid (id, val) VALUES (1, 'after the truncate')")
    _run(config)
    assert_lake_matches(pgdb, lake, context="with changelogs")
    counts = {spec.qualified: assert_changelog_matches(pgdb, lake, spec) for spec in TABLES}
    # The workload did every kind of change, so the comparison above covered them all.
    assert counts[ACCT.qualified]["U"] and counts[ACCT.qualified]["D"] and counts[ACCT.qualified]["I"]
    assert counts[FULLID.qualified]["D"] and counts[FULLID.qualified]["B"] and counts[PAIR.qualified]["U"]
    assert counts[PAIR.qualified]["T"] and counts[FULLID.qualified]["T"], counts
    assert not (counts[EVENTS.qualified].keys() - {"I", "T"})
    assert not counts[ACCT.qualified]["B"] and not counts[PAIR.qualified]["B"]  # old rows only under FULL
    # The changelog log names every window that changed a changelog table.
    log = read_delta(str(lake / "_pg2delta" / "changelog_log")).to_pylist()
    applied = read_delta(str(lake / "_pg2delta" / "applied_log")).to_pylist()
    logged = {(r["run_id"], r["window_end"], r["table_name"]) for r in log}
    assert {(r["run_id"], r["window_end"], r["table_name"]) for r in applied} <= logged


def test_changelog_only_where_configured(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, default=False, changelog={ACCT.qualified: True})
    with Workload(pgdb, 77) as wl:
        wl.phase(40)
    _run(config)
    assert_lake_matches(pgdb, lake)
    assert changelog_rows(lake, ACCT)
    assert_changelog_matches(pgdb, lake, ACCT)
    for spec in (PAIR, FULLID, EVENTS):
        assert not changelog_path(lake, spec).exists(), spec.qualified


def test_changelog_follows_new_columns(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO acct (id, name) VALUES (1, 'a'), (2, 'b')")
    _run(config)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ALTER TABLE acct ADD COLUMN extra integer")
        conn.execute("UPDATE acct SET extra = 7 WHERE id = 2")
        conn.execute("INSERT INTO acct (id, name, extra) VALUES (3, 'c', 9)")
    _run(config)
    rows = changelog_rows(lake, ACCT)
    assert [(r["id"], r["_pg2delta_op"], r["extra"]) for r in rows] == [(1, "I", None), (2, "I", None), (2, "U", 7), (3, "I", 9)]
    assert_changelog_matches(pgdb, lake, ACCT)


@pytest.mark.parametrize("point", ["after_changelog", "between_tables", "before_advance"])
def test_replayed_window_adds_nothing_twice(pgdb: str, tmp_path: Path, point: str) -> None:
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake)
    with Workload(pgdb, 900 + len(point)) as wl:
        wl.phase(30)
        _run(config)
        wl.phase(50)
    before = confirmed_lsn(pgdb, slot)
    first = sum(len(changelog_rows(lake, spec)) for spec in TABLES)
    crashed = cli("run", "--config", str(config), env={FAULT_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, (point, crashed.returncode, crashed.stderr[-2000:])
    assert confirmed_lsn(pgdb, slot) == before, "the slot moved although the run died"
    # The crashed run did commit its changelog rows: the replay must not add them again.
    assert sum(len(changelog_rows(lake, spec)) for spec in TABLES) > first
    again = cli("run", "--config", str(config))
    assert again.returncode == 0, again.stderr[-3000:]
    assert confirmed_lsn(pgdb, slot) != before
    assert_lake_matches(pgdb, lake, context=f"after a crash at {point}")
    for spec in TABLES:
        assert_changelog_matches(pgdb, lake, spec)
