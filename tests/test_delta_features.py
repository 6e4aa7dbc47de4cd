"""The Delta features of the tables pg2delta creates ([lake] and [tables."s.t"] properties,
partition_by, cluster_by, change_data_feed, column_mapping), on the engine under test, and the refusal of
features the embedded engine cannot write. Every lake is read back with delta-rs and compared
with PostgreSQL (by column name: pysail puts partition columns last in a table's schema).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from conftest import newest_server_only
from engines import TEST_ENGINE
from pg2delta.backfill import backfill
from pg2delta.bootstrap import run_bootstrap
from pg2delta.config import Config, TableConfig, load
from pg2delta.delta_features import FeatureSettings
from pg2delta.errors import ConfigError, LakeError, Pg2DeltaError
from pg2delta.job import run
from pg2delta.lake.engine_features import TableFeatures
from pg2delta.maintain import maintain
from pg2delta.resync import resync
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import TableSpec, assert_same_rows, cli, confirmed_lsn, lake_rows, pg_rows, published_table

pytestmark = [pytest.mark.e2e]

FEAT = TableSpec("public", "feat", ("id",))


@pytest.fixture
def pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    newest_server_only(pg_server, "which Delta features a table gets does not depend on the server")
    return pgdb


def _config(tmp_path: Path, dsn: str, slot: str, pub: str, lake: Path, text: str) -> Config:
    path = tmp_path / f"pg2delta-{uuid.uuid4().hex[:6]}.toml"
    path.write_text(text)
    return load(path, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake), engine=TEST_ENGINE)


def lake_rows_of(path: Path) -> list[dict[str, Any]]:
    return DeltaTable(str(path)).to_pyarrow_table().to_pylist()


def _transaction(dsn: str, *statements: str) -> None:
    """``statements`` in one transaction of PostgreSQL's."""
    with psycopg.connect(dsn) as conn:
        for statement in statements:
            conn.execute(statement)


def _assert_equal_by_name(dsn: str, lake: Path, spec: TableSpec, where: str) -> None:
    with psycopg.connect(dsn) as conn:
        names, pg = pg_rows(conn, spec)
    got = lake_rows(lake, spec)
    assert got is not None, where
    idx = [got[0].index(n) for n in names]
    assert_same_rows(spec, names, pg, (names, [tuple(r[i] for i in idx) for r in got[1]]), where)


FEATURES = """
[lake]
properties = { "delta.logRetentionDuration" = "interval 60 days" }

[tables."public.feat"]
partition_by = ["region"]
changelog = true
properties = { "delta.checkpointInterval" = 5 }
"""


def test_properties_and_partitions_on_new_and_existing_tables(pgdb: str, tmp_path: Path) -> None:
    slot, pub = published_table(
        pgdb, "CREATE TABLE feat (id int PRIMARY KEY, region text, v text)", "feat",
        "INSERT INTO feat SELECT g, 'r' || (g % 3), 'v' || g FROM generate_series(1, 30) g",
    )
    lake = tmp_path / "lake"
    cfg = _config(tmp_path, pgdb, slot, pub, lake, FEATURES)
    run(cfg)  # the run's append creates the table
    table = lake / "public" / "feat"
    meta = DeltaTable(str(table)).metadata()
    assert meta.partition_columns == ["region"]
    assert meta.configuration["delta.logRetentionDuration"] == "interval 60 days"
    assert meta.configuration["delta.checkpointInterval"] == "5"
    _assert_equal_by_name(pgdb, lake, FEAT, "after the first run")

    # A property added to the config reaches the existing table before the next window's commit;
    # rows move between partitions.
    more = FEATURES + 'change_data_feed = false\n'
    more = more.replace('"delta.checkpointInterval" = 5', '"delta.checkpointInterval" = 5, "delta.deletedFileRetentionDuration" = "interval 14 days"')
    cfg = _config(tmp_path, pgdb, slot, pub, lake, more)
    with psycopg.connect(pgdb) as conn:
        conn.execute("UPDATE feat SET region = 'r9', v = 'moved' WHERE id % 5 = 0")
        conn.execute("DELETE FROM feat WHERE id % 7 = 0")
    run(cfg)
    conf = DeltaTable(str(table)).metadata().configuration
    assert conf["delta.deletedFileRetentionDuration"] == "interval 14 days", conf
    assert conf["delta.enableChangeDataFeed"] == "false", conf
    _assert_equal_by_name(pgdb, lake, FEAT, "after the second run")

    # pg2delta backfill --into a new folder creates its copy partitioned and with the properties as
    # configured, both seeded from the main table (time travel to the first window) and from the
    # lake's start (no seed: created by the replay's first write).
    windows = [w for w in lake_rows_of(lake / "_pg2delta" / "applied_log") if w["table_name"] == "feat"]
    end = max(w["window_end"] for w in windows)
    for n, a in enumerate((min(w["window_start"] for w in windows), min(w["window_end"] for w in windows))):
        into = tmp_path / f"copy{n}"
        backfill(cfg, a, end, into=str(into))
        copy = DeltaTable(str(into / "public" / "feat")).metadata()
        assert copy.partition_columns == ["region"], (n, copy)
        assert copy.configuration["delta.checkpointInterval"] == "5", (n, copy.configuration)
        _assert_equal_by_name(pgdb, into, FEAT, f"backfill --into {'from the start' if n == 0 else 'seeded'}")

    # A resync writes the table whole again: partitioned as configured, properties kept.
    with psycopg.connect(pgdb) as conn:
        conn.execute("INSERT INTO feat VALUES (100, 'r1', 'late')")
    resync(cfg, ["public.feat"])
    meta = DeltaTable(str(table)).metadata()
    assert meta.partition_columns == ["region"]
    assert meta.configuration["delta.logRetentionDuration"] == "interval 60 days"
    _assert_equal_by_name(pgdb, lake, FEAT, "after the resync")


@pytest.mark.skipif(TEST_ENGINE != "embedded", reason="what the embedded engine refuses")
def test_embedded_engine_refuses_features_it_cannot_write(pgdb: str, tmp_path: Path) -> None:
    slot, pub = published_table(
        pgdb, "CREATE TABLE feat (id int PRIMARY KEY, region text, v text)", "feat",
        "INSERT INTO feat SELECT g, 'r', 'v' FROM generate_series(1, 5) g",
    )
    lake = tmp_path / "lake"
    for text in ("[lake]\nchange_data_feed = true\n", '[tables."public.feat"]\ncolumn_mapping = "name"\n',
                 '[tables."public.feat"]\ncluster_by = ["region"]\n',
                 '[lake]\nproperties = { "delta.enableDeletionVectors" = true }\n'):
        with pytest.raises(ConfigError) as refused:
            _config(tmp_path, pgdb, slot, pub, lake, text)
        assert refused.value.exit_code == 78 and "embedded engine" in refused.value.one_line()
        assert "\n" not in refused.value.one_line()
    with pytest.raises(ConfigError, match="forbids the updates and deletes"):
        _config(tmp_path, pgdb, slot, pub, lake, '[lake]\nproperties = { "delta.appendOnly" = true }\n')
    assert not lake.exists()

    # A table written with column mapping (as Apache Spark writes it when configured so; here
    # through the configuration's check, which a lake moved between engines does not pass again):
    # the embedded engine refuses its next window before anything is written.
    cfg = _config(tmp_path, pgdb, slot, pub, lake, "")
    mapped = dataclasses.replace(cfg, tables={"public.feat": TableConfig(delta=FeatureSettings(column_mapping="name"))})
    run(mapped)
    table = lake / "public" / "feat"
    assert "columnMapping" in (DeltaTable(str(table)).protocol().writer_features or [])
    with psycopg.connect(pgdb) as conn:
        conn.execute("UPDATE feat SET v = 'w' WHERE id = 1")
    version, before = DeltaTable(str(table)).version(), confirmed_lsn(pgdb, slot)
    with pytest.raises(LakeError) as refused_table:
        run(cfg)
    assert refused_table.value.exit_code == 78 and "columnMapping" in str(refused_table.value), refused_table.value
    assert DeltaTable(str(table)).version() == version
    assert confirmed_lsn(pgdb, slot) == before


CDF = TableSpec("public", "cdf", ("id",))
CM = TableSpec("public", "cm", ("id",))


@pytest.mark.classic
@pytest.mark.skipif(TEST_ENGINE != "spark", reason="Change Data Feed is written on Apache Spark (make test-spark)")
def test_change_data_feed_reproduces_every_window(
    pgdb: str, tmp_path: Path, shared_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After windows of inserts, updates, deletes, a truncate and a key change, Spark's
    ``table_changes`` replayed over the table's first version gives the table PostgreSQL has; the
    table uses column mapping (name mode) and is partitioned. Column renames with column mapping:
    followed in place, also after a run that stopped between the rename's commit and its log row
    (unchanged TOAST of the renamed column kept); one transaction that updates, renames and updates
    again is refused."""
    slot, pub = published_table(
        pgdb, "CREATE TABLE cdf (id int PRIMARY KEY, region text, v text)", "cdf",
        "INSERT INTO cdf SELECT g, 'r' || (g % 2), 'v' || g FROM generate_series(1, 20) g",
    )
    # A second table, created without column mapping; its large column is stored out of line, so
    # an UPDATE that leaves it alone sends it as unchanged TOAST ('u').
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE cm (id int PRIMARY KEY, tag text, big text)")
        conn.execute("ALTER TABLE cm ALTER COLUMN big SET STORAGE EXTERNAL")
        conn.execute(f"ALTER PUBLICATION {pub} ADD TABLE cm")
        conn.execute("INSERT INTO cm SELECT g, 't', repeat(chr(64 + g), 5000) FROM generate_series(1, 6) g")
    lake = tmp_path / "lake"
    text = '[lake]\nchange_data_feed = true\n[tables."public.cdf"]\ncolumn_mapping = "name"\npartition_by = ["region"]\n'
    cfg = _config(tmp_path, pgdb, slot, pub, lake, text)
    run(cfg)
    cm_table = lake / "public" / "cm"
    assert "delta.columnMapping.mode" not in DeltaTable(str(cm_table)).metadata().configuration
    _assert_equal_by_name(pgdb, lake, CM, "cm before column mapping")
    table = lake / "public" / "cdf"
    first = DeltaTable(str(table))
    assert first.metadata().configuration["delta.enableChangeDataFeed"] == "true"
    assert first.metadata().configuration["delta.columnMapping.mode"] == "name"
    assert first.metadata().partition_columns == ["region"]
    start = first.version()
    windows = [
        ["INSERT INTO cdf VALUES (21, 'r1', 'new'), (22, 'r0', 'new')"],
        ["UPDATE cdf SET v = 'upd' WHERE id <= 5", "UPDATE cdf SET region = 'r9' WHERE id = 6"],
        ["DELETE FROM cdf WHERE id BETWEEN 7 AND 9"],
        ["UPDATE cdf SET id = id + 100 WHERE id IN (10, 11)"],  # a key change: a delete and an insert
        ["TRUNCATE cdf", "INSERT INTO cdf VALUES (1, 'r0', 'after truncate'), (2, 'r1', 'x')"],
        ["INSERT INTO cdf VALUES (3, 'r0', 'y')", "UPDATE cdf SET v = 'z' WHERE id = 1", "DELETE FROM cdf WHERE id = 2"],
    ]
    for statements in windows:
        with psycopg.connect(pgdb) as conn:  # one transaction: one window of the next run
            for statement in statements:
                conn.execute(statement)
    run(dataclasses.replace(cfg, window=dataclasses.replace(cfg.window, max_changes=1)))
    assert DeltaTable(str(table)).version() >= start + len(windows)  # a commit (or more) per window
    spark = shared_engine.spark
    changes = spark.sql(f"SELECT * FROM table_changes_by_path('{table}', {start + 1})").collect()
    kinds = {r["_change_type"] for r in changes}
    assert {"insert", "delete", "update_preimage", "update_postimage"} <= kinds, kinds
    # Replay the changes, commit by commit, over the table's first version.
    rows = {r["id"]: (r["id"], r["region"], r["v"]) for r in spark.read.format("delta").option("versionAsOf", start).load(str(table)).collect()}
    for r in sorted(changes, key=lambda r: (r["_commit_version"], r["_change_type"] not in ("delete", "update_preimage"))):
        if r["_change_type"] in ("delete", "update_preimage"):
            assert rows.pop(r["id"]) == (r["id"], r["region"], r["v"]), r
        else:
            assert r["id"] not in rows, r
            rows[r["id"]] = (r["id"], r["region"], r["v"])
    with psycopg.connect(pgdb) as conn:
        names, pg = pg_rows(conn, CDF)
    assert names == ["id", "region", "v"]
    assert sorted(rows.values()) == sorted(pg)
    lake_now = spark.read.format("delta").load(str(table)).select("id", "region", "v").collect()
    assert sorted(tuple(r) for r in lake_now) == sorted(pg)
    _assert_equal_by_name(pgdb, lake, CDF, "read back with delta-rs")

    # Column mapping: a RENAME COLUMN in PostgreSQL is a rename in the lake, a commit that rewrites
    # no file, not a new column beside the old one. cm gets column mapping now (configured for an
    # existing table: one property commit) and, in the same window, a rename followed by updates
    # that leave the renamed column alone: its values come from the lake under the old name.
    _transaction(pgdb, "ALTER TABLE cdf RENAME COLUMN v TO note")
    _transaction(pgdb, "UPDATE cdf SET note = 'renamed' WHERE id = 1", "INSERT INTO cdf VALUES (50, 'r0', 'after rename')")
    _transaction(pgdb, "ALTER TABLE cm RENAME COLUMN big TO body", "UPDATE cm SET tag = 'after rename' WHERE id IN (1, 2)")
    renamed_at = DeltaTable(str(table)).version() + 1
    cm_before = DeltaTable(str(cm_table)).version()
    cfg = _config(tmp_path, pgdb, slot, pub, lake, text + '[tables."public.cm"]\ncolumn_mapping = "name"\n')
    run(cfg)
    cm_history = sorted(DeltaTable(str(cm_table)).history(), key=lambda h: h["version"])[cm_before + 1:]
    assert [h["operation"] for h in cm_history] == ["SET TBLPROPERTIES", "RENAME COLUMN", "MERGE"], cm_history
    turned_on = (cm_table / "_delta_log" / f"{cm_before + 1:020d}.json").read_text()
    assert '"delta.columnMapping.mode":"name"' in turned_on and '"add"' not in turned_on, turned_on
    assert DeltaTable(str(cm_table)).metadata().configuration["delta.columnMapping.mode"] == "name"
    assert [f.name for f in DeltaTable(str(cm_table)).schema().fields] == ["id", "tag", "body"]
    _assert_equal_by_name(pgdb, lake, CM, "cm after the rename and the unchanged TOAST in its window")
    # The next window, unchanged TOAST again (from the renamed column as the lake now has it), and
    # one that has an update before a rename and another after it.
    _transaction(pgdb, "UPDATE cm SET tag = 'next window' WHERE id IN (2, 3)")
    run(cfg)
    _assert_equal_by_name(pgdb, lake, CM, "cm a window after the rename")
    # An update made before a second rename (under the old name), the rename and an update after
    # it, each leaving the renamed column alone: the lake follows the rename and keeps the values.
    _transaction(pgdb, "UPDATE cm SET tag = 'before' WHERE id = 4")
    _transaction(pgdb, "ALTER TABLE cm RENAME COLUMN body TO content", "UPDATE cm SET tag = 'after' WHERE id = 5")
    version = DeltaTable(str(cm_table)).version()
    run(cfg)
    ops = [h["operation"] for h in sorted(DeltaTable(str(cm_table)).history(), key=lambda h: h["version"])[version + 1:]]
    assert "RENAME COLUMN" in ops, ops
    assert [f.name for f in DeltaTable(str(cm_table)).schema().fields] == ["id", "tag", "content"], ops
    _assert_equal_by_name(pgdb, lake, CM, f"cm after an update before a rename and one after it ({ops})")
    history = {h["version"]: h for h in DeltaTable(str(table)).history()}
    assert history[renamed_at]["operation"] == "RENAME COLUMN", history[renamed_at]
    log = (table / "_delta_log" / f"{renamed_at:020d}.json").read_text()
    assert '"add"' not in log and '"remove"' not in log
    assert [f.name for f in DeltaTable(str(table)).schema().fields] == ["id", "region", "note"]
    _assert_equal_by_name(pgdb, lake, CDF, "after the rename, read back with delta-rs")
    after = spark.sql(f"SELECT * FROM table_changes_by_path('{table}', {renamed_at})").collect()
    assert {(r["id"], r["note"], r["_change_type"]) for r in after} == {
        (1, "z", "update_preimage"), (1, "renamed", "update_postimage"), (50, "after rename", "insert")
    }

    # A run that stopped after a rename's commit, before its MERGE and its log row: the next run
    # plans the window again from the table as its last logged window left it (the old name), finds
    # the column renamed already (no second rename), and takes the unchanged TOAST of the renamed
    # column from that version under the old name (the window's renames, engine.renaming).
    # table_changes from the rename on shows the update, the value kept.
    _transaction(pgdb, "ALTER TABLE cm RENAME COLUMN content TO text", "UPDATE cm SET tag = 'stopped' WHERE id = 6")
    version, slot_at = DeltaTable(str(cm_table)).version(), confirmed_lsn(pgdb, slot)
    rename_columns = TableFeatures.rename_columns

    def renamed_then_stopped(engine: TableFeatures, uri: str, renames: Any) -> None:
        rename_columns(engine, uri, renames)
        if renames:
            raise LakeError("stopped after the rename's commit (test)")

    with monkeypatch.context() as m:
        m.setattr(TableFeatures, "rename_columns", renamed_then_stopped)
        with pytest.raises(LakeError, match="stopped after the rename"):
            run(cfg)
    assert confirmed_lsn(pgdb, slot) == slot_at
    ops = [h["operation"] for h in sorted(DeltaTable(str(cm_table)).history(), key=lambda h: h["version"])[version + 1:]]
    assert ops == ["RENAME COLUMN"], ops
    run(cfg)
    _assert_equal_by_name(pgdb, lake, CM, "cm after a run stopped between the rename and its window")
    changed = spark.sql(f"SELECT * FROM table_changes_by_path('{cm_table}', {version + 1})").collect()
    assert {(r["id"], r["tag"], r["text"] == "F" * 5000, r["_change_type"]) for r in changed} == {
        (6, "t", True, "update_preimage"), (6, "stopped", True, "update_postimage")
    }, changed
    # One transaction that updates a row, renames a column and updates again: its changes before
    # the rename carry the old name, which the lake cannot follow in place (exit 78, nothing written).
    _transaction(pgdb, "UPDATE cm SET tag = 'one' WHERE id = 1", "ALTER TABLE cm RENAME COLUMN tag TO label",
                 "UPDATE cm SET label = 'two' WHERE id = 2")
    version, slot_at = DeltaTable(str(cm_table)).version(), confirmed_lsn(pgdb, slot)
    with pytest.raises(Pg2DeltaError) as refused:
        run(cfg)
    assert refused.value.exit_code == 78 and "new to the lake but not to PostgreSQL" in refused.value.one_line(), refused.value
    assert (DeltaTable(str(cm_table)).version(), confirmed_lsn(pgdb, slot)) == (version, slot_at)


LC = TableSpec("public", "lc", ("id",))
LP = TableSpec("public", "lp", ("id",))


@pytest.mark.classic
@pytest.mark.skipif(TEST_ENGINE != "spark", reason="liquid clustering is written on Apache Spark (make test-spark)")
def test_liquid_clustering_kept_through_every_path(pgdb: str, tmp_path: Path, shared_engine: Any) -> None:
    """``cluster_by``: a table the bootstrap creates is clustered, one the lake holds unclustered is
    clustered in place when configured so, and the clustering stays through the runs' MERGEs, a
    column widened (the table rewritten), a truncate, ``maintain`` (whose ``OPTIMIZE`` clusters the
    files), a resync and a ``backfill --into`` copy; the embedded engine refuses the clustered table
    before writing. Every step's lake is read back with delta-rs and compared with PostgreSQL."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE lc (id int PRIMARY KEY, region text, n int, v text)")
        conn.execute("CREATE TABLE lp (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO lc SELECT g, 'r' || (g % 3), g, 'v' || g FROM generate_series(1, 40) g")
        conn.execute("INSERT INTO lp SELECT g, 'p' || g FROM generate_series(1, 10) g")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE lc, lp")
    lake = tmp_path / "lake"
    text = '[tables."public.lc"]\ncluster_by = ["region", "id"]\n'
    cfg = _config(tmp_path, pgdb, slot, pub, lake, text)

    def clustering(table: str, root: Path = lake) -> list[str]:
        return list(shared_engine.spark.sql(f"DESCRIBE DETAIL delta.`{root / 'public' / table}`").collect()[0]["clusteringColumns"])

    def equal(where: str, root: Path = lake) -> None:
        for spec in (LC, LP):
            _assert_equal_by_name(pgdb, root, spec, f"{spec.name} {where}")

    run_bootstrap(cfg)  # creates lc (empty and clustered, then the copy) and lp
    assert (clustering("lc"), clustering("lp")) == (["region", "id"], []), "after the bootstrap"
    assert "clustering" in (DeltaTable(str(lake / "public" / "lc")).protocol().writer_features or [])
    equal("after the bootstrap")

    # lp configured clustered now: one ALTER TABLE ... CLUSTER BY before its window's MERGE.
    cfg = _config(tmp_path, pgdb, slot, pub, lake, text + '[tables."public.lp"]\ncluster_by = ["id"]\nchangelog = true\n')
    _transaction(pgdb, "UPDATE lc SET v = 'upd' WHERE id % 4 = 0", "DELETE FROM lc WHERE id % 9 = 0",
                 "INSERT INTO lc VALUES (100, 'r9', 100, 'new')", "UPDATE lp SET v = 'upd' WHERE id < 4")
    lp_before = DeltaTable(str(lake / "public" / "lp")).version()
    run(cfg)
    lp_ops = [h["operation"] for h in sorted(DeltaTable(str(lake / "public" / "lp")).history(), key=lambda h: h["version"])[lp_before + 1:]]
    assert lp_ops[0] == "CLUSTER BY" and "add" not in (lake / "public" / "lp" / "_delta_log" / f"{lp_before + 1:020d}.json").read_text(), lp_ops
    assert (clustering("lc"), clustering("lp")) == (["region", "id"], ["id"]), "after a run"
    equal("after a run")

    # A column widened (the table rewritten whole), then a truncate, in one window.
    _transaction(pgdb, "ALTER TABLE lc ALTER COLUMN n TYPE bigint", "UPDATE lc SET n = 1099511627776 WHERE id = 1")
    _transaction(pgdb, "TRUNCATE lc", "INSERT INTO lc SELECT g, 'r' || (g % 2), g, 'again' FROM generate_series(1, 30) g",
                 "INSERT INTO lp VALUES (50, 'later')")
    lc_before = DeltaTable(str(lake / "public" / "lc")).version()
    run(cfg)
    lc_ops = [h["operation"] for h in sorted(DeltaTable(str(lake / "public" / "lc")).history(), key=lambda h: h["version"])[lc_before + 1:]]
    assert lc_ops[:2] == ["WRITE", "CLUSTER BY"], lc_ops  # the rewrite, clustered again; then the truncate's MERGE
    assert clustering("lc") == ["region", "id"], "after the rewrite of a widened column and a truncate"
    equal("after a rewrite and a truncate")

    # maintain's OPTIMIZE clusters the files: its commit's files carry Delta's clustering provider.
    before = {t: DeltaTable(str(lake / "public" / t)).version() for t in ("lc", "lp")}
    maintain(cfg)
    for t in ("lc", "lp"):
        log = lake / "public" / t / "_delta_log"
        optimized = [json.loads(line) for v in range(before[t] + 1, DeltaTable(str(log.parent)).version() + 1)
                     for line in (log / f"{v:020d}.json").read_text().splitlines()]
        assert any(a.get("commitInfo", {}).get("operation") == "OPTIMIZE" for a in optimized), (t, optimized)
        assert {a["add"].get("clusteringProvider") for a in optimized if "add" in a} == {"liquid"}, (t, optimized)
    assert (clustering("lc"), clustering("lp")) == (["region", "id"], ["id"]), "after maintain"
    equal("after maintain")

    # A resync writes lc whole again (an overwrite, which forgets the clustering: set again).
    _transaction(pgdb, "INSERT INTO lc VALUES (200, 'r5', 200, 'late')")
    resync(cfg, ["public.lc"])
    assert clustering("lc") == ["region", "id"], "after the resync"
    equal("after the resync")

    # backfill --into a new folder, seeded from the main table (lp keeps a changelog since its first
    # window): the copy is created clustered as configured.
    windows = [w for w in lake_rows_of(lake / "_pg2delta" / "applied_log") if w["table_name"] == "lp"]
    into = tmp_path / "copy"
    backfill(cfg, min(w["window_end"] for w in windows), max(w["window_end"] for w in windows), tables=["public.lp"], into=str(into))
    assert clustering("lp", into) == ["id"], "backfill --into"
    _assert_equal_by_name(pgdb, into, LP, "lp backfilled --into")

    # The embedded engine meets the clustered table (where this venv has it: the Spark 3.5 one):
    # refused before its first write, the slot unmoved.
    _transaction(pgdb, "UPDATE lc SET v = 'embedded' WHERE id = 1")
    if importlib.util.find_spec("pysail") is not None:
        version, slot_at = DeltaTable(str(lake / "public" / "lc")).version(), confirmed_lsn(pgdb, slot)
        refused = cli("run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake),
                      env={"PG2DELTA_ENGINE": "embedded"}, child=True)
        assert refused.returncode == 78 and "clustering" in refused.stderr and "embedded engine" in refused.stderr, refused.stderr[-2000:]
        assert (DeltaTable(str(lake / "public" / "lc")).version(), confirmed_lsn(pgdb, slot)) == (version, slot_at)
    run(cfg)
    equal("after the refusal, on Apache Spark")
