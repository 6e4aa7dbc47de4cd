"""Reading a Delta table as of an older version, on the embedded engine, against delta-rs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from lake_read import read_delta
from pg2delta.errors import LakeError
from pg2delta.lake.engine import Engine, EngineConfig, Lake

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("hint", [True, False], ids=["hint-dropped", "from-files"])
def test_every_version_reads_back_as_delta_rs_reads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hint: bool) -> None:
    """pysail 0.7.2 writes a checkpoint every 10 commits and cannot time-travel below the one
    ``_last_checkpoint`` names; the engine then drops that hint and reads again, or where that does
    not help reads the files the JSON commits list. Appends, a delete and appends again across two
    checkpoints: every version equals delta-rs's view of it, both ways."""
    if not hint:
        monkeypatch.setattr(Lake, "drop_checkpoint_hint", lambda self, uri: False)
    lake = Lake(str(tmp_path))
    engine = Engine.start(EngineConfig(), lake)
    uri = lake.table_uri("s", "t")
    try:
        for i in range(24):
            if i == 14:
                engine.delete_all(uri)
            else:
                engine.append(uri, pa.table({"id": pa.array([i], pa.int64()), "v": pa.array([f"v{i}"])}))
        latest = lake.delta_version(uri)
        assert latest is not None and latest >= 21
        assert (tmp_path / "s" / "t" / "_delta_log" / f"{20:020d}.checkpoint.parquet").exists()
        keys = [(i,) for i in range(24)]
        for version in range(latest + 1):
            want = sorted(
                (r["id"], r["v"]) for r in read_delta(str(tmp_path / "s" / "t"), version=version).to_pylist()
            )
            got = sorted((r["id"], r["v"]) for r in engine.read_rows(uri, ["id"], keys, ["v"], version=version))
            assert got == want, f"version {version}"
            assert engine.table_types(uri, version=version) == {"id": "bigint", "v": "string"}, f"version {version}"
    finally:
        engine.stop()


@pytest.mark.parametrize("hint", [True, False], ids=["hint-dropped", "from-files"])
def test_old_versions_keep_nan_in_float_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hint: bool) -> None:
    """Versions below the newest checkpoint (pysail's own, and maintenance's after a compaction by
    delta-rs) keep a NaN of a float column whose other values in the file are all one value. Read
    through Delta, the table keeps no float statistics; read from their files as plain Parquet
    (where time travel fails even without the hint), pysail would take the footers' float
    statistics (pysail's own files' and delta-rs's compacted one's, which leave NaN out) as
    bounds of every value, so those files are read from copies without them."""
    if not hint:
        monkeypatch.setattr(Lake, "drop_checkpoint_hint", lambda self, uri: False)
    lake = Lake(str(tmp_path))
    engine = Engine.start(EngineConfig(), lake)
    uri = lake.table_uri("s", "f")
    path = tmp_path / "s" / "f"

    def check(versions: range) -> None:
        for version in versions:
            table = read_delta(str(path), version=version)
            want = sorted(repr((r["id"], r["x"])) for r in table.to_pylist())
            got = sorted(repr((r["id"], r["x"])) for r in engine.read_version(uri, version).collect())
            assert got == want, f"version {version}"

    try:
        for i in range(13):  # each file holds a NaN and one other value
            engine.append(uri, pa.table({"id": pa.array([2 * i, 2 * i + 1], pa.int64()), "x": [float("nan"), 2.5]}))
        assert (path / "_delta_log" / f"{10:020d}.checkpoint.parquet").exists()
        check(range(1, 13))
        engine.compact(uri)  # delta-rs rewrites the files into one (version 13)
        engine.append(uri, pa.table({"id": pa.array([100], pa.int64()), "x": [1.0]}))
        assert engine.checkpoint(uri)  # at version 14, above the compacted one
        assert lake.delta_version(uri) == 14
        check(range(1, 15))
        check(range(13, 15))  # read again: the copies of the first reads serve
        copies = list((tmp_path / "_pg2delta").glob("**/*.parquet"))
        assert bool(copies) != hint, copies  # pysail's files and delta-rs's compacted one have float bounds
    finally:
        engine.stop()
    # Read from its files, the compacted file was copied without statistics; the copies go at stop.
    assert not list((tmp_path / "_pg2delta").glob("**/*.parquet"))


def test_versions_with_deletion_vectors_read_back_as_delta_rs_reads_them(tmp_path: Path) -> None:
    """The tables the embedded engine creates have deletion vectors, which its DELETE and MERGE
    write: every version, below the newest checkpoint too (the hint dropped), reads back with the
    rows its vectors removed left out, as delta-rs reads it. Read from its files alone (where even
    that fails), a version with vectors is refused rather than read with those rows."""
    lake = Lake(str(tmp_path))
    engine = Engine.start(EngineConfig(), lake)
    uri = lake.table_uri("s", "t")
    try:
        rows = engine.spark.range(100).selectExpr("id", "concat('v', id) AS v")
        engine.new_table_writer(engine.delta_writer(rows, "append"), rows, uri).save(uri)  # as a window creates a table
        for i in range(12):
            engine.query(f"DELETE FROM {engine.target(uri)} WHERE id = {i * 7}", "a delete")
        log = "".join(p.read_text() for p in sorted((tmp_path / "s" / "t" / "_delta_log").glob("*.json")))
        assert '"deletionVector":{' in log, "the deletes wrote deletion vectors"
        latest = lake.delta_version(uri)
        assert latest is not None and (tmp_path / "s" / "t" / "_delta_log" / f"{10:020d}.checkpoint.parquet").exists()
        keys = [(i,) for i in range(100)]
        for version in range(latest + 1):
            want = sorted((r["id"], r["v"]) for r in read_delta(str(tmp_path / "s" / "t"), version=version).to_pylist())
            got = sorted((r["id"], r["v"]) for r in engine.read_rows(uri, ["id"], keys, ["v"], version=version))
            assert got == want and len(got) == 100 - min(version, 12), f"version {version}"
        with pytest.raises(LakeError, match="deletion vectors"):
            lake.snapshot_at(uri, latest)
    finally:
        engine.stop()
