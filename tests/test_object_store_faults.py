"""The object store throttling and failing under a run (the embedded engine, the lake at ``s3://``
on S3Proxy behind tests/s3fault.py's proxy): requests answered ``503 SlowDown`` or ``500
InternalError`` as S3 answers under load.

A store that throttles some requests costs retries, not data: the run ends 0 and the lake equals
PostgreSQL. A store that keeps failing stops the run with 75 (retry later) and one line naming the
object store; the slot stays where it was, and the next run, the store back, lands everything.

Every CLI call of these tests runs in a child process (the ``proxy`` fixture), so the faults reach
every client of a run: in this test process the embedded engine (pysail) keeps the S3 client of
the first endpoint it used for a bucket for the life of the process, whatever the environment says
later, and a proxy thread of this process cannot answer a call of this process that holds the GIL
(delta-rs's ``alter.set_table_properties`` does: measured, it times out through such a proxy).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

import workload
from changelog_support import setup_source
from conftest import newest_server_only
from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.errors import EXIT_STATUS_LAKE_CHANGED
from s3fault import FaultProxy, Policy, passthrough
from s3server import S3Server
from test_object_store import _ok, assert_s3_lake_matches, write_config
from workload import TABLES, Workload, cli, confirmed_lsn, create_schema

pytestmark = [pytest.mark.e2e, pytest.mark.deploy]


# The User-Agent of the object_store crate's requests: the embedded engine's (pysail) and delta-rs's.
OBJECT_STORE = "object_store/"


@pytest.fixture
def proxy(s3_server: S3Server, s3_lake: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """The proxy in front of the test process's S3 server, its endpoint in AWS_ENDPOINT_URL, and
    every ``cli()`` of the test in a child process (see the module's docstring)."""
    p = FaultProxy(s3_server).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
    monkeypatch.setattr(workload, "_CLI_IN_PROCESS", False)
    try:
        yield p
    finally:
        p.stop()


def _table_file(path: str) -> bool:
    """Whether a request's path is a data file of a replicated table (not its log, not pg2delta's
    own tables or staging): in a run, only the engine writes those (delta-rs writes commits and
    compacts in ``maintain`` only; pyarrow writes staging files and pg2delta's own tables)."""
    name = path.split("?")[0]
    return name.endswith(".parquet") and "/_delta_log/" not in name and "/_pg2delta/" not in name


def test_a_throttling_store_costs_retries_not_rows(
    pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, proxy: FaultProxy, tmp_path: Any
) -> None:
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake)
    with Workload(pgdb, 83) as wl:
        wl.phase(40)
        _ok(cli("run", "--config", config), "first run, store healthy")
        wl.phase(40)
        # every sixth request refused, writes and reads alike, as a throttled prefix is
        proxy.policy = lambda method, path, n: 503 if n % 6 == 0 else None
        before = proxy.faults
        _ok(cli("run", "--config", config), "run against a throttling store")
        assert proxy.faults > before, "the store was never throttled: the test proved nothing"
    proxy.policy = lambda method, path, n: None
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "after a throttled run")


def test_a_failing_store_stops_the_run_with_75_and_loses_nothing(
    pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, proxy: FaultProxy, tmp_path: Any
) -> None:
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake)
    with Workload(pgdb, 84) as wl:
        wl.phase(40)
        _ok(cli("run", "--config", config), "first run, store healthy")
        wl.phase(40)
        before = confirmed_lsn(pgdb, slot)
        # First only the engine's writes of the tables' data files fail, then every write of every client.
        phases: list[tuple[str, str, Policy]] = [
            ("the engine's writes", OBJECT_STORE, lambda method, path, n: 500 if method in ("PUT", "POST") and _table_file(path) else None),
            ("every write", "", lambda method, path, n: 500 if method in ("PUT", "POST", "DELETE") else None),
        ]
        for what, agent, policy in phases:
            proxy.agent, proxy.policy = agent, policy
            started = time.monotonic()
            failed = cli("run", "--config", config)
            took = time.monotonic() - started
            refused = sum(1 for *_, status in proxy.seen if status is not None)
            proxy.reset()
            assert failed.returncode == 75, (what, failed.returncode, took, failed.stderr[-3000:])
            lines = [line for line in failed.stderr.splitlines() if line.startswith("pg2delta")]
            assert len(lines) == 1 and "object store" in lines[0], failed.stderr[-3000:]
            assert confirmed_lsn(pgdb, slot) == before, f"the slot moved past a window the store refused ({what})"
            assert refused, f"{what}: no request was refused: the test proved nothing"
            print(f"{what} refused: exit 75 after {took:.1f} s, {refused} requests refused")
        _ok(cli("run", "--config", config), "run with the store back")
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "after a failed run and its rerun")


@pytest.mark.skipif(TEST_ENGINE != "embedded", reason="delta-rs appends the applied log on the embedded engine")
def test_a_refused_checkpoint_of_the_applied_log_is_a_warning(
    pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, proxy: FaultProxy, tmp_path: Any
) -> None:
    """The applied log's append is committed before its every-tenth checkpoint is written: a store
    refusing the checkpoint (403) costs one warning line, not the run, and the lake stays equal."""
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake)
    with open(config) as f:
        text = f.read().replace("max_changes = 40", "max_changes = 1")  # a window a transaction
    with open(config, "w") as f:
        f.write(text)
    _ok(cli("run", "--config", config), "first run")
    log_dir = "/_pg2delta/applied_log/_delta_log/"
    proxy.policy = lambda method, path, n: 403 if method == "PUT" and log_dir in path and ".checkpoint." in path else None
    with psycopg.connect(pgdb, autocommit=True) as conn:
        for k in range(14):
            conn.execute("INSERT INTO acct (id, name, big) VALUES (%s, %s, %s)", (20_000 + k, f"c{k}", k))
    done = cli("run", "--config", config)
    _ok(done, "run whose applied-log checkpoint the store refuses")
    assert proxy.faults, "the store refused no checkpoint: the test proved nothing"
    warned = [line for line in done.stderr.splitlines() if "could not write the checkpoint of" in line]
    assert len(warned) == proxy.faults, done.stderr[-3000:]
    proxy.policy = passthrough
    applied = DeltaTable(f"{s3_lake}/_pg2delta/applied_log", storage_options=s3_server.storage_options)
    assert applied.version() >= 10 and not any(".checkpoint." in uri for uri in _listing(s3_server, s3_lake, log_dir))
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "after the refused checkpoints")


def _listing(server: S3Server, root: str, folder: str) -> list[str]:
    import pyarrow.fs as pafs

    from pg2delta.lake.lake_files import s3_filesystem

    fs = s3_filesystem(server.env)
    return [i.path for i in fs.get_file_info(pafs.FileSelector(f"{root.removeprefix('s3://')}{folder}"))]


def _twice(server: S3Server, uri: str, columns: list[str]) -> int:
    """Rows of the Delta table at ``uri`` whose ``columns`` another row holds too (0: none, or no table)."""
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(uri, storage_options=server.storage_options):
        return 0
    t = read_delta(uri, columns=columns, storage_options=server.storage_options)
    keys = list(zip(*(t.column(c).to_pylist() for c in columns), strict=True))
    return len(keys) - len(set(keys))


def test_an_answer_lost_after_the_commit_landed(
    pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, proxy: FaultProxy, tmp_path: Any
) -> None:
    """The store applies a Delta commit's PUT but the client gets ``500`` (a reply lost on the way).
    Its retry finds the version taken (412): the run goes on (the client took its own commit for
    done) or stops with 75, the slot where it was; one run each with the first commit of a
    changelog, of a history, of a table, of the applied log and of the changelog log answered so. The next run leaves every table equal to PostgreSQL (``events`` has no key: a window
    appended twice would be rows twice), and no change is twice in a changelog or a history."""
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake,
                          '[tables."public.acct"]\nhistory = "scd2"\n[tables."public.events"]\nhistory = "scd2"\n')
    with Workload(pgdb, 85) as wl:
        wl.phase(40)
        _ok(cli("run", "--config", config), "first run, store healthy")
        codes: list[int] = []
        for part in ("/_pg2delta/changelog/", "__history/_delta_log/", "/public/acct/_delta_log/", "/_pg2delta/applied_log/",
                     "/_pg2delta/changelog_log/"):
            wl.phase(30)
            before = confirmed_lsn(pgdb, slot)
            lost: list[str] = []

            def lost_answer(method: str, path: str, n: int, part: str = part, lost: list[str] = lost) -> int | None:
                if not lost and method == "PUT" and part in path and path.split("?")[0].endswith(".json"):
                    lost.append(path)
                    return -500
                return None

            proxy.policy = lost_answer
            failed = cli("run", "--config", config)
            for _ in range(2):  # a run that wrote no such commit (its window held none): more changes, once more
                if lost or failed.returncode not in (0, 75):
                    break
                wl.phase(30)
                failed = cli("run", "--config", config)
            proxy.policy = lambda method, path, n: None
            assert lost, (f"no commit of {part} in three runs: the test proved nothing (last exit {failed.returncode})\n"
                          f"{failed.stderr[-2000:]}")
            codes.append(failed.returncode)
            assert failed.returncode in (0, 75), (part, failed.returncode, failed.stderr[-3000:])
            if failed.returncode == 75:
                assert "lost its answer to a commit" in failed.stderr, failed.stderr[-2000:]
                assert confirmed_lsn(pgdb, slot) == before, f"the slot moved past a window whose {part} commit failed"
        _ok(cli("run", "--config", config), "run after the lost answers")
    print("exit codes of the runs with a lost answer:", codes)
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "after commits whose answers were lost")
    for spec in TABLES:
        log = f"{s3_lake}/_pg2delta/changelog/{spec.schema}/{spec.name}"
        assert _twice(s3_server, log, ["_pg2delta_lsn", "_pg2delta_pos"]) == 0, f"changelog of {spec.qualified}: a change twice"
    versions = ["_pg2delta_valid_from_lsn", "_pg2delta_valid_from_pos"]
    assert _twice(s3_server, f"{s3_lake}/public/acct__history", ["id", *versions]) == 0, "acct's history: a version twice"
    assert _twice(s3_server, f"{s3_lake}/public/events__history", versions) == 0, "events' history: a version twice"
    # (The changelog log may hold a window twice: a window replayed after its changelog commit is
    # logged again with 0 rows, which backfill's chunks, LSN ranges, take as nothing more.)
    logged = ["slot", "window_end", "relation_oid", "schema_name", "table_name", "kind"]
    assert _twice(s3_server, f"{s3_lake}/_pg2delta/applied_log", logged) == 0, "the applied log: a window twice"


def test_the_copies_commits_and_verify_over_other_writers_commits(
    pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, proxy: FaultProxy, tmp_path: Any
) -> None:
    """The copies' commits (bootstrap, resync) meet the store's faults and other writers' commits
    as a run's commits do (pg2delta.lake.conflicts.committing), on the embedded engine; each fault
    when the first commit of ``acct``'s Delta log goes through the proxy:

    1. the store applies the commit of ``acct``'s copy in the bootstrap and loses its answer: the
       bootstrap ends 0, or 75 with one line and the next bootstrap finishes it;
    2. another writer's ``DELETE`` (delta-rs, straight to the store) lands just before verify's run
       commits to ``acct``: the run remembers it and commits again over it (a run would stop with
       21), verify names it and exits 20, ``status`` flags it (13);
    3. a compaction lands just before the commit of ``acct``'s copy in a resync: the resync commits
       again over it, one line naming the engine's exception, and ends 0, the damage repaired.

    The lake equals PostgreSQL after a run on top."""
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(pgdb, pub)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake)
    acct = f"{s3_lake}/public/acct"
    log = f"/{acct.removeprefix('s3://')}/_delta_log/"  # the table's, not its changelog's

    def at_acct_commit(action: Callable[[], int | None]) -> list[str]:
        """``action()`` (the proxy's answer) at the next commit of acct's log; the commit's path, once done."""
        hit: list[str] = []

        def policy(method: str, path: str, n: int) -> int | None:
            if not hit and method == "PUT" and path.startswith(log) and path.split("?")[0].endswith(".json"):
                hit.append(path)
                return action()
            return None

        proxy.policy = policy
        return hit

    def other_writer(change: Callable[[DeltaTable], Any]) -> Callable[[], None]:
        def commit() -> None:  # then the proxy passes pg2delta's commit on: too late
            change(DeltaTable(acct, storage_options=s3_server.storage_options))

        return commit

    with Workload(pgdb, 86) as wl:
        wl.phase(40, truncate=False)
        lost = at_acct_commit(lambda: -500)
        boot = cli("bootstrap", "--config", config)
        proxy.policy = passthrough
        assert lost, f"no commit of acct's copy went through the proxy (exit {boot.returncode}): {boot.stderr[-2000:]}"
        print("exit code of the bootstrap whose commit lost its answer:", boot.returncode)
        assert boot.returncode in (0, 75), boot.stderr[-3000:]
        if boot.returncode == 75:
            lines = [line for line in boot.stderr.splitlines() if line.startswith("pg2delta")]
            assert len(lines) == 1 and "lost its answer to a commit" in lines[0], boot.stderr[-3000:]
            _ok(cli("bootstrap", "--config", config), "the bootstrap again, the store back")
        assert_s3_lake_matches(pgdb, s3_server, s3_lake, "a bootstrap whose copy's commit lost its answer")

        wl.phase(40)
        first = read_delta(acct, columns=["id"], storage_options=s3_server.storage_options)["id"][0]
        deleted = at_acct_commit(other_writer(lambda t: t.delete(f"id = {first.as_py()}")))
        verified = cli("verify", "--config", config, "--json")
        proxy.policy = passthrough
        assert deleted and verified.returncode == 20, (deleted, verified.returncode, verified.stderr[-3000:])
        foreign = json.loads(verified.stdout)["tables"]["public.acct"]["foreign_commits"]
        assert [c["operation"] for c in foreign] == ["DELETE"], foreign
        assert "another writer's commit that changes rows, remembered" in verified.stderr, verified.stderr[-3000:]
        assert cli("status", "--config", config).returncode == EXIT_STATUS_LAKE_CHANGED

        compacted = at_acct_commit(other_writer(lambda t: t.optimize.z_order(["id"])))
        resync = cli("resync", "--config", config, "--table", "public.acct")
        proxy.policy = passthrough
        assert resync.returncode == 0 and compacted, (resync.returncode, compacted, resync.stderr[-3000:])
        retried = [line for line in resync.stderr.splitlines() if "met a concurrent commit that changes no row" in line]
        assert len(retried) == 1 and "OPTIMIZE" in retried[0] and "the engine raised " in retried[0], resync.stderr[-3000:]
        print("the resync's retry:", retried[0])
        wl.phase(40)
        _ok(cli("run", "--config", config), "run after the resync")
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "after the copies' faults, verify and a run")
