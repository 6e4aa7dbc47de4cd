"""A primary failover (Operations > Faults: a primary failover).

A primary and a physical standby of PostgreSQL 18 (``pg_basebackup -R``; the standby with
``sync_replication_slots``, ``hot_standby_feedback`` and ``primary_slot_name``, the primary waiting
for it through ``synchronized_standby_slots``). One lake follows a failover slot, another a plain
one, through a workload and runs; the standby is promoted and the runs go on against it:

* from the failover slot's copy, which the standby stopped synchronizing before the last runs, so
  that it starts behind the lake: the run says so, reads those windows again, and the lake ends
  equal to PostgreSQL (the keyless table would show a change applied twice or lost);
* the plain slot has no copy there: its run stops with exit 78 and one line, with
  ``--create-slot`` too, and creates nothing.

A second pair: with the standby down, a run does not wait for it without end (75); the primary no
longer waiting for it, the lake takes changes the standby never receives, and after its promotion the
run finds the lake past the timeline's start and stops (78).

``status --standby-dsn`` says ready (0) once the copy is sync-ready, not ready (14) before it and
after the standby stopped synchronizing, and 14 against a promoted server. Embedded engine only: no
part of this depends on the engine (the run's reread of windows the lake holds is the path a
rerun after a crash takes, which the fault tests cover on Apache Spark).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pg2delta.errors import EXIT_NEEDS_HUMAN, EXIT_RETRYABLE, EXIT_STATUS_FAILOVER
from pg2delta.source.throwaway import ThrowawayPostgres, _free_port, find_bindir
from workload import TABLES, TableSpec, Workload, assert_lake_matches, cli, confirmed_lsn, create_schema

pytestmark = [pytest.mark.e2e, pytest.mark.failover, pytest.mark.deploy]


@dataclass
class Pair:
    """A primary and its physical standby (``standby`` shares the primary's OS user and binaries)."""

    primary: ThrowawayPostgres
    root: Path  # the standby's folder
    port: int

    @property
    def standby_dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def pg_ctl(self, *args: str) -> None:
        self.primary._run([str(self.primary.bindir / "pg_ctl"), "-D", str(self.root / "data"), *args])


@pytest.fixture
def pair() -> Iterator[Pair]:
    try:
        find_bindir(18)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    primary = ThrowawayPostgres.start(18, settings={"synchronized_standby_slots": "'standby1'"})
    root = primary.root / "standby"
    p = Pair(primary, root, _free_port())
    try:
        root.mkdir()
        if primary.user is not None:
            os.chown(root, primary.user.pw_uid, primary.user.pw_gid)
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_create_physical_replication_slot('standby1', true)")
        # -d with dbname: -R writes it into primary_conninfo, which slot synchronization needs.
        primary._run([
            str(primary.bindir / "pg_basebackup"), "-d", primary.dsn, "-D", str(root / "data"),
            "-R", "-X", "stream", "-S", "standby1", "-c", "fast", "--no-sync",
        ])
        with open(root / "data" / "postgresql.auto.conf", "a", encoding="utf-8") as conf:
            conf.write(
                f"port = {p.port}\nunix_socket_directories = '{root}'\nsync_replication_slots = on\n"
                "hot_standby_feedback = on\nsynchronized_standby_slots = ''\n"
            )
        p.pg_ctl("-l", str(root / "server.log"), "-w", "-t", "60", "start")
        yield p
    finally:
        if (root / "data" / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError):
                p.pg_ctl("-w", "-m", "immediate", "stop")
        primary.stop()  # removes the standby's folder too


def _sql(dsn: str, query: str, params: tuple[object, ...] = ()) -> tuple[object, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchone() if cur.description else None


def _copy(p: Pair, slot: str) -> tuple[object, ...] | None:
    """The standby's copy of ``slot``: (sync-ready, synced, confirmed_flush_lsn)."""
    return _sql(p.standby_dsn, "SELECT NOT temporary, synced, confirmed_flush_lsn::text FROM pg_replication_slots "
                "WHERE slot_name = %s", (slot,))


def _until(what: str, check: Callable[[], bool], nudge: Callable[[], None], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        nudge()
        time.sleep(0.1)


def _status(config: Path, *args: str) -> tuple[int, dict[str, object], str]:
    done = cli("status", "--config", str(config), "--json", *args)
    return done.returncode, json.loads(done.stdout), done.stderr


def _config(tmp_path: Path, name: str, dsn: str, slot: str, pub: str, *, failover: bool, standby: str) -> Path:
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[source]\ndsn = "{dsn}"\nslot = "{slot}"\npublication = "{pub}"\nfailover = {str(failover).lower()}\n'
        f'standby_dsn = "{standby}"\n[lake]\nroot = "{tmp_path / name}"\n'
    )
    return config


def test_promotion(pair: Pair, tmp_path: Path) -> None:
    p = pair
    tag = uuid.uuid4().hex[:8]
    dsn, pub = p.primary.dsn, f"pub_{tag}"
    slot, plain = f"fo_{tag}", f"plain_{tag}"
    config = _config(tmp_path, "lake", dsn, slot, pub, failover=True, standby=p.standby_dsn)
    plain_config = _config(tmp_path, "plain", dsn, plain, pub, failover=False, standby="")
    create_schema(dsn, pub)
    wl = Workload(dsn, 36)  # one workload across the promotion: its keys stay fresh
    with wl:
        wl.phase(15)
        for c in (config, plain_config):
            done = cli("bootstrap", "--config", str(c), "--parallel", "1")
            assert done.returncode == 0, done.stderr[-2000:]
        assert _sql(dsn, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == (True,)
        assert _sql(dsn, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (plain,)) == (False,)

        # Not ready at first: the standby's copy is temporary until the primary's slot has moved past
        # what the standby reserved.
        code, report, err = _status(config)
        assert code == EXIT_STATUS_FAILOVER, err
        assert report["slot"]["failover"] is True and report["standby"]["ready"] is False  # type: ignore[index]

        # Runs advance the slot past the standby's snapshots (pg_log_standby_snapshot); a reload
        # wakes the standby's slot sync worker at once (else it sleeps up to 30 s).
        def advance() -> None:
            _sql(dsn, "SELECT pg_log_standby_snapshot()")
            assert cli("run", "--config", str(config)).returncode == 0
            _sql(p.standby_dsn, "SELECT pg_reload_conf()")

        wl.phase(15)
        _until("the standby's copy to be sync-ready", lambda: bool((row := _copy(p, slot)) and row[0]), advance)
        code, report, err = _status(config)
        assert code == 0, err
        standby = report["standby"]
        assert standby["ready"] is True and standby["slot_synced"] is True, standby  # type: ignore[index]
        assert standby["primary_waits_for_it"] is True  # type: ignore[index]
        text = cli("status", "--config", str(config))  # the summary's lines
        assert "failover slot: yes" in text.stdout and "sync-ready" in text.stdout, text.stdout
        assert "; ready for a promotion" in text.stdout, text.stdout

        early = cli("run", "--config", str(config), "--dsn", p.standby_dsn)  # pointed at the standby too early
        assert early.returncode == EXIT_RETRYABLE and "standby in recovery" in early.stderr, early.stderr[-2000:]
        # The standby stops synchronizing: its copy stays behind what the next runs confirm.
        _sql(p.standby_dsn, "ALTER SYSTEM SET sync_replication_slots = off")
        _sql(p.standby_dsn, "SELECT pg_reload_conf()")
        time.sleep(0.5)  # the worker stops at the reload
        copied_at = _copy(p, slot)
        assert copied_at is not None
        code, report, err = _status(config)
        assert code == EXIT_STATUS_FAILOVER and "sync_replication_slots = off" in err, err
        wl.phase(20)
        for c in (config, plain_config):
            assert cli("run", "--config", str(c)).returncode == 0
        assert confirmed_lsn(dsn, slot) != copied_at[2]
        wl.phase(15)  # never applied before the promotion
    flushed = _sql(dsn, "SELECT pg_current_wal_flush_lsn()::text")
    assert flushed is not None
    _until("the standby's replay", lambda: bool(_sql(p.standby_dsn, "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                                                     (flushed[0],)) == (True,)), lambda: None)
    p.pg_ctl("-w", "-t", "60", "promote")
    # The former primary is gone (stopped; its folder, which holds the standby's, stays until the end).
    p.primary._run([str(p.primary.bindir / "pg_ctl"), "-D", str(p.primary.datadir), "-w", "-m", "immediate", "stop"])
    new = p.standby_dsn
    assert _copy(p, slot) == copied_at  # the copy as synchronized: behind the lake

    again = cli("run", "--config", str(config), "--dsn", new)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "behind the lake" in again.stderr, again.stderr[-3000:]
    assert_lake_matches(new, tmp_path / "lake", TABLES, context="after the promotion, from a copy behind the lake")
    wl.dsn = new
    with wl:
        wl.phase(20)
    assert cli("run", "--config", str(config), "--dsn", new).returncode == 0
    assert_lake_matches(new, tmp_path / "lake", TABLES, context="a run after the promotion")
    code, report, err = _status(config, "--dsn", new, "--standby-dsn", new)
    assert code == EXIT_STATUS_FAILOVER and "not in recovery" in err, err  # the promoted server is no standby
    assert report["slot"]["synced"] is True  # type: ignore[index]

    # The plain slot has no copy on the promoted server: one line, 78, nothing created; plan says so too.
    for extra in ((), ("--create-slot",), ("plan",)):
        command = ("plan",) if extra == ("plan",) else ("run", *extra)
        lost = cli(*command, "--config", str(plain_config), "--dsn", new)
        assert lost.returncode == EXIT_NEEDS_HUMAN, lost.stderr[-2000:]
        lines = [line for line in lost.stderr.splitlines() if line.startswith("pg2delta: ")]
        assert len(lines) == 1 and "does not exist on this server, but the lake" in lines[0], lost.stderr[-2000:]
    assert _sql(new, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (plain,)) == (0,)


def test_promotion_of_a_standby_the_primary_did_not_wait_for(pair: Pair, tmp_path: Path) -> None:
    """With its standby down, a primary that waits for it would hold a run's read for good: the run
    stops at once (75). Without ``synchronized_standby_slots`` the lake can take changes the standby
    never received: after its promotion, the run finds the lake past the promotion's switch point and
    stops (78)."""
    p = pair
    tag = uuid.uuid4().hex[:8]
    dsn, slot, pub = p.primary.dsn, f"fo_{tag}", f"pub_{tag}"
    config = _config(tmp_path, "lake", dsn, slot, pub, failover=True, standby=p.standby_dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE t")
        conn.execute("INSERT INTO t SELECT g, 'a' FROM generate_series(1, 20) g")
    assert cli("bootstrap", "--config", str(config), "--parallel", "1").returncode == 0

    def advance() -> None:
        _sql(dsn, "INSERT INTO t VALUES ((SELECT max(id) + 1 FROM t), 'b')")
        _sql(dsn, "SELECT pg_log_standby_snapshot()")
        assert cli("run", "--config", str(config)).returncode == 0
        _sql(p.standby_dsn, "SELECT pg_reload_conf()")

    def waits_for(names: str) -> None:
        _sql(dsn, f"ALTER SYSTEM SET synchronized_standby_slots = '{names}'")
        _sql(dsn, "SELECT pg_reload_conf()")

    _until("the standby's copy to be sync-ready", lambda: bool((row := _copy(p, slot)) and row[0]), advance)
    waits_for("")
    code, _, err = _status(config)
    assert code == EXIT_STATUS_FAILOVER and "synchronized_standby_slots does not name" in err, err
    waits_for("standby1")
    p.pg_ctl("-w", "-m", "fast", "stop")  # the standby is down
    _sql(dsn, "UPDATE t SET v = 'c' WHERE id <= 5")
    t0 = time.monotonic()
    held = cli("run", "--config", str(config))
    assert held.returncode == EXIT_RETRYABLE and "would wait for standby1 (inactive" in held.stderr, held.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    planned = cli("plan", "--config", str(config))  # the plan's read too
    assert planned.returncode == EXIT_RETRYABLE and "would wait for standby1" in planned.stderr, planned.stderr[-2000:]
    waits_for("")  # the lake takes what the standby never receives
    assert cli("run", "--config", str(config)).returncode == 0
    p.primary._run([str(p.primary.bindir / "pg_ctl"), "-D", str(p.primary.datadir), "-w", "-m", "immediate", "stop"])
    p.pg_ctl("-l", str(p.root / "server.log"), "-w", "-t", "60", "start")
    p.pg_ctl("-w", "-t", "60", "promote")
    done = cli("run", "--config", str(config), "--dsn", p.standby_dsn)
    assert done.returncode == EXIT_NEEDS_HUMAN, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("pg2delta: ")]
    assert len(lines) == 1 and "where this server's timeline begins" in lines[0], done.stderr[-2000:]


def test_failover_refused_before_17(pg_server: ThrowawayPostgres, pgdb: str, tmp_path: Path) -> None:
    if pg_server.version >= 17:
        pytest.skip("a server older than 17 refuses failover slots")
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"s_{tag}", f"p_{tag}"
    config = _config(tmp_path, "lake", pgdb, slot, pub, failover=True, standby="")
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE t")
    for args in (("bootstrap",), ("run", "--create-slot")):
        done = cli(*args, "--config", str(config))
        assert done.returncode == EXIT_NEEDS_HUMAN, done.stderr[-2000:]
        lines = [line for line in done.stderr.splitlines() if line.startswith("pg2delta: ")]
        assert len(lines) == 1 and "needs PostgreSQL 17" in lines[0], done.stderr
    assert _sql(pgdb, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == (0,)


def test_run_makes_the_slot_a_failover_slot(pg_server: ThrowawayPostgres, pgdb: str, tmp_path: Path) -> None:
    if pg_server.version < 17:
        pytest.skip("failover slots: PostgreSQL 17 and later")
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"s_{tag}", f"p_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE t")
        conn.execute("INSERT INTO t SELECT g, 'a' FROM generate_series(1, 10) g")
    plain = _config(tmp_path, "lake", pgdb, slot, pub, failover=False, standby="")
    assert cli("bootstrap", "--config", str(plain), "--parallel", "1").returncode == 0
    config = _config(tmp_path, "lake", pgdb, slot, pub, failover=True, standby="")
    code, report, err = _status(config)  # the config asks for a failover slot, the slot is none
    assert code == EXIT_STATUS_FAILOVER and "not a failover slot yet" in err, err
    assert report["slot"]["failover"] is False and report["standby"] is None  # type: ignore[index]
    _sql(pgdb, "UPDATE t SET v = 'b' WHERE id <= 3")
    done = cli("run", "--config", str(config))
    assert done.returncode == 0 and "is a failover slot now" in done.stderr, done.stderr[-2000:]
    assert _sql(pgdb, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == (True,)
    assert _status(config)[0] == 0
    assert_lake_matches(pgdb, tmp_path / "lake", [TableSpec("public", "t", ("id",))])
