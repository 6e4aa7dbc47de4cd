"""The bootstrap's COPY reader (``bootstrap.CopyRows``): CopyData blocks gathered into a buffer,
walked in C and decoded column-wise, give the same rows however the stream is cut into blocks
and chunks; bad streams raise DecodeError (unit tests, no server). ``copy_blocks`` on a real
server: the same bytes as psycopg's Copy, a server error after rows raised as psycopg raises it,
and the connection usable after an error or an early stop."""

from __future__ import annotations

from typing import Any

import psycopg
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg import sql

from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import WindowDecoder
from pg2delta.errors import DecodeError
from pg2delta.source import copy as bs
from pg2delta.source import copydata
from test_tuples_ext import COPY_HEADER, COPY_TRAILER, copy_row

Row = tuple[int | None, str | None, bytes | None]


def plan(*, text_columns: frozenset[str] = frozenset()) -> bs.CopyPlan:
    cols = (po.RelationColumn(1, "id", 23, -1), po.RelationColumn(0, "note", 25, -1), po.RelationColumn(0, "raw", 17, -1))
    rel = po.Relation(None, 4242, "public", "t", "d", cols)
    table = bs.PublishedTable(rel, False, None, text_columns, None)
    return bs.CopyPlan.make(table, WindowDecoder().relation_version(rel))


def wire(row: Row) -> bytes:
    i, s, b = row
    return copy_row([None if i is None else i.to_bytes(4, "big", signed=True), None if s is None else s.encode(), b])


def run(p: bs.CopyPlan, blocks: list[bytes], threshold: int) -> list[dict[str, Any]]:
    """What stage_table does with the blocks, gathering ``threshold`` bytes before each walk."""
    walker = bs.CopyRows(p)
    batches: list[pa.RecordBatch] = []
    buf = bytearray()
    for block in blocks:
        buf += block
        if len(buf) >= threshold:
            buf = walker.feed(bytes(buf), batches.append)
    walker.feed(bytes(buf), batches.append, last=True)
    assert walker.rows == sum(b.num_rows for b in batches)
    return pa.Table.from_batches(batches, schema=p.schema).to_pylist()


rows_st = st.lists(
    st.tuples(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1)), st.one_of(st.none(), st.text(max_size=5)),
              st.one_of(st.none(), st.binary(max_size=5))),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(rows_st, st.data())
def test_any_blocks_and_chunks_give_the_rows(rows: list[Row], data: st.DataObject) -> None:
    stream = COPY_HEADER + b"".join(wire(r) for r in rows) + COPY_TRAILER
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    blocks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    threshold = data.draw(st.integers(1, 64))
    chunk_rows = data.draw(st.integers(1, 5))
    p = plan()
    old = bs._CHUNK_ROWS
    bs._CHUNK_ROWS = chunk_rows
    try:
        got = run(p, blocks, threshold)
    finally:
        bs._CHUNK_ROWS = old
    assert got == [{"id": i, "note": s, "raw": b} for i, s, b in rows]


def test_text_columns_are_decoded_as_text() -> None:
    p = plan(text_columns=frozenset({"id"}))
    stream = COPY_HEADER + copy_row([b"17", b"x", None]) + COPY_TRAILER
    assert run(p, [stream], 1) == [{"id": 17, "note": "x", "raw": None}]


@pytest.mark.parametrize(
    ("what", "stream", "match"),
    [
        ("no signature", b"PGCOPY\n\xff\r\n\x01" + bytes(8) + COPY_TRAILER, "signature"),
        ("cut in the header", COPY_HEADER[:10], "header"),
        ("no trailer", COPY_HEADER + wire((1, "a", b"")), "trailer"),
        ("cut row", COPY_HEADER + wire((1, "a", b""))[:-1], "trailer"),
        ("after the trailer", COPY_HEADER + COPY_TRAILER + wire((1, "a", b"")), "after the trailer"),
        ("field count", COPY_HEADER + copy_row([b"\0\0\0\1"]) + COPY_TRAILER, "malformed binary COPY row 0"),
        ("bad int4", COPY_HEADER + copy_row([b"\0\1", None, None]) + COPY_TRAILER, "'id'"),
    ],
)
def test_bad_streams_raise_decode_error(what: str, stream: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        run(plan(), [stream], 1)


def test_header_extension_is_skipped() -> None:
    header = COPY_HEADER[:-4] + (3).to_bytes(4, "big") + b"ext"
    assert run(plan(), [header + wire((5, None, b"z")) + COPY_TRAILER], 1) == [{"id": 5, "note": None, "raw": b"z"}]


# --- copy_blocks on a real server -------------------------------------------------------------------

COPY_SERIES = "COPY (SELECT i, repeat('x', i % 50) FROM generate_series(1, 200000) i) TO STDOUT (FORMAT binary)"


@pytest.mark.integration
@pytest.mark.parametrize("direct", [True, False], ids=["libpq-from-C", "psycopg-per-message"])
def test_copy_blocks_equal_psycopgs_copy(pg: Any, direct: bool) -> None:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        with conn.cursor() as cur, cur.copy(COPY_SERIES) as copy:
            want = b"".join(bytes(b) for b in copy)
        blocks = [bytes(b) for b in copydata.copy_blocks(conn, sql.SQL(COPY_SERIES), direct=direct)]
        assert b"".join(blocks) == want
        if direct:
            # This machine's psycopg has one libpq, so the copy is drained in C, many rows a block.
            assert copydata.libpq_copy_functions() is not None
            assert len(blocks) < 200000 // 10
        else:
            assert len(blocks) >= 200000
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.integration
@pytest.mark.parametrize("direct", [True, False], ids=["libpq-from-C", "psycopg-per-message"])
def test_copy_blocks_raise_a_server_error_after_rows_and_leave_the_connection_usable(pg: Any, direct: bool) -> None:
    failing = "COPY (SELECT 1 / (i - 150000) FROM generate_series(1, 200000) i) TO STDOUT (FORMAT binary)"
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        seen = 0
        with pytest.raises(psycopg.errors.DivisionByZero):
            for block in copydata.copy_blocks(conn, sql.SQL(failing), direct=direct):
                seen += len(block)
        assert seen > 0
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.integration
@pytest.mark.parametrize("direct", [True, False], ids=["libpq-from-C", "psycopg-per-message"])
def test_copy_blocks_closed_early_leave_the_connection_usable(pg: Any, direct: bool) -> None:
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        blocks = copydata.copy_blocks(conn, sql.SQL(COPY_SERIES), direct=direct)
        for i, _ in enumerate(blocks):
            if i == 2:
                break
        else:
            pytest.fail("the copy ended before the third block")
        blocks.close()
        assert conn.execute("SELECT 1").fetchone() == (1,)
