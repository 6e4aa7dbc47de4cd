"""``pg2delta plan``: what a run would do, from the real CLI against real servers, writing nothing.

Every plan is checked against the slot's confirmed position and the lake's files before and after,
and its counts against the ``run --json`` that follows over the same bound.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from workload import (
    Workload,
    assert_lake_matches,
    cli,
    confirmed_lsn,
    create_schema,
    lake_files,
    published_table,
)

pytestmark = pytest.mark.e2e


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"slot_{tag}", f"pub_{tag}"


def _flush_lsn(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def _plan_writes_nothing(
    dsn: str, slot: str, lake: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """``pg2delta plan --json``: its exit code and report, after checking that it moved and wrote nothing."""
    confirmed, files = confirmed_lsn(dsn, slot), lake_files(lake)
    done = cli("plan", *args, "--json", env=env)
    assert done.returncode in (0, 78), done.stderr[-2000:]
    assert confirmed_lsn(dsn, slot) == confirmed, "plan moved the slot"
    assert lake_files(lake) == files, "plan wrote to the lake"
    with psycopg.connect(dsn) as conn:
        temporary = conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'pg2delta_plan_%'").fetchone()
    assert temporary == (0,), "plan left its temporary copy of the slot behind"
    report = json.loads(done.stdout)
    assert report["schema_version"] == 1
    return done.returncode, report


def _per_table(tables: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int, int, bool]]:
    return {n: (t["inserts"], t["updates"], t["deletes"], t["truncated"]) for n, t in tables.items()}


@pytest.mark.parametrize(
    ("max_changes", "spill"),
    [(None, False), (60, False), (None, True)],
    ids=["one-window", "small-windows", "one-window-spilled"],
)
def test_plan_counts_equal_the_run(pgdb: str, tmp_path: Path, max_changes: int | None, spill: bool) -> None:
    # spill: a memory budget of one byte, so plan and run both take the spilled path (pg2delta.window.spill)
    env = {"PG2DELTA_MEMORY_BUDGET": "1"} if spill else None
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    if max_changes is not None:
        common += ["--max-changes", str(max_changes)]
    with Workload(pgdb, 4242) as wl:
        wl.phase(40)
        first = cli("run", *common)  # the lake has its tables, the next plan plans against them
        assert first.returncode == 0, first.stderr[-2000:]
        wl.phase(60)
    bound = _flush_lsn(pgdb)
    code, planned = _plan_writes_nothing(pgdb, slot, lake, *common, "--until-lsn", bound, env=env)
    assert code == 0, planned["refusals"]
    assert planned["refusals"] == [] and planned["exact"] is True
    assert planned["changes"] > 0
    done = cli("run", *common, "--until-lsn", bound, "--json", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    ran = json.loads(done.stdout)
    assert (ran["spilled_rows"] > 0) == spill
    assert _per_table(planned["tables"]) == _per_table(ran["tables"])
    assert planned["window_count"] == ran["windows"] == len(planned["windows"])
    assert planned["to_lsn"] == ran["to_lsn"]
    assert planned["changes"] == ran["changes"]
    if max_changes is not None:
        assert planned["window_count"] > 1, "small windows should give several windows"
    assert_lake_matches(pgdb, lake)


def test_plan_reports_a_narrowing_and_exits_78(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE nar (id int PRIMARY KEY, v int8)")
        conn.execute("CREATE TABLE other (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE nar, other")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO nar VALUES (1, 10), (2, 20)")
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common)
    assert first.returncode == 0, first.stderr[-2000:]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ALTER TABLE nar ALTER COLUMN v TYPE int4")
        conn.execute("INSERT INTO nar VALUES (3, 30)")
        conn.execute("INSERT INTO other VALUES (1, 'a')")
    code, planned = _plan_writes_nothing(pgdb, slot, lake, *common)
    assert code == 78
    [refusal] = planned["refusals"]
    assert refusal["table"] == "public.nar" and "narrowing" in refusal["message"]
    assert planned["tables"]["public.nar"]["refusal"] == refusal["message"]
    # the window's other tables are still planned
    assert planned["tables"]["public.other"]["inserts"] == 1
    assert planned["tables"]["public.other"]["new_table"] is True
    text = cli("plan", *common)
    assert text.returncode == 78 and "REFUSED (public.nar" in text.stdout, text.stdout
    # and the run refuses it as the plan said
    confirmed = confirmed_lsn(pgdb, slot)
    refused = cli("run", *common)
    assert refused.returncode == 78 and "narrowing" in refused.stderr
    assert confirmed_lsn(pgdb, slot) == confirmed


def test_plan_shows_shape_changes(pgdb: str, tmp_path: Path) -> None:
    slot, pub = published_table(
        pgdb, "CREATE TABLE sh (id int PRIMARY KEY, a int4, gone text)", "sh", "INSERT INTO sh VALUES (1, 1, 'x'), (2, 2, 'y')"
    )
    lake = tmp_path / "lake"
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common)
    assert first.returncode == 0, first.stderr[-2000:]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO sh VALUES (3, 3, 'z')")
        conn.execute("ALTER TABLE sh ALTER COLUMN a TYPE int8, ADD COLUMN b text, DROP COLUMN gone")
        conn.execute("UPDATE sh SET b = 'new' WHERE id = 1")
        conn.execute("DELETE FROM sh WHERE id = 2")
    code, planned = _plan_writes_nothing(pgdb, slot, lake, *common)
    assert code == 0, planned["refusals"]
    # the shape change starts a second window, as in the run
    assert [w["ends_at"] for w in planned["windows"]] == ["shape_change", "bound"]
    t = planned["tables"]["public.sh"]
    assert (t["inserts"], t["updates"], t["deletes"]) == (1, 1, 1)
    assert t["added"] == ["b"] and t["dropped"] == ["gone"] and t["dropped_columns"] == "keep"
    assert t["widened"] == [{"column": "a", "from": "int", "to": "bigint"}]
    done = cli("run", *common, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    ran = json.loads(done.stdout)
    assert _per_table(planned["tables"]) == _per_table(ran["tables"])
    assert planned["window_count"] == ran["windows"]


def test_plan_lists_a_table_new_to_the_publication_as_copied_first(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    boot = cli("bootstrap", *common)
    assert boot.returncode == 0, boot.stderr[-2000:]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE extra (id int PRIMARY KEY, v text)")
        conn.execute(f"ALTER PUBLICATION {pub} ADD TABLE extra")
        conn.execute("INSERT INTO extra VALUES (1, 'a'), (2, 'b')")
        conn.execute("INSERT INTO acct (id, name) VALUES (100000, 'n')")
    code, planned = _plan_writes_nothing(pgdb, slot, lake, *common)
    assert code == 0, planned["refusals"]
    assert planned["would_copy"] == ["public.extra"]
    assert planned["tables"]["public.extra"]["would_copy"] is True
    assert planned["tables"]["public.acct"]["inserts"] == 1
    text = cli("plan", *common)
    assert text.returncode == 0 and "public.extra: would be copied first" in text.stdout, text.stdout


def test_plan_waits_for_no_one(pgdb: str, tmp_path: Path) -> None:
    """Another run holds the slot's lock: plan exits 73 like a run would."""
    slot, pub = _names()
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("SELECT pg_advisory_lock(hashtextextended('pg2delta slot ' || %s, 0))", (slot,))
        busy = cli("plan", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(tmp_path / "lake"))
    assert busy.returncode == 73, busy.stderr[-2000:]


def test_plan_reports_a_table_dropped_and_created_again(pgdb: str, tmp_path: Path) -> None:
    """A refusal of the whole window (mapping it to Delta tables) is reported with no table."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE again (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO again VALUES (1, 'a')")
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common)
    assert first.returncode == 0, first.stderr[-2000:]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("DROP TABLE again")
        conn.execute("CREATE TABLE again (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO again VALUES (2, 'b')")
    code, planned = _plan_writes_nothing(pgdb, slot, lake, *common)
    assert code == 78
    [refusal] = planned["refusals"]
    assert refusal["table"] is None and "created again" in refusal["message"]
    assert planned["windows"][-1]["refused"] is True


def test_plan_without_a_free_slot_plans_the_first_window(pgdb: str, tmp_path: Path) -> None:
    """No ``max_replication_slots`` entry for the temporary copy: the first window only, said so."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), "--max-changes", "40"]
    with Workload(pgdb, 99) as wl:
        wl.phase(60, truncate=False)
    with psycopg.connect(pgdb, autocommit=True) as holder:
        row = holder.execute(
            "SELECT current_setting('max_replication_slots')::int - (SELECT count(*) FROM pg_replication_slots)"
        ).fetchone()
        assert row is not None
        for n in range(int(row[0])):  # temporary: gone with this session
            holder.execute("SELECT pg_create_physical_replication_slot(%s, false, true)", (f"fill_{uuid.uuid4().hex[:8]}_{n}",))
        code, planned = _plan_writes_nothing(pgdb, slot, lake, *common)
    assert code == 0, planned["refusals"]
    assert planned["exact"] is False and planned["window_count"] == 1
    assert planned["windows"][0]["ends_at"] == "cap"
    done = cli("run", *common, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["windows"] > 1
