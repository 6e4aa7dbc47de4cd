"""Schema changes under a running job, end to end on PostgreSQL 15 and 18.

DDL is interleaved with a workload inside single windows (one run, everything in the slot)
and across windows (runs between the statements, or ``--max-changes 1``): columns added
with and without defaults, dropped and renamed, types widened, narrowed and changed to
another kind, replica identity switched, primary keys changed, dropped and changed inside a
transaction, partitioned tables with and without ``publish_via_partition_root`` (attach and
detach), tables renamed and moved to another schema. After every run the lake, read back
with delta-rs, is compared with PostgreSQL under the rules of docs/concepts/schema-changes.md;
refused changes must give one line on stderr, exit 78, an unmoved slot and an
unchanged lake.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from conftest import newest_server_only
from lake_read import read_delta
from pg2delta.config import load
from pg2delta.errors import SchemaError
from pg2delta.job import RunReport, run
from pg2delta.resync import resync
from workload import cli, confirmed_lsn, lake_files

pytestmark = pytest.mark.e2e

EXIT_NEEDS_HUMAN = 78
Key = tuple[Any, ...]


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"slot_{tag}", f"pub_{tag}"


def _sql(dsn: str, *statements: str) -> None:
    """Each statement in its own transaction (autocommit); a string holding several is one transaction."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def _txn(dsn: str, *statements: str) -> None:
    """All statements in one transaction."""
    with psycopg.connect(dsn) as conn:
        for s in statements:
            conn.execute(s)


def _setup(dsn: str, slot: str, pub: str, ddl: str, tables: str, *, pub_options: str = "") -> None:
    _sql(dsn, ddl, f"CREATE PUBLICATION {pub} FOR TABLE {tables}{pub_options}")
    _sql(dsn, f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")


def _run(dsn: str, slot: str, pub: str, lake: Path, conf: Path | None = None, **flags: Any) -> RunReport:
    cfg = load(conf, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake), **flags)
    return run(cfg)


def _cli_run(dsn: str, slot: str, pub: str, lake: Path, conf: Path | None = None) -> Any:
    args = ["run", "--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    if conf is not None:
        args += ["--config", str(conf)]
    return cli(*args)


def _pg(dsn: str, qualified: str, key: Sequence[str]) -> tuple[list[str], dict[Key, dict[str, Any]]]:
    schema, name = qualified.split(".")
    with psycopg.connect(dsn) as conn:
        cols = [
            str(r[0])
            for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
                "ORDER BY attnum",
                (qualified,),
            ).fetchall()
        ]
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        rows = cur.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(schema, name))).fetchall()
    return cols, {tuple(r[k] for k in key): dict(r) for r in rows}


def _lake_table(lake: Path, schema: str, name: str) -> pa.Table:
    return read_delta(str(lake / schema / name))


def _lake(lake: Path, schema: str, name: str, key: Sequence[str]) -> tuple[list[str], dict[Key, dict[str, Any]]]:
    table = _lake_table(lake, schema, name)
    cols = [n for n in table.column_names if not n.startswith("_pg2delta_")]
    rows = table.to_pylist()
    out = {tuple(r[k] for k in key): r for r in rows}
    assert len(out) == len(rows), f"{schema}.{name}: duplicate keys in the lake"
    return cols, out


def assert_lake_equals(
    dsn: str,
    lake: Path,
    qualified: str,
    key: Sequence[str],
    *,
    target: str | None = None,
    kept: Mapping[str, Mapping[Key, Any]] | None = None,
    null_in_lake: Mapping[str, Iterable[Key]] | None = None,
    extra_rows: Mapping[Key, Mapping[str, Any]] | None = None,
    context: str = "",
) -> None:
    """The Delta table (of ``target``, default ``qualified``) equals the PostgreSQL table.

    ``kept``: columns only the lake has (dropped in PostgreSQL) and their value per key (absent: NULL).
    ``null_in_lake``: per column, the keys whose lake value is NULL where PostgreSQL shows a value
    (a column added with a default, rows not written since). ``extra_rows``: rows only the lake has.
    """
    where = f"{target or qualified}{' (' + context + ')' if context else ''}"
    schema, name = (target or qualified).split(".")
    pg_cols, pg = _pg(dsn, qualified, key)
    lake_cols, got = _lake(lake, schema, name, key)
    kept = kept or {}
    assert set(lake_cols) == set(pg_cols) | set(kept), f"{where}: lake columns {lake_cols}, PostgreSQL {pg_cols}, kept {list(kept)}"
    expected_keys = set(pg) | set(extra_rows or {})
    assert set(got) == expected_keys, (
        f"{where}: missing from the lake {sorted(expected_keys - set(got), key=repr)[:5]}, "
        f"not expected {sorted(set(got) - expected_keys, key=repr)[:5]}"
    )
    nulls = {c: set(ks) for c, ks in (null_in_lake or {}).items()}
    for k, lrow in got.items():
        want = dict(extra_rows[k]) if extra_rows and k in extra_rows else dict(pg[k])
        for c in pg_cols:
            exp = None if k in nulls.get(c, set()) else want.get(c)
            assert lrow[c] == exp, f"{where}: row {k} column {c}: lake {lrow[c]!r}, expected {exp!r}"
        for c, values in kept.items():
            assert lrow[c] == values.get(k), f"{where}: row {k} kept column {c}: lake {lrow[c]!r}, expected {values.get(k)!r}"


def lake_types(lake: Path, schema: str, name: str) -> dict[str, pa.DataType]:
    table = _lake_table(lake, schema, name)
    return {f.name: f.type for f in table.schema}


def assert_refused(proc: Any, *fragments: str) -> str:
    """Exit 78 and the error on one line (after the log lines of windows applied before it)."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pg2delta:")]
    assert proc.returncode == EXIT_NEEDS_HUMAN, f"exit {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), f"wanted one error line:\n{proc.stderr[-3000:]}"
    assert errors[0].startswith("pg2delta: schema error:"), errors[0]
    for f in fragments:
        assert f.lower() in errors[0].lower(), (f, errors[0])
    return errors[0]


# --- columns ------------------------------------------------------------------------------------

COLS_DDL = "CREATE TABLE t (id int PRIMARY KEY, a text, b int)"


def _column_workload(dsn: str) -> None:
    """ADD COLUMN (no default), ADD COLUMN with DEFAULT, DROP COLUMN, with changes between them,
    and one transaction that changes rows, adds and drops columns and changes rows again."""
    _sql(
        dsn,
        "INSERT INTO t SELECT g, 'a' || g, g * 10 FROM generate_series(1, 5) g",
        "UPDATE t SET a = 'a1-up' WHERE id = 1",
        "ALTER TABLE t ADD COLUMN c int",
        "INSERT INTO t VALUES (6, 'a6', 60, 600)",
        "UPDATE t SET c = 100 WHERE id = 1",
        "ALTER TABLE t ADD COLUMN d text DEFAULT 'dflt'",
        "UPDATE t SET a = 'a2-up' WHERE id = 2",  # an old row rewritten: PostgreSQL sends d = 'dflt'
        "INSERT INTO t (id, a, b, c) VALUES (7, 'a7', 70, 700)",
        "ALTER TABLE t DROP COLUMN b",
        "UPDATE t SET a = 'a3-up' WHERE id = 3",  # b keeps its value in the lake
        "INSERT INTO t (id, a) VALUES (8, 'a8')",  # b is NULL in the lake
        "DELETE FROM t WHERE id = 5",
    )
    _txn(
        dsn,
        "UPDATE t SET a = 'a4-before' WHERE id = 4",
        "ALTER TABLE t ADD COLUMN e numeric(6,2)",
        "UPDATE t SET e = 4.25 WHERE id = 4",
        "INSERT INTO t (id, a, e) VALUES (9, 'a9', 9.5)",
        "ALTER TABLE t DROP COLUMN c",
        "UPDATE t SET a = 'a6-after' WHERE id = 6",  # c keeps 600 in the lake
        "INSERT INTO t (id, a, e) VALUES (10, 'a10', 10)",
    )


def _expect_columns(dsn: str, lake: Path, context: str) -> None:
    # b was dropped after rows 1-7 were written (5 deleted later); rows updated since keep their b.
    b = {(i,): i * 10 for i in (1, 2, 3, 4, 6, 7)}
    # c was dropped inside the last transaction; row 6, updated after that, keeps 600.
    c = {(1,): 100, (6,): 600, (7,): 700}
    # d was added with a default: PostgreSQL reads it for every older row but sends it only for rows
    # it writes again. Row 1 was not written since: the lake has it from attmissingval (docs/concepts/schema-changes.md).
    _, pg = _pg(dsn, "public.t", ["id"])
    assert pg[(1,)]["d"] == "dflt"
    assert_lake_equals(dsn, lake, "public.t", ["id"], kept={"b": b, "c": c}, context=context)


@pytest.mark.parametrize("max_changes", [None, 1], ids=["one-run-one-window", "a-window-per-transaction"])
def test_columns_added_and_dropped(pgdb: str, tmp_path: Path, max_changes: int | None) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, COLS_DDL, "t")
    _column_workload(pgdb)
    flags = {"max_changes": max_changes} if max_changes else {}
    report = _run(pgdb, slot, pub, lake, **flags)
    assert len(report.windows) >= 5, "every change of shape after a window's first transaction ends that window"
    _expect_columns(pgdb, lake, "after one run")
    types = lake_types(lake, "public", "t")
    assert types["e"] == pa.decimal128(6, 2) and types["c"] == pa.int32() and types["d"] == pa.string()


def test_columns_across_runs(pgdb: str, tmp_path: Path) -> None:
    """The same DDL with a run after every statement: each Relation change lands in a later window."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, COLS_DDL, "t")
    _sql(pgdb, "INSERT INTO t SELECT g, 'a' || g, g * 10 FROM generate_series(1, 5) g", "UPDATE t SET a = 'a1-up' WHERE id = 1")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "ALTER TABLE t ADD COLUMN c int")
    _sql(pgdb, "INSERT INTO t VALUES (6, 'a6', 60, 600)", "UPDATE t SET c = 100 WHERE id = 1")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "ALTER TABLE t ADD COLUMN d text DEFAULT 'dflt'", "UPDATE t SET a = 'a2-up' WHERE id = 2")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "INSERT INTO t (id, a, b, c) VALUES (7, 'a7', 70, 700)", "ALTER TABLE t DROP COLUMN b")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "UPDATE t SET a = 'a3-up' WHERE id = 3", "INSERT INTO t (id, a) VALUES (8, 'a8')", "DELETE FROM t WHERE id = 5")
    _run(pgdb, slot, pub, lake)
    _txn(
        pgdb,
        "UPDATE t SET a = 'a4-before' WHERE id = 4",
        "ALTER TABLE t ADD COLUMN e numeric(6,2)",
        "UPDATE t SET e = 4.25 WHERE id = 4",
        "INSERT INTO t (id, a, e) VALUES (9, 'a9', 9.5)",
        "ALTER TABLE t DROP COLUMN c",
        "UPDATE t SET a = 'a6-after' WHERE id = 6",
        "INSERT INTO t (id, a, e) VALUES (10, 'a10', 10)",
    )
    _run(pgdb, slot, pub, lake)
    _expect_columns(pgdb, lake, "after a run per step")


def test_renamed_column_is_told_from_a_drop_and_an_add(pgdb: str, tmp_path: Path) -> None:
    """pgoutput names columns only by name: a rename looks like a drop and an add. The column's
    ``attnum`` (kept by a rename, never reused by an add) tells them apart: the run stops naming
    resync instead of leaving the renamed column NULL in rows not written since."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE r (id int PRIMARY KEY, old_name text, v int)", "r")
    _sql(pgdb, "INSERT INTO r VALUES (1, 'one', 1), (2, 'two', 2), (3, 'three', 3)")
    _run(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "UPDATE r SET v = 10 WHERE id = 1",
        "ALTER TABLE r RENAME COLUMN old_name TO new_name",
        "UPDATE r SET v = 20 WHERE id = 2",
        "UPDATE r SET new_name = 'THREE' WHERE id = 3",
        "INSERT INTO r VALUES (4, 'four', 4)",
    )
    with pytest.raises(SchemaError, match=r"column new_name of public\.r is new to the lake but not to PostgreSQL") as refused:
        _run(pgdb, slot, pub, lake)
    assert "pg2delta resync --table public.r" in str(refused.value)
    resync(load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake)), ["public.r"])
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.r", ["id"], context="renamed, resynced")

    # A genuinely new column after the resync is an ADD as before (NULL where PostgreSQL reads NULL).
    _sql(pgdb, "ALTER TABLE r ADD COLUMN added int", "UPDATE r SET added = 5 WHERE id = 4")
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.r", ["id"], context="a column added after the resync")

    # Dropped and added again under its old name: the lake's rows would keep the old values.
    _sql(pgdb, "ALTER TABLE r DROP COLUMN v", "ALTER TABLE r ADD COLUMN v int DEFAULT 7", "UPDATE r SET v = 1 WHERE id = 1")
    with pytest.raises(SchemaError, match=r"column v of public\.r was dropped and added again"):
        _run(pgdb, slot, pub, lake)
    # With on_unfollowable = "resync" the run copies it again by itself, then goes on.
    conf = tmp_path / "resync.toml"
    conf.write_text('[tables."public.r"]\non_unfollowable = "resync"\n')
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.r", ["id"], context="dropped and added again, resynced by the run")
    _sql(pgdb, "ALTER TABLE r RENAME COLUMN new_name TO newest", "UPDATE r SET v = 2 WHERE id = 2")
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.r", ["id"], context="renamed again, resynced by the run")

    # Added and renamed before the run reads the catalog: the window that brings the column to the lake
    # finds no number for its name (the soak's seed 5: the rename was taken for a drop and an add with
    # a default, every row given the default, the updates of the column lost).
    _sql(pgdb, "ALTER TABLE r ADD COLUMN x int DEFAULT 9", "UPDATE r SET x = 90 WHERE id = 1",
         "ALTER TABLE r RENAME COLUMN x TO y", "UPDATE r SET v = 3 WHERE id = 3")
    with pytest.raises(SchemaError, match=r"column y of public\.r is new to the lake but not to PostgreSQL"):
        _run(pgdb, slot, pub, lake)
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.r", ["id"], context="added and renamed before the run")

    # A column the lake dropped (dropped_columns = "drop") keeps the number a window gave it: a column
    # added after it, updated and renamed before the run is not numbered as the dropped one (the short
    # soak of 2026-11-28: the rename was taken for a drop and an add with a default, every row given
    # the default, the column's updates lost).
    dropping = tmp_path / "drop.toml"
    dropping.write_text('[tables."public.r"]\ndropped_columns = "drop"\n')
    both = tmp_path / "drop-resync.toml"
    both.write_text('[tables."public.r"]\ndropped_columns = "drop"\non_unfollowable = "resync"\n')
    _sql(pgdb, "ALTER TABLE r ADD COLUMN d int", "UPDATE r SET d = 4 WHERE id = 4")
    _run(pgdb, slot, pub, lake, dropping)
    _sql(pgdb, "ALTER TABLE r DROP COLUMN d", "UPDATE r SET v = 8 WHERE id = 4")
    _run(pgdb, slot, pub, lake, dropping)
    _sql(pgdb, "ALTER TABLE r ADD COLUMN z int DEFAULT 47", "UPDATE r SET z = 1 WHERE id <= 2",
         "ALTER TABLE r RENAME COLUMN z TO z2", "UPDATE r SET z2 = 5 WHERE id = 3")
    with pytest.raises(SchemaError, match=r"column z2 of public\.r is new to the lake but not to PostgreSQL"):
        _run(pgdb, slot, pub, lake, dropping)
    _run(pgdb, slot, pub, lake, both)
    assert_lake_equals(pgdb, lake, "public.r", ["id"], context="a column dropped by the lake, then one added and renamed")


# --- columns added with a default -----------------------------------------------------------------

DEFAULTS_DDL = "CREATE TABLE dv (id int PRIMARY KEY, a text); CREATE TABLE other (id int PRIMARY KEY, v text)"


def _hundred_rows(dsn: str, slot: str, pub: str, lake: Path) -> None:
    """dv with 100 rows in PostgreSQL and in the lake."""
    _setup(dsn, slot, pub, DEFAULTS_DDL, "dv, other")
    _sql(dsn, "INSERT INTO dv SELECT g, 'a' || g FROM generate_series(1, 100) g", "INSERT INTO other VALUES (1, 'a')")
    _run(dsn, slot, pub, lake)


def _server_version(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return int(conn.execute("SHOW server_version_num").fetchone()[0]) // 10000  # type: ignore[index]


@pytest.mark.parametrize(
    "max_changes", [pytest.param(None, marks=pytest.mark.classic), 1], ids=["one-window", "a-window-per-transaction"]
)
def test_constant_default_reaches_rows_already_in_the_lake(pgdb: str, tmp_path: Path, max_changes: int | None) -> None:
    """ADD COLUMN c int DEFAULT 7 on a table of 100 rows, then updates in the same window: the rows not
    written since hold 7 in the lake, as PostgreSQL reads them (attmissingval); rows written since
    hold what PostgreSQL sent."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _hundred_rows(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "ALTER TABLE dv ADD COLUMN c int DEFAULT 7",
        "UPDATE dv SET a = 'touched' WHERE id <= 10",  # PostgreSQL sends c = 7 for these
        "UPDATE dv SET c = 70 WHERE id BETWEEN 11 AND 15",
        "UPDATE dv SET c = NULL WHERE id = 16",
        "DELETE FROM dv WHERE id = 17",
        "INSERT INTO dv VALUES (101, 'new', 1)",
    )
    flags = {"max_changes": max_changes} if max_changes else {}
    _run(pgdb, slot, pub, lake, **flags)
    assert_lake_equals(pgdb, lake, "public.dv", ["id"])
    _, got = _lake(lake, "public", "dv", ["id"])
    assert got[(100,)]["c"] == 7 and got[(1,)]["c"] == 7 and got[(11,)]["c"] == 70
    assert got[(16,)]["c"] is None and (17,) not in got and got[(101,)]["c"] == 1
    assert lake_types(lake, "public", "dv")["c"] == pa.int32()
    # The value is set once, when the column reaches the lake: later changes are merged as usual.
    _sql(pgdb, "UPDATE dv SET c = 8 WHERE id = 99", "UPDATE dv SET a = 'later' WHERE id = 98")
    _run(pgdb, slot, pub, lake, **flags)
    assert_lake_equals(pgdb, lake, "public.dv", ["id"], context="after a later run")


def test_defaults_of_other_types(pgdb: str, tmp_path: Path) -> None:
    """attmissingval's text form goes through the column's codec: text with quotes, commas and
    backslashes, numeric, now(), arrays with NULLs, a type without a decoder of its own (box, whose
    array delimiter is ';'), a domain's default; a column without a default among them stays NULL."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE DOMAIN seven AS int DEFAULT 7; CREATE TABLE ty (id int PRIMARY KEY, a text)", "ty")
    _sql(pgdb, "INSERT INTO ty SELECT g, 'a' || g FROM generate_series(1, 20) g")
    _run(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "ALTER TABLE ty ADD COLUMN s text DEFAULT 'a, \"b\" \\ {c}', ADD COLUMN n numeric(8,2) DEFAULT 12.5, "
        "ADD COLUMN ts timestamptz DEFAULT now(), ADD COLUMN arr int[] DEFAULT '{1,NULL,3}', "
        "ADD COLUMN bx box DEFAULT '((1,1),(0,0))', ADD COLUMN dm seven, ADD COLUMN plain int",
        "UPDATE ty SET a = 'x' WHERE id = 1",
    )
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.ty", ["id"])
    _, got = _lake(lake, "public", "ty", ["id"])
    row = got[(20,)]
    assert row["s"] == 'a, "b" \\ {c}' and row["n"] == Decimal("12.50") and row["arr"] == [1, None, 3]
    assert row["bx"] == "(1,1),(0,0)" and row["dm"] == 7 and row["plain"] is None and row["ts"] is not None


@pytest.mark.parametrize("max_changes", [None, 1], ids=["one-window", "a-window-per-transaction"])
def test_default_with_rows_written_before_and_after_it(pgdb: str, tmp_path: Path, max_changes: int | None) -> None:
    """Rows written in the ALTER's own transaction before it (sent without the column) read the default in
    PostgreSQL too; rows inserted and updated after it keep what PostgreSQL sent. Also for a table
    the lake sees for the first time in that transaction."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _hundred_rows(pgdb, slot, pub, lake)
    _sql(pgdb, "CREATE TABLE nd (id int PRIMARY KEY, a text)", f"ALTER PUBLICATION {pub} ADD TABLE nd")
    _txn(
        pgdb,
        "INSERT INTO dv VALUES (101, 'before')",
        "UPDATE dv SET a = 'before' WHERE id = 1",
        "INSERT INTO nd SELECT g, 'before' FROM generate_series(1, 5) g",
        "ALTER TABLE dv ADD COLUMN c int DEFAULT 7",
        "ALTER TABLE nd ADD COLUMN c text DEFAULT 'seven'",
        "INSERT INTO dv VALUES (102, 'after', 1)",
        "UPDATE dv SET c = 20 WHERE id = 2",
        "INSERT INTO dv (id, a) VALUES (103, 'after, default')",
        "INSERT INTO nd VALUES (6, 'after', 'six')",
    )
    _sql(
        pgdb,
        "INSERT INTO dv VALUES (104, 'later', NULL)",
        "UPDATE dv SET a = 'later' WHERE id = 3",
        "UPDATE dv SET c = 30 WHERE id = 101",
        "DELETE FROM dv WHERE id = 4",
        "UPDATE nd SET a = 'later' WHERE id = 2",
    )
    flags = {"max_changes": max_changes} if max_changes else {}
    _run(pgdb, slot, pub, lake, **flags)
    assert_lake_equals(pgdb, lake, "public.dv", ["id"])
    assert_lake_equals(pgdb, lake, "public.nd", ["id"])
    _, got = _lake(lake, "public", "dv", ["id"])
    assert [got[(i,)]["c"] for i in (1, 2, 3, 50, 101, 102, 103, 104)] == [7, 20, 7, 7, 30, 1, 7, None]
    _, nd = _lake(lake, "public", "nd", ["id"])
    assert [nd[(i,)]["c"] for i in range(1, 7)] == ["seven"] * 5 + ["six"]


def test_column_added_without_a_default_stays_null(pgdb: str, tmp_path: Path) -> None:
    """No default (or DEFAULT NULL, which PostgreSQL does not even record): the rows read NULL, in the lake too."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _hundred_rows(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "ALTER TABLE dv ADD COLUMN c int",
        "ALTER TABLE dv ADD COLUMN d text DEFAULT NULL",
        "UPDATE dv SET c = 5, d = 'x' WHERE id = 1",
        "UPDATE dv SET a = 'y' WHERE id = 2",
    )
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.dv", ["id"])
    _, got = _lake(lake, "public", "dv", ["id"])
    assert got[(1,)]["c"] == 5 and got[(50,)]["c"] is None and got[(50,)]["d"] is None


def test_columns_added_to_a_table_without_a_key(pg_server: Any, pgdb: str, tmp_path: Path) -> None:
    """A table without a key is appended by commit position (``_pg2delta_lsn``, ``_pg2delta_pos``,
    NOT NULL in its Delta table): pysail 0.7.2's ``mergeSchema`` append added no column to such a
    table, so the MERGE failed, and every run after it (exit 78; found by ``make soak``, a column
    added to ``pgbench_history``). Columns added with and without a default, rows before and after."""
    newest_server_only(pg_server, "the lake's side does not depend on the server")
    slot, pub = _names()
    lake = tmp_path / "lake"
    _sql(pgdb, "CREATE TABLE hist (tid int, delta int, at timestamptz)",
         "INSERT INTO hist SELECT g, g, '2026-01-01' FROM generate_series(1, 20) g", f"CREATE PUBLICATION {pub} FOR TABLE hist")
    boot = cli("bootstrap", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake))
    assert boot.returncode == 0, boot.stderr[-2000:]
    _sql(pgdb, "INSERT INTO hist VALUES (21, 1, now())", "ALTER TABLE hist ADD COLUMN note text",
         "INSERT INTO hist VALUES (22, 2, now(), 'n')", "ALTER TABLE hist ADD COLUMN c int DEFAULT 7",
         "INSERT INTO hist VALUES (23, 3, now(), 'm', 8)")
    done = _cli_run(pgdb, slot, pub, lake)
    assert done.returncode == 0, done.stderr[-2000:]
    names = ["tid", "delta", "at", "note", "c"]
    with psycopg.connect(pgdb) as conn:
        pg = sorted(conn.execute("SELECT tid, delta, at, note, c FROM hist").fetchall())
    table = _lake_table(lake, "public", "hist")
    assert sorted(zip(*(table.column(n).to_pylist() for n in names), strict=True)) == pg
    assert pg[21] == (22, 2, pg[21][2], "n", 7) and pg[19][3:] == (None, 7)


@pytest.mark.parametrize(
    ("statements", "column"),
    [
        (("ALTER TABLE dv ADD COLUMN c timestamptz DEFAULT clock_timestamp()",), "c"),
        (("ALTER TABLE dv ADD COLUMN c uuid DEFAULT gen_random_uuid()",), "c"),
        (("ALTER TABLE dv ADD COLUMN c int GENERATED ALWAYS AS IDENTITY",), "c"),
        (("ALTER TABLE dv ADD COLUMN c int DEFAULT 7", "VACUUM FULL dv"), "c"),
        (("ALTER TABLE dv ADD COLUMN g int GENERATED ALWAYS AS (id * 2) STORED",), "g"),
    ],
    ids=["clock_timestamp", "gen_random_uuid", "identity", "rewritten-since", "stored-generated"],
)
def test_default_pg2delta_cannot_know_is_refused(
    pgdb: str, tmp_path: Path, statements: tuple[str, ...], column: str
) -> None:
    """PostgreSQL computed the rows' values in a rewrite it does not send, or a rewrite since cleared
    attmissingval: refused (exit 78) naming pg2delta resync, nothing of the window applied, slot unmoved."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    generated = column == "g"
    if generated and _server_version(pgdb) < 18:
        pytest.skip("PostgreSQL publishes stored generated columns from 18 on")
    _setup(pgdb, slot, pub, DEFAULTS_DDL, "dv, other", pub_options=" WITH (publish_generated_columns = stored)" if generated else "")
    _sql(pgdb, "INSERT INTO dv SELECT g, 'a' || g FROM generate_series(1, 100) g", "INSERT INTO other VALUES (1, 'a')")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "INSERT INTO other VALUES (2, 'b')", *statements, "UPDATE dv SET a = 'x' WHERE id = 1")
    before_slot, before_lake = confirmed_lsn(pgdb, slot), lake_files(lake)
    proc = _cli_run(pgdb, slot, pub, lake)
    line = assert_refused(proc, f"column {column} of public.dv", "pg2delta resync --table public.dv")
    assert "nothing of this window was applied" in line
    assert confirmed_lsn(pgdb, slot) == before_slot, "the slot moved past a refused window"
    assert lake_files(lake) == before_lake, "a refused window wrote to the lake"
    again = _cli_run(pgdb, slot, pub, lake)
    assert_refused(again, "pg2delta resync --table public.dv")
    assert confirmed_lsn(pgdb, slot) == before_slot


def test_volatile_default_on_a_table_without_rows_goes_on(pgdb: str, tmp_path: Path) -> None:
    """No row was written before the column: nothing to know, nothing refused."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, DEFAULTS_DDL, "dv, other")
    _sql(pgdb, "INSERT INTO dv VALUES (1, 'a')")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "DELETE FROM dv")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "ALTER TABLE dv ADD COLUMN c timestamptz DEFAULT clock_timestamp()", "INSERT INTO dv (id, a) VALUES (2, 'b')")
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.dv", ["id"])


@pytest.mark.parametrize("point", ["after_schema_change", pytest.param("after_commits", marks=pytest.mark.classic)])
def test_crash_after_the_default_was_set_then_rerun(pgdb: str, tmp_path: Path, point: str) -> None:
    """SIGKILL after the rewrite that set the default on the lake's rows (before the MERGE), or after the
    MERGE (before the applied log): the slot stays, and the rerun (with other window caps) gives the same lake."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _hundred_rows(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "ALTER TABLE dv ADD COLUMN c int DEFAULT 7",
        "UPDATE dv SET c = 70 WHERE id <= 5",
        "UPDATE dv SET a = 'x' WHERE id BETWEEN 6 AND 8",
        "INSERT INTO dv VALUES (101, 'new', NULL)",
    )
    before = confirmed_lsn(pgdb, slot)
    crashed = cli(
        "run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), env={"PG2DELTA_CRASH_AT": point}
    )
    assert crashed.returncode == -9, (crashed.returncode, crashed.stderr[-2000:])
    assert confirmed_lsn(pgdb, slot) == before
    _, got = _lake(lake, "public", "dv", ["id"])
    assert got[(50,)]["c"] == 7, "the rows already in the lake got the default before the MERGE"
    if point == "after_schema_change":
        assert got[(1,)]["c"] == 7 and (101,) not in got
    _run(pgdb, slot, pub, lake, max_changes=1)
    assert_lake_equals(pgdb, lake, "public.dv", ["id"])


@pytest.mark.parametrize("mode", ["via-root", "partitions-to-root", "leaf-tables"])
def test_default_on_a_partitioned_table(pgdb: str, tmp_path: Path, mode: str) -> None:
    """PostgreSQL keeps attmissingval on the leaf partitions (the root has no storage)."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    conf = None
    if mode == "partitions-to-root":
        conf = tmp_path / "root.toml"
        conf.write_text('[tables."public.m"]\npartitions = "root"\n')
    _setup(pgdb, slot, pub, PART_DDL, "m", pub_options=" WITH (publish_via_partition_root = true)" if mode == "via-root" else "")
    _sql(pgdb, "INSERT INTO m SELECT g, g * 10, 'v' || g FROM generate_series(1, 15) g")
    _run(pgdb, slot, pub, lake, conf)
    _sql(pgdb, "ALTER TABLE m ADD COLUMN c int DEFAULT 5", "UPDATE m SET c = 6 WHERE id = 1", "UPDATE m SET v = 'w' WHERE id = 12")
    _run(pgdb, slot, pub, lake, conf)
    if mode == "leaf-tables":
        for part in ("m1", "m2"):
            assert_lake_equals(pgdb, lake, f"public.{part}", ["id", "k"])
    else:
        assert_lake_equals(pgdb, lake, "public.m", ["id", "k"])
        _, got = _lake(lake, "public", "m", ["id", "k"])
        assert got[(2, 20)]["c"] == 5 and got[(1, 10)]["c"] == 6


# --- types --------------------------------------------------------------------------------------

WIDE_DDL = "CREATE TABLE w (id int PRIMARY KEY, s int2, f float4, v varchar(5), n numeric(8,2), i int4)"


@pytest.mark.classic
def test_type_widening(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, WIDE_DDL, "w")
    _sql(pgdb, "INSERT INTO w VALUES (1, 32767, 1.5, 'abcde', 123456.78, 7), (2, -5, -0.25, 'x', -1.05, 8)")
    _run(pgdb, slot, pub, lake)
    assert lake_types(lake, "public", "w")["s"] == pa.int16()
    # Inside one run: int2 -> int4 with rows before and after, then int4 -> int8 and the others.
    _sql(
        pgdb,
        "INSERT INTO w (id, s) VALUES (3, 3)",
        "ALTER TABLE w ALTER s TYPE int4",
        "INSERT INTO w (id, s) VALUES (4, 2000000000)",
        "ALTER TABLE w ALTER s TYPE int8",
        "UPDATE w SET s = 9000000000000000000 WHERE id = 1",
        "ALTER TABLE w ALTER f TYPE float8, ALTER v TYPE text, ALTER n TYPE numeric(14,4)",
        "UPDATE w SET f = 1e300, v = 'longer than five', n = 1234567890.1234 WHERE id = 2",
        "ALTER TABLE w ALTER i TYPE numeric(12,2)",
        "UPDATE w SET i = 99999.99 WHERE id = 3",
    )
    # One transaction widening a column between two changes of the same row.
    _txn(
        pgdb,
        "UPDATE w SET f = 2.5 WHERE id = 1",
        "ALTER TABLE w ALTER f TYPE float8",  # already float8: a Relation message of the same shape
        "INSERT INTO w (id, s, n) VALUES (5, 5, 5.5)",
    )
    _run(pgdb, slot, pub, lake)
    types = lake_types(lake, "public", "w")
    assert types["s"] == pa.int64() and types["f"] == pa.float64() and types["v"] == pa.string()
    assert types["n"] == pa.decimal128(14, 4) and types["i"] == pa.decimal128(12, 2)
    assert_lake_equals(pgdb, lake, "public.w", ["id"])
    _, pg = _pg(pgdb, "public.w", ["id"])
    assert pg[(1,)]["s"] == 9000000000000000000 and pg[(2,)]["n"] == Decimal("1234567890.1234")


def test_widening_inside_one_transaction(pgdb: str, tmp_path: Path) -> None:
    """Rows of the old and the new type in one transaction (one window): merged at the wider type."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE w1 (id int PRIMARY KEY, s int2, n numeric(6,2))", "w1")
    _sql(pgdb, "INSERT INTO w1 VALUES (1, 1, 1.25)")
    _run(pgdb, slot, pub, lake)
    _txn(
        pgdb,
        "INSERT INTO w1 VALUES (2, 2, 2.5)",
        "UPDATE w1 SET s = 11 WHERE id = 1",
        "ALTER TABLE w1 ALTER s TYPE int8, ALTER n TYPE numeric(10,3)",
        "INSERT INTO w1 VALUES (3, 5000000000, 1234567.125)",
        "UPDATE w1 SET n = 0.001 WHERE id = 2",
    )
    _run(pgdb, slot, pub, lake)
    types = lake_types(lake, "public", "w1")
    assert types["s"] == pa.int64() and types["n"] == pa.decimal128(10, 3)
    assert_lake_equals(pgdb, lake, "public.w1", ["id"])


@pytest.mark.parametrize(
    ("alter", "new_value", "fragments"),
    [
        ("ALTER TABLE nt ALTER x TYPE int4", "42", ("public.nt", "column x", "from bigint to int (PostgreSQL integer)", "narrowing", 'narrowing = "keep"')),
        ("ALTER TABLE nt ALTER x TYPE text USING x::text", "'42'", ("public.nt", "column x", "from bigint to string (PostgreSQL text)", "pg2delta resync --table public.nt")),
    ],
    ids=["narrowing", "other-kind"],
)
def test_type_change_refused(pgdb: str, tmp_path: Path, alter: str, new_value: str, fragments: tuple[str, ...]) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE nt (id int PRIMARY KEY, x int8); CREATE TABLE other (id int PRIMARY KEY, v text)", "nt, other")
    _sql(pgdb, "INSERT INTO nt VALUES (1, 10), (2, 20)", "INSERT INTO other VALUES (1, 'a')")
    _run(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "INSERT INTO other VALUES (2, 'b')",  # same window as the refused change: must not be applied
        alter,
        f"UPDATE nt SET x = {new_value} WHERE id = 1",
        "INSERT INTO other VALUES (3, 'c')",
    )
    before_slot = confirmed_lsn(pgdb, slot)
    before_lake = lake_files(lake)
    proc = _cli_run(pgdb, slot, pub, lake)
    line = assert_refused(proc, *fragments)
    assert "nothing of this window was applied" in line
    assert confirmed_lsn(pgdb, slot) == before_slot, "the slot moved past a refused window"
    assert lake_files(lake) == before_lake, "a refused window wrote to the lake"
    _, other = _lake(lake, "public", "other", ["id"])
    assert sorted(other) == [(1,)]
    if "int4" in alter:
        # The documented way out: keep the Delta column wide.
        conf = tmp_path / "keep.toml"
        conf.write_text('[tables."public.nt"]\nnarrowing = "keep"\n')
        _run(pgdb, slot, pub, lake, conf)
        assert lake_types(lake, "public", "nt")["x"] == pa.int64()
        assert_lake_equals(pgdb, lake, "public.nt", ["id"])
        assert_lake_equals(pgdb, lake, "public.other", ["id"])
    else:
        again = _cli_run(pgdb, slot, pub, lake)
        assert_refused(again, "column x")
        assert confirmed_lsn(pgdb, slot) == before_slot


# --- keys -----------------------------------------------------------------------------------------


def test_replica_identity_full_switch(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE ri (id int PRIMARY KEY, v text, big text)", "ri")
    _sql(pgdb, "INSERT INTO ri SELECT g, 'v' || g, repeat(md5(g::text), 400) FROM generate_series(1, 6) g")
    _run(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "UPDATE ri SET v = 'before' WHERE id = 1",
        "ALTER TABLE ri REPLICA IDENTITY FULL",
        "UPDATE ri SET v = 'full' WHERE id = 2",
        "UPDATE ri SET id = 20 WHERE id = 3",
        "DELETE FROM ri WHERE id = 4",
    )
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.ri", ["id"], context="after the switch to FULL")
    _sql(
        pgdb,
        "UPDATE ri SET v = 'full2' WHERE id = 5",
        "ALTER TABLE ri REPLICA IDENTITY DEFAULT",
        "UPDATE ri SET v = 'default' WHERE id = 6",
        "DELETE FROM ri WHERE id = 20",
    )
    _run(pgdb, slot, pub, lake, max_changes=1)
    assert_lake_equals(pgdb, lake, "public.ri", ["id"], context="after the switch back")


@pytest.mark.classic
def test_primary_key_changed_between_transactions(pgdb: str, tmp_path: Path) -> None:
    """A new primary key: changes before it merge on the old key, changes after on the new one."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE pk (id int PRIMARY KEY, code text NOT NULL, v text)", "pk")
    _sql(pgdb, "INSERT INTO pk SELECT g, 'c' || g, 'v' || g FROM generate_series(1, 6) g")
    _run(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "UPDATE pk SET v = 'old key' WHERE id = 1",
        "DELETE FROM pk WHERE id = 2",
        "ALTER TABLE pk DROP CONSTRAINT pk_pkey, ADD PRIMARY KEY (code)",
        # With the key on code, id is an ordinary column: an update may give two rows the same id.
        "UPDATE pk SET id = 3 WHERE code = 'c4'",
        "UPDATE pk SET code = 'c5x' WHERE code = 'c5'",
        "DELETE FROM pk WHERE code = 'c6'",
        "INSERT INTO pk VALUES (7, 'c7', 'new')",
    )
    report = _run(pgdb, slot, pub, lake)
    assert len(report.windows) >= 2, "the window must end where the key changes"
    assert_lake_equals(pgdb, lake, "public.pk", ["code"])


def test_primary_key_dropped_and_added_again(pgdb: str, tmp_path: Path) -> None:
    """No key and REPLICA IDENTITY DEFAULT: PostgreSQL publishes inserts only; they are appended.
    A primary key added later is used for the changes after it."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE nk2 (id int PRIMARY KEY, v text)", "nk2")

    def lake_pairs() -> list[tuple[Any, Any]]:
        return sorted((r["id"], r["v"]) for r in _lake_table(lake, "public", "nk2").select(["id", "v"]).to_pylist())

    def pg_pairs() -> list[tuple[Any, Any]]:
        with psycopg.connect(pgdb) as conn:
            return sorted(conn.execute("SELECT id, v FROM nk2").fetchall())

    _sql(pgdb, "INSERT INTO nk2 VALUES (1, 'a'), (2, 'b')", "UPDATE nk2 SET v = 'a2' WHERE id = 1")
    _sql(pgdb, "ALTER TABLE nk2 DROP CONSTRAINT nk2_pkey", "INSERT INTO nk2 VALUES (3, 'c'), (5, 'e')")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "INSERT INTO nk2 VALUES (4, 'd')")
    _run(pgdb, slot, pub, lake, max_changes=1)
    assert lake_pairs() == pg_pairs()
    assert "_pg2delta_lsn" in _lake_table(lake, "public", "nk2").column_names
    _sql(
        pgdb,
        "INSERT INTO nk2 VALUES (6, 'f')",
        "ALTER TABLE nk2 ADD PRIMARY KEY (id)",
        "UPDATE nk2 SET v = 'c2' WHERE id = 3",  # a row the lake got while the table had no key
        "DELETE FROM nk2 WHERE id = 1",
        "UPDATE nk2 SET id = 50 WHERE id = 5",
    )
    _run(pgdb, slot, pub, lake)
    assert lake_pairs() == pg_pairs()


def test_key_change_inside_a_transaction_is_refused(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE kx (id int PRIMARY KEY, code text NOT NULL, v text)", "kx")
    _sql(pgdb, "INSERT INTO kx SELECT g, 'c' || g, 'v' FROM generate_series(1, 3) g")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "UPDATE kx SET v = 'applied' WHERE id = 1")
    _txn(
        pgdb,
        "DELETE FROM kx WHERE id = 2",
        "ALTER TABLE kx DROP CONSTRAINT kx_pkey, ADD PRIMARY KEY (code)",
        "UPDATE kx SET id = 1 WHERE code = 'c3'",
    )
    before = lake_files(lake)
    proc = _cli_run(pgdb, slot, pub, lake)
    # The transaction before the key change is applied in its own window, then the run stops.
    assert_refused(proc, "public.kx", "changed its key from (id) to (code)")
    _, got = _lake(lake, "public", "kx", ["id"])
    assert got[(1,)]["v"] == "applied" and (2,) in got, "the window before the key change is applied, the rest not"
    assert lake_files(lake) != before
    slot_at = confirmed_lsn(pgdb, slot)
    again = _cli_run(pgdb, slot, pub, lake)
    assert_refused(again, "public.kx")
    assert confirmed_lsn(pgdb, slot) == slot_at


def test_full_identity_primary_key_changed_between_runs(pgdb: str, tmp_path: Path) -> None:
    """REPLICA IDENTITY FULL tables are keyed on the primary key the catalog has when the job runs.
    Pending changes may predate a change of that key: refused until the config names the key."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE fk (id int PRIMARY KEY, code text NOT NULL, v text)", "fk")
    _sql(pgdb, "ALTER TABLE fk REPLICA IDENTITY FULL", "INSERT INTO fk SELECT g, 'c' || g, 'v' FROM generate_series(1, 4) g")
    _run(pgdb, slot, pub, lake)
    _sql(pgdb, "ALTER TABLE fk DROP CONSTRAINT fk_pkey, ADD PRIMARY KEY (code)")
    _sql(pgdb, "UPDATE fk SET id = 1 WHERE code = 'c2'", "DELETE FROM fk WHERE code = 'c3'", "INSERT INTO fk VALUES (9, 'c9', 'n')")
    slot_at = confirmed_lsn(pgdb, slot)
    before = lake_files(lake)
    proc = _cli_run(pgdb, slot, pub, lake)
    assert_refused(proc, "public.fk", "replica identity full", "now (code)", "merged on (id)", 'key = [...]')
    assert confirmed_lsn(pgdb, slot) == slot_at and lake_files(lake) == before
    # Every pending change came after the new key: name it for one run.
    conf = tmp_path / "key.toml"
    conf.write_text('[tables."public.fk"]\nkey = ["code"]\n')
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.fk", ["code"])
    # The lake was merged on (code), the catalog's key: no setting needed any more.
    _sql(pgdb, "UPDATE fk SET v = 'later' WHERE code = 'c4'")
    _run(pgdb, slot, pub, lake)
    assert_lake_equals(pgdb, lake, "public.fk", ["code"])


# --- partitions -----------------------------------------------------------------------------------

PART_DDL = """
CREATE TABLE m (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);
CREATE TABLE m1 PARTITION OF m FOR VALUES FROM (0) TO (100);
CREATE TABLE m2 PARTITION OF m FOR VALUES FROM (100) TO (200);
"""


def _partition_workload(dsn: str) -> None:
    _sql(
        dsn,
        "INSERT INTO m SELECT g, g * 10, 'v' || g FROM generate_series(1, 15) g",
        "UPDATE m SET v = 'moved', k = 150 WHERE id = 2",  # from m1 to m2: a delete and an insert
        "UPDATE m SET v = 'up' WHERE id = 12",
        "DELETE FROM m WHERE id = 3",
        "CREATE TABLE m3 (id int, k int, v text, PRIMARY KEY (id, k))",
        "ALTER TABLE m ATTACH PARTITION m3 FOR VALUES FROM (200) TO (300)",
        "INSERT INTO m VALUES (30, 250, 'in m3'), (31, 299, 'in m3')",
        "UPDATE m SET k = 260 WHERE id = 12",  # from m2 to the attached m3
    )


def test_partitions_via_root(pgdb: str, tmp_path: Path) -> None:
    """publish_via_partition_root: one Delta table for the root; detached rows make the run stop,
    or stay in it with ``detached_partitions = "keep"``."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, PART_DDL, "m", pub_options=" WITH (publish_via_partition_root = true)")
    _sql(pgdb, "INSERT INTO m VALUES (100, 5, 'first')")
    _run(pgdb, slot, pub, lake)
    _partition_workload(pgdb)
    _run(pgdb, slot, pub, lake)
    with psycopg.connect(pgdb) as conn:
        in_m1 = {(r[0], r[1]): {"id": r[0], "k": r[1], "v": r[2]} for r in conn.execute("SELECT id, k, v FROM m1")}
    _sql(pgdb, "ALTER TABLE m DETACH PARTITION m1", "UPDATE m1 SET v = 'detached' WHERE id = 1")
    # PostgreSQL sends no deletes for a detached partition's rows.
    with pytest.raises(SchemaError, match=r"public\.m1 left public\.m \(DETACH PARTITION or DROP\)"):
        _run(pgdb, slot, pub, lake)
    conf = tmp_path / "keep.toml"
    conf.write_text('[tables."public.m"]\ndetached_partitions = "keep"\n')
    _run(pgdb, slot, pub, lake, conf)
    assert not (lake / "public" / "m1").exists() and not (lake / "public" / "m3").exists()
    # Kept: the rows stay in the root's Delta table as they were when it was detached (the later
    # update of m1 is not published).
    assert_lake_equals(pgdb, lake, "public.m", ["id", "k"], extra_rows=in_m1)
    # A TRUNCATE of one partition is not sent in this mode (only one of the root is): the run
    # notices it (test_resync.py has the rest) and stops, or copies the root again when allowed,
    # and the rows kept from m1 go with that copy.
    _sql(pgdb, "TRUNCATE m2")
    with pytest.raises(SchemaError, match=r"public\.m2 was truncated alone .* pg2delta resync --table public\.m"):
        _run(pgdb, slot, pub, lake, conf)
    conf.write_text('[tables."public.m"]\ndetached_partitions = "keep"\non_unfollowable = "resync"\n')
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.m", ["id", "k"])
    _sql(pgdb, "TRUNCATE m", "INSERT INTO m VALUES (1, 150, 'after truncate')")
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.m", ["id", "k"])


def test_partitions_as_leaf_tables(pgdb: str, tmp_path: Path) -> None:
    """Without publish_via_partition_root (the default): a Delta table per partition."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, PART_DDL, "m")
    _partition_workload(pgdb)
    _run(pgdb, slot, pub, lake)
    assert not (lake / "public" / "m").exists()
    for part in ("m1", "m2", "m3"):
        assert_lake_equals(pgdb, lake, f"public.{part}", ["id", "k"])
    _sql(pgdb, "TRUNCATE m1", "INSERT INTO m VALUES (1, 1, 'after truncate')", "TRUNCATE m")
    _sql(pgdb, "INSERT INTO m VALUES (2, 150, 'after truncate')")
    _run(pgdb, slot, pub, lake)
    for part in ("m1", "m2", "m3"):
        assert_lake_equals(pgdb, lake, f"public.{part}", ["id", "k"], context="after truncates")


def test_partitions_mapped_to_root(pgdb: str, tmp_path: Path) -> None:
    """Without publish_via_partition_root, partitions = "root": every partition into the root's Delta table."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, PART_DDL, "m")
    conf = tmp_path / "root.toml"
    conf.write_text('[tables."public.m"]\npartitions = "root"\n')
    _sql(pgdb, "INSERT INTO m VALUES (100, 5, 'first')")
    _run(pgdb, slot, pub, lake, conf)
    _partition_workload(pgdb)
    _run(pgdb, slot, pub, lake, conf, max_changes=3)
    assert sorted(p.name for p in (lake / "public").iterdir()) == ["m"]
    assert_lake_equals(pgdb, lake, "public.m", ["id", "k"])
    _sql(pgdb, "INSERT INTO m VALUES (40, 40, 'x')", "TRUNCATE m", "INSERT INTO m VALUES (1, 150, 'after truncate')")
    _run(pgdb, slot, pub, lake, conf)
    assert_lake_equals(pgdb, lake, "public.m", ["id", "k"], context="after TRUNCATE of the root")
    # Some partitions only: the rows to delete from the root's Delta table are not known.
    _sql(pgdb, "INSERT INTO m VALUES (2, 2, 'y')", "TRUNCATE m1")
    slot_at = confirmed_lsn(pgdb, slot)
    proc = _cli_run(pgdb, slot, pub, lake, conf)
    assert_refused(proc, "truncate of partition(s) public.m1", 'partitions = "leaf"')
    assert confirmed_lsn(pgdb, slot) == slot_at


# --- tables renamed and moved ---------------------------------------------------------------------


def test_table_renamed_and_moved_keeps_its_delta_table(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE orig (id int PRIMARY KEY, v text); CREATE SCHEMA arch", "orig")
    _sql(pgdb, "INSERT INTO orig SELECT g, 'v' || g FROM generate_series(1, 4) g")
    _run(pgdb, slot, pub, lake)
    _sql(
        pgdb,
        "ALTER TABLE orig RENAME TO renamed",
        "UPDATE renamed SET v = 'after rename' WHERE id = 1",
        "ALTER TABLE renamed SET SCHEMA arch",
        "DELETE FROM arch.renamed WHERE id = 2",
        "INSERT INTO arch.renamed VALUES (5, 'new')",
    )
    _run(pgdb, slot, pub, lake)
    assert not (lake / "public" / "renamed").exists() and not (lake / "arch").exists()
    assert_lake_equals(pgdb, lake, "arch.renamed", ["id"], target="public.orig")

    # A new table under the old name is another relation: its changes must not land in the old
    # table's Delta table.
    _sql(pgdb, "CREATE TABLE orig (id int PRIMARY KEY, v text)", f"ALTER PUBLICATION {pub} ADD TABLE orig")
    _sql(pgdb, "INSERT INTO orig VALUES (1, 'another table')")
    slot_at = confirmed_lsn(pgdb, slot)
    proc = _cli_run(pgdb, slot, pub, lake)
    assert_refused(proc, "public.orig", "relation oid")
    assert confirmed_lsn(pgdb, slot) == slot_at
    assert_lake_equals(pgdb, lake, "arch.renamed", ["id"], target="public.orig")


# --- crashes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("point", [pytest.param("after_schema_change", marks=pytest.mark.classic), "after_commits"])
def test_crash_after_a_schema_change_then_rerun(pgdb: str, tmp_path: Path, point: str) -> None:
    """SIGKILL after the Delta table was widened, had columns dropped and added, before the MERGE (or
    before the applied log): the slot stays, and the rerun (with other window caps) gives the same lake."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    conf = tmp_path / "drop.toml"
    conf.write_text('[tables."public.cr"]\ndropped_columns = "drop"\n')
    _setup(pgdb, slot, pub, "CREATE TABLE cr (id int PRIMARY KEY, s int2, gone text, big text)", "cr")
    _sql(pgdb, "INSERT INTO cr SELECT g, g, 'g' || g, repeat(md5(g::text), 300) FROM generate_series(1, 6) g")
    _run(pgdb, slot, pub, lake, conf)
    _txn(
        pgdb,
        "UPDATE cr SET s = 10 WHERE id = 1",
        "ALTER TABLE cr ALTER s TYPE int8, DROP COLUMN gone, ADD COLUMN extra numeric(5,1)",
        "UPDATE cr SET s = 5000000000, extra = 1.5 WHERE id = 2",  # big is unchanged TOAST
        "INSERT INTO cr (id, s) VALUES (7, 7)",
        "UPDATE cr SET id = 30 WHERE id = 3",
    )
    _sql(pgdb, "UPDATE cr SET extra = 2.5 WHERE id = 4", "DELETE FROM cr WHERE id = 5")
    before = confirmed_lsn(pgdb, slot)
    args = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake), "--config", str(conf)]
    crashed = cli(*args, env={"PG2DELTA_CRASH_AT": point})
    assert crashed.returncode == -9, (crashed.returncode, crashed.stderr[-2000:])
    assert confirmed_lsn(pgdb, slot) == before
    if point == "after_schema_change":
        types = lake_types(lake, "public", "cr")
        # gone is still in a shape of this window (the transaction's first change): it goes with the next one.
        assert types["s"] == pa.int64() and "gone" in types and "extra" in types, types
    _run(pgdb, slot, pub, lake, conf, max_changes=1)
    assert_lake_equals(pgdb, lake, "public.cr", ["id"], null_in_lake={"extra": []})


# --- random DDL among random changes --------------------------------------------------------------

_WIDER = {"int2": "int4", "int4": "int8", "float4": "float8", "numeric(6,2)": "numeric(10,3)", "varchar(8)": "text"}
_NEW_TYPES = ["int2", "int4", "float4", "numeric(6,2)", "varchar(8)", "text"]


def _value(rng: Any, typ: str) -> str:
    if typ.startswith("int"):
        return str(rng.randint(-30000, 30000))
    if typ.startswith("float"):
        return str(rng.randint(-400, 400) / 4)  # exact in float4
    if typ.startswith("numeric"):
        return f"{rng.randint(-999999, 999999) / 100:.2f}"
    if typ == "text" and rng.random() < 0.3:
        return f"repeat(md5('{rng.random()}'), 200)"  # stored out of line: later updates send unchanged TOAST
    return f"'{rng.choice(['x', 'yy', 'zzz', 'abcdefgh'])}'"


@pytest.mark.parametrize("seed", [101, 202, 303])
def test_random_ddl_among_changes(pgdb: str, tmp_path: Path, seed: int) -> None:
    """Seeded random columns added, dropped and widened, inside and between transactions, among inserts,
    updates (with unchanged TOAST), key changes and deletes, with runs of random window caps between;
    the lake must equal PostgreSQL on PostgreSQL's columns after every run."""
    import random

    rng = random.Random(seed)
    slot, pub = _names()
    lake = tmp_path / "lake"
    _setup(pgdb, slot, pub, "CREATE TABLE rd (id int PRIMARY KEY, c0 int2, c1 text)", "rd")
    _sql(pgdb, "ALTER TABLE rd ALTER c1 SET STORAGE EXTERNAL")
    cols: dict[str, str] = {"c0": "int2", "c1": "text"}
    ids: list[int] = []
    next_id, next_col, runs = 1, 2, 0
    log: list[str] = []

    def statement() -> str:
        nonlocal next_id, next_col
        r = rng.random()
        if r < 0.3 or not ids:
            n = next_id
            next_id += 1
            ids.append(n)
            names = [c for c in cols if rng.random() < 0.7]
            values = [_value(rng, cols[c]) for c in names]
            return f"INSERT INTO rd (id{''.join(', ' + c for c in names)}) VALUES ({n}{''.join(', ' + v for v in values)})"
        if r < 0.55:
            c = rng.choice(list(cols))
            return f"UPDATE rd SET {c} = {_value(rng, cols[c])} WHERE id = {rng.choice(ids)}"
        if r < 0.62:
            old = rng.choice(ids)
            ids.remove(old)
            ids.append(next_id)
            next_id += 1
            return f"UPDATE rd SET id = {ids[-1]} WHERE id = {old}"
        if r < 0.7:
            gone = rng.choice(ids)
            ids.remove(gone)
            return f"DELETE FROM rd WHERE id = {gone}"
        if r < 0.8:
            name, typ = f"c{next_col}", rng.choice(_NEW_TYPES)
            next_col += 1
            cols[name] = typ
            return f"ALTER TABLE rd ADD COLUMN {name} {typ}"
        if r < 0.88 and len(cols) > 1:
            name = rng.choice(list(cols))
            del cols[name]
            return f"ALTER TABLE rd DROP COLUMN {name}"
        wider = [c for c in cols if cols[c] in _WIDER]
        if not wider:
            return "UPDATE rd SET id = id WHERE false"
        name = rng.choice(wider)
        cols[name] = _WIDER[cols[name]]
        return f"ALTER TABLE rd ALTER {name} TYPE {cols[name]}"

    for step in range(70):
        group = [statement() for _ in range(rng.choice([1, 1, 1, 2, 3, 4]))]
        log.append(" ; ".join(group))
        _txn(pgdb, *group)
        if rng.random() < 0.15 or step == 69:
            runs += 1
            cap = rng.choice([None, 1, 2, 5])
            _run(pgdb, slot, pub, lake, **({"max_changes": cap} if cap else {}))
            context = f"seed {seed}, run {runs} after step {step}; last statements: {log[-3:]}"
            _, got = _lake(lake, "public", "rd", ["id"])
            pg_cols, pg = _pg(pgdb, "public.rd", ["id"])
            assert set(got) == set(pg), context
            for k, row in pg.items():
                for c in pg_cols:
                    # A column added after the table's last change is not in the lake yet: all NULL.
                    lake_value = got[k].get(c)
                    assert lake_value == row[c], f"{context}: row {k} column {c}: lake {lake_value!r}, PostgreSQL {row[c]!r}"
