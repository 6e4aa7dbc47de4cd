"""``pg2delta resync``: a table copied again at a new snapshot while the slot keeps its place.

Each test ends with the lake equal to PostgreSQL row for row (read with delta-rs), after changes
the slot alone cannot bring: a volatile default, a type change the lake refuses, a table out of the
publication for a while, rows deleted from the lake behind pg2delta's back (under concurrent
writes), and a resync killed with SIGKILL.
"""

from __future__ import annotations

import signal
import threading
import uuid
from pathlib import Path

import psycopg
import pytest
from deltalake import DeltaTable

from lake_read import data_commits, read_delta
from workload import TableSpec, assert_lake_matches, cli, confirmed_lsn

pytestmark = pytest.mark.e2e

DV = TableSpec("public", "dv", ("id",))
OTHER = TableSpec("public", "other", ("id",))


def _setup(dsn: str, lake: Path) -> tuple[str, str, list[str]]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE dv (id int PRIMARY KEY, a text, n int)")
        conn.execute("CREATE TABLE other (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE dv, other")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO dv SELECT g, 'row ' || g, g FROM generate_series(1, 100) g")
        conn.execute("INSERT INTO other SELECT g, 'v' || g FROM generate_series(1, 10) g")
    common = ["--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]
    first = cli("run", *common)
    assert first.returncode == 0, first.stderr[-2000:]
    return slot, pub, common


def _sql(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def _ok(*args: str) -> None:
    done = cli(*args)
    assert done.returncode == 0, (args[0], done.returncode, done.stderr[-2000:])


def _the_run_after(
    pgdb: str, lake: Path, config: str, specs: list[TableSpec], update: str, *, not_said: str = "copying"
) -> None:
    """After a run that copied a table again: one more change, which the next run applies by
    changes alone (it copies nothing), and the lake equals PostgreSQL."""
    _sql(pgdb, update)
    again = cli("run", "--config", config)
    assert again.returncode == 0 and not_said not in again.stderr, again.stderr[-2000:]
    assert_lake_matches(pgdb, lake, specs, context="the run after")


@pytest.mark.classic
def test_volatile_default_then_resync(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, _, common = _setup(pgdb, lake)
    _sql(
        pgdb,
        "ALTER TABLE dv ADD COLUMN u text DEFAULT gen_random_uuid()::text",
        "UPDATE dv SET n = -n WHERE id <= 10",
        "INSERT INTO other VALUES (11, 'new')",
    )
    before = confirmed_lsn(pgdb, slot)
    refused = cli("run", *common)
    assert refused.returncode == 78, refused.stderr[-2000:]
    assert "pg2delta resync --table public.dv" in refused.stderr
    assert confirmed_lsn(pgdb, slot) == before

    _ok("resync", *common, "--table", "public.dv")
    assert confirmed_lsn(pgdb, slot) == before, "resync moved the slot"
    _sql(pgdb, "UPDATE dv SET a = 'after' WHERE id BETWEEN 5 AND 15", "INSERT INTO dv (id, a, n) VALUES (101, 'x', 1)")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="volatile default, resync, run")


def test_type_change_the_lake_refuses_then_resync(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    _slot, _, common = _setup(pgdb, lake)
    _sql(pgdb, "UPDATE dv SET n = n + 1 WHERE id <= 3", "ALTER TABLE dv ALTER COLUMN n TYPE text", "UPDATE dv SET n = 'x' || n WHERE id <= 5")
    refused = cli("run", *common)
    assert refused.returncode == 78, refused.stderr[-2000:]
    _ok("resync", *common, "--table", "public.dv")
    _sql(pgdb, "UPDATE dv SET n = 'y' WHERE id = 50")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="int -> text, resync, run")
    n_type = read_delta(str(lake / "public" / "dv")).schema.field("n").type
    assert str(n_type) in ("string", "large_string", "string_view"), n_type


def test_table_out_of_the_publication_for_a_while(pgdb: str, tmp_path: Path) -> None:
    """A table removed from the publication, changed, added back: the run notices (the catalog rows
    that put it in the publication are new) and stops naming resync; after the resync the lake
    equals PostgreSQL. With ``on_unfollowable = "resync"`` the run copies it again by itself."""
    lake = tmp_path / "lake"
    slot, pub, common = _setup(pgdb, lake)
    _sql(pgdb, "UPDATE other SET v = 'logged with its membership' WHERE id = 1", "UPDATE dv SET n = 1 WHERE id = 1")
    _ok("run", *common)
    _sql(pgdb, f"ALTER PUBLICATION {pub} DROP TABLE dv", "DELETE FROM dv WHERE id <= 20", "UPDATE dv SET a = 'unseen'")
    _ok("run", *common)  # out of the publication: nothing of it to apply
    _sql(pgdb, f"ALTER PUBLICATION {pub} ADD TABLE dv", "UPDATE dv SET n = 0 WHERE id = 99",
         "INSERT INTO other VALUES (12, 'other table')")
    before = confirmed_lsn(pgdb, slot)
    planned = cli("plan", *common, "--json")  # plan sees the refusal the run would hit
    assert planned.returncode == 78 and "public.dv left publication" in planned.stdout, planned.stderr[-2000:]
    stopped = cli("run", *common)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.dv left publication" in stopped.stderr and "pg2delta resync --table public.dv" in stopped.stderr
    assert confirmed_lsn(pgdb, slot) == before
    _ok("resync", *common, "--table", "public.dv")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="table dropped from the publication and added back, resync")

    # Explicitly listed and then also covered by its schema: it never left, nothing to do.
    _sql(pgdb, f"ALTER PUBLICATION {pub} ADD TABLES IN SCHEMA public", "UPDATE dv SET n = 2 WHERE id = 50")
    _ok("run", *common)
    _sql(pgdb, f"ALTER PUBLICATION {pub} DROP TABLE dv", "UPDATE dv SET n = 3 WHERE id = 51")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="covered by its schema all along")

    # Allowed to resync by itself: out of the publication (schema and all) and back, copied again.
    _sql(pgdb, f"ALTER PUBLICATION {pub} DROP TABLES IN SCHEMA public", "UPDATE dv SET a = 'unseen again'",
         f"ALTER PUBLICATION {pub} ADD TABLE dv", "DELETE FROM dv WHERE id = 77")
    config = _config(tmp_path, common, "public.dv")
    done = cli("run", "--config", config)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "came back since its last window" in done.stderr and "copying it again" in done.stderr
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="added back, resynced by the run")
    _the_run_after(pgdb, lake, config, [DV, OTHER], "UPDATE dv SET a = 'after' WHERE id BETWEEN 30 AND 40",
                   not_said="copying it again")


def test_damaged_lake_table_resynced_under_concurrent_writes(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    _slot, _, common = _setup(pgdb, lake)
    DeltaTable(str(lake / "public" / "dv")).delete("id <= 30")  # behind pg2delta's back
    history = len(DeltaTable(str(lake / "public" / "dv")).history())
    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        with psycopg.connect(pgdb, autocommit=True) as conn:
            i = 1000
            while not stop.is_set() and i < 1400:
                conn.execute("INSERT INTO dv VALUES (%s, 'during', %s)", (i, i))
                conn.execute("UPDATE dv SET n = n + 1 WHERE id = %s", ((i % 100) + 1,))
                conn.execute("UPDATE other SET v = v || '.' WHERE id = %s", ((i % 10) + 1,))
                written.append(i)
                i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        _ok("resync", *common, "--table", "public.dv")
    finally:
        stop.set()
        thread.join()
    assert written, "no concurrent write happened"
    version_before = history - 1
    old = read_delta(str(lake / "public" / "dv"), version=version_before)
    assert old.num_rows == 70, "time travel to before the resync reads the damaged table as it was"
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="damaged table resynced under concurrent writes")


@pytest.mark.parametrize("point", ["copy_after_replace", "bootstrap_after_table"])
def test_resync_killed_then_run_again(pgdb: str, tmp_path: Path, point: str) -> None:
    lake = tmp_path / "lake"
    slot, _, common = _setup(pgdb, lake)
    DeltaTable(str(lake / "public" / "dv")).delete("id > 90")
    _sql(pgdb, "UPDATE dv SET a = 'changed' WHERE id <= 10")
    before = confirmed_lsn(pgdb, slot)
    killed = cli("resync", *common, "--table", "public.dv", env={"PG2DELTA_CRASH_AT": point})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before
    assert read_delta(str(lake / "public" / "dv")).num_rows in (90, 100), "the table stays readable"
    _ok("resync", *common, "--table", "public.dv")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context=f"resync killed at {point}, run again")


def test_resync_of_a_table_not_published(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    _, _, common = _setup(pgdb, lake)
    done = cli("resync", *common, "--table", "public.nope")
    assert done.returncode == 78
    lines = [line for line in done.stderr.splitlines() if "public.nope" in line]
    assert lines and "not in publication" in lines[0]


def _config(tmp_path: Path, common: list[str], table: str, settings: str = 'on_unfollowable = "resync"') -> str:
    """A config file with ``settings`` (default ``on_unfollowable = "resync"``) for ``table`` (the
    rest from ``common``'s flags)."""
    flags = dict(zip(common[::2], common[1::2], strict=True))
    path = tmp_path / f"pg2delta_{uuid.uuid4().hex[:6]}.toml"
    path.write_text(
        f'[source]\ndsn = "{flags["--dsn"]}"\nslot = "{flags["--slot"]}"\npublication = "{flags["--publication"]}"\n'
        f'[lake]\nroot = "{flags["--lake"]}"\n[tables."{table}"]\n{settings}\n'
    )
    return str(path)


@pytest.mark.parametrize(
    "ddl",
    [
        "ALTER TABLE dv ALTER COLUMN n TYPE text",
        "ALTER TABLE dv ADD COLUMN t text DEFAULT clock_timestamp()::text",
    ],
    ids=["int-to-text", "volatile-default"],
)
def test_the_run_resyncs_by_itself_when_allowed(pgdb: str, tmp_path: Path, ddl: str) -> None:
    lake = tmp_path / "lake"
    _slot, _, common = _setup(pgdb, lake)
    _sql(pgdb, "UPDATE dv SET n = n + 1 WHERE id <= 3", ddl, "UPDATE dv SET a = 'later' WHERE id <= 5",
         "INSERT INTO other VALUES (11, 'other table, same window')")
    stopped = cli("run", *common)  # the default: stop, naming the way out
    assert stopped.returncode == 78 and "pg2delta resync --table public.dv" in stopped.stderr, stopped.stderr[-2000:]
    config = _config(tmp_path, common, "public.dv")
    done = cli("run", "--config", config, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "copying it again" in done.stderr
    assert_lake_matches(pgdb, lake, [DV, OTHER], context=f"{ddl}, resynced by the run")
    _sql(pgdb, "UPDATE dv SET a = 'after the resync' WHERE id BETWEEN 50 AND 60", "DELETE FROM dv WHERE id = 99")
    again = cli("run", "--config", config)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "copying it again" not in again.stderr
    assert_lake_matches(pgdb, lake, [DV, OTHER], context=f"{ddl}, the run after")


M = TableSpec("public", "m", ("id", "k"))


def _partitioned(dsn: str, lake: Path, *, via_root: bool) -> tuple[str, list[str]]:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    _sql(
        dsn,
        "CREATE TABLE m (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY LIST (k)",
        "CREATE TABLE m1 PARTITION OF m FOR VALUES IN (1)",
        f"CREATE PUBLICATION {pub} FOR TABLE m WITH (publish_via_partition_root = {'true' if via_root else 'false'})",
        f"SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')",
        "INSERT INTO m SELECT g, 1, 'one ' || g FROM generate_series(1, 30) g",
    )
    return slot, ["--dsn", dsn, "--slot", slot, "--publication", pub, "--lake", str(lake)]


def _attach_with_rows(dsn: str, name: str, k: int) -> None:
    _sql(
        dsn,
        f"CREATE TABLE {name} (id int, k int, v text, PRIMARY KEY (id, k))",
        f"INSERT INTO {name} SELECT g, {k}, 'before the attach ' || g FROM generate_series(1, 20) g",
        f"ALTER TABLE m ATTACH PARTITION {name} FOR VALUES IN ({k})",
        f"INSERT INTO m VALUES (100, {k}, 'after the attach')",
    )


def test_partition_attached_with_rows_to_a_root_published_via_itself(pgdb: str, tmp_path: Path) -> None:
    """Rows a partition had when it was attached are never sent: the run notices them (stop, naming
    resync; or resync by itself), and a partition created empty and filled later is not a case."""
    lake = tmp_path / "lake"
    slot, common = _partitioned(pgdb, lake, via_root=True)
    _ok("run", *common)
    _sql(pgdb, "CREATE TABLE m3 PARTITION OF m FOR VALUES IN (3)",
         "INSERT INTO m SELECT g, 3, 'three' FROM generate_series(1, 10) g", "UPDATE m SET v = 'x' WHERE id = 1")
    _ok("run", *common)  # a new, empty partition, filled after: its rows are sent
    assert_lake_matches(pgdb, lake, [M], context="partition created empty")

    _attach_with_rows(pgdb, "m2", 2)
    before = confirmed_lsn(pgdb, slot)
    planned = cli("plan", *common, "--json")
    assert planned.returncode == 78 and "public.m2 was attached to public.m" in planned.stdout, planned.stderr[-2000:]
    stopped = cli("run", *common)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m2 was attached to public.m with rows" in stopped.stderr
    assert "pg2delta resync --table public.m" in stopped.stderr
    assert confirmed_lsn(pgdb, slot) == before
    _ok("resync", *common, "--table", "public.m")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [M], context="attached with rows, resync")

    _attach_with_rows(pgdb, "m4", 4)
    config = _config(tmp_path, common, "public.m")
    done = cli("run", "--config", config)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "public.m4 was attached to public.m with rows in it" in done.stderr and "copying public.m again" in done.stderr
    assert_lake_matches(pgdb, lake, [M], context="attached with rows, resynced by the run")
    _the_run_after(pgdb, lake, config, [M], "UPDATE m SET v = 'later' WHERE id <= 5")


def test_partition_attached_with_rows_to_a_root_written_as_one_table(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"`` (leaves published): the run stops naming resync of the root, which
    copies every leaf into the root's Delta table; rows rewritten after an attach are sent."""
    lake = tmp_path / "lake"
    _slot, common = _partitioned(pgdb, lake, via_root=False)
    flags = dict(zip(common[::2], common[1::2], strict=True))
    config = tmp_path / "root.toml"
    config.write_text(
        f'[source]\ndsn = "{flags["--dsn"]}"\nslot = "{flags["--slot"]}"\npublication = "{flags["--publication"]}"\n'
        f'[lake]\nroot = "{flags["--lake"]}"\n[tables."public.m"]\npartitions = "root"\n'
    )
    _ok("run", "--config", str(config))
    _attach_with_rows(pgdb, "m2", 2)
    stopped = cli("run", "--config", str(config))
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m2 was attached to public.m with rows" in stopped.stderr
    assert "pg2delta resync --table public.m" in stopped.stderr
    _ok("resync", "--config", str(config), "--table", "public.m")
    _ok("run", "--config", str(config))
    assert_lake_matches(pgdb, lake, [M], context="partitions = root, attached with rows, resync")
    _attach_with_rows(pgdb, "m3", 3)
    _sql(pgdb, "UPDATE m3 SET v = v")
    _ok("run", "--config", str(config))
    assert_lake_matches(pgdb, lake, [M], context="partitions = root, rows rewritten after the attach")


def _lake_rows(lake: Path) -> set[tuple[int, int]]:
    rows = read_delta(str(lake / "public" / "m"), columns=["id", "k"]).to_pylist()
    return {(r["id"], r["k"]) for r in rows}


def _partition_with_rows(dsn: str, name: str, k: int) -> None:
    """A partition created empty and filled after: its rows are sent."""
    _sql(dsn, f"CREATE TABLE {name} PARTITION OF m FOR VALUES IN ({k})",
         f"INSERT INTO m SELECT g, {k}, 'part ' || g FROM generate_series(1, 15) g")


def test_partition_detached_or_dropped_from_a_root_published_via_itself(pgdb: str, tmp_path: Path) -> None:
    """PostgreSQL sends nothing for the rows of a partition that is detached or dropped: the run
    stops naming resync (or resyncs by itself), or keeps them when told to."""
    lake = tmp_path / "lake"
    slot, common = _partitioned(pgdb, lake, via_root=True)
    for name, k in (("m2", 2), ("m3", 3), ("m4", 4)):
        _partition_with_rows(pgdb, name, k)
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [M], context="partitions filled")

    _sql(pgdb, "ALTER TABLE m DETACH PARTITION m2", "UPDATE m SET v = 'after' WHERE id = 2")
    before = confirmed_lsn(pgdb, slot)
    planned = cli("plan", *common, "--json")
    assert planned.returncode == 78 and "public.m2 left public.m" in planned.stdout, planned.stderr[-2000:]
    stopped = cli("run", *common)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m2 left public.m (DETACH PARTITION or DROP)" in stopped.stderr
    assert "pg2delta resync --table public.m" in stopped.stderr and "detached_partitions" in stopped.stderr
    assert confirmed_lsn(pgdb, slot) == before
    _ok("resync", *common, "--table", "public.m")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [M], context="detached, resync")
    assert not any(k == 2 for _, k in _lake_rows(lake))

    _sql(pgdb, "DROP TABLE m3", "INSERT INTO m VALUES (200, 1, 'new')")
    config = _config(tmp_path, common, "public.m")
    done = cli("run", "--config", config)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a dropped partition (OID" in done.stderr and "copying public.m again" in done.stderr
    assert_lake_matches(pgdb, lake, [M], context="dropped, resynced by the run")

    keep = _config(tmp_path, common, "public.m", 'detached_partitions = "keep"')
    _sql(pgdb, "ALTER TABLE m DETACH PARTITION m4", "UPDATE m SET v = 'kept' WHERE k = 1")
    done = cli("run", "--config", keep)
    assert done.returncode == 0, done.stderr[-2000:]
    with psycopg.connect(pgdb) as conn:
        in_pg = {(int(i), int(k)) for i, k in conn.execute("SELECT id, k FROM m UNION ALL SELECT id, k FROM m4")}
    assert _lake_rows(lake) == in_pg  # the root's rows, and m4's kept
    _sql(pgdb, "INSERT INTO m VALUES (201, 1, 'later')")
    again = cli("run", *common)  # the window above logged m's partitions of now: nothing to refuse
    assert again.returncode == 0, again.stderr[-2000:]
    assert (201, 1) in _lake_rows(lake)


def test_partition_detached_from_a_root_written_as_one_table(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``: the run stops naming the ways out, or keeps the rows when told to."""
    lake = tmp_path / "lake"
    _slot, common = _partitioned(pgdb, lake, via_root=False)
    _partition_with_rows(pgdb, "m2", 2)
    root = _config(tmp_path, common, "public.m", 'partitions = "root"')
    _ok("run", "--config", root)
    assert_lake_matches(pgdb, lake, [M], context="partitions = root")
    _sql(pgdb, "ALTER TABLE m DETACH PARTITION m2")
    stopped = cli("run", "--config", root)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m2 left public.m" in stopped.stderr and "pg2delta resync --table public.m" in stopped.stderr
    keep = _config(tmp_path, common, "public.m", 'partitions = "root"\ndetached_partitions = "keep"')
    _ok("run", "--config", keep)
    assert (2, 2) in _lake_rows(lake)


def test_changes_of_a_partition_detached_before_the_run_go_to_the_root(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``, ``detached_partitions = "keep"``: changes a partition made while it
    was attached, still in the slot when it is detached, go to the root's Delta table (the leaves
    as the lake last logged them), not to a table named after the partition."""
    lake = tmp_path / "lake"
    common = _rooted(pgdb, lake)
    config = _config(tmp_path, common, "public.m", 'partitions = "root"\ndetached_partitions = "keep"')
    _ok("bootstrap", "--config", config)
    _sql(pgdb, "UPDATE m SET v = 'x' WHERE id <= 2")
    _ok("run", "--config", config)  # the leaves are logged with the root's window
    _sql(
        pgdb,
        "INSERT INTO m VALUES (500, 2, 'in m2 before its detach')",
        "UPDATE m SET v = 'updated in m2 before its detach' WHERE k = 2 AND id <= 5",
        "DELETE FROM m WHERE k = 2 AND id BETWEEN 10 AND 12",
        "UPDATE m SET v = 'in m1' WHERE k = 1 AND id = 1",
        "ALTER TABLE m DETACH PARTITION m2",
    )
    done = cli("run", "--config", config)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (lake / "public" / "m2").exists(), "the partition's changes went to a table of their own"
    rows = {(r["id"], r["k"]): r["v"] for r in read_delta(str(lake / "public" / "m")).to_pylist()}
    with psycopg.connect(pgdb) as conn:
        m2 = {(int(i), int(k)): str(v) for i, k, v in conn.execute("SELECT id, k, v FROM m2").fetchall()}
    assert {key: v for key, v in rows.items() if key[1] == 2} == m2  # kept, with its last changes
    assert rows[(500, 2)] == "in m2 before its detach" and (10, 2) not in rows and rows[(1, 1)] == "in m1"
    # The detached table's own changes from now on are not the root's.
    _sql(pgdb, "INSERT INTO m VALUES (501, 1, 'after')", "UPDATE m2 SET v = 'not the root''s' WHERE id = 1")
    _ok("run", "--config", config)
    after = {(r["id"], r["k"]): r["v"] for r in read_delta(str(lake / "public" / "m")).to_pylist()}
    assert after[(501, 1)] == "after" and after[(1, 2)] == m2[(1, 2)]


M2 = TableSpec("public", "m2", ("id", "k"))


def test_changes_of_a_detached_partition_published_on_its_own_split_at_its_detach(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``, ``detached_partitions = "keep"``, and the detached partition still
    published on its own: its changes in the slot are the root's up to its DETACH and its own
    after it. The root's Delta table keeps its rows as they were at the DETACH, its own table
    equals it in PostgreSQL; a run that ends before the DETACH leaves the partition the root's.
    The DETACH is CONCURRENTLY (two transactions: the second is the one found); pg_walinspect
    tells it from a later ALTER TABLE."""
    lake = tmp_path / "lake"
    common = _rooted(pgdb, lake)
    pub = common[common.index("--publication") + 1]
    _sql(pgdb, f"ALTER PUBLICATION {pub} ADD TABLE m2, m3", "CREATE EXTENSION pg_walinspect")
    config = _config(tmp_path, common, "public.m", 'partitions = "root"\ndetached_partitions = "keep"')
    _ok("bootstrap", "--config", config)
    _sql(pgdb, "UPDATE m SET v = 'x' WHERE id <= 2")
    _ok("run", "--config", config)  # the leaves are logged with the root's window
    _sql(pgdb, "UPDATE m SET v = 'in m2, run 1' WHERE k = 2 AND id <= 3", "UPDATE m SET v = 'in m1' WHERE k = 1 AND id = 1")
    with psycopg.connect(pgdb) as conn:
        until = str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
    _sql(
        pgdb,
        "INSERT INTO m VALUES (500, 2, 'in m2 before its detach')",
        "UPDATE m SET v = 'in m2, run 2' WHERE k = 2 AND id BETWEEN 3 AND 5",
        "DELETE FROM m WHERE k = 2 AND id BETWEEN 10 AND 12",
    )
    with psycopg.connect(pgdb) as conn:
        at_detach = {(int(i), int(k)): str(v) for i, k, v in conn.execute("SELECT id, k, v FROM m2").fetchall()}
    _sql(
        pgdb,
        "ALTER TABLE m DETACH PARTITION m2 CONCURRENTLY",
        "UPDATE m2 SET v = 'after the detach' WHERE id <= 6",
        "INSERT INTO m2 VALUES (600, 2, 'after the detach')",
        "DELETE FROM m2 WHERE id IN (13, 500)",
        "UPDATE m SET v = 'in m3' WHERE k = 3 AND id = 1",
    )
    _ok("run", "--config", config, "--until-lsn", until)  # ends before the DETACH
    done = cli("run", "--config", config, "-v")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "for the DETACH of 1 table(s)" in done.stderr, done.stderr[-2000:]

    def lake_m() -> dict[tuple[int, int], str]:
        return {(r["id"], r["k"]): r["v"] for r in read_delta(str(lake / "public" / "m")).to_pylist()}

    with psycopg.connect(pgdb) as conn:
        in_m = {(int(i), int(k)): str(v) for i, k, v in conn.execute("SELECT id, k, v FROM m").fetchall()}
    assert lake_m() == {**in_m, **at_detach}  # the root's rows, and m2's as they were at its DETACH
    assert_lake_matches(pgdb, lake, [M2], context="the detached partition's own table")
    _sql(pgdb, "UPDATE m2 SET v = 'later' WHERE id = 1", "INSERT INTO m VALUES (700, 1, 'later')")
    done = cli("run", "--config", config, "-v")
    assert done.returncode == 0 and "for the DETACH" not in done.stderr, done.stderr[-2000:]  # logged: not decoded again
    assert_lake_matches(pgdb, lake, [M2], context="the detached partition's own table, later")
    assert lake_m()[(1, 2)] == at_detach[(1, 2)] and lake_m()[(700, 1)] == "later"

    # Its first column's type changed after the DETACH: the ALTER wrote the rows the DETACH did
    # (the table's, that column's), so the DETACH is not found (placed there, the changes between
    # would go to the root). The run stops before reading (the slot where it was) naming resync.
    slot = common[common.index("--slot") + 1]
    _sql(pgdb, "ALTER TABLE m DETACH PARTITION m3", "UPDATE m3 SET v = 'after its detach' WHERE id = 2",
         "ALTER TABLE m3 ALTER COLUMN id TYPE bigint")
    before = confirmed_lsn(pgdb, slot)
    planned = cli("plan", "--config", config, "--json")
    assert planned.returncode == 78 and "public.m3 left public.m (DETACH PARTITION)" in planned.stdout, planned.stderr[-2000:]
    stopped = cli("run", "--config", config)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m3 left public.m (DETACH PARTITION) and is published on its own" in stopped.stderr
    assert "written again since the DETACH" in stopped.stderr
    assert "pg2delta resync --table public.m --table public.m3" in stopped.stderr and confirmed_lsn(pgdb, slot) == before
    _ok("resync", "--config", config, "--table", "public.m", "--table", "public.m3")
    _ok("run", "--config", config)
    assert_lake_matches(pgdb, lake, [M, M2, TableSpec("public", "m3", ("id", "k"))], context="detached, altered, resync")


def test_partition_truncated_alone_under_a_root_published_via_itself(pgdb: str, tmp_path: Path) -> None:
    """pgoutput sends no TRUNCATE of one partition when the root is published via itself: its
    changed relfilenode makes the run decode the backlog, which tells a VACUUM FULL (go on) from a
    TRUNCATE (stop naming resync, or resync by itself)."""
    lake = tmp_path / "lake"
    slot, common = _partitioned(pgdb, lake, via_root=True)
    _partition_with_rows(pgdb, "m2", 2)
    _ok("run", *common)
    _sql(pgdb, "VACUUM FULL m2", "CLUSTER m1 USING m1_pkey", "UPDATE m SET v = 'after the vacuum' WHERE id <= 3",
         "TRUNCATE m")  # the root's TRUNCATE is sent: it empties the Delta table
    _partition_with_rows(pgdb, "m3", 3)
    _sql(pgdb, "INSERT INTO m SELECT g, k, 'again' FROM generate_series(1, 20) g, (VALUES (1), (2)) AS ks(k)")
    done = cli("run", *common, "-v")
    assert done.returncode == 0 and "TRUNCATEs of 3 partition(s): 0 found" in done.stderr, done.stderr[-2000:]
    assert_lake_matches(pgdb, lake, [M], context="VACUUM FULL, CLUSTER, TRUNCATE of the root, a new partition")

    _sql(pgdb, "TRUNCATE m2", "INSERT INTO m VALUES (300, 2, 'after the truncate')", "UPDATE m SET v = 'x' WHERE k = 1")
    before, kept = confirmed_lsn(pgdb, slot), _lake_rows(lake)
    planned = cli("plan", *common, "--json")
    assert planned.returncode == 78 and "public.m2 was truncated alone" in planned.stdout, planned.stderr[-2000:]
    stopped = cli("run", *common)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m2 was truncated alone" in stopped.stderr and "pg2delta resync --table public.m" in stopped.stderr
    assert confirmed_lsn(pgdb, slot) == before and _lake_rows(lake) == kept
    _ok("resync", *common, "--table", "public.m")
    _sql(pgdb, "VACUUM FULL m3")  # the backlog's TRUNCATE of m2 is older than the copy: not counted again
    done = cli("run", *common, "-v")
    assert done.returncode == 0 and "TRUNCATEs of 1 partition(s): 0 found" in done.stderr, done.stderr[-2000:]
    assert_lake_matches(pgdb, lake, [M], context="truncated alone, resync")

    _sql(pgdb, "TRUNCATE m1, m3", "INSERT INTO m VALUES (301, 1, 'after')")
    done = cli("run", "--config", _config(tmp_path, common, "public.m"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "public.m1, public.m3 were truncated alone" in done.stderr and "copying public.m again" in done.stderr
    assert_lake_matches(pgdb, lake, [M], context="truncated alone, resynced by the run")

    # A rewrite of a partition of a root that the next windows do not change: the window that
    # looked logs the root's new relfilenodes anyway, so the run after decodes nothing again.
    flags = dict(zip(common[::2], common[1::2], strict=True))
    _sql(pgdb, "CREATE TABLE q (id int PRIMARY KEY)", f"ALTER PUBLICATION {flags['--publication']} ADD TABLE q",
         "VACUUM FULL m1", "INSERT INTO q VALUES (1)")
    done = cli("run", *common, "-v")
    assert done.returncode == 0 and "TRUNCATEs of 1 partition(s): 0 found" in done.stderr, done.stderr[-2000:]
    _sql(pgdb, "INSERT INTO q VALUES (2)")
    done = cli("run", *common, "-v")
    assert done.returncode == 0 and "TRUNCATEs of" not in done.stderr, done.stderr[-2000:]
    assert_lake_matches(pgdb, lake, [M, TableSpec("public", "q", ("id",))], context="a quiet root's partition rewritten")

    # A partition created, filled and truncated in one transaction: PostgreSQL empties it in
    # place (its relfilenode stays) after its rows were sent through the root. A new partition
    # makes the run look at the backlog too.
    with psycopg.connect(pgdb) as conn:
        conn.execute("CREATE TABLE m4 PARTITION OF m FOR VALUES IN (4)")
        conn.execute("INSERT INTO m SELECT g, 4, 'gone' FROM generate_series(1, 5) g")
        conn.execute("TRUNCATE m4")
        conn.execute("INSERT INTO m VALUES (400, 4, 'kept')")
    before, kept = confirmed_lsn(pgdb, slot), _lake_rows(lake)
    stopped = cli("run", *common)
    assert stopped.returncode == 78 and "public.m4 was truncated alone" in stopped.stderr, stopped.stderr[-2000:]
    assert confirmed_lsn(pgdb, slot) == before and _lake_rows(lake) == kept
    done = cli("run", "--config", _config(tmp_path, common, "public.m"))
    assert done.returncode == 0 and "copying public.m again" in done.stderr, done.stderr[-2000:]
    assert_lake_matches(pgdb, lake, [M, TableSpec("public", "q", ("id",))], context="created, filled and truncated at once")


def test_new_partition_when_the_backlog_cannot_be_decoded(pgdb: str, tmp_path: Path) -> None:
    """A partition created, filled and truncated in one transaction under a root published via
    itself: its rows are sent through the root, its TRUNCATE is not. Where the backlog cannot be
    decoded (here every replication slot is in use, so test_decoding's copy of the slot cannot
    be made), a new partition stops the run (exit 78, the slot where it was) naming resync."""
    lake = tmp_path / "lake"
    slot, common = _partitioned(pgdb, lake, via_root=True)
    _ok("run", *common)
    with psycopg.connect(pgdb) as conn:
        conn.execute("CREATE TABLE m4 PARTITION OF m FOR VALUES IN (4)")
        conn.execute("INSERT INTO m SELECT g, 4, 'gone' FROM generate_series(1, 5) g")
        conn.execute("TRUNCATE m4")
        conn.execute("INSERT INTO m VALUES (400, 4, 'kept'), (1, 1, 'updated')  ON CONFLICT (id, k) DO UPDATE SET v = excluded.v")
    fillers = f"fill_{uuid.uuid4().hex[:8]}_"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        free = int(conn.execute(
            "SELECT current_setting('max_replication_slots')::int - count(*) FROM pg_replication_slots").fetchone()[0])
        for i in range(free):
            conn.execute("SELECT pg_create_physical_replication_slot(%s)", (f"{fillers}{i}",))
        try:
            before, kept = confirmed_lsn(pgdb, slot), _lake_rows(lake)
            stopped = cli("run", *common)
            assert stopped.returncode == 78, stopped.stderr[-2000:]
            assert "public.m4 became a partition of public.m since the lake's last window of it" in stopped.stderr
            assert "test_decoding" in stopped.stderr and "pg2delta resync --table public.m" in stopped.stderr
            assert confirmed_lsn(pgdb, slot) == before and _lake_rows(lake) == kept
        finally:
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE %s",
                         (fillers + "%",))
    _ok("resync", *common, "--table", "public.m")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [M], context="new partition truncated in its creating transaction, resync")
    assert (1, 4) not in _lake_rows(lake) and (400, 4) in _lake_rows(lake)


EV = TableSpec("public", "ev", ())  # no key: insert-only, a change applied twice would be a second row


def _rooted(dsn: str, lake: Path) -> list[str]:
    """``m`` (keyed) in three list partitions and ``ev`` (no key) in two, with rows, published per
    leaf (not via the root); no slot yet: the bootstrap creates it."""
    tag = uuid.uuid4().hex[:8]
    pub = f"pub_{tag}"
    _sql(
        dsn,
        "CREATE TABLE m (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY LIST (k)",
        "CREATE TABLE ev (id int, k int, note text) PARTITION BY LIST (k)",
        *(f"CREATE TABLE m{k} PARTITION OF m FOR VALUES IN ({k})" for k in (1, 2, 3)),
        *(f"CREATE TABLE ev{k} PARTITION OF ev FOR VALUES IN ({k})" for k in (1, 2)),
        "INSERT INTO m SELECT g, k, 'p' || k || ' ' || g FROM generate_series(1, 40) g, generate_series(1, 3) k",
        "INSERT INTO ev SELECT g, 1 + g % 2, 'ev ' || g FROM generate_series(1, 50) g",
        f"CREATE PUBLICATION {pub} FOR TABLE m, ev",
    )
    return ["--dsn", dsn, "--slot", f"slot_{tag}", "--publication", pub, "--lake", str(lake)]


def test_partitions_written_as_one_table_bootstrapped_then_run(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``: the bootstrap copies every leaf into the root's one Delta table; the
    run then merges the leaves' changes (a row moved between partitions too) on top, and a resync
    of a keyless root while changes of its leaves wait in the slot applies none of them twice."""
    lake = tmp_path / "lake"
    common = _rooted(pgdb, lake)
    config = _config(tmp_path, common, "public.m", 'partitions = "root"\n[tables."public.ev"]\npartitions = "root"')
    _ok("bootstrap", "--config", config)
    assert sorted(p.name for p in (lake / "public").iterdir()) == ["ev", "m"]
    assert data_commits(lake / "public" / "m") == 1  # the three leaves in one commit
    assert_lake_matches(pgdb, lake, [M, EV], context="bootstrapped")
    assert len(_lake_rows(lake)) == 120

    _sql(
        pgdb,
        "INSERT INTO m VALUES (100, 1, 'new in m1'), (100, 3, 'new in m3')",
        "UPDATE m SET v = 'updated in m2' WHERE k = 2 AND id <= 10",
        "DELETE FROM m WHERE k = 3 AND id BETWEEN 20 AND 25",
        "DELETE FROM m WHERE k = 2 AND id BETWEEN 30 AND 32",
        "UPDATE m SET k = 2, v = 'moved from m1' WHERE k = 1 AND id BETWEEN 30 AND 32",  # m1 -> m2
        "INSERT INTO ev SELECT g, 1 + g % 2, 'after the bootstrap' FROM generate_series(51, 60) g",
    )
    _ok("run", "--config", config)
    assert_lake_matches(pgdb, lake, [M, EV], context="leaves' changes merged into the root's table")
    assert {(i, 2) for i in (30, 31, 32)} <= _lake_rows(lake) and not {(i, 1) for i in (30, 31, 32)} & _lake_rows(lake)

    _sql(pgdb, "INSERT INTO ev SELECT g, 1 + g % 2, 'before the resync' FROM generate_series(61, 70) g",
         "UPDATE m SET v = 'before the resync' WHERE id = 1")
    _ok("resync", "--config", config, "--table", "public.ev")
    _sql(pgdb, "INSERT INTO ev SELECT g, 1 + g % 2, 'after the resync' FROM generate_series(71, 75) g")
    _ok("run", "--config", config)
    assert_lake_matches(pgdb, lake, [M, EV], context="keyless root resynced with its leaves' changes pending")
    assert read_delta(str(lake / "public" / "ev")).num_rows == 75


def test_partition_truncated_or_detached_under_partitions_root_then_resync(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"``: a TRUNCATE of one partition, a DETACH and a DROP stop the run naming
    ``pg2delta resync --table`` of the root (nothing applied, the slot where it was); the resync
    copies the root's leaves again and the run goes on. ``on_unfollowable = "resync"`` does it by itself."""
    lake = tmp_path / "lake"
    common = _rooted(pgdb, lake)
    slot = common[common.index("--slot") + 1]
    config = _config(tmp_path, common, "public.m", 'partitions = "root"')
    _ok("bootstrap", "--config", config)
    _sql(pgdb, "UPDATE m SET v = 'x' WHERE id <= 5")
    _ok("run", "--config", config)

    _sql(pgdb, "TRUNCATE m2", "INSERT INTO m VALUES (200, 1, 'after the truncate')", "UPDATE m SET v = 'y' WHERE k = 3")
    before, kept = confirmed_lsn(pgdb, slot), _lake_rows(lake)
    stopped = cli("run", "--config", config)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "TRUNCATE of partition(s) public.m2" in stopped.stderr
    assert "pg2delta resync --table public.m" in stopped.stderr
    assert confirmed_lsn(pgdb, slot) == before and _lake_rows(lake) == kept
    _ok("resync", "--config", config, "--table", "public.m")
    _sql(pgdb, "INSERT INTO m VALUES (201, 2, 'after the resync')")
    _ok("run", "--config", config)
    assert_lake_matches(pgdb, lake, [M], context="truncated alone, resync")
    assert {i for i, k in _lake_rows(lake) if k == 2} == {201}

    _sql(pgdb, "ALTER TABLE m DETACH PARTITION m3", "UPDATE m SET v = 'after the detach' WHERE k = 1 AND id <= 3")
    before, kept = confirmed_lsn(pgdb, slot), _lake_rows(lake)
    stopped = cli("run", "--config", config)
    assert stopped.returncode == 78, stopped.stderr[-2000:]
    assert "public.m3 left public.m (DETACH PARTITION or DROP)" in stopped.stderr
    assert "pg2delta resync --table public.m" in stopped.stderr and "publish_via_partition_root" not in stopped.stderr
    assert confirmed_lsn(pgdb, slot) == before and _lake_rows(lake) == kept
    _ok("resync", "--config", config, "--table", "public.m")
    _ok("run", "--config", config)
    assert_lake_matches(pgdb, lake, [M], context="detached, resync")
    assert not any(k == 3 for _, k in _lake_rows(lake))

    resyncing = _config(tmp_path, common, "public.m", 'partitions = "root"\non_unfollowable = "resync"')
    _sql(pgdb, "TRUNCATE m1", "INSERT INTO m VALUES (300, 1, 'after the truncate'), (300, 2, 'in m2')")
    done = cli("run", "--config", resyncing)
    assert done.returncode == 0 and "copying it again" in done.stderr, done.stderr[-2000:]
    assert_lake_matches(pgdb, lake, [M], context="truncated alone, resynced by the run")
    assert {i for i, k in _lake_rows(lake) if k == 1} == {300}

    _sql(pgdb, "DROP TABLE m2", "CREATE TABLE m4 PARTITION OF m FOR VALUES IN (4)", "INSERT INTO m VALUES (400, 4, 'm4')")
    done = cli("run", "--config", resyncing)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a dropped partition (OID" in done.stderr and "copying public.m again" in done.stderr
    assert_lake_matches(pgdb, lake, [M], context="dropped, resynced by the run")
    _the_run_after(pgdb, lake, resyncing, [M], "UPDATE m SET v = 'later' WHERE k = 4")


def test_leaves_publishing_different_columns_stop_only_their_root(pgdb: str, tmp_path: Path) -> None:
    """``partitions = "root"`` whose leaves publish different column lists cannot be one Delta
    table: a resync or a verify of that root stops (exit 78) naming both lists, and nothing is
    copied; a resync or a verify of another table of the publication is not stopped by it."""
    lake = tmp_path / "lake"
    _slot, common = _partitioned(pgdb, lake, via_root=False)
    pub = common[common.index("--publication") + 1]
    _sql(
        pgdb,
        "CREATE TABLE m2 PARTITION OF m FOR VALUES IN (2)",
        "CREATE TABLE other (id int PRIMARY KEY, v text)",
        f"ALTER PUBLICATION {pub} ADD TABLE other",
        "INSERT INTO m SELECT g, 2, 'two ' || g FROM generate_series(1, 10) g",
        "INSERT INTO other SELECT g, 'o' || g FROM generate_series(1, 10) g",
    )
    config = _config(tmp_path, common, "public.m", 'partitions = "root"')
    _ok("run", "--config", config)
    assert_lake_matches(pgdb, lake, [M, OTHER], context="before the column lists")
    _sql(pgdb, f"ALTER PUBLICATION {pub} SET TABLE m1 (id, k, v), m2 (id, k), other")
    version = DeltaTable(str(lake / "public" / "m")).version()
    for command in ("verify", "resync"):
        stopped = cli(command, "--config", config, "--table", "public.m")
        assert stopped.returncode == 78, (command, stopped.returncode, stopped.stderr[-2000:])
        assert "publish different columns (public.m1: id, k, v; public.m2: id, k)" in stopped.stderr, stopped.stderr[-2000:]
        _ok(command, "--config", config, "--table", "public.other")
    assert DeltaTable(str(lake / "public" / "m")).version() == version  # the root: nothing copied
    assert_lake_matches(pgdb, lake, [OTHER], context="other resynced")


def test_a_column_renamed_after_the_copy_snapshot_is_retried(pgdb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy's COPY is parsed against the catalog as it is, not as of the copy's snapshot: a column
    renamed between the two (an ALTER TABLE while a resync runs; found by make soak, where the run
    resyncs by itself) fails it. That is exit 75 (run again), not 78; the next resync copies the new shape."""
    from pg2delta.copy import staging

    lake = tmp_path / "lake"
    _, _, common = _setup(pgdb, lake)
    real = staging.copy_blocks
    renamed: list[bool] = []

    def renaming(conn: psycopg.Connection[bytes], statement: object) -> object:
        if not renamed:
            with psycopg.connect(pgdb, autocommit=True) as other:
                other.execute("SET lock_timeout = '5s'")
                other.execute("ALTER TABLE dv RENAME COLUMN a TO b")
            renamed.append(True)
        return real(conn, statement)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "copy_blocks", renaming)
    done = cli("resync", *common, "--table", "public.dv")
    monkeypatch.undo()
    assert renamed, "the copy never started: the test proved nothing"
    assert done.returncode == 75 and "shape changed after the copy's snapshot" in done.stderr, done.stderr[-2000:]
    _ok("resync", *common, "--table", "public.dv")
    _ok("run", *common)
    assert_lake_matches(pgdb, lake, [DV, OTHER], context="resync again after a rename under the first")
