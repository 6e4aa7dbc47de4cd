"""Golden bytes from real PostgreSQL 15 and 18 servers, decoded and checked against what the
workload did (``facts`` in each capture's sidecar, read from the server with plain SQL).

The captures live in ``tests/golden`` (see its README for the framing) and are made by
``tools/capture_golden.py``. The last test here does the same against a live server and
checks every decoded value against the type's own output and send functions.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pg2delta.decode import pgoutput as po
from pg2delta.decode.pgoutput import (
    NULL,
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Binary,
    ColumnValue,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Message,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    Text,
    Truncate,
    Type,
    Update,
    parse_message,
)
from pg2delta.lsn import parse_lsn

GOLDEN = Path(__file__).parent / "golden"
ROW_HEADER = struct.Struct("!QII")


@dataclass(frozen=True)
class Row:
    lsn: int
    xid: int
    data: bytes
    in_stream: bool  # between Stream Start and Stream Stop, as a consumer tracks it


@dataclass(frozen=True)
class GoldenCapture:
    version: int
    name: str
    meta: dict[str, Any]
    rows: tuple[Row, ...]

    @property
    def id(self) -> str:
        return f"pg{self.version}-{self.name}"

    @property
    def facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = self.meta["facts"]
        return facts

    @property
    def options(self) -> dict[str, str]:
        options: dict[str, str] = self.meta["options"]
        return options

    @property
    def binary(self) -> bool:
        return self.options["binary"] == "true"

    def messages(self) -> list[tuple[Row, Message]]:
        return [(row, parse_message(row.data, in_stream=row.in_stream, lsn=row.lsn)) for row in self.rows]


def read_rows(blob: bytes) -> Iterator[tuple[int, int, bytes]]:
    off = 0
    while off < len(blob):
        lsn, xid, length = ROW_HEADER.unpack_from(blob, off)
        off += ROW_HEADER.size
        yield lsn, xid, blob[off : off + length]
        off += length
    assert off == len(blob)


def load_captures() -> list[GoldenCapture]:
    """Every capture; ``in_stream`` is tracked from the tag bytes alone, without the parser."""
    captures = []
    for path in sorted(GOLDEN.glob("pg*/*.bin")):
        meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        rows, in_stream = [], False
        for lsn, xid, data in read_rows(path.read_bytes()):
            if data[:1] == b"E":
                in_stream = False
            rows.append(Row(lsn, xid, data, in_stream and data[:1] != b"S"))
            if data[:1] == b"S":
                in_stream = True
        captures.append(GoldenCapture(int(path.parent.name[2:]), path.stem, meta, tuple(rows)))
    return captures


CAPTURES = load_captures()


def captures(scenario: str) -> list[Any]:
    return [pytest.param(c, id=c.id) for c in CAPTURES if c.meta["scenario"] == scenario]


def of(msgs: list[tuple[Row, Message]], cls: type[Any]) -> list[Any]:
    return [m for _, m in msgs if isinstance(m, cls)]


def value(capture: GoldenCapture, text: bytes, binary: bytes | None = None) -> ColumnValue:
    """The value as the server sends it in this capture's format."""
    if capture.binary:
        return Binary(text if binary is None else binary)
    return Text(text)


def int4(capture: GoldenCapture, n: int) -> ColumnValue:
    return value(capture, str(n).encode(), struct.pack("!i", n))


# ---------------------------------------------------------------- all captures


def test_captures_exist_for_both_versions() -> None:
    versions = Counter(c.version for c in CAPTURES)
    assert versions[15] >= 10
    assert versions[18] >= 15
    assert sum(p.stat().st_size for p in GOLDEN.glob("pg*/*")) < 2_000_000


@pytest.mark.parametrize("capture", [pytest.param(c, id=c.id) for c in CAPTURES])
def test_every_row_decodes(capture: GoldenCapture) -> None:
    msgs = capture.messages()
    assert len(msgs) == capture.meta["rows"] > 0
    for row, msg in msgs:
        if isinstance(msg, Begin | StreamStart | StreamCommit | BeginPrepare | Prepare | StreamPrepare):
            assert msg.xid == row.xid  # the peek's xid column is the top-level xid
        if isinstance(msg, LogicalMessage | Relation | Type | Insert | Update | Delete | Truncate):
            assert (msg.xid is not None) == row.in_stream
    # Transactions are well formed: Begin ... Commit with matching LSN and timestamp.
    begin: Begin | None = None
    for _, msg in msgs:
        if isinstance(msg, Begin):
            assert begin is None
            begin = msg
        elif isinstance(msg, Commit):
            assert begin is not None
            assert (msg.commit_lsn, msg.commit_ts, msg.flags) == (begin.final_lsn, begin.commit_ts, 0)
            assert msg.end_lsn > msg.commit_lsn
            begin = None
    assert begin is None


def test_every_tag_occurs_in_real_output() -> None:
    seen = {row.data[0] for c in CAPTURES for row in c.rows}
    all_tags = {
        v for k, v in vars(po).items() if k.isupper() and not k.startswith("_") and isinstance(v, int)
    }
    assert len(all_tags) == 19
    assert seen == all_tags


# ---------------------------------------------------------------- DML


@pytest.mark.parametrize("capture", captures("dml"))
def test_dml_relations_and_types(capture: GoldenCapture) -> None:
    facts = capture.facts
    msgs = capture.messages()
    relations = {r.oid: r for r in of(msgs, Relation)}
    expected = {
        "t_default": ("public", "t_default", ("id",)),
        "t_full": ("public", "t_full", ("id", "name")),
        "t_index": ("public", "t_index", ("a", "b")),
        "t_nothing": ("public", "t_nothing", ()),
        "t_toast": ("public", "t_toast", ("id",)),
        '"Wéird Name"': ("public", "Wéird Name", ("Çol",)),
        "other.t_empty": ("other", "t_empty", ()),
    }
    assert set(relations) == {f["oid"] for f in facts["relations"].values()}
    for key, (namespace, name, keys) in expected.items():
        rel = relations[facts["relations"][key]["oid"]]
        assert (rel.namespace, rel.name, rel.key_names) == (namespace, name, keys)
        assert rel.replica_identity == facts["relations"][key]["replica_identity"]
    t_default = relations[facts["relations"]["t_default"]["oid"]]
    assert [(c.name, c.type_oid, c.type_modifier) for c in t_default.columns] == [
        ("id", 23, -1),
        ("name", 25, -1),
        ("score", 1700, (10 << 16 | 2) + 4),
        ("flag", 16, -1),
        ("at", 1184, -1),
        ("raw", 17, -1),
        ("feeling", facts["types"]["mood"], -1),
        ("n", facts["types"]["posint"], -1),
    ]
    assert relations[facts["relations"]["other.t_empty"]["oid"]].columns == ()
    # A user-defined enum is described by its own name; a domain by its own OID but the
    # namespace ('' = pg_catalog) and name of its base type.
    assert sorted(of(msgs, Type), key=lambda t: t.oid) == sorted(
        [
            Type(None, facts["types"]["mood"], "public", "mood"),
            Type(None, facts["types"]["posint"], "", "int4"),
        ],
        key=lambda t: t.oid,
    )


@pytest.mark.parametrize("capture", captures("dml"))
def test_dml_changes(capture: GoldenCapture) -> None:
    facts = capture.facts
    msgs = capture.messages()
    oid = {key: f["oid"] for key, f in facts["relations"].items()}
    changes = [m for _, m in msgs if isinstance(m, Insert | Update | Delete)]
    assert {b.xid for b in of(msgs, Begin)} == set(facts["xids"].values())

    def v(text: bytes, binary: bytes | None = None) -> ColumnValue:
        return value(capture, text, binary)

    def i(n: int) -> ColumnValue:
        return int4(capture, n)

    pg_ts = (1704164645 - 946684800) * 1_000_000  # 2024-01-02 03:04:05 UTC
    row1 = (
        i(1),
        v(b"alpha"),
        v(b"12.50", struct.pack("!hhHHhh", 2, 0, 0, 2, 12, 5000)),
        v(b"t", b"\x01"),
        v(b"2024-01-02 03:04:05+00", struct.pack("!q", pg_ts)),
        v(b"\\x00ff", b"\x00\xff"),
        v(b"happy"),
        i(7),
    )
    nulls7 = (NULL,) * 7
    assert changes == [
        Insert(None, oid["t_default"], row1),
        Insert(None, oid["t_default"], (i(2), *nulls7)),
        Update(None, oid["t_default"], None, None, (row1[0], v(b"beta"), *row1[2:])),
        Update(None, oid["t_default"], "K", (i(2), *nulls7), (i(10), *nulls7)),
        Delete(None, oid["t_default"], "K", (i(10), *nulls7)),
        Insert(None, oid["t_full"], (i(1), v(b"x"))),
        Insert(None, oid["t_full"], (i(2), NULL)),
        Update(None, oid["t_full"], "O", (i(1), v(b"x")), (i(1), v(b"y"))),
        Delete(None, oid["t_full"], "O", (i(2), NULL)),
        Insert(None, oid["t_index"], (i(1), v(b"k"), v(b"c1"))),
        Update(None, oid["t_index"], None, None, (i(1), v(b"k"), v(b"c2"))),
        Update(None, oid["t_index"], "K", (i(1), v(b"k"), NULL), (i(1), v(b"k2"), v(b"c2"))),
        Delete(None, oid["t_index"], "K", (i(1), v(b"k2"), NULL)),
        Insert(None, oid["t_nothing"], (i(1), v(b"v"))),
        Insert(None, oid["t_toast"], (i(1), v(b"x" * facts["toast_length"]), i(1))),
        Update(None, oid["t_toast"], None, None, (i(1), UNCHANGED_TOAST, i(2))),
        Insert(None, oid['"Wéird Name"'], (i(42), v(b""))),
        Insert(None, oid["other.t_empty"], ()),
    ]
    # REPLICA IDENTITY NOTHING: the source refuses updates and deletes of a published table.
    assert all(facts["nothing_refused"].values())


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize("capture", captures("messages"))
def test_logical_messages(capture: GoldenCapture) -> None:
    msgs = capture.messages()
    got = of(msgs, LogicalMessage)
    if capture.options.get("messages") != "true":
        assert got == []
        assert [m.new for m in of(msgs, Insert)] == [(Text(b"1"),)]
        return
    expected = capture.facts["messages"]
    assert [(m.transactional, m.prefix, m.content.hex(), m.xid) for m in got] == [
        (e["transactional"], e["prefix"], e["content"], None) for e in expected
    ]
    # Transactional messages come inside their transaction; the others outside any, xid 0.
    current: int | None = None
    for row, msg in msgs:
        if isinstance(msg, Begin):
            current = msg.xid
        elif isinstance(msg, Commit):
            current = None
        elif isinstance(msg, LogicalMessage):
            want = next(e for e in expected if e["prefix"] == msg.prefix)
            assert current == want["xid"]
            assert row.xid == (want["xid"] or 0)
            assert msg.lsn >= row.lsn


# ---------------------------------------------------------------- streaming


@pytest.mark.parametrize("capture", captures("stream"))
def test_streamed_transactions(capture: GoldenCapture) -> None:
    facts = capture.facts
    msgs = capture.messages()
    top, sub, committed, aborted = (
        facts["savepoint_xid"],
        facts["savepoint_subxid"],
        facts["commit_xid"],
        facts["abort_xid"],
    )
    starts = of(msgs, StreamStart)
    firsts = [s.xid for s in starts if s.first_segment]
    assert len(firsts) == len(set(firsts))
    # Decoding after the fact: PostgreSQL 17+ no longer streams a transaction it already
    # knows to be aborted, so the whole-transaction abort shows up on 15 only.
    if capture.version < 17:
        assert firsts == [committed, top, aborted]
    else:
        assert firsts == [committed, top]
    assert [(c.xid, c.flags) for c in of(msgs, StreamCommit)] == [(committed, 0), (top, 0)]
    parallel = capture.options["streaming"] == "parallel"
    aborts = of(msgs, StreamAbort)
    assert [(a.xid, a.subxid) for a in aborts] == [(top, sub)] + (
        [(aborted, aborted)] if capture.version < 17 else []
    )
    for row, msg in msgs:
        if isinstance(msg, StreamAbort):
            assert row.xid == msg.subxid  # the peek row of a subtransaction abort names the subxid
            if parallel:
                assert msg.abort_lsn == row.lsn
                assert msg.abort_ts is not None
                assert msg.abort_ts > 0
            else:
                assert (msg.abort_lsn, msg.abort_ts) == (None, None)
    # Inside a stream, changes carry the xid of the (sub)transaction that made them, not
    # the top-level xid of Stream Start.
    xid_of = {}
    for _, msg in msgs:
        if isinstance(msg, Insert):
            ident = msg.new[0]
            assert isinstance(ident, Text | Binary)
            key = int(ident.data) if isinstance(ident, Text) else struct.unpack("!i", ident.data)[0]
            xid_of[key] = msg.xid
    assert xid_of[1] == committed
    assert xid_of[100000] == top
    assert xid_of[200000] == sub
    assert xid_of[100001] not in (None, top, sub)  # ROLLBACK TO re-opens the savepoint: a new subxact
    in_stream_messages = of(msgs, LogicalMessage)
    if capture.options.get("messages") == "true":
        assert [(m.xid, m.transactional, m.prefix, m.content) for m in in_stream_messages] == [
            (committed, True, "golden-in-stream", b"m")
        ]
    else:
        assert in_stream_messages == []
    relations = of(msgs, Relation)
    assert {r.oid for r in relations} == {facts["relation_oid"]}
    assert all(r.xid is not None for r in relations)


# ---------------------------------------------------------------- two-phase commit


@pytest.mark.parametrize("capture", captures("twophase"))
def test_two_phase(capture: GoldenCapture) -> None:
    msgs = capture.messages()
    prepared = {p["gid"]: p for p in capture.facts["prepared"]}
    streaming = "streaming" in capture.options
    begins = {m.gid: m for m in of(msgs, BeginPrepare)}
    prepares = {m.gid: m for m in of(msgs, Prepare)}
    stream_prepares = {m.gid: m for m in of(msgs, StreamPrepare)}
    commits = {m.gid: m for m in of(msgs, CommitPrepared)}
    rollbacks = {m.gid: m for m in of(msgs, RollbackPrepared)}
    small = {"golden-gid-1", "golden-gid-2"}
    assert set(begins) == set(prepares) == (small if streaming else set(prepared))
    assert set(stream_prepares) == ({"golden-gid-big"} if streaming else set())
    assert set(commits) == {"golden-gid-1", "golden-gid-big"}
    assert set(rollbacks) == {"golden-gid-2"}
    for gid, fact in prepared.items():
        prep = prepares.get(gid) or stream_prepares[gid]
        assert prep.xid == fact["xid"]
        assert prep.flags == 0
        assert prep.end_lsn > prep.prepare_lsn
        if gid in begins:
            b = begins[gid]
            assert (b.xid, b.prepare_lsn, b.end_lsn, b.prepare_ts) == (
                fact["xid"],
                prep.prepare_lsn,
                prep.end_lsn,
                prep.prepare_ts,
            )
        if gid in commits:
            c = commits[gid]
            assert (c.xid, c.flags) == (fact["xid"], 0)
            assert c.commit_lsn == prep.end_lsn  # the COMMIT PREPARED record follows the PREPARE
            assert c.end_lsn > c.commit_lsn
            assert c.commit_ts >= prep.prepare_ts
        if gid in rollbacks:
            r = rollbacks[gid]
            assert (r.xid, r.prepare_end_lsn, r.prepare_ts) == (fact["xid"], prep.end_lsn, prep.prepare_ts)
            assert r.rollback_end_lsn > r.prepare_end_lsn
            assert r.rollback_ts >= r.prepare_ts
    if streaming:
        assert [s.xid for s in of(msgs, StreamStart) if s.first_segment] == [
            prepared["golden-gid-big"]["xid"]
        ]


# ---------------------------------------------------------------- origins


@pytest.mark.parametrize("capture", captures("origin"))
def test_origin(capture: GoldenCapture) -> None:
    facts = capture.facts
    msgs = capture.messages()
    begins = {b.xid: b for b in of(msgs, Begin)}
    if capture.options.get("origin") == "none":
        # origin=none drops transactions that came from a replication origin.
        assert of(msgs, Origin) == []
        assert set(begins) == {facts["local_xid"]}
        return
    assert set(begins) == {facts["origin_xid"], facts["local_xid"]}
    assert of(msgs, Origin) == [Origin(commit_lsn=facts["origin_lsn"], name=facts["origin_name"])]
    # The Origin message comes right after the Begin of the replayed transaction, whose
    # commit timestamp is the one set with pg_replication_origin_xact_setup.
    kinds = [type(m).__name__ for _, m in msgs]
    assert kinds[:2] == ["Begin", "Origin"]
    assert begins[facts["origin_xid"]].commit_ts == facts["origin_ts_pg_epoch_us"]
    assert begins[facts["local_xid"]].commit_ts > facts["origin_ts_pg_epoch_us"]


# ---------------------------------------------------------------- truncate


@pytest.mark.parametrize("capture", captures("truncate"))
def test_truncate(capture: GoldenCapture) -> None:
    facts = capture.facts
    msgs = capture.messages()
    truncates = of(msgs, Truncate)
    assert [(t.options, sorted(t.relation_oids)) for t in truncates] == [
        (f["options"], f["oids"]) for f in facts["truncates"]
    ]
    assert [(t.cascade, t.restart_identity) for t in truncates] == [
        (False, False),
        (True, False),
        (False, True),
        (True, True),
    ]
    oids = facts["oids"]
    # Tables reached only through CASCADE come after the ones named in the statement.
    assert truncates[-1].relation_oids[-1] == oids["tb"]
    # Each truncated relation is described (Relation message) before the Truncate.
    described: set[int] = set()
    for _, msg in msgs:
        if isinstance(msg, Relation):
            described.add(msg.oid)
        elif isinstance(msg, Truncate):
            assert set(msg.relation_oids) <= described


# ---------------------------------------------------------------- live server


def _peek(conn: psycopg.Connection[Any], slot: str, *options: str) -> list[tuple[int, bytes]]:
    args = "".join(", %s" for _ in options)
    rows = conn.execute(
        f"SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL{args})",
        (slot, *options),
    ).fetchall()
    return [(parse_lsn(lsn), bytes(data)) for lsn, data in rows]


def test_live_values_match_the_types_own_output(pgdb: str) -> None:
    """Decoded Text values equal the type's output function, Binary values its send function."""
    columns = {
        "id": ("int4", "int4out", "int4send"),
        "t": ("text", "textout", "textsend"),
        "n": ("numeric", "numeric_out", "numeric_send"),
        "f": ("float8", "float8out", "float8send"),
        "ts": ("timestamptz", "timestamptz_out", "timestamptz_send"),
        "d": ("date", "date_out", "date_send"),
        "j": ("jsonb", "jsonb_out", "jsonb_send"),
        "a": ("int8[]", "array_out", "array_send"),
        "u": ("uuid", "uuid_out", "uuid_send"),
        "bl": ("bool", "boolout", "boolsend"),
        "by": ("bytea", "byteaout", "byteasend"),
    }
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE v ("
            + ", ".join(f"{c} {t}" for c, (t, _, _) in columns.items())
            + ", PRIMARY KEY (id))"
        )
        conn.execute("CREATE PUBLICATION live_pub FOR TABLE v")
        conn.execute("SELECT pg_create_logical_replication_slot('live_slot', 'pgoutput')")
        conn.execute(
            """INSERT INTO v VALUES
            (1, 'héllo', 123456789.000123, -1.5e-300, '1999-12-31 23:59:59.999999+00', '0001-01-01',
             '{"k": [1, null]}', '{1,NULL,-9223372036854775808}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
             false, '\\x00'),
            (2, '', 'NaN', 'Infinity', 'infinity', '-infinity', 'null', '{}', NULL, NULL, '')"""
        )

        as_text = {
            r[0]: r
            for r in conn.execute(
                f"SELECT {', '.join(f'{out}({c})::text' for c, (_, out, _) in columns.items())} FROM v"
            )
        }
        as_binary = {
            r[0]: r
            for r in conn.execute(
                f"SELECT id, {', '.join(f'{send}({c})' for c, (_, _, send) in columns.items())} FROM v ORDER BY id"
            )
        }
        for binary in ("false", "true"):
            inserts = []
            for lsn, data in _peek(
                conn, "live_slot", "proto_version", "1", "publication_names", "live_pub", "binary", binary
            ):
                msg = parse_message(data, lsn=lsn)
                if isinstance(msg, Insert):
                    inserts.append(msg)
            assert len(inserts) == 2
            for msg in inserts:
                ident = msg.new[0]
                if binary == "true":
                    assert isinstance(ident, Binary)
                    key = struct.unpack("!i", ident.data)[0]
                    expected: tuple[ColumnValue, ...] = tuple(
                        NULL if b is None else Binary(bytes(b)) for b in as_binary[key][1:]
                    )
                else:
                    assert isinstance(ident, Text)
                    key = int(ident.data)
                    expected = tuple(NULL if t is None else Text(t.encode()) for t in as_text[str(key)])
                assert msg.new == expected
        conn.execute("SELECT pg_drop_replication_slot('live_slot')")
