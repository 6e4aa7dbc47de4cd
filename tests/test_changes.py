"""The window decoder against real PostgreSQL 15 and 18, and against bad bytes.

Two independent oracles check every decoded window:

* a reference decoder written here, message by message with :func:`pgoutput.parse_message`
  and the codecs' per-value reference path, which buffers transactions the way a
  subscriber does (stream segments, subtransaction aborts, prepared transactions) and
  yields the expected rows with their commit LSN, position, operation and TOAST names;
* state replay: the decoded changes, applied in (commit LSN, position) order to a dict
  per table, must equal ``SELECT * FROM`` the table at the end of the workload.

Every window is fed in chunks of 1 row, 7 rows and all rows; chunking must not change
the result.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import (
    LSN_COL,
    META_NAMES,
    OP_COL,
    POS_COL,
    TOAST_COL,
    TS_COL,
    XID_COL,
    DecodedChunk,
    RelationVersion,
    RowChunk,
    WindowDecoder,
)
from pg2delta.decode.typemap import KIND_BINARY, KIND_TEXT, codec_for
from pg2delta.errors import DecodeError

Rows = list[tuple[int, bytes]]
Key = tuple[Any, ...]
CHUNK_SIZES = (1, 7, None)


# --- reading a slot -----------------------------------------------------------------------


def create_slot(conn: psycopg.Connection[Any], slot: str, *, two_phase: bool = False) -> None:
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (slot, two_phase))


def peek(conn: psycopg.Connection[Any], slot: str, options: dict[str, str]) -> Rows:
    flat = [x for kv in options.items() for x in kv]
    rows = conn.execute(
        "SELECT (lsn - '0/0')::int8, data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, VARIADIC %s)",
        (slot, flat),
    ).fetchall()
    return [(int(lsn), bytes(data)) for lsn, data in rows]


def options(pub: str, proto: int, *, binary: bool = True, streaming: str | None = None, two_phase: bool = False) -> dict[str, str]:
    opts = {"proto_version": str(proto), "publication_names": pub, "binary": str(binary).lower(), "messages": "true"}
    if streaming:
        opts["streaming"] = streaming
    if two_phase:
        opts["two_phase"] = "true"
    return opts


def server_version(conn: psycopg.Connection[Any]) -> int:
    return int(conn.info.server_version) // 10000


# --- what the decoder produced, flattened -------------------------------------------------


@dataclass(frozen=True)
class Change:
    lsn: int
    pos: int
    table: str
    op: str
    values: tuple[tuple[str, Any], ...]
    toast: tuple[str, ...] | None
    xid: int | None

    @property
    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)


@dataclass
class Decoded:
    changes: list[Change]
    truncates: list[tuple[int, int, tuple[str, ...]]]
    messages: list[tuple[int | None, int, str, bytes]]
    versions: dict[str, set[tuple[str, ...]]]  # table -> column name tuples seen
    keys: dict[str, tuple[str, ...]]  # table -> key names of its latest version
    transactions: int
    notes: dict[str, int]


def flatten(chunks: Sequence[DecodedChunk]) -> Decoded:
    changes: list[Change] = []
    truncates: list[tuple[int, int, tuple[str, ...]]] = []
    messages: list[tuple[int | None, int, str, bytes]] = []
    versions: dict[str, set[tuple[str, ...]]] = {}
    keys: dict[str, tuple[str, ...]] = {}
    latest: dict[str, int] = {}
    notes: dict[str, int] = {}
    transactions = 0
    for chunk in chunks:
        transactions += chunk.transactions
        for k, v in chunk.notes.items():
            notes[k] = notes.get(k, 0) + v
        per_table_last: dict[str, tuple[int, int]] = {}
        for cb in chunk.changes:
            rel: RelationVersion = cb.relation
            assert cb.batch.schema == rel.schema
            name = rel.relation.name
            versions.setdefault(name, set()).add(rel.column_names)
            if rel.version >= latest.get(name, -1):
                latest[name], keys[name] = rel.version, rel.key_names
            for row in cb.batch.to_pylist():
                lsn, pos = row[LSN_COL], row[POS_COL]
                # Batches of one table come in commit order, and so do their rows.
                assert (lsn, pos) > per_table_last.get(name, (-1, -1))
                per_table_last[name] = (lsn, pos)
                assert row[TS_COL] is not None
                toast = row[TOAST_COL]
                values = tuple((k, v) for k, v in row.items() if k not in META_NAMES)
                changes.append(Change(lsn, pos, name, row[OP_COL], values, tuple(toast) if toast else None, row[XID_COL]))
        for t in chunk.truncates:
            truncates.append((t.commit_lsn, t.pos, tuple(sorted(v.relation.name for v in t.relations))))
        for m in chunk.messages:
            messages.append((m.commit_lsn, m.pos, m.message.prefix, m.message.content))
    changes.sort(key=lambda c: (c.lsn, c.pos))
    messages.sort(key=lambda m: (-1 if m[0] is None else m[0], m[1]))
    return Decoded(changes, truncates, messages, versions, keys, transactions, notes)


def decode(
    rows: Rows,
    chunk: int | None,
    resolver: Callable[[po.Relation], Sequence[str] | None] | None = None,
    split_rows: int | None = None,
) -> Decoded:
    dec = WindowDecoder(None, resolver, split_rows=split_rows)
    size = chunk or max(len(rows), 1)
    out = [dec.feed(RowChunk.from_messages(rows[i : i + size])) for i in range(0, len(rows), size)]
    out.append(dec.finish())
    return flatten(out)


# --- the reference decoder ---------------------------------------------------------------


def _value(rel: po.Relation, c: int, v: po.ColumnValue) -> Any:
    if isinstance(v, po.Text | po.Binary):
        codec = codec_for(rel.columns[c].type_oid, rel.columns[c].type_modifier)
        kind = KIND_TEXT if isinstance(v, po.Text) else KIND_BINARY
        arr = codec.decode(v.data, np.array([0]), np.array([len(v.data)]), np.array([kind], dtype=np.uint8), reference=True)
        return arr.to_pylist()[0]
    return None


def _raw(v: po.ColumnValue) -> Any:
    return (type(v).__name__, v.data) if isinstance(v, po.Text | po.Binary) else v


def reference(rows: Rows, resolver: Callable[[po.Relation], Sequence[str] | None] | None = None) -> Decoded:
    rels: dict[int, po.Relation] = {}
    changes: list[Change] = []
    truncates: list[tuple[int, int, tuple[str, ...]]] = []
    messages: list[tuple[int | None, int, str, bytes]] = []
    plain: tuple[list[po.Message], int | None] | None = None
    streams: dict[int, list[po.Message]] = {}
    prepared: dict[str, list[po.Message]] = {}
    segment: int | None = None
    transactions = 0

    def key_idx(rel: po.Relation) -> list[int]:
        names = resolver(rel) if resolver else None
        if names is None:
            return [i for i, c in enumerate(rel.columns) if c.is_key]
        return [[c.name for c in rel.columns].index(n) for n in names]

    def apply(msgs: list[po.Message], commit_lsn: int, xid: int | None) -> None:
        nonlocal transactions
        transactions += 1
        pos = 0
        for m in msgs:
            if isinstance(m, po.Relation):
                rels[m.oid] = m
                continue
            if isinstance(m, po.Type):
                continue
            if isinstance(m, po.Truncate):
                truncates.append((commit_lsn, 2 * pos + 1, tuple(sorted(rels[o].name for o in m.relation_oids))))
            elif isinstance(m, po.LogicalMessage):
                messages.append((commit_lsn, 2 * pos + 1, m.prefix, m.content))
            elif isinstance(m, po.Insert | po.Update | po.Delete):
                rel = rels[m.relation_oid]
                names = [c.name for c in rel.columns]

                def row(t: po.TupleData, op: str, p: int, rel: po.Relation = rel, names: list[str] = names) -> Change:
                    vals = tuple((names[c], _value(rel, c, v)) for c, v in enumerate(t))
                    toast = tuple(names[c] for c, v in enumerate(t) if v is po.UNCHANGED_TOAST) if op != "D" else ()
                    return Change(commit_lsn, p, rel.name, op, vals, toast or None, xid)

                if isinstance(m, po.Insert):
                    changes.append(row(m.new, "I", 2 * pos + 1))
                elif isinstance(m, po.Delete):
                    changes.append(row(m.old, "D", 2 * pos + 1))
                else:
                    new = list(m.new)
                    if m.old is not None:
                        if any(
                            m.new[c] is not po.UNCHANGED_TOAST and _raw(m.old[c]) != _raw(m.new[c])
                            for c in key_idx(rel)
                        ):
                            changes.append(row(m.old, "D", 2 * pos))
                        if m.old_kind == "O":
                            # REPLICA IDENTITY FULL: the old tuple holds what the new one left out.
                            new = [o if n is po.UNCHANGED_TOAST and isinstance(o, po.Text | po.Binary) else n for o, n in zip(m.old, m.new, strict=True)]
                    changes.append(row(tuple(new), "U", 2 * pos + 1))
            else:  # pragma: no cover - the reference buffers only the kinds above
                raise AssertionError(m)
            pos += 1

    for lsn, data in rows:
        msg = po.parse_message(data, in_stream=segment is not None, lsn=lsn)
        if isinstance(msg, po.Begin | po.BeginPrepare):
            plain = ([], msg.xid)
        elif isinstance(msg, po.Commit):
            assert plain is not None
            apply(plain[0], msg.commit_lsn, plain[1])
            plain = None
        elif isinstance(msg, po.Prepare):
            assert plain is not None
            prepared[msg.gid] = plain[0]
            plain = None
        elif isinstance(msg, po.CommitPrepared):
            apply(prepared.pop(msg.gid), msg.commit_lsn, msg.xid)
        elif isinstance(msg, po.RollbackPrepared):
            prepared.pop(msg.gid, None)
        elif isinstance(msg, po.StreamStart):
            segment = msg.xid
            streams.setdefault(msg.xid, [])
        elif isinstance(msg, po.StreamStop):
            segment = None
        elif isinstance(msg, po.StreamCommit):
            apply(streams.pop(msg.xid), msg.commit_lsn, msg.xid)
        elif isinstance(msg, po.StreamPrepare):
            prepared[msg.gid] = streams.pop(msg.xid)
        elif isinstance(msg, po.StreamAbort):
            if msg.subxid == msg.xid:
                streams.pop(msg.xid, None)
            else:
                buffered = streams.get(msg.xid, [])
                first = next((i for i, m in enumerate(buffered) if getattr(m, "xid", None) == msg.subxid), None)
                if first is not None:
                    del buffered[first:]
        elif isinstance(msg, po.LogicalMessage) and not msg.transactional:
            messages.append((None, 0, msg.prefix, msg.content))
        elif isinstance(msg, po.Origin):
            pass
        elif segment is not None:
            streams[segment].append(msg)
        else:
            assert plain is not None, msg
            plain[0].append(msg)
    changes.sort(key=lambda c: (c.lsn, c.pos))
    messages.sort(key=lambda m: (-1 if m[0] is None else m[0], m[1]))
    return Decoded(changes, truncates, messages, {}, {}, transactions, {})


# --- state replay -------------------------------------------------------------------------


def replay(decoded: Decoded, key_names: dict[str, Sequence[str]]) -> dict[str, dict[Key, dict[str, Any]]]:
    """Apply every decoded change and truncate in commit order to a dict per table."""
    state: dict[str, dict[Key, dict[str, Any]]] = {}
    events: list[tuple[int, int, Change | tuple[str, ...]]] = [(c.lsn, c.pos, c) for c in decoded.changes]
    events += [(lsn, pos, names) for lsn, pos, names in decoded.truncates]
    events.sort(key=lambda e: (e[0], e[1]))
    assert len({(e[0], e[1]) for e in events}) == len(events), "two events share a commit LSN and position"
    moved: tuple[int, int, dict[str, Any]] | None = None  # row an old-key delete took away
    for lsn, pos, ev in events:
        if not isinstance(ev, Change):
            for name in ev:
                state[name] = {}
            continue
        table = state.setdefault(ev.table, {})
        row = ev.as_dict
        key = tuple(row[k] for k in key_names[ev.table])
        if ev.op == "D":
            old = table.pop(key)
            moved = (lsn, pos, old) if pos % 2 == 0 else None
        elif ev.op == "I":
            assert key not in table
            table[key] = row
        else:
            before = moved[2] if moved is not None and moved[:2] == (lsn, pos - 1) else table[key]
            for col in ev.toast or ():
                row[col] = before[col]
            table[key] = row
    return state


def table_state(conn: psycopg.Connection[Any], table: str, key: Sequence[str]) -> dict[Key, dict[str, Any]]:
    cur = conn.execute(f'SELECT * FROM "{table}"')
    names = [d.name for d in cur.description or ()]
    out = {}
    for r in cur.fetchall():
        row = dict(zip(names, r, strict=True))
        out[tuple(row[k] for k in key)] = row
    return out


def normalise(state: dict[Key, dict[str, Any]], columns: Sequence[str]) -> dict[Key, dict[str, Any]]:
    """Rows decoded before an ADD COLUMN lack the column; PostgreSQL shows it as NULL."""
    return {k: {c: row.get(c) for c in columns} for k, row in state.items()}


def check_window(
    conn: psycopg.Connection[Any],
    rows: Rows,
    tables: dict[str, Sequence[str]],
    resolver: Callable[[po.Relation], Sequence[str] | None] | None = None,
) -> Decoded:
    """Decode ``rows`` in several chunkings; each must equal the reference and replay to the tables."""
    assert rows, "the window is empty"
    ref = reference(rows, resolver)
    first: Decoded | None = None
    for size in CHUNK_SIZES:
        got = decode(rows, size, resolver)
        assert got.changes == ref.changes, f"chunk size {size}"
        assert got.truncates == ref.truncates, f"chunk size {size}"
        assert got.messages == ref.messages, f"chunk size {size}"
        assert got.transactions == ref.transactions, f"chunk size {size}"
        if first is None:
            first = got
    # Transactions larger than a few rows given out in parts as they arrive: the same changes.
    for size, split in ((1, 1), (3, 2), (7, 5)):
        got = decode(rows, size, resolver, split_rows=split)
        assert got.changes == ref.changes, f"chunk size {size}, split at {split}"
        assert got.truncates == ref.truncates, f"chunk size {size}, split at {split}"
        assert got.messages == ref.messages, f"chunk size {size}, split at {split}"
        assert got.transactions == ref.transactions, f"chunk size {size}, split at {split}"
    assert first is not None
    state = replay(first, tables)
    for table, key in tables.items():
        want = table_state(conn, table, key)
        cols = list(next(iter(want.values())).keys()) if want else []
        assert normalise(state.get(table, {}), cols) == want, table
    return first


# --- workloads ----------------------------------------------------------------------------

BIG = "(SELECT string_agg(md5(random()::text || g::text), '') FROM generate_series(1, 400) g)"


@pytest.fixture
def conns(pgdb: str) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:
    a = psycopg.connect(pgdb, autocommit=True)
    b = psycopg.connect(pgdb, autocommit=True)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def setup_tables(conn: psycopg.Connection[Any], slot: str, *, two_phase: bool = False) -> None:
    conn.execute(
        "CREATE TABLE t1 (id int PRIMARY KEY, a text, n numeric(12,2), b bytea, ts timestamptz, big text)"
    )
    conn.execute("CREATE TABLE t2 (k1 int, k2 text, v int, big text, PRIMARY KEY (k1, k2))")
    conn.execute("ALTER TABLE t2 REPLICA IDENTITY FULL")
    conn.execute("CREATE PUBLICATION pub FOR TABLE t1, t2")
    create_slot(conn, slot, two_phase=two_phase)


TABLE_KEYS: dict[str, Sequence[str]] = {"t1": ["id"], "t2": ["k1", "k2"]}


def full_pk(rel: po.Relation) -> Sequence[str] | None:
    """The job's key resolver in small: the primary key for REPLICA IDENTITY FULL tables.

    A table it does not know (a damaged name, in the mutation property) keeps its flagged columns.
    """
    return TABLE_KEYS.get(rel.name) if rel.replica_identity == "f" else None


def plain_workload(a: psycopg.Connection[Any], b: psycopg.Connection[Any]) -> None:
    a.execute(
        f"INSERT INTO t1 SELECT g, 'a' || g, g * 1.25, '\\x00ff'::bytea, '2024-01-02 03:04:05.678+00', "
        f"CASE WHEN g % 3 = 0 THEN {BIG} END FROM generate_series(1, 30) g"
    )
    a.execute(f"INSERT INTO t2 SELECT g, 'k' || g, g, {BIG} FROM generate_series(1, 10) g")
    # Interleaved: b starts after a but commits first.
    a.execute("BEGIN")
    a.execute("UPDATE t1 SET a = 'from a' WHERE id = 1")
    b.execute("BEGIN")
    b.execute("UPDATE t1 SET a = 'from b' WHERE id = 2")
    b.execute("INSERT INTO t1 (id, a) VALUES (100, 'b')")
    b.execute("COMMIT")
    a.execute("INSERT INTO t1 (id, a) VALUES (101, 'a')")
    a.execute("COMMIT")
    # Rolled back: never decoded.
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) VALUES (200, 'rolled back')")
    a.execute("ROLLBACK")
    # Unchanged TOAST (t1 default identity; t2 FULL, where the old tuple has the value).
    a.execute("UPDATE t1 SET a = 'toast kept' WHERE id IN (3, 6)")
    a.execute("UPDATE t2 SET v = v + 100 WHERE k1 <= 3")
    # Primary key changes, a chain 9 -> 50 -> 51, and one on a TOASTed row.
    a.execute("BEGIN")
    a.execute("UPDATE t1 SET id = 50 WHERE id = 9")
    a.execute("UPDATE t1 SET id = 51, a = 'moved twice' WHERE id = 50")
    a.execute("UPDATE t1 SET id = id + 1000 WHERE id = 12")
    a.execute("UPDATE t2 SET k2 = 'moved' WHERE k1 = 4")
    a.execute("COMMIT")
    # Delete then re-insert the same key in one transaction; and a savepoint rolled back.
    a.execute("BEGIN")
    a.execute("DELETE FROM t1 WHERE id = 4")
    a.execute("INSERT INTO t1 (id, a) VALUES (4, 'again')")
    a.execute("SAVEPOINT s")
    a.execute("DELETE FROM t1 WHERE id = 5")
    a.execute("ROLLBACK TO SAVEPOINT s")
    a.execute("DELETE FROM t2 WHERE k1 = 5")
    a.execute("COMMIT")
    # Logical messages, transactional and not, around a truncate in the middle of a transaction.
    a.execute("SELECT pg_logical_emit_message(false, 'nontx', 'hello')")
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) VALUES (300, 'before truncate')")
    a.execute("SELECT pg_logical_emit_message(true, 'tx', '\\x0001'::bytea)")
    a.execute("TRUNCATE t1")
    a.execute("INSERT INTO t1 (id, a) VALUES (301, 'after truncate')")
    a.execute("COMMIT")
    a.execute(f"INSERT INTO t1 SELECT g, 'refill', NULL, NULL, NULL, {BIG} FROM generate_series(400, 405) g")
    a.execute("UPDATE t1 SET a = 'refill toast' WHERE id = 401")
    # A new column in the middle of the window: a second relation version.
    a.execute("ALTER TABLE t1 ADD COLUMN extra int")
    a.execute("INSERT INTO t1 (id, a, extra) VALUES (500, 'new shape', 7)")
    a.execute("UPDATE t1 SET extra = 8, a = 'new shape toast' WHERE id = 402")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "text"])
def test_plain_transactions(conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]], binary: bool) -> None:
    a, b = conns
    setup_tables(a, "plain_slot")
    plain_workload(a, b)
    rows = peek(a, "plain_slot", options("pub", 1, binary=binary))
    got = check_window(a, rows, TABLE_KEYS, full_pk)
    assert len(got.versions["t1"]) == 2  # before and after ADD COLUMN
    assert got.keys == {"t1": ("id",), "t2": ("k1", "k2")}
    ops = [(c.table, c.op, c.pos % 2) for c in got.changes]
    assert ("t1", "D", 0) in ops and ("t2", "D", 0) in ops  # old-key deletes
    assert any(c.toast == ("big",) and c.table == "t1" for c in got.changes)
    # FULL identity: the unchanged TOAST value came from the old tuple, nothing left to resolve.
    assert not any(c.toast for c in got.changes if c.table == "t2")
    assert [m[2] for m in got.messages] == ["nontx", "tx"]
    assert got.messages[0][:2] == (None, 0)
    (trunc,) = got.truncates
    lsn, pos, names = trunc
    assert names == ("t1",)
    assert [(c.op, c.pos) for c in got.changes if c.lsn == lsn] == [("I", 1), ("I", pos + 2)]
    assert got.notes.get("incomplete_transaction_rows", 0) == 0


def test_proto2_plain_equals_proto1(conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    a, b = conns
    setup_tables(a, "p2_slot")
    plain_workload(a, b)
    v1 = decode(peek(a, "p2_slot", options("pub", 1)), None, full_pk)
    v2 = decode(peek(a, "p2_slot", options("pub", 2, streaming="true")), None, full_pk)
    assert v1.changes == v2.changes and v1.truncates == v2.truncates and v1.messages == v2.messages


def stream_workload(a: psycopg.Connection[Any], b: psycopg.Connection[Any]) -> None:
    a.execute(f"INSERT INTO t1 (id, a, big) SELECT g, 'seed', {BIG} FROM generate_series(1, 5) g")
    # A large transaction (streamed: logical_decoding_work_mem is 64kB) with a concurrent
    # small one committing in its middle, a savepoint rolled back after it was streamed,
    # key changes and unchanged TOAST.
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('x', 50) FROM generate_series(1000, 1999) g")
    b.execute("INSERT INTO t1 (id, a) VALUES (10, 'small, commits first')")
    a.execute("SAVEPOINT s1")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('y', 50) FROM generate_series(2000, 2999) g")
    a.execute("UPDATE t1 SET a = 'in s1' WHERE id = 1")
    a.execute("ROLLBACK TO SAVEPOINT s1")
    a.execute("SAVEPOINT s2")
    a.execute("UPDATE t1 SET a = 'kept from s2' WHERE id = 2")
    a.execute("RELEASE SAVEPOINT s2")
    a.execute("UPDATE t1 SET id = 7000 WHERE id = 3")
    a.execute("SELECT pg_logical_emit_message(true, 'streamed', 'm')")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('z', 50) FROM generate_series(3000, 3999) g")
    b.execute("UPDATE t1 SET a = 'small again' WHERE id = 10")
    a.execute("SAVEPOINT s3")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('w', 50) FROM generate_series(4000, 4999) g")
    a.execute("SAVEPOINT s4")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('v', 50) FROM generate_series(5000, 5999) g")
    a.execute("ROLLBACK TO SAVEPOINT s3")
    a.execute("DELETE FROM t1 WHERE id BETWEEN 1000 AND 1100")
    a.execute("COMMIT")
    # A large transaction aborted entirely.
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('q', 50) FROM generate_series(8000, 9999) g")
    b.execute("INSERT INTO t1 (id, a) VALUES (11, 'between')")
    a.execute("ROLLBACK")
    a.execute("UPDATE t1 SET a = 'after abort' WHERE id = 4")


def _streaming_modes() -> list[tuple[int, str]]:
    return [(2, "true"), (4, "parallel")]


@pytest.mark.parametrize("proto,streaming", _streaming_modes(), ids=["v2-on", "v4-parallel"])
def test_streamed_transactions(
    conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]], proto: int, streaming: str
) -> None:
    a, b = conns
    if proto == 4 and server_version(a) < 16:
        pytest.skip("protocol 4 needs PostgreSQL 16")
    setup_tables(a, "stream_slot")
    stream_workload(a, b)
    rows = peek(a, "stream_slot", options("pub", proto, streaming=streaming))
    tags = [data[0] for _, data in rows]
    assert po.STREAM_START in tags and po.STREAM_COMMIT in tags
    aborts = [po.parse_message(d) for _, d in rows if d[0] == po.STREAM_ABORT]
    assert any(isinstance(m, po.StreamAbort) and m.subxid != m.xid for m in aborts)
    if server_version(a) < 17:
        # From 17 on, a transaction already known to have aborted is not streamed at all.
        assert any(isinstance(m, po.StreamAbort) and m.subxid == m.xid for m in aborts)
    got = check_window(a, rows, TABLE_KEYS, full_pk)
    # Commit order differs from start order: the small transaction comes before the big one.
    small = next(c for c in got.changes if c.as_dict["id"] == 10)
    big = next(c for c in got.changes if c.as_dict["id"] == 1000)
    assert small.lsn < big.lsn
    assert got.notes.get("streamed_aborts", 0) >= len(aborts) >= 1


def test_two_phase(conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    a, b = conns
    setup_tables(a, "tp_slot", two_phase=True)
    a.execute(f"INSERT INTO t1 (id, a, big) SELECT g, 'seed', {BIG} FROM generate_series(1, 5) g")
    # Two prepared transactions open at once, committed in the other order, with a plain
    # transaction in between; one prepared and rolled back; one large (stream prepare).
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) VALUES (10, 'gid a')")
    a.execute("UPDATE t1 SET a = 'gid a toast' WHERE id = 1")
    a.execute("PREPARE TRANSACTION 'gid_a'")
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) VALUES (11, 'gid b')")
    a.execute("UPDATE t1 SET id = 12 WHERE id = 2")
    a.execute("PREPARE TRANSACTION 'gid_b'")
    b.execute("INSERT INTO t1 (id, a) VALUES (20, 'plain')")
    a.execute("COMMIT PREPARED 'gid_b'")
    b.execute("INSERT INTO t1 (id, a) VALUES (21, 'plain 2')")
    a.execute("COMMIT PREPARED 'gid_a'")
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) VALUES (30, 'rolled back')")
    a.execute("PREPARE TRANSACTION 'gid_c'")
    a.execute("ROLLBACK PREPARED 'gid_c'")
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('x', 50) FROM generate_series(1000, 2999) g")
    a.execute("SAVEPOINT s")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('y', 50) FROM generate_series(3000, 3999) g")
    a.execute("ROLLBACK TO SAVEPOINT s")
    a.execute("PREPARE TRANSACTION 'gid_big'")
    a.execute("COMMIT PREPARED 'gid_big'")
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('x', 50) FROM generate_series(5000, 6999) g")
    a.execute("PREPARE TRANSACTION 'gid_big_rb'")
    a.execute("ROLLBACK PREPARED 'gid_big_rb'")
    for proto_opts in (options("pub", 3, two_phase=True), options("pub", 3, two_phase=True, streaming="true")):
        rows = peek(a, "tp_slot", proto_opts)
        tags = {data[0] for _, data in rows}
        assert {po.BEGIN_PREPARE, po.PREPARE, po.COMMIT_PREPARED, po.ROLLBACK_PREPARED} <= tags
        if "streaming" in proto_opts:
            assert po.STREAM_PREPARE in tags
        got = check_window(a, rows, TABLE_KEYS, full_pk)
        order = [c.as_dict["id"] for c in got.changes if c.op == "I" and c.as_dict["id"] in (10, 11, 20, 21)]
        assert order == [20, 11, 21, 10]  # commit order


def test_prepared_open_at_window_end(conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """A transaction prepared but not committed holds nothing back: later commits decode."""
    a, b = conns
    setup_tables(a, "open_slot", two_phase=True)
    try:
        a.execute("BEGIN")
        a.execute("INSERT INTO t1 (id, a) VALUES (1, 'prepared')")
        a.execute("PREPARE TRANSACTION 'open_gid'")
        b.execute("INSERT INTO t1 (id, a) VALUES (2, 'committed')")
        rows = peek(a, "open_slot", options("pub", 3, two_phase=True))
        for size in CHUNK_SIZES:
            got = decode(rows, size)
            assert [c.as_dict["id"] for c in got.changes] == [2], size
            assert got.notes.get("prepared_not_committed_in_window", 0) == 1
    finally:
        a.execute("ROLLBACK PREPARED 'open_gid'")


def test_stream_open_at_window_end(conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    """A streamed transaction still open at the end of the window: the ones committed meanwhile decode."""
    a, b = conns
    setup_tables(a, "sopen_slot")
    a.execute("BEGIN")
    a.execute("INSERT INTO t1 (id, a) SELECT g, repeat('x', 50) FROM generate_series(1000, 2999) g")
    b.execute("INSERT INTO t1 (id, a) VALUES (1, 'committed meanwhile')")
    try:
        rows = peek(b, "sopen_slot", options("pub", 2, streaming="true"))
        assert rows[0][1][0] == po.STREAM_START
        for size in CHUNK_SIZES:
            got = decode(rows, size)
            assert [c.as_dict["id"] for c in got.changes] == [1], size
            assert got.notes.get("incomplete_transaction_rows", 0) > 0
    finally:
        a.execute("ROLLBACK")


# --- bad bytes ----------------------------------------------------------------------------


def _captured(conn: psycopg.Connection[Any], b: psycopg.Connection[Any]) -> Rows:
    setup_tables(conn, "bad_slot")
    plain_workload(conn, b)
    return peek(conn, "bad_slot", options("pub", 1))


def _expect_decode_error(rows: Rows, lsn: int | None = None) -> DecodeError | None:
    try:
        for size in (1, None):
            decode(rows, size, full_pk)
    except DecodeError as exc:
        if lsn is not None:
            assert exc.lsn == lsn, str(exc)
        return exc
    return None


def test_corrupt_messages(conns: tuple[psycopg.Connection[Any], psycopg.Connection[Any]]) -> None:
    a, b = conns
    rows = _captured(a, b)
    idx = {tag: next(i for i, (_, d) in enumerate(rows) if d[0] == tag) for tag in (po.INSERT, po.UPDATE, po.DELETE)}
    cases: list[tuple[str, int, bytes]] = []
    for tag, i in idx.items():
        data = rows[i][1]
        cases += [
            (f"{chr(tag)} truncated", i, data[:-1]),
            (f"{chr(tag)} cut after oid", i, data[:5]),
            (f"{chr(tag)} cut in tag", i, data[:1]),
            (f"{chr(tag)} trailing byte", i, data + b"\0"),
            (f"{chr(tag)} column count + 1", i, data[:6] + (int.from_bytes(data[6:8], "big") + 1).to_bytes(2, "big") + data[8:]),
            (f"{chr(tag)} bad marker", i, data[:5] + b"X" + data[6:]),
            (f"{chr(tag)} undescribed relation", i, data[:1] + b"\xff\xff\xff\xf0" + data[5:]),
        ]
        # A length field past the end: the first text/binary column's length.
        at = data.find(b"b", 8) if data.find(b"b", 8) > 0 else data.find(b"t", 8)
        if at > 0:
            cases.append((f"{chr(tag)} length past the end", i, data[: at + 1] + b"\x7f\xff\xff\xff" + data[at + 5 :]))
    begin = next(i for i, (_, d) in enumerate(rows) if d[0] == po.BEGIN)
    commit = next(i for i, (_, d) in enumerate(rows) if d[0] == po.COMMIT)
    rel = next(i for i, (_, d) in enumerate(rows) if d[0] == po.RELATION)
    cases += [
        ("begin truncated", begin, rows[begin][1][:5]),
        ("commit truncated", commit, rows[commit][1][:-2]),
        ("relation truncated", rel, rows[rel][1][:-3]),
        ("commit flipped to Z", commit, b"Z" + rows[commit][1][1:]),
        ("empty message", commit, b""),
    ]
    for what, i, data in cases:
        bad = list(rows)
        bad[i] = (rows[i][0], data)
        err = _expect_decode_error(bad, rows[i][0])
        assert err is not None, what
    # A change outside any transaction, and a Relation message dropped.
    stray = [*rows[:begin], rows[idx[po.INSERT]], *rows[begin:]]
    assert _expect_decode_error(stray, rows[idx[po.INSERT]][0]) is not None
    no_rel = [r for j, r in enumerate(rows) if j != rel]
    assert _expect_decode_error(no_rel) is not None


@pytest.fixture(scope="module")
def captured_rows(pg_server: Any) -> Rows:
    """One real window, captured once for the mutation property below."""
    import uuid

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        with psycopg.connect(pg_server.dsn_for(name), autocommit=True) as a, psycopg.connect(
            pg_server.dsn_for(name), autocommit=True
        ) as b:
            rows = _captured(a, b)
            a.execute("SELECT pg_drop_replication_slot('bad_slot')")
            return rows
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


_MUTATIONS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "insert", "delete", "set_kind", "drop_row", "dup_row"]),
        st.integers(min_value=0, max_value=10**9),
        st.integers(min_value=0, max_value=10**9),
        st.integers(min_value=0, max_value=255),
    ),
    min_size=1,
    max_size=4,
)


def _mutate(rows: Rows, mutations: list[tuple[str, int, int, int]]) -> Rows:
    out = list(rows)
    for kind, r, off, byte in mutations:
        i = r % len(out)
        lsn, data = out[i]
        j = off % max(len(data), 1)
        if kind == "flip":
            data = data[:j] + bytes([byte]) + data[j + 1 :]
        elif kind == "truncate":
            data = data[:j]
        elif kind == "insert":
            data = data[:j] + bytes([byte]) + data[j:]
        elif kind == "delete":
            data = data[:j] + data[j + 1 :]
        elif kind == "set_kind":
            data = bytes([byte]) + data[1:]
        elif kind == "drop_row":
            del out[i]
            if not out:
                return rows[:1]
            continue
        else:
            out.insert(i, (lsn, data))
            continue
        out[i] = (lsn, data)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], print_blob=True)
@given(mutations=_MUTATIONS, chunk=st.sampled_from([1, 3, 1000]))
def test_mutated_windows_raise_only_decode_error(captured_rows: Rows, mutations: list[tuple[str, int, int, int]], chunk: int) -> None:
    rows = _mutate(captured_rows, mutations)
    lsns = {lsn for lsn, _ in rows}
    try:
        got = decode(rows, chunk, full_pk)
    except DecodeError as exc:
        assert exc.lsn is None or exc.lsn in lsns
        assert exc.lsn is not None, str(exc)
        return
    # Decoded without complaint: still well formed.
    assert all(c.op in ("I", "U", "D") for c in got.changes)


# --- unit checks without a server ---------------------------------------------------------


def _rel(oid: int = 16384, cols: Sequence[tuple[str, int, int]] = (("id", 23, 1), ("v", 25, 0))) -> bytes:
    out = bytearray(b"R" + oid.to_bytes(4, "big") + b"public\0t\0" + b"d" + len(cols).to_bytes(2, "big"))
    for name, typ, flags in cols:
        out += bytes([flags]) + name.encode() + b"\0" + typ.to_bytes(4, "big") + (-1).to_bytes(4, "big", signed=True)
    return bytes(out)


def _tuple(*vals: bytes | str | None) -> bytes:
    out = bytearray(len(vals).to_bytes(2, "big"))
    for v in vals:
        if v is None:
            out += b"n"
        elif v == "u":
            out += b"u"
        else:
            assert isinstance(v, bytes)
            out += b"t" + len(v).to_bytes(4, "big") + v
    return bytes(out)


def _begin(lsn: int, xid: int) -> bytes:
    return b"B" + lsn.to_bytes(8, "big") + (0).to_bytes(8, "big") + xid.to_bytes(4, "big")


def _commit(lsn: int) -> bytes:
    return b"C\0" + lsn.to_bytes(8, "big") + (lsn + 8).to_bytes(8, "big") + (0).to_bytes(8, "big")


def test_hand_built_key_change_and_toast_names() -> None:
    rows: Rows = [
        (1, _begin(100, 7)),
        (2, _rel()),
        (3, b"I" + (16384).to_bytes(4, "big") + b"N" + _tuple(b"1", b"x")),
        (4, b"U" + (16384).to_bytes(4, "big") + b"K" + _tuple(b"1", None) + b"N" + _tuple(b"2", "u")),
        (5, b"U" + (16384).to_bytes(4, "big") + b"N" + _tuple(b"2", b"y")),
        (6, b"D" + (16384).to_bytes(4, "big") + b"K" + _tuple(b"2", None)),
        (7, _commit(100)),
    ]
    for size in CHUNK_SIZES:
        got = decode(rows, size)
        assert [(c.op, c.pos, c.as_dict["id"], c.toast) for c in got.changes] == [
            ("I", 1, 1, None),
            ("D", 2, 1, None),
            ("U", 3, 2, ("v",)),
            ("U", 5, 2, None),
            ("D", 7, 2, None),
        ]
        assert got.changes == reference(rows).changes


def test_random_chunking_is_invisible() -> None:
    rng = random.Random(1234)
    rows: Rows = []
    lsn = 0
    for t in range(30):
        lsn += 10
        rows.append((lsn, _begin(lsn + 5, t + 1)))
        if t == 0:
            rows.append((lsn, _rel()))
        for k in range(rng.randrange(0, 5)):
            rows.append((lsn, b"I" + (16384).to_bytes(4, "big") + b"N" + _tuple(str(t * 10 + k).encode(), b"v")))
        rows.append((lsn + 5, _commit(lsn + 5)))
    whole = decode(rows, None)
    assert whole.changes == reference(rows).changes
    for n in range(20):
        dec = WindowDecoder(split_rows=None if n % 2 else rng.randrange(1, 4))
        out = []
        i = 0
        while i < len(rows):
            j = i + rng.randrange(1, 9)
            out.append(dec.feed(RowChunk.from_messages(rows[i:j])))
            i = j
        out.append(dec.finish())
        assert flatten(out).changes == whole.changes


def test_commit_timestamp_the_lake_cannot_hold_is_a_decode_error() -> None:
    """Found by the mutation property: a damaged Commit timestamp used to reach the batches."""
    far = (300_000_000_000_000_000).to_bytes(8, "big")  # about year 11500 after 2000-01-01
    rows: Rows = [
        (1, _begin(100, 7)),
        (2, _rel()),
        (3, b"I" + (16384).to_bytes(4, "big") + b"N" + _tuple(b"1", b"x")),
        (4, _commit(100)[:18] + far),
    ]
    with pytest.raises(DecodeError) as info:
        decode(rows, None)
    assert (info.value.tag, info.value.offset, info.value.lsn) == ("C", 18, 4)
    assert "commit timestamp" in info.value.reason


def test_transaction_given_out_in_parts_then_left_open_is_retracted() -> None:
    """A window that ends inside a transaction already given out in parts names it for dropping."""
    rows: Rows = [(10, _begin(15, 1)), (10, _rel())]
    rows += [(10, b"I" + (16384).to_bytes(4, "big") + b"N" + _tuple(str(k).encode(), b"v")) for k in range(6)]
    rows.append((15, _commit(15)))
    rows.append((20, _begin(25, 2)))
    rows += [(20, b"I" + (16384).to_bytes(4, "big") + b"N" + _tuple(str(100 + k).encode(), b"w")) for k in range(6)]
    dec = WindowDecoder(split_rows=2)
    out = [dec.feed(RowChunk.from_messages(rows[i : i + 2])) for i in range(0, len(rows), 2)]
    last = dec.finish()
    out.append(last)
    assert last.retracted == 25
    got = flatten(out).changes
    committed = [c for c in got if c.lsn == 15]
    assert committed == reference(rows).changes  # the reference drops the open transaction
    assert len(committed) == 6
    # What was given out of the open transaction is exactly what the job drops.
    assert {c.lsn for c in got} == {15, 25}
    assert sum(ch.transactions for ch in out) == 1


def test_transaction_given_out_in_parts_holds_only_its_begin() -> None:
    """Between the parts of a large transaction the decoder keeps its Begin alone, not the buffer of
    every row given out so far (which the next chunk would copy again, growing with the transaction)."""
    rows: Rows = [(10, _begin(15, 1)), (10, _rel())]
    rows += [(10, b"I" + (16384).to_bytes(4, "big") + b"N" + _tuple(str(k).encode(), b"v" * 100)) for k in range(400)]
    rows.append((15, _commit(15)))
    dec = WindowDecoder(split_rows=20)
    out = []
    for i in range(0, len(rows) - 1, 50):
        out.append(dec.feed(RowChunk.from_messages(rows[i : min(i + 50, len(rows) - 1)])))
        assert len(dec._pending.buf) < 25 * 130, len(dec._pending.buf)  # the Begin and at most split_rows rows
    out.append(dec.feed(RowChunk.from_messages(rows[-1:])))
    out.append(dec.finish())
    assert flatten(out).changes == reference(rows).changes
