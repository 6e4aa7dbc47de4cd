"""A Delta table's latest version and files from the tail of its log (``_last_checkpoint``, then
the commits after it by name) equal what a listing of the whole log gives, in every shape of log
pg2delta meets: delta-rs's and the engines' checkpoints, a hint gone or stale, the checkpoint's own
commit cleaned up, more commits past the hint than one probe, multi-part checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable, write_deltalake

from pg2delta.errors import LakeError
from pg2delta.lake import lake_files
from pg2delta.lake.engine_commits import _delta_rs_bounds
from pg2delta.lake.lake_files import Lake, key_bounds, metadata_at, protocol_at, schema_at


def _table(path: Path, commits: int, checkpoint_at: int | None) -> str:
    uri = str(path)
    for i in range(commits):
        write_deltalake(uri, pa.table({"id": [i], "v": [f"row {i}"]}), mode="append")
        if i == checkpoint_at:
            DeltaTable(uri).create_checkpoint()
    return uri


def _by_listing(lake: Lake, uri: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int | None, object]:
    with monkeypatch.context() as m:
        m.setattr(lake_files, "_log_tail", lambda fs, log_dir: None)
        return lake.delta_version(uri), lake.files_now(uri)


class _Spy:
    """``lake.fs`` that counts the paths each lookup by name asks for, and fails on a listing."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.fs, self.asked = fs, list[int]()

    def get_file_info(self, what: object) -> object:
        assert not isinstance(what, pafs.FileSelector), "the log was listed"
        self.asked.append(len(what) if isinstance(what, list) else 1)
        return self.fs.get_file_info(what)

    def __getattr__(self, name: str) -> object:
        return getattr(self.fs, name)


@pytest.mark.parametrize("commits,checkpoint_at", [(3, 1), (40, 2), (15, 14)], ids=["few-after", "past-one-probe", "at-head"])
def test_the_tail_equals_the_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commits: int, checkpoint_at: int) -> None:
    uri = _table(tmp_path / "t", commits, checkpoint_at)
    lake = Lake(str(tmp_path))
    expected = _by_listing(lake, uri, monkeypatch)
    assert expected[0] == commits - 1
    assert json.loads((tmp_path / "t" / "_delta_log" / "_last_checkpoint").read_text())["version"] == checkpoint_at
    fs = pafs.LocalFileSystem()
    tail = lake_files._log_tail(fs, f"{uri}/_delta_log")
    assert tail is not None and max(tail[0]) == commits - 1 and list(tail[1]) == [(checkpoint_at, 1)]
    assert (lake.delta_version(uri), lake.files_now(uri)) == expected
    assert schema_at(lake, uri) == schema_at(lake, uri, commits - 1)
    # An older version than the checkpoint's: the whole log is read for it.
    assert schema_at(lake, uri, 0) is not None


def test_no_listing_where_the_hint_names_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = _table(tmp_path / "t", 30, 24)
    lake = Lake(str(tmp_path))
    expected = _by_listing(lake, uri, monkeypatch)
    spy = _Spy(lake.fs)
    lake.fs = spy  # type: ignore[assignment]
    assert lake.delta_version(uri) == 29
    assert lake.files_now(uri) == expected[1]
    # The checkpoint and one probe of the commits after it, in one request each time.
    assert spy.asked == [1 + lake_files._TAIL_PROBE, 1 + lake_files._TAIL_PROBE], spy.asked


def test_a_missing_stale_or_odd_hint_falls_back_to_the_listing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = _table(tmp_path / "t", 25, 9)
    log_dir = tmp_path / "t" / "_delta_log"
    lake = Lake(str(tmp_path))
    expected = _by_listing(lake, uri, monkeypatch)
    hint = log_dir / "_last_checkpoint"
    text = hint.read_text()
    for content in (None, "not json", '{"version": 9, "v2Checkpoint": {}}', '{"version": 9, "parts": 3}', '{"size": 1}'):
        if content is None:
            hint.unlink()
        else:
            hint.write_text(content)
        assert lake_files._log_tail(pafs.LocalFileSystem(), str(log_dir)) is None, content
        assert (lake.delta_version(uri), lake.files_now(uri)) == expected, content
    # A hint older than a newer checkpoint it does not name: the commits after it are replayed.
    hint.write_text(text)
    DeltaTable(uri).create_checkpoint()
    hint.write_text(text)
    assert (lake.delta_version(uri), lake.files_now(uri)) == expected


def test_the_checkpoints_own_commit_cleaned_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = _table(tmp_path / "t", 6, 5)
    (tmp_path / "t" / "_delta_log" / f"{5:020d}.json").unlink()
    lake = Lake(str(tmp_path))
    assert lake.delta_version(uri) == 5
    version, files = lake.files_now(uri) or (None, {})
    assert version == 5 and len(files) == 6
    assert schema_at(lake, uri) is not None


def test_a_multi_part_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apache Spark writes a large table's checkpoint in parts, and says how many in the hint."""
    uri = _table(tmp_path / "t", 8, 4)
    log_dir = tmp_path / "t" / "_delta_log"
    lake = Lake(str(tmp_path))
    expected = _by_listing(lake, uri, monkeypatch)
    single = log_dir / f"{4:020d}.checkpoint.parquet"
    # The same checkpoint as one part of one, named as a multi-part checkpoint is.
    shutil.move(single, log_dir / f"{4:020d}.checkpoint.{1:010d}.{1:010d}.parquet")
    hint = json.loads((log_dir / "_last_checkpoint").read_text())
    (log_dir / "_last_checkpoint").write_text(json.dumps({**hint, "parts": 1}))
    tail = lake_files._log_tail(pafs.LocalFileSystem(), str(log_dir))
    assert tail is not None and list(tail[1]) == [(4, 1)]
    assert (lake.delta_version(uri), lake.files_now(uri)) == expected


def test_a_file_removed_and_added_again_in_one_commit_stays(tmp_path: Path) -> None:
    """A commit that gives a file a deletion vector removes it and adds it again under its path;
    Apache Spark writes the add first. The file is still the table's (before, files_now dropped it,
    and the next MERGE took a 98 MB table for a small one and rewrote every file)."""
    uri = _table(tmp_path / "t", 2, None)
    log = tmp_path / "t" / "_delta_log"
    first = next(json.loads(line)["add"] for line in (log / f"{0:020d}.json").read_text().splitlines() if '"add"' in line)
    vector = {"storageType": "u", "pathOrInlineDv": "ab^-aqEH.-t@S}K{vb[*k^", "offset": 1, "sizeInBytes": 36, "cardinality": 1}
    again = {**first, "deletionVector": vector, "dataChange": True}
    removed = {"path": first["path"], "deletionTimestamp": 1, "dataChange": True, "size": first["size"]}
    actions = [{"commitInfo": {"operation": "DELETE"}}, {"add": again}, {"remove": removed}]
    (log / f"{2:020d}.json").write_text("".join(json.dumps(a) + "\n" for a in actions))
    found = Lake(str(tmp_path)).files_now(uri)
    assert found is not None and found[0] == 2
    assert first["path"] in found[1] and len(found[1]) == 2, found


class _Opens:
    """``lake.fs`` that records the data files opened (not the log's)."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self.fs, self.data = fs, list[str]()

    def open_input_file(self, path: str) -> object:
        if "/_delta_log/" not in path:
            self.data.append(path.rsplit("/", 1)[-1])
        return self.fs.open_input_file(path)

    def __getattr__(self, name: str) -> object:
        return getattr(self.fs, name)


def test_a_table_read_again_reads_only_its_new_files(tmp_path: Path) -> None:
    """The applied log is read several times a run: each data file once, a file set seen before not
    at all (the same table), and what a commit, a compaction or a table made again changes is read."""
    uri = _table(tmp_path / "t", 3, None)
    lake = Lake(str(tmp_path))
    spy = _Opens(lake.fs)
    lake.fs = spy  # type: ignore[assignment]

    def rows(uri: str) -> list[dict[str, object]]:
        return list(lake.made_of(uri, pa.Table.to_pylist) or [])

    def ids() -> list[int]:
        return sorted(int(r["id"]) for r in rows(uri))  # type: ignore[call-overload]

    assert ids() == [0, 1, 2] and len(spy.data) == 3
    first = lake.read_delta(uri)
    assert lake.read_delta(uri) is first and len(spy.data) == 3
    assert lake.made_of(uri, pa.Table.to_pylist) is lake.made_of(uri, pa.Table.to_pylist)  # made once
    assert ids() == [0, 1, 2]

    write_deltalake(uri, pa.table({"id": [3], "v": ["row 3"]}), mode="append")
    assert ids() == [0, 1, 2, 3] and len(spy.data) == 4, spy.data
    DeltaTable(uri).optimize.compact()
    assert ids() == [0, 1, 2, 3] and len(spy.data) == 5, spy.data  # the compacted file only
    assert len(lake.files_now(uri)[1]) == 1  # type: ignore[index]

    shutil.rmtree(tmp_path / "t")  # made again by another writer
    write_deltalake(uri, pa.table({"id": [7, 8], "v": ["a", "b"]}))
    assert ids() == [7, 8] and len(spy.data) == 6
    shutil.rmtree(tmp_path / "t")
    assert lake.read_delta(uri) is None and rows(uri) == []


@pytest.mark.parametrize("checkpoint", [False, True], ids=["json-commits", "checkpoint"])
def test_the_protocol_and_metadata_from_the_log_equal_delta_rs(tmp_path: Path, checkpoint: bool) -> None:
    """What the embedded engine's check of a table's features reads (properties, partition
    columns, writer features, protocol versions) is what delta-rs says, whether the newest
    ``protocol`` and ``metaData`` actions are in a JSON commit or only in a checkpoint."""
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"id": [1, 2], "part": ["a", "b"]}), partition_by=["part"],
                    configuration={"delta.enableDeletionVectors": "true", "delta.checkpointInterval": "50"})
    for i in range(3):
        write_deltalake(uri, pa.table({"id": [10 + i], "part": ["a"]}), mode="append")
    dt = DeltaTable(uri)
    if checkpoint:
        dt.create_checkpoint()
        for v in range(dt.version() + 1):  # the actions left in the checkpoint alone
            (tmp_path / "t" / "_delta_log" / f"{v:020d}.json").unlink()
    lake = Lake(str(tmp_path))
    protocol, meta = protocol_at(lake, uri), metadata_at(lake, uri)
    want, want_meta = dt.protocol(), dt.metadata()
    assert protocol is not None and meta is not None
    assert (protocol["minReaderVersion"], protocol["minWriterVersion"]) == (want.min_reader_version, want.min_writer_version)
    assert set(protocol.get("writerFeatures") or []) == set(want.writer_features or []) and "deletionVectors" in want.writer_features
    assert dict(meta["configuration"]) == dict(want_meta.configuration)
    assert list(meta["partitionColumns"]) == list(want_meta.partition_columns) == ["part"]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["json-commits", "checkpoint"])
def test_the_key_bounds_from_the_log_equal_delta_rs(tmp_path: Path, checkpoint: bool) -> None:
    """The bounds of the first key column in each file and the files' rows, which the embedded
    engine's rewrite of a window's key ranges reads from the log's tail (no delta-rs load of the
    table), equal what delta-rs's ``get_add_actions`` gives: files replaced by an overwrite gone,
    a file whose keys are all NULL without bounds, the table's files counted with it."""
    uri = str(tmp_path / "t")
    for i in range(4):
        write_deltalake(uri, pa.table({"id": pa.array(range(10 * i, 10 * i + 10), pa.int64()), "v": [f"r{i}"] * 10}),
                        mode="append", configuration={"delta.checkpointInterval": "100"} if i == 0 else None)
    write_deltalake(uri, pa.table({"id": pa.array([12, 15], pa.int64()), "v": ["x", "y"]}), mode="overwrite",
                    predicate="id >= 10 AND id <= 19")
    if checkpoint:
        DeltaTable(uri).create_checkpoint()
    write_deltalake(uri, pa.table({"id": pa.array([None, None], pa.int64()), "v": ["n", "n"]}), mode="append")
    write_deltalake(uri, pa.table({"id": pa.array([100, 105, 101], pa.int64()), "v": ["a", "b", "c"]}), mode="append")
    got = key_bounds(Lake(str(tmp_path)), uri, "id")
    want = _delta_rs_bounds(DeltaTable(uri), "id")
    assert got is not None and want is not None
    lo, hi, rows, files = got
    assert files == want[3] == 6  # 4 appends, one replaced by the overwrite's file, the NULLs' and the last
    assert sorted(zip(lo.tolist(), hi.tolist(), rows.tolist(), strict=True)) == sorted(
        zip(want[0].tolist(), want[1].tolist(), want[2].tolist(), strict=True))
    assert (12, 15, 2) in zip(lo.tolist(), hi.tolist(), rows.tolist(), strict=True) and len(lo) == 5


def test_no_key_bounds_for_a_partition_column(tmp_path: Path) -> None:
    """A key that is the table's partition column has no statistics: the rewrite takes the window's range."""
    uri = str(tmp_path / "t")
    write_deltalake(uri, pa.table({"id": pa.array([1, 2], pa.int64()), "v": ["a", "b"]}), partition_by=["id"])
    assert key_bounds(Lake(str(tmp_path)), uri, "id") is None
    assert _delta_rs_bounds(DeltaTable(uri), "id") is None
    with pytest.raises(LakeError):  # no table there: the caller asks delta-rs, which says why
        key_bounds(Lake(str(tmp_path)), str(tmp_path / "none"), "id")
