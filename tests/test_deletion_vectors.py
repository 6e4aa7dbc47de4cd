"""Deletion vectors on Apache Spark: what a window's MERGE reads and rewrites, read from the Delta log.

The tables pg2delta creates on Apache Spark use deletion vectors unless ``[lake] deletion_vectors =
false`` (every other classic test runs on such tables); a table created without them keeps working,
and ``pg2delta maintain`` turns them on. Each lake is read back with delta-rs and compared with
PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from conftest import newest_server_only
from engines import TEST_ENGINE
from lake_read import has_deletion_vectors, key_ranges, last_commit
from pg2delta.job import run
from pg2delta.lake import engine_commits
from pg2delta.lake.engine_writes import DELETION_VECTORS
from pg2delta.maintain import maintain
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import TableSpec, assert_lake_matches, one_transaction, published_table, vectors_config

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.classic,
    pytest.mark.skipif(TEST_ENGINE != "spark", reason="deletion vectors are written on Apache Spark (make test-spark)"),
]

DVT = TableSpec("public", "dvt", ("id",))
ROWS = 400  # per insert transaction: each its own window, its own files of one range of keys


@pytest.fixture
def pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    newest_server_only(pg_server, "what the Delta log says does not depend on the server")
    return pgdb


def _source(dsn: str, transactions: int) -> tuple[str, str]:
    """The table ``dvt`` with ``transactions`` insert transactions of :data:`ROWS` keys each, in key order."""
    inserts = [
        f"INSERT INTO dvt SELECT g, 'row ' || g, g FROM generate_series({t * ROWS + 1}, {(t + 1) * ROWS}) g"
        for t in range(transactions)
    ]
    return published_table(dsn, "CREATE TABLE dvt (id integer PRIMARY KEY, v text, n bigint)", "dvt", *inserts)


def _assert_only_touched(
    table: Path, before: dict[str, tuple[int, int]], keys: set[int], *, untouched: bool = True
) -> dict[str, Any]:
    """The newest commit (the window's overwrite of its keys, else its ``MERGE``) rewrote no file:
    the files holding a key of ``keys`` got a deletion vector (removed and added again under the
    same path), the others (``untouched``: there are some) are not in the commit, and the new data
    files hold only the rows of the window. Returns the commit's metrics."""
    info, adds, removes = last_commit(table)
    assert info["operation"] in ("WRITE", "MERGE"), info["operation"]
    touched = {p for p, (lo, hi) in before.items() if any(lo <= k <= hi for k in keys)}
    assert touched and (touched != set(before) or not untouched), "the test needs touched and untouched files"
    removed = {r["path"] for r in removes}
    readded = {a["path"]: a for a in adds if a["path"] in before}
    assert removed <= touched, ("files without a key of the window were rewritten", removed - touched)
    assert set(readded) == removed, "every file the commit removed is back, with a deletion vector"
    assert all(a.get("deletionVector") for a in readded.values())
    new = [a for a in adds if a["path"] not in before]
    assert sum(json.loads(a["stats"])["numRecords"] for a in new) <= len(keys)
    metrics: dict[str, Any] = info["operationMetrics"]
    if info["operation"] == "MERGE":
        assert int(metrics["numTargetBytesRemoved"]) == 0 and int(metrics["numTargetRowsCopied"]) == 0, metrics
        assert int(metrics["numTargetDeletionVectorsAdded"]) >= 1, metrics  # one per touched file
    else:  # an overwrite of the window's keys: replaceWhere names them
        assert info["operationParameters"]["mode"] == "Overwrite" and " IN (" in info["operationParameters"]["predicate"]
        assert int(metrics["numRemovedBytes"]) == 0, metrics
    return metrics


def _operation(table: Path) -> str:
    return str(last_commit(table)[0]["operation"])


@pytest.fixture
def vectors_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MERGE into a table with deletion vectors writes them (the tests' tables are small:
    by default their MERGEs rewrite the files they touch, pg2delta.lake.engine_commits.VECTORS_FROM_BYTES)."""
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", -1)


def test_a_scattered_update_writes_deletion_vectors_and_rewrites_no_file(
    pgdb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot, pub = _source(pgdb, 4)
    lake = tmp_path / "lake"
    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    default = engine_commits.VECTORS_FROM_BYTES
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", -1)
    run(cfg)
    table = lake / "public" / "dvt"
    assert has_deletion_vectors(table)
    assert DeltaTable(str(table)).metadata().configuration[DELETION_VECTORS] == "true"
    before = key_ranges(table)
    assert len(before) >= 4, before

    # Keys in the first and third transactions' files; the second's and the fourth's are not touched.
    updated, deleted = {10, 2 * ROWS + 7}, {20}
    one_transaction(pgdb, f"UPDATE dvt SET v = 'new', n = -n WHERE id IN ({', '.join(map(str, updated))})", "DELETE FROM dvt WHERE id = 20")
    run(cfg)
    _assert_only_touched(table, before, updated | deleted)
    assert _operation(table) == "WRITE"  # a few keys: an overwrite of them (engine_commits.REPLACE_KEYS_MAX)
    assert_lake_matches(pgdb, lake, [DVT], context="after a scattered update")

    # The same as a MERGE (a window of more keys than the overwrite takes): deletion vectors too.
    before = key_ranges(table)
    keys_max = engine_commits.REPLACE_KEYS_MAX
    monkeypatch.setattr(engine_commits, "REPLACE_KEYS_MAX", 1)
    one_transaction(pgdb, f"UPDATE dvt SET v = 'merged', n = n + 1 WHERE id IN (12, {2 * ROWS + 8})", "DELETE FROM dvt WHERE id = 21")
    run(cfg)
    _assert_only_touched(table, before, {12, 2 * ROWS + 8, 21})
    assert _operation(table) == "MERGE"
    monkeypatch.setattr(engine_commits, "REPLACE_KEYS_MAX", keys_max)
    assert_lake_matches(pgdb, lake, [DVT], context="after a scattered MERGE")

    # Keys of the last transaction's file only: the MERGE's ON clause bounds the table's keys to the
    # window's range (Delta's data skipping then leaves the other files out of its scan); the
    # commit touches that file alone.
    before = key_ranges(table)
    last = {4 * ROWS - 5, 4 * ROWS - 1}
    one_transaction(pgdb, f"UPDATE dvt SET n = 0 WHERE id IN ({', '.join(map(str, last))})")
    run(cfg)
    _assert_only_touched(table, before, last)
    assert_lake_matches(pgdb, lake, [DVT], context="after an update of the newest keys")

    # A table above the size limit writes vectors window after window: the files the last window
    # gave vectors still count (files_now used to drop a file removed and added again in one
    # commit, so every second MERGE took the table for a small one and rewrote it whole).
    size = sum(DeltaTable(str(table)).get_add_actions(flatten=True).column("size_bytes").to_pylist())
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", size // 2)
    for n, keys in enumerate(({13, 3 * ROWS + 3}, {14, 3 * ROWS + 4})):
        before = key_ranges(table)
        one_transaction(pgdb, f"UPDATE dvt SET n = {n} WHERE id IN ({', '.join(map(str, keys))})")
        run(cfg)
        _assert_only_touched(table, before, keys)

    # By default a table as small as this one has its touched files rewritten, without vectors
    # (the overwrite's replaceWhere, as a MERGE would):
    # the file of the first transaction's keys goes, a file without vectors holds its rows anew.
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", default)
    before = key_ranges(table)
    one_transaction(pgdb, "UPDATE dvt SET v = 'small' WHERE id = 11")
    run(cfg)
    info, adds, removes = last_commit(table)
    removed, touched = {r["path"] for r in removes}, {p for p, (lo, hi) in before.items() if lo <= 11 <= hi}
    assert info["operation"] == "WRITE" and removed and removed <= touched, (removed, touched)
    assert int(info["operationMetrics"]["numRemovedBytes"]) > 0, info["operationMetrics"]
    assert not any(a.get("deletionVector") for a in adds) and not {a["path"] for a in adds} & set(before)
    assert_lake_matches(pgdb, lake, [DVT], context="a small table's commit rewriting its touched file")


def test_a_table_created_without_deletion_vectors_keeps_working_and_maintain_turns_them_on(
    pgdb: str, tmp_path: Path, vectors_always: None
) -> None:
    slot, pub = _source(pgdb, 2)
    lake = tmp_path / "lake"
    table = lake / "public" / "dvt"
    run(vectors_config(pgdb, slot, pub, lake, deletion_vectors=False, max_changes=ROWS))  # as earlier versions created tables
    assert not has_deletion_vectors(table)
    assert DELETION_VECTORS not in DeltaTable(str(table)).metadata().configuration

    cfg = vectors_config(pgdb, slot, pub, lake, max_changes=ROWS)
    one_transaction(pgdb, "UPDATE dvt SET n = n + 1 WHERE id IN (3, 500)", "DELETE FROM dvt WHERE id = 7")
    run(cfg)  # the table keeps its protocol: no deletion vectors until maintenance
    assert not has_deletion_vectors(table)
    info, adds, _ = last_commit(table)
    assert info["operation"] == "WRITE" and not any(a.get("deletionVector") for a in adds)
    assert_lake_matches(pgdb, lake, [DVT], context="a table without deletion vectors")

    report = maintain(cfg)
    assert [t.deletion_vectors_enabled for t in report.tables if t.name == DVT.qualified] == [True]
    # pg2delta's own logs and changelogs take appends only: they keep the readers they had.
    assert not any(t.deletion_vectors_enabled for t in report.tables if t.name.startswith("_pg2delta"))
    assert has_deletion_vectors(table)
    assert_lake_matches(pgdb, lake, [DVT], context="after maintain")
    before = key_ranges(table)
    one_transaction(pgdb, "UPDATE dvt SET v = 'x' WHERE id IN (2, 9)")
    run(cfg)
    _assert_only_touched(table, before, {2, 9}, untouched=False)  # maintain compacted the table into one file
    assert_lake_matches(pgdb, lake, [DVT], context="after maintain and a run")
    assert [t.deletion_vectors_enabled for t in maintain(cfg).tables if t.name == DVT.qualified] == [False]

    off = vectors_config(pgdb, slot, pub, lake, deletion_vectors=False, max_changes=ROWS)
    assert [t.deletion_vectors_enabled for t in maintain(off).tables if t.name == DVT.qualified] == [False]
