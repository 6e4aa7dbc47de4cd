"""Hand-built pgoutput messages: every message type, edge cases, and every way to be malformed.

The bytes here are written out with ``struct.pack`` from the layouts in the protocol
documentation, independently of the parser's own headers. Most of these shapes also occur
in the golden captures (tests/golden); the following can only be built by hand because
the SQL interface cannot produce them on the servers we capture from:

* Stream Abort with protocol-4 fields for a whole-transaction abort (PostgreSQL 17+ does
  not stream a transaction that is already aborted when decoding reaches it);
* Stream Prepare / Commit flags other than 0, Message flags other than 0 and 1;
* empty strings where the server always sends a name (prefix, gid, origin name);
* Relation namespace '' for a table (only types in pg_catalog get it);
* every kind of malformed message.
"""

from __future__ import annotations

import dataclasses
import struct

import pytest

from pg2delta.decode import pgoutput as po
from pg2delta.decode.pgoutput import (
    NULL,
    UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Binary,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    Prepare,
    Relation,
    RelationColumn,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Text,
    Truncate,
    Type,
    Update,
    parse_message,
    parse_tuple,
)
from pg2delta.errors import DecodeError

LSN = 0x16_B374D848
LSN2 = 0x16_B374D900
TS = 757_382_400_000_000  # 2024-01-01 00:00:00 UTC in microseconds since 2000-01-01
TS2 = TS + 1_234_567
XID = 0xDEADBEEF  # above 2**31: xids are unsigned
SUBXID = 0xDEADBEF0
OID = 0xFFFF_FF00  # above 2**31: OIDs are unsigned


def s(text: str) -> bytes:
    return text.encode() + b"\0"


def tup(*cols: bytes) -> bytes:
    return struct.pack("!H", len(cols)) + b"".join(cols)


def t(value: bytes) -> bytes:
    return b"t" + struct.pack("!i", len(value)) + value


def b(value: bytes) -> bytes:
    return b"b" + struct.pack("!i", len(value)) + value


ROW = tup(t(b"1"), b"n", b"u", b(b"\x00\x01"), t(b""))
ROW_VALUES = (Text(b"1"), NULL, UNCHANGED_TOAST, Binary(b"\x00\x01"), Text(b""))


def test_tag_constants() -> None:
    expected = {
        "BEGIN": "B", "MESSAGE": "M", "COMMIT": "C", "ORIGIN": "O", "RELATION": "R", "TYPE": "Y",
        "INSERT": "I", "UPDATE": "U", "DELETE": "D", "TRUNCATE": "T", "STREAM_START": "S",
        "STREAM_STOP": "E", "STREAM_COMMIT": "c", "STREAM_ABORT": "A", "BEGIN_PREPARE": "b",
        "PREPARE": "P", "COMMIT_PREPARED": "K", "ROLLBACK_PREPARED": "r", "STREAM_PREPARE": "p",
    }  # fmt: skip
    for name, char in expected.items():
        assert getattr(po, name) == ord(char), name


# ------------------------------------------------------------------ every message type


def test_begin() -> None:
    msg = parse_message(b"B" + struct.pack("!QqI", LSN, TS, XID))
    assert msg == Begin(final_lsn=LSN, commit_ts=TS, xid=XID)


def test_begin_negative_timestamp_is_kept() -> None:
    # Before 2000-01-01: the timestamp is signed.
    msg = parse_message(b"B" + struct.pack("!QqI", 1, -5, 1))
    assert msg == Begin(1, -5, 1)


def test_commit() -> None:
    msg = parse_message(b"C" + struct.pack("!BQQq", 0, LSN, LSN2, TS))
    assert msg == Commit(flags=0, commit_lsn=LSN, end_lsn=LSN2, commit_ts=TS)


def test_commit_keeps_unknown_flags() -> None:
    msg = parse_message(b"C" + struct.pack("!BQQq", 7, LSN, LSN2, TS))
    assert isinstance(msg, Commit)
    assert msg.flags == 7


def test_origin() -> None:
    assert parse_message(b"O" + struct.pack("!Q", LSN) + s("upstream")) == Origin(LSN, "upstream")
    assert parse_message(b"O" + struct.pack("!Q", 0) + s("")) == Origin(0, "")


@pytest.mark.parametrize(
    ("flags", "transactional"),
    [(0, False), (1, True), (3, True), (2, False)],
)
def test_logical_message(flags: int, transactional: bool) -> None:
    content = b"\x00\xffbinary\0content"
    buf = b"M" + struct.pack("!BQ", flags, LSN) + s("my-prefix") + struct.pack("!i", len(content)) + content
    assert parse_message(buf) == LogicalMessage(None, transactional, LSN, "my-prefix", content)


def test_logical_message_in_stream_and_empty() -> None:
    buf = b"M" + struct.pack("!IBQ", XID, 1, LSN) + s("") + struct.pack("!i", 0)
    assert parse_message(buf, in_stream=True) == LogicalMessage(XID, True, LSN, "", b"")


def _relation_body() -> bytes:
    return (
        struct.pack("!I", OID)
        + s("public")
        + s("Wéird table")
        + b"f"
        + struct.pack("!H", 3)
        + b"\x01" + s("id") + struct.pack("!Ii", 23, -1)
        + b"\x00" + s("price") + struct.pack("!Ii", 1700, (10 << 16 | 2) + 4)
        + b"\x01" + s("") + struct.pack("!Ii", 0xFFFF_FFFE, 0)
    )  # fmt: skip


def test_relation() -> None:
    msg = parse_message(b"R" + _relation_body())
    assert msg == Relation(
        xid=None,
        oid=OID,
        namespace="public",
        name="Wéird table",
        replica_identity="f",
        columns=(
            RelationColumn(1, "id", 23, -1),
            RelationColumn(0, "price", 1700, 655366),
            RelationColumn(1, "", 0xFFFF_FFFE, 0),
        ),
    )
    assert msg.key_names == ("id", "")
    assert [c.is_key for c in msg.columns] == [True, False, True]


def test_relation_in_stream_zero_columns_all_identities() -> None:
    for ident in "dnfi":
        buf = b"R" + struct.pack("!II", XID, 1) + s("") + s("t") + ident.encode() + struct.pack("!H", 0)
        msg = parse_message(buf, in_stream=True)
        assert msg == Relation(XID, 1, "", "t", ident, ())
        assert msg.key_names == ()


def test_relation_column_flag_bits_other_than_key() -> None:
    col = RelationColumn(flags=2, name="x", type_oid=25, type_modifier=-1)
    assert not col.is_key
    assert RelationColumn(3, "x", 25, -1).is_key


def test_type() -> None:
    assert parse_message(b"Y" + struct.pack("!I", 16386) + s("public") + s("mood")) == Type(
        None, 16386, "public", "mood"
    )
    assert parse_message(b"Y" + struct.pack("!II", XID, 16394) + s("") + s("int4"), in_stream=True) == Type(
        XID, 16394, "", "int4"
    )


def test_insert_all_column_kinds() -> None:
    msg = parse_message(b"I" + struct.pack("!I", OID) + b"N" + ROW)
    assert msg == Insert(None, OID, ROW_VALUES)


def test_insert_in_stream_zero_columns() -> None:
    msg = parse_message(b"I" + struct.pack("!II", XID, 5) + b"N" + tup(), in_stream=True)
    assert msg == Insert(XID, 5, ())


def test_update_without_old() -> None:
    msg = parse_message(b"U" + struct.pack("!I", OID) + b"N" + ROW)
    assert msg == Update(None, OID, None, None, ROW_VALUES)


def test_update_with_key() -> None:
    key = tup(t(b"7"), b"n")
    msg = parse_message(b"U" + struct.pack("!I", OID) + b"K" + key + b"N" + tup(t(b"8"), t(b"x")))
    assert msg == Update(None, OID, "K", (Text(b"7"), NULL), (Text(b"8"), Text(b"x")))


def test_update_with_old_in_stream() -> None:
    old = tup(t(b"7"), t(b"a"))
    new = tup(t(b"7"), b"u")
    msg = parse_message(b"U" + struct.pack("!II", XID, OID) + b"O" + old + b"N" + new, in_stream=True)
    assert msg == Update(XID, OID, "O", (Text(b"7"), Text(b"a")), (Text(b"7"), UNCHANGED_TOAST))


@pytest.mark.parametrize("kind", ["K", "O"])
def test_delete(kind: str) -> None:
    msg = parse_message(b"D" + struct.pack("!I", OID) + kind.encode() + ROW)
    assert msg == Delete(None, OID, kind, ROW_VALUES)


def test_delete_in_stream() -> None:
    msg = parse_message(
        b"D" + struct.pack("!II", XID, 9) + b"K" + tup(b(b"\x00\x00\x00\x09")), in_stream=True
    )
    assert msg == Delete(XID, 9, "K", (Binary(b"\x00\x00\x00\x09"),))


@pytest.mark.parametrize(
    ("options", "cascade", "restart"),
    [(0, False, False), (1, True, False), (2, False, True), (3, True, True)],
)
def test_truncate(options: int, cascade: bool, restart: bool) -> None:
    oids = (16476, 16492, OID, 16481)
    msg = parse_message(b"T" + struct.pack("!iB4I", 4, options, *oids))
    assert msg == Truncate(None, options, oids)
    assert isinstance(msg, Truncate)
    assert (msg.cascade, msg.restart_identity) == (cascade, restart)


def test_truncate_in_stream_and_empty() -> None:
    assert parse_message(b"T" + struct.pack("!IiBI", XID, 1, 0, 7), in_stream=True) == Truncate(XID, 0, (7,))
    assert parse_message(b"T" + struct.pack("!iB", 0, 0)) == Truncate(None, 0, ())


def test_stream_start_stop() -> None:
    assert parse_message(b"S" + struct.pack("!IB", XID, 1)) == StreamStart(XID, True)
    assert parse_message(b"S" + struct.pack("!IB", XID, 0)) == StreamStart(XID, False)
    assert parse_message(b"E") == StreamStop()
    # The stream tags themselves never carry the leading xid: in_stream changes nothing.
    assert parse_message(b"E", in_stream=True) == StreamStop()
    assert parse_message(b"S" + struct.pack("!IB", 3, 1), in_stream=True) == StreamStart(3, True)


def test_stream_commit() -> None:
    msg = parse_message(b"c" + struct.pack("!IBQQq", XID, 0, LSN, LSN2, TS))
    assert msg == StreamCommit(xid=XID, flags=0, commit_lsn=LSN, end_lsn=LSN2, commit_ts=TS)


def test_stream_abort_protocol_2() -> None:
    assert parse_message(b"A" + struct.pack("!II", XID, SUBXID)) == StreamAbort(XID, SUBXID, None, None)


def test_stream_abort_protocol_4_parallel() -> None:
    msg = parse_message(b"A" + struct.pack("!IIQq", XID, XID, LSN, TS))
    assert msg == StreamAbort(xid=XID, subxid=XID, abort_lsn=LSN, abort_ts=TS)


@pytest.mark.parametrize("rest", [0, 4, 7, 9, 16, 23, 25, 32])
def test_stream_abort_other_lengths_are_rejected(rest: int) -> None:
    with pytest.raises(DecodeError) as err:
        parse_message(b"A" + bytes(rest), lsn=LSN)
    assert err.value.tag == "A"
    assert err.value.lsn == LSN


def test_begin_prepare() -> None:
    msg = parse_message(b"b" + struct.pack("!QQqI", LSN, LSN2, TS, XID) + s("gid-1"))
    assert msg == BeginPrepare(prepare_lsn=LSN, end_lsn=LSN2, prepare_ts=TS, xid=XID, gid="gid-1")


def test_prepare() -> None:
    msg = parse_message(b"P" + struct.pack("!BQQqI", 0, LSN, LSN2, TS, XID) + s("gïd"))
    assert msg == Prepare(flags=0, prepare_lsn=LSN, end_lsn=LSN2, prepare_ts=TS, xid=XID, gid="gïd")


def test_commit_prepared() -> None:
    msg = parse_message(b"K" + struct.pack("!BQQqI", 0, LSN, LSN2, TS, XID) + s(""))
    assert msg == CommitPrepared(flags=0, commit_lsn=LSN, end_lsn=LSN2, commit_ts=TS, xid=XID, gid="")


def test_rollback_prepared() -> None:
    msg = parse_message(b"r" + struct.pack("!BQQqqI", 0, LSN, LSN2, TS, TS2, XID) + s("g"))
    assert msg == RollbackPrepared(
        flags=0, prepare_end_lsn=LSN, rollback_end_lsn=LSN2, prepare_ts=TS, rollback_ts=TS2, xid=XID, gid="g"
    )


def test_stream_prepare() -> None:
    msg = parse_message(b"p" + struct.pack("!BQQqI", 1, LSN, LSN2, TS, XID) + s("big"))
    assert msg == StreamPrepare(flags=1, prepare_lsn=LSN, end_lsn=LSN2, prepare_ts=TS, xid=XID, gid="big")


def test_buffer_types() -> None:
    raw = b"I" + struct.pack("!I", OID) + b"N" + ROW
    expected = Insert(None, OID, ROW_VALUES)
    assert parse_message(bytearray(raw)) == expected
    assert parse_message(memoryview(raw)) == expected
    assert parse_message(memoryview(b"xx" + raw)[2:]) == expected
    msg = parse_message(memoryview(bytearray(raw)))
    assert msg == expected
    assert isinstance(msg, Insert)
    first = msg.new[0]
    assert isinstance(first, Text)
    assert type(first.data) is bytes


def test_messages_are_frozen_and_slotted() -> None:
    msg = parse_message(b"B" + struct.pack("!QqI", 1, 2, 3))
    assert isinstance(msg, Begin)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.xid = 4  # type: ignore[misc]
    assert not hasattr(msg, "__dict__")
    assert not hasattr(Text(b""), "__dict__")


def test_column_value_singletons() -> None:
    assert repr(NULL) == "NULL"
    assert repr(UNCHANGED_TOAST) == "UNCHANGED_TOAST"
    assert len({NULL, UNCHANGED_TOAST, Text(b"x"), Binary(b"x")}) == 4


# ------------------------------------------------------------------ parse_tuple


def test_parse_tuple_returns_offset_after_it() -> None:
    buf = b"junk" + ROW + b"rest"
    values, end = parse_tuple(buf, 4)
    assert values == ROW_VALUES
    assert buf[end:] == b"rest"


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_parse_tuple_buffer_types(wrap: type) -> None:
    values, end = parse_tuple(wrap(b"x" + ROW), 1)
    assert values == ROW_VALUES
    assert end == 1 + len(ROW)


def test_parse_tuple_rejects_bad_offsets() -> None:
    for offset in (-1, len(ROW) + 1):
        with pytest.raises(DecodeError):
            parse_tuple(ROW, offset)
    with pytest.raises(DecodeError) as err:
        parse_tuple(ROW, len(ROW))
    assert err.value.offset == len(ROW)


# ------------------------------------------------------------------ malformed input

GOOD_INSERT = b"I" + struct.pack("!I", 7) + b"N" + tup(t(b"abc"), b"n")


def _decode_error(buf: bytes, *, in_stream: bool = False) -> DecodeError:
    with pytest.raises(DecodeError) as err:
        parse_message(buf, in_stream=in_stream, lsn=LSN)
    assert err.value.lsn == LSN
    assert f"{LSN >> 32:X}/{LSN & 0xFFFFFFFF:X}" in str(err.value)
    return err.value


def test_empty_message() -> None:
    err = _decode_error(b"")
    assert err.offset == 0


@pytest.mark.parametrize("tag", [b"\x00", b"X", b"Z", b"a", b"\xff", b"N", b"n", b"t", b"W", b"k"])
def test_unknown_tags(tag: bytes) -> None:
    err = _decode_error(tag + bytes(40))
    assert err.tag == tag.decode("latin-1")
    assert err.offset == 0
    assert "unknown message tag" in err.reason


def test_every_truncation_of_a_valid_message_is_rejected() -> None:
    messages = [
        GOOD_INSERT,
        b"B" + struct.pack("!QqI", LSN, TS, XID),
        b"R" + _relation_body(),
        b"U" + struct.pack("!I", OID) + b"O" + ROW + b"N" + ROW,
        b"r" + struct.pack("!BQQqqI", 0, LSN, LSN2, TS, TS2, XID) + s("g"),
        b"T" + struct.pack("!iB2I", 2, 3, 5, 6),
        b"M" + struct.pack("!BQ", 1, LSN) + s("p") + struct.pack("!i", 3) + b"abc",
    ]
    for whole in messages:
        for cut in range(1, len(whole)):
            err = _decode_error(whole[:cut])
            assert err.tag == chr(whole[0])
            assert err.offset is not None
            assert 0 <= err.offset <= cut


@pytest.mark.parametrize(
    "garbage",
    [b"\x00", b"N", b"extra bytes"],
)
def test_trailing_garbage(garbage: bytes) -> None:
    for whole in (
        GOOD_INSERT,
        b"E",
        b"B" + struct.pack("!QqI", 1, 2, 3),
        b"Y" + struct.pack("!I", 1) + s("") + s("x"),
    ):
        err = _decode_error(whole + garbage)
        assert err.offset == len(whole)
        assert "trailing" in err.reason


@pytest.mark.parametrize("kind", [b"x", b"N", b"T", b"\x00", b"U"])
def test_bad_tuple_column_kind(kind: bytes) -> None:
    buf = b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 2) + t(b"a") + kind + bytes(8)
    err = _decode_error(buf)
    assert err.tag == "I"
    assert err.offset == 1 + 4 + 1 + 2 + 5 + 1
    assert "kind" in err.reason


def test_negative_column_length() -> None:
    buf = b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 1) + b"t" + struct.pack("!i", -1)
    err = _decode_error(buf)
    assert err.offset == 9
    assert "negative" in err.reason


def test_column_length_past_the_end() -> None:
    buf = b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 1) + b"b" + struct.pack("!i", 10) + b"abc"
    err = _decode_error(buf)
    assert err.offset == 9
    # 2**31 - 1 must not allocate or overflow either.
    buf = (
        b"I"
        + struct.pack("!I", 7)
        + b"N"
        + struct.pack("!H", 1)
        + b"b"
        + struct.pack("!i", 2**31 - 1)
        + b"abc"
    )
    _decode_error(buf)


def test_too_many_columns_declared() -> None:
    buf = b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 3) + t(b"a") + b"n"
    err = _decode_error(buf)
    assert err.offset == len(buf)


@pytest.mark.parametrize("marker", [b"K", b"O", b"X", b"n", b"\x00"])
def test_insert_needs_new_marker(marker: bytes) -> None:
    err = _decode_error(b"I" + struct.pack("!I", 7) + marker + tup(t(b"a")))
    assert err.offset == 5


@pytest.mark.parametrize("marker", [b"X", b"k", b"o", b"\x00"])
def test_update_bad_old_marker(marker: bytes) -> None:
    err = _decode_error(b"U" + struct.pack("!I", 7) + marker + tup(t(b"a")) + b"N" + tup(t(b"b")))
    assert err.offset == 5


def test_update_old_without_new() -> None:
    for second in (b"K", b"O", b"X"):
        err = _decode_error(b"U" + struct.pack("!I", 7) + b"K" + tup(t(b"a")) + second + tup(t(b"b")))
        assert err.offset == 5 + 1 + len(tup(t(b"a")))


@pytest.mark.parametrize("marker", [b"N", b"X", b"\x00"])
def test_delete_bad_old_marker(marker: bytes) -> None:
    err = _decode_error(b"D" + struct.pack("!I", 7) + marker + tup(t(b"a")))
    assert err.offset == 5


def test_negative_and_oversized_truncate_count() -> None:
    err = _decode_error(b"T" + struct.pack("!iB", -1, 0))
    assert "negative" in err.reason
    err = _decode_error(b"T" + struct.pack("!iBI", 2, 0, 5))
    assert err.offset == 6
    _decode_error(b"T" + struct.pack("!iBI", 2**31 - 1, 0, 5))


def test_negative_and_oversized_message_content_length() -> None:
    head = b"M" + struct.pack("!BQ", 1, LSN) + s("p")
    assert "negative" in _decode_error(head + struct.pack("!i", -5)).reason
    _decode_error(head + struct.pack("!i", 4) + b"abc")
    _decode_error(head + struct.pack("!i", 2**31 - 1) + b"abc")


def test_unterminated_strings() -> None:
    _decode_error(b"O" + struct.pack("!Q", 1) + b"no-nul")
    _decode_error(b"Y" + struct.pack("!I", 1) + s("ns") + b"name")
    _decode_error(b"b" + struct.pack("!QQqI", 1, 2, 3, 4) + b"gid")


def test_invalid_utf8() -> None:
    err = _decode_error(b"O" + struct.pack("!Q", 1) + b"ab\xff\xfecd\0")
    assert err.tag == "O"
    assert err.offset == 9 + 2
    assert "UTF-8" in err.reason
    assert isinstance(err.__cause__, UnicodeDecodeError)
    err = _decode_error(b"R" + struct.pack("!I", 1) + s("public") + b"\xc3\0" + b"d" + struct.pack("!H", 0))
    assert "UTF-8" in err.reason


def test_bad_replica_identity() -> None:
    err = _decode_error(b"R" + struct.pack("!I", 1) + s("") + s("t") + b"x" + struct.pack("!H", 0))
    assert err.offset == 1 + 4 + 1 + 2
    assert "replica identity" in err.reason


def test_in_stream_mismatch_is_detected() -> None:
    # The same Insert read with the wrong idea of in_stream cannot parse as the right thing.
    plain = b"I" + struct.pack("!I", 7) + b"N" + tup(t(b"abc"))
    streamed = b"I" + struct.pack("!II", XID, 7) + b"N" + tup(t(b"abc"))
    _decode_error(plain, in_stream=True)
    _decode_error(streamed, in_stream=False)


def test_not_bytes() -> None:
    with pytest.raises(DecodeError):
        parse_message("B...")  # type: ignore[arg-type]
    with pytest.raises(DecodeError):
        parse_message(12)  # type: ignore[arg-type]
    with pytest.raises(DecodeError):
        parse_tuple([1, 2], 0)  # type: ignore[arg-type]


def test_error_is_a_protocol_error() -> None:
    from pg2delta.errors import ErrorKind

    err = _decode_error(b"?")
    assert err.kind is ErrorKind.PROTOCOL
    assert not err.retryable
