"""Bad input and bad state: one line on stderr, the right exit code, and the slot unmoved.

Every case runs the real CLI in a child process against a real server with changes
waiting in the slot, so a run that wrongly did something would move the slot.
"""

from __future__ import annotations

import socket
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pg2delta.errors import SlotBusy
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import cli, confirmed_lsn, create_schema

EXIT_BUSY, EXIT_RETRYABLE, EXIT_NEEDS_HUMAN = 73, 75, 78


@dataclass
class Source:
    dsn: str
    slot: str
    publication: str
    lake: Path

    def args(self, **override: str) -> list[str]:
        values = {"dsn": self.dsn, "slot": self.slot, "publication": self.publication, "lake": str(self.lake)}
        values.update(override)
        out = ["run"]
        for k, v in values.items():
            out += [f"--{k}", v]
        return out


@pytest.fixture
def source(pgdb: str, tmp_path: Path) -> Source:
    """A pgoutput slot with committed changes waiting in it."""
    tag = uuid.uuid4().hex[:8]
    src = Source(pgdb, f"slot_{tag}", f"pub_{tag}", tmp_path / "lake")
    create_schema(pgdb, src.publication)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (src.slot,))
        conn.execute("INSERT INTO acct (id, name) SELECT g, 'n' || g FROM generate_series(1, 50) g")
        conn.execute("INSERT INTO events (kind) VALUES ('a'), ('b')")
    return src


def assert_one_line_error(proc: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}; stderr:\n{proc.stderr[-3000:]}"
    assert len(lines) == 1, f"wanted exactly one line on stderr, got {len(lines)}:\n{proc.stderr[-3000:]}"
    assert lines[0].startswith("pg2delta:"), lines[0]
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, lines[0])
    assert proc.stdout == "", proc.stdout
    return lines[0]


def test_missing_slot(source: Source) -> None:
    proc = cli(*source.args(slot="no_such_slot"))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "no_such_slot", "does not exist")
    assert confirmed_lsn(source.dsn, "no_such_slot") is None, "the run created the slot without --create-slot"
    assert confirmed_lsn(source.dsn, source.slot) is not None


def test_missing_publication(source: Source) -> None:
    before = confirmed_lsn(source.dsn, source.slot)
    proc = cli(*source.args(publication="no_such_pub"))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "no_such_pub")
    assert confirmed_lsn(source.dsn, source.slot) == before
    assert not source.lake.exists()


def test_slot_of_another_plugin(source: Source) -> None:
    other = f"td_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(source.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (other,))
        conn.execute("INSERT INTO acct (id) VALUES (1000)")
    before = confirmed_lsn(source.dsn, other)
    proc = cli(*source.args(slot=other))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, other, "test_decoding")
    assert confirmed_lsn(source.dsn, other) == before


def test_two_phase_slot(source: Source) -> None:
    other = f"tp_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(source.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true)", (other,))
        conn.execute("INSERT INTO acct (id) VALUES (1000)")
    before = confirmed_lsn(source.dsn, other)
    proc = cli(*source.args(slot=other))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, other, "two-phase")
    assert confirmed_lsn(source.dsn, other) == before


def test_unreachable_server(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=3"
    proc = cli("run", "--dsn", dsn, "--slot", "s", "--publication", "p", "--lake", str(tmp_path / "lake"))
    assert_one_line_error(proc, EXIT_RETRYABLE, "connect")


@pytest.fixture
def password_role(pg_server: ThrowawayPostgres, pgdb: str) -> Iterator[str]:
    """A role with a password that the server checks (scram), for this role only."""
    role = f"pw_{uuid.uuid4().hex[:8]}"
    hba = pg_server.datadir / "pg_hba.conf"
    original = hba.read_text()
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'right-password'")
        hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n" + original)
        conn.execute("SELECT pg_reload_conf()")
    try:
        yield role
    finally:
        hba.write_text(original)
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
            conn.execute(f"DROP ROLE {role}")


def test_wrong_password_needs_a_human(source: Source, password_role: str) -> None:
    """A login the server refuses will fail the same way on every retry: 78, not 75."""
    before = confirmed_lsn(source.dsn, source.slot)
    dsn = f"{source.dsn} user={password_role} password=wrong-password"
    # the right password does get in, so it is the password that is wrong
    psycopg.connect(f"{source.dsn} user={password_role} password=right-password").close()
    proc = cli(*source.args(dsn=dsn))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "password authentication failed")
    assert confirmed_lsn(source.dsn, source.slot) == before


@pytest.mark.parametrize("what", ["database", "role"])
def test_login_to_missing_database_or_role(source: Source, what: str) -> None:
    dsn = f"{source.dsn} dbname=no_such_db" if what == "database" else f"{source.dsn} user=no_such_role"
    proc = cli(*source.args(dsn=dsn))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "does not exist")


def test_unwritable_lake(source: Source, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    before = confirmed_lsn(source.dsn, source.slot)
    proc = cli(*source.args(lake=str(blocker / "lake")))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "lake")
    assert confirmed_lsn(source.dsn, source.slot) == before


def test_broken_toml(source: Source, tmp_path: Path) -> None:
    conf = tmp_path / "broken.toml"
    conf.write_text('[source]\nslot = "unterminated\n')
    before = confirmed_lsn(source.dsn, source.slot)
    proc = cli(*source.args(), "--config", str(conf))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "toml")
    assert confirmed_lsn(source.dsn, source.slot) == before


def test_unknown_config_key(source: Source, tmp_path: Path) -> None:
    conf = tmp_path / "unknown.toml"
    conf.write_text('[source]\nslot_name = "x"\n')
    before = confirmed_lsn(source.dsn, source.slot)
    proc = cli(*source.args(), "--config", str(conf))
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "slot_name")
    assert confirmed_lsn(source.dsn, source.slot) == before


@pytest.mark.parametrize("garbage", ["garbage", "1/2/3", "-1/0", "123456789/0", "", "0/1 2"])
def test_until_lsn_garbage(source: Source, garbage: str) -> None:
    before = confirmed_lsn(source.dsn, source.slot)
    proc = cli(*source.args(), f"--until-lsn={garbage}")
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "lsn")
    assert confirmed_lsn(source.dsn, source.slot) == before
    assert not source.lake.exists()


def test_second_run_while_the_first_holds_the_lock(source: Source) -> None:
    before = confirmed_lsn(source.dsn, source.slot)
    with psycopg.connect(source.dsn, autocommit=True) as holder:
        (got,) = holder.execute(
            "SELECT pg_try_advisory_lock(hashtextextended('pg2delta slot ' || %s, 0))", (source.slot,)
        ).fetchone() or (False,)
        assert got
        proc = cli(*source.args())
        assert_one_line_error(proc, EXIT_BUSY, "another", source.slot)
        assert confirmed_lsn(source.dsn, source.slot) == before
    # the lock is gone with the holder's session: the next run does the work
    done = cli(*source.args())
    assert done.returncode == 0, done.stderr[-2000:]
    assert confirmed_lsn(source.dsn, source.slot) != before


def test_the_lock_is_free_as_soon_as_a_run_closes(source: Source) -> None:
    """A run right after another (a retry, a test, a backfill chain) finds the lock free: closing
    releases it in the session, not when the server gets round to ending the backend."""
    from pg2delta.source.slot import SlotSource

    first = SlotSource(source.dsn, source.slot, source.publication)
    try:
        first.lock()
        with SlotSource(source.dsn, source.slot, source.publication) as second, pytest.raises(SlotBusy):
            second.lock()
        first.unlock()  # what close() does first; the session is still open here
        with SlotSource(source.dsn, source.slot, source.publication) as third:
            third.lock()
    finally:
        first.close()


def test_full_identity_without_key_after_the_engine_started(source: Source) -> None:
    # The error comes after the engine has started (the applied log is read first): engine
    # warnings and logs must not join it on stderr.
    with psycopg.connect(source.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE nokey (a int, b text)")
        conn.execute("ALTER TABLE nokey REPLICA IDENTITY FULL")
        conn.execute(f"ALTER PUBLICATION {source.publication} ADD TABLE nokey")
        conn.execute("INSERT INTO nokey VALUES (1, 'x')")
        conn.execute("UPDATE nokey SET b = 'y'")
    before = confirmed_lsn(source.dsn, source.slot)
    proc = cli(*source.args())
    assert_one_line_error(proc, EXIT_NEEDS_HUMAN, "public.nokey", "key")
    assert confirmed_lsn(source.dsn, source.slot) == before
