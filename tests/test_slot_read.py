"""The window read's framing (``slot._Framer``): the slot function's binary COPY rows (lsn, xid,
data), gathered from CopyData blocks and walked in C, give the same rows, byte counts, last
commit and ``max_bytes`` stop as a row-by-row reading, however the stream is cut into blocks and
chunks; bad streams raise DecodeError (unit tests, no server). On a real server, a window read in
small chunks holds what the slot function returns, and a window stopped by ``max_bytes`` leaves
the connection usable."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pg2delta.decode import pgoutput as po
from pg2delta.errors import DecodeError
from pg2delta.source import slot as sl
from test_tuples_ext import COPY_HEADER, COPY_TRAILER, copy_row

Row = tuple[int, bytes]  # (lsn, message)


def wire(lsn: int, data: bytes, *, xid: int = 7) -> bytes:
    return copy_row([lsn.to_bytes(8, "big"), xid.to_bytes(4, "big"), data])


def commit(n: int) -> bytes:
    return bytes([po.COMMIT]) + b"\x00" + n.to_bytes(8, "big") * 3


def reference(rows: list[Row], max_changes: int | None, max_bytes: int | None) -> tuple[list[Row], int, int | None, bool]:
    """Row by row: the rows up to the first commit once ``max_changes`` changes or ``max_bytes``
    bytes were read."""
    out: list[Row] = []
    total, changes, last, capped = 0, 0, None, False
    for lsn, data in rows:
        out.append((lsn, data))
        total += len(data) + 26
        changes += data[:1] in (b"I", b"U", b"D", b"T")
        if data[:1] == bytes([po.COMMIT]):
            last = lsn
            if (max_bytes is not None and total >= max_bytes) or (max_changes is not None and changes >= max_changes):
                capped = True
                break
    return out, total, last, capped


def frame(
    blocks: list[bytes], max_changes: int | None, max_bytes: int | None, chunk_rows: int, chunk_bytes: int
) -> tuple[list[Row], sl._Framer]:
    framer = sl._Framer(max_changes, max_bytes, chunk_rows)
    got: list[Row] = []
    for chunk in framer.chunks(blocks, chunk_bytes):
        assert 0 < len(chunk) <= chunk_rows
        got += [(int(chunk.lsns[i]), chunk.buf[chunk.starts[i]:chunk.ends[i]]) for i in range(len(chunk))]
    return got, framer


messages = st.one_of(
    st.binary(min_size=1, max_size=9), st.sampled_from([b"I..", b"U", b"D.", b"T...", b"B", b"R", b"M"]),
    st.integers(0, 2**40).map(commit), st.just(b""),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**63 - 1), messages), max_size=14), st.data())
def test_any_blocks_and_chunks_give_the_rows(rows: list[Row], data: st.DataObject) -> None:
    stream = COPY_HEADER + b"".join(wire(lsn, d) for lsn, d in rows) + COPY_TRAILER
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    blocks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    max_bytes = data.draw(st.one_of(st.none(), st.integers(1, 400)))
    max_changes = data.draw(st.one_of(st.none(), st.integers(1, 6)))
    got, framer = frame(blocks, max_changes, max_bytes, data.draw(st.integers(1, 5)), data.draw(st.integers(1, 80)))
    want, total, last, capped = reference(rows, max_changes, max_bytes)
    assert got == want
    assert (framer.rows, framer.bytes, framer.last_commit, framer.cut) == (len(want), total, last, capped)
    if capped:  # whether rows follow the cut, where the blocks read tell
        assert framer.more in (None, len(want) < len(rows)), (framer.more, len(want), len(rows))


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (b"PGCOPY\n\xff\r\n\x01" + bytes(8) + COPY_TRAILER, "without binary signature"),
        (COPY_HEADER + copy_row([bytes(8), bytes(4)]) + COPY_TRAILER, "malformed COPY row"),
        (COPY_HEADER + copy_row([bytes(7), bytes(4), b"x"]) + COPY_TRAILER, r"is not \(pg_lsn, xid, bytea\)"),
        (COPY_HEADER + copy_row([bytes(8), bytes(4), None]) + COPY_TRAILER, r"is not \(pg_lsn, xid, bytea\)"),
        (COPY_HEADER + wire(1, b"abc")[:-1], "ends without its trailer"),
        (COPY_HEADER + COPY_TRAILER + wire(1, b"abc"), "after the end"),
    ],
)
def test_bad_streams(stream: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        frame([stream], None, None, 4, 1)


def test_a_window_read_in_small_chunks_holds_the_slot_functions_rows(pgdb: str) -> None:
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("CREATE TABLE r (id int PRIMARY KEY, v text)")
        conn.execute("CREATE PUBLICATION r_pub FOR TABLE r")
        conn.execute("SELECT pg_create_logical_replication_slot('r_slot', 'pgoutput')")
        for lo in range(0, 3000, 300):
            conn.execute("INSERT INTO r SELECT g, repeat('x', g %% 50) FROM generate_series(%s::int, %s::int) g", (lo, lo + 299))
        upto = sl._lsn_value(conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone()[0])
        assert upto is not None
        want = [(int(sl._lsn_value(lsn) or 0), bytes(d)) for lsn, d in conn.execute(
            "SELECT lsn, data FROM pg_logical_slot_peek_binary_changes('r_slot', %s::pg_lsn, NULL, 'proto_version', '1', "
            "'publication_names', 'r_pub', 'binary', 'true', 'messages', 'true')", (sl.format_lsn(upto),))]
    with sl.SlotSource(pgdb, "r_slot", "r_pub") as src:
        got: list[Row] = []
        items = list(src.read_window(upto, max_changes=None, max_bytes=None, chunk_rows=700, chunk_bytes=4096))
        for chunk in items[:-1]:
            assert isinstance(chunk, sl.RowChunk) and len(chunk) <= 700
            got += [(int(chunk.lsns[i]), chunk.buf[chunk.starts[i]:chunk.ends[i]]) for i in range(len(chunk))]
        read = items[-1]
        assert isinstance(read, sl.WindowRead) and not read.capped
        assert got == want and read.rows == len(want)
        assert read.last_commit_end_lsn == max(lsn for lsn, d in want if d[:1] == bytes([po.COMMIT]))
        # Stopped by max_bytes: the first commit past it ends the window; the connection is usable after.
        items = list(src.read_window(upto, max_changes=None, max_bytes=20_000, chunk_bytes=4096))
        read = items[-1]
        assert isinstance(read, sl.WindowRead) and read.capped
        rows = [r for c in items[:-1] if isinstance(c, sl.RowChunk) for r in (
            (int(c.lsns[i]), c.buf[c.starts[i]:c.ends[i]]) for i in range(len(c)))]
        cut, total, last, capped = reference(want, None, 20_000)
        assert capped and rows == cut and (read.rows, read.bytes, read.last_commit_end_lsn) == (len(cut), total, last)
        assert src.conn.execute("SELECT 1").fetchone() == (1,)
        # max_changes counts changes, not the Begin, Commit and Relation rows: 900 changes are the
        # first three transactions of 300, whole; 901 take a fourth.
        for cap, txns in ((900, 3), (901, 4), (3000, 10)):
            items = list(src.read_window(upto, max_changes=cap, max_bytes=None, chunk_bytes=4096))
            read = items[-1]
            assert isinstance(read, sl.WindowRead) and read.capped == (txns < 10)
            cut, total, last, _ = reference(want, cap, None)
            assert read.rows == len(cut) == txns * 302 + 1 and read.last_commit_end_lsn == last, (cap, read)
