"""A year's applied log is one big compacted file (maintenance) and a few small ones: a run reads
what the digest of the big file kept (pg2delta.lake.digests), written by the first process that
read the file, and makes of it what it makes of the whole log."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import write_deltalake

from pg2delta.lake import digests
from pg2delta.lake.applied_log import DIGEST, LOG_SCHEMA, LOG_TABLE, deciding_rows, log_rows
from pg2delta.lake.lake_files import Lake


def _year(windows: int, first: int = 0) -> pa.Table:
    rows = [{"run_id": f"r{w}", "slot": "s", "window_start": w, "window_end": w + 1, "window_end_lsn": "0/1",
             "relation_oid": 7, "schema_name": "bench", "table_name": "t", "delta_version": w, "inserts": 20,
             "updates": 2, "deletes": 0, "truncated": False, "key_columns": '["id"]',
             "kind": "bootstrap" if w == 0 else "window", "publication": f"p{w}", "attnums": '{"id": 1, "v": 2}'}
            for w in range(first, first + windows)]
    return pa.Table.from_pylist(rows, schema=LOG_SCHEMA)


def _lake(tmp_path: Path) -> tuple[Lake, Path, pa.Table]:
    """A log of one file of 30,000 windows (a digest's worth) and one of a window after them, and
    the whole log as a reader without digests reads it."""
    log = tmp_path / "_pg2delta" / "applied_log"
    big = _year(30_000)
    write_deltalake(str(log), big)
    write_deltalake(str(log), _year(1, first=30_000), mode="append")
    assert min(p.stat().st_size for p in log.glob("*.parquet")) < DIGEST.min_bytes
    assert max(p.stat().st_size for p in log.glob("*.parquet")) >= DIGEST.min_bytes
    whole = Lake(str(tmp_path)).read_delta(str(log))
    assert whole is not None and whole.num_rows == 30_001
    return Lake(str(tmp_path)), log, whole


def _kept(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / digests.DIGESTS_ROOT / DIGEST.name).glob("*"))


def test_a_run_reads_the_big_files_digest_not_the_file(tmp_path: Path) -> None:
    lake, log, whole = _lake(tmp_path)
    want = deciding_rows(whole)
    assert sorted(r["window_end"] for r in want) == [1, 30_001]
    assert log_rows(lake) == want
    kept = _kept(tmp_path)
    assert len(kept) == 1 and pq.read_table(kept[0]).num_rows == 2  # the big file's first and newest rows
    # A new process: the big file moved away, its rows come from the digest.
    big = max(log.glob("*.parquet"), key=lambda p: p.stat().st_size)
    aside = tmp_path / "aside.parquet"
    big.rename(aside)
    assert log_rows(Lake(str(tmp_path))) == want
    aside.rename(big)


def test_a_digest_cut_short_is_made_again(tmp_path: Path) -> None:
    lake, _, whole = _lake(tmp_path)
    assert log_rows(lake) == deciding_rows(whole)
    kept = _kept(tmp_path)[0]
    kept.write_bytes(kept.read_bytes()[:100])
    assert log_rows(Lake(str(tmp_path))) == deciding_rows(whole)
    assert pq.read_table(kept).num_rows == 2 and _kept(tmp_path) == [kept]  # whole again, nothing left beside it


def test_a_lake_where_no_digest_can_be_written_is_read_whole(tmp_path: Path) -> None:
    """A reader that may not write (here the digests' folder is a file) still reads every row."""
    lake, _, whole = _lake(tmp_path)
    (tmp_path / digests.DIGESTS_ROOT).write_text("not a folder")
    assert log_rows(lake) == deciding_rows(whole)
    assert log_rows(Lake(str(tmp_path))) == deciding_rows(whole)


def test_clean_keeps_the_digests_of_the_files_the_table_has(tmp_path: Path) -> None:
    lake, _, _ = _lake(tmp_path)
    log_rows(lake)
    found = lake.files_now(lake.table_uri(LOG_TABLE))
    assert found is not None
    mine = tmp_path / digests.DIGESTS_ROOT / DIGEST.name
    (mine / "gone.parquet").write_bytes(b"a file compaction replaced")
    older = tmp_path / digests.DIGESTS_ROOT / "applied_log-0"
    older.mkdir()
    (older / "x.parquet").write_bytes(b"an older reduction's")
    other = tmp_path / digests.DIGESTS_ROOT / "changelog_log-1"
    other.mkdir()
    (other / "y.parquet").write_bytes(b"another reduction's")
    assert digests.clean(lake.fs, lake.path, DIGEST, found[1].items()) == 2
    assert [p.name for p in _kept(tmp_path)] == [digests.digest_name(p, s) for p, s in found[1].items() if s >= DIGEST.min_bytes]
    assert not any(older.iterdir()) and (other / "y.parquet").exists()
