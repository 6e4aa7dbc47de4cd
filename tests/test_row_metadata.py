"""Row metadata (``metadata = true``): every row holds the commit LSN, commit time and kind of its
last change, exactly as PostgreSQL says them.

PostgreSQL's own word is read from a second logical slot of the test's, peeked as pgoutput bytes:
each transaction's Begin message holds its commit LSN, commit time and xid (parsed here with
``struct``, not by pg2delta), and each row's ``xmin`` names the transaction of its last change. The
lake is read back with delta-rs and compared with PostgreSQL's rows and those values.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import signal
import struct
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta import config as config_module
from pg2delta.apply.rowmeta import row_columns
from pg2delta.errors import ConfigError
from workload import cli, confirmed_lsn

PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
META = ("_pg2delta_lsn", "_pg2delta_commit_ts", "_pg2delta_op")


def test_metadata_and_deletes_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[source]\ndsn = "host=x"\n[lake]\nroot = "{tmp_path}"\nmetadata = true\n'
                    '[tables."s.a"]\nmetadata = false\n[tables."s.b"]\ndeletes = "soft"\n')
    cfg = config_module.load(path, env={})
    assert row_columns(cfg, "s", "other") == META and row_columns(cfg, "s", "a") == ()
    assert row_columns(cfg, "s", "b") == (*META, "_pg2delta_deleted")
    path.write_text(f'[source]\ndsn = "host=x"\n[lake]\nroot = "{tmp_path}"\n[tables."s.a"]\ndeletes = "gone"\n')
    with pytest.raises(ConfigError, match="deletes \"hard\" or \"soft\", not None, 'gone'"):
        config_module.load(path, env={})


def _truth(dsn: str, slot: str, pub: str) -> dict[int, tuple[int, dt.datetime]]:
    """xid -> (commit LSN, commit time) of every transaction the test's own slot has seen, from
    the Begin messages PostgreSQL sent it (``B``, final LSN, commit time in microseconds since
    2000, xid)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s)", (slot, pub),
        ).fetchall()
    out = {}
    for (data,) in rows:
        if bytes(data[:1]) == b"B":
            lsn, micros, xid = struct.unpack(">QqI", bytes(data[1:21]))
            out[xid] = (lsn, PG_EPOCH + dt.timedelta(microseconds=micros))
    return out


def _rows(dsn: str, table: str) -> dict[int, dict[str, Any]]:
    """PostgreSQL's rows of ``table``: v, big, the xid of their last change and email (None if no such column)."""
    with psycopg.connect(dsn) as conn:
        cur = conn.execute(f"SELECT id, v, big, xmin::text::bigint AS xid, to_jsonb(t)->>'email' FROM {table} AS t")
        return {r[0]: {"v": r[1], "big": r[2], "xid": r[3], "email": r[4]} for r in cur.fetchall()}


HASH_KEY = "row-metadata-test-key"


def _hashed(value: str | None) -> str | None:
    """What ``hash = [...]`` lands for ``value``: HMAC-SHA-256 under the test's key, in hex."""
    return None if value is None else hmac.new(HASH_KEY.encode(), value.encode(), hashlib.sha256).hexdigest()


def _lake(path: Path) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in read_delta(path).to_pylist()}


def _check(dsn: str, lake: Path, table: str, truth: dict[int, tuple[int, dt.datetime]], ops: dict[int, str],
           copied: tuple[int, str]) -> None:
    """The Delta table of ``table`` holds PostgreSQL's rows, each with its last change's commit LSN and
    time (a row copied at the bootstrap: the snapshot's LSN, op S) and op (``ops``; default: copied)."""
    want, got = _rows(dsn, table), _lake(lake / table.replace(".", "/"))
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        lrow = got[key]
        assert (lrow["v"], lrow["big"]) == (row["v"], row["big"]), key
        if row["xid"] in truth:
            lsn, ts = truth[row["xid"]]
            assert (lrow["_pg2delta_lsn"], lrow["_pg2delta_commit_ts"], lrow["_pg2delta_op"]) == (lsn, ts, ops[key]), key
        else:  # copied at the bootstrap
            assert (lrow["_pg2delta_lsn"], lrow["_pg2delta_op"]) == (copied[0], "S"), key
            assert lrow["_pg2delta_commit_ts"].isoformat() == copied[1], key


def _soft_first_window(dsn: str, tmp_path: Path, tag: str) -> None:
    """A soft-delete table the run's first window creates (no bootstrap: the window's rows are
    appended, marked as a MERGE would mark them): a row updated then deleted keeps the update's
    values and the delete's LSN, a row deleted before a truncate its own delete, the rows the
    truncate found live are marked ``T`` with the truncate's LSN (one updated first keeps that
    update's values), a key inserted again after it is live."""
    slot, pub, truth_slot, lake = f"fw_{tag}", f"fw_{tag}", f"fw_truth_{tag}", tmp_path / "fresh"
    xids: dict[str, int] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE rm.fresh (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE rm.fresh")
        for s in (slot, truth_slot):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (s,))
        for step, sql in (("insert", "INSERT INTO rm.fresh SELECT g, 'v' || g FROM generate_series(1, 5) g"),
                          ("update", "UPDATE rm.fresh SET v = 'u' || id WHERE id IN (2, 4)"),
                          ("delete2", "DELETE FROM rm.fresh WHERE id = 2"), ("delete3", "DELETE FROM rm.fresh WHERE id = 3"),
                          ("truncate", "TRUNCATE rm.fresh"), ("again", "INSERT INTO rm.fresh VALUES (1, 'again'), (6, 'six')")):
            with conn.transaction():
                xids[step] = int(conn.execute("SELECT txid_current() % 4294967296").fetchone()[0])  # type: ignore[index]
                conn.execute(sql)
    path = tmp_path / "fresh.toml"
    path.write_text("\n".join(["[source]", f"dsn = {json.dumps(dsn)}", f'slot = "{slot}"', f'publication = "{pub}"',
                               "[lake]", f'root = "{lake}"', '[tables."rm.fresh"]', 'deletes = "soft"']) + "\n")
    done = cli("run", "--config", str(path))
    assert done.returncode == 0 and "appended" in done.stderr, done.stderr[-3000:]
    truth = _truth(dsn, truth_slot, pub)
    lsn = {step: truth[xid][0] for step, xid in xids.items()}
    got = {k: (r["v"], r["_pg2delta_deleted"], r["_pg2delta_op"], r["_pg2delta_lsn"]) for k, r in _lake(lake / "rm" / "fresh").items()}
    assert got == {1: ("again", False, "I", lsn["again"]), 6: ("six", False, "I", lsn["again"]),
                   2: ("u2", True, "D", lsn["delete2"]), 3: ("v3", True, "D", lsn["delete3"]),
                   4: ("u4", True, "T", lsn["truncate"]), 5: ("v5", True, "T", lsn["truncate"])}
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert {k: r[0] for k, r in got.items() if not r[1]} == dict(conn.execute("SELECT id, v FROM rm.fresh").fetchall())
        conn.execute("SELECT pg_drop_replication_slot(%s)", (truth_slot,))


@pytest.mark.e2e
def test_row_metadata_through_changes_resync_and_backfill(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    tag = uuid.uuid4().hex[:8]
    slot, pub, truth_slot = f"rm_{tag}", f"rm_{tag}", f"rm_truth_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA rm")
        for t in ("items", "plain"):
            conn.execute(f"CREATE TABLE rm.{t} (id int PRIMARY KEY, v text, big text)")
            conn.execute(f"ALTER TABLE rm.{t} ALTER big SET STORAGE EXTERNAL")  # out of line: unchanged TOAST
            conn.execute(f"INSERT INTO rm.{t} SELECT g, 'v' || g, repeat(chr(96 + g), 3000) FROM generate_series(1, 10) g")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE rm.items, rm.plain")

    def config(plain: str, memory_budget: int | None = None) -> Path:
        """``plain``: "off" (metadata = false), "soft" (deletes = "soft"), "resync" (and on_unfollowable = "resync")."""
        path = tmp_path / "rm.toml"
        path.write_text("\n".join([
            "[source]", f"dsn = {json.dumps(pgdb)}", f'slot = "{slot}"', f'publication = "{pub}"',
            "[lake]", f'root = "{lake}"', "metadata = true", "changelog = true",
            *(["[window]", f"memory_budget = {memory_budget}"] if memory_budget else []),
            '[tables."rm.plain"]', "metadata = false" if plain == "off" else 'deletes = "soft"',
            *(['on_unfollowable = "resync"'] if plain == "resync" else []),
        ]) + "\n")
        return path

    before = dt.datetime.now(dt.UTC)
    done = cli("bootstrap", "--config", str(config("off")))
    assert done.returncode == 0, done.stderr[-3000:]
    boot = [r for r in read_delta(lake / "_pg2delta" / "applied_log").to_pylist() if r["kind"] == "bootstrap"]
    snapshot_lsn = boot[0]["window_end"]
    copied_ts = _lake(lake / "rm" / "items")[1]["_pg2delta_commit_ts"]
    assert before - dt.timedelta(seconds=5) < copied_ts < dt.datetime.now(dt.UTC)  # PostgreSQL's clock, in the snapshot
    copied = (snapshot_lsn, copied_ts.isoformat())
    assert not set(META) & set(read_delta(lake / "rm" / "plain").column_names)
    _check(pgdb, lake, "rm.items", {}, {}, copied)

    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (truth_slot,))
        conn.execute("UPDATE rm.items SET v = 'u' || id WHERE id IN (1, 2)")  # big: unchanged TOAST
        conn.execute("DELETE FROM rm.items WHERE id = 3")
        conn.execute("UPDATE rm.items SET id = 104 WHERE id = 4")  # a key change, big unchanged
        conn.execute("INSERT INTO rm.items VALUES (11, 'new', repeat('y', 3000))")
        with conn.transaction():  # inserted then updated in one transaction: its last change is the update
            conn.execute("INSERT INTO rm.items VALUES (12, 'twelve', NULL)")
            conn.execute("UPDATE rm.items SET v = 'twelve-u' WHERE id = 12")
        conn.execute("UPDATE rm.plain SET v = 'p' WHERE id = 1")
    ops = {1: "U", 2: "U", 104: "U", 11: "I", 12: "U"}
    done = cli("run", "--config", str(config("off")))
    assert done.returncode == 0, done.stderr[-3000:]
    truth = _truth(pgdb, truth_slot, pub)
    _check(pgdb, lake, "rm.items", truth, ops, copied)

    # Turning soft deletes (and so metadata) on for a table the lake holds without them: refused
    # until a resync rewrites it; with on_unfollowable = "resync" the run copies it again itself.
    old_plain = _rows(pgdb, "rm.plain")
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE rm.items SET v = 'u2-' || id WHERE id = 1")
        conn.execute("UPDATE rm.plain SET v = 'p2' WHERE id = 2")
        conn.execute("DELETE FROM rm.plain WHERE id = 10")  # before the copy: the copy lacks it, the lake had it
    ops[1] = "U"
    refused = cli("run", "--config", str(config("soft")))
    assert refused.returncode == 78, refused.stderr[-3000:]
    assert "metadata = true now, the table was landed with metadata = false" in refused.stderr
    assert 'deletes = "soft" now, the table was landed with deletes = "hard"' in refused.stderr
    assert "pg2delta resync --table rm.plain" in refused.stderr
    resynced = cli("run", "--config", str(config("resync")))
    assert resynced.returncode == 0 and 'on_unfollowable = "resync": copying it again' in resynced.stderr, resynced.stderr[-3000:]
    plain = _lake(lake / "rm" / "plain")
    live = {k: r for k, r in plain.items() if not r["_pg2delta_deleted"]}
    resync_lsn = {r["_pg2delta_lsn"] for r in live.values()}
    assert {r["_pg2delta_op"] for r in live.values()} == {"S"} and len(resync_lsn) == 1 and min(resync_lsn) > snapshot_lsn
    assert {k: r["v"] for k, r in live.items()} == {k: r["v"] for k, r in _rows(pgdb, "rm.plain").items()}
    # The row deleted before the copy: marked deleted at the copy's snapshot, with the values the lake held.
    gone = plain[10]
    assert (gone["_pg2delta_deleted"], gone["_pg2delta_op"], gone["_pg2delta_lsn"], gone["v"], gone["big"]) == (
        True, "D", min(resync_lsn), old_plain[10]["v"], old_plain[10]["big"])
    assert gone["_pg2delta_commit_ts"] == live[1]["_pg2delta_commit_ts"] and sorted(plain) == list(range(1, 11))
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE rm.plain SET v = 'p3' WHERE id = 3")
        conn.execute("UPDATE rm.items SET v = 'spilled' WHERE id IN (2, 5)")  # a spilled window: reduced by the engine
    ops[2] = ops[5] = "U"
    done = cli("run", "--config", str(config("resync", memory_budget=1)), "-v")
    assert done.returncode == 0 and "by the engine" in done.stderr, done.stderr[-3000:]
    truth = _truth(pgdb, truth_slot, pub)
    _check(pgdb, lake, "rm.items", truth, ops, copied)
    plain = _lake(lake / "rm" / "plain")
    lsn3, ts3 = truth[_rows(pgdb, "rm.plain")[3]["xid"]]
    assert (plain[3]["v"], plain[3]["_pg2delta_lsn"], plain[3]["_pg2delta_commit_ts"], plain[3]["_pg2delta_op"]) == (
        "p3", lsn3, ts3, "U")
    assert {plain[k]["_pg2delta_lsn"] for k in (1, 2)} == resync_lsn

    # verify compares the table's own columns; a backfill into a copy replays the same metadata.
    verified = cli("verify", "--config", str(config("resync")), "--json")
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = json.loads(verified.stdout)
    assert report["equal"] and not report["tables"]["rm.items"]["skipped"], report
    assert report["tables"]["rm.items"]["columns_not_compared"] == []
    logged = [r for r in read_delta(lake / "_pg2delta" / "applied_log").to_pylist() if r["table_name"] == "items"]
    copy = tmp_path / "copy"
    lsn = lambda v: f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"  # noqa: E731
    backfill = cli("backfill", "--config", str(config("resync")), "--table", "rm.items", "--from-lsn", lsn(snapshot_lsn),
                   "--to-lsn", lsn(max(r["window_end"] for r in logged)), "--into", str(copy))
    assert backfill.returncode == 0, backfill.stderr[-3000:]
    assert sorted(map(str, read_delta(copy / "rm" / "items").to_pylist())) == sorted(
        map(str, read_delta(lake / "rm" / "items").to_pylist()))
    _soft_first_window(pgdb, tmp_path, tag)


def _check_bare(dsn: str, lake: Path, truncated: list[str]) -> None:
    """The keyless soft-delete table rm.bare: its live rows are PostgreSQL's (as a multiset), each
    row truncated (``truncated``, as a multiset) is there once, marked ``T``, and no two rows share
    a key (a keyless row's commit position, ``_pg2delta_lsn`` and ``_pg2delta_pos``)."""
    rows = read_delta(lake / "rm" / "bare").to_pylist()
    with psycopg.connect(dsn) as conn:
        live = sorted(r[0] for r in conn.execute("SELECT v FROM rm.bare").fetchall())
    assert sorted(r["v"] for r in rows if not r["_pg2delta_deleted"]) == live
    assert sorted(r["v"] for r in rows if r["_pg2delta_deleted"]) == sorted(truncated)
    assert {r["_pg2delta_op"] for r in rows if r["_pg2delta_deleted"]} == {"T"}
    assert len({(r["_pg2delta_lsn"], r["_pg2delta_pos"]) for r in rows}) == len(rows)


@pytest.mark.e2e
@pytest.mark.classic  # the Apache Spark tier too: soft deletes' MERGE, UPDATE and truncates in Delta's own SQL
def test_soft_deletes_keep_deleted_rows_marked(pgdb: str, tmp_path: Path) -> None:
    """(The lake's side: the newest server only, conftest.LAKE_SIDE.) ``deletes = "soft"``: a deleted row stays with ``_pg2delta_deleted`` and its delete's commit
    LSN, time and op; a key change marks the old key; a key inserted again is live; a truncate marks
    every row; the history keeps its own columns; verify compares the live rows; a resync keeps the
    rows marked deleted. With column governance too (a hashed and an excluded column)."""
    lake, embedded = tmp_path / "lake", TEST_ENGINE == "embedded"
    tag = uuid.uuid4().hex[:8]
    slot, pub, truth_slot = f"sd_{tag}", f"sd_{tag}", f"sd_truth_{tag}"
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA rm")
        conn.execute("CREATE TABLE rm.soft (id int PRIMARY KEY, v text, big text, "
                     "email text DEFAULT 'someone@example.org', ssn text DEFAULT 'ssn-x')")  # hashed, excluded
        conn.execute("ALTER TABLE rm.soft ALTER big SET STORAGE EXTERNAL")
        conn.execute("INSERT INTO rm.soft SELECT g, 'v' || g, repeat(chr(96 + g), 3000), 'e' || g || '@example.org', "
                     "'ssn-' || g FROM generate_series(1, 10) g")
        conn.execute("CREATE TABLE rm.bare (v text)")  # no key: its rows go only by truncates
        conn.execute("INSERT INTO rm.bare VALUES ('b1'), ('b2')")
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE rm.soft, rm.bare")
    path, key_file = tmp_path / "sd.toml", tmp_path / "hash.key"
    key_file.write_text(HASH_KEY + "\n")
    path.write_text("\n".join([
        "[source]", f"dsn = {json.dumps(pgdb)}", f'slot = "{slot}"', f'publication = "{pub}"',
        "[lake]", f'root = "{lake}"', "changelog = true", f"hash_key_file = {json.dumps(str(key_file))}",
        '[tables."rm.soft"]', 'deletes = "soft"', 'hash = ["email"]', 'exclude = ["ssn"]',
        *(['history = "scd2"'] if embedded else []),  # the history's own MERGEs: on the embedded engine only (CI time)
        '[tables."rm.bare"]', 'deletes = "soft"',
    ]) + "\n")
    done = cli("bootstrap", "--config", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert {r["_pg2delta_deleted"] for r in _lake(lake / "rm" / "soft").values()} == {False}

    deleted: dict[int, tuple[int, str, dict[str, Any]]] = {}  # key -> (deleting xid, op, its last values)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (truth_slot,))
        conn.execute("UPDATE rm.soft SET v = 'u1' WHERE id = 1")  # big: unchanged TOAST
        old = _rows(pgdb, "rm.soft")
        with conn.transaction():
            xid = conn.execute("SELECT txid_current() % 4294967296").fetchone()[0]  # type: ignore[index]
            conn.execute("DELETE FROM rm.soft WHERE id IN (2, 3)")
        deleted |= {k: (xid, "D", old[k]) for k in (2, 3)}
        with conn.transaction():
            xid = conn.execute("SELECT txid_current() % 4294967296").fetchone()[0]  # type: ignore[index]
            conn.execute("UPDATE rm.soft SET id = 104 WHERE id = 4")  # the old key is gone: marked
        deleted[4] = (xid, "D", old[4])
        conn.execute("INSERT INTO rm.soft VALUES (2, 'back', 'b')")  # a deleted key comes back live
        conn.execute("INSERT INTO rm.bare VALUES ('b3')")  # inserted, then truncated in the window: kept, T
        conn.execute("TRUNCATE rm.bare")
        conn.execute("INSERT INTO rm.bare VALUES ('b4')")
        del deleted[2]
        with conn.transaction():  # a key change, then the new key deleted, in one window: both keys kept
            xid = conn.execute("SELECT txid_current() % 4294967296").fetchone()[0]  # type: ignore[index]
            conn.execute("UPDATE rm.soft SET id = 108 WHERE id = 8")  # big: unchanged TOAST, the lake's row 8's
        deleted[8] = (xid, "D", old[8])
        with conn.transaction():
            xid = conn.execute("SELECT txid_current() % 4294967296").fetchone()[0]  # type: ignore[index]
            conn.execute("DELETE FROM rm.soft WHERE id = 108")
        deleted[108] = (xid, "D", old[8])
    done = cli("run", "--config", str(path))
    assert done.returncode == 0, done.stderr[-3000:]

    def check(ops: dict[int, str], copied_lsn: int) -> None:
        truth = _truth(pgdb, truth_slot, pub)
        live, got = _rows(pgdb, "rm.soft"), _lake(lake / "rm" / "soft")
        assert sorted(got) == sorted({*live, *deleted})
        assert "ssn" not in read_delta(lake / "rm" / "soft").column_names
        for key, row in live.items():
            lrow = got[key]
            assert (lrow["v"], lrow["big"], lrow["_pg2delta_deleted"]) == (row["v"], row["big"], False), key
            assert lrow["email"] == _hashed(row["email"]), key
            if row["xid"] in truth:
                assert (lrow["_pg2delta_lsn"], lrow["_pg2delta_commit_ts"], lrow["_pg2delta_op"]) == (
                    *truth[row["xid"]], ops[key]), key
            else:
                assert (lrow["_pg2delta_lsn"], lrow["_pg2delta_op"]) == (copied_lsn, "S"), key
        for key, (xid, op, values) in deleted.items():
            lrow = got[key]
            assert (lrow["v"], lrow["big"], lrow["_pg2delta_deleted"]) == (values["v"], values["big"], True), key
            assert lrow["email"] == _hashed(values["email"]), key
            assert (lrow["_pg2delta_lsn"], lrow["_pg2delta_commit_ts"], lrow["_pg2delta_op"]) == (*truth[xid], op), key

    copied_lsn = next(r for r in read_delta(lake / "_pg2delta" / "applied_log").to_pylist() if r["kind"] == "bootstrap")["window_end"]
    check({1: "U", 104: "U", 2: "I"}, copied_lsn)
    bare = {r["v"]: r for r in read_delta(lake / "rm" / "bare").to_pylist()}
    assert {v: (r["_pg2delta_deleted"], r["_pg2delta_op"]) for v, r in bare.items()} == {
        "b1": (True, "T"), "b2": (True, "T"), "b3": (True, "T"), "b4": (False, "I")}
    # A truncate's mark keeps a keyless row's key (its commit position): b2 copied and b3 share a position.
    _check_bare(pgdb, lake, ["b1", "b2", "b3"])

    # One window: an update and a delete of a row before a truncate, keys inserted between two
    # truncates, one inserted again after them, one inserted and deleted, one inserted, deleted and
    # inserted again; then the same in a window spilled past the memory budget. A key the window
    # inserts and deletes (or truncates) is kept, marked, with the values it had.
    def xid_of(conn: psycopg.Connection[Any]) -> int:
        return int(conn.execute("SELECT txid_current() % 4294967296").fetchone()[0])  # type: ignore[index]

    def truncate(conn: psycopg.Connection[Any]) -> None:
        old = _rows(pgdb, "rm.soft")
        with conn.transaction():
            xid = xid_of(conn)
            conn.execute("TRUNCATE rm.soft")
        deleted.update({k: (xid, "T", v) for k, v in old.items()})

    # On Apache Spark (CI time) the window in memory only; the spilled window and the backfill run the same SQL.
    for step, spilled, gone in (("w", False, 6), ("s", True, 11))[: 2 if embedded else 1]:
        with psycopg.connect(pgdb, autocommit=True) as conn:
            conn.execute(f"UPDATE rm.soft SET v = 'pre-{step}' WHERE id = 5")  # then truncated: marked T with it
            # Updated, then deleted before the truncate: its own D, the update's values (big: unchanged TOAST).
            conn.execute(f"UPDATE rm.soft SET v = 'upd-{step}' WHERE id = %s", (gone,))
            old = _rows(pgdb, "rm.soft")
            with conn.transaction():
                xid = xid_of(conn)
                conn.execute("DELETE FROM rm.soft WHERE id = %s", (gone,))
            deleted[gone] = (xid, "D", old[gone])
            truncate(conn)
            conn.execute(f"INSERT INTO rm.soft VALUES (5, 'mid-{step}', NULL), (9, 'mid9-{step}', NULL), "
                         f"({20 + int(spilled)}, 'mid20-{step}', 'm')")  # 20: new, then truncated: kept, T
            truncate(conn)  # 9 came back and went again: marked by this truncate, with its new values
            conn.execute(f"INSERT INTO rm.soft VALUES (5, 'after-{step}', 'a'), "
                         f"(11 + {int(spilled)}, '11', repeat('k', 3000))")  # 11: updated and deleted in the next window
            once, again = 30, 40 + int(spilled)  # the spilled window: 30 marked deleted before, inserted and deleted again
            conn.execute(f"INSERT INTO rm.soft VALUES ({once}, 'once-{step}', 'o'), ({again}, 'first-{step}', 'f')")
            with conn.transaction():
                xid = xid_of(conn)
                conn.execute("DELETE FROM rm.soft WHERE id IN (%s, %s)", (once, again))
            deleted[once] = (xid, "D", {"v": f"once-{step}", "big": "o", "email": "someone@example.org"})
            conn.execute(f"INSERT INTO rm.soft VALUES ({again}, 'again-{step}', 'g')")  # inserted, deleted, inserted: live
            for key in (5, 11 + int(spilled)):
                deleted.pop(key, None)
            if not spilled:  # the keyless table: truncates and inserts of equal rows, one transaction or two
                conn.execute("INSERT INTO rm.bare VALUES ('m1'), ('m2'), ('m3')")  # positions the next one's inserts take
                with conn.transaction():
                    conn.execute("TRUNCATE rm.bare")
                    conn.execute("INSERT INTO rm.bare VALUES ('b4'), ('m2'), ('x1'), ('m3')")
                conn.execute("TRUNCATE rm.bare")
                conn.execute("INSERT INTO rm.bare VALUES ('b4'), ('x1'), ('x2')")
                # Killed after the tables' commits, before the applied log's row: the window is applied again.
                killed = cli("run", "--config", str(path), env={"PG2DELTA_CRASH_AT": "after_commits"})
                assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        done = cli("run", "--config", str(path), "-v", env={"PG2DELTA_MEMORY_BUDGET": "1"} if spilled else None)
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("by the engine" in done.stderr) == spilled, done.stderr[-3000:]
        check({5: "I", 11: "I", 12: "I", 40: "I", 41: "I"}, copied_lsn)
        _check_bare(pgdb, lake, ["b1", "b2", "b3", "b4", "m1", "m2", "m3", "b4", "m2", "x1", "m3"])
    changelog = read_delta(lake / "_pg2delta" / "changelog" / "rm" / "soft")  # hashed there too, the excluded column left out
    assert "ssn" not in changelog.column_names and changelog.num_rows
    assert {len(e) for e in changelog.column("email").to_pylist() if e is not None} == {64}
    current = set(_rows(pgdb, "rm.soft"))
    if embedded:
        history = read_delta(lake / "rm" / "soft__history")
        assert "_pg2delta_deleted" not in history.column_names and "_pg2delta_op" not in history.column_names
        assert {r["id"] for r in history.to_pylist() if r["_pg2delta_is_current"]} == current <= {5, 11, 12, 40, 41}
        # A backfill into a copy replays the changelog (the deletes before a truncate too): the same rows, marked alike.
        logged = [r for r in read_delta(lake / "_pg2delta" / "applied_log").to_pylist() if r["table_name"] == "soft"]
        lsn = lambda v: f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"  # noqa: E731
        backfill = cli("backfill", "--config", str(path), "--table", "rm.soft", "--from-lsn", lsn(copied_lsn),
                       "--to-lsn", lsn(max(r["window_end"] for r in logged)), "--into", str(tmp_path / "copy"))
        assert backfill.returncode == 0, backfill.stderr[-3000:]
        assert sorted(map(str, read_delta(tmp_path / "copy" / "rm" / "soft").to_pylist())) == sorted(
            map(str, read_delta(lake / "rm" / "soft").to_pylist()))

    # A resync copies PostgreSQL's rows anew, in one commit: the rows marked deleted stay as they
    # were, a key inserted again is the copy's (live), a row deleted meanwhile (its change skipped,
    # the copy holds what came before it) is marked deleted at the copy's snapshot with the lake's
    # values. Killed after that commit, before its log row, the slot has not moved and the resync
    # run again converges (the row marked by the first stays as it marked it).
    before = _lake(lake / "rm" / "soft")
    version = DeltaTable(str(lake / "rm" / "soft")).version()
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("DELETE FROM rm.soft WHERE id = 5")
        conn.execute("INSERT INTO rm.soft VALUES (30, 'back30', NULL)")
    marked = before[5] | {"_pg2delta_deleted": True, "_pg2delta_op": "D", "_pg2delta_commit_ts": None}
    commits = 1
    if embedded:  # killed (a JVM more on Apache Spark, whose commit is the same overwrite: CI time)
        slot_at = confirmed_lsn(pgdb, slot)
        killed = cli("resync", "--config", str(path), "--table", "rm.soft", env={"PG2DELTA_CRASH_AT": "copy_after_replace"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        assert DeltaTable(str(lake / "rm" / "soft")).version() == version + 1 and confirmed_lsn(pgdb, slot) == slot_at
        first = _lake(lake / "rm" / "soft")
        first_lsn = {r["_pg2delta_lsn"] for r in first.values() if r["_pg2delta_op"] == "S"}
        assert len(first_lsn) == 1 and (first[5] | {"_pg2delta_commit_ts": None}) == marked | {"_pg2delta_lsn": min(first_lsn)}
        assert first[5]["_pg2delta_commit_ts"] in {r["_pg2delta_commit_ts"] for r in first.values() if r["_pg2delta_op"] == "S"}
        commits = 2
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO rm.bare VALUES ('b5')")
    # With rm.bare, keyless: its rows marked by the truncate stay, its live rows are the copy's.
    resynced = cli("resync", "--config", str(path), "--table", "rm.soft", "--table", "rm.bare",
                   "--parallel", "1")
    assert resynced.returncode == 0, resynced.stderr[-3000:]
    assert DeltaTable(str(lake / "rm" / "soft")).version() == version + commits
    live, got = _rows(pgdb, "rm.soft"), _lake(lake / "rm" / "soft")
    resync_lsn = max(r["window_end"] for r in read_delta(lake / "_pg2delta" / "applied_log").to_pylist()
                     if r["kind"] == "bootstrap" and r["table_name"] == "soft")
    assert sorted(got) == sorted({*live, *deleted, 5}) and 30 in live
    copy_ts = {got[k]["_pg2delta_commit_ts"] for k in live}
    for key, row in live.items():
        assert (got[key]["v"], got[key]["big"], got[key]["_pg2delta_deleted"]) == (row["v"], row["big"], False), key
        assert (got[key]["_pg2delta_lsn"], got[key]["_pg2delta_op"]) == (resync_lsn, "S"), key
    assert all(got[k] == before[k] for k in deleted if k != 30) and len(copy_ts) == 1
    if embedded:  # marked by the killed resync, kept as it marked it
        assert got[5] == first[5] and resync_lsn > min(first_lsn)
    else:
        assert (got[5] | {"_pg2delta_commit_ts": None}) == marked | {"_pg2delta_lsn": resync_lsn}
        assert got[5]["_pg2delta_commit_ts"] in copy_ts
    verified = cli("verify", "--config", str(path), "--json")  # the changes before the copy: skipped
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = json.loads(verified.stdout)["tables"]["rm.soft"]
    assert report["source_rows"] == report["lake_rows"] == len(live) and not report["differences"], report
    assert _lake(lake / "rm" / "soft") == got
    got_bare = read_delta(lake / "rm" / "bare").to_pylist()
    assert sorted((r for r in got_bare if r["v"] in bare and r["v"] != "b4"), key=lambda r: r["v"]) == [
        bare[v] for v in ("b1", "b2", "b3")]
    assert sorted((r["v"], r["_pg2delta_deleted"], r["_pg2delta_op"]) for r in got_bare if not r["_pg2delta_deleted"]) == [
        ("b4", False, "S"), ("b5", False, "S"), ("x1", False, "S"), ("x2", False, "S")]
