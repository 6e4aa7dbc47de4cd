"""Bootstrap: the initial copy at the slot's exported snapshot, then ``run``, equal to PostgreSQL.

Every test writes to the tables while the copy runs (a background workload), so the boundary
between the snapshot and the slot's changes is exercised: a change on both sides would show as a
doubled row in the keyless table, a change on neither side as a missing or stale row.
"""

from __future__ import annotations

import itertools
import json
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from conftest import newest_server_only
from engines import TEST_ENGINE
from lake_read import data_commits, read_delta
from pg2delta.bootstrap import run_bootstrap
from pg2delta.config import load
from pg2delta.copy import staging as copy_staging
from pg2delta.errors import Pg2DeltaError
from pg2delta.faults import FAULT_ENV
from pg2delta.job import run
from pg2delta.lake.applied_log import LOG_TABLE
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import (
    TABLES,
    TableSpec,
    Workload,
    assert_lake_matches,
    cli,
    confirmed_lsn,
    create_schema,
    lsn_int,
)

pytestmark = pytest.mark.e2e

ROWS = 60_000  # rows preloaded into acct; the benchmark uses 1 M


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"slot_{tag}", f"pub_{tag}"


def _preload(dsn: str, rows: int = ROWS) -> None:
    """Rows that exist before the slot; keys far from the workload's own new keys."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO acct (id, big, name, amount, at, doc, flag, blob, body) "
            "SELECT 1000000 + g, g * 7919, 'pre ' || g, (g %% 10007) * 0.25, "
            "timestamptz '2021-01-01 00:00:00+00' + g * interval '1 minute', jsonb_build_object('g', g, 's', 'x'), "
            "CASE WHEN g %% 3 = 0 THEN NULL ELSE g %% 2 = 0 END, decode(lpad(to_hex(g), 8, '0'), 'hex'), "
            "CASE WHEN g %% 500 = 0 THEN repeat(md5(g::text), 300) END "
            "FROM generate_series(1, %s) g",
            (rows,),
        )
        conn.execute(
            "INSERT INTO shop.pair SELECT 'r' || (g %% 3) || '-p', 1000000 + g, g, 'note ' || g, now() "
            "FROM generate_series(1, %s) g",
            (rows // 4,),
        )
        conn.execute(
            "INSERT INTO fullid SELECT 1000000 + g, 'v' || g, g * 0.5, g %% 2 = 0, NULL FROM generate_series(1, %s) g",
            (rows // 4,),
        )
        conn.execute(
            "INSERT INTO events SELECT now(), 'pre', g %% 7, NULL, NULL FROM generate_series(1, %s) g", (rows // 2,)
        )
        conn.execute("ANALYZE")


class Background:
    """The seeded workload, phase after phase in a thread, until :meth:`finish`."""

    def __init__(self, dsn: str, seed: int) -> None:
        self.wl = Workload(dsn, seed).__enter__()
        self.stop = threading.Event()
        self.phases = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                self.wl.phase(12, truncate=False)
                self.phases += 1
        except BaseException as exc:  # re-raised in finish()
            self.error = exc

    def __enter__(self) -> Background:
        self.thread.start()
        while self.phases == 0 and self.thread.is_alive():
            self.stop.wait(0.05)
        return self

    def finish(self) -> int:
        self.stop.set()
        self.thread.join(timeout=120)
        self.wl.__exit__()
        if self.error is not None:
            raise self.error
        return self.phases

    def __exit__(self, *exc: object) -> None:
        if not self.stop.is_set():
            self.finish()


def _config(dsn: str, slot: str, pub: str, lake: Path) -> Any:
    return load(None, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake))


def _log_rows(lake: Path, slot: str) -> list[dict[str, Any]]:
    return [r for r in read_delta(str(lake / LOG_TABLE)).to_pylist() if r["slot"] == slot]


def _version(lake: Path, spec: TableSpec) -> int | None:
    path = lake / spec.schema / spec.name
    return DeltaTable(str(path)).version() if (path / "_delta_log").is_dir() else None


def test_bootstrap_under_a_concurrent_workload_then_run(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _preload(pgdb)
    cfg = _config(pgdb, slot, pub, lake)
    with Background(pgdb, 41) as bg:
        report = run_bootstrap(cfg)
        during = bg.phases
        bg.finish()
    assert report.created_slot
    assert {f"{t.schema}.{t.table}" for t in report.copied} == {t.qualified for t in TABLES}
    assert all(t.snapshot_lsn == report.start_lsn for t in report.copied)
    copied = {f"{t.schema}.{t.table}": t.rows for t in report.copied}
    assert copied["public.acct"] >= ROWS - 200, copied  # the workload deletes a few preloaded rows
    assert confirmed_lsn(pgdb, slot) is not None and lsn_int(confirmed_lsn(pgdb, slot) or "") == report.start_lsn
    rows = _log_rows(lake, slot)
    assert [r["window_end"] for r in rows if r["relation_oid"] is None] == [report.start_lsn]
    assert sorted(r["table_name"] for r in rows if r["kind"] == "bootstrap" and r["relation_oid"]) == sorted(
        t.name for t in TABLES
    )

    after = run(cfg)
    assert during > 0 and after.changes > 0, "the workload did not write while the bootstrap ran"
    assert_lake_matches(pgdb, lake, context="bootstrap under a workload, then run")
    assert not list((lake / "_pg2delta" / "staging").rglob("*.parquet")), "staging files left behind"
    assert not (lake / "_pg2delta" / "staging" / "bootstrap" / slot).exists(), "the copy's staging folder left"


@pytest.mark.classic
def test_bootstrap_killed_after_a_table_then_resumed(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _preload(pgdb, ROWS // 2)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    with Background(pgdb, 43) as bg:
        killed = cli("bootstrap", *common, "--parallel", "1", env={FAULT_ENV: "bootstrap_after_table"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert confirmed_lsn(pgdb, slot) is not None, "the slot must survive the kill"
        done = {spec.qualified: _version(lake, spec) for spec in TABLES}
        finished = [name for name, v in done.items() if v is not None]
        assert finished == ["public.acct"], done  # the largest table goes first
        resumed = cli("bootstrap", *common, "--json")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        bg.finish()
    report = json.loads(resumed.stdout)
    assert report["created_slot"] is False
    assert report["already_copied"] == ["public.acct"]
    assert sorted(report["tables"]) == sorted(t.qualified for t in TABLES if t.qualified != "public.acct")
    assert _version(lake, TABLES[0]) == done["public.acct"], "a finished table was copied again"
    # The resumed tables are as of a later snapshot than the slot's start.
    assert all(lsn_int(t["as_of_lsn"]) > lsn_int(report["start_lsn"]) for t in report["tables"].values())

    again = cli("run", *common)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_lake_matches(pgdb, lake, context="bootstrap killed after a table, resumed, run")


def test_new_tables_take_the_staged_files_unless_their_folder_holds_others(
    pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path
) -> None:
    """On the embedded engine a new table's version 0 is its copy's staged files, moved and
    converted (no rewrite), with statistics of its key and none of a boolean, a bytea or a float (in
    the log or the footers: pysail would fold a NaN into a file's other value, and a later MERGE
    would write that back); a folder holding somebody else's files is left as it is, and the engine
    writes the table there."""
    newest_server_only(pg_server, "how the lake takes a copy does not depend on the server")
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _preload(pgdb, 4000)
    with psycopg.connect(pgdb, autocommit=True) as conn:  # floats: a file's NaN must survive a later MERGE (min = max of the other values)
        conn.execute("CREATE TABLE floats (id int PRIMARY KEY, f float8, r real)")
        conn.execute("INSERT INTO floats VALUES (1, 'NaN', 'NaN'), (2, 2.5, 2.5), (3, 2.5, 2.5)")
        conn.execute(f"ALTER PUBLICATION {pub} ADD TABLE floats")
    foreign = lake / "shop" / "pair" / "notes.txt"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("not ours")
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    done = cli("bootstrap", *common, "--parallel", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    first = {spec.qualified: DeltaTable(str(lake / spec.schema / spec.name)).history()[-1] for spec in TABLES}
    if TEST_ENGINE == "embedded":
        assert first["public.acct"]["operation"] == "CONVERT", first["public.acct"]
    assert first["shop.pair"]["operation"] != "CONVERT", first["shop.pair"]
    assert foreign.read_text() == "not ours"
    acct = DeltaTable(str(lake / "public" / "acct"))
    assert acct.metadata().configuration.get("delta.dataSkippingStatsColumns"), acct.metadata().configuration
    adds = pa.table(acct.get_add_actions(flatten=True))
    assert pc.min(adds.column("min.id")).as_py() == 1000001 and pc.max(adds.column("max.id")).as_py() == 1004000
    assert not [c for c in adds.column_names if c.startswith("min.") and c[4:] in ("flag", "blob")]
    floats = DeltaTable(str(lake / "public" / "floats"))
    assert not [c for c in pa.table(floats.get_add_actions(flatten=True)).column_names if c[4:] in ("f", "r")]
    for file in floats.file_uris():  # nor in the files' footers, which pysail reads too
        meta = pq.ParquetFile(file).metadata
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                col = meta.row_group(g).column(c)
                assert col.path_in_schema not in ("f", "r") or col.statistics is None or not col.statistics.has_min_max
    assert_lake_matches(pgdb, lake, context="bootstrap")
    with psycopg.connect(pgdb, autocommit=True) as conn:  # a MERGE that rewrites the NaN rows' file
        conn.execute("UPDATE floats SET r = 0.5 WHERE id = 2")
    again = cli("run", *common)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_lake_matches(pgdb, lake, context="bootstrap, run")
    rows = sorted(read_delta(str(lake / "public" / "floats")).to_pylist(), key=lambda r: r["id"])
    assert [(r["id"], repr(r["f"]), repr(r["r"])) for r in rows] == [
        (1, "nan", "nan"), (2, "2.5", "0.5"), (3, "2.5", "2.5")
    ], rows


@pytest.mark.skipif(TEST_ENGINE != "embedded", reason="Apache Spark writes the copy's table itself")
@pytest.mark.parametrize("point", ["copy_adopt_moved", "copy_after_replace"])
def test_bootstrap_killed_around_a_copy_adopted(
    pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path, point: str
) -> None:
    """Killed after a new table's copy moved into its folder but before the commit adopting it, the
    next bootstrap removes those files and copies the table again; killed after that commit but
    before the applied log says so, it copies the table again over the adopted version. No row
    twice, none lost."""
    newest_server_only(pg_server, "how the lake takes a copy does not depend on the server")
    slot, pub = _names()
    lake = tmp_path / "lake"
    folder = lake / "public" / "acct"
    create_schema(pgdb, pub)
    _preload(pgdb, 4000)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    killed = cli("bootstrap", *common, "--parallel", "1", env={FAULT_ENV: point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert list(folder.glob("*.parquet"))
    assert (folder / "_delta_log").exists() == (point == "copy_after_replace")
    resumed = cli("bootstrap", *common, "--json")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "public.acct" in json.loads(resumed.stdout)["tables"]
    acct = DeltaTable(str(folder))
    # Version 0 adopts the copy, version 1 turns deletion vectors on (engine_writes.DeltaWrites.adopt_copy).
    if point == "copy_adopt_moved":
        assert acct.version() == 1
        on_disk = sorted(p.name for p in folder.glob("*.parquet"))
        assert on_disk == sorted(Path(u).name for u in acct.file_uris()), "files of the killed copy left beside the table"
    else:
        assert acct.version() == 2, "the copy is made again over the adopted one"
    assert_lake_matches(pgdb, lake, context=f"bootstrap killed at {point}, resumed")


def _copy_backends(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pg2delta bootstrap copy'"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("parallel", [1, 2])
def test_bootstrap_killed_mid_table_exposes_nothing(pgdb: str, tmp_path: Path, parallel: int) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _preload(pgdb, ROWS // 2)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    with Background(pgdb, 47) as bg:
        killed = cli("bootstrap", *common, "--parallel", str(parallel), env={FAULT_ENV: "bootstrap_mid_table"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        # The worker processes of a killed bootstrap stop too: none goes on copying for nobody.
        deadline = time.monotonic() + 60
        while _copy_backends(pgdb) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _copy_backends(pgdb) == 0, "the killed bootstrap's copies are still running"
        if parallel == 1:
            # Staged rows exist, but no table is visible: a reader never sees a half-loaded table.
            assert list((lake / "_pg2delta" / "staging").rglob("*.parquet"))
            assert all(_version(lake, spec) is None for spec in TABLES)
        # (With workers, a small table may be staged and committed whole before the first progress
        # report kills the bootstrap; the lake's comparison below covers every table either way.)
        resumed = cli("bootstrap", *common, "--json")
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        bg.finish()
    report = json.loads(resumed.stdout)
    assert sorted([*report["tables"], *report["already_copied"]]) == sorted(t.qualified for t in TABLES)
    if parallel == 1:
        assert report["already_copied"] == []
    staging = lake / "_pg2delta" / "staging"
    # Nothing the killed copy staged is left: not its tables' files, and not the staged append of
    # the lake's start the kill may have cut (the resumed bootstrap emptied the slot's folder).
    assert not list(staging.rglob("*.parquet")), "staging files of the killed copy left"
    again = cli("run", *common)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_lake_matches(pgdb, lake, context="bootstrap killed mid-table, resumed, run")


def test_a_bootstrap_failing_before_its_first_commit_is_resumed(pgdb: str, tmp_path: Path) -> None:
    """The slot exists once the snapshot is exported; a failure after that and before any table is
    committed (here: a table the copy cannot key) still leaves the lake's start logged, so the
    bootstrap run again after the fix resumes, without --resume."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE nokey (id int NOT NULL, v text)")
        conn.execute("ALTER TABLE nokey REPLICA IDENTITY FULL")
        conn.execute("INSERT INTO nokey SELECT g, 'v' || g FROM generate_series(1, 500) g")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE nokey")
    with pytest.raises(Pg2DeltaError, match="REPLICA IDENTITY FULL and no primary key"):
        run_bootstrap(_config(pgdb, slot, pub, lake))
    assert confirmed_lsn(pgdb, slot) is not None, "the slot was created before the failure"
    start = [r["window_end"] for r in _log_rows(lake, slot) if r["relation_oid"] is None]
    assert len(start) == 1, "the lake's start was not logged"

    conf = tmp_path / "keyed.toml"
    conf.write_text('[tables."public.nokey"]\nkey = ["id"]\n')
    keyed = load(conf, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
    report = run_bootstrap(keyed)  # no resume=True: the lake knows this slot
    assert report.created_slot is False and report.start_lsn == start[0]
    assert [(t.table, t.rows) for t in report.copied] == [("nokey", 500)]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE nokey SET v = 'changed' WHERE id <= 10")
    run(keyed)
    got = read_delta(str(lake / "public" / "nokey")).to_pylist()
    assert sorted((r["id"], r["v"]) for r in got) == [(i, "changed" if i <= 10 else f"v{i}") for i in range(1, 501)]


EXTRA = TableSpec("public", "extra", ("id",))


def _extra_writer(dsn: str, stop: threading.Event, errors: list[BaseException], committed: list[int] | None = None) -> None:
    """Inserts, updates and deletes on the table added later, in small transactions (their count
    goes to ``committed``)."""
    n = 0
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                n += 1
                with conn.transaction():
                    conn.execute("INSERT INTO extra VALUES (%s, %s, %s)", (500_000 + n, f"new {n}", n))
                    conn.execute("UPDATE extra SET n = n + 1, v = v || '+' WHERE id = %s", (1 + (n * 37) % 20_000,))
                    conn.execute("DELETE FROM extra WHERE id = %s", (1 + (n * 101) % 20_000,))
                conn.execute("INSERT INTO events (kind, n) VALUES ('extra', %s)", (n,))
                if committed is not None:
                    committed.append(n)
    except BaseException as exc:
        errors.append(exc)


def test_table_added_to_the_publication_mid_workload(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    _preload(pgdb, ROWS // 4)
    cfg = _config(pgdb, slot, pub, lake)
    with Background(pgdb, 53) as bg:
        run_bootstrap(cfg)
        run(cfg)
        with psycopg.connect(pgdb, autocommit=True) as conn:
            conn.execute("CREATE TABLE extra (id integer PRIMARY KEY, v text, n integer)")
            conn.execute("INSERT INTO extra SELECT g, 'old ' || g, g FROM generate_series(1, 20000) g")
            conn.execute("ANALYZE extra")
        stop, errors, committed = threading.Event(), [], []
        writer = threading.Thread(target=_extra_writer, args=(pgdb, stop, errors, committed), daemon=True)
        writer.start()
        try:
            with psycopg.connect(pgdb, autocommit=True) as conn:
                conn.execute(f'ALTER PUBLICATION "{pub}" ADD TABLE extra')
            # changes of extra committed after it joined the publication, before the run fixes its bound
            after = len(committed)
            deadline = time.monotonic() + 60
            while len(committed) < after + 2 and not errors and time.monotonic() < deadline:
                time.sleep(0.01)
            first = run(cfg)  # copies extra at a snapshot of its own, then applies everyone's changes
            stop.wait(0.5)
        finally:
            stop.set()
            writer.join(timeout=60)
        assert not errors, errors
        bg.finish()
    assert any(t.table == "extra" for w in first.windows for t in w.tables), "the run applied no change of extra"
    boot = [r for r in _log_rows(lake, slot) if r["table_name"] == "extra" and r["kind"] == "bootstrap"]
    assert len(boot) == 1 and boot[0]["inserts"] >= 20_000 - 200
    run(cfg)
    assert_lake_matches(pgdb, lake, (*TABLES, EXTRA), context="a table added to the publication mid-workload")


def test_run_skips_a_table_added_while_it_read(pgdb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table that joins the publication after run's check: its changes wait for the next run's copy."""
    import pg2delta.copy.copier as bootstrap_module

    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    cfg = _config(pgdb, slot, pub, lake)
    run_bootstrap(cfg)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE extra (id integer PRIMARY KEY, v text, n integer)")
        conn.execute("INSERT INTO extra SELECT g, 'old ' || g, g FROM generate_series(1, 100) g")
        conn.execute(f'ALTER PUBLICATION "{pub}" ADD TABLE extra')
        conn.execute("UPDATE extra SET n = -n WHERE id <= 10")
        conn.execute("INSERT INTO acct (id, name) VALUES (1, 'a')")
    # As if the table had joined the publication after the run's check: nothing is copied first.
    real = bootstrap_module.copy_new_tables
    monkeypatch.setattr(bootstrap_module, "copy_new_tables", lambda job, src, **kw: True)
    report = run(cfg)
    assert [t.skipped for w in report.windows for t in w.tables if t.table == "extra"] == [True]
    assert _version(lake, EXTRA) is None, "a table without a copy must not be created from its changes"
    monkeypatch.setattr(bootstrap_module, "copy_new_tables", real)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE extra SET v = 'later' WHERE id > 90")
    run(cfg)
    assert_lake_matches(pgdb, lake, (*TABLES, EXTRA), context="table skipped, then copied")


def test_row_filter_and_column_list(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE filt (id integer PRIMARY KEY, a text, secret text, n integer)")
        conn.execute("INSERT INTO filt SELECT g, 'a' || g, 'hidden', g FROM generate_series(1, 5000) g")
        conn.execute(f'CREATE PUBLICATION "{pub}" FOR TABLE filt (id, a, n) WHERE (id % 2 = 0)')
    cfg = _config(pgdb, slot, pub, lake)
    report = run_bootstrap(cfg)
    assert [t.rows for t in report.copied] == [2500]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE filt SET n = n * 10, secret = 'changed' WHERE id % 5 = 0")
        conn.execute("UPDATE filt SET id = id + 10001 WHERE id BETWEEN 101 AND 140")  # odd <-> even: in and out
        conn.execute("DELETE FROM filt WHERE id % 7 = 0")
        conn.execute("INSERT INTO filt SELECT g, 'b' || g, 'hidden', -g FROM generate_series(6000, 6100) g")
    run(cfg)
    table = read_delta(str(lake / "public" / "filt"))
    assert table.column_names == ["id", "a", "n"]
    got = sorted(zip(*(table.column(c).to_pylist() for c in ("id", "a", "n")), strict=True))
    with psycopg.connect(pgdb) as conn:
        want = sorted(conn.execute("SELECT id, a, n FROM filt WHERE id % 2 = 0").fetchall())
    assert got == want


def test_bootstrap_refuses_an_existing_slot_without_a_bootstrap(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO acct (id, name) VALUES (1, 'a')")
    before = confirmed_lsn(pgdb, slot)
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    refused = cli("bootstrap", *common)
    assert refused.returncode == 78, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "already exists" in lines[0] and "--resume" in lines[0], refused.stderr
    assert confirmed_lsn(pgdb, slot) == before
    assert not lake.exists() or not any(lake.rglob("_delta_log")), "the refused bootstrap wrote to the lake"
    # --resume takes the slot as it is: every table copied at a new snapshot, the slot's later changes kept.
    resumed = cli("bootstrap", *common, "--resume", "--json")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads(resumed.stdout)["start_lsn"] == before
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET name = 'b' WHERE id = 1")
    assert cli("run", *common).returncode == 0
    assert_lake_matches(pgdb, lake)


def test_bootstrap_errors_touch_nothing(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    missing_pub = cli("bootstrap", "--dsn", pgdb, "--slot", slot, "--publication", "nope", "--lake", str(lake))
    assert missing_pub.returncode == 78, missing_pub.stderr
    assert len(missing_pub.stderr.strip().splitlines()) == 1 and "publication 'nope'" in missing_pub.stderr
    assert confirmed_lsn(pgdb, slot) is None, "the slot was created although the publication is missing"
    assert not lake.exists()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    down = cli("bootstrap", "--dsn", f"host=127.0.0.1 port={port} user=postgres dbname=x connect_timeout=2",
               "--slot", slot, "--publication", pub, "--lake", str(lake))
    assert down.returncode == 75, down.stderr
    assert len(down.stderr.strip().splitlines()) == 1 and "cannot connect" in down.stderr


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_snapshot_that_is_gone_stops_the_copy(pgdb: str, tmp_path: Path, parallel: int) -> None:
    """The exported snapshot dies with its replication connection: say so, write nothing."""
    from pg2delta.copy.copier import Copier
    from pg2delta.errors import ErrorKind, Pg2DeltaError
    from pg2delta.job import Job
    from pg2delta.source.publication import published_tables
    from pg2delta.source.snapshot import Snapshot

    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    job = Job(_config(pgdb, slot, pub, lake))
    try:
        with psycopg.connect(pgdb, autocommit=True) as conn:
            copier = Copier(job.copies, Snapshot(slot, 1, "00000003-0000FFFF-1"), "run", parallel=parallel)
            plans = copier.plans(conn, published_tables(conn, pub))
        with pytest.raises(Pg2DeltaError) as err:
            copier.copy_all(plans)
    finally:
        job.close()
    assert err.value.kind is ErrorKind.SOURCE_STATE and err.value.exit_code == 78
    assert "can no longer be imported" in str(err.value) and "bootstrap again" in str(err.value)
    assert not lake.exists() or not any(lake.rglob("_delta_log"))


def test_partitioned_table_published_through_its_root(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE parted (id integer PRIMARY KEY, v text) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE parted_a PARTITION OF parted FOR VALUES FROM (0) TO (1000)")
        conn.execute("CREATE TABLE parted_b PARTITION OF parted FOR VALUES FROM (1000) TO (100000)")
        conn.execute("INSERT INTO parted SELECT g, 'v' || g FROM generate_series(1, 3000) g")
        conn.execute(f'CREATE PUBLICATION "{pub}" FOR TABLE parted WITH (publish_via_partition_root = true)')
    cfg = _config(pgdb, slot, pub, lake)
    report = run_bootstrap(cfg)
    assert [(t.table, t.rows) for t in report.copied] == [("parted", 3000)]
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE parted SET v = v || '!' WHERE id % 10 = 0")
        conn.execute("DELETE FROM parted WHERE id % 7 = 0")
        conn.execute("INSERT INTO parted SELECT g, 'w' || g FROM generate_series(5000, 5100) g")
    run(cfg)
    assert_lake_matches(pgdb, lake, (TableSpec("public", "parted", ("id",)),))


def test_partitions_copied_into_their_root_with_row_filters_and_column_lists(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``: the published leaves, each under its own row filter and column list,
    copied into the root's one Delta table in one commit, logged as the root; the run follows on."""
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE parted (id integer, v text, secret text, PRIMARY KEY (id)) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE parted_a PARTITION OF parted FOR VALUES FROM (0) TO (1000)")
        conn.execute("CREATE TABLE parted_b PARTITION OF parted FOR VALUES FROM (1000) TO (100000)")
        conn.execute("INSERT INTO parted SELECT g, 'v' || g, 'hidden' FROM generate_series(1, 3000) g")
        conn.execute(
            f'CREATE PUBLICATION "{pub}" FOR TABLE parted_a (id, v) WHERE (id % 2 = 0), parted_b (id, v) WHERE (id % 3 = 0)'
        )
    conf = tmp_path / "pg2delta.toml"
    conf.write_text('[tables."public.parted"]\npartitions = "root"\n')
    cfg = load(conf, env={}, dsn=pgdb, slot=slot, publication=pub, lake=str(lake))
    report = run_bootstrap(cfg)
    assert [(t.schema, t.table, t.rows) for t in report.copied] == [("public", "parted", 499 + 667)]
    assert sorted(p.name for p in (lake / "public").iterdir()) == ["parted"]
    assert data_commits(lake / "public" / "parted") == 1  # one commit
    with psycopg.connect(pgdb) as conn:
        (root_oid,) = conn.execute("SELECT 'parted'::regclass::oid::int8").fetchall()[0]
    copied = [r for r in _log_rows(lake, slot) if r["relation_oid"] is not None]
    assert [(r["relation_oid"], r["kind"]) for r in copied] == [(root_oid, "bootstrap")]

    def want() -> list[tuple[Any, ...]]:
        with psycopg.connect(pgdb) as conn:
            return sorted(conn.execute(
                "SELECT id, v FROM parted_a WHERE id % 2 = 0 UNION ALL SELECT id, v FROM parted_b WHERE id % 3 = 0"
            ).fetchall())

    def got() -> list[tuple[Any, ...]]:
        table = read_delta(str(lake / "public" / "parted"))
        assert table.column_names == ["id", "v"]
        return sorted(zip(table.column("id").to_pylist(), table.column("v").to_pylist(), strict=True))

    assert got() == want()
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE parted SET v = v || '!', secret = 'changed' WHERE id % 5 = 0")
        conn.execute("UPDATE parted SET id = id + 10000 WHERE id BETWEEN 900 AND 930")  # moved to parted_b
        conn.execute("DELETE FROM parted WHERE id % 7 = 0")
        conn.execute("INSERT INTO parted SELECT g, 'w' || g, 'hidden' FROM generate_series(5000, 5100) g")
    run(cfg)
    assert got() == want()


@pytest.mark.skipif(TEST_ENGINE != "embedded", reason="Apache Spark writes the copy's table itself")
def test_bootstrap_writes_key_ranges_in_files_and_a_run_rewrites_one(
    pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table whose rows lie in the heap out of key order is copied in key order, in files of a
    bounded size: each file holds a key range apart from the others. A later run's update of one
    key then rewrites that key's file only, the others untouched in the Delta log."""
    newest_server_only(pg_server, "the copy's order and file sizes do not depend on the server")
    monkeypatch.setattr(copy_staging, "_FILE_ROWS", 1000)
    slot, pub = _names()
    lake = tmp_path / "lake"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE ordered (id bigint PRIMARY KEY, v text)")
        conn.execute("INSERT INTO ordered SELECT g, 'v' || g FROM generate_series(1, 5000) g ORDER BY random()")
        conn.execute(f'CREATE PUBLICATION "{pub}" FOR TABLE ordered')
    cfg = _config(pgdb, slot, pub, lake)
    run_bootstrap(cfg, parallel=1)
    uri = str(lake / "public" / "ordered")
    files = sorted(
        (a["min.id"], a["max.id"], a["path"]) for a in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist()
    )
    assert len(files) == 5, files
    assert all(a[1] < b[0] for a, b in itertools.pairwise(files)), files  # key ranges apart
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE ordered SET v = 'changed' WHERE id = 2500")
    run(cfg)
    after = {a["path"] for a in pa.table(DeltaTable(uri).get_add_actions(flatten=True)).to_pylist()}
    assert [f[2] for f in files if f[2] not in after] == [f[2] for f in files if f[0] <= 2500 <= f[1]]
    assert_lake_matches(pgdb, lake, (TableSpec("public", "ordered", ("id",)),))


def test_bootstrap_under_a_long_tmpdir(pg_server: ThrowawayPostgres, pgdb: str, tmp_path: Path) -> None:
    """A TMPDIR as long as a YARN container's (or a spark-submit driver's in a test's folder): the
    copy workers' forkserver listens on a Unix socket, whose path holds at most 107 bytes; the
    bootstrap stopped with 70, "AF_UNIX path too long" (CI, the standalone-cluster test)."""
    newest_server_only(pg_server, "where the copy's workers listen does not depend on the server")
    slot, pub = f"slot_{uuid.uuid4().hex[:8]}", f"pub_{uuid.uuid4().hex[:8]}"
    create_schema(pgdb, pub)
    _preload(pgdb, 500)
    long_tmp = tmp_path / ("t" * 60) / ("u" * 60)
    long_tmp.mkdir(parents=True)
    lake = tmp_path / "lake"
    done = cli("bootstrap", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake),
               "--parallel", "2", env={"TMPDIR": str(long_tmp)}, child=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_lake_matches(pgdb, lake, TABLES, context="bootstrap under a long TMPDIR")
