"""The merged features together, as a user meets them: bootstrap, schema changes, changelog, backfill.

Each scenario starts from tables that hold rows, copies them with ``pg2delta bootstrap`` (the CLI)
while a workload writes, then changes the tables' shapes (a column added, a widening type change,
a new primary key) among updates that leave big ``SET STORAGE EXTERNAL`` values unchanged (sent as
unchanged TOAST) and truncates, and runs ``pg2delta run`` in many small windows with a changelog on
every table. The oracles are independent of the engine that wrote the lake: PostgreSQL itself for
the tables, delta-rs for the lake, the changelog and the backfilled copies.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest

from changelog_support import changelog_rows, write_config
from conftest import PG_VERSIONS
from lake_read import read_delta
from pg2delta.faults import FAULT_ENV
from pg2delta.source.throwaway import ThrowawayPostgres
from test_bootstrap import Background
from workload import TABLES, TableSpec, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema

pytestmark = pytest.mark.e2e

EXIT_OK = 0
MAX_CHANGES = "150"

# A table of our own for the shape changes: ``uid`` becomes its primary key half-way.
DOC = TableSpec("public", "doc", ("uid",))
DOC_DDL = """
CREATE TABLE doc (id integer PRIMARY KEY, uid integer NOT NULL UNIQUE, code integer, title text, body text);
ALTER TABLE doc ALTER COLUMN body SET STORAGE EXTERNAL;
ALTER TABLE doc SET (autovacuum_enabled = off);
"""
# 4 kB, stored out of line uncompressed (EXTERNAL): an update that does not touch it sends it as unchanged TOAST
BODY = "repeat(md5(({})::text), 128)"


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"slot_{tag}", f"pub_{tag}"


def _source(dsn: str, pub: str, rows: int = 300) -> None:
    """The workload's tables and ``doc``, all published and holding rows before the slot exists."""
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DOC_DDL)
        conn.execute(f'ALTER PUBLICATION "{pub}" ADD TABLE doc')
        conn.execute(
            f"INSERT INTO doc SELECT g, 100000 + g, g * 3, 'title ' || g, {BODY.format('g')} FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO acct (id, big, name, amount, body) "
            "SELECT 1000000 + g, g * 7919, 'pre ' || g, g * 0.25, CASE WHEN g %% 7 = 0 THEN repeat(md5(g::text), 300) END "
            "FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute("INSERT INTO shop.pair SELECT 'r' || (g %% 3), 1000000 + g, g, 'note ' || g, now() FROM generate_series(1, %s) g", (rows // 2,))
        conn.execute("INSERT INTO fullid SELECT 1000000 + g, 'v' || g, g * 0.5, g %% 2 = 0, NULL FROM generate_series(1, %s) g", (rows // 2,))
        conn.execute("INSERT INTO events SELECT now(), 'pre', g %% 7, NULL, NULL FROM generate_series(1, %s) g", (rows // 2,))


def _bootstrap_under_load(config: Path, dsn: str, seed: int) -> Workload:
    """``pg2delta bootstrap`` while the workload writes; returns the workload (closed) to go on with."""
    with Background(dsn, seed) as bg:
        proc = cli("bootstrap", "--config", str(config), "--json")
        phases = bg.finish()
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert phases > 0, "the workload did not write while the bootstrap ran"
    return bg.wl


def _untouched_toast_updates(conn: psycopg.Connection[Any], where: str) -> None:
    """Updates that leave ``body`` alone: pgoutput sends it as unchanged TOAST."""
    conn.execute(f"UPDATE doc SET title = title || ' +' WHERE {where}")


def _insert_doc(conn: psycopg.Connection[Any], first: int, last: int) -> None:
    conn.execute(
        f"INSERT INTO doc (id, uid, code, title, body) SELECT g, 100000 + g, g, 'new ' || g, {BODY.format('g * 11')} "
        "FROM generate_series(%s::int, %s::int) g",
        (first, last),
    )


def _shape_changes(dsn: str, wl: Workload) -> None:
    """A column added, a widening by rewrite and a new primary key, each among row changes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _untouched_toast_updates(conn, "id % 5 = 0")
        conn.execute("ALTER TABLE doc ADD COLUMN note text")
        conn.execute("UPDATE doc SET note = 'n' || id WHERE id % 3 = 0")
        _untouched_toast_updates(conn, "id % 4 = 1")
        wl.phase(25)
        conn.execute("ALTER TABLE doc ALTER COLUMN code TYPE bigint")
        conn.execute("UPDATE doc SET code = code + 5000000000 WHERE id % 2 = 0")
        _insert_doc(conn, 400, 420)
        conn.execute("DELETE FROM doc WHERE id % 10 = 7")  # deletes sent with the old key
        wl.phase(25)
        conn.execute("ALTER TABLE doc DROP CONSTRAINT doc_pkey, ADD PRIMARY KEY (uid)")
        conn.execute("UPDATE doc SET id = id + 1000 WHERE id % 6 = 0")  # no longer the key
        _untouched_toast_updates(conn, "id % 7 = 2")
        conn.execute("DELETE FROM doc WHERE id % 10 = 3")
        wl.phase(25)
        conn.execute("TRUNCATE shop.pair")
        conn.execute("INSERT INTO shop.pair VALUES ('after', 1, 1, 'after the truncate', now())")
        _untouched_toast_updates(conn, "uid % 9 = 4")


def _log(lake: Path, name: str = "applied_log") -> list[dict[str, Any]]:
    path = lake / "_pg2delta" / name
    return read_delta(str(path)).to_pylist() if (path / "_delta_log").is_dir() else []


def _fmt(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _rows(path: Path) -> list[tuple[tuple[str, Any], ...]]:
    return sorted((tuple(sorted(r.items())) for r in read_delta(str(path)).to_pylist()), key=repr)


def _brief(row: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    return {k: (f"{v[:8]}...({len(v)})" if isinstance(v, str) and len(v) > 40 else v) for k, v in row}


def _types(path: Path) -> dict[str, pa.DataType]:
    schema = read_delta(str(path)).schema
    return {f.name: f.type for f in schema}


def _assert_changelogs_unique(lake: Path, specs: tuple[TableSpec, ...]) -> None:
    for spec in specs:
        rows = changelog_rows(lake, spec)
        assert rows, f"{spec.qualified}: no changelog rows"
        dup = [k for k, n in Counter((r["_pg2delta_lsn"], r["_pg2delta_pos"]) for r in rows).items() if n > 1]
        assert not dup, f"{spec.qualified}: changelog rows twice at (lsn, pos) {dup[:5]}"


def _assert_backfill_equals_main(config: Path, lake: Path, into: Path, a: int, specs: tuple[TableSpec, ...], *extra: str) -> None:
    """``backfill --into`` from ``a`` to the last window end gives copies equal to the main tables."""
    b = max(r["window_end"] for r in _log(lake))
    proc = cli("backfill", "--config", str(config), "--from-lsn", _fmt(a), "--to-lsn", _fmt(b), "--into", str(into), *extra)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    for spec in specs:
        main, copy = lake / spec.schema / spec.name, into / spec.schema / spec.name
        assert _types(copy) == _types(main), f"{spec.qualified}: copy columns differ from the main table's"
        got, want = _rows(copy), _rows(main)
        extra, missing = sorted(set(got) - set(want), key=repr), sorted(set(want) - set(got), key=repr)
        assert got == want, (
            f"{spec.qualified}: backfilled copy ({len(got)} rows) differs from the main table ({len(want)} rows): "
            f"only in the copy {[_brief(r) for r in extra[:5]]}, only in the main table {[_brief(r) for r in missing[:5]]}"
        )


def _lake_start(lake: Path, slot: str) -> int:
    (start,) = [r["window_end"] for r in _log(lake) if r["slot"] == slot and r["kind"] == "bootstrap" and not r["table_name"]]
    return int(start)


def _assert_doc_shape(lake: Path, *added: str) -> None:
    types = _types(lake / "public" / "doc")
    assert types["code"] == pa.int64() and {"note", *added} <= set(types), types


def test_bootstrap_shape_changes_changelog_backfill(pgdb: str, tmp_path: Path) -> None:
    """Scenario 1: bootstrap under load, shape changes, many windows with a changelog, backfill."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _source(pgdb, pub)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=int(MAX_CHANGES))
    with _bootstrap_under_load(config, pgdb, seed=901) as wl:
        wl.phase(30)
        _shape_changes(pgdb, wl)
    proc = cli("run", "--config", str(config), "--max-changes", MAX_CHANGES, "--json")
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["windows"] > 5
    specs = (*TABLES, DOC)
    assert_lake_matches(pgdb, lake, specs, context="bootstrap, shape changes, small windows")
    _assert_doc_shape(lake)
    _assert_changelogs_unique(lake, specs)
    _assert_backfill_equals_main(config, lake, tmp_path / "copy", _lake_start(lake, slot), specs)


# Three of the job's fault points, to keep the file to a few minutes: the changelog committed and
# nothing else; the copy's rewrite (widening) committed before its MERGE; everything committed and
# logged but the slot not advanced. test_job_faults.py runs every point without shape changes.
CRASH_POINTS = ["after_changelog", "after_schema_change", "before_advance"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_in_the_window_of_a_widening(pg_server: ThrowawayPostgres, pgdb: str, tmp_path: Path, point: str) -> None:
    """Scenario 2: SIGKILL in the window that widens ``doc.code`` and adds a column, then a rerun."""
    if point != "after_schema_change" and pg_server.version != max(PG_VERSIONS):
        # CI time: each crash point costs minutes; one point runs on every server, all on the newest.
        pytest.skip(f"{point} runs on PostgreSQL {max(PG_VERSIONS)} only")
    slot, pub = _names()
    lake = tmp_path / "lake"
    _source(pgdb, pub, rows=150)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=int(MAX_CHANGES))
    wl = _bootstrap_under_load(config, pgdb, seed=910 + CRASH_POINTS.index(point))
    with wl, psycopg.connect(pgdb, autocommit=True) as conn:
        wl.phase(30)
        conn.execute("ALTER TABLE doc ADD COLUMN note text")
        conn.execute("UPDATE doc SET note = 'n' || id WHERE id % 3 = 0")
        _untouched_toast_updates(conn, "id % 4 = 1")
        (before_widening,) = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone() or ("",)
        # The widening and the changes of several tables in one transaction: one window holds them all.
        with conn.transaction():
            conn.execute("ALTER TABLE doc ALTER COLUMN code TYPE bigint, ADD COLUMN tag text")
            conn.execute("UPDATE doc SET tag = 't' || id WHERE id % 4 = 3")
            conn.execute("UPDATE doc SET code = code + 5000000000 WHERE id % 2 = 0")
            conn.execute("UPDATE doc SET title = title || ' w' WHERE id % 5 = 1")  # unchanged TOAST
            conn.execute("INSERT INTO acct (id, name) VALUES (-1, 'in the widening window')")
            conn.execute("INSERT INTO events (kind, n) VALUES ('widening', 1)")
        wl.phase(30)
        conn.execute("ALTER TABLE doc DROP CONSTRAINT doc_pkey, ADD PRIMARY KEY (uid)")
        _untouched_toast_updates(conn, "id % 7 = 2")
        conn.execute("TRUNCATE events")
        wl.phase(20)
    first = cli("run", "--config", str(config), "--until-lsn", before_widening)
    assert first.returncode == EXIT_OK, first.stderr[-3000:]
    held = confirmed_lsn(pgdb, slot)
    crashed = cli("run", "--config", str(config), "--max-changes", MAX_CHANGES, env={FAULT_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, (point, crashed.returncode, crashed.stderr[-3000:])
    assert confirmed_lsn(pgdb, slot) == held, f"the slot moved although the run died at {point}"
    again = cli("run", "--config", str(config), "--max-changes", MAX_CHANGES, "--json")
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    specs = (*TABLES, DOC)
    assert_lake_matches(pgdb, lake, specs, context=f"a crash at {point} in the widening window, then a rerun")
    _assert_doc_shape(lake, "tag")
    _assert_changelogs_unique(lake, specs)
    _assert_backfill_equals_main(config, lake, tmp_path / "copy", _lake_start(lake, slot), specs)


LATE = TableSpec("public", "late", ("id",))


def test_table_added_after_bootstrap_with_a_shape_change(pgdb: str, tmp_path: Path) -> None:
    """Scenario 3: a table joins the publication after the bootstrap and changes shape before the next run."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _source(pgdb, pub, rows=150)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=int(MAX_CHANGES))
    wl = _bootstrap_under_load(config, pgdb, seed=931)
    with wl, psycopg.connect(pgdb, autocommit=True) as conn:
        wl.phase(20)
        conn.execute("CREATE TABLE late (id integer PRIMARY KEY, n integer, v text)")
        conn.execute("ALTER TABLE late ALTER COLUMN v SET STORAGE EXTERNAL")
        conn.execute(f"INSERT INTO late SELECT g, g, {BODY.format('g')} FROM generate_series(1, 200) g")
        conn.execute(f'ALTER PUBLICATION "{pub}" ADD TABLE late')
        conn.execute("UPDATE late SET n = -n WHERE id % 4 = 0")
        conn.execute("ALTER TABLE late ADD COLUMN extra text, ALTER COLUMN n TYPE bigint")
        conn.execute("UPDATE late SET extra = 'x' || id, n = n * 10000000000 WHERE id % 3 = 0")  # v: unchanged TOAST
        wl.phase(20)
    proc = cli("run", "--config", str(config), "--max-changes", MAX_CHANGES)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    specs = (*TABLES, DOC, LATE)
    assert_lake_matches(pgdb, lake, specs, context="a table added after the bootstrap")
    copied = [r for r in _log(lake) if r["table_name"] == "late" and r["kind"] == "bootstrap"]
    assert len(copied) == 1, copied
    # A shape change after its copy, before the next run.
    with wl, psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ALTER TABLE late ADD COLUMN more integer")
        conn.execute("UPDATE late SET more = id WHERE id % 2 = 0")
        conn.execute("DELETE FROM late WHERE id % 10 = 5")
        wl.phase(20)
    proc = cli("run", "--config", str(config), "--max-changes", MAX_CHANGES)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert_lake_matches(pgdb, lake, specs, context="a table added after the bootstrap, then reshaped")
    _assert_changelogs_unique(lake, (*TABLES, LATE))  # doc is not written here
    # The late table's rows before its copy are not changelog rows: backfill from its copy's LSN.
    _assert_backfill_equals_main(
        config, lake, tmp_path / "copy", int(copied[0]["window_end"]), (LATE,), "--table", LATE.qualified
    )
