"""SCD2 history (``history = "scd2"``): every version of every key, exactly once, across crashes.

The oracle is computed here, independently of pg2delta's history code, from the changelog (itself
checked against PostgreSQL's audit trail by test_changelog), both read with delta-rs: every change
ends the key's current version and an insert or update opens the next; a truncate ends them all.
The current versions must equal the PostgreSQL table.
"""

from __future__ import annotations

import json
import logging
import random
import signal
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from changelog_support import assert_changelog_matches, changelog_rows, setup_source
from conftest import newest_server_only
from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.apply.history import neighbours_sql, versions_sql, versions_summary_sql, window_versions
from pg2delta.apply.merge import fill_toast_in_order
from pg2delta.config import load
from pg2delta.decode.changes import TruncateEvent
from pg2delta.faults import FAULT_ENV
from pg2delta.job import run
from pg2delta.lake.engine import EngineConfig, Lake
from pg2delta.source.throwaway import ThrowawayPostgres
from pg2delta.status import status
from workload import (
    ACCT,
    EVENTS,
    FULLID,
    PAIR,
    TABLES,
    TableSpec,
    Workload,
    assert_lake_matches,
    assert_same_rows,
    cli,
    confirmed_lsn,
    lsn_int,
    pg_rows,
)

META = (
    "_pg2delta_valid_from_lsn", "_pg2delta_valid_from_pos", "_pg2delta_valid_from",
    "_pg2delta_valid_to_lsn", "_pg2delta_valid_to_pos", "_pg2delta_valid_to",
    "_pg2delta_is_current", "_pg2delta_end_op",
)


@pytest.fixture
def newest_pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    """The newest server only, for the crash tests: what they prove (the history's commit replayed
    exactly once) is the lake's side; the history's versions are compared on every server above."""
    newest_server_only(pg_server, "a crash and its replay are the lake's side")
    return pgdb


def _config(path: Path, dsn: str, slot: str, pub: str, lake: Path, *, max_changes: int, extra: str = "") -> Path:
    path.write_text(
        f'[source]\ndsn = "{dsn}"\nslot = "{slot}"\npublication = "{pub}"\n'
        f'[lake]\nroot = "{lake}"\nchangelog = true\nhistory = "scd2"\n'
        f"[window]\nmax_changes = {max_changes}\n{extra}"
    )
    return path


def _history(lake: Path, spec: TableSpec) -> list[dict[str, Any]]:
    path = lake / spec.schema / f"{spec.name}__history"
    if not (path / "_delta_log").is_dir():
        return []
    return read_delta(str(path)).to_pylist()


def expected_history(lake: Path, spec: TableSpec, names: list[str]) -> list[dict[str, Any]]:
    """The versions the changelog implies, each as a dict of the table's columns and the meta columns."""
    current: dict[tuple[Any, ...], dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None  # the changelog row before, for the new-key half of a key change
    last_values: dict[tuple[Any, ...], dict[str, Any]] = {}

    def end(version: dict[str, Any], r: dict[str, Any], op: str) -> None:
        version.update(
            _pg2delta_valid_to_lsn=r["_pg2delta_lsn"], _pg2delta_valid_to_pos=r["_pg2delta_pos"],
            _pg2delta_valid_to=r["_pg2delta_commit_ts"], _pg2delta_is_current=False, _pg2delta_end_op=op,
        )
        done.append(version)

    for r in changelog_rows(lake, spec):
        op = r["_pg2delta_op"]
        if op == "B":
            continue
        if op == "T":
            for version in current.values():
                end(version, r, "T")
            current.clear()
            previous = r
            continue
        key = tuple(r[k] for k in spec.key) if spec.key else (r["_pg2delta_lsn"], r["_pg2delta_pos"])
        if key in current:
            end(current.pop(key), r, op)
        if op in ("I", "U"):
            values = {n: r.get(n) for n in names}
            before = last_values.get(key)
            if (
                previous is not None and previous["_pg2delta_op"] == "D"
                and previous["_pg2delta_lsn"] == r["_pg2delta_lsn"] and previous["_pg2delta_pos"] == r["_pg2delta_pos"] - 1
            ):  # the new key of a key change: unchanged values are the old key's
                before = last_values.get(tuple(previous[k] for k in spec.key))
            for c in r["_pg2delta_toast"] or []:
                assert before is not None, (spec.qualified, key, c)
                values[c] = before[c]
            last_values[key] = values
            current[key] = {
                **values, "_pg2delta_valid_from_lsn": r["_pg2delta_lsn"], "_pg2delta_valid_from_pos": r["_pg2delta_pos"],
                "_pg2delta_valid_from": r["_pg2delta_commit_ts"], "_pg2delta_valid_to_lsn": None,
                "_pg2delta_valid_to_pos": None, "_pg2delta_valid_to": None, "_pg2delta_is_current": True,
                "_pg2delta_end_op": None,
            }
        previous = r
    return done + list(current.values())


def _order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda v: (v["_pg2delta_valid_from_lsn"], v["_pg2delta_valid_from_pos"]))


def assert_history_matches(dsn: str, lake: Path, spec: TableSpec) -> dict[str, int]:
    """The history of ``spec`` equals the versions its changelog implies, and its current versions
    the PostgreSQL table; returns the versions by how they ended."""
    with psycopg.connect(dsn) as conn:
        names, pg = pg_rows(conn, spec)
    got = _history(lake, spec)
    assert got, f"{spec.qualified}: no history"
    assert set(got[0]) == {*names, *META}, f"{spec.qualified}: history columns {sorted(got[0])}"
    want = expected_history(lake, spec, names)
    ids = [(v["_pg2delta_valid_from_lsn"], v["_pg2delta_valid_from_pos"]) for v in got]
    assert len(set(ids)) == len(ids), f"{spec.qualified}: a version is in the history twice"
    assert len(got) == len(want), f"{spec.qualified}: {len(got)} versions in the history, the changelog implies {len(want)}"
    for g, w in zip(_order(got), _order(want), strict=True):
        diff = [c for c in (*names, *META) if g[c] != w[c]]
        assert not diff, f"{spec.qualified}: version at {ids and (w['_pg2delta_valid_from_lsn'], w['_pg2delta_valid_from_pos'])} differs in {diff}"
    now = [tuple(v[n] for n in names) for v in got if v["_pg2delta_is_current"]]
    assert_same_rows(spec, names, pg, (names, now), f"{spec.qualified} current versions")
    counts: dict[str, int] = {}
    for v in got:
        op = v["_pg2delta_end_op"] or "current"
        counts[op] = counts.get(op, 0) + 1
    return counts


def _explicit_changes(dsn: str) -> None:
    """Every case the random workload may miss: several changes of one key in one transaction, a
    delete and a re-insert of the key, key changes, unchanged TOAST across a key change, a truncate
    then new rows in the same transaction."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO fullid (id, val, body) SELECT g, 'v' || g, repeat('x', 3000) || g FROM generate_series(700001, 700006) g")
        with conn.transaction():
            conn.execute("UPDATE fullid SET val = 'one' WHERE id = 700001")
            conn.execute("UPDATE fullid SET val = 'two' WHERE id = 700001")
            conn.execute("DELETE FROM fullid WHERE id = 700001")
            conn.execute("INSERT INTO fullid (id, val) VALUES (700001, 'again')")
        conn.execute("DELETE FROM fullid WHERE id = 700002")
        conn.execute("INSERT INTO fullid (id, val) VALUES (700002, 're-inserted')")
        conn.execute("UPDATE fullid SET id = 700100 WHERE id = 700003")
        conn.execute(
            "INSERT INTO acct (id, name, body) VALUES "
            "(800001, 'a', (SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 400)))"
        )
        conn.execute("UPDATE acct SET name = 'keeps its toast' WHERE id = 800001")
        conn.execute("UPDATE acct SET id = 800002 WHERE id = 800001")
        conn.execute("UPDATE acct SET name = 'still' WHERE id = 800002")


def _truncate_then_insert(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("UPDATE fullid SET val = 'before the truncate' WHERE id = 700004")
            conn.execute("TRUNCATE fullid, shop.pair")
            conn.execute("INSERT INTO fullid (id, val) VALUES (700004, 'after the truncate'), (1, 'one')")
            conn.execute("UPDATE fullid SET val = 'changed after the truncate' WHERE id = 1")
        conn.execute("INSERT INTO shop.pair (region, n, qty) VALUES ('x', 1, 1)")


@pytest.mark.e2e
def test_history_equals_the_versions(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = load(_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=40), env={})
    with Workload(pgdb, 1515) as wl:
        wl.phase(60)
        run(config)
        wl.phase(60)
        _explicit_changes(pgdb)
        run(config)
        wl.phase(40)
    _truncate_then_insert(pgdb)
    report = run(config)
    assert len(report.windows) > 1
    assert_lake_matches(pgdb, lake, context="with histories")
    # pg2delta status shows each history's Delta version as delta-rs reads it.
    shown = {t["table"]: t["history"] for t in status(config)["tables"]}
    for spec in TABLES:
        dt = DeltaTable(str(lake / spec.schema / f"{spec.name}__history"))
        assert shown[spec.qualified]["delta_version"] == dt.version(), shown[spec.qualified]
        assert shown[spec.qualified]["files"] == len(dt.file_uris()), shown[spec.qualified]
    counts = {spec.qualified: assert_history_matches(pgdb, lake, spec) for spec in TABLES}
    for spec in TABLES:
        assert_changelog_matches(pgdb, lake, spec)
    # The comparison above covered every way a version ends.
    assert counts[ACCT.qualified].get("U") and counts[ACCT.qualified].get("D"), counts
    assert counts[FULLID.qualified].get("T") and counts[PAIR.qualified].get("T"), counts
    assert counts[FULLID.qualified].get("D") and counts[FULLID.qualified].get("current"), counts
    assert set(counts[EVENTS.qualified]) <= {"T", "current"}, counts
    # Spelled out for the explicit changes: each change of 700001 in one transaction its own version.
    mine = _order([v for v in _history(lake, FULLID) if v["id"] == 700001])
    assert [v["val"] for v in mine][:4] == ["v700001", "one", "two", "again"]
    assert [v["_pg2delta_end_op"] for v in mine][:3] == ["U", "U", "D"]
    assert len({v["_pg2delta_valid_from_lsn"] for v in mine[1:4]}) == 1
    # The TOASTed body, sent once, is in every version, across the key change (old key ended by D).
    moved = _order([v for v in _history(lake, ACCT) if v["id"] in (800001, 800002)])
    assert [v["id"] for v in moved] == [800001, 800001, 800002, 800002]
    assert len({v["body"] for v in moved}) == 1 and len(moved[0]["body"] or "") == 12800
    assert [v["_pg2delta_end_op"] for v in moved][:3] == ["U", "D", "U"] and moved[3]["_pg2delta_end_op"] in (None, "T")


SPILL = "memory_budget = 1\nsplit_rows = 7\n"  # every decoded chunk spills, transactions in parts of 7 rows


def _two_lakes(
    dsn: str, tmp_path: Path, *, spilled: str, other: str, max_changes: int = 40, spill: bool = True
) -> tuple[str, Path, Path, Path, Path]:
    """A source, two slots created together, and a config for each (the first spills every window
    unless not ``spill``): the same changes applied twice. Returns the first slot, the two lakes and
    the two configs."""
    slot, pub = setup_source(dsn)
    second = f"slot_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (second,))
    lake_a, lake_b = tmp_path / spilled, tmp_path / other
    conf_a = _config(tmp_path / "a.toml", dsn, slot, pub, lake_a, max_changes=max_changes, extra=SPILL if spill else "")
    conf_b = _config(tmp_path / "b.toml", dsn, second, pub, lake_b, max_changes=max_changes)
    return slot, lake_a, lake_b, conf_a, conf_b


def _assert_same_histories(dsn: str, lake_a: Path, lake_b: Path, what: str) -> dict[str, dict[str, int]]:
    """Both lakes equal PostgreSQL, their histories equal the changelog's versions and each other, row for row."""
    counts = {}
    for lake in (lake_a, lake_b):
        assert_lake_matches(dsn, lake, context=what)
        counts = {spec.qualified: assert_history_matches(dsn, lake, spec) for spec in TABLES}
    for spec in TABLES:
        a, b = _order(_history(lake_a, spec)), _order(_history(lake_b, spec))
        assert a and a == b, f"{spec.qualified}: {what}: the histories differ"
    return counts


@pytest.mark.e2e
def test_spilled_history_equals_in_memory(pgdb: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Windows spilled past window.memory_budget get the history the in-memory path gives: key
    changes, deletes and re-inserts, several changes of a key in one transaction, unchanged TOAST
    (across a key change too), a truncate in the middle of a window with changes on both sides."""
    _, spilled_lake, memory_lake, spilled, memory = _two_lakes(pgdb, tmp_path, spilled="spilled", other="memory")
    reports = []
    with Workload(pgdb, 4242) as wl:
        wl.phase(50)
        _explicit_changes(pgdb)
        wl.phase(30)
    _truncate_then_insert(pgdb)
    with caplog.at_level(logging.INFO, logger="pg2delta.apply.history"):
        reports.append(run(load(spilled, env={})))
    engine_side = [r for r in caplog.records if "computed by the engine" in r.getMessage()]
    reports.append(run(load(memory, env={})))
    assert sum(w.spilled_rows for w in reports[0].windows) > 0, "the small budget spilled nothing"
    assert len(engine_side) >= len(TABLES), "the spilled windows' versions were not computed by the engine"
    assert not any(w.spilled_rows for w in reports[1].windows)
    assert len(reports[0].windows) > 1
    counts = _assert_same_histories(pgdb, spilled_lake, memory_lake, "spilled and in memory")
    assert counts[ACCT.qualified].get("U") and counts[ACCT.qualified].get("D"), counts
    assert counts[FULLID.qualified].get("T") and counts[FULLID.qualified].get("current"), counts
    # The TOASTed body, sent once, is in every version across the key change, in the spilled lake too.
    moved = _order([v for v in _history(spilled_lake, ACCT) if v["id"] in (800001, 800002)])
    assert [v["id"] for v in moved] == [800001, 800001, 800002, 800002]
    assert len({v["body"] for v in moved}) == 1 and len(moved[0]["body"] or "") == 12800


@pytest.mark.e2e
@pytest.mark.parametrize("point", ["after_spill", "after_history"])
def test_crash_in_a_spilled_window_then_rerun(newest_pgdb: str, tmp_path: Path, point: str) -> None:
    """A run killed at ``point`` in a spilled window, then run again: the history equals an uncrashed
    in-memory lake's (each window still one commit to it, nothing twice, nothing lost)."""
    pgdb = newest_pgdb
    slot, crashed_lake, clean_lake, crashed, clean = _two_lakes(pgdb, tmp_path, spilled="crashed", other="clean")
    with Workload(pgdb, 5150 + len(point)) as wl:
        wl.phase(40)
        run(load(crashed, env={}))
        wl.phase(40)
    _explicit_changes(pgdb)
    _truncate_then_insert(pgdb)
    before = confirmed_lsn(pgdb, slot)
    proc = cli("run", "--config", str(crashed), env={FAULT_ENV: point})
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
    assert confirmed_lsn(pgdb, slot) == before, f"the slot moved although the run died at {point}"
    history = _history(crashed_lake, FULLID)
    if point == "after_history":  # the window's versions committed, the tables' MERGEs not
        assert any(v["_pg2delta_valid_from_lsn"] > lsn_int(before) for v in history if v["_pg2delta_valid_from_pos"] >= 0)
    again = cli("run", "--config", str(crashed), "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["spilled_rows"] > 0
    run(load(clean, env={}))
    _assert_same_histories(pgdb, crashed_lake, clean_lake, f"crash at {point}")


POINTS = ["after_changelog", "after_history", "between_tables", "before_advance"]


# Embedded only: on Apache Spark one such run takes minutes (a MERGE into the table, its history and
# changelog per window of 30 changes), past the classic tier's time; the history's MERGE and its
# engine-side versions are on Apache Spark in test_added_column_and_resync and
# test_engine_versions_equal_the_in_memory_ones, and a crash between the tables' commits in
# tests/test_job_faults.py.
@pytest.mark.e2e
@pytest.mark.parametrize("point", POINTS)
def test_crash_then_rerun_gives_the_same_history(newest_pgdb: str, tmp_path: Path, point: str) -> None:
    """Two lakes from two slots created together: one run killed at ``point`` then run again, one
    never killed; their histories are identical, and both equal the versions the changelog implies."""
    pgdb = newest_pgdb
    slot, crashed_lake, clean_lake, crashed, clean = _two_lakes(
        pgdb, tmp_path, spilled="crashed", other="clean", max_changes=30, spill=False
    )
    with Workload(pgdb, 900 + POINTS.index(point)) as wl:
        wl.phase(40)
        run(load(crashed, env={}))
        wl.phase(50)
    _explicit_changes(pgdb)
    _truncate_then_insert(pgdb)
    before = confirmed_lsn(pgdb, slot)
    proc = cli("run", "--config", str(crashed), env={FAULT_ENV: point})
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr[-2000:])
    assert confirmed_lsn(pgdb, slot) == before, f"the slot moved although the run died at {point}"
    again = cli("run", "--config", str(crashed))
    assert again.returncode == 0, again.stderr[-2000:]
    run(load(clean, env={}))
    for lake in (crashed_lake, clean_lake):
        assert_lake_matches(pgdb, lake, context=f"crash at {point}")
        for spec in TABLES:
            assert_history_matches(pgdb, lake, spec)
    for spec in TABLES:
        a, b = _order(_history(crashed_lake, spec)), _order(_history(clean_lake, spec))
        assert a == b, f"{spec.qualified}: the history after a crash at {point} differs from an uncrashed run's"


DV = TableSpec("public", "dv", ("id",))


@pytest.mark.e2e
@pytest.mark.classic
def test_added_column_and_resync(pgdb: str, tmp_path: Path) -> None:
    """A column added in the source appears in the history (older versions NULL); ``pg2delta resync``
    ends every current version (``R``, at the copy's LSN) and opens one per copied row."""
    lake = tmp_path / "lake"
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE dv (id int PRIMARY KEY, a text, n int)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE dv")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO dv SELECT g, 'row ' || g, g FROM generate_series(1, 100) g")
    config = str(_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=1000))

    def ok(*args: str) -> None:
        done = cli(*args, "--config", config)
        assert done.returncode == 0, (args, done.stderr[-2000:])

    ok("run")
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE dv SET n = n + 1000 WHERE id <= 5")
        conn.execute("DELETE FROM dv WHERE id = 6")
        conn.execute("ALTER TABLE dv ADD COLUMN d int DEFAULT 5")
        conn.execute("ALTER TABLE dv ADD COLUMN c int")
        conn.execute("UPDATE dv SET c = 7 WHERE id = 1")
    ok("run")
    assert_lake_matches(pgdb, lake, [DV])
    added = _history(lake, DV)
    assert len(added) == 100 + 5 + 1
    assert [v["c"] for v in added if v["id"] == 1 and v["_pg2delta_is_current"]] == [7]
    assert all(v["c"] is None for v in added if v["id"] != 1 or not v["_pg2delta_is_current"])
    # PostgreSQL's value for rows written before the ADD COLUMN ... DEFAULT, in every version as in the table.
    assert {v["d"] for v in added} == {5}
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ALTER TABLE dv ADD COLUMN u text DEFAULT gen_random_uuid()::text")
        conn.execute("UPDATE dv SET n = -n WHERE id <= 10")
    refused = cli("run", "--config", config)
    assert refused.returncode == 78, refused.stderr[-2000:]
    ok("resync", "--table", "public.dv")
    copies = [r for r in read_delta(str(lake / "_pg2delta" / "applied_log")).to_pylist()
              if r["kind"] == "bootstrap" and r["table_name"] == "dv"]
    at = max(r["window_end"] for r in copies)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE dv SET a = 'after' WHERE id = 20")
    ok("run")
    assert_lake_matches(pgdb, lake, [DV])
    got = _history(lake, DV)
    ids = [(v["id"], v["_pg2delta_valid_from_lsn"], v["_pg2delta_valid_from_pos"]) for v in got]
    assert len(set(ids)) == len(ids)
    before = [v for v in got if v["_pg2delta_valid_from_lsn"] < at]
    copy = [v for v in got if v["_pg2delta_valid_from_lsn"] == at and v["_pg2delta_valid_from_pos"] == -1]
    after = [v for v in got if v["_pg2delta_valid_from_lsn"] > at]
    assert len(before) + len(copy) + len(after) == len(got)
    # What was current at the resync ended there, the rest as before.
    assert sorted(v["id"] for v in before if v["_pg2delta_end_op"] == "R") == sorted(set(range(1, 101)) - {6})
    assert all(v["_pg2delta_valid_to_lsn"] == at for v in before if v["_pg2delta_end_op"] == "R")
    assert not any(v["_pg2delta_is_current"] for v in before) and all(v["u"] is None for v in before)
    # The copy: one version per row, with the added column's values; the one update after it ends one.
    assert sorted(v["id"] for v in copy) == sorted(set(range(1, 101)) - {6})
    assert all(v["u"] is not None for v in copy)
    assert [(v["id"], v["_pg2delta_end_op"]) for v in copy if not v["_pg2delta_is_current"]] == [(20, "U")]
    assert [(v["id"], v["a"], v["_pg2delta_is_current"]) for v in after] == [(20, "after", True)]
    with psycopg.connect(pgdb) as conn:
        names, pg = pg_rows(conn, DV)
    assert_same_rows(DV, names, pg, (names, [tuple(v[n] for n in names) for v in got if v["_pg2delta_is_current"]]), "dv")


# --- the window's versions, without a server -----------------------------------------------------


def _changes(rows: list[tuple[int, int, str, int, str | None]]) -> pa.Table:
    """(lsn, pos, op, id, v) rows as a window's changes (commit time = lsn)."""
    return pa.table({
        "id": pa.array([r[3] for r in rows], pa.int32()),
        "v": pa.array([r[4] for r in rows], pa.string()),
        "_pg2delta_lsn": pa.array([r[0] for r in rows], pa.int64()),
        "_pg2delta_pos": pa.array([r[1] for r in rows], pa.int64()),
        "_pg2delta_op": pa.array([r[2] for r in rows], pa.string()),
        "_pg2delta_commit_ts": pa.array([r[0] for r in rows], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    })


def _by_action(table: pa.Table | None) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    assert table is not None
    rows = table.to_pylist()
    opened = [(r["id"], r["v"], r["_pg2delta_valid_from_lsn"], r["_pg2delta_valid_to_lsn"], r["_pg2delta_end_op"],
               r["_pg2delta_is_current"]) for r in rows if r["__pg2delta_action"] == "open"]
    closed = [(r["id"], r["_pg2delta_valid_to_lsn"], r["_pg2delta_end_op"]) for r in rows if r["__pg2delta_action"] == "close"]
    return opened, closed


def test_versions_of_one_window() -> None:
    changes = _changes([
        (10, 1, "U", 1, "a"), (10, 3, "U", 1, "b"),  # two versions in one transaction; the first ends the lake's
        (20, 1, "D", 2, None), (30, 1, "I", 2, "again"),  # delete, then the key inserted again
        (40, 2, "D", 3, None), (40, 3, "U", 4, "moved"),  # key change 3 -> 4
        (50, 1, "D", 5, None),  # a key the window never opened: ends the lake's version only
    ])
    opened, closed = _by_action(window_versions(changes, [], ["id"], ["id", "v"])[0])
    assert opened == [
        (1, "a", 10, 10, "U", False), (1, "b", 10, None, None, True),
        (2, "again", 30, None, None, True), (4, "moved", 40, None, None, True),
    ]
    assert closed == [(1, 10, "U"), (2, 20, "D"), (3, 40, "D"), (4, 40, "U"), (5, 50, "D")]


def test_versions_around_a_truncate() -> None:
    changes = _changes([(10, 1, "U", 1, "a"), (30, 1, "I", 1, "new"), (30, 2, "I", 2, "x")])
    truncate = TruncateEvent(20, 1, (), 0, 7, 20)
    rows, first = window_versions(changes, [truncate], ["id"], ["id", "v"])
    opened, closed = _by_action(rows)
    # The update ends the lake's version of 1; the truncate ends the update's and every other (MERGE).
    assert opened == [(1, "a", 10, 20, "T", False), (1, "new", 30, None, None, True), (2, "x", 30, None, None, True)]
    assert closed == [(1, 10, "U")] and first is truncate
    # Nothing but a truncate: no rows, the MERGE ends every current version.
    assert window_versions(None, [truncate], ["id"], []) == (None, truncate)


def test_versions_without_a_key() -> None:
    changes = _changes([(10, 1, "I", 1, "a"), (10, 2, "I", 1, "a")])
    opened, closed = _by_action(window_versions(changes, [], [], ["id", "v"])[0])
    assert [o[5] for o in opened] == [True, True] and not closed  # the same values twice: two rows


# --- a spilled window's versions by the engine, against the in-memory ones ------------------------

_KEYS = range(1, 10)


def _random_window(seed: int) -> tuple[pa.Table, list[TruncateEvent], dict[int, dict[str, Any]]]:
    """A window of random transactions on keys 1..9 (inserts, updates, some with the body sent as
    unchanged TOAST, key changes, deletes, truncates) and the lake's rows before it."""
    rng = random.Random(seed)
    lake = {k: {"id": k, "v": f"lake{k}", "body": f"lake body {k}"} for k in rng.sample(list(_KEYS), 4)}
    live = {k: dict(r) for k, r in lake.items()}
    rows: list[tuple[int, int, str, dict[str, Any], list[str] | None]] = []
    truncates: list[TruncateEvent] = []
    lsn = 1000
    for _ in range(rng.randint(4, 12)):
        lsn += rng.randint(1, 50)
        for i in range(rng.randint(1, 6)):
            pos, r = 2 * i + 1, rng.random()
            absent = [k for k in _KEYS if k not in live]
            if r < 0.07:
                truncates.append(TruncateEvent(lsn, pos, (), 0, 7, lsn * 1000))
                live.clear()
            elif absent and (not live or r < 0.35):
                k = rng.choice(absent)
                live[k] = {"id": k, "v": f"i{lsn}.{pos}", "body": f"b{lsn}.{pos}"}
                rows.append((lsn, pos, "I", dict(live[k]), None))
            elif r < 0.75:
                k = rng.choice(sorted(live))
                old = live.pop(k)
                toast = rng.random() < 0.6
                new = rng.choice(absent) if absent and rng.random() < 0.3 else k
                if new != k:  # PostgreSQL's key change: the old key's delete just before the update
                    rows.append((lsn, pos - 1, "D", {"id": k, "v": None, "body": None}, None))
                row = {"id": new, "v": f"u{lsn}.{pos}", "body": None if toast else f"b{lsn}.{pos}"}
                rows.append((lsn, pos, "U", row, ["body"] if toast else None))
                live[new] = {**row, "body": old["body"] if toast else row["body"]}
            else:
                k = rng.choice(sorted(live))
                del live[k]
                rows.append((lsn, pos, "D", {"id": k, "v": None, "body": None}, None))
    table = pa.table({
        "id": pa.array([r[3]["id"] for r in rows], pa.int32()),
        "v": pa.array([r[3]["v"] for r in rows], pa.string()),
        "body": pa.array([r[3]["body"] for r in rows], pa.string()),
        "_pg2delta_lsn": pa.array([r[0] for r in rows], pa.int64()),
        "_pg2delta_pos": pa.array([r[1] for r in rows], pa.int64()),
        "_pg2delta_op": pa.array([r[2] for r in rows], pa.string()),
        "_pg2delta_toast": pa.array([r[4] for r in rows], pa.list_(pa.string())),
        "_pg2delta_commit_ts": pa.array([r[0] * 1000 for r in rows], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    })
    return table, truncates, lake


def _in_memory(changes: pa.Table, truncates: list[TruncateEvent], lake: dict[int, dict[str, Any]], since: int) -> pa.Table | None:
    """What the run computes in memory (job.py ``_write_history``): TOAST filled from the window, then
    from the lake's rows; the changes from ``since`` on made into versions."""
    filled = fill_toast_in_order(changes, ["id"])
    body = filled.table.column("body").to_pylist()
    for lk in filled.lookups:
        body[lk.row] = lake[int(str(lk.key[0]))]["body"]
    table = filled.table.set_column(filled.table.column_names.index("body"), "body", pa.array(body, pa.string()))
    table = table.filter(pc.greater_equal(table.column("_pg2delta_lsn"), since))
    return window_versions(table, [t for t in truncates if t.commit_lsn >= since], ["id"], ["id", "v", "body"])[0]


def _plain(table: pa.Table | None) -> list[dict[str, Any]]:
    """Rows with timestamps as microseconds (Parquet from the engine may hold them in another unit)."""
    if table is None:
        return []
    cols = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.timestamp("us", tz=col.type.tz)).cast(pa.int64())
        cols[name] = col
    return sorted(pa.table(cols).to_pylist(), key=repr)


# Two windows on Apache Spark (a few seconds each there), which hold every way a version ends, a
# key moved by a key change into a key a truncate emptied, and unchanged TOAST; twelve on pysail.
SEEDS = (0, 1) if TEST_ENGINE == "spark" else tuple(range(12))


@pytest.mark.e2e
@pytest.mark.classic
def test_engine_versions_equal_the_in_memory_ones(tmp_path: Path, shared_engine: Any) -> None:
    """The versions of random windows computed by the engine (a spilled window's way: Spark SQL over
    staged changes, unchanged TOAST filled there, the lake's rows read as of a version) equal the
    in-memory ones row for row, also when a replay takes only the changes past the history's end."""
    lake = Lake(str(tmp_path / "lake"))
    engine = shared_engine.start(EngineConfig(), lake)
    checked = {"current": 0, "U": 0, "D": 0, "T": 0, "toast": 0, "close": 0}
    for seed in SEEDS:
        changes, truncates, before = _random_window(seed)
        table_uri = lake.table_uri("public", f"t{seed}")
        write_deltalake(table_uri, pa.Table.from_pylist(list(before.values()), schema=pa.schema(
            [("id", pa.int32()), ("v", pa.string()), ("body", pa.string())])))
        lsns = sorted(set(changes.column("_pg2delta_lsn").to_pylist()))
        for since in (0, lsns[len(lsns) // 2]):
            work = f"w{seed}-{since}"
            lake.stage(changes, f"{work}/changes/part-000000")
            ordered = sorted(truncates, key=lambda t: (t.commit_lsn, t.pos))
            kept = [t for t in ordered if t.commit_lsn >= since]
            out, summary = engine.stage_filled(
                table_uri, lake.staging_uri(f"{work}/changes"),
                [lambda view, s=since, k=kept: neighbours_sql(view, ["id"], k, s),
                 lambda view, k=kept: versions_sql(view, ["id"], ["id", "v", "body"], k)],
                versions_summary_sql, out=f"{work}/out", work=f"{work}/work", key_names=["id"],
                data_columns=["id", "v", "body"], toast_columns=("body",), lookup_version=0, nullable_keys=False,
                truncates=[(t.commit_lsn, t.pos) for t in truncates],
            )
            got = _plain(pq.read_table(out))
            want = _plain(_in_memory(changes, truncates, before, since))
            assert got == want, (seed, since)
            assert (summary["opened"] or 0) == sum(1 for r in want if r["__pg2delta_action"] == "open")
            for r in want:
                checked[r["_pg2delta_end_op"] or "current"] += 1
                checked["close"] += r["__pg2delta_action"] == "close"
            checked["toast"] += sum(1 for t in changes.column("_pg2delta_toast").to_pylist() if t)
    assert all(checked.values()), checked  # every way a version ends, unchanged TOAST and closes were compared


def test_versions_of_a_nan_key() -> None:
    """A float key holding NaN is one key, as in PostgreSQL: its second version ends the first."""
    nan = float("nan")
    changes = _changes([(10, 1, "U", 1, "a"), (10, 3, "U", 1, "b"), (20, 1, "D", 1, None)])
    changes = changes.set_column(0, "id", pa.array([nan, float("nan"), float("nan")], pa.float64()))
    opened, closed = _by_action(window_versions(changes, [], ["id"], ["id", "v"])[0])
    assert [o[1:] for o in opened] == [("a", 10, 10, "U", False), ("b", 10, 20, "D", False)]
    assert [c[1:] for c in closed] == [(10, "U")]  # the version current before the window
