"""Deletion vectors on the embedded engine (pysail): what a window's commit reads and rewrites,
read from the Delta log, and every lake read back with delta-rs and compared with PostgreSQL.

The tables pg2delta creates there use deletion vectors too (``[lake] deletion_vectors``, default
on): a window into a large table is pysail's ``MERGE``, which writes a vector on each file holding
a key of the window and the window's rows in a new file, instead of rewriting every file a
scattered window touches (pg2delta.lake.engine_commits.RangeRewrites._merges_with_vectors).
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from conftest import newest_server_only
from engines import TEST_ENGINE
from lake_read import has_deletion_vectors, key_ranges, last_commit, read_delta
from pg2delta.bootstrap import run_bootstrap
from pg2delta.job import run
from pg2delta.lake import engine_commits
from pg2delta.lake.engine_writes import DELETION_VECTORS
from pg2delta.maintain import maintain
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import TableSpec, assert_lake_matches, one_transaction, published_table, vectors_config

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(TEST_ENGINE != "embedded", reason="the embedded engine's commits (Apache Spark's: test_deletion_vectors)"),
]

DVT = TableSpec("public", "dvt", ("id",))
ROWS = 400  # per insert transaction: each its own window, its own file of one range of keys
CREATE = "CREATE TABLE dvt (id integer PRIMARY KEY, v text, n bigint)"


@pytest.fixture
def pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    newest_server_only(pg_server, "what the Delta log says does not depend on the server")
    return pgdb


@pytest.fixture
def vectors_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every window into a table with deletion vectors is merged with them (the tests' tables are
    small: by default their windows rewrite the files they touch, engine_commits.VECTORS_FROM_BYTES)."""
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", -1)


def _inserts(transactions: int) -> list[str]:
    return [
        f"INSERT INTO dvt SELECT g, 'row ' || g, g FROM generate_series({t * ROWS + 1}, {(t + 1) * ROWS}) g"
        for t in range(transactions)
    ]


def _assert_vectors_only(table: Path, before: dict[str, tuple[int, int]], keys: set[int]) -> None:
    """The newest commit is a ``MERGE`` that rewrote no file: the files holding a key of ``keys``
    are removed and added again under their own path with a deletion vector, the other files of
    ``before`` are not in the commit, and the new files hold only the window's rows."""
    info, adds, removes = last_commit(table)
    assert info["operation"] == "MERGE", info["operation"]
    touched = {p for p, (lo, hi) in before.items() if any(lo <= k <= hi for k in keys)}
    assert touched and touched != set(before), "the test needs touched and untouched files"
    removed = {r["path"] for r in removes}
    readded = {a["path"]: a for a in adds if a["path"] in before}
    assert removed <= touched, ("files without a key of the window are in the commit", removed - touched)
    assert removed and set(readded) == removed, "each file the commit removed is back under its own path"
    assert all(a.get("deletionVector") for a in readded.values()), "with a deletion vector"
    new = [a for a in adds if a["path"] not in before]
    assert sum(json.loads(a["stats"])["numRecords"] for a in new) <= len(keys)


def _protocol_is_clean(table: Path) -> None:
    """Deletion vectors on, and no reader feature the table does not use (delta-rs 1.6's protocol
    upgrade adds ``variantType``, which Delta 3.3 refuses to read)."""
    dt = DeltaTable(str(table))
    assert dt.metadata().configuration.get(DELETION_VECTORS) == "true"
    assert dt.protocol().reader_features == ["deletionVectors"], dt.protocol()


def test_a_scattered_window_writes_deletion_vectors_and_rewrites_no_file(
    pgdb: str, tmp_path: Path, vectors_always: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot, pub = published_table(pgdb, CREATE, "dvt", *_inserts(4))
    lake = tmp_path / "lake"
    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    run(cfg)
    table = lake / "public" / "dvt"
    assert has_deletion_vectors(table)
    _protocol_is_clean(table)
    before = key_ranges(table)
    assert len(before) >= 4, before

    # Keys in the first and third transactions' files, an insert; the second's and the fourth's
    # files are not in the commit.
    updated, deleted = {10, 2 * ROWS + 7}, {20}
    one_transaction(pgdb, f"UPDATE dvt SET v = 'new', n = -n WHERE id IN ({', '.join(map(str, updated))})",
            "DELETE FROM dvt WHERE id = 20", f"INSERT INTO dvt VALUES ({4 * ROWS + 1}, 'inserted', 1)")
    run(cfg)
    _assert_vectors_only(table, before, updated | deleted)
    assert_lake_matches(pgdb, lake, [DVT], context="after a scattered window")

    # A file with a vector takes another one: the rows both windows removed stay removed.
    before = key_ranges(table)
    one_transaction(pgdb, "UPDATE dvt SET v = 'again' WHERE id IN (11, 12)", "DELETE FROM dvt WHERE id = 10")
    run(cfg)
    _assert_vectors_only(table, before, {10, 11, 12})
    assert_lake_matches(pgdb, lake, [DVT], context="after a second window into the same file")

    # A window of more rows than the MERGE takes is a rewrite of the files that hold its keys.
    monkeypatch.setattr(engine_commits, "EMBEDDED_VECTOR_MERGE_ROWS", 1)
    one_transaction(pgdb, "UPDATE dvt SET n = 7 WHERE id IN (13, 14)")
    run(cfg)
    info, adds, _ = last_commit(table)
    assert info["operation"] == "WRITE" and not any(a.get("deletionVector") for a in adds), info["operation"]
    assert_lake_matches(pgdb, lake, [DVT], context="after a rewrite of a table with vectors")

    # Compaction (delta-rs) leaves the rows the vectors removed out; the table still matches.
    maintain(cfg)
    assert_lake_matches(pgdb, lake, [DVT], context="after maintain")
    one_transaction(pgdb, f"UPDATE dvt SET v = 'after' WHERE id IN (15, {3 * ROWS})")
    run(cfg)
    assert_lake_matches(pgdb, lake, [DVT], context="after maintain and a window")

    # A truncate is the rewrite, which writes the window's rows alone (a MERGE would mark every row).
    one_transaction(pgdb, "TRUNCATE dvt", "INSERT INTO dvt VALUES (1, 'after the truncate', 1)")
    run(cfg)
    info, adds, _ = last_commit(table)
    assert info["operation"] == "WRITE" and not any(a.get("deletionVector") for a in adds), info["operation"]
    assert_lake_matches(pgdb, lake, [DVT], context="after a truncate")


def test_a_small_table_is_rewritten_without_vectors(pgdb: str, tmp_path: Path) -> None:
    slot, pub = published_table(pgdb, CREATE, "dvt", *_inserts(2))
    lake = tmp_path / "lake"
    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    run(cfg)
    table = lake / "public" / "dvt"
    _protocol_is_clean(table)
    before = set(key_ranges(table))
    one_transaction(pgdb, "UPDATE dvt SET v = 'small' WHERE id = 11")
    run(cfg)
    info, adds, removes = last_commit(table)
    assert info["operation"] == "WRITE", info["operation"]
    assert not any(a.get("deletionVector") for a in adds) and {r["path"] for r in removes} <= before
    assert_lake_matches(pgdb, lake, [DVT], context="a small table's window")


def test_a_bootstrapped_table_uses_deletion_vectors(pgdb: str, tmp_path: Path, vectors_always: None) -> None:
    """The bootstrap's copy, adopted as version 0 by delta-rs, gets deletion vectors in a commit of
    pysail's (with a protocol Apache Spark reads), keeping the statistics' settings."""
    slot, pub = published_table(pgdb, CREATE, "dvt")
    one_transaction(pgdb, *_inserts(3))
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    lake = tmp_path / "lake"
    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    report = run_bootstrap(cfg)
    assert [t.rows for t in report.copied] == [3 * ROWS]
    table = lake / "public" / "dvt"
    _protocol_is_clean(table)
    configuration = DeltaTable(str(table)).metadata().configuration
    assert "delta.dataSkippingStatsColumns" in configuration or "delta.dataSkippingNumIndexedCols" in configuration, configuration
    assert_lake_matches(pgdb, lake, [DVT], context="after the bootstrap")

    one_transaction(pgdb, "UPDATE dvt SET v = 'b' WHERE id IN (5, 6)", f"INSERT INTO dvt VALUES ({3 * ROWS + 1}, 'new', 0)")
    run(cfg)
    info, adds, _ = last_commit(table)
    assert info["operation"] == "MERGE" and any(a.get("deletionVector") for a in adds), info["operation"]
    assert_lake_matches(pgdb, lake, [DVT], context="after the bootstrap and a window")


def test_maintain_turns_deletion_vectors_on_for_an_older_table(pgdb: str, tmp_path: Path, vectors_always: None) -> None:
    slot, pub = published_table(pgdb, CREATE, "dvt", *_inserts(3))
    lake = tmp_path / "lake"
    table = lake / "public" / "dvt"
    run(vectors_config(pgdb, slot, pub, lake, deletion_vectors=False, max_changes=ROWS))  # as earlier versions created tables
    assert not has_deletion_vectors(table)
    version = DeltaTable(str(table)).version()

    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    report = maintain(cfg)
    assert [t.deletion_vectors_enabled for t in report.tables if t.name == DVT.qualified] == [True]
    assert not any(t.deletion_vectors_enabled for t in report.tables if t.name.startswith("_pg2delta"))
    _protocol_is_clean(table)
    assert [t.deletion_vectors_enabled for t in maintain(cfg).tables if t.name == DVT.qualified] == [False]
    assert not list(Path(tmp_path).glob("**/pg2delta_props_*")), "the name the statement used leaves nothing behind"

    # maintain compacted the table into one file: the window's keys are in it.
    one_transaction(pgdb, "UPDATE dvt SET v = 'x' WHERE id IN (2, 9)", "DELETE FROM dvt WHERE id = 3")
    run(cfg)
    info, adds, _ = last_commit(table)
    assert info["operation"] == "MERGE" and any(a.get("deletionVector") for a in adds), info["operation"]
    assert_lake_matches(pgdb, lake, [DVT], context="after maintain turned vectors on and a window")
    # The version before vectors reads as it was: delta-rs time travel.
    assert read_delta(table, version).num_rows == 3 * ROWS


def test_a_window_in_few_files_rewrites_them(pgdb: str, tmp_path: Path, vectors_always: None) -> None:
    """A window whose keys are in files holding at most an eighth of the table's rows
    (engine_commits.VECTOR_MERGE_FROM_FRACTION) rewrites those files, without vectors: pysail's
    ``MERGE`` would read the whole table."""
    slot, pub = published_table(pgdb, CREATE, "dvt", *_inserts(10))
    lake = tmp_path / "lake"
    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    run(cfg)
    table = lake / "public" / "dvt"
    before = key_ranges(table)
    assert len(before) >= 10, before
    one_transaction(pgdb, f"UPDATE dvt SET v = 'recent' WHERE id IN ({10 * ROWS - 3}, {10 * ROWS - 1})")
    run(cfg)
    info, adds, removes = last_commit(table)
    touched = {p for p, (lo, hi) in before.items() if lo <= 10 * ROWS - 1 <= hi}
    assert info["operation"] == "WRITE", info["operation"]
    assert {r["path"] for r in removes} == touched and not any(a.get("deletionVector") for a in adds)
    assert_lake_matches(pgdb, lake, [DVT], context="a window in one file of ten")
