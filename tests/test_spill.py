"""Windows larger than the memory budget: spilled to staged Parquet, reduced by the engine.

The same workload applied through the in-memory path and through the spilled one (a budget of
one byte: every decoded chunk spills; transactions given out in parts of a few rows) must give
the same lake, the same changelog, and both must equal PostgreSQL (read with delta-rs).
"""

from __future__ import annotations

import json
import signal
import uuid
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from changelog_support import assert_changelog_matches, changelog_rows, setup_source, write_config
from engines import SharedEngine
from lake_read import read_delta
from pg2delta.apply.merge import merge_statement
from pg2delta.config import load
from pg2delta.faults import FAULT_ENV
from pg2delta.job import run
from pg2delta.lake.engine import EngineConfig, Lake
from pg2delta.lake.engine_session import AppendRows
from workload import ACCT, TABLES, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema, lake_rows

pytestmark = pytest.mark.e2e

SPILL = {"memory_budget": 1, "split_rows": 7}


def _second_slot(dsn: str) -> str:
    slot = f"slot_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    return slot


def _source(dsn: str, tmp_path: Path) -> tuple[str, str, Path]:
    """The workload's tables, a publication of them and a slot, and a path for the lake."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    return slot, pub, tmp_path / "lake"


SPILL_ENV = {"PG2DELTA_MEMORY_BUDGET": "1"}


def _killed_spilling(dsn: str, slot: str, pub: str, lake: Path, point: str) -> list[str]:
    """``pg2delta run`` with every chunk spilled, killed at ``point``: the slot has not moved.
    Returns the command, for the rerun (with :data:`SPILL_ENV`)."""
    before = confirmed_lsn(dsn, slot)
    common = ["run", "--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    crashed = cli(*common, env={**SPILL_ENV, FAULT_ENV: point})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert confirmed_lsn(dsn, slot) == before
    return common


def _meta_free(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{k: v for k, v in r.items() if k != "_pg2delta_commit_ts"} for r in rows]


@pytest.mark.classic
def test_spilled_window_equals_in_memory(pgdb: str, tmp_path: Path) -> None:
    """Unchanged TOAST (also across key changes), truncates inside the window, key changes, REPLICA
    IDENTITY FULL, a keyless table and the changelog, through both paths."""
    slot_mem, pub = setup_source(pgdb)
    slot_spill = _second_slot(pgdb)
    lake_mem, lake_spill = tmp_path / "mem", tmp_path / "spill"
    conf_mem = write_config(tmp_path / "mem.toml", pgdb, slot_mem, pub, lake_mem)
    conf_spill = write_config(tmp_path / "spill.toml", pgdb, slot_spill, pub, lake_spill)
    conf_spill.write_text(conf_spill.read_text() + "[window]\nmemory_budget = 1\nsplit_rows = 7\n")
    seed = 9001
    with Workload(pgdb, seed) as wl:
        for steps in (60, 60):
            wl.phase(steps)
            for conf in (conf_mem, conf_spill):
                done = cli("run", "--config", str(conf), "--json")
                assert done.returncode == 0, done.stderr[-3000:]
            spilled = json.loads(done.stdout)
            assert spilled["changes"] > 0
            assert spilled["spilled_rows"] > 0
            for lake in (lake_mem, lake_spill):
                assert_lake_matches(pgdb, lake, context=f"seed {seed}, {lake.name}")
    for spec in TABLES:
        mem, spill = lake_rows(lake_mem, spec), lake_rows(lake_spill, spec)
        assert mem is not None and spill is not None
        assert mem[0] == spill[0], spec.qualified
        assert sorted(mem[1], key=repr) == sorted(spill[1], key=repr), spec.qualified
        assert _meta_free(changelog_rows(lake_mem, spec)) == _meta_free(changelog_rows(lake_spill, spec)), spec.qualified
        assert_changelog_matches(pgdb, lake_spill, spec)


def test_one_transaction_larger_than_the_budget(pgdb: str, tmp_path: Path) -> None:
    """One UPDATE of every row, with a key change and unchanged TOAST, given out in parts and spilled."""
    slot, pub, lake = _source(pgdb, tmp_path)
    big = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 400) g)"  # 12.8 kB: stored out of line
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ALTER TABLE acct ALTER COLUMN body SET STORAGE EXTERNAL")
        conn.execute(f"INSERT INTO acct (id, name, body) SELECT g, 'n' || g, {big} FROM generate_series(1, 3000) g")
    cfg = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake), **SPILL)
    run(cfg)
    assert_lake_matches(pgdb, lake)
    with psycopg.connect(pgdb) as conn:
        # The body is not touched: every update sends it as unchanged TOAST; keys move up by 10000,
        # then some rows change again in the same transaction.
        conn.execute("UPDATE acct SET name = name || '!', id = id + 10000")
        conn.execute("UPDATE acct SET big = id WHERE id % 7 = 0")
        conn.execute("DELETE FROM acct WHERE id % 11 = 0")
        conn.execute("UPDATE acct SET id = id + 100000 WHERE id % 13 = 0")
        conn.commit()
        for k in range(5):  # later transactions: windows after the big one
            conn.execute("UPDATE acct SET big = %s WHERE id = (SELECT min(id) FROM acct)", (k,))
            conn.commit()
    # The big transaction alone is over max_bytes: its window ends at its commit, the next ones follow.
    capped = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake), max_bytes=100_000, **SPILL)
    report = run(capped)
    window = report.windows[0]
    assert window.transactions == 1
    assert len(report.windows) > 1
    assert window.spilled_rows >= 3000
    assert_lake_matches(pgdb, lake)
    assert len(read_delta(str(lake / ACCT.schema / ACCT.name))) == 3000 - 3000 // 11


def test_kill_while_spilling_then_rerun(pgdb: str, tmp_path: Path) -> None:
    slot, pub, lake = _source(pgdb, tmp_path)
    with Workload(pgdb, 9101) as wl:
        wl.phase(50)
    before = confirmed_lsn(pgdb, slot)
    common = _killed_spilling(pgdb, slot, pub, lake, "after_spill")
    spilled = list((lake / "_pg2delta" / "staging").rglob("*.parquet"))
    assert spilled, "the killed run had spilled nothing"
    again = cli(*common, env=SPILL_ENV)
    assert again.returncode == 0, again.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) != before
    assert_lake_matches(pgdb, lake)
    # The rerun emptied the slot's staging folder before it read: the killed run's spill is gone.
    left = [p for p in spilled if p.exists()]
    assert not left, left[:3]
    assert not list((lake / "_pg2delta" / "staging").rglob("*.parquet"))
    # And the rerun, which ended, left no folder of its own for the next run to take as a killed one's.
    assert not list((lake / "_pg2delta" / "staging" / f"slot-{slot}").iterdir())


def test_engine_reduce_with_no_final_row_to_resolve(tmp_path: Path, shared_engine: SharedEngine) -> None:
    """Unchanged TOAST in a spilled window that no final row needs (the key updated again with its
    value, no key change): the chain of rows to resolve is empty, which pysail writes as no file at
    all; the reduce goes on and merges the final row."""
    lake = Lake(str(tmp_path / "lake"))
    uri = lake.table_uri("public", "t")
    write_deltalake(uri, pa.table({"id": pa.array([1, 2], pa.int32()), "body": ["lake 1", "lake 2"]}))
    lake.stage(pa.table({
        "id": pa.array([1, 1, 2], pa.int32()), "body": [None, "new", None],
        "_pg2delta_lsn": pa.array([10, 20, 30], pa.int64()), "_pg2delta_pos": pa.array([1, 1, 1], pa.int64()),
        "_pg2delta_op": ["U", "U", "D"], "_pg2delta_toast": pa.array([["body"], None, None], pa.list_(pa.string())),
    }), "changes/part-000000")
    engine = shared_engine.start(EngineConfig(), lake)
    merged = engine.merge_reduced(
        uri, lake.staging_uri("changes"), lambda t, v: merge_statement(t, v, ["id"], ["id", "body"], truncate=False),
        work="reduce", key_names=["id"], data_columns=["id", "body"], toast_columns=("body",),
        lookup_version=0, nullable_keys=False,
    )
    assert merged == 2
    assert read_delta(uri).to_pylist() == [{"id": 1, "body": "new"}]


@pytest.mark.classic  # Spark's own hash() and pmod() there
def test_engine_reduce_in_buckets_equals_one_query(
    tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past REDUCE_BUCKET_ROWS staged changes the reduce runs one hash bucket of the keys at a time
    (some buckets empty), then one MERGE: the same table as the reduce in one query."""
    import random

    from pg2delta.lake import engine_staged

    rnd = random.Random(12)
    ids, bodies, lsns, ops = [], [], [], []
    for n in range(400):
        key = rnd.randrange(60)
        ids.append(key)
        bodies.append(f"v{n}")
        lsns.append(100 + n)
        ops.append(rnd.choice("IUUD"))
    changes = pa.table({
        "id": pa.array(ids, pa.int32()), "body": bodies,
        "_pg2delta_lsn": pa.array(lsns, pa.int64()), "_pg2delta_pos": pa.array([1] * len(ids), pa.int64()),
        "_pg2delta_op": ops, "_pg2delta_toast": pa.array([None] * len(ids), pa.list_(pa.string())),
    })
    tables = []
    for buckets_rows in (0, 7):
        lake = Lake(str(tmp_path / f"lake-{buckets_rows}"))
        uri = lake.table_uri("public", "t")
        write_deltalake(uri, pa.table({"id": pa.array(range(0, 80, 2), pa.int32()), "body": ["lake"] * 40}))
        lake.stage(changes.slice(0, 200), "changes/part-000000")
        lake.stage(changes.slice(200), "changes/part-000001")
        engine = shared_engine.start(EngineConfig(), lake)
        if buckets_rows:
            monkeypatch.setattr(engine_staged, "REDUCE_BUCKET_ROWS", buckets_rows)
        merged = engine.merge_reduced(
            uri, lake.staging_uri("changes"), lambda t, v: merge_statement(t, v, ["id"], ["id", "body"], truncate=False),
            work="reduce", key_names=["id"], data_columns=["id", "body"], toast_columns=(),
            lookup_version=0, nullable_keys=False, rows=changes.num_rows,
        )
        assert merged == len(set(ids))
        assert DeltaTable(uri).version() == 1  # one commit
        tables.append(sorted(read_delta(uri).to_pylist(), key=lambda r: r["id"]))
    assert tables[0] == tables[1]
    assert len(tables[0]) > 20


def test_embedded_appends_write_bounded_files(
    tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded engine writes a large append (a new table's window) into files of about
    EMBEDDED_FILE_BYTES each (pysail holds a file's rows until it closes it), every row once."""
    from pg2delta.lake import engine_session

    monkeypatch.setattr(engine_session, "EMBEDDED_FILE_BYTES", 1 << 20)
    n = 300_000
    lake = Lake(str(tmp_path / "lake"))
    uri = lake.table_uri("public", "t")
    lake.stage(pa.table({
        "id": pa.array(range(n), pa.int64()), "body": [f"row {i} " + "x" * (i % 50) for i in range(n)],
        "_pg2delta_lsn": pa.array([10] * n, pa.int64()), "_pg2delta_pos": pa.array(range(n), pa.int64()),
        "_pg2delta_op": ["I"] * n, "_pg2delta_toast": pa.array([None] * n, pa.list_(pa.string())),
    }), "changes/part-000000")
    engine = shared_engine.start(EngineConfig(), lake)
    if not engine.embedded:
        pytest.skip("the file size is set on the embedded engine only")
    engine.ensure_table(uri, lake.staging_uri("changes"), ["id", "body"])
    merged = engine.merge_reduced(
        uri, lake.staging_uri("changes"), lambda t, v: AppendRows(("id", "body"), "_pg2delta_op <> 'D'"),
        work="reduce", key_names=["id"], data_columns=["id", "body"], toast_columns=(),
        lookup_version=None, nullable_keys=False, rows=n, distinct_keys=True,
    )
    assert merged == n
    table = DeltaTable(uri)
    sizes = [Path(f).stat().st_size for f in table.file_uris()]
    assert len(sizes) >= 3, sizes
    assert max(sizes) < 2 << 20, sizes
    assert sorted(read_delta(uri, columns=["id"]).column("id").to_pylist()) == list(range(n))


def test_key_buckets_put_equal_keys_together() -> None:
    """The driver's buckets of a spilled window's rows (apply.stage.key_buckets): equal keys, one
    bucket, however the rows are sliced into batches; every type a key is conformed to; NULLs."""
    import datetime
    import decimal

    import numpy as np

    from pg2delta.apply.stage import key_buckets

    n = 3000
    ids = [i % 701 for i in range(n)]
    table = pa.table({
        "i8": pa.array(ids, pa.int64()), "i4": pa.array(ids, pa.int32()), "i2": pa.array([i % 300 for i in ids], pa.int16()),
        "s": pa.array([f"key-{i}" if i % 97 else None for i in ids]), "ls": pa.array([f"k{i}" for i in ids], pa.large_string()),
        "b": pa.array([str(i).encode() for i in ids], pa.binary()),
        "d": pa.array([decimal.Decimal(i) / 100 for i in ids], pa.decimal128(12, 2)),
        "ts": pa.array([datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=i) for i in ids], pa.timestamp("us", tz="UTC")),
        "dt": pa.array([datetime.date(2026, 1, 1) + datetime.timedelta(days=i) for i in ids], pa.date32()),
        "f": pa.array([float(i) if i else -0.0 for i in ids], pa.float64()), "bool": pa.array([i % 2 == 0 for i in ids]),
    })
    for key in (["i8"], ["i4"], ["s"], ["ls"], ["b"], ["d"], ["ts"], ["dt"], ["f"], ["i2", "bool"], ["s", "d", "ts"]):
        whole = key_buckets(table, key, 7)
        assert whole is not None, key
        assert whole.min() >= 0 and whole.max() < 7
        # Sliced at odd places and put together again from separate batches: the same buckets.
        pieces = [key_buckets(table.slice(a, b - a), key, 7) for a, b in ((0, 11), (11, 1500), (1500, n))]
        assert np.array_equal(np.concatenate(pieces), whole), key  # type: ignore[arg-type]
        by_key: dict[tuple[object, ...], int] = {}
        for row, bucket in zip(table.select(key).to_pylist(), whole, strict=True):
            assert by_key.setdefault(tuple(row.values()), int(bucket)) == bucket, (key, row)
        assert len(set(by_key.values())) == 7, key  # 701 keys reach every bucket
    assert key_buckets(table.append_column("l", pa.array([[i] for i in ids])), ["l"], 7) is None
    assert np.array_equal(key_buckets(pa.table({"f": [0.0, -0.0]}), ["f"], 5)[:1], key_buckets(pa.table({"f": [-0.0]}), ["f"], 5))  # type: ignore[index]


def test_spilled_window_in_driver_buckets_equals_in_memory(
    pgdb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past REDUCE_BUCKET_ROWS changes a spilled table is staged in buckets of its key by the driver
    and each of the engine's reduce queries reads one bucket's files: the same lake as the in-memory
    path (tables with unchanged TOAST are reduced in one query, whatever their files)."""
    from pg2delta.apply import stage
    from pg2delta.lake import engine_staged

    monkeypatch.setattr(engine_staged, "REDUCE_BUCKET_ROWS", 25)
    bucketed: list[int] = []
    real = stage.key_buckets

    def spy(table: pa.Table, key: list[str], n: int) -> object:
        bucketed.append(n)
        return real(table, key, n)

    monkeypatch.setattr(stage, "key_buckets", spy)
    slot_mem, pub = setup_source(pgdb)
    slot_spill = _second_slot(pgdb)
    lake_mem, lake_spill = tmp_path / "mem", tmp_path / "spill"
    with Workload(pgdb, 9202) as wl:
        for steps in (60, 60):
            wl.phase(steps)
            run(load(None, env={}, dsn=pgdb, slot=slot_mem, publication=pub, lake=str(lake_mem)))
            report = run(load(None, env={}, dsn=pgdb, slot=slot_spill, publication=pub, lake=str(lake_spill), **SPILL))
            assert sum(w.spilled_rows for w in report.windows) > 0
            for lake in (lake_mem, lake_spill):
                assert_lake_matches(pgdb, lake, context=f"seed 9202, {lake.name}")
    assert bucketed and max(bucketed) > 1
    for spec in TABLES:
        mem, spill = lake_rows(lake_mem, spec), lake_rows(lake_spill, spec)
        assert mem is not None and spill is not None
        assert mem[0] == spill[0], spec.qualified
        assert sorted(mem[1], key=repr) == sorted(spill[1], key=repr), spec.qualified


def test_spilled_inserts_are_merged_without_a_reduce(
    pgdb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spilled window of a table that holds only inserts, under a key PostgreSQL keeps unique
    (a primary key, REPLICA IDENTITY FULL's, a keyless table's position), has one change per key:
    the engine merges the staged changes as they are, with no reduce query, into a table the
    window creates (an append) and into one with rows (a MERGE), also after a truncate in the
    window. A key set in the config, an
    update or a delete in the window: reduced as before. A crash after the commits replays the
    window to the same lake (no row twice)."""
    from pg2delta.lake import engine_staged

    reduced: list[str] = []
    real = engine_staged._Steps.filled

    def spy(self: object, uri: str, *args: object, **kwargs: object) -> str:
        reduced.append(uri.rstrip("/").rsplit("/", 1)[-1])
        return real(self, uri, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_staged._Steps, "filled", spy)
    slot, pub, lake = _source(pgdb, tmp_path)

    def insert(first: int, n: int) -> None:
        with psycopg.connect(pgdb) as conn:
            for lo in range(first, first + n, 50):  # several transactions
                hi = min(lo + 50, first + n)
                conn.execute(
                    "INSERT INTO acct (id, name, amount, body) SELECT g, 'n' || g, g / 7.0, repeat('b', g %% 90) "
                    "FROM generate_series(%s, %s - 1) g", (lo, hi)
                )
                conn.execute("INSERT INTO shop.pair (region, n, qty) SELECT 'r' || (g %% 3), g, g FROM generate_series(%s, %s - 1) g", (lo, hi))
                conn.execute("INSERT INTO fullid (id, val) SELECT g, 'v' || g FROM generate_series(%s, %s - 1) g", (lo, hi))
                conn.execute("INSERT INTO events (kind, n) SELECT 'k', g FROM generate_series(%s, %s - 1) g", (lo, hi))
                conn.commit()

    def spilled_run(config: Path | None = None) -> None:
        report = run(load(config, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake), **SPILL))
        assert sum(w.spilled_rows for w in report.windows) > 0

    insert(1, 200)
    spilled_run()  # every table created by this window: appended
    assert_lake_matches(pgdb, lake, context="inserts into new tables")
    assert reduced == []
    insert(1000, 200)
    spilled_run()  # into tables with rows: MERGEd
    assert_lake_matches(pgdb, lake, context="inserts into tables with rows")
    assert reduced == []

    # Killed after the window's commits, before the slot moved: the rerun merges the same inserts again.
    insert(2000, 150)
    common = _killed_spilling(pgdb, slot, pub, lake, "after_commits")
    again = cli(*common, env=SPILL_ENV)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_lake_matches(pgdb, lake, context="after the crash and the rerun")

    # Keys inserted, truncated and inserted again in one window: only the inserts after the
    # truncate are staged, one per key.
    insert(5000, 50)
    with psycopg.connect(pgdb) as conn:
        conn.execute("TRUNCATE acct, shop.pair, fullid, events")
    insert(5000, 60)
    spilled_run()
    assert_lake_matches(pgdb, lake, context="inserts around a truncate")
    assert reduced == []

    # An update of one table's row: that table's window is reduced, the others' are not.
    insert(3000, 100)
    with psycopg.connect(pgdb) as conn:
        conn.execute("UPDATE acct SET name = 'changed' WHERE id = 3005")
    spilled_run()
    assert_lake_matches(pgdb, lake, context="an update among the inserts")
    assert reduced == ["acct"]

    # A key from the config is not known to be unique: reduced, even with inserts only.
    reduced.clear()
    insert(4000, 100)
    conf = tmp_path / "keys.toml"
    conf.write_text('[tables."shop.pair"]\nkey = ["region", "n"]\n')
    spilled_run(conf)
    assert_lake_matches(pgdb, lake, context="a key from the config")
    assert reduced == ["pair"]
