"""The applied log gains a row per window and table, forever (about 105,000 a year for one table
on a five-minute schedule); a run makes dicts only of the rows its readers decide by
(applied_log.deciding_rows), and every reader makes of them what it makes of all the rows."""

from __future__ import annotations

import itertools

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pg2delta.copy.copier import lake_state
from pg2delta.lake.applied_log import LOG_SCHEMA, applied_of, deciding_rows, deciding_table
from pg2delta.lake.foreign import last_logged_versions
from pg2delta.versions import applied_through

NEWER = ["publication", "partitions", "attnums", "filenodes", "commit_ts"]  # added to the log later


def _one(*choices: object) -> st.SearchStrategy[object]:
    return st.sampled_from(choices)


ROW = st.fixed_dictionaries({
    "slot": _one("a", "a", "b", None), "window_end": st.integers(1, 6), "relation_oid": _one(1, 2, 3, None),
    "schema_name": _one("s", "s", "", None), "table_name": _one("t", "u", "", None), "delta_version": _one(None, 0, 1, 2, 3),
    "key_columns": _one(None, "", '["id"]', '["k", "id"]'), "kind": _one("window", "window", "bootstrap", "backfill", None),
    "publication": _one(None, "", "p1", "p2"), "partitions": _one(None, "", "[5]", "[5, 6]"),
    "attnums": _one(None, "", '{"a": 1}', '{"a": 1, "b": 2}', '{"b": 3}'), "filenodes": _one(None, "", '{"5": 50}', '{"5": 51}'),
})


def _readers(rows: list[dict[str, object]]) -> list[object]:
    return [(applied_of(rows, s), lake_state(rows, s), last_logged_versions(rows, s), applied_through(rows, s)) for s in ("a", "b")]


@settings(max_examples=300, deadline=None)
@given(st.lists(ROW, max_size=120), st.booleans())
def test_every_reader_makes_the_same_of_the_deciding_rows(rows: list[dict[str, object]], older: bool) -> None:
    table = pa.Table.from_pylist([{"run_id": f"r{i}", "window_start": 0, **r} for i, r in enumerate(rows)], schema=LOG_SCHEMA)
    if older:  # a log written before the later columns
        table = table.drop_columns(NEWER)
    full = table.to_pylist()
    kept = deciding_rows(table)
    assert _readers(kept) == _readers(full)
    assert [r["run_id"] for r in full if r in kept] == [r["run_id"] for r in kept]  # in the log's order


def test_a_long_schedule_keeps_a_few_rows() -> None:
    rows = [{"run_id": f"r{w}", "slot": "s", "window_start": w, "window_end": w + 1, "window_end_lsn": "0/1", "relation_oid": 7,
             "schema_name": "bench", "table_name": "t", "delta_version": w, "inserts": 20, "updates": 2, "deletes": 0,
             "truncated": False, "key_columns": '["id"]', "kind": "bootstrap" if w == 0 else "window", "publication": "p",
             "attnums": '{"id": 1, "v": 2}' if w < 500 else '{"id": 1, "v": 2, "w": 3}'}
            for w in range(2000)]
    table = pa.Table.from_pylist(rows, schema=LOG_SCHEMA)
    kept = deciding_rows(table)
    assert [r["window_end"] for r in kept] == [1, 501, 2000], [r["window_end"] for r in kept]
    assert _readers(kept) == _readers(table.to_pylist())
    assert deciding_rows(table.slice(0, 0)) == []


def test_a_lake_of_many_tables_keeps_each_ones_rows() -> None:
    """Past a few hundred kept rows (here 2 per table of 300, over several files' chunks) they are
    read with one take, not a slice each: the same rows, in the log's order."""
    common = {"slot": "s", "window_start": 0, "schema_name": "bench", "inserts": 1, "updates": 0, "deletes": 0,
              "truncated": False, "key_columns": '["id"]', "publication": "p", "attnums": '{"id": 1}'}
    chunks = [pa.Table.from_pylist([{**common, "run_id": f"w{w}-{oid}", "window_end": w, "relation_oid": oid,
                                      "table_name": f"t{oid}", "kind": "window", "delta_version": w - 1}
                                     for oid in range(300)], schema=LOG_SCHEMA) for w in range(1, 6)]
    table = pa.concat_tables(chunks)
    full = table.to_pylist()
    kept = deciding_rows(table)
    assert len(kept) == 600 and [r["run_id"] for r in full if r in kept] == [r["run_id"] for r in kept]
    assert {r["window_end"] for r in kept} == {1, 5}  # each table's first attnums, and its newest window
    assert _readers(kept) == _readers(full)


def test_a_copy_is_remembered_under_later_windows() -> None:
    """The copy's row of a table, older than all its windows and like none of them (no attnums, as
    older versions wrote), still decides lake_state."""
    common = {"slot": "s", "window_start": 0, "schema_name": "bench", "table_name": "t", "inserts": 0, "updates": 0, "deletes": 0,
              "truncated": False}
    rows = [{**common, "run_id": "start", "window_end": 5, "relation_oid": None, "kind": "bootstrap", "table_name": None},
            {**common, "run_id": "copy", "window_end": 5, "relation_oid": 7, "kind": "bootstrap", "delta_version": 0}]
    rows += [{**common, "run_id": f"w{w}", "window_end": w, "relation_oid": 7, "kind": "window", "delta_version": w,
              "key_columns": '["id"]', "publication": "p", "attnums": '{"id": 1}'} for w in range(6, 50)]
    table = pa.Table.from_pylist(rows, schema=LOG_SCHEMA)
    kept = deciding_rows(table)
    assert lake_state(kept, "s") == lake_state(table.to_pylist(), "s")
    assert lake_state(kept, "s").start_lsn == 5 and lake_state(kept, "s").copied == {7: 5} and [r["run_id"] for r in kept] == ["start", "copy", "w6", "w49"]


def test_a_resync_after_windows_leaves_applied_through_at_the_window() -> None:
    """applied_through reads window rows and the lake's starts, not a table's copies: a copy (a
    resync) newer than a table's last window leaves it at that window."""
    common = {"slot": "s", "window_start": 0, "relation_oid": 1, "schema_name": "bench", "table_name": "t", "inserts": 0,
              "updates": 0, "deletes": 0, "truncated": False, "key_columns": '["id"]', "publication": "p", "attnums": '{"id": 1}'}
    rows = [{**common, "run_id": "copy", "window_end": 5, "kind": "bootstrap", "delta_version": 0},
            {**common, "run_id": "window", "window_end": 10, "kind": "window", "delta_version": 1},
            {**common, "run_id": "resync", "window_end": 20, "kind": "bootstrap", "delta_version": 2}]
    table = pa.Table.from_pylist(rows, schema=LOG_SCHEMA)
    kept = deciding_rows(table)
    assert applied_through(kept, "s") == applied_through(table.to_pylist(), "s") == 10


@settings(max_examples=60, deadline=None)
@given(st.lists(ROW, max_size=60))
def test_maintenance_orders_a_table_by_its_newest_key(rows: list[dict[str, object]]) -> None:
    """maintain._first_keys reduces the log with Arrow: per table, the first column of the key its
    newest window with a key merged on (window ends told apart here: a tie has no newest)."""
    import json
    import tempfile

    from deltalake import write_deltalake

    from pg2delta.lake.lake_files import Lake
    from pg2delta.maintain import _first_keys

    rows = [{**r, "window_end": i * 7 % 61} for i, r in enumerate(rows)]  # distinct ends, not in order
    want: dict[tuple[object, object], str] = {}
    for r in sorted(rows, key=lambda r: int(str(r["window_end"]))):
        key = r["key_columns"]
        if r["schema_name"] is not None and r["table_name"] is not None and key and json.loads(str(key)):
            want[(r["schema_name"], r["table_name"])] = str(json.loads(str(key))[0])
    with tempfile.TemporaryDirectory() as root:
        lake = Lake(root)
        if rows:
            table = pa.Table.from_pylist([{"run_id": f"r{i}", "window_start": 0, **r} for i, r in enumerate(rows)],
                                         schema=LOG_SCHEMA)
            write_deltalake(lake.table_uri("_pg2delta", "applied_log"), table)
        assert _first_keys(lake) == {lake.table_uri(str(s), str(t)): k for (s, t), k in want.items()}


@settings(max_examples=200, deadline=None)
@given(st.lists(ROW, max_size=80), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)), max_size=80))
def test_status_reduces_the_log_as_a_loop_over_its_rows_would(rows: list[dict[str, object]], counts: list[tuple[int, int, int]]) -> None:
    """status._per_relation with Arrow: per relation of the slot, the first newest row by window_end,
    the changes windows applied (a row without a kind is a window's) and the newest commit time."""
    import datetime as dt

    from pg2delta.status import _per_relation

    stamp = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    full = [{"run_id": f"r{i}", "window_start": 0, **r, "inserts": c[0], "updates": c[1], "deletes": None if c[2] > 25 else c[2],
             "commit_ts": None if c[0] % 3 == 0 else stamp + dt.timedelta(seconds=c[0] * 7 + i)}
            for i, (r, c) in enumerate(zip(rows, counts + [(1, 1, 1)] * len(rows), strict=False))]
    table = pa.Table.from_pylist(full, schema=LOG_SCHEMA)
    read = table.to_pylist()
    for slot in ("a", "b"):
        latest: dict[int, dict[str, object]] = {}
        totals: dict[int, dict[str, int]] = {}
        commits: dict[int, int] = {}
        for row in read:
            if row["slot"] != slot or row["relation_oid"] is None:
                continue
            oid = int(row["relation_oid"])
            total = totals.setdefault(oid, {"inserts": 0, "updates": 0, "deletes": 0})
            if (row["kind"] or "window") == "window":
                for op in total:
                    total[op] += int(row[op] or 0)
            if row["commit_ts"] is not None:
                us = int((row["commit_ts"] - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) / dt.timedelta(microseconds=1))
                commits[oid] = max(us, commits.get(oid, us))
            if oid not in latest or int(row["window_end"]) > int(str(latest[oid]["window_end"])):
                latest[oid] = row
        got_latest, got_totals, got_commits = _per_relation(table, slot)
        assert sorted(got_latest, key=lambda r: int(r["relation_oid"])) == [latest[o] for o in sorted(latest)]
        assert (got_totals, got_commits) == (totals, commits)


@settings(max_examples=40, deadline=None)
@given(st.lists(ROW.filter(lambda r: r["schema_name"] is not None and r["table_name"] is not None), max_size=40))
def test_the_catalog_registers_the_slots_tables(rows: list[dict[str, object]]) -> None:
    """metastore.slot_tables with Arrow: every (schema, table) a row of the slot with a relation names."""
    import tempfile
    from types import SimpleNamespace

    from deltalake import write_deltalake

    from pg2delta.lake.lake_files import Lake
    from pg2delta.metastore import slot_tables

    with tempfile.TemporaryDirectory() as root:
        lake = Lake(root)
        config = SimpleNamespace(source=SimpleNamespace(slot="a"))  # all slot_tables reads of it
        if rows:
            write_deltalake(lake.table_uri("_pg2delta", "applied_log"), pa.Table.from_pylist(
                [{"run_id": f"r{i}", "window_start": 0, **r} for i, r in enumerate(rows)], schema=LOG_SCHEMA))
        want = sorted({(r["schema_name"], r["table_name"]) for r in rows if r["slot"] == "a" and r["relation_oid"] is not None})
        assert slot_tables(config, lake) == want  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.lists(ROW, max_size=120), st.lists(st.integers(0, 120), max_size=6), st.booleans())
def test_the_rows_kept_of_each_file_keep_what_the_whole_log_keeps(rows: list[dict[str, object]], cuts: list[int], older: bool) -> None:
    """A run reads what a digest kept of each of the log's big files (applied_log.DIGEST), not the
    file: the rows kept of the rows kept of each part, in the log's order, are the rows kept of it
    whole (an older file without the later columns first, if ``older``)."""
    table = pa.Table.from_pylist([{"run_id": f"r{i}", "window_start": 0, **r} for i, r in enumerate(rows)], schema=LOG_SCHEMA)
    bounds = sorted({0, table.num_rows, *(c for c in cuts if c <= table.num_rows)})
    parts = [table.slice(a, b - a) for a, b in itertools.pairwise(bounds)] or [table]
    if older:
        parts[0] = parts[0].drop_columns(NEWER)
    whole = pa.concat_tables(parts, promote_options="permissive")
    kept = pa.concat_tables([deciding_table(p) for p in parts], promote_options="permissive")
    assert deciding_rows(kept) == deciding_rows(whole)
