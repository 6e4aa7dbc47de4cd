"""End to end: random workloads on real PostgreSQL 15/18, the real job, real Delta tables.

After every run the lake, read back with delta-rs, must equal PostgreSQL row for row.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import psycopg
import pytest

from lake_read import read_delta
from pg2delta.config import load
from pg2delta.job import RunReport, run
from workload import (
    ACCT,
    EVENTS,
    FULLID,
    PAIR,
    TABLES,
    TableSpec,
    Workload,
    assert_lake_matches,
    cli,
    confirmed_lsn,
    create_schema,
    lake_files,
    lake_rows,
    lsn_int,
    pg_rows,
)

pytestmark = [pytest.mark.e2e, pytest.mark.compat]  # compat: run again on the oldest stack (make test-compat)


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"slot_{tag}", f"pub_{tag}"


def _run(dsn: str, slot: str, pub: str, lake: Path, **flags: object) -> RunReport:
    cfg = load(None, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake), create_slot=True, **flags)
    return run(cfg)


def _create_slot(dsn: str, slot: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))


def _flush_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    assert row is not None
    return lsn_int(row[0])


# (seed, max_changes per window, phases of (steps, runs after the phase))
SCENARIOS = [
    pytest.param(1001, None, [(50, 1), (60, 1), (40, 2)], id="seed1001-big-windows"),
    pytest.param(2002, 40, [(50, 1), (50, 1)], id="seed2002-small-windows", marks=pytest.mark.classic),
    pytest.param(3003, 150, [(70, 1), (30, 1), (30, 1)], id="seed3003"),
]


@pytest.mark.parametrize(("seed", "max_changes", "phases"), SCENARIOS)
def test_random_workload(pgdb: str, tmp_path: Path, seed: int, max_changes: int | None,
                         phases: list[tuple[int, int]]) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    flags = {"max_changes": max_changes} if max_changes else {}
    total_windows = 0
    with Workload(pgdb, seed) as wl:
        for n, (steps, runs) in enumerate(phases):
            wl.phase(steps)
            for r in range(runs):
                context = f"seed {seed}, phase {n}, run {r}; replay with Workload(dsn, {seed})"
                bound = _flush_lsn(pgdb)
                report = _run(pgdb, slot, pub, lake, **flags)
                total_windows += len(report.windows)
                assert report.end_lsn >= bound, context
                assert confirmed_lsn(pgdb, slot) is not None
                assert lsn_int(confirmed_lsn(pgdb, slot) or "0/0") == report.end_lsn, context
                assert_lake_matches(pgdb, lake, context=context)
                if r + 1 < runs:
                    wl.phase(10, truncate=False)  # a little more between runs of one phase
    if max_changes is not None and max_changes <= 40:
        assert total_windows > len(phases), "small --max-changes should give several windows per run"


def test_second_run_has_nothing_to_do(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    with Workload(pgdb, 77) as wl:
        wl.phase(30)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common, "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["changes"] > 0
    assert_lake_matches(pgdb, lake)
    before = lake_files(lake)
    confirmed = confirmed_lsn(pgdb, slot)
    # The server may write a WAL record of its own (a running-transactions snapshot) after
    # the first run's bound; a run over it applies nothing. Within a few runs the slot is
    # at the server's flush LSN and the job says so: "idle" in its report, and exit 0 (an
    # Airflow task that succeeds) unless --idle-exit-code asks for another code.
    idle = []
    for _ in range(3):
        again = cli("run", *common, "--json")
        assert again.returncode == 0, again.stderr
        report = json.loads(again.stdout)
        assert report["schema_version"] == 1 and report["command"] == "run", report
        assert report["changes"] == 0 and report["rows_read"] == 0, report
        idle.append(report["idle"])
        if report["idle"]:
            break
    assert idle[-1] is True, f"idle flags {idle}: a run with nothing to do must say so"
    assert lake_files(lake) == before, "a run with nothing to apply wrote to the lake"
    if idle == [True]:
        assert confirmed_lsn(pgdb, slot) == confirmed
    # Those who branch on it ask for a code of their own; the codes that mean failures are refused.
    flagged_codes = []
    for _ in range(3):
        flagged = cli("run", *common, "--idle-exit-code", "3", "--json")
        flagged_codes.append(flagged.returncode)
        if flagged.returncode != 0:
            break
        assert json.loads(flagged.stdout)["idle"] is False  # a record of the server's own: not idle
    assert flagged_codes[-1] == 3, (flagged_codes, flagged.stderr[-3000:])
    refused = cli("run", *common, "--idle-exit-code", "75")
    assert refused.returncode == 78 and "idle-exit-code" in refused.stderr, refused.stderr
    assert lake_files(lake) == before


def test_idle_publication_still_advances_slot(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE elsewhere (id int PRIMARY KEY, v text)")  # not in the publication
        conn.execute("INSERT INTO elsewhere SELECT g, repeat('x', 100) FROM generate_series(1, 5000) g")
        conn.execute("UPDATE elsewhere SET v = 'y'")
    start = lsn_int(confirmed_lsn(pgdb, slot) or "0/0")
    bound = _flush_lsn(pgdb)
    assert bound > start
    report = _run(pgdb, slot, pub, lake, max_changes=50)
    assert report.changes == 0
    assert report.end_lsn == report.upper_lsn >= bound
    assert lsn_int(confirmed_lsn(pgdb, slot) or "0/0") == report.end_lsn
    for spec in TABLES:
        assert not (lake / spec.schema / spec.name).exists(), f"{spec.qualified} got a Delta table without changes"
    assert_lake_matches(pgdb, lake)


def test_status_after_run(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    with Workload(pgdb, 55) as wl:
        wl.phase(25, truncate=False)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    done = cli("run", *common)
    assert done.returncode == 0, done.stderr
    confirmed = confirmed_lsn(pgdb, slot)
    assert confirmed is not None
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO events (kind) VALUES ('after the run')")  # some lag

    out = cli("status", *common)
    assert out.returncode == 0, out.stderr
    head, *lines = out.stdout.splitlines()
    m = re.match(r"slot (\S+): confirmed (\S+), server flushed (\S+); lag (\d+) bytes, [^;]*; wal_status (\S+)", head)
    assert m, head
    assert m.group(1) == slot
    assert m.group(2) == confirmed
    assert int(m.group(4)) == lsn_int(m.group(3)) - lsn_int(confirmed) > 0
    assert m.group(5) in ("reserved", "extended")
    applied = dict(re.findall(r"^\s+(\S+): applied through (\S+) ", "\n".join(lines), flags=re.M))
    touched = {s.qualified for s in (ACCT, PAIR, FULLID, EVENTS) if (lake / s.schema / s.name).exists()}
    assert touched and set(applied) == touched, (applied, touched)
    assert all(v == confirmed for v in applied.values()), applied

    js = cli("status", *common, "--json")
    assert js.returncode == 0, js.stderr
    info = json.loads(js.stdout)
    assert info["slot"]["confirmed_flush_lsn"] == confirmed
    assert info["slot"]["lag_bytes"] > 0
    assert {t["table"]: t["applied_lsn"] for t in info["tables"]} == applied


def test_until_lsn_stops_between_transactions(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO acct (id, name) SELECT g, 'first' FROM generate_series(1, 10) g")
        between = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert between is not None
        conn.execute("INSERT INTO acct (id, name) SELECT g, 'second' FROM generate_series(11, 20) g")
        conn.execute("UPDATE acct SET name = 'second' WHERE id <= 5")
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common, "--until-lsn", between[0], "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["to_lsn"] == between[0]
    assert confirmed_lsn(pgdb, slot) == between[0]
    got = lake_rows(lake, ACCT)
    assert got is not None
    names, rows = got
    assert sorted((r[names.index("id")], r[names.index("name")]) for r in rows) == [(i, "first") for i in range(1, 11)]

    rest = cli("run", *common)
    assert rest.returncode == 0, rest.stderr
    assert_lake_matches(pgdb, lake)


def test_unchanged_toast_from_the_lake(pgdb: str, tmp_path: Path) -> None:
    """Updates that leave a large value alone, its row's older state only in the lake (earlier run)."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    big = [f"{n:x}" * 1 + "".join(f"{(n * 7919 + i) ** 3 % 65521:04x}" for i in range(3000)) for n in range(4)]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        for n in range(4):
            conn.execute("INSERT INTO acct (id, name, body) VALUES (%s, 'v1', %s)", (n + 1, big[n]))
            conn.execute("INSERT INTO fullid (id, val, body) VALUES (%s, 'v1', %s)", (n + 1, big[n]))
        row = conn.execute("SELECT min(pg_column_size(body)) FROM acct").fetchone()
        assert row is not None and row[0] > 4000, "the values must be stored out of line, uncompressed"
    _run(pgdb, slot, pub, lake)
    assert_lake_matches(pgdb, lake, context="after the inserts")
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET name = 'v2' WHERE id = 1")  # unchanged TOAST
        conn.execute("UPDATE acct SET id = 102, name = 'moved' WHERE id = 2")  # key change, unchanged TOAST
        conn.execute("UPDATE acct SET name = 'v2' WHERE id = 3")
        conn.execute("UPDATE acct SET id = 103 WHERE id = 3")  # two steps in one window
        conn.execute("UPDATE fullid SET val = 'v2' WHERE id IN (1, 2)")
        conn.execute("UPDATE fullid SET id = 104 WHERE id = 4")
    _run(pgdb, slot, pub, lake, max_changes=1)  # one transaction per window
    assert_lake_matches(pgdb, lake, context="after partial updates")


def test_until_lsn_beyond_the_server(pgdb: str, tmp_path: Path) -> None:
    """A bound past the server's WAL must not be recorded as applied: later changes would be skipped."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _create_slot(pgdb, slot)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO acct (id, name) SELECT g, 'first' FROM generate_series(1, 10) g")
        conn.execute("INSERT INTO events (kind) VALUES ('first')")
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common, "--until-lsn", "FFFF/0", "--json")
    assert first.returncode == 0, first.stderr
    assert_lake_matches(pgdb, lake)
    confirmed = confirmed_lsn(pgdb, slot)
    assert confirmed is not None
    assert lsn_int(confirmed) <= _flush_lsn(pgdb)
    assert json.loads(first.stdout)["to_lsn"] == confirmed, "the report must say where the slot really is"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET name = 'second' WHERE id <= 5")
        conn.execute("INSERT INTO events (kind) VALUES ('second')")
    rest = cli("run", *common)
    assert rest.returncode == 0, rest.stderr
    assert_lake_matches(pgdb, lake, context="changes after a run with a bound past the server")


def test_configured_key_with_nulls(pgdb: str, tmp_path: Path) -> None:
    """A key from the config may hold NULLs: rows with a NULL key part are matched, not duplicated."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    spec = TableSpec("public", "nk", ("a", "b"))
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE nk (a integer, b text, v text)")
        conn.execute("ALTER TABLE nk REPLICA IDENTITY FULL")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE nk")
        _create_slot(pgdb, slot)
        conn.execute("INSERT INTO nk VALUES (1, NULL, 'one'), (2, 'x', 'two'), (NULL, NULL, 'three'), (4, NULL, 'four')")
    conf = tmp_path / "nk.toml"
    conf.write_text('[tables."public.nk"]\nkey = ["a", "b"]\n')

    def run_it() -> None:
        cfg = load(conf, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
        run(cfg)
        assert_lake_matches(pgdb, lake, [spec])

    run_it()
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE nk SET v = 'uno' WHERE a = 1")
        conn.execute("UPDATE nk SET v = 'tres' WHERE a IS NULL")
        conn.execute("DELETE FROM nk WHERE a = 4")
        conn.execute("UPDATE nk SET b = 'y' WHERE a = 2")
    run_it()


def _nan_safe(rows: list[tuple[object, ...]]) -> list[tuple[str, ...]]:
    """Rows with every value as its repr, sorted: NaN compares equal to NaN, as PostgreSQL has it."""
    return sorted(tuple(repr(v) for v in r) for r in rows)


# On Apache Spark in memory only: what differs there (the tables' statistics columns, Spark's own
# NaN-aware joins) is the same for a spilled window, and each classic run of this test costs about 90 s.
@pytest.mark.parametrize(
    "spill", [pytest.param(False, marks=pytest.mark.classic), True], ids=["in-memory", "spilled"]
)
def test_float_keys_with_nan(pgdb: str, tmp_path: Path, spill: bool) -> None:
    """Float primary keys holding NaN, ±Infinity and -0: updates, deletes and key changes of them match.

    PostgreSQL orders NaN as one value equal to itself, so a float key may hold it once; the lake
    must match that row on every engine, whatever its SQL says of ``NaN = NaN``.
    """
    slot, pub = _names()
    lake = tmp_path / "lake"
    specs = [TableSpec("public", "fk", ("k",)), TableSpec("public", "fk2", ("a", "f")), TableSpec("public", "fv", ("id",))]
    big = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 1000) i)"  # kept out of line (TOAST)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE fk (k double precision PRIMARY KEY, v text, big text)")
        conn.execute("CREATE TABLE fk2 (a integer, f real, v text, PRIMARY KEY (a, f))")
        # Floats that are not keys: a file of [NaN, 2.5] must keep its NaN when a MERGE rewrites it.
        conn.execute("CREATE TABLE fv (id integer PRIMARY KEY, x double precision, y real, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE fk, fk2, fv")
        _create_slot(pgdb, slot)
        conn.execute(
            f"INSERT INTO fk VALUES ('NaN', 'nan', {big}), ('Infinity', 'inf', NULL), ('-Infinity', 'ninf', NULL), "
            "('-0', 'zero', NULL), (1.5, 'x', NULL)"
        )
        conn.execute("INSERT INTO fk2 VALUES (1, 'NaN', 'a'), (2, 'NaN', 'b'), (1, 2.5, 'c')")
        conn.execute("INSERT INTO fv VALUES (1, 'NaN', 'NaN', 'a'), (2, 2.5, 1, 'b'), (3, 2.5, 'NaN', 'c')")

    conf = tmp_path / "nan.toml"  # with the SCD2 history and changelog, which key their rows too
    conf.write_text('[lake]\nhistory = "scd2"\nchangelog = true\n')

    def run_it() -> None:
        flags = {"memory_budget": 1, "split_rows": 7} if spill else {}
        run(load(conf, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake), create_slot=True, **flags))
        with psycopg.connect(pgdb) as conn:
            for spec in specs:
                names, pg = pg_rows(conn, spec)
                got = lake_rows(lake, spec)
                assert got is not None and got[0] == names, spec.qualified
                assert _nan_safe(got[1]) == _nan_safe(pg), spec.qualified
                # The history's current versions are the table's rows, each key once.
                history = read_delta(str(lake / spec.schema / f"{spec.name}__history"))
                current = history.filter(history.column("_pg2delta_is_current")).select(names).to_pylist()
                assert _nan_safe([tuple(r.values()) for r in current]) == _nan_safe(pg), spec.qualified

    run_it()
    # Each change of a NaN-keyed row in a window of its own for its table, so each one meets the
    # lake's row (changes of different tables, or of other keys, share a window: -0's update and
    # Infinity's delete each meet their own row in one MERGE).
    windows = [
        [
            "UPDATE fv SET v = 'b2' WHERE id = 2",  # rewrites the file holding the NaNs of rows 1 and 3
            "UPDATE fk SET v = 'nan2' WHERE k = 'NaN'",  # big unchanged: read from the lake's NaN row
            "UPDATE fk2 SET v = 'b2' WHERE a = 2 AND f = 'NaN'",
        ],
        [
            "UPDATE fk SET v = 'zero2' WHERE k = 0",
            "DELETE FROM fk2 WHERE a = 1 AND f = 'NaN'",
            "DELETE FROM fk WHERE k = 'Infinity'",
        ],
        ["UPDATE fk SET k = 'Infinity' WHERE k = 'NaN'"],  # a key change away from NaN
        ["UPDATE fk SET k = 'NaN' WHERE k = 1.5"],  # and onto NaN
    ]
    for steps in windows:
        with psycopg.connect(pgdb, autocommit=True) as conn:
            for step in steps:
                conn.execute(step)
        run_it()
    # Several changes of one NaN key in one window, reduced together.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("DELETE FROM fk WHERE k = 'NaN'")
        conn.execute("INSERT INTO fk VALUES ('NaN', 'again')")
        conn.execute("UPDATE fk SET v = 'again2' WHERE k = 'NaN'")
        conn.execute("INSERT INTO fk2 VALUES (1, 'NaN', 'back')")
        conn.execute("UPDATE fk2 SET v = 'back2' WHERE a = 1 AND f = 'NaN'")
    run_it()
