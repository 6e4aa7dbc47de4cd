"""``pg2delta versions --at-lsn``: the Delta version of each table that holds the source's state at an LSN.

The oracle is PostgreSQL's own snapshot at that LSN: a temporary logical slot created with an
exported snapshot gives a consistent point X and a snapshot holding exactly the transactions whose
commit record starts before X; the tables are read in that snapshot while its replication connection
stays open, and later compared with the Delta tables read by delta-rs at the versions the CLI prints.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql

from engines import SharedEngine
from pg2delta.config import load
from pg2delta.errors import LakeError
from pg2delta.job import run
from pg2delta.lake.engine import Lake
from pg2delta.lsn import format_lsn, parse_lsn
from pg2delta.versions import (
    COPIED_AGAIN,
    EXACT,
    INSIDE_WINDOW,
    NOT_APPLIED,
    NOT_IN_LAKE,
    open_at_lsn,
    versions,
    versions_at,
)
from workload import (
    TABLES,
    TableSpec,
    Workload,
    assert_same_rows,
    cli,
    confirmed_lsn,
    create_schema,
    lake_rows,
    pg_rows,
)

# --- the rule, on applied-log rows written by hand -------------------------------------------------

SLOT = "s"


def _window(start: int, end: int, version: int | None, table: str = "t", oid: int = 1) -> dict[str, Any]:
    return {
        "slot": SLOT, "window_start": start, "window_end": end, "relation_oid": oid, "schema_name": "public",
        "table_name": table, "delta_version": version, "kind": "window",
    }


def _copy(lsn: int, version: int, table: str = "t", oid: int = 1) -> dict[str, Any]:
    return {**_window(lsn, lsn, version, table, oid), "kind": "bootstrap"}


def _start(lsn: int) -> dict[str, Any]:
    return {
        "slot": SLOT, "window_start": lsn, "window_end": lsn, "relation_oid": None, "schema_name": None,
        "table_name": None, "delta_version": None, "kind": "bootstrap",
    }


def _at(rows: list[dict[str, Any]], lsn: int, table: str = "t", confirmed: int | None = None) -> tuple[str, int | None]:
    report = versions_at(rows, SLOT, lsn, slot_confirmed=confirmed)
    [t] = [t for t in report.tables if t.table == table]
    return t.status, t.delta_version


def test_rule_bootstrapped_lake() -> None:
    # bootstrap at 100 (version 0), windows [100, 200) -> 1 and [300, 400) -> 2; another table's window to 500
    rows = [_start(100), _copy(100, 0), _window(100, 200, 1), _window(300, 400, 2), _window(400, 500, 7, "u", 2)]
    assert _at(rows, 99) == (NOT_IN_LAKE, None)
    assert _at(rows, 100) == (EXACT, 0)
    assert _at(rows, 150) == (INSIDE_WINDOW, None)
    assert _at(rows, 200) == (EXACT, 1)
    assert _at(rows, 250) == (EXACT, 1)  # no window of the table in [200, 300)
    assert _at(rows, 300) == (EXACT, 1)
    assert _at(rows, 301) == (INSIDE_WINDOW, None)
    assert _at(rows, 400) == (EXACT, 2)
    assert _at(rows, 500) == (EXACT, 2)  # the lake is applied through 500 (the other table's window)
    assert _at(rows, 501) == (NOT_APPLIED, None)
    assert _at(rows, 900, confirmed=900) == (EXACT, 2)  # the slot says windows up to 900 were applied
    report = versions_at(rows, SLOT, 150)
    [t] = [t for t in report.tables if t.table == "t"]
    assert t.window == (100, 200) and not report.exact
    assert versions_at(rows, "other slot", 150).tables == []


def test_rule_replayed_windows_resync_and_no_commit() -> None:
    # a window replayed larger after a crash: its changes before 200 were applied by the first
    rows = [_start(100), _copy(100, 0), _window(100, 200, 1), _window(100, 300, 2)]
    assert _at(rows, 200) == (EXACT, 1)
    assert _at(rows, 250) == (INSIDE_WINDOW, None)
    # a resync at 600 (the slot at 400): what the table did in (400, 600) is unknown
    rows = [_start(100), _copy(100, 0), _window(300, 400, 1), _copy(600, 2), _window(500, 700, 3), _window(700, 800, 9, "u", 2)]
    assert _at(rows, 400) == (EXACT, 1)
    assert _at(rows, 450) == (COPIED_AGAIN, None)
    assert _at(rows, 600) == (EXACT, 2)
    assert _at(rows, 650) == (INSIDE_WINDOW, None)  # the window after the copy holds only changes from 600
    assert _at(rows, 550) == (COPIED_AGAIN, None)
    assert _at(rows, 750) == (EXACT, 3)
    # a window logged without a commit (its changes all before the table's copy): the version before holds
    rows = [_start(100), _copy(150, 4), _window(100, 200, None)]
    assert _at(rows, 120) == (NOT_IN_LAKE, None)
    assert _at(rows, 150) == (EXACT, 4)
    assert _at(rows, 200) == (EXACT, 4)
    # a lake without a bootstrap: the table exists from the end of its first window
    rows = [_window(100, 200, 0), _window(200, 300, 1)]
    assert _at(rows, 100) == (NOT_IN_LAKE, None)
    assert _at(rows, 200) == (EXACT, 0)


# --- end to end: versions against PostgreSQL's snapshots ------------------------------------------

CALM = TableSpec("public", "calm", ("id",))  # changes once, late: exact at LSNs inside other tables' windows


def _snapshot_at_new_slot(dsn: str, tables: list[TableSpec]) -> tuple[str, dict[str, tuple[list[str], list[Any]]]]:
    """A temporary slot's consistent point X, and every table's rows in the snapshot it exported."""
    name = f"snap_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True, replication="database") as repl:
        res = repl.pgconn.exec_(f"CREATE_REPLICATION_SLOT {name} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')".encode())
        assert res.status == pq.ExecStatus.TUPLES_OK, res.error_message
        fields = {bytes(res.fname(i) or b"").decode(): bytes(res.get_value(0, i) or b"").decode() for i in range(res.nfields)}
        point, snapshot = fields["consistent_point"], fields["snapshot_name"]
        rows: dict[str, tuple[list[str], list[Any]]] = {}
        with psycopg.connect(dsn, autocommit=True) as conn:  # while the exporting connection is open
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot)))
            for spec in tables:
                rows[spec.qualified] = pg_rows(conn, spec)
            conn.execute("COMMIT")
    return format_lsn(parse_lsn(point)), rows


def _versions(lake: Path, lsn: str, *args: str) -> dict[str, Any]:
    done = cli("versions", "--lake", str(lake), "--at-lsn", lsn, "--json", *args)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["schema_version"] == 1 and report["at_lsn"] == lsn
    return report


def _assert_state(lake: Path, report: dict[str, Any], snapshot: dict[str, tuple[list[str], list[Any]]], specs: list[TableSpec]) -> int:
    """The exact tables of ``report`` at their versions equal the snapshot's rows; returns how many were exact."""
    exact = 0
    for spec in specs:
        t = report["tables"][spec.qualified]
        if t["status"] != EXACT:
            assert t["delta_version"] is None
            continue
        exact += 1
        names, pg = snapshot[spec.qualified]
        got = lake_rows(lake, spec, version=t["delta_version"])
        assert_same_rows(spec, names, pg, got, f"{spec.qualified} at {report['at_lsn']} (version {t['delta_version']})")
    return exact


def test_versions_hold_the_snapshots_of_the_source(pgdb: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    lake = tmp_path / "lake"
    specs = [*TABLES, CALM]
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE calm (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO calm SELECT g, 'v' || g FROM generate_series(1, 5) g")
        conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE calm").format(sql.Identifier(pub)))
    db = ["--dsn", pgdb, "--slot", slot, "--publication", pub]
    common = [*db, "--lake", str(lake)]
    points: dict[str, dict[str, tuple[list[str], list[Any]]]] = {}
    with Workload(pgdb, 977) as wl:
        wl.phase(25)
        boot = cli("bootstrap", *common, "--json")
        assert boot.returncode == 0, boot.stderr[-2000:]
        booted = json.loads(boot.stdout)
        wl.phase(30)
        p1, points["p1"] = _snapshot_at_new_slot(pgdb, specs)
        wl.phase(30)
        p2, points["p2"] = _snapshot_at_new_slot(pgdb, specs)
        wl.phase(30)
        p3, points["p3"] = _snapshot_at_new_slot(pgdb, specs)
        with psycopg.connect(pgdb, autocommit=True) as conn:
            conn.execute("UPDATE calm SET v = 'changed' WHERE id = 2")
            conn.execute("DELETE FROM calm WHERE id = 3")
        wl.phase(20)
        p4, points["p4"] = _snapshot_at_new_slot(pgdb, specs)
        wl.phase(15)
    # windows end at p1 (after several small ones), at p3 (one window: p2 falls inside it), at p4, then at the end
    for bound, extra in ((p1, ["--max-changes", "80"]), (p3, []), (p4, ["--max-changes", "80"]), (None, [])):
        done = cli("run", *common, *extra, *(["--until-lsn", bound] if bound else []))
        assert done.returncode == 0, done.stderr[-2000:]
        if bound:
            assert confirmed_lsn(pgdb, slot) == bound

    # the bootstrap's start: the copies
    start = _versions(lake, booted["start_lsn"], "--slot", slot)
    assert start["exact"] is True
    assert {n: t["delta_version"] for n, t in start["tables"].items()} == {
        n: t["delta_version"] for n, t in booted["tables"].items()
    }
    for name in ("p1", "p3", "p4"):
        lsn = {"p1": p1, "p3": p3, "p4": p4}[name]
        report = _versions(lake, lsn, "--slot", slot)
        assert report["exact"] is True, report
        assert _assert_state(lake, report, points[name], specs) == len(specs)
        # with the source's DSN the answer is the same (the slot is past these LSNs)
        assert _versions(lake, lsn, *db)["tables"] == report["tables"]
    # p2 lies inside the one window [p1, p3): the tables it changed have no version holding p2
    report = _versions(lake, p2, "--slot", slot)
    inside = [t for t in report["tables"].values() if t["status"] == INSIDE_WINDOW]
    assert inside and all(t["window"] == {"start_lsn": p1, "end_lsn": p3} for t in inside)
    assert report["tables"]["public.calm"]["status"] == EXACT  # calm did not change until after p3
    assert _assert_state(lake, report, points["p2"], specs) == len(specs) - len(inside)
    assert report["exact"] is False
    text = cli("versions", "--lake", str(lake), "--slot", slot, "--at-lsn", p2)
    assert text.returncode == 0 and "no exact version (inside_window)" in text.stdout, text.stdout
    # calm changed between p3 and p4: a newer version at p4 than at p3
    at3 = _versions(lake, p3, "--slot", slot)["tables"]["public.calm"]["delta_version"]
    at4 = _versions(lake, p4, "--slot", slot)["tables"]["public.calm"]["delta_version"]
    assert at4 > at3

    # before the bootstrap: no state; far ahead: not applied
    before = _versions(lake, format_lsn(parse_lsn(booted["start_lsn"]) - 1), "--slot", slot)
    assert {t["status"] for t in before["tables"].values()} == {NOT_IN_LAKE}
    ahead = _versions(lake, "FF/0", "--slot", slot)
    assert {t["status"] for t in ahead["tables"].values()} == {NOT_APPLIED}


def test_versions_past_idle_windows_need_the_slot(pgdb: str, tmp_path: Path) -> None:
    """Windows without changes for the publication log nothing: the slot's position says they were applied."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE pub_t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE unpublished (id int PRIMARY KEY)")
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE pub_t").format(sql.Identifier(pub)))
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO pub_t VALUES (1, 'a'), (2, 'b')")
    db = ["--dsn", pgdb, "--slot", slot, "--publication", pub]
    assert cli("run", *db, "--lake", str(lake)).returncode == 0
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO unpublished SELECT generate_series(1, 100)")
    assert cli("run", *db, "--lake", str(lake)).returncode == 0
    idle_end = confirmed_lsn(pgdb, slot)
    assert idle_end is not None
    lake_only = _versions(lake, idle_end, "--slot", slot)
    assert lake_only["tables"]["public.pub_t"]["status"] == NOT_APPLIED
    with_slot = _versions(lake, idle_end, *db)
    assert with_slot["slot_confirmed_lsn"] == idle_end
    t = with_slot["tables"]["public.pub_t"]
    assert t["status"] == EXACT
    spec = TableSpec("public", "pub_t", ("id",))
    with psycopg.connect(pgdb) as conn:
        names, pg = pg_rows(conn, spec)
    assert_same_rows(spec, names, pg, lake_rows(lake, spec, version=t["delta_version"]), "public.pub_t at the slot")


def test_versions_refuses_a_lake_without_applied_log_and_a_bad_lsn(tmp_path: Path) -> None:
    done = cli("versions", "--lake", str(tmp_path / "empty"), "--at-lsn", "0/10")
    assert done.returncode == 78 and "no applied log" in done.stderr
    done = cli("versions", "--lake", str(tmp_path / "empty"), "--at-lsn", "nope")
    assert done.returncode == 78 and "not an LSN" in done.stderr


@pytest.mark.classic
def test_open_at_lsn_registers_views_at_those_versions(pgdb: str, tmp_path: Path, shared_engine: SharedEngine) -> None:
    """In process, on the session of the engine under test: views of two tables at one LSN, joined."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    lake = tmp_path / "lake"
    customers, orders = TableSpec("public", "customers", ("id",)), TableSpec("public", "orders", ("id",))
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE customers (id int PRIMARY KEY, name text)")
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, customer int, amount int)")
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE customers, orders").format(sql.Identifier(pub)))
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO customers VALUES (1, 'a'), (2, 'b')")
        conn.execute("INSERT INTO orders VALUES (10, 1, 5), (11, 2, 7)")
    at, snapshot = _snapshot_at_new_slot(pgdb, [customers, orders])
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO customers VALUES (3, 'c')")
        conn.execute("INSERT INTO orders VALUES (12, 3, 9)")
        conn.execute("UPDATE orders SET amount = amount * 100 WHERE id = 10")
    config = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
    run(config, until_lsn=parse_lsn(at))
    run(config)
    spark = shared_engine.start(config.engine, Lake(str(lake))).spark
    views = open_at_lsn(spark, str(lake), at, slot=slot)
    assert set(views) == {"public_customers", "public_orders"}
    joined = spark.sql(
        "SELECT o.id, c.name, o.amount FROM public_orders o JOIN public_customers c ON o.customer = c.id"
    ).collect()
    expected = sorted(
        (o[0], {c[0]: c[1] for c in snapshot["public.customers"][1]}[o[1]], o[2]) for o in snapshot["public.orders"][1]
    )
    assert sorted((r["id"], r["name"], r["amount"]) for r in joined) == expected == [(10, "a", 5), (11, "b", 7)]
    # the same LSN through the CLI's own function, and a helper call that cannot be exact
    report = versions(config, parse_lsn(at))
    assert {f"{t.schema}_{t.table}": t.delta_version for t in report.tables} == views
    with pytest.raises(LakeError, match="no Delta version holds"):
        open_at_lsn(spark, str(lake), parse_lsn(at) - 1, slot=slot)
    with pytest.raises(LakeError, match="no applied log"):
        open_at_lsn(spark, str(tmp_path / "no-lake"), at, slot=slot)
