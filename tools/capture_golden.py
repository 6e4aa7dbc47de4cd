"""Capture golden pgoutput bytes from real PostgreSQL servers into ``tests/golden``.

    .venv/bin/python tools/capture_golden.py            # every available version (15, 18)
    .venv/bin/python tools/capture_golden.py --versions 18

For each server version this starts a throwaway server, and for each scenario creates a
fresh database, its tables and a publication, a logical slot, runs the scenario's
workload, then reads the slot with ``pg_logical_slot_peek_binary_changes`` under several
option sets. Each (scenario, option set) becomes one capture:

``tests/golden/pg<major>/<name>.bin``
    the rows, one after another, each framed as
    ``u64 lsn | u32 xid | u32 length | length bytes of data`` (big-endian);
``tests/golden/pg<major>/<name>.json``
    the options passed to the plugin, the server version, how many rows were dropped
    by trimming, and ``facts``: what the workload did, read back from the server with
    plain SQL (OIDs, xids, gids, values), for the tests to check the decoded messages against.

Option sets a server rejects are recorded, with the server's error, in
``tests/golden/pg<major>/rejected.json``.

Streamed captures are trimmed so the files stay small: inside each streamed segment only
the first few Insert rows are kept (Relation, Type, Message, Stream * rows are never dropped).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from pg2delta.lsn import parse_lsn
from pg2delta.source.throwaway import ThrowawayPostgres, available_versions

ROW_HEADER = struct.Struct("!QII")  # lsn, xid, length
GOLDEN_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden"
WORK_MEM = "64kB"  # the smallest logical_decoding_work_mem: large transactions stream early
BIG_ROWS = 1200  # rows in a "large" transaction: a few times over WORK_MEM
KEEP_INSERTS_PER_SEGMENT = 3
PG_EPOCH_UNIX = 946684800  # 2000-01-01 in Unix seconds

Facts = dict[str, Any]
Conn = psycopg.Connection[Any]


@dataclass(frozen=True)
class Capture:
    name: str
    options: dict[str, str]
    min_version: int = 0
    trim: bool = False


@dataclass
class Scenario:
    name: str
    setup: str
    workload: Callable[[Conn], Facts]
    captures: list[Capture]
    two_phase_slot: bool = False
    rejected_options: list[dict[str, str]] = field(default_factory=list)


def one(conn: Conn, query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def xid_now(conn: Conn) -> int:
    return int(one(conn, "SELECT pg_current_xact_id()::text"))


def oid_of(conn: Conn, name: str) -> int:
    return int(one(conn, "SELECT %s::regclass::oid::bigint", (name,)))


# ------------------------------------------------------------------ scenarios

DML_SETUP = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
CREATE TABLE t_default (
    id int PRIMARY KEY, name text, score numeric(10,2), flag boolean,
    at timestamptz, raw bytea, feeling mood, n posint
);
CREATE TABLE t_full (id int, name text);
ALTER TABLE t_full REPLICA IDENTITY FULL;
CREATE TABLE t_index (a int NOT NULL, b text NOT NULL, c text);
CREATE UNIQUE INDEX t_index_ba ON t_index (b, a);
ALTER TABLE t_index REPLICA IDENTITY USING INDEX t_index_ba;
CREATE TABLE t_nothing (id int, v text);
ALTER TABLE t_nothing REPLICA IDENTITY NOTHING;
CREATE TABLE t_toast (id int PRIMARY KEY, big text, small int);
ALTER TABLE t_toast ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE "Wéird Name" ("Çol" int PRIMARY KEY, "a b" text);
CREATE SCHEMA other;
CREATE TABLE other.t_empty ();
CREATE PUBLICATION golden_pub FOR ALL TABLES;
"""


def dml_workload(conn: Conn) -> Facts:
    """Inserts, updates and deletes under every replica identity, a TOASTed column, odd names."""
    facts: Facts = {"relations": {}, "xids": {}}
    for name, ident in [
        ("t_default", "d"),
        ("t_full", "f"),
        ("t_index", "i"),
        ("t_nothing", "n"),
        ("t_toast", "d"),
        ('"Wéird Name"', "d"),
        ("other.t_empty", "d"),
    ]:
        facts["relations"][name] = {"oid": oid_of(conn, name), "replica_identity": ident}
    facts["types"] = {
        "mood": int(one(conn, "SELECT 'mood'::regtype::oid::bigint")),
        "posint": int(one(conn, "SELECT 'posint'::regtype::oid::bigint")),
    }

    def tx(label: str, *statements: str) -> None:
        with conn.transaction():
            facts["xids"][label] = xid_now(conn)
            for sql in statements:
                conn.execute(sql)

    tx(
        "insert_default",
        "INSERT INTO t_default VALUES (1, 'alpha', 12.50, true, '2024-01-02 03:04:05+00', '\\x00ff', 'happy', 7),"
        " (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
    )
    tx("update_default_nonkey", "UPDATE t_default SET name = 'beta' WHERE id = 1")
    tx("update_default_key", "UPDATE t_default SET id = 10 WHERE id = 2")
    tx("delete_default", "DELETE FROM t_default WHERE id = 10")
    tx(
        "full",
        "INSERT INTO t_full VALUES (1, 'x'), (2, NULL)",
        "UPDATE t_full SET name = 'y' WHERE id = 1",
        "DELETE FROM t_full WHERE id = 2",
    )
    tx(
        "index",
        "INSERT INTO t_index VALUES (1, 'k', 'c1')",
        "UPDATE t_index SET c = 'c2' WHERE a = 1",
        "UPDATE t_index SET b = 'k2' WHERE a = 1",
        "DELETE FROM t_index WHERE a = 1",
    )
    tx("insert_nothing", "INSERT INTO t_nothing VALUES (1, 'v')")
    # A published table without a replica identity refuses updates and deletes at the source.
    refused: dict[str, str | None] = {}
    for label, sql in [
        ("update", "UPDATE t_nothing SET v = 'w'"),
        ("delete", "DELETE FROM t_nothing"),
    ]:
        try:
            with conn.transaction():
                conn.execute(sql)
            refused[label] = None
        except psycopg.Error as exc:
            refused[label] = str(exc).splitlines()[0]
    facts["nothing_refused"] = refused
    facts["toast_length"] = 3000
    tx("insert_toast", "INSERT INTO t_toast VALUES (1, repeat('x', 3000), 1)")
    tx("update_toast", "UPDATE t_toast SET small = 2 WHERE id = 1")
    tx("insert_weird", "INSERT INTO \"Wéird Name\" VALUES (42, '')")
    tx("insert_empty", "INSERT INTO other.t_empty DEFAULT VALUES")
    return facts


MESSAGES_SETUP = """
CREATE TABLE m (id int PRIMARY KEY);
CREATE PUBLICATION golden_pub FOR TABLE m;
"""


def messages_workload(conn: Conn) -> Facts:
    """Logical decoding messages, transactional and not, text and binary content."""
    facts: Facts = {"xids": {}}
    conn.execute("SELECT pg_logical_emit_message(false, 'golden-nontx', 'hello')")
    with conn.transaction():
        facts["xids"]["tx"] = xid_now(conn)
        conn.execute("INSERT INTO m VALUES (1)")
        conn.execute("SELECT pg_logical_emit_message(true, 'golden-tx', '\\x0001ff'::bytea)")
    with conn.transaction():
        facts["xids"]["tx_empty"] = xid_now(conn)
        conn.execute("SELECT pg_logical_emit_message(true, 'golden-empty', '')")
    conn.execute("SELECT pg_logical_emit_message(false, 'golden-ünï', 'ß'::text)")
    facts["messages"] = [
        {"transactional": False, "prefix": "golden-nontx", "content": b"hello".hex(), "xid": None},
        {"transactional": True, "prefix": "golden-tx", "content": "0001ff", "xid": facts["xids"]["tx"]},
        {"transactional": True, "prefix": "golden-empty", "content": "", "xid": facts["xids"]["tx_empty"]},
        {"transactional": False, "prefix": "golden-ünï", "content": "ß".encode().hex(), "xid": None},
    ]
    facts["relation_oid"] = oid_of(conn, "m")
    return facts


STREAM_SETUP = """
CREATE TABLE s (id int PRIMARY KEY, pad text);
CREATE PUBLICATION golden_pub FOR TABLE s;
"""


def _big_insert(conn: Conn, start: int) -> None:
    conn.execute(
        "INSERT INTO s SELECT g, repeat('p', 40) FROM generate_series(%s::int, %s::int) g",
        (start, start + BIG_ROWS - 1),
    )


def stream_workload(conn: Conn) -> Facts:
    """Large transactions: one commits, one rolls back a savepoint, one aborts entirely."""
    facts: Facts = {"relation_oid": oid_of(conn, "s")}
    with conn.transaction():
        facts["commit_xid"] = xid_now(conn)
        _big_insert(conn, 1)
        conn.execute("SELECT pg_logical_emit_message(true, 'golden-in-stream', 'm')")
    conn.execute("BEGIN")
    facts["savepoint_xid"] = xid_now(conn)
    conn.execute("INSERT INTO s VALUES (100000, 'top')")
    conn.execute("SAVEPOINT sp")
    _big_insert(conn, 200000)
    facts["savepoint_subxid"] = int(one(conn, "SELECT xmin::text FROM s WHERE id = 200000"))
    conn.execute("ROLLBACK TO SAVEPOINT sp")
    conn.execute("INSERT INTO s VALUES (100001, 'after')")
    conn.execute("COMMIT")
    conn.execute("BEGIN")
    facts["abort_xid"] = xid_now(conn)
    _big_insert(conn, 300000)
    conn.execute("ROLLBACK")
    facts["committed_ids_outside_big"] = [100000, 100001]
    return facts


TWOPHASE_SETUP = """
CREATE TABLE tp (id int PRIMARY KEY, v text);
CREATE PUBLICATION golden_pub FOR TABLE tp;
"""


def twophase_workload(conn: Conn) -> Facts:
    """PREPARE TRANSACTION, then COMMIT PREPARED / ROLLBACK PREPARED; one large prepared transaction."""
    facts: Facts = {"relation_oid": oid_of(conn, "tp"), "prepared": []}
    for gid, rows, finish in [
        ("golden-gid-1", 1, "COMMIT PREPARED"),
        ("golden-gid-2", 1, "ROLLBACK PREPARED"),
        ("golden-gid-big", BIG_ROWS, "COMMIT PREPARED"),
    ]:
        conn.execute("BEGIN")
        xid = xid_now(conn)
        base = len(facts["prepared"]) * 10000
        conn.execute(
            "INSERT INTO tp SELECT g, 'v' || g FROM generate_series(%s::int, %s::int) g",
            (base + 1, base + rows),
        )
        conn.execute(f"PREPARE TRANSACTION '{gid}'")
        conn.execute(f"{finish} '{gid}'")
        facts["prepared"].append({"gid": gid, "xid": xid, "rows": rows, "finish": finish})
    return facts


ORIGIN_SETUP = """
CREATE TABLE o (id int PRIMARY KEY);
CREATE PUBLICATION golden_pub FOR TABLE o;
"""

ORIGIN_LSN = "0/1234ABCD"
ORIGIN_TS = "2024-01-01 00:00:00+00"


def origin_workload(conn: Conn) -> Facts:
    """A transaction replayed from a named replication origin, and one that is not."""
    conn.execute("SELECT pg_replication_origin_create('golden_origin')")
    conn.execute("SELECT pg_replication_origin_session_setup('golden_origin')")
    with conn.transaction():
        origin_xid = xid_now(conn)
        conn.execute("SELECT pg_replication_origin_xact_setup(%s, %s)", (ORIGIN_LSN, ORIGIN_TS))
        conn.execute("INSERT INTO o VALUES (1)")
    conn.execute("SELECT pg_replication_origin_session_reset()")
    with conn.transaction():
        local_xid = xid_now(conn)
        conn.execute("INSERT INTO o VALUES (2)")
    return {
        "origin_name": "golden_origin",
        "origin_lsn": parse_lsn(ORIGIN_LSN),
        "origin_ts_pg_epoch_us": (1704067200 - PG_EPOCH_UNIX) * 1_000_000,
        "origin_xid": origin_xid,
        "local_xid": local_xid,
        "relation_oid": oid_of(conn, "o"),
    }


TRUNCATE_SETUP = """
CREATE TABLE ta (id int PRIMARY KEY);
CREATE TABLE tb (id int PRIMARY KEY, a int REFERENCES ta);
CREATE TABLE tc (id serial PRIMARY KEY, v text);
CREATE TABLE td (id int);
CREATE PUBLICATION golden_pub FOR ALL TABLES;
"""


def truncate_workload(conn: Conn) -> Facts:
    """TRUNCATE of several tables, with CASCADE, RESTART IDENTITY, both."""
    oids = {name: oid_of(conn, name) for name in ("ta", "tb", "tc", "td")}
    conn.execute("INSERT INTO ta VALUES (1); INSERT INTO tb VALUES (1, 1); INSERT INTO tc (v) VALUES ('a')")
    truncates = []
    for sql, options, tables in [
        ("TRUNCATE ta, tb", 0, ["ta", "tb"]),
        ("TRUNCATE ta CASCADE", 1, ["ta", "tb"]),
        ("TRUNCATE tc RESTART IDENTITY", 2, ["tc"]),
        ("TRUNCATE ta, tc, td RESTART IDENTITY CASCADE", 3, ["ta", "tb", "tc", "td"]),
    ]:
        with conn.transaction():
            xid = xid_now(conn)
            conn.execute(sql)
        truncates.append(
            {"sql": sql, "xid": xid, "options": options, "oids": sorted(oids[t] for t in tables)}
        )
    return {"oids": oids, "truncates": truncates}


def opts(proto: int, binary: bool = False, **extra: str) -> dict[str, str]:
    out = {
        "proto_version": str(proto),
        "publication_names": "golden_pub",
        "binary": "true" if binary else "false",
    }
    out.update(extra)
    return out


SCENARIOS = [
    Scenario(
        "dml",
        DML_SETUP,
        dml_workload,
        [
            Capture("dml_v1_text", opts(1)),
            Capture("dml_v1_binary", opts(1, True)),
            Capture("dml_v2_text", opts(2)),
            Capture("dml_v3_binary", opts(3, True)),
            Capture("dml_v4_binary", opts(4, True), min_version=16),
        ],
        rejected_options=[opts(4), opts(99), opts(0)],
    ),
    Scenario(
        "messages",
        MESSAGES_SETUP,
        messages_workload,
        [
            Capture("messages_v1", opts(1, messages="true")),
            Capture("messages_off_v1", opts(1)),
        ],
    ),
    Scenario(
        "stream",
        STREAM_SETUP,
        stream_workload,
        [
            Capture("stream_v2_text", opts(2, streaming="true", messages="true"), trim=True),
            Capture("stream_v3_binary", opts(3, True, streaming="true"), trim=True),
            Capture("stream_v4_on", opts(4, streaming="on", messages="true"), min_version=16, trim=True),
            Capture(
                "stream_v4_parallel",
                opts(4, streaming="parallel", messages="true"),
                min_version=16,
                trim=True,
            ),
        ],
        rejected_options=[
            opts(1, streaming="true"),
            opts(2, streaming="parallel"),
            opts(3, streaming="parallel"),
            opts(4, streaming="parallel"),
        ],
    ),
    Scenario(
        "twophase",
        TWOPHASE_SETUP,
        twophase_workload,
        [
            Capture("twophase_v3", opts(3, two_phase="true"), trim=True),
            Capture("twophase_v3_stream", opts(3, two_phase="true", streaming="true"), trim=True),
            Capture(
                "twophase_v4_parallel",
                opts(4, True, two_phase="true", streaming="parallel"),
                min_version=16,
                trim=True,
            ),
        ],
        two_phase_slot=True,
        rejected_options=[opts(2, two_phase="true")],
    ),
    Scenario(
        "origin",
        ORIGIN_SETUP,
        origin_workload,
        [
            Capture("origin_v1", opts(1)),
            Capture("origin_v4_none", opts(4, origin="none"), min_version=16),
        ],
        rejected_options=[opts(1, origin="none")],
    ),
    Scenario("truncate", TRUNCATE_SETUP, truncate_workload, [Capture("truncate_v1", opts(1))]),
]

# ------------------------------------------------------------------ capture


def peek(conn: Conn, slot: str, options: dict[str, str]) -> list[tuple[int, int, bytes]]:
    args = "".join(", %s, %s" for _ in options)
    params: list[str] = [slot]
    for key, value in options.items():
        params += [key, value]
    rows = conn.execute(
        f"SELECT lsn::text, xid::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL{args})",
        params,
    ).fetchall()
    return [(parse_lsn(lsn), int(xid), bytes(data)) for lsn, xid, data in rows]


def trim(rows: list[tuple[int, int, bytes]]) -> tuple[list[tuple[int, int, bytes]], int]:
    """Keep the first few Insert rows of each streamed segment or transaction; drop the rest."""
    kept, dropped, inserts = [], 0, 0
    for row in rows:
        tag = row[2][:1]
        if tag in (b"S", b"B", b"b"):
            inserts = 0
        if tag == b"I":
            inserts += 1
            if inserts > KEEP_INSERTS_PER_SEGMENT:
                dropped += 1
                continue
        kept.append(row)
    return kept, dropped


def write_capture(outdir: Path, name: str, rows: list[tuple[int, int, bytes]], meta: dict[str, Any]) -> int:
    blob = b"".join(ROW_HEADER.pack(lsn, xid, len(data)) + data for lsn, xid, data in rows)
    (outdir / f"{name}.bin").write_bytes(blob)
    (outdir / f"{name}.json").write_text(
        json.dumps(meta, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    )
    return len(blob)


def run_scenario(server: ThrowawayPostgres, scenario: Scenario, outdir: Path, rejected: list[Any]) -> None:
    dbname = f"golden_{scenario.name}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{dbname}"')
    slot = f"golden_{scenario.name}"
    with psycopg.connect(server.dsn_for(dbname), autocommit=True) as conn:
        conn.execute(scenario.setup)
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)",
            (slot, scenario.two_phase_slot),
        )
        facts = scenario.workload(conn)
        # Aborts and non-transactional messages do not flush WAL, and a peek reads only
        # up to the flush position: end with a commit that wrote WAL (catalog rows only,
        # which pgoutput does not send) so everything the workload wrote is decodable.
        with conn.transaction():
            conn.execute("CREATE TABLE golden_fence (); DROP TABLE golden_fence")
        version = one(conn, "SHOW server_version")
        version_num = int(one(conn, "SHOW server_version_num"))
        conn.execute(f"SET logical_decoding_work_mem = '{WORK_MEM}'")
        for cap in scenario.captures:
            if version_num < cap.min_version * 10000:
                continue
            rows = peek(conn, slot, cap.options)
            total = len(rows)
            dropped = 0
            if cap.trim:
                rows, dropped = trim(rows)
            meta = {
                "scenario": scenario.name,
                "description": (scenario.workload.__doc__ or "").strip(),
                "server_version": version,
                "options": cap.options,
                "two_phase_slot": scenario.two_phase_slot,
                "logical_decoding_work_mem": WORK_MEM,
                "rows": len(rows),
                "rows_before_trim": total,
                "trimmed_inserts": dropped,
                "trim_rule": f"at most {KEEP_INSERTS_PER_SEGMENT} Insert rows per stream segment or transaction"
                if cap.trim
                else None,
                "facts": facts,
            }
            size = write_capture(outdir, cap.name, rows, meta)
            print(f"  {cap.name}: {len(rows)} rows ({dropped} trimmed), {size} bytes")
        for options in scenario.rejected_options:
            try:
                peek(conn, slot, options)
                rejected.append({"scenario": scenario.name, "options": options, "error": None})
            except psycopg.Error as exc:
                rejected.append(
                    {"scenario": scenario.name, "options": options, "error": str(exc).splitlines()[0]}
                )
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{dbname}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--versions", default=",".join(map(str, available_versions())))
    parser.add_argument("--out", type=Path, default=GOLDEN_DIR)
    parser.add_argument("--only", help="comma-separated scenario names")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    for version in (int(v) for v in args.versions.split(",") if v):
        outdir = args.out / f"pg{version}"
        outdir.mkdir(parents=True, exist_ok=True)
        print(f"PostgreSQL {version}:")
        rejected: list[Any] = []
        with ThrowawayPostgres.start(version) as server:
            for scenario in SCENARIOS:
                if only is None or scenario.name in only:
                    run_scenario(server, scenario, outdir, rejected)
        if only is None:
            (outdir / "rejected.json").write_text(json.dumps(rejected, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
