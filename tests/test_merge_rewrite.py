"""A window's final rows committed on the embedded engine as a rewrite of their key range, and on
Apache Spark as an overwrite of their keys, not a MERGE (pg2delta.lake.engine_commits): the same
table as the MERGE gives, one commit, the files without a key of the window untouched; and through
the job, with a crash after the commit and its replay.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import signal
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from engines import SharedEngine
from lake_read import read_delta
from pg2delta.apply.merge import merge_statement
from pg2delta.config import load
from pg2delta.faults import FAULT_ENV
from pg2delta.job import run
from pg2delta.lake import engine_commits, engine_maintain
from pg2delta.lake.engine import EngineConfig, Lake, MergeRows
from pg2delta.lake.engine_maintain import overlapping
from workload import TABLES, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema

OP = "_pg2delta_op"

I32, I64, F64, S = pa.int32(), pa.int64(), pa.float64(), pa.string()


def _case(
    table: dict[str, pa.Array], source: dict[str, pa.Array], key: list[str], *, truncate: bool = False,
    nullable: bool = False, files: int = 1,
) -> dict[str, Any]:
    return {"table": pa.table(table), "source": pa.table(source), "key": key, "truncate": truncate,
            "nullable": nullable, "files": files}


CASES = {
    # An integer key, the table in four files; the source updates, deletes and inserts inside the
    # second file's range only: the other three files stay as they are.
    "int key": _case(
        {"id": pa.array(range(0, 400), I32), "v": [f"t{i}" for i in range(400)]},
        {"id": pa.array([100, 150, 151, 199, 120], I32), "v": ["u100", None, "u151", "u199", "x"],
         OP: ["U", "D", "U", "I", "D"]},
        ["id"], files=4,
    ),
    # A key past the table's rows widens the range to the last file; one that the table lacks is deleted.
    "int key, new rows past the end": _case(
        {"id": pa.array(range(0, 400), I64), "v": [f"t{i}" for i in range(400)]},
        {"id": pa.array([5, 1000, 1001, 2000], I64), "v": ["u5", "n1000", None, "n2000"], OP: ["U", "I", "D", "I"]},
        ["id"], files=4,
    ),
    # Composite key; the table's first key column narrower than the source's is cast back to it.
    "composite key": _case(
        {"a": pa.array([1, 1, 2, 2, 3], I64), "b": ["x", "y", "x", "y", "x"], "v": pa.array([1, 2, 3, 4, 5], I64)},
        {"a": pa.array([1, 2, 2, 4], I64), "b": ["y", "x", "z", "x"], "v": pa.array([20, None, 7, 8], I32),
         OP: ["U", "D", "I", "I"]},
        ["a", "b"],
    ),
    # A keyless table's key is its position; rows the lake got under an earlier key have none and stay.
    "position key with NULLs in the table": _case(
        {"v": ["old1", "old2", "p1", "p2"], "_pg2delta_lsn": pa.array([None, None, 10, 10], I64),
         "_pg2delta_pos": pa.array([None, None, 1, 2], I64)},
        {"v": ["p3", "p2"], "_pg2delta_lsn": pa.array([20, 10], I64), "_pg2delta_pos": pa.array([1, 2], I64),
         OP: ["I", "I"]},
        ["_pg2delta_lsn", "_pg2delta_pos"],
    ),
    # A key from the config may be NULL, matched null-safely: the table is rewritten whole.
    "nullable key": _case(
        {"code": pa.array([None, 1, 2], I64), "v": ["null", "one", "two"]},
        {"code": pa.array([None, 2, 3], I64), "v": ["null2", None, "three"], OP: ["U", "D", "I"]},
        ["code"], nullable=True,
    ),
    # A float key with NaN (no range of floats): NaN updated, not duplicated.
    "float key with NaN": _case(
        {"f": pa.array([math.nan, 0.5, 1.5], F64), "v": ["nan", "half", "one and a half"]},
        {"f": pa.array([math.nan, 1.5, 2.5], F64), "v": ["nan2", None, "new"], OP: ["U", "D", "I"]},
        ["f"],
    ),
    "string key": _case(
        {"s": ["a", "b", "it's", "back\\slash"], "v": pa.array([1, 2, 3, 4], I64)},
        {"s": ["it's", "back\\slash", "c"], "v": pa.array([30, None, 5], I64), OP: ["U", "D", "I"]},
        ["s"],
    ),
    # A truncate in the window and nothing after it but deletes: the table ends empty.
    "truncate, deletes only": _case(
        {"id": pa.array(range(0, 50), I32), "v": [f"t{i}" for i in range(50)]},
        {"id": pa.array([3, 60], I32), "v": [None, None], OP: ["D", "D"]},
        ["id"], truncate=True,
    ),
    # A truncate in the window: the table is the source's rows that are not deletes.
    "truncate": _case(
        {"id": pa.array(range(0, 50), I32), "v": [f"t{i}" for i in range(50)]},
        {"id": pa.array([3, 7, 60], I32), "v": ["u3", None, "n60"], OP: ["I", "D", "I"]},
        ["id"], truncate=True,
    ),
}


def _committed(
    tmp_path: Path, shared: SharedEngine, case: dict[str, Any], name: str, *, vectors: bool = False
) -> tuple[list[dict[str, Any]], DeltaTable, set[str]]:
    """The case's table (in ``files`` appends; ``vectors``: then with deletion vectors, Apache
    Spark), the source committed as a MergeRows (with its keys, where it has one key column of
    integers or strings); the rows after, the table, and the files before the commit."""
    lake = Lake(str(tmp_path / name))
    uri = lake.table_uri("public", "t")
    engine = shared.start(EngineConfig(), lake)
    table, source, key = case["table"], case["source"], case["key"]
    step = -(-table.num_rows // case["files"])
    for at in range(0, table.num_rows, step):
        engine.append(uri, table.slice(at, step))
    if vectors:
        engine.spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = true)")
    before = set(DeltaTable(uri).file_uris())
    staged = lake.stage(source, "source")
    columns = tuple(table.column_names)
    engine.merge(
        uri, staged,
        lambda t, v: MergeRows(
            merge_statement(t, v, key, columns, truncate=case["truncate"], nullable_keys=case["nullable"]),
            tuple(key), columns, case["truncate"], case["nullable"],
            keys=engine_commits.replaced_keys(source.column(key[0])) if len(key) == 1 else None,
        ),
        rows=source.num_rows,
    )
    dt = DeltaTable(uri)
    rows = read_delta(uri).to_pylist()
    return sorted(rows, key=lambda r: repr(sorted(r.items()))), dt, before


@pytest.mark.parametrize("buckets", [False, True], ids=["one-query", "in-buckets"])
@pytest.mark.parametrize("name", list(CASES))
def test_rewrite_equals_merge(
    name: str, buckets: bool, tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case committed by a MERGE and by the rewrite of its key range, in one query and in hash
    buckets of the key (staged, then one overwrite): the same rows, in one commit each; an integer
    key's rewrite leaves the files outside the source's range alone."""
    if not shared_engine.start(EngineConfig(), Lake(str(tmp_path))).embedded:
        pytest.skip("the rewrite is the embedded engine's")
    case = CASES[name]
    monkeypatch.setattr(engine_commits, "EMBEDDED_REWRITE_ROWS", 1 << 40)
    merged, merge_table, _ = _committed(tmp_path, shared_engine, case, "merge")
    monkeypatch.setattr(engine_commits, "EMBEDDED_REWRITE_ROWS", 0)
    if buckets:
        monkeypatch.setattr(engine_commits, "REWRITE_BUCKET_ROWS", 1)
        monkeypatch.setattr(engine_commits, "BUCKET_WINDOW_ROWS", 0)
    rewritten, table, before = _committed(tmp_path, shared_engine, case, "rewrite")
    assert _nan_safe(rewritten) == _nan_safe(merged)
    appends = case["files"]
    assert table.version() == merge_table.version() == appends  # one commit, after the appends
    assert [h["operation"] for h in table.history(1)] == ["WRITE"]
    assert [h["operation"] for h in merge_table.history(1)] == ["MERGE"]
    if name == "int key":
        kept = before & set(table.file_uris())
        assert len(kept) == 3, (before, table.file_uris())  # the second file alone was rewritten


# The cases Apache Spark commits as an overwrite of their keys: one key column of integers or
# strings, not matched null-safely, no truncate.
KEYED = {"int key", "int key, new rows past the end", "string key"}


@pytest.mark.classic
@pytest.mark.parametrize(
    ("name", "vectors"),
    # Both ways for the cases the overwrite takes; once for the others, which stay MERGEs.
    [(n, v) for n in CASES for v in ((False, True) if n in KEYED else (False,))],
    ids=lambda x: ("deletion-vectors" if x else "rewrite") if isinstance(x, bool) else x,
)
def test_key_overwrite_equals_merge(
    name: str, vectors: bool, tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Apache Spark, each case committed by a MERGE and by an overwrite of the source's keys
    (replaceWhere), deletion vectors written or the touched files rewritten: the same rows, in one
    commit each; the overwrite leaves the files without a key of the window out of its commit."""
    if not shared_engine.start(EngineConfig(), Lake(str(tmp_path))).classic:
        pytest.skip("the overwrite of the window's keys is Apache Spark's")
    case = dict(CASES[name])
    types = dict(zip(case["table"].column_names, case["table"].schema.types, strict=True))
    source = case["source"]  # a column of NULLs alone typed as the table's (Apache Spark reads no Parquet of type null)
    case["source"] = source.cast(pa.schema([pa.field(f.name, types[f.name]) if pa.types.is_null(f.type) else f for f in source.schema]))
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", -1 if vectors else 1 << 40)
    monkeypatch.setattr(engine_commits, "REPLACE_KEYS_MAX", 0)
    merged, merge_table, _ = _committed(tmp_path, shared_engine, case, "merge", vectors=vectors)
    monkeypatch.setattr(engine_commits, "REPLACE_KEYS_MAX", 5_000)
    replaced, table, _ = _committed(tmp_path, shared_engine, case, "replace", vectors=vectors)
    assert _nan_safe(replaced) == _nan_safe(merged)
    assert table.version() == merge_table.version() == case["files"] + vectors  # one commit, after the appends
    assert [h["operation"] for h in merge_table.history(1)] == ["MERGE"]
    last = table.history(1)[0]
    assert last["operation"] == ("WRITE" if name in KEYED else "MERGE"), last
    if name in KEYED:
        assert last["operationParameters"]["mode"] == "Overwrite" and " IN (" in last["operationParameters"]["predicate"]
    if name == "int key":
        actions = [json.loads(line) for line in (Path(table.table_uri.removeprefix("file://")) / "_delta_log"
                                                  / f"{table.version():020d}.json").read_text().splitlines() if line]
        removed = {a["remove"]["path"] for a in actions if "remove" in a}
        assert len(removed) == 1, actions  # the second file alone holds the window's keys
        readded = [a["add"] for a in actions if "add" in a and a["add"]["path"] in removed]
        # With vectors the file comes back with one; without, its other rows are in a new file.
        assert (len(readded) == 1 and bool(readded[0].get("deletionVector"))) if vectors else not readded, actions


@pytest.mark.classic
@pytest.mark.parametrize("seed", range(2))  # an integer key, a string one
def test_key_overwrite_equals_merge_on_random_windows(
    seed: int, tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Apache Spark, random tables in files of key ranges and random windows of updates, deletes
    and inserts, a string key or an integer one, with deletion vectors: the overwrite of the
    window's keys gives the MERGE's rows, and its commit touches only files whose statistics' range
    holds a key of the window."""
    if not shared_engine.start(EngineConfig(), Lake(str(tmp_path))).classic:
        pytest.skip("the overwrite of the window's keys is Apache Spark's")
    rng = random.Random(seed)
    text = seed % 2 == 1
    ids = sorted(rng.sample(range(0, 3000), 200))
    files = [ids[i:i + 50] for i in range(0, 200, 50)]
    keys = set(rng.sample(ids, rng.randint(1, 15)))
    new = set(rng.sample(range(-50, 3100), 5)) - set(ids)
    ops = {k: rng.choice("UD") for k in keys} | {k: "I" for k in new}

    def key(k: int) -> Any:
        return f"k{k:05d}'\\" if text else k

    kind = S if text else I64
    source = pa.table({"id": pa.array([key(k) for k in sorted(ops)], kind), "v": [f"s{k}" for k in sorted(ops)],
                       OP: [ops[k] for k in sorted(ops)]})
    monkeypatch.setattr(engine_commits, "VECTORS_FROM_BYTES", -1)
    results, commits = [], []
    for mode, most in (("merge", 0), ("replace", 5_000)):
        monkeypatch.setattr(engine_commits, "REPLACE_KEYS_MAX", most)
        lake = Lake(str(tmp_path / mode))
        uri = lake.table_uri("public", "t")
        engine = shared_engine.start(EngineConfig(), lake)
        for f in files:
            engine.append(uri, pa.table({"id": pa.array([key(i) for i in f], kind), "v": [f"t{i}" for i in f]}))
        engine.spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = true)")
        before = {a["path"]: (a["min.id"], a["max.id"]) for a in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist()}
        engine.merge(
            uri, lake.stage(source, "source"),
            lambda t, v: MergeRows(merge_statement(t, v, ["id"], ("id", "v"), truncate=False), ("id",), ("id", "v"),
                                   False, False, keys=engine_commits.replaced_keys(source.column("id"))),
            rows=source.num_rows,
        )
        table = DeltaTable(uri)
        results.append(sorted(read_delta(uri).to_pylist(), key=lambda r: str(r["id"])))
        commits.append(table.history(1)[0]["operation"])
        after = {a["path"] for a in pa.table(table.get_add_actions(flatten=True)).to_pylist()}
        gone = {p for p in before if p not in after or p in _removed(table)}
        holding = {p for p, (lo, hi) in before.items() if any(lo <= key(k) <= hi for k in ops)}
        assert gone <= holding, (mode, seed, sorted(before.values()), sorted(ops))
    assert commits == ["MERGE", "WRITE"], commits
    assert results[0] == results[1], f"seed {seed}"


def _removed(table: DeltaTable) -> set[str]:
    """The paths the table's newest commit removed (a file given a deletion vector is removed and added again)."""
    path = Path(table.table_uri.removeprefix("file://")) / "_delta_log" / f"{table.version():020d}.json"
    return {json.loads(line)["remove"]["path"] for line in path.read_text().splitlines() if '"remove"' in line}


def test_in_keys_and_replaced_keys() -> None:
    """The overwrite's condition names each key once, bounded by the smallest and the largest (a
    string's quote and backslash escaped); keys are given for integers and strings alone, none
    NULL, at most REPLACE_KEYS_MAX."""
    assert engine_commits.in_keys("`id`", (3, 1, 3)) == "`id` IS NOT NULL AND `id` >= 1 AND `id` <= 3 AND `id` IN (1, 3)"
    assert engine_commits.in_keys("`s`", ("b", "it's", "a\\b")) == (
        "`s` IS NOT NULL AND `s` >= 'a\\\\b' AND `s` <= 'it\\'s' AND `s` IN ('a\\\\b', 'b', 'it\\'s')")
    assert engine_commits.replaced_keys(pa.chunked_array([pa.array([1, 2], I32)])) == (1, 2)
    assert engine_commits.replaced_keys(pa.chunked_array([pa.array(["x"], S)])) == ("x",)
    assert engine_commits.replaced_keys(pa.chunked_array([pa.array([1.5], F64)])) is None
    assert engine_commits.replaced_keys(pa.chunked_array([pa.array([1, None], I64)])) is None
    assert engine_commits.replaced_keys(pa.chunked_array([pa.array([], I64)])) is None
    many = pa.chunked_array([pa.array(range(engine_commits.REPLACE_KEYS_MAX + 1), I64)])
    assert engine_commits.replaced_keys(many) is None


def test_key_ranges() -> None:
    """The ranges of the files holding a key, new keys' runs between files, merged when they meet;
    files holding none left out; past the limit the narrowest gaps joined."""
    files = ([0, 100, 200, 300], [99, 199, 299, 399])
    assert engine_commits.key_ranges([150], *files) == [(100, 199)]
    # Two files next to each other merge; a key past every file is its own run.
    assert engine_commits.key_ranges([5, 150, 1000, 1002], *files) == [(0, 199), (1000, 1002)]
    # New keys on both sides of a file are two runs (the file between them stays out).
    files = ([0, 100], [9, 109])
    assert engine_commits.key_ranges([20, 30, 200], *files) == [(20, 30), (200, 200)]
    # Overlapping files: the key's files, both; a file whose range holds no key, none.
    assert engine_commits.key_ranges([5], [0, 3, 50], [10, 60, 70]) == [(0, 60)]
    assert engine_commits.key_ranges([], [0], [9]) == []
    assert engine_commits.key_ranges([1, 2], [], []) == [(1, 2)]
    spread = engine_commits.key_ranges(list(range(0, 1000, 10)), list(range(5, 1000, 10)), list(range(6, 1000, 10)),
                                       limit=3)
    assert len(spread) == 3 and spread[0][0] == 0 and spread[-1][1] == 990


@pytest.mark.parametrize("seed", range(6))
def test_pruned_rewrite_equals_merge(
    seed: int, tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random tables in files of key ranges (some overlapping, some gaps) and random windows of
    updates, deletes and inserts (inside files, between them, past them): the rewrite gives the
    MERGE's rows, and the Delta log shows it removed exactly the files whose statistics' range
    holds a key of the window (and, where files overlap, those inside such a range), the others
    untouched."""
    if not shared_engine.start(EngineConfig(), Lake(str(tmp_path))).embedded:
        pytest.skip("the rewrite is the embedded engine's")
    rng = random.Random(seed)
    starts = sorted(rng.sample(range(0, 5000, 50), 8))
    parts = [list(range(a, a + rng.randint(5, 60), rng.choice([1, 2, 3]))) for a in starts]
    if seed % 2:
        parts.append(rng.sample(range(starts[2], starts[4] + 10), 6))  # a file overlapping others
    ids = [i for part in parts for i in part]
    ids = list(dict.fromkeys(ids))
    keys = set(rng.sample(ids, rng.randint(1, 12)))
    new = set(rng.sample(range(-50, 6000), 6)) - set(ids)
    ops = {k: rng.choice("UD") for k in keys} | {k: "I" for k in new}
    source = {"id": pa.array(sorted(ops), I64), "v": [f"s{k}" for k in sorted(ops)], OP: [ops[k] for k in sorted(ops)]}
    seen: set[int] = set()
    files: list[list[int]] = []
    for part in parts:
        files.append([i for i in part if i not in seen])
        seen.update(part)
    files = [f for f in files if f]
    results = []
    for mode, threshold in (("merge", 1 << 40), ("rewrite", 1)):
        monkeypatch.setattr(engine_commits, "EMBEDDED_REWRITE_ROWS", threshold)
        lake = Lake(str(tmp_path / mode))
        uri = lake.table_uri("public", "t")
        engine = shared_engine.start(EngineConfig(), lake)
        for f in files:
            engine.append(uri, pa.table({"id": pa.array(f, I64), "v": [f"t{i}" for i in f]}))
        before = {a["path"]: (a["min.id"], a["max.id"]) for a in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist()}
        engine.merge(
            uri, lake.stage(pa.table(source), "source"),
            lambda t, v: MergeRows(merge_statement(t, v, ["id"], ("id", "v"), truncate=False), ("id",), ("id", "v"), False, False),
            rows=len(ops),
        )
        table = DeltaTable(uri)
        results.append(sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"]))
    assert results[0] == results[1], f"seed {seed}"
    assert [h["operation"] for h in table.history(1)] == ["WRITE"]
    after = {a["path"] for a in pa.table(table.get_add_actions(flatten=True)).to_pylist()}
    removed = {p for p in before if p not in after}
    holding = {p for p, (lo, hi) in before.items() if any(lo <= k <= hi for k in ops)}
    if seed % 2 == 0:  # files of disjoint key ranges
        assert removed == holding, (seed, sorted(before.values()), sorted(ops))
    else:  # a file overlapping others: a file inside its range is rewritten with it, no other
        spans = [before[p] for p in holding]
        meets = {p for p, (lo, hi) in before.items() if any(lo <= b and hi >= a for a, b in spans)}
        assert holding <= removed <= meets, (seed, sorted(before.values()), sorted(ops))


def _nan_safe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: ("NaN" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]


def test_rewrite_keeps_a_merge_for_columns_the_source_lacks(
    tmp_path: Path, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A column of the table that the window does not set (a dropped column the lake keeps): the
    rows a MERGE updates keep its value, so such a table stays a MERGE."""
    monkeypatch.setattr(engine_commits, "EMBEDDED_REWRITE_ROWS", 0)
    case = _case(
        {"id": pa.array([1, 2, 3], I32), "v": ["a", "b", "c"], "gone": ["g1", "g2", "g3"]},
        {"id": pa.array([2, 4], I32), "v": ["b2", "d"], OP: ["U", "I"]},
        ["id"],
    )
    lake = Lake(str(tmp_path / "lake"))
    uri = lake.table_uri("public", "t")
    engine = shared_engine.start(EngineConfig(), lake)
    engine.append(uri, case["table"])
    staged = lake.stage(case["source"], "source")
    engine.merge(
        uri, staged,
        lambda t, v: MergeRows(merge_statement(t, v, ["id"], ["id", "v"], truncate=False), ("id",), ("id", "v"), False, False),
        rows=2,
    )
    table = DeltaTable(uri)
    assert sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "v": "a", "gone": "g1"}, {"id": 2, "v": "b2", "gone": "g2"},
        {"id": 3, "v": "c", "gone": "g3"}, {"id": 4, "v": "d", "gone": None},
    ]
    assert [h["operation"] for h in table.history(1)] == ["MERGE"]


@pytest.mark.e2e
@pytest.mark.parametrize("budget", [None, 1], ids=["in-memory", "spilled"])
def test_random_workload_committed_as_rewrites(
    pgdb: str, tmp_path: Path, budget: int | None, shared_engine: SharedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The random workload (every kind of table, TOAST, key changes, truncates) with every window's
    MERGE into a table that has rows committed as a rewrite instead: the lake equals PostgreSQL
    after each run, in-memory windows and spilled ones."""
    if not shared_engine.start(EngineConfig(), Lake(str(tmp_path))).embedded:
        pytest.skip("the rewrite is the embedded engine's")
    monkeypatch.setattr(engine_commits, "EMBEDDED_REWRITE_ROWS", 0)
    rewrites: list[str] = []
    original = engine_commits.Commits._rewrite_range

    def spy(self: Any, uri: str, *args: Any) -> bool:
        done = original(self, uri, *args)
        if done:
            rewrites.append(uri)
        return done

    monkeypatch.setattr(engine_commits.Commits, "_rewrite_range", spy)
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    lake = tmp_path / "lake"
    flags: dict[str, Any] = {"memory_budget": budget, "split_rows": 7} if budget else {}
    with Workload(pgdb, 4242 + (budget or 0)) as wl:
        for phase in range(3):
            wl.phase(60)
            cfg = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake), **flags)
            report = run(cfg)
            assert report.end_lsn > 0
            assert_lake_matches(pgdb, lake, context=f"phase {phase}, budget {budget}")
    # Every table: the first phase creates them (appends), the later ones rewrite.
    assert {uri.rsplit("/", 2)[-2] + "." + uri.rsplit("/", 2)[-1] for uri in rewrites} == {t.qualified for t in TABLES}


@pytest.mark.e2e
def test_bulk_update_rewritten_then_replayed(pgdb: str, tmp_path: Path) -> None:
    """One transaction updating 120,000 rows of a 150,000-row table (also deleting and inserting),
    at the default threshold, through the real CLI: killed right after its commit, the slot has
    not moved; the rerun commits the same rows again and the lake equals PostgreSQL."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    table = f"bulk_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, v text, n int)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE {table}")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute(f"INSERT INTO {table} SELECT g, 'v' || g, g % 7 FROM generate_series(1, 150000) g")
    lake = tmp_path / "lake"
    common = ["run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli(*common)
    assert first.returncode == 0, first.stderr[-2000:]
    with psycopg.connect(pgdb) as conn, conn.transaction():
        conn.execute(f"UPDATE {table} SET v = 'u' || id, n = n + 1 WHERE id > 30000")
        conn.execute(f"DELETE FROM {table} WHERE id % 1000 = 0")
        conn.execute(f"INSERT INTO {table} SELECT g, 'new', 0 FROM generate_series(200001, 201000) g")
    before = confirmed_lsn(pgdb, slot)
    crashed = cli(*common, env={FAULT_ENV: "after_commits"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before
    rerun = cli(*common, "-v")
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "committed as a rewrite" in rerun.stderr
    dt = DeltaTable(str(lake / "public" / table))
    assert [h["operation"] for h in dt.history(2)] == ["WRITE", "WRITE"]  # the crashed run's, and the replay's
    got = sorted(tuple(r.values()) for r in read_delta(lake / "public" / table, columns=["id", "v", "n"]).to_pylist())
    with psycopg.connect(pgdb) as conn:
        want = sorted(conn.execute(f"SELECT id, v, n FROM {table}").fetchall())
    assert len(want) == 150000 - 150 + 1000
    assert got == want


def test_compaction_sorts_files_whose_key_ranges_overlap(tmp_path: Path, shared_engine: SharedEngine) -> None:
    """Files whose key ranges overlap (as a rewrite's on the embedded engine) are compacted in key
    order when the table's key is named: several files, each a key range apart, the same rows;
    files already apart are only compacted."""
    lake = Lake(str(tmp_path / "lake"))
    uri = lake.table_uri("public", "t")
    engine = shared_engine.start(EngineConfig(), lake)
    for part in range(4):  # four files, each spanning the whole key range
        ids = list(range(part, 40_000, 4))
        engine.append(uri, pa.table({"id": pa.array(ids, I64), "v": [f"t{i}" for i in ids]}))
    before = sorted(DeltaTable(uri).to_pyarrow_table().to_pylist(), key=lambda r: r["id"])
    assert overlapping(DeltaTable(uri), "id") > 0.7  # 3 of 4 files' ranges covered by the first
    engine.compact(uri, target_size=100_000, key="id")
    table = DeltaTable(uri)
    assert sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["id"]) == before
    spans = sorted((a["min.id"], a["max.id"]) for a in pa.table(table.get_add_actions(flatten=True)).to_pylist())
    assert len(spans) >= 2, spans
    if engine.embedded:  # delta-rs's sort: ranges apart
        assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), spans
        assert overlapping(table, "id") == 0.0
    else:  # Delta's ZORDER BY: ranges that share a few keys at their edges
        assert overlapping(table, "id") < engine_maintain.OVERLAP_SHARE, spans
    version = table.version()
    engine.compact(uri, key="id")  # apart already: a compaction (of these files into one) keeps the order
    assert overlapping(DeltaTable(uri), "id") < engine_maintain.OVERLAP_SHARE and DeltaTable(uri).version() >= version
