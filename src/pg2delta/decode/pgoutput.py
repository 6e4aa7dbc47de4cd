"""The pgoutput logical replication protocol: bytes in, immutable messages out.

Pure and I/O free. :func:`parse_message` decodes one message as returned by
``pg_logical_slot_peek_binary_changes`` (or carried in a walsender ``XLogData``) into one of
the frozen dataclasses below; :func:`parse_tuple` decodes one ``TupleData`` part.

Layouts follow "Logical Replication Message Formats" of the PostgreSQL documentation,
protocol versions 1 to 4, and are checked against golden bytes captured from real
PostgreSQL 15 and 18 servers (``tests/golden``). Integers are big-endian. Xids and OIDs
are unsigned 32-bit, LSNs unsigned 64-bit, timestamps signed 64-bit microseconds since
2000-01-01 (kept as sent), type modifiers and lengths signed 32-bit.

Inside a streamed transaction (between Stream Start and Stream Stop, protocol >= 2) the
Message, Relation, Type, Insert, Update, Delete and Truncate messages carry a leading
Int32 xid; the message itself does not say so, the caller does (``in_stream=True``).

Every read is bounds-checked. Anything malformed raises :class:`DecodeError` naming the
message tag, the byte offset inside the message and the LSN the caller passed in; no other
exception escapes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TypeAlias

from pg2delta.decode.messages import (
    BEGIN,
    BEGIN_PREPARE,
    COMMIT,
    COMMIT_PREPARED,
    DELETE,
    INSERT,
    MESSAGE,
    NULL,
    ORIGIN,
    PREPARE,
    RELATION,
    ROLLBACK_PREPARED,
    STREAM_ABORT,
    STREAM_COMMIT,
    STREAM_PREPARE,
    STREAM_START,
    STREAM_STOP,
    TRUNCATE,
    TYPE,
    UNCHANGED_TOAST,
    UPDATE,
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
    NullType,
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
    TupleData,
    Type,
    UnchangedToastType,
    Update,
)
from pg2delta.errors import DecodeError

__all__ = [
    "BEGIN",
    "BEGIN_PREPARE",
    "COMMIT",
    "COMMIT_PREPARED",
    "DELETE",
    "INSERT",
    "MESSAGE",
    "NULL",
    "ORIGIN",
    "PREPARE",
    "RELATION",
    "ROLLBACK_PREPARED",
    "STREAM_ABORT",
    "STREAM_COMMIT",
    "STREAM_PREPARE",
    "STREAM_START",
    "STREAM_STOP",
    "TRUNCATE",
    "TYPE",
    "UNCHANGED_TOAST",
    "UPDATE",
    "Begin",
    "BeginPrepare",
    "Binary",
    "ColumnValue",
    "Commit",
    "CommitPrepared",
    "Delete",
    "Insert",
    "LogicalMessage",
    "Message",
    "NullType",
    "Origin",
    "Prepare",
    "Relation",
    "RelationColumn",
    "RollbackPrepared",
    "StreamAbort",
    "StreamCommit",
    "StreamPrepare",
    "StreamStart",
    "StreamStop",
    "Text",
    "Truncate",
    "TupleData",
    "Type",
    "UnchangedToastType",
    "Update",
    "parse_message",
    "parse_tuple",
]

# The messages and their tags (pg2delta.decode.messages), handed on from here.

_NEW = ord("N")
_KEY = ord("K")
_OLD = ord("O")

# TupleData column kinds.
_KIND_NULL = ord("n")
_KIND_TOAST = ord("u")
_KIND_TEXT = ord("t")
_KIND_BINARY = ord("b")

_REPLICA_IDENTITIES = frozenset("dnfi")

# ------------------------------------------------------------------ fixed headers
# Offsets below are inside the message; the tag byte is at offset 0.

_U8 = struct.Struct("!B")
_U16 = struct.Struct("!H")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_BEGIN = struct.Struct("!QqI")  # final lsn, commit ts, xid
_MESSAGE_HEAD = struct.Struct("!BQ")  # flags, lsn
_COMMIT = struct.Struct("!BQQq")  # flags, commit lsn, end lsn, commit ts
_RELATION_TAIL = struct.Struct("!BH")  # replica identity, column count
_COLUMN_TAIL = struct.Struct("!Ii")  # type oid, type modifier
_TRUNCATE_HEAD = struct.Struct("!iB")  # relation count, options
_STREAM_START = struct.Struct("!IB")  # xid, first segment
_STREAM_COMMIT = struct.Struct("!IBQQq")  # xid, flags, commit lsn, end lsn, commit ts
_STREAM_ABORT = struct.Struct("!II")  # xid, subxid
_STREAM_ABORT_V4 = struct.Struct("!IIQq")  # xid, subxid, abort lsn, abort ts
_BEGIN_PREPARE = struct.Struct("!QQqI")  # prepare lsn, end lsn, prepare ts, xid
_PREPARE = struct.Struct("!BQQqI")  # flags, lsn, end lsn, ts, xid (Prepare, Commit Prepared, Stream Prepare)
# flags, prepare end lsn, rollback end lsn, prepare ts, rollback ts, xid
_ROLLBACK_PREPARED = struct.Struct("!BQQqqI")


class _Malformed(Exception):
    """Internal: what is wrong and where; :func:`parse_message` adds the tag and the LSN."""

    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset


_Buf: TypeAlias = bytes | memoryview


def _need(data: _Buf, off: int, size: int, what: str) -> None:
    if off + size > len(data):
        raise _Malformed(f"truncated: {what} needs {size} bytes, {max(len(data) - off, 0)} left", off)


def _unpack(st: struct.Struct, data: _Buf, off: int, what: str) -> tuple[int, ...]:
    _need(data, off, st.size, what)
    return st.unpack_from(data, off)


def _string(data: bytes, off: int, what: str) -> tuple[str, int]:
    """A NUL-terminated UTF-8 string at ``off``; returns it and the offset after the NUL."""
    nul = data.find(b"\0", off)
    if nul < 0:
        raise _Malformed(f"{what}: string without terminating NUL", off)
    try:
        return data[off:nul].decode("utf-8"), nul + 1
    except UnicodeDecodeError as exc:
        raise _Malformed(f"{what}: invalid UTF-8 ({exc.reason})", off + exc.start) from exc


def _tuple(data: _Buf, off: int) -> tuple[TupleData, int]:
    (ncols,) = _unpack(_U16, data, off, "TupleData column count")
    off += 2
    end = len(data)
    values: list[ColumnValue] = []
    append = values.append
    for _ in range(ncols):
        if off >= end:
            raise _Malformed(
                f"truncated: TupleData has {ncols} columns, input ended after {len(values)}", off
            )
        kind = data[off]
        if kind in (_KIND_TEXT, _KIND_BINARY):
            if off + 5 > end:
                raise _Malformed("truncated: column value length", off + 1)
            (length,) = _I32.unpack_from(data, off + 1)
            if length < 0:
                raise _Malformed(f"negative column value length {length}", off + 1)
            start = off + 5
            off = start + length
            if off > end:
                raise _Malformed(
                    f"column value length {length} runs past the end ({end - start} bytes left)", start - 4
                )
            value = bytes(data[start:off])
            append(Text(value) if kind == _KIND_TEXT else Binary(value))
        elif kind == _KIND_NULL:
            append(NULL)
            off += 1
        elif kind == _KIND_TOAST:
            append(UNCHANGED_TOAST)
            off += 1
        else:
            raise _Malformed(f"unknown TupleData column kind {bytes([kind])!r}", off)
    return tuple(values), off


def _xid(data: bytes, in_stream: bool) -> tuple[int | None, int]:
    """The streamed-transaction xid after the tag, if ``in_stream``; returns it and the next offset."""
    if not in_stream:
        return None, 1
    (xid,) = _unpack(_U32, data, 1, "xid")
    return xid, 5


# --------------------------------------------------------------- one per message
# Each takes the whole message (tag at offset 0) and returns the message and the offset
# just after it; parse_message rejects anything left over.

_Parsed: TypeAlias = tuple[Message, int]


def _begin(data: bytes, in_stream: bool) -> _Parsed:
    final_lsn, commit_ts, xid = _unpack(_BEGIN, data, 1, "Begin")
    return Begin(final_lsn, commit_ts, xid), 1 + _BEGIN.size


def _message(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    flags, lsn = _unpack(_MESSAGE_HEAD, data, off, "Message header")
    prefix, off = _string(data, off + _MESSAGE_HEAD.size, "Message prefix")
    (length,) = _unpack(_I32, data, off, "Message content length")
    if length < 0:
        raise _Malformed(f"negative Message content length {length}", off)
    start = off + 4
    _need(data, start, length, "Message content")
    return LogicalMessage(xid, bool(flags & 1), lsn, prefix, data[start : start + length]), start + length


def _commit(data: bytes, in_stream: bool) -> _Parsed:
    flags, commit_lsn, end_lsn, commit_ts = _unpack(_COMMIT, data, 1, "Commit")
    return Commit(flags, commit_lsn, end_lsn, commit_ts), 1 + _COMMIT.size


def _origin(data: bytes, in_stream: bool) -> _Parsed:
    (commit_lsn,) = _unpack(_U64, data, 1, "Origin commit LSN")
    name, off = _string(data, 9, "Origin name")
    return Origin(commit_lsn, name), off


def _relation(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    (oid,) = _unpack(_U32, data, off, "Relation OID")
    namespace, off = _string(data, off + 4, "Relation namespace")
    name, off = _string(data, off, "Relation name")
    ident, ncols = _unpack(_RELATION_TAIL, data, off, "Relation replica identity and column count")
    replica_identity = chr(ident)
    if replica_identity not in _REPLICA_IDENTITIES:
        raise _Malformed(f"unknown replica identity {bytes([ident])!r}", off)
    off += _RELATION_TAIL.size
    columns = []
    for _ in range(ncols):
        (flags,) = _unpack(_U8, data, off, "column flags")
        col_name, off = _string(data, off + 1, "column name")
        type_oid, type_modifier = _unpack(_COLUMN_TAIL, data, off, "column type")
        off += _COLUMN_TAIL.size
        columns.append(RelationColumn(flags, col_name, type_oid, type_modifier))
    return Relation(xid, oid, namespace, name, replica_identity, tuple(columns)), off


def _type(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    (oid,) = _unpack(_U32, data, off, "Type OID")
    namespace, off = _string(data, off + 4, "Type namespace")
    name, off = _string(data, off, "Type name")
    return Type(xid, oid, namespace, name), off


def _expect_new(data: bytes, off: int) -> int:
    (marker,) = _unpack(_U8, data, off, "new tuple marker")
    if marker != _NEW:
        raise _Malformed(f"expected new tuple marker b'N', got {bytes([marker])!r}", off)
    return off + 1


def _insert(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    (relid,) = _unpack(_U32, data, off, "relation OID")
    new, off = _tuple(data, _expect_new(data, off + 4))
    return Insert(xid, relid, new), off


def _update(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    (relid,) = _unpack(_U32, data, off, "relation OID")
    off += 4
    (marker,) = _unpack(_U8, data, off, "old or new tuple marker")
    old_kind: str | None = None
    old: TupleData | None = None
    if marker in (_KEY, _OLD):
        old_kind = chr(marker)
        old, off = _tuple(data, off + 1)
    elif marker != _NEW:
        raise _Malformed(f"expected b'K', b'O' or b'N', got {bytes([marker])!r}", off)
    new, off = _tuple(data, _expect_new(data, off))
    return Update(xid, relid, old_kind, old, new), off


def _delete(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    (relid,) = _unpack(_U32, data, off, "relation OID")
    off += 4
    (marker,) = _unpack(_U8, data, off, "old tuple marker")
    if marker not in (_KEY, _OLD):
        raise _Malformed(f"expected b'K' or b'O', got {bytes([marker])!r}", off)
    old, off = _tuple(data, off + 1)
    return Delete(xid, relid, chr(marker), old), off


def _truncate(data: bytes, in_stream: bool) -> _Parsed:
    xid, off = _xid(data, in_stream)
    count, options = _unpack(_TRUNCATE_HEAD, data, off, "Truncate header")
    off += _TRUNCATE_HEAD.size
    if count < 0:
        raise _Malformed(f"negative relation count {count}", off - _TRUNCATE_HEAD.size)
    _need(data, off, 4 * count, f"{count} relation OIDs")
    oids = struct.unpack_from(f"!{count}I", data, off)
    return Truncate(xid, options, oids), off + 4 * count


def _stream_start(data: bytes, in_stream: bool) -> _Parsed:
    xid, first = _unpack(_STREAM_START, data, 1, "Stream Start")
    return StreamStart(xid, bool(first)), 1 + _STREAM_START.size


def _stream_stop(data: bytes, in_stream: bool) -> _Parsed:
    return StreamStop(), 1


def _stream_commit(data: bytes, in_stream: bool) -> _Parsed:
    xid, flags, commit_lsn, end_lsn, commit_ts = _unpack(_STREAM_COMMIT, data, 1, "Stream Commit")
    return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_ts), 1 + _STREAM_COMMIT.size


def _stream_abort(data: bytes, in_stream: bool) -> _Parsed:
    # Protocol 4 with streaming=parallel appends the abort LSN and timestamp; nothing in the
    # message says so, the length does.
    rest = len(data) - 1
    if rest == _STREAM_ABORT.size:
        xid, subxid = _STREAM_ABORT.unpack_from(data, 1)
        return StreamAbort(xid, subxid, None, None), len(data)
    if rest == _STREAM_ABORT_V4.size:
        xid, subxid, abort_lsn, abort_ts = _STREAM_ABORT_V4.unpack_from(data, 1)
        return StreamAbort(xid, subxid, abort_lsn, abort_ts), len(data)
    raise _Malformed(f"Stream Abort must have 8 or 24 bytes after the tag, has {rest}", 1)


def _begin_prepare(data: bytes, in_stream: bool) -> _Parsed:
    prepare_lsn, end_lsn, prepare_ts, xid = _unpack(_BEGIN_PREPARE, data, 1, "Begin Prepare")
    gid, off = _string(data, 1 + _BEGIN_PREPARE.size, "gid")
    return BeginPrepare(prepare_lsn, end_lsn, prepare_ts, xid, gid), off


def _prepare(data: bytes, in_stream: bool) -> _Parsed:
    flags, lsn, end_lsn, ts, xid = _unpack(_PREPARE, data, 1, "Prepare")
    gid, off = _string(data, 1 + _PREPARE.size, "gid")
    return Prepare(flags, lsn, end_lsn, ts, xid, gid), off


def _commit_prepared(data: bytes, in_stream: bool) -> _Parsed:
    flags, lsn, end_lsn, ts, xid = _unpack(_PREPARE, data, 1, "Commit Prepared")
    gid, off = _string(data, 1 + _PREPARE.size, "gid")
    return CommitPrepared(flags, lsn, end_lsn, ts, xid, gid), off


def _rollback_prepared(data: bytes, in_stream: bool) -> _Parsed:
    flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid = _unpack(
        _ROLLBACK_PREPARED, data, 1, "Rollback Prepared"
    )
    gid, off = _string(data, 1 + _ROLLBACK_PREPARED.size, "gid")
    return RollbackPrepared(flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid, gid), off


def _stream_prepare(data: bytes, in_stream: bool) -> _Parsed:
    flags, lsn, end_lsn, ts, xid = _unpack(_PREPARE, data, 1, "Stream Prepare")
    gid, off = _string(data, 1 + _PREPARE.size, "gid")
    return StreamPrepare(flags, lsn, end_lsn, ts, xid, gid), off


_PARSERS: dict[int, Callable[[bytes, bool], _Parsed]] = {
    BEGIN: _begin,
    MESSAGE: _message,
    COMMIT: _commit,
    ORIGIN: _origin,
    RELATION: _relation,
    TYPE: _type,
    INSERT: _insert,
    UPDATE: _update,
    DELETE: _delete,
    TRUNCATE: _truncate,
    STREAM_START: _stream_start,
    STREAM_STOP: _stream_stop,
    STREAM_COMMIT: _stream_commit,
    STREAM_ABORT: _stream_abort,
    BEGIN_PREPARE: _begin_prepare,
    PREPARE: _prepare,
    COMMIT_PREPARED: _commit_prepared,
    ROLLBACK_PREPARED: _rollback_prepared,
    STREAM_PREPARE: _stream_prepare,
}

# ------------------------------------------------------------------------ entry points


def _as_bytes(buf: bytes | bytearray | memoryview) -> bytes:
    if type(buf) is bytes:
        return buf
    if isinstance(buf, bytes | bytearray | memoryview):
        return bytes(buf)
    raise DecodeError(f"expected a bytes-like message, got {type(buf).__name__}")


def parse_message(
    buf: bytes | bytearray | memoryview, *, in_stream: bool = False, lsn: int | None = None
) -> Message:
    """Decode one pgoutput message.

    ``in_stream`` says the message lies between Stream Start and Stream Stop, so the
    messages that can belong to a streamed transaction carry a leading xid. ``lsn`` (the
    LSN of the row the message came from) only goes into error messages.
    """
    data = _as_bytes(buf)
    if not data:
        raise DecodeError("empty message", offset=0, lsn=lsn)
    tag = data[0]
    parser = _PARSERS.get(tag)
    if parser is None:
        raise DecodeError(f"unknown message tag {bytes([tag])!r}", tag=chr(tag), offset=0, lsn=lsn)
    try:
        message, end = parser(data, in_stream)
    except _Malformed as exc:
        raise DecodeError(exc.reason, tag=chr(tag), offset=exc.offset, lsn=lsn) from exc.__cause__
    except (struct.error, IndexError, ValueError, OverflowError) as exc:  # a bug here, not in the bytes
        raise DecodeError(f"internal decoder error: {exc}", tag=chr(tag), lsn=lsn) from exc
    if end != len(data):
        raise DecodeError(f"{len(data) - end} bytes of trailing garbage", tag=chr(tag), offset=end, lsn=lsn)
    return message


def parse_tuple(buf: bytes | bytearray | memoryview, offset: int) -> tuple[TupleData, int]:
    """Decode the TupleData part starting at ``offset``; returns it and the offset just after it.

    Does not copy a ``bytes`` buffer. Errors are :class:`DecodeError` with the offset into ``buf``.
    """
    data: _Buf
    if type(buf) is bytes:
        data = buf
    elif isinstance(buf, memoryview) and buf.ndim == 1 and buf.format in ("B", "b", "c") and buf.c_contiguous:
        data = buf.cast("B")
    elif isinstance(buf, bytes | bytearray | memoryview):
        data = bytes(buf)
    else:
        raise DecodeError(f"expected a bytes-like buffer, got {type(buf).__name__}")
    if offset < 0 or offset > len(data):
        raise DecodeError(f"offset {offset} outside a buffer of {len(data)} bytes", offset=offset)
    try:
        return _tuple(data, offset)
    except _Malformed as exc:
        raise DecodeError(exc.reason, offset=exc.offset) from exc.__cause__
