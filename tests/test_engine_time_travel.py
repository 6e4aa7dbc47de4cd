"""Reading a Delta table as of an older version, on the embedded engine, against delta-rs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pg2delta.lake.engine import Engine, EngineConfig, Lake

pytestmark = pytest.mark.e2e


def test_every_version_reads_back_as_delta_rs_reads_it(tmp_path: Path) -> None:
    """pysail 0.7.2 writes a checkpoint every 10 commits and cannot time-travel below it; the
    engine then reads the files the JSON commits list at that version. Appends, a delete and
    appends again across two checkpoints: every version equals delta-rs's view of it."""
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
                (r["id"], r["v"]) for r in DeltaTable(str(tmp_path / "s" / "t"), version=version).to_pyarrow_table().to_pylist()
            )
            got = sorted((r["id"], r["v"]) for r in engine.read_rows(uri, ["id"], keys, ["v"], version=version))
            assert got == want, f"version {version}"
            assert engine.table_types(uri, version=version) == {"id": "bigint", "v": "string"}, f"version {version}"
    finally:
        engine.stop()
