"""A lake changed behind pg2delta's back: rows deleted and updated with delta-rs, as a stray job would.

``verify`` compares what readers read (the latest version) and names the keys and the commits;
``status`` flags the table (13); a run that would write the table refuses (21) with the slot where
it was; ``resync`` repairs it, and the lake equals PostgreSQL again.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from pg2delta.errors import EXIT_LAKE_CHANGED, EXIT_STATUS_LAKE_CHANGED, EXIT_VERIFY_DIFFERS
from pg2delta.lake.foreign import REMEMBERED
from workload import TableSpec, assert_lake_matches, cli, confirmed_lsn

pytestmark = pytest.mark.e2e

ITEMS = TableSpec("public", "items", ("id",))
OTHER = TableSpec("public", "other", ("id",))


def _setup(dsn: str, lake: Path) -> tuple[str, list[str]]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    _sql(dsn, "CREATE TABLE items (id int PRIMARY KEY, name text, qty int)",
         "CREATE TABLE other (id int PRIMARY KEY, v text)",
         f"CREATE PUBLICATION {pub} FOR TABLE items, other",
         f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')",
         "INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 200) g",
         "INSERT INTO other SELECT g, 'v' || g FROM generate_series(1, 10) g")
    common = ["--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    _ok("run", *common)
    _sql(dsn, "UPDATE items SET qty = qty + 1 WHERE id <= 20")  # a MERGE of pg2delta's own on top
    _ok("run", *common)
    assert_lake_matches(dsn, lake, [ITEMS, OTHER], context="before the damage")
    return slot, common


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def _ok(*args: str) -> None:
    done = cli(*args)
    assert done.returncode == 0, (args[0], done.returncode, done.stderr[-2000:])


def _damage(lake: Path) -> None:
    """What a stray job does: one row deleted, another updated, with delta-rs."""
    table = DeltaTable(str(lake / "public" / "items"))
    table.delete("id = 7")
    table.update(predicate="id = 42", updates={"name": "'hand fix'"})


def _verify(common: list[str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    done = cli("verify", *common, "--json")
    return done.returncode, json.loads(done.stdout)


def _assert_found(report: dict) -> None:  # type: ignore[type-arg]
    items = report["tables"]["public.items"]
    assert report["equal"] is False and items["equal"] is False
    assert {(d["kind"], d["key"]["id"]) for d in items["differences"]} == {
        ("missing_in_lake", "7"), ("different_values", "42")}
    assert [(c["operation"], c["engine"].split(":")[0]) for c in items["foreign_commits"]] == [
        ("UPDATE", "delta-rs"), ("DELETE", "delta-rs")]
    assert report["tables"]["public.other"]["equal"] is True


def _assert_status_flags(common: list[str]) -> None:
    status = cli("status", *common, "--json")
    assert status.returncode == EXIT_STATUS_LAKE_CHANGED, status.stderr[-2000:]
    report = json.loads(status.stdout)
    assert [p["kind"] for p in report["problems"]] == ["lake_changed"]
    flagged = {t["table"]: [c["operation"] for c in t["foreign_commits"]] for t in report["tables"]}
    assert flagged == {"public.items": ["UPDATE", "DELETE"], "public.other": []}


def _assert_run_refuses(dsn: str, slot: str, common: list[str]) -> None:
    before = confirmed_lsn(dsn, slot)
    refused = cli("run", *common)
    assert refused.returncode == EXIT_LAKE_CHANGED, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("pg2delta: lake_changed error")]
    assert len(lines) == 1 and "public.items" in lines[0] and "resync --table public.items" in lines[0], refused.stderr
    assert confirmed_lsn(dsn, slot) == before


def test_damage_is_found_refused_and_repaired(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, common = _setup(pgdb, lake)
    _damage(lake)

    code, report = _verify(common)
    assert code == EXIT_VERIFY_DIFFERS
    _assert_found(report)
    _assert_status_flags(common)
    assert cli("run", *common).returncode == 0, "nothing to write: the run writes no table"
    _sql(pgdb, "UPDATE items SET qty = -qty WHERE id IN (1, 2)", "UPDATE other SET v = 'x' WHERE id = 1")
    _assert_run_refuses(pgdb, slot, common)

    _ok("resync", *common, "--table", "public.items")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [ITEMS, OTHER], context="resynced after the damage")
    code, report = _verify(common)
    assert code == 0 and report["tables"]["public.items"]["foreign_commits"] == [], report
    assert cli("status", *common).returncode == 0


def test_verify_writing_over_damage_remembers_it(pgdb: str, tmp_path: Path) -> None:
    """A change of the damaged table waits in the slot: verify's own run applies it over the damage
    (verify must pin the lake at its LSN) and remembers the commits, so the runs after still refuse."""
    lake = tmp_path / "lake"
    slot, common = _setup(pgdb, lake)
    _damage(lake)
    _sql(pgdb, "UPDATE items SET qty = 0 WHERE id = 3")

    code, report = _verify(common)
    assert code == EXIT_VERIFY_DIFFERS
    _assert_found(report)
    assert list((lake / REMEMBERED / f"slot-{slot}" / "public").iterdir()) == [lake / REMEMBERED / f"slot-{slot}" / "public" / "items.json"]
    _assert_status_flags(common)
    _sql(pgdb, "UPDATE items SET qty = 1 WHERE id = 4")
    _assert_run_refuses(pgdb, slot, common)

    _ok("resync", *common, "--table", "public.items")
    assert not (lake / REMEMBERED / f"slot-{slot}" / "public" / "items.json").exists()
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [ITEMS, OTHER], context="resynced after verify wrote over the damage")
    assert cli("status", *common).returncode == 0
