"""Changelog settings and the changelog rows of a window, without a server."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest

from pg2delta.apply.changelog import TRUNCATE_OP, window_rows
from pg2delta.config import load
from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import (
    LSN_COL,
    META_FIELDS,
    OP_COL,
    POS_COL,
    TS_COL,
    XID_COL,
    RelationVersion,
    TruncateEvent,
)
from pg2delta.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text('[source]\ndsn = "x"\n' + text)
    return path


def test_changelog_default_and_per_table(tmp_path: Path) -> None:
    cfg = load(write(tmp_path, '[lake]\nroot = "/l"\n[tables."a.on"]\nchangelog = true\n'), env={})
    assert cfg.changelog_of("a", "on") and not cfg.changelog_of("a", "other")
    cfg = load(write(tmp_path, '[lake]\nroot = "/l"\nchangelog = true\n[tables."a.off"]\nchangelog = false\nkey = ["k"]\n'), env={})
    assert cfg.changelog_of("a", "other") and not cfg.changelog_of("a", "off")
    assert cfg.table("a", "off").key == ("k",)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[lake]\nroot = "/l"\nchangelog = "yes"\n', "true or false"),
        ('[lake]\nroot = "/l"\n[tables."a.b"]\nchangelog = 1\n', "true or false"),
        ('[lake]\nroot = "/l"\n[tables."a.b"]\naudit = true\n', "unknown setting(s) ['audit'] (known: changelog,"),
    ],
)
def test_bad_changelog_settings(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load(write(tmp_path, text), env={})


def test_backfill_needs_no_dsn(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[lake]\nroot = "/l"\n')
    with pytest.raises(ConfigError, match="DSN"):
        load(path, env={})
    assert load(path, env={}, need_source=False).lake_root == "/l"


def _version() -> RelationVersion:
    rel = po.Relation(xid=None, oid=16384, namespace="public", name="t", replica_identity="d",
                      columns=(po.RelationColumn(flags=1, name="id", type_oid=23, type_modifier=-1),))
    fields = [pa.field("id", pa.int32())]
    return RelationVersion(1, rel, (), (0,), pa.schema([*fields, *META_FIELDS]))


def test_window_rows_merge_changes_and_truncates_in_commit_order() -> None:
    version = _version()
    batch = pa.RecordBatch.from_pylist(
        [
            {"id": 1, LSN_COL: 100, POS_COL: 1, OP_COL: "I", XID_COL: 7, TS_COL: 5},
            {"id": 1, LSN_COL: 300, POS_COL: 1, OP_COL: "D", XID_COL: 9, TS_COL: 6},
        ],
        schema=version.schema,
    )
    trunc = TruncateEvent(200, 3, (version,), 0, 8, 1_700_000_000_000_000)
    rows = window_rows([batch], [trunc, trunc])  # the same truncate listed twice (two tables) is one row
    assert rows is not None
    assert rows.column(LSN_COL).to_pylist() == [100, 200, 300]
    assert rows.column(OP_COL).to_pylist() == ["I", TRUNCATE_OP, "D"]
    assert rows.column("id").to_pylist() == [1, None, 1]
    assert rows.column(XID_COL).to_pylist() == [7, 8, 9]
    assert rows.column(TS_COL).type == pa.timestamp("us", tz="UTC")
    assert all(f.nullable for f in rows.schema)
    assert window_rows([], []) is None


def test_backfill_chunks_follow_windows_rows_and_columns() -> None:
    from pg2delta.backfill import _chunks, _Plan

    ab, abc, a = ("a", "b"), ("a", "b", "c"), ("a",)
    windows = ((100, 200, 30, ab, a), (200, 300, 30, ab, a), (300, 400, 0, (), a), (400, 500, 10, abc, a), (500, 600, 50, abc, a))
    plan = _Plan("s", "t", 1, a, 100, None, False, -1, windows)
    # At most 50 rows a chunk, cut at window ends; a new column set starts a new chunk.
    assert _chunks(plan, 650, 50) == [(100, 300, ab, a), (300, 400, ab, a), (400, 600, abc, a), (600, 650, abc, a)]
    # One chunk when the rows fit and the columns never change.
    same = _Plan("s", "t", 1, a, 100, None, False, -1, windows[:3])
    assert _chunks(same, 400, 1000) == [(100, 400, ab, a)]


def test_backfill_chunks_follow_key_changes() -> None:
    """Windows merged on the old key are replayed on it: their deletes carry only the old key's columns."""
    from pg2delta.backfill import _chunks, _Plan

    ab = ("a", "b")
    windows = ((100, 200, 10, ab, ("a",)), (200, 300, 10, ab, ("a",)), (300, 400, 10, ab, ("b",)))
    plan = _Plan("s", "t", 1, ("b",), 100, None, False, -1, windows)
    assert _chunks(plan, 400, 1000) == [(100, 300, ab, ("a",)), (300, 400, ab, ("b",))]
    # A window replayed after a crash past its changelog commit is logged with 0 rows appended:
    # its columns and key still hold for its rows.
    abc = ("a", "b", "c")
    replayed = (*windows[:2], (300, 400, 0, abc, ("b",)))
    plan = _Plan("s", "t", 1, ("b",), 100, None, False, -1, replayed)
    assert _chunks(plan, 400, 1000) == [(100, 300, ab, ("a",)), (300, 400, abc, ("b",))]
