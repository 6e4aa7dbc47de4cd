"""Leaf partitions rewritten under a root published via itself (pg2delta.source.rewrites): the
test_decoding TRUNCATE lines parsed, relfilenodes compared; the e2e run is in test_resync.py."""

from __future__ import annotations

import psycopg
import pytest

from pg2delta.apply.targets import truncated_partitions
from pg2delta.config import Config, SourceConfig, TableConfig
from pg2delta.lsn import parse_lsn
from pg2delta.source.detaches import Detach, detach_positions
from pg2delta.source.publication import published_tables
from pg2delta.source.rewrites import (
    DecodeUnavailable,
    Truncated,
    filenodes_of,
    fresh_leaves,
    leaf_filenodes,
    match_truncates,
    rewritten_leaves,
    truncate_names,
    truncated_alone,
)
from pg2delta.source.slot import SlotSource


def test_truncate_lines() -> None:
    assert truncate_names("table public.m2: TRUNCATE: (no-flags)") == ["public.m2"]
    assert truncate_names('table public.m, public."M 2", "a,b"."x: y": TRUNCATE: restart_seqs cascade') == [
        "public.m", 'public."M 2"', '"a,b"."x: y"',
    ]
    assert truncate_names('table "q""t".m: TRUNCATE: cascade') == ['"q""t".m']
    # an INSERT whose value holds the words, and lines that are not TRUNCATEs
    assert truncate_names("table public.t: INSERT: v[text]:'a: TRUNCATE: b'") is None
    assert truncate_names("COMMIT 731") is None
    assert truncate_names('table public."m: TRUNCATE:') is None


def test_rewritten_leaves() -> None:
    assert rewritten_leaves(None, {5: 9}) == []  # nothing recorded: nothing to compare
    assert rewritten_leaves({5: 5, 6: 6}, {5: 5, 6: 8}) == [6]
    # New leaves count (a TRUNCATE in the transaction that created one keeps its relfilenode);
    # those never rewritten (relfilenode still the OID) are "fresh".
    assert rewritten_leaves({5: 5}, {5: 5, 7: 7, 8: 12}) == [7, 8]
    assert fresh_leaves({5: 5}, {5: 5, 7: 7, 8: 12}) == {7}
    assert fresh_leaves(None, {7: 7}) == set()
    assert rewritten_leaves({5: 5, 6: 6}, {5: 5}) == []  # a leaf gone is _detached's case
    assert rewritten_leaves({}, {7: 7, 8: 9}) == [7, 8]  # a root that had no leaves when it was logged


def test_match_truncates() -> None:
    names = {1: "public.m", 2: "public.m1", 3: "public.m2"}
    truncates = [
        ({"public.m", "public.m1", "public.m2"}, 100),  # the root's: sent
        ({"public.m2"}, 200),
        ({"public.other", "public.old_name"}, 300),  # a name no relation has now
    ]
    roots = {1: (0, [2, 3])}
    assert match_truncates(truncates, roots, names, set()) == {1: Truncated(["public.m2"], [])}
    assert match_truncates(truncates, roots, names, {"public.old_name"}) == {1: Truncated(["public.m2"], ["public.old_name"])}
    assert match_truncates(truncates, {1: (200, [2, 3])}, names, set()) == {}  # at or before its copy: in it
    assert match_truncates(truncates, {1: (0, [2])}, names, set()) == {}


@pytest.mark.integration
def test_backlog_decoded(pgdb: str) -> None:
    """A real backlog: a TRUNCATE of the root (sent), of a leaf alone, and of a leaf renamed since."""
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int, k int) PARTITION BY LIST (k)")
        for k in (1, 2, 3):
            conn.execute(f'CREATE TABLE "m {k}" PARTITION OF m FOR VALUES IN ({k})')
        conn.execute("SELECT pg_create_logical_replication_slot('backlog', 'pgoutput')")
        oids = [int(conn.execute("SELECT %s::regclass::oid::int8", (n,)).fetchone()[0]) for n in ('m', '"m 1"', '"m 2"')]
        before = leaf_filenodes(conn, [oids[0]])[oids[0]]
        # A copy records them too (read in its snapshot); a root without partitions records none.
        conn.execute("CREATE TABLE e (id int, k int) PARTITION BY LIST (k)")
        conn.execute("CREATE PUBLICATION backlog FOR TABLE m, e WITH (publish_via_partition_root = true)")
        copied = {t.relation.name: filenodes_of(t.filenodes) for t in published_tables(conn, "backlog")}
        assert copied == {"m": before, "e": {}}
        conn.execute("INSERT INTO m VALUES (1, 1), (2, 2), (3, 3)")
        conn.execute("TRUNCATE m")
        conn.execute('TRUNCATE "m 1"')
        conn.execute('VACUUM FULL "m 2"')
        conn.execute('TRUNCATE "m 3"')
        conn.execute('ALTER TABLE "m 3" RENAME TO m3')
        now = leaf_filenodes(conn, [oids[0]])[oids[0]]
    changed = rewritten_leaves(before, now)
    assert len(changed) == 3
    found = truncated_alone(pgdb, "backlog", {oids[0]: (0, changed)})
    assert found == {oids[0]: Truncated(['public."m 1"'], ['public."m 3"'])}


@pytest.mark.integration
def test_backlog_not_decodable(pgdb: str) -> None:
    """Where the backlog cannot be decoded (here: the slot's copy fails), any rewrite counts."""
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE m (id int, k int) PARTITION BY LIST (k)")
        conn.execute("CREATE TABLE m2 PARTITION OF m FOR VALUES IN (2)")
        root, leaf = (int(conn.execute("SELECT %s::regclass::oid::int8", (n,)).fetchone()[0]) for n in ("m", "m2"))
    with pytest.raises(DecodeUnavailable, match="no_such_slot"):
        truncated_alone(pgdb, "no_such_slot", {root: (0, [leaf])})
    cfg = Config(source=SourceConfig(dsn=pgdb, slot="no_such_slot"))
    with SlotSource(pgdb, "no_such_slot", "p") as src:
        refusal = truncated_partitions(cfg, src, {}, {root: [leaf]}, again := {})
        assert refusal is not None and not again
        assert str(refusal).startswith(
            "a partition of public.m (public.m2) was rewritten (TRUNCATE, VACUUM FULL or CLUSTER) since the lake's "
            "last window of it, and pg2delta cannot tell which: the test_decoding plugin"
        ), str(refusal)
        assert str(refusal).endswith('pg2delta resync --table public.m (or set on_unfollowable = "resync")')
        resync = Config(source=cfg.source, tables={"public.m": TableConfig(on_unfollowable="resync")})
        assert truncated_partitions(resync, src, {}, {root: [leaf]}, again) is None and again == {root: "public.m"}
        # A partition only new since (never rewritten) is refused too: created, filled and
        # truncated in one transaction, its rows were sent and its TRUNCATE not.
        fresh = truncated_partitions(cfg, src, {}, {root: [leaf]}, fresh_again := {}, fresh={leaf})
        assert fresh is not None and not fresh_again
        assert str(fresh).startswith(
            "public.m2 became a partition of public.m since the lake's last window of it, and pg2delta cannot tell "
            "whether it was truncated in the transaction that created it"
        ), str(fresh)
        assert "pg2delta resync --table public.m" in str(fresh)
        assert truncated_partitions(resync, src, {}, {root: [leaf]}, fresh_again, fresh={leaf}) is None
        assert fresh_again == {root: "public.m"}


@pytest.mark.integration
def test_detach_positions(pgdb: str) -> None:
    """Where each partition's DETACH committed in the slot's backlog: found for a plain DETACH and
    for one CONCURRENTLY (its second transaction); 0 for one before the slot; unknown for a DETACH
    in a transaction that changed rows, for a table whose catalog row was written again since (a
    GRANT; an ALTER COLUMN … TYPE of its first column, which writes that column's row too), for an
    ALTER TABLE since that wrote every row a DETACH writes (pg_walinspect: it deleted no pg_inherits
    row), and for every DETACH in the backlog without pg_walinspect."""
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_walinspect")
        conn.execute("CREATE TABLE m (id int, k int, v text) PARTITION BY LIST (k)")
        for k in (2, 3, 4, 5, 6, 7, 8):
            conn.execute(f"CREATE TABLE m{k} PARTITION OF m FOR VALUES IN ({k})")
        conn.execute("ALTER TABLE m DETACH PARTITION m5")
        conn.execute("SELECT pg_create_logical_replication_slot('backlog', 'pgoutput')")
        conn.execute("INSERT INTO m VALUES (1, 2, 'before'), (1, 7, 'before')")
        conn.execute("ALTER TABLE m DETACH PARTITION m2")
        after = parse_lsn(str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]))
        conn.execute("INSERT INTO m2 VALUES (2, 2, 'after')")
        conn.execute("ALTER TABLE m DETACH PARTITION m3")
        conn.execute("GRANT SELECT ON m3 TO PUBLIC")
        with conn.transaction():
            conn.execute("INSERT INTO m VALUES (1, 4, 'with the detach')")
            conn.execute("ALTER TABLE m DETACH PARTITION m4")
        pending = parse_lsn(str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]))
        conn.execute("ALTER TABLE m DETACH PARTITION m6 CONCURRENTLY")
        concurrently = parse_lsn(str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]))
        conn.execute("ALTER TABLE m DETACH PARTITION m7")
        conn.execute("ALTER TABLE m7 ALTER COLUMN id TYPE bigint")
        conn.execute("ALTER TABLE m DETACH PARTITION m8")
        conn.execute("ALTER TABLE m8 ALTER id SET STATISTICS 10, ALTER k SET STATISTICS 10, ALTER v SET STATISTICS 10, "
                     "SET (fillfactor = 50)")
        oids = {n: int(conn.execute("SELECT %s::regclass::oid::int8", (n,)).fetchone()[0])
                for n in ("m2", "m3", "m4", "m5", "m6", "m7", "m8")}
        found = detach_positions(pgdb, "backlog", oids.values())
        assert found[oids["m5"]] == Detach(0)
        at = found[oids["m2"]].lsn
        assert at is not None and 0 < at <= after, found
        assert found[oids["m3"]].lsn is None and "written again" in found[oids["m3"]].why
        assert found[oids["m4"]].lsn is None and "changed or rewrote rows too" in found[oids["m4"]].why
        at = found[oids["m6"]].lsn
        assert at is not None and pending < at <= concurrently, found
        assert found[oids["m7"]].lsn is None and "written again" in found[oids["m7"]].why
        assert found[oids["m8"]].lsn is None and "detached no partition" in found[oids["m8"]].why
        conn.execute("DROP EXTENSION pg_walinspect")
    unproven = detach_positions(pgdb, "backlog", [oids["m2"], oids["m5"]])
    assert unproven[oids["m5"]] == Detach(0)
    assert unproven[oids["m2"]].lsn is None and "pg_walinspect" in unproven[oids["m2"]].why, unproven
