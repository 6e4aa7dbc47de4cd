"""``pg2delta verify``: the lake against the source at one LSN, on a real server and the real engine.

The lake is corrupted behind pg2delta's back with delta-rs (an independent writer), while a thread
keeps writing to PostgreSQL, and verify must name exactly the corrupted keys with the right kind;
an intact lake under the same writes must verify clean. The type test runs the type matrix of
tests/test_type_fidelity.py through the job (inserts, updates with unchanged TOAST, deletes,
truncate) and verifies it after every phase, then changes one value of every column in the lake
and expects exactly those (key, column) pairs back.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import random
import struct
import threading
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from psycopg import sql

from lake_read import read_delta
from pg2delta import verify as verify_module
from pg2delta.config import load
from pg2delta.errors import EXIT_VERIFY_DIFFERS, LakeError
from pg2delta.job import Job
from pg2delta.verify import DIFFERENT, EXTRA, MISSING, decode_items, first_depth, verify
from test_type_fidelity import SETUP, TOAST_COLUMNS, _literal_columns, _phases
from workload import cli

# --- unit: the pieces that need no server --------------------------------------------------------


def test_items_round_trip_and_cannot_run_together() -> None:
    assert decode_items("V1:aNV0:V2:é") == ["a", None, "", "é"]
    assert decode_items("V3:a:bV1:N") == ["a:b", "N"]
    assert first_depth(10) == 1 and first_depth(2_000 * 16) == 1 and first_depth(2_000 * 17) == 2
    assert first_depth(10**12) == 4


# --- a table, a writer thread, the lake corrupted with delta-rs -----------------------------------

ITEMS = """
CREATE TABLE items (id int PRIMARY KEY, name text, qty int, price numeric(10,2), at timestamptz, tags text[]);
INSERT INTO items SELECT g, 'item ' || g, g % 7, g * 1.25, '2024-01-01'::timestamptz + g * interval '1 minute',
                         ARRAY['t' || (g % 3)] FROM generate_series(1, 3000) g;
"""


class Writer(threading.Thread):
    """Keeps changing rows with ids above 10000 (inserts, updates, deletes) until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.commits = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                n = 10_000
                while not self.stop.is_set():
                    n += 1
                    with conn.transaction():
                        conn.execute("INSERT INTO items VALUES (%s, 'new', 1, 2.50, now(), '{}')", (n,))
                        conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (n - 3,))
                        conn.execute("DELETE FROM items WHERE id = %s", (n - 7,))
                    self.commits += 1
                    time.sleep(0.005)
        except BaseException as exc:
            self.error = exc


def _setup(dsn: str, tmp: Path) -> tuple[list[str], Path]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    lake = tmp / "lake"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ITEMS)
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE items").format(sql.Identifier(pub)))
    common = ["--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    done = cli("bootstrap", *common)
    assert done.returncode == 0, done.stderr[-2000:]
    return common, lake


def _verify(common: list[str], *extra: str) -> tuple[int, dict[str, Any], str]:
    done = cli("verify", *common, "--json", *extra)
    assert done.returncode in (0, EXIT_VERIFY_DIFFERS), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout), done.stderr


def test_intact_lake_under_concurrent_writes_verifies_clean(pgdb: str, tmp_path: Path) -> None:
    common, _lake = _setup(pgdb, tmp_path)
    writer = Writer(pgdb)
    writer.start()
    try:
        time.sleep(0.5)
        assert cli("run", *common).returncode == 0
        code, report, _ = _verify(common)
        code2, report2, _ = _verify(common)
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None and writer.commits > 20
    for code_, rep in ((code, report), (code2, report2)):
        assert code_ == 0, rep
        t = rep["tables"]["public.items"]
        assert rep["equal"] is True and t["equal"] is True and t["differences"] == []
        assert t["source_rows"] == t["lake_rows"] > 3000 - 10
        assert t["buckets_compared"] >= 2
    assert report["at_lsn"] != report2["at_lsn"]  # each verify pins a point of its own


# Embedded only: the narrowing is the engine's SQL of test_every_type_verifies_clean_..., on Apache Spark there.
def test_corrupted_lake_names_exactly_the_corrupted_keys(pgdb: str, tmp_path: Path) -> None:
    common, lake = _setup(pgdb, tmp_path)
    path = str(lake / "public" / "items")
    writer = Writer(pgdb)
    writer.start()
    try:
        time.sleep(0.3)
        assert cli("run", *common).returncode == 0
        # behind pg2delta's back: one row changed, one deleted, one added (ids the writer never touches)
        table = DeltaTable(path)
        table.update(predicate="id = 17", updates={"qty": "qty + 100"})
        table.delete("id = 23")
        added = pa.table({
            "id": pa.array([5000], pa.int32()), "name": ["ghost"], "qty": pa.array([1], pa.int32()),
            "price": pa.array([Decimal("1.00")], pa.decimal128(10, 2)),
            "at": pa.array([dt.datetime(2024, 1, 1, tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC")),
            "tags": pa.array([["x"]], pa.list_(pa.string())),
        })
        write_deltalake(path, added.cast(pa.schema(DeltaTable(path).schema().to_arrow())), mode="append")
        time.sleep(0.3)  # the writer's changes after the corruption: verify's run merges them onto it
        code, report, _ = _verify(common)
        shown_code, shown, _ = _verify(common, "--show-values", "--table", "public.items")
        text = cli("verify", *common)
        # in process, with buckets of 5 rows from one hex digit on: the narrowing goes levels deep
        config = load(None, env={}, **dict(zip(("dsn", "slot", "publication", "lake"), common[1::2], strict=True)))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(verify_module, "BUCKET_ROWS", 5)
            mp.setattr(verify_module, "first_depth", lambda rows: 1)
            deep = verify(config)
        capped = verify(config, max_differences=1)
    finally:
        writer.stop.set()
        writer.join()
    assert writer.error is None
    for c, rep in ((code, report), (shown_code, shown)):
        assert c == EXIT_VERIFY_DIFFERS
        t = rep["tables"]["public.items"]
        assert rep["equal"] is False and t["truncated"] is False
        assert sorted((d["kind"], d["key"]["id"]) for d in t["differences"]) == [
            (DIFFERENT, "17"), (EXTRA, "5000"), (MISSING, "23"),
        ]
        assert [d["columns"] for d in t["differences"] if d["kind"] == DIFFERENT] == [["qty"]]
        assert t["lake_rows"] == t["source_rows"]  # one deleted, one added
    assert all("source" not in d for d in report["tables"]["public.items"]["differences"])  # keys only by default
    changed = next(d for d in shown["tables"]["public.items"]["differences"] if d["kind"] == DIFFERENT)
    assert int(changed["lake"]["qty"]) == int(changed["source"]["qty"]) + 100
    [t] = deep.tables
    assert sorted((d.kind, d.key["id"]) for d in t.differences) == [(DIFFERENT, "17"), (EXTRA, "5000"), (MISSING, "23")]
    assert t.buckets_compared > 16 * 3  # three differing buckets of 1 digit, each split further
    [t] = capped.tables
    assert len(t.differences) == 1 and t.truncated and not capped.equal
    assert text.returncode == EXIT_VERIFY_DIFFERS
    assert "different_values: (id='17') columns qty" in text.stdout and "ghost" not in text.stdout


def test_bad_input_is_one_line(pgdb: str, tmp_path: Path) -> None:
    common, _lake = _setup(pgdb, tmp_path)
    for args, message in (
        (["--table", "public.nope"], "not a table of the lake"),
        (["--table", "items"], "--table takes schema.table"),
    ):
        done = cli("verify", *common, *args)
        assert done.returncode == 78, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("pg2delta:")]
        assert len(lines) == 1 and message in lines[0], done.stderr
    done = cli("verify", *common[:-1], str(tmp_path / "empty-lake"))
    assert done.returncode == 78 and "no applied log" in done.stderr


def test_keyless_tables_are_skipped(pgdb: str, tmp_path: Path) -> None:
    common, _lake = _setup(pgdb, tmp_path)
    pub = common[common.index("--publication") + 1]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE log_rows (v text)")
        conn.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE log_rows").format(sql.Identifier(pub)))
        conn.execute("INSERT INTO log_rows VALUES ('a'), ('b')")
    assert cli("run", *common).returncode == 0
    code, report, _ = _verify(common)
    assert code == 0 and report["tables"]["public.log_rows"]["skipped"].startswith("no key")
    assert report["tables"]["public.items"]["equal"] is True
    done = cli("verify", *common, "--table", "public.log_rows")  # asked for by name: an error, one line
    assert done.returncode == 78, done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("pg2delta:")] == [
        "pg2delta: schema error: cannot verify public.log_rows: no key (rows are appended, keyed by their commit "
        "position): not compared"
    ]


def test_partitions_written_into_their_root_are_verified(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``: the source side is the root's published leaves, each ONLY its own
    rows under its own row filter and the published columns, against the root's one Delta table."""
    tag = uuid.uuid4().hex[:8]
    slot, pub, lake = f"slot_{tag}", f"pub_{tag}", tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int, k int, v text, secret text, PRIMARY KEY (id, k)) PARTITION BY LIST (k)")
        for k in (1, 2, 3):
            conn.execute(f"CREATE TABLE m{k} PARTITION OF m FOR VALUES IN ({k})")
        conn.execute("INSERT INTO m SELECT g, k, 'p' || k || ' ' || g, 's' FROM generate_series(1, 40) g, "
                     "generate_series(1, 3) k")
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE m1 (id, k, v), m2 (id, k, v) WHERE (id % 2 = 0), "
                             "m3 (id, k, v)").format(sql.Identifier(pub)))
    config = tmp_path / "root.toml"
    config.write_text(f'[source]\ndsn = "{pgdb}"\nslot = "{slot}"\npublication = "{pub}"\n'
                      f'[lake]\nroot = "{lake}"\n[tables."public.m"]\npartitions = "root"\n')
    common = ["--config", str(config)]
    done = cli("bootstrap", *common)
    assert done.returncode == 0, done.stderr[-2000:]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO m VALUES (100, 1, 'new', 's'), (101, 2, 'filtered out', 's'), (102, 2, 'new', 's')")
        conn.execute("UPDATE m SET v = 'updated', secret = 'not published' WHERE k = 3 AND id <= 10")
        conn.execute("DELETE FROM m WHERE k = 2 AND id BETWEEN 20 AND 25")
        conn.execute("UPDATE m SET k = 2, v = 'moved' WHERE k = 1 AND id BETWEEN 20 AND 23")  # m1 -> m2, odd ids filtered
        expected = conn.execute("SELECT (SELECT count(*) FROM m1) + (SELECT count(*) FROM m2 WHERE id % 2 = 0) "
                                "+ (SELECT count(*) FROM m3)").fetchone()
    done = cli("run", *common)
    assert done.returncode == 0, done.stderr[-2000:]
    code, report, _ = _verify(common)
    assert code == 0, report
    assert set(report["tables"]) == {"public.m"}  # the leaves have no Delta tables of their own
    t = report["tables"]["public.m"]
    assert t["equal"] is True and t["skipped"] is None and t["differences"] == [] and t["columns_not_compared"] == []
    assert expected is not None and t["source_rows"] == t["lake_rows"] == expected[0] == 37 + 20 + 40

    # behind pg2delta's back: one value of a row of m1 in the root's Delta table
    DeltaTable(str(lake / "public" / "m")).update(predicate="id = 5 AND k = 1", updates={"v": "'changed'"})
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE m SET v = v WHERE id = 1 AND k = 3")  # a window on top of it: verify reads it
    code, report, _ = _verify(common, "--table", "public.m")
    assert code == EXIT_VERIFY_DIFFERS
    t = report["tables"]["public.m"]
    assert report["equal"] is False and t["source_rows"] == t["lake_rows"] == expected[0]
    assert t["differences"] == [{"kind": DIFFERENT, "key": {"id": "5", "k": "1"}, "columns": ["v"]}]
    text = cli("verify", *common)
    assert text.returncode == EXIT_VERIFY_DIFFERS
    assert "different_values: (id='5', k='1') columns v" in text.stdout, text.stdout


# --- every type ---------------------------------------------------------------------------------------


def _changed(value: Any, typ: pa.DataType) -> Any:
    """Another value of the same Arrow type (never equal under the canonical forms)."""
    if pa.types.is_boolean(typ):
        return not value
    if pa.types.is_integer(typ):
        return value - 1 if value > 0 else value + 1
    if pa.types.is_floating(typ):
        return 1.0 if math.isnan(value) or math.isinf(value) or value == 0 else value * 2
    if pa.types.is_decimal(typ):
        unit = Decimal(1).scaleb(-typ.scale)
        return value - unit if value > 0 else value + unit
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return value + "x"
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        return value + b"x"
    if pa.types.is_date(typ):
        return value - dt.timedelta(days=1) if value.year > 1 else value + dt.timedelta(days=1)
    if pa.types.is_timestamp(typ):
        return value - dt.timedelta(microseconds=1) if value.year > 1 else value + dt.timedelta(microseconds=1)
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return [*value, None]
    raise AssertionError(f"no change for {typ}")


def _corrupt_every_column(path: str, skip: set[int]) -> set[tuple[int, str]]:
    """One value of every column changed, each in another row where possible; the (id, column) pairs."""
    table = read_delta(path).sort_by("id")
    ids = table.column("id").to_pylist()
    changed: set[tuple[int, str]] = set()
    columns = {}
    for j, name in enumerate(table.column_names):
        values = table.column(name).to_pylist()
        if name != "id":
            rows = [i for i, v in enumerate(values) if v is not None and ids[i] not in skip]
            if rows:
                i = rows[j % len(rows)]
                values[i] = _changed(values[i], table.schema.field(name).type)
                changed.add((ids[i], name))
        columns[name] = pa.array(values, table.schema.field(name).type)
    write_deltalake(path, pa.table(columns, schema=table.schema), mode="overwrite")
    return changed


@pytest.mark.classic
def test_every_type_verifies_clean_and_every_changed_value_is_found(pg_server: Any, pgdb: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        version = conn.info.server_version // 10000
        conn.execute(SETUP)
        try:
            conn.execute("SELECT '<a/>'::xml")
            xml = True
        except psycopg.errors.FeatureNotSupported:
            xml = False
        literal = _literal_columns(version, xml)
        cols = [f"{n} {t}" for n, t, _v, _k in literal] + [f"{n} {t}" for n, t, _e, _k in TOAST_COLUMNS]
        conn.execute(f"CREATE TABLE matrix (id int PRIMARY KEY, {', '.join(cols)})")
        for n, _t, _e, _k in TOAST_COLUMNS:
            conn.execute(f"ALTER TABLE matrix ALTER {n} SET STORAGE EXTERNAL")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE matrix")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        config = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(tmp_path / "lake"))
        job = Job(config)
        try:
            for phase in _phases(conn, literal):
                job.run()
                report = verify(config, show_values=True)
                [t] = report.tables
                assert t.differences == [] and t.equal, (phase, t.differences[:5])
                assert t.columns_not_compared == [], t.columns_not_compared
                assert t.source_rows == t.lake_rows > 0
        finally:
            job.close()
        path = str(tmp_path / "lake" / "public" / "matrix")
        ids = {int(r[0]) for r in conn.execute("SELECT id FROM matrix").fetchall()}
        touched = min(ids)
        changed = _corrupt_every_column(path, skip={touched})
        assert len(changed) >= len(literal)  # every column has a non-NULL value somewhere
        conn.execute("UPDATE matrix SET c_int2 = c_int2 WHERE id = %s", (touched,))  # a window on top of it
    report = verify(config, ["public.matrix"], show_values=True)
    [t] = report.tables
    found = {(int(str(d.key["id"])), c) for d in t.differences for c in d.columns}
    assert {d.kind for d in t.differences} == {DIFFERENT}
    assert found == changed, (sorted(found - changed), sorted(changed - found))
    for d in t.differences:
        assert d.source is not None and d.lake is not None and set(d.source) == set(d.columns)


@pytest.mark.classic
def test_random_float_bits_verify_clean(pgdb: str, tmp_path: Path) -> None:
    """Doubles and floats of random bit patterns (subnormals, huge, tiny, negative): Spark's arithmetic
    significand and exponent must equal the ones PostgreSQL reads from the bits."""
    rng = random.Random(20261125)
    doubles = [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(3000)]
    doubles += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(52)))[0] for _ in range(300)]  # subnormals
    doubles = [d for d in doubles if not math.isnan(d)]
    floats = [struct.unpack("<f", struct.pack("<I", rng.getrandbits(32)))[0] for _ in range(len(doubles))]
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE floats (id int PRIMARY KEY, d float8, f float4)")
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE floats").format(sql.Identifier(pub)))
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO floats VALUES (%s, %s, %s)",
                            [(i, d, None if math.isnan(f) else f) for i, (d, f) in enumerate(zip(doubles, floats, strict=True))])
    config = load(None, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(tmp_path / "lake"))
    report = verify(config)
    [t] = report.tables
    assert t.equal and t.differences == [] and t.source_rows == len(doubles), t.differences[:5]
    # one ulp changed is found
    path = str(tmp_path / "lake" / "public" / "floats")
    DeltaTable(path).update(predicate="id = 5", updates={"d": f"CAST({doubles[5]!r} AS DOUBLE) * 1.0000000000000002"})
    [t] = verify(config).tables
    assert [(d.key["id"], d.columns) for d in t.differences] == [("5", ("d",))]
    assert [c.operation for c in t.foreign_commits] == ["UPDATE"]


def test_a_run_past_the_pinned_lsn_meanwhile_is_retryable(pgdb: str, tmp_path: Path) -> None:
    """Another run moves the slot past L between verify's pinning and its own run: no version holds L."""
    common, _lake = _setup(pgdb, tmp_path)
    config = load(None, env={}, **dict(zip(("dsn", "slot", "publication", "lake"), common[1::2], strict=True)))
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE items SET qty = qty + 1 WHERE id = 1")  # before L, not applied yet

    class Racing(Job):
        def run(self, *, until_lsn: int | None = None, create_slot: bool | None = None) -> Any:
            with psycopg.connect(pgdb, autocommit=True) as conn:
                conn.execute("UPDATE items SET qty = qty + 1 WHERE id = 2")  # after L
            other = Job(self.config)
            try:
                other.run()  # one window over both updates, ending past L
            finally:
                other.close()
            return super().run(until_lsn=until_lsn, create_slot=create_slot)

    with pytest.raises(LakeError, match="inside the window") as raised:
        verify(config, job_factory=Racing)
    assert raised.value.exit_code == 75
    report = verify(config)  # a new pin after it: exact again
    assert report.equal and report.tables[0].source_rows == 3000
