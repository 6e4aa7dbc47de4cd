"""Another writer at the same time: a compaction and a foreign append committed while a run merges
into the same table. The second writer's commit is made beforehand on a copy of the table as the
run will read it, and landed (its files, then its commit's JSON, created only if absent: Delta's
own rule) by a thread of the test process as soon as the run's new data files appear in the
table's folder: the run has read the table's version and has not committed yet.

The compaction changes no row: the run retries its commit from the new version (one log line) and
ends 0. The append changes rows behind pg2delta's back: the run stops with 21, the slot where it was,
and a resync repairs the table. Either way the lake, read back with delta-rs, equals PostgreSQL, the
changelog holds no change twice and the slot ends where the lake is. On both engines (marker
``classic``): pysail fails its commit on any commit that landed since its read; Apache Spark's
Delta raises ``ConcurrentAppendException`` for both (delta-rs's commits are not blind appends).

On Apache Spark also Apache Spark's own ``OPTIMIZE`` as the second writer. Delta's ``MERGE`` fails
on it with ``ConcurrentAppendException`` too (seen in the retry's line); the run retries. Every retry's line names the other writer's commit and the exception the
engine raised (printed by the test).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from changelog_support import changelog_rows
from engines import TEST_ENGINE
from pg2delta.errors import EXIT_LAKE_CHANGED, EXIT_STATUS_LAKE_CHANGED
from pg2delta.lake.foreign import USER_METADATA
from workload import TableSpec, assert_lake_matches, cli, confirmed_lsn

pytestmark = [pytest.mark.e2e, pytest.mark.classic]

ITEMS = TableSpec("public", "items", ("id",))
ROWS = 20_000
TINY = 64 << 10  # bytes: the files of windows of one row are smaller, the first window's larger


class SecondWriter(threading.Thread):
    """Commits ``action(path)`` to the Delta table at ``path`` once a file appears in its folder
    that was not there when it started (the run's commit is being written); ``action`` returns the
    version it made."""

    def __init__(self, path: Path, action: Callable[[str], int]) -> None:
        super().__init__(daemon=True)
        self.path, self.action = path, action
        self.before = {p.name for p in path.iterdir()}
        self.committed: int | None = None  # the version the second writer's commit made
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if {p.name for p in self.path.iterdir()} - self.before:
                try:
                    self.committed = self.action(str(self.path))
                except Exception as exc:  # it lost the race (its own commit met the run's): said by the test
                    self.error = exc
                return
            time.sleep(0.001)

    def __enter__(self) -> SecondWriter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join(30)


def _compact(path: str) -> None:
    DeltaTable(path).optimize.compact(target_size=TINY)


class Prepared:
    """Another writer's commit, made beforehand by ``make(copy)`` on a copy of ``table`` as the run
    will read it (:meth:`prepare`), landed during the run by :meth:`land`: its new files, then its
    commit's JSON, created only if no commit took that version (Delta's own rule). Landing takes a
    moment, where making it (a compaction, Apache Spark's ``OPTIMIZE``) can take longer than the
    run takes from its files to its commit: made during the run, it lost the race now and then."""

    def __init__(self, table: Path, copy: Path, make: Callable[[Path], None], operation: str) -> None:
        self.table, self.copy, self.make, self.operation = table, copy, make, operation
        self.version = -1

    def prepare(self) -> None:
        shutil.rmtree(self.copy, ignore_errors=True)
        shutil.copytree(self.table, self.copy)
        self.make(self.copy)
        self.version = DeltaTable(str(self.copy)).version()
        assert DeltaTable(str(self.copy)).history(1)[0]["operation"] == self.operation

    def land(self, path: str) -> int:
        for f in self.copy.iterdir():
            if f.is_file() and not (Path(path) / f.name).exists():
                shutil.copy(f, Path(path) / f.name)
        name = f"_delta_log/{self.version:020d}.json"
        os.link(self.copy / name, Path(path) / name)  # FileExistsError: the run's commit took the version
        return self.version


def _spark_optimize(spark: Any) -> Callable[[Path], None]:
    """Apache Spark's ``OPTIMIZE`` with a session of the tests' Spark that does not carry
    pg2delta's mark."""
    session = spark.newSession()
    session.conf.unset(USER_METADATA)

    def optimize(copy: Path) -> None:
        session.sql(f"OPTIMIZE delta.`{copy}`").collect()

    return optimize


def _append_a_row(copy: Path) -> None:
    """An append of one row by another job."""
    row = pa.table({"id": [-1], "v": ["a stray job"], "n": [0]})
    write_deltalake(str(copy), row.cast(pa.schema(DeltaTable(str(copy)).schema().to_arrow())), mode="append")


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def _during_a_run(
    dsn: str, slot: str, common: list[str], table: Path, second_writer: Prepared,
    prepare: Callable[[int], None] = lambda attempt: None,
) -> tuple[int, str, int, str | None]:
    """A run with ``second_writer``'s commit landed while it writes ``table``: its exit code, its
    standard error, the version the second writer made and the slot's position before the run. Up
    to three runs, each with another window (``prepare(attempt)`` first, then the second writer's
    commit made on a copy), while the second writer loses the race (the run took its version first:
    the run proved nothing)."""
    for attempt in range(3):
        prepare(attempt)
        second_writer.prepare()
        # Rows of every file: the run's MERGE reads the small files the compaction removes.
        _sql(dsn, f"UPDATE items SET n = n + 1, v = 'window {attempt}' WHERE id % 3 = {attempt} OR id > {ROWS}")
        before = confirmed_lsn(dsn, slot)
        with SecondWriter(table, second_writer.land) as second:
            done = cli("run", *common)
        if second.committed is not None:
            print(f"{second_writer.operation}: the second writer committed version {second.committed} "
                  f"during run {attempt + 1}")
            return done.returncode, done.stderr, second.committed, before
        assert done.returncode == 0, done.stderr[-3000:]
    raise AssertionError(f"the second writer lost the race three times: the test proved nothing ({second.error})")


def test_a_compaction_and_a_foreign_append_during_a_run(pgdb: str, tmp_path: Path, shared_engine: Any) -> None:
    tag = uuid.uuid4().hex[:8]
    slot, pub, lake = f"slot_{tag}", f"pub_{tag}", tmp_path / "lake"
    _sql(pgdb, "CREATE TABLE items (id int PRIMARY KEY, v text, n int)",
         f"CREATE PUBLICATION {pub} FOR TABLE items",
         f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')")
    config = tmp_path / "c.toml"
    config.write_text(f'[source]\ndsn = "{pgdb}"\nslot = "{slot}"\npublication = "{pub}"\n'
                      f'[lake]\nroot = "{lake}"\nchangelog = true\ndeletion_vectors = false\n[maintain]\ninterval = ""\n')
    common = ["--config", str(config)]
    _sql(pgdb, f"INSERT INTO items SELECT g, 'item ' || g, 0 FROM generate_series(1, {ROWS}) g")
    assert cli("run", *common).returncode == 0
    table = lake / "public" / "items"

    def small_files(attempt: int) -> None:
        """Two small files (windows of a new key each) beside the large one: a fast compaction."""
        for key in (ROWS + 2 * attempt + 1, ROWS + 2 * attempt + 2):
            _sql(pgdb, f"INSERT INTO items VALUES ({key}, 'item', 0)")
            assert cli("run", *common).returncode == 0

    # A compaction (dataChange = false) while the run merges: retried, the run ends 0.
    compaction = Prepared(table, tmp_path / "compacted", lambda copy: _compact(str(copy)), "OPTIMIZE")
    code, stderr, compacted, _ = _during_a_run(pgdb, slot, common, table, compaction, small_files)
    assert code == 0, stderr[-3000:]
    history = {h["version"]: h["operation"] for h in DeltaTable(str(table)).history()}
    retries = [line for line in stderr.splitlines() if "met a concurrent commit that changes no row" in line]
    assert len(retries) == 1 and "OPTIMIZE by delta-rs" in retries[0], (compacted, history, stderr[-3000:])
    assert "the engine raised " in retries[0], retries
    print(retries[0])
    assert history[compacted] == "OPTIMIZE" and max(history) > compacted, history
    assert_lake_matches(pgdb, lake, [ITEMS], context="after a compaction during a run")

    if TEST_ENGINE == "spark":  # Apache Spark's own OPTIMIZE: retried as well
        optimize = Prepared(table, tmp_path / "optimized", _spark_optimize(shared_engine.spark), "OPTIMIZE")

        def small_file(attempt: int) -> None:
            """A small file more for the OPTIMIZE to compact."""
            _sql(pgdb, f"INSERT INTO items VALUES ({ROWS + 10 + attempt}, 'item', 0)")
            assert cli("run", *common).returncode == 0

        code, stderr, optimized, _ = _during_a_run(pgdb, slot, common, table, optimize, small_file)
        assert code == 0, stderr[-3000:]
        retries = [line for line in stderr.splitlines() if "met a concurrent commit that changes no row" in line]
        assert len(retries) == 1 and f"version {optimized}: OPTIMIZE by Apache-Spark" in retries[0], stderr[-3000:]
        assert "the engine raised " in retries[0], retries
        print(retries[0])
        assert_lake_matches(pgdb, lake, [ITEMS], context="after Apache Spark's OPTIMIZE during a run")

    # A foreign append while the run merges: the run stops with 21, the slot where it was.
    append = Prepared(table, tmp_path / "appended", _append_a_row, "WRITE")
    code, stderr, appended, before = _during_a_run(pgdb, slot, common, table, append)
    assert code == EXIT_LAKE_CHANGED, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("pg2delta: lake_changed error")]
    assert len(lines) == 1 and f"version {appended}: WRITE by delta-rs" in lines[0], stderr[-3000:]
    assert "resync --table public.items" in lines[0], lines
    assert confirmed_lsn(pgdb, slot) == before, "the slot moved past a window written over a foreign commit"
    assert cli("run", *common).returncode == EXIT_LAKE_CHANGED, "the next run built on the damaged table"
    assert cli("status", *common).returncode == EXIT_STATUS_LAKE_CHANGED

    assert cli("resync", *common, "--table", "public.items").returncode == 0
    done = cli("run", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_lake_matches(pgdb, lake, [ITEMS], context="resynced after a foreign append during a run")
    with psycopg.connect(pgdb, autocommit=True) as conn:  # the slot is past every change
        waiting = conn.execute("SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                               "'proto_version', '1', 'publication_names', %s)", (slot, pub)).fetchone()
    assert waiting == (0,), waiting
    changes = [(r["_pg2delta_lsn"], r["_pg2delta_pos"]) for r in changelog_rows(lake, ITEMS)]
    assert changes and len(changes) == len(set(changes)), "a change twice in the changelog"
