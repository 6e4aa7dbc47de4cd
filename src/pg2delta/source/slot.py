"""The source side: one logical replication slot (pgoutput), read by bounded, streamed windows.

Reading never consumes the slot: rows come from ``pg_logical_slot_peek_binary_changes``
streamed through ``COPY ... TO STDOUT (FORMAT binary)``, so client memory stays bounded
whatever the window size. The slot moves only through :meth:`SlotSource.advance`, which
the job calls after every Delta commit of the window has succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import logging
import os
import select
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import pq as libpq
from psycopg import sql

from pg2delta.decode import _tuples
from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import RowChunk
from pg2delta.errors import (
    ConfigError,
    ConnectionFailed,
    DecodeError,
    Pg2DeltaError,
    SlotBusy,
    SourceStateError,
)
from pg2delta.lsn import format_lsn

log = logging.getLogger(__name__)

_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_COPY_HEADER_LEN = 19  # signature (11) + flags (4) + extension length (4)
_TRAILER = b"\xff\xff"  # the end of binary COPY data
_ROW_PREFIX = 26  # int16 nfields, int32 len, int64 lsn, int32 len, int32 xid, int32 len
_CHANGE_TAGS = np.array([po.INSERT, po.UPDATE, po.DELETE, po.TRUNCATE], dtype=np.uint8)
CHUNK_ROWS = 50_000  # rows of the slot function per RowChunk, at most
CHUNK_BYTES = 8 << 20  # bytes of CopyData gathered before their rows are framed


def connect(dsn: str, *, application_name: str = "pg2delta", connect_timeout: int = 10) -> psycopg.Connection[tuple[object, ...]]:
    """A connection, with failures mapped to pg2delta errors (wrong password is not retryable)."""
    try:
        # Text-format values (types without a binary send function) are parsed assuming these.
        return psycopg.connect(
            dsn,
            autocommit=True,
            application_name=application_name,
            connect_timeout=connect_timeout,
            options="-c DateStyle=ISO -c IntervalStyle=postgres -c bytea_output=hex -c extra_float_digits=3",
        )
    except psycopg.OperationalError as exc:
        text = " ".join(str(exc).split())
        if "password authentication failed" in text or "no password supplied" in text or "does not exist" in text:
            # Retrying cannot help: a refused login needs a human (exit 78).
            raise ConnectionFailed(f"cannot log in to PostgreSQL: {text}", retryable=False) from exc
        raise ConnectionFailed(f"cannot connect to PostgreSQL: {text}") from exc
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"invalid connection string: {exc}") from exc


@dataclass(frozen=True, slots=True)
class SlotInfo:
    name: str
    plugin: str
    slot_type: str
    database: str
    confirmed_flush_lsn: int | None
    restart_lsn: int | None
    wal_status: str | None
    safe_wal_size: int | None
    active_pid: int | None
    two_phase: bool
    invalidation_reason: str | None = None  # PostgreSQL 17 and later; None before
    conflicting: bool | None = None  # PostgreSQL 16 and later: invalidated by a recovery conflict
    failover: bool | None = None  # PostgreSQL 17 and later: a failover slot (synchronized to standbys)
    synced: bool | None = None  # PostgreSQL 17 and later: a standby's copy of a failover slot (kept after a promotion)

    @property
    def invalidated(self) -> bool:
        """The slot can no longer be read: its WAL was removed, or the server invalidated it otherwise."""
        return (
            self.wal_status == "lost"
            or self.invalidation_reason is not None
            or bool(self.conflicting)
            or (self.slot_type == "logical" and self.confirmed_flush_lsn is None)
        )


@dataclass(frozen=True, slots=True)
class ServerState:
    """Where the server's WAL is, for lag and retention (``pg2delta status``)."""

    version_num: int
    in_recovery: bool
    flush_lsn: int  # the WAL flush position (the replay position on a standby)
    current_lsn: int  # the WAL insert position (the replay position on a standby)
    max_slot_wal_keep_size: int | None  # bytes; None: unlimited (-1)
    now_us: int  # the server's clock, microseconds since 1970 (UTC)


@dataclass(frozen=True, slots=True)
class WindowRead:
    """What one window read returned, once the rows have all been consumed."""

    rows: int
    bytes: int
    last_commit_end_lsn: int | None
    capped: bool  # stopped by the change or byte cap before reaching the upper bound


def _lsn_value(text: object) -> int | None:
    if text is None:
        return None
    hi, lo = str(text).split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


_LOCK = "SELECT pg_try_advisory_lock(hashtextextended('pg2delta slot ' || %s, 0))"
_UNLOCK = "SELECT pg_advisory_unlock(hashtextextended('pg2delta slot ' || %s, 0))"


class SlotSource:
    """A control connection to the source database, holding the run's advisory lock."""

    def __init__(self, dsn: str, slot: str, publication: str, *, connect_timeout: int = 10) -> None:
        self.dsn = dsn
        self.slot = slot
        self.publication = publication
        self.conn = connect(dsn, connect_timeout=connect_timeout)
        self._locked = False
        self.server_version = self.conn.info.server_version

    def close(self) -> None:
        # Release the lock before closing: the server drops a session's locks only once its backend
        # has exited, after the client is gone, so a run started right after this one could still
        # find the slot locked and exit 73.
        self.unlock()
        with contextlib.suppress(psycopg.Error):
            self.conn.close()

    def __enter__(self) -> SlotSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _query(self, query: str | sql.Composed, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        try:
            return self.conn.execute(query, params).fetchall()
        except psycopg.OperationalError as exc:
            raise ConnectionFailed(f"lost the connection to PostgreSQL: {' '.join(str(exc).split())}") from exc

    # --- checks -------------------------------------------------------------------------------

    def lock(self) -> None:
        """Take the per-slot advisory lock for this run, or fail at once if another run has it."""
        (got,) = self._query(_LOCK, (self.slot,))[0]
        if not got:
            raise SlotBusy(f"another pg2delta run is using slot {self.slot!r}; this run did nothing")
        self._locked = True

    def unlock(self) -> None:
        """Release this run's advisory lock, if it holds it."""
        if self._locked:
            with contextlib.suppress(psycopg.Error):
                self.conn.execute(_UNLOCK, (self.slot,))
            self._locked = False

    def slot_info(self) -> SlotInfo | None:
        cols = "slot_name, plugin, slot_type, database, confirmed_flush_lsn, restart_lsn, wal_status, safe_wal_size, active_pid, two_phase"
        cols += ", conflicting" if self.server_version >= 160000 else ", NULL"
        cols += ", invalidation_reason, failover, synced" if self.server_version >= 170000 else ", NULL, NULL, NULL"
        rows = self._query(f"SELECT {cols} FROM pg_replication_slots WHERE slot_name = %s", (self.slot,))
        if not rows:
            return None
        r = rows[0]
        return SlotInfo(
            name=str(r[0]),
            plugin=str(r[1]),
            slot_type=str(r[2]),
            database=str(r[3]),
            confirmed_flush_lsn=_lsn_value(r[4]),
            restart_lsn=_lsn_value(r[5]),
            wal_status=None if r[6] is None else str(r[6]),
            safe_wal_size=None if r[7] is None else int(str(r[7])),
            active_pid=None if r[8] is None else int(str(r[8])),
            two_phase=bool(r[9]),
            conflicting=None if r[10] is None else bool(r[10]),
            invalidation_reason=None if r[11] is None else str(r[11]),
            failover=None if r[12] is None else bool(r[12]),
            synced=None if r[13] is None else bool(r[13]),
        )

    def server_state(self) -> ServerState:
        rows = self._query(
            "SELECT current_setting('server_version_num')::int, pg_is_in_recovery(), "
            "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_flush_lsn() END, "
            "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, "
            "(SELECT CASE WHEN setting::bigint < 0 THEN NULL ELSE setting::bigint * "
            "  pg_size_bytes(CASE WHEN unit ~ '^[0-9]' THEN unit ELSE '1' || unit END) END "
            "  FROM pg_settings WHERE name = 'max_slot_wal_keep_size'), "
            "(extract(epoch FROM clock_timestamp()) * 1000000)::int8"
        )
        r = rows[0]
        flush, current = _lsn_value(r[2]), _lsn_value(r[3])
        return ServerState(
            version_num=int(str(r[0])),
            in_recovery=bool(r[1]),
            flush_lsn=flush or 0,
            current_lsn=current or 0,
            max_slot_wal_keep_size=None if r[4] is None else int(str(r[4])),
            now_us=int(str(r[5])),
        )

    def check(self) -> SlotInfo:
        """The slot, checked to be usable by this job; raises SourceStateError otherwise."""
        info = self.slot_info()
        if info is None:
            raise SourceStateError(
                f"replication slot {self.slot!r} does not exist; create it with --create-slot "
                "(or pg2delta bootstrap) and run again"
            )
        if info.slot_type != "logical" or info.plugin != "pgoutput":
            raise SourceStateError(
                f"slot {self.slot!r} uses plugin {info.plugin!r} ({info.slot_type}); pg2delta needs a logical pgoutput slot"
            )
        if info.two_phase:
            # Such a slot sends a prepared transaction at PREPARE time, before it is decided; a
            # window ending between PREPARE and COMMIT PREPARED would lose or wrongly apply it.
            raise SourceStateError(
                f"slot {self.slot!r} was created with two-phase decoding, which pg2delta does not support: "
                "create a slot without it (pg2delta run --create-slot with a new --slot name)"
            )
        (dbname,) = self._query("SELECT current_database()")[0]
        if info.database != dbname:
            raise SourceStateError(f"slot {self.slot!r} belongs to database {info.database!r}, not {dbname!r}")
        if info.invalidated:
            why = f"wal_status={info.wal_status}"
            if info.invalidation_reason is not None:
                why += f", invalidation_reason={info.invalidation_reason}"
            raise SourceStateError(
                f"slot {self.slot!r} is invalidated ({why}); its changes are gone: "
                "drop it and bootstrap the lake again (docs: operations/guide, Recovering from an invalidated slot)"
            )
        if info.active_pid is not None:
            raise SlotBusy(f"slot {self.slot!r} is in use by server process {info.active_pid}; this run did nothing")
        if not self._query("SELECT 1 FROM pg_publication WHERE pubname = %s", (self.publication,)):
            raise SourceStateError(f"publication {self.publication!r} does not exist in database {dbname!r}")
        return info

    def flush_lsn(self) -> int:
        """The server's flushed WAL; a standby (the DSN pointed at it before its promotion) is refused, 75."""
        recovery, value = self._query(
            "SELECT pg_is_in_recovery(), CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_flush_lsn() END"
        )[0]
        if recovery:
            raise SourceStateError("this server is a standby in recovery: pg2delta reads its slot on the primary "
                                   "(retry once it is promoted, or point the DSN at the primary)", retryable=True)
        lsn = _lsn_value(value)
        assert lsn is not None
        return lsn

    def locked_bounds(self, until_lsn: int | None) -> tuple[int, int]:
        """Take the slot's lock, check the slot, and return :meth:`bounds` (a run takes them through
        pg2delta.failover.run_bounds, which may create the slot first)."""
        self.lock()
        return self.bounds(self.check(), until_lsn)

    def bounds(self, info: SlotInfo, until_lsn: int | None) -> tuple[int, int]:
        """Where a run starts (the slot's confirmed position) and where it stops: ``until_lsn``, never
        beyond the server's flushed WAL (the slot cannot go there, and a window logged as ending
        there would make every later change look applied)."""
        assert info.confirmed_flush_lsn is not None
        flush = self.flush_lsn()
        return info.confirmed_flush_lsn, flush if until_lsn is None else min(until_lsn, flush)

    def system_identifier(self) -> int:
        """The server's system identifier (new for every initdb; WAL positions are only comparable within one)."""
        (value,) = self._query("SELECT system_identifier FROM pg_control_system()")[0]
        return int(str(value))

    def current_lsn(self) -> int:
        (value,) = self._query("SELECT pg_current_wal_lsn()")[0]
        lsn = _lsn_value(value)
        assert lsn is not None
        return lsn

    # --- reading -----------------------------------------------------------------------------

    def peek_options(self) -> list[str]:
        # Streaming and two-phase stay off: the server then hands over whole transactions
        # at commit, in commit order (it spills large ones to disk itself).
        return [
            "proto_version", "1",
            "publication_names", self.publication,
            "binary", "true",
            "messages", "true",
        ]

    def read_window(
        self,
        upto_lsn: int,
        *,
        max_changes: int | None,
        max_bytes: int | None,
        chunk_rows: int = CHUNK_ROWS,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> Iterator[RowChunk | WindowRead]:
        """Stream the window's rows as :class:`RowChunk` objects, then one :class:`WindowRead`.

        Stops at ``upto_lsn``, or at the first commit once ``max_changes`` changes (inserts,
        updates, deletes, truncates) or ``max_bytes`` bytes were read, whichever comes first. The
        server materializes its peek before sending anything, so it is bounded too: it stops at the
        first commit past :func:`server_rows` rows of its output (Begin, Commit and Relation rows
        count there; a tenth more than ``max_changes`` leaves room for them, so ``max_changes``
        changes in transactions of a few rows or more fit in one window).
        The CopyData blocks are appended to one buffer (:func:`copy_blocks`); every ``chunk_bytes``
        its whole rows are framed in C (``_tuples.walk_copy``), at most ``chunk_rows`` per chunk:
        no Python work per row.
        """
        bound = server_rows(max_changes)
        query = _peek_copy(self.slot, upto_lsn, bound, self.peek_options())
        framer = _Framer(max_changes, max_bytes, chunk_rows)
        blocks = copy_blocks(self.conn, query)
        try:
            yield from framer.chunks(blocks, chunk_bytes)
            if framer.cut and framer.more is None:  # the cut is the last row read: see whether more follow
                after = next(blocks, None)
                framer.more = after is not None and bytes(after) != _TRAILER
            if framer.more:
                # Stop the server, then take what it sent before stopping: psycopg leaves a COPY TO
                # left early unread, and the connection would refuse every later command.
                self.conn.cancel_safe()
            for _ in blocks:
                pass
        except psycopg.errors.QueryCanceled:
            if not framer.more:
                raise ConnectionFailed("the window read was cancelled by the server") from None
        except psycopg.Error as exc:
            raise _read_error(self.slot, exc) from exc
        finally:
            blocks.close()
        # Capped: the cut left rows of the window's range unread, or the server stopped at its bound.
        capped = bool(framer.cut and framer.more) or (bound is not None and framer.rows >= bound)
        yield WindowRead(framer.rows, framer.bytes, framer.last_commit, capped)

    def scratch_copy(self) -> SlotSource | None:
        """A temporary copy of the slot (same confirmed position), on this connection, for reading
        window after window without moving the slot (``pg2delta plan``): peeks of the copy and
        :meth:`advance` of it leave the slot alone; the server drops it when this session ends.
        None (logged) when the server cannot make one (no free ``max_replication_slots`` entry)."""
        name = f"pg2delta_plan_{uuid.uuid4().hex[:16]}"
        try:
            self.conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true)", (self.slot, name))
        except (psycopg.errors.ConfigurationLimitExceeded, psycopg.errors.InsufficientPrivilege,
                psycopg.errors.ObjectNotInPrerequisiteState) as exc:
            log.warning("cannot make a temporary copy of slot %r: %s", self.slot, " ".join(str(exc).split()))
            return None
        except psycopg.OperationalError as exc:
            raise ConnectionFailed(f"lost the connection while copying the slot: {' '.join(str(exc).split())}") from exc
        except psycopg.Error as exc:
            raise SourceStateError(f"cannot copy slot {self.slot!r}: {' '.join(str(exc).split())}") from exc
        scratch = copy.copy(self)
        scratch.slot = name
        scratch._locked = False  # the lock stays with (and is released by) this source
        return scratch

    def drop_scratch(self, scratch: SlotSource) -> None:
        """Drop a copy made by :meth:`scratch_copy` now (it would go with the session anyway)."""
        with contextlib.suppress(psycopg.Error):
            self.conn.execute("SELECT pg_drop_replication_slot(%s)", (scratch.slot,))

    def advance(self, lsn: int) -> int:
        """Move the slot's confirmed position to ``lsn``; returns where it ended up."""
        try:
            rows = self._query("SELECT end_lsn FROM pg_replication_slot_advance(%s, %s::pg_lsn)", (self.slot, format_lsn(lsn)))
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                raise ConnectionFailed(f"lost the connection while advancing the slot: {exc}") from exc
            raise SourceStateError(f"cannot advance slot {self.slot!r}: {' '.join(str(exc).split())}") from exc
        end = _lsn_value(rows[0][0])
        assert end is not None
        return end


def server_rows(max_changes: int | None) -> int | None:
    """The server's bound on a window's rows (its peek's ``upto_nchanges``) for ``max_changes``
    changes: a tenth more, for the Begin, Commit and Relation rows it counts too."""
    return None if not max_changes else max_changes + max(max_changes // 10, 1)


def _peek_copy(slot: str, upto_lsn: int, max_changes: int | None, options: list[str]) -> sql.Composed:
    """The COPY that streams a window's rows (lsn, xid, data) in binary format."""
    return sql.SQL(
        "COPY (SELECT lsn, xid, data FROM pg_logical_slot_peek_binary_changes({slot}, {upto}::pg_lsn, {n}, {opts})) "
        "TO STDOUT (FORMAT binary)"
    ).format(
        slot=sql.Literal(slot),
        upto=sql.Literal(format_lsn(upto_lsn)),
        n=sql.Literal(max_changes) if max_changes else sql.SQL("NULL"),
        opts=sql.SQL(", ").join(sql.Literal(o) for o in options),
    )


def _read_error(slot: str, exc: psycopg.Error) -> Pg2DeltaError:
    """The pg2delta error for a failed window read of ``slot``."""
    text = " ".join(str(exc).split())
    if isinstance(exc, psycopg.errors.UndefinedObject):
        return SourceStateError(text)
    if isinstance(exc, psycopg.errors.ObjectInUse):
        return SlotBusy(text)
    if isinstance(exc, psycopg.OperationalError):
        return ConnectionFailed(f"lost the connection while reading the slot: {text}")
    return SourceStateError(f"cannot read slot {slot!r}: {text}")


class CopyWalk:
    """Binary COPY data (``COPY … TO STDOUT (FORMAT binary)``), walked in C: the file header, then
    rows of ``ncols`` fields (``_tuples.walk_copy``: field count, per field its length, -1 for NULL,
    and the bytes, every read bounds-checked), then the trailer. The window read and the
    bootstrap's copy both read their COPY through it. ``subject`` names the stream in errors
    (``COPY of public.t``); ``malformed`` is the message of a bad row, with ``{row}`` and ``{reason}``."""

    def __init__(self, ncols: int, value_kinds: bytes, cap: int, subject: str, malformed: str) -> None:
        self.ncols, self.value_kinds, self.cap = ncols, value_kinds, cap
        self.subject, self.malformed = subject, malformed
        self.rows = 0  # rows walked so far
        self.header_seen = False
        self.ended = False

    def walk(self, buf: bytes, take: Callable[[Any, Any, Any], bool], *, last: bool = False) -> int:
        """Hand the whole rows of ``buf`` to ``take(kinds, starts, lengths)`` (per column, at most
        ``cap`` rows a call; ``take`` returns False to stop there). Returns the offset of the rest: a
        row cut at the end of ``buf``, to be completed by the next blocks. ``last``: no more come."""
        pos = 0
        if not self.header_seen:
            if len(buf) < _COPY_HEADER_LEN:
                if last:
                    raise DecodeError(f"{self.subject} ends in its header", offset=0)
                return 0
            if not buf.startswith(_COPY_SIGNATURE):
                raise DecodeError(f"{self.subject} without binary signature", offset=0)
            pos = _COPY_HEADER_LEN + int.from_bytes(buf[_COPY_HEADER_LEN - 4:_COPY_HEADER_LEN], "big")
            if len(buf) < pos:
                if last:
                    raise DecodeError(f"{self.subject} ends in its header", offset=0)
                return 0
            self.header_seen = True
        while pos < len(buf):
            if self.ended:
                raise DecodeError(f"{self.subject}: bytes after the trailer (after the end of the data)", offset=pos)
            kinds = np.empty((self.ncols, self.cap), dtype=np.uint8)
            starts = np.empty((self.ncols, self.cap), dtype=np.int64)
            lengths = np.empty((self.ncols, self.cap), dtype=np.int64)
            n, nxt, status, reason = _tuples.walk_copy(buf, pos, self.ncols, self.value_kinds, kinds, starts, lengths)
            if status == 2:
                raise DecodeError(self.malformed.format(row=self.rows + n, reason=reason), offset=nxt)
            go_on = True
            if n:
                go_on = take(kinds[:, :n], starts[:, :n], lengths[:, :n])
                self.rows += n
            pos = nxt
            if status == 1:
                self.ended = True
            if not go_on:
                return pos
            if status != 1 and n < self.cap:
                break  # the rest is a row cut at the end of buf
        if last and not self.ended:
            raise DecodeError(f"{self.subject} ends without its trailer (a row cut short?)", offset=pos)
        return pos


class _Framer:
    """Binary COPY rows (lsn pg_lsn, xid xid, data bytea) of a buffer -> :class:`RowChunk` objects,
    walked in C and checked in bulk; counts the rows, changes and bytes, keeps the last commit's
    LSN, and stops at the first commit once ``max_changes`` changes or ``max_bytes`` bytes were read
    (:attr:`cut`)."""

    def __init__(self, max_changes: int | None, max_bytes: int | None, chunk_rows: int) -> None:
        self.max_changes = max_changes
        self.max_bytes = max_bytes
        self.cap = chunk_rows
        self.rows = 0
        self.changes = 0  # Insert, Update, Delete and Truncate messages
        self.bytes = 0  # rows' bytes, as COPY sends them (their field count and lengths included)
        self.last_commit: int | None = None
        self.cut = False
        self.more: bool | None = None  # after a cut: whether rows follow it (None: not known yet)
        self.walk = CopyWalk(3, b"bbb", chunk_rows, "COPY stream", "malformed COPY row {row} of the slot function: {reason}")

    def chunks(self, blocks: Iterable[bytes | bytearray | memoryview], chunk_bytes: int) -> Iterator[RowChunk]:
        """The rows of ``blocks`` (CopyData blocks as they come), framed every ``chunk_bytes``;
        stops early at the first commit past ``max_changes`` or ``max_bytes`` (:attr:`cut`)."""
        acc = bytearray()
        it = iter(blocks)
        for block in it:
            acc += block
            if len(acc) >= chunk_bytes:
                framed, rest = self.frame(acc)
                yield from framed
                if self.cut:
                    if not self.more and not self.walk.ended:
                        # Whether rows follow the cut: the bytes after it, as many blocks as it takes
                        # to tell them from the trailer (a block may end inside it).
                        after = bytes(acc[rest:])
                        while len(after) < len(_TRAILER) and (following := next(it, None)) is not None:
                            after += following
                        if after:
                            self.more = after != _TRAILER
                    return
                del acc[:rest]
        yield from self.frame(acc, last=True)[0]

    def frame(self, buf: bytearray, *, last: bool = False) -> tuple[list[RowChunk], int]:
        """The whole rows of ``buf`` as chunks, and the offset of the rest (see :meth:`CopyWalk.walk`)."""
        view = bytes(buf)  # (the chunks' messages are slices of it, and stay valid after buf changes)
        framed: list[RowChunk] = []

        def take(kinds: Any, starts: Any, lengths: Any) -> bool:
            framed.append(self._chunk(view, kinds, starts, lengths))
            return not self.cut

        return framed, self.walk.walk(view, take, last=last)

    def _chunk(self, view: bytes, kinds: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> RowChunk:
        bad = (lengths[0] != 8) | (lengths[1] != 4) | (kinds != ord("b")).any(axis=0)
        if bad.any():
            raise DecodeError("COPY row is not (pg_lsn, xid, bytea)", offset=int(starts[0, np.argmax(bad)]))
        u8 = np.frombuffer(view, dtype=np.uint8)
        at = starts[0]
        lsn_bytes = np.empty(len(at) * 8, dtype=np.uint8)
        _tuples.gather_fixed(view, at, 8, lsn_bytes, True)  # big-endian on the wire
        lsn = lsn_bytes.view(np.int64)
        data_starts, data_ends = starts[2], starts[2] + lengths[2]
        sizes = lengths[2] + _ROW_PREFIX
        tags = np.where(lengths[2] > 0, u8[np.minimum(data_starts, len(u8) - 1)], 0)
        commits = np.flatnonzero(tags == po.COMMIT)
        changed = np.cumsum(np.isin(tags, _CHANGE_TAGS))
        n = len(at)
        if len(commits) and (self.max_changes is not None or self.max_bytes is not None):
            over = np.zeros(len(commits), dtype=bool)
            if self.max_changes is not None:
                over |= self.changes + changed[commits] >= self.max_changes
            if self.max_bytes is not None:
                over |= self.bytes + np.cumsum(sizes)[commits] >= self.max_bytes
            if over.any():
                n = int(commits[np.argmax(over)]) + 1
                self.cut = True
                self.more = True if n < len(at) else None
                commits = commits[commits < n]
        if len(commits):
            self.last_commit = int(lsn[commits[-1]])
        self.rows += n
        self.changes += int(changed[n - 1])
        self.bytes += int(sizes[:n].sum())
        return RowChunk(view, lsn[:n], data_starts[:n].copy(), data_ends[:n].copy())


# Bytes of CopyData taken from libpq per call of _tuples.drain_copy.
DRAIN_BYTES = 1 << 20
# When libpq has drained everything, wait for the socket, then this long more before draining
# again: the server sends a COPY in packets of a few KB, so without the pause each wake-up took
# about 125 rows (8,000 wake-ups per 1,000,000 rows, each a system call and a Python loop turn);
# with it each takes what arrived meanwhile (measured, bench/README.md: the bootstrap's staging
# uses less CPU, the bench's bootstrap 3.4-3.6 s against 3.7 s; the window read, which waits for
# the server, unchanged). The server does not wait for it: the kernel's receive buffer holds
# what arrives in the meantime.
DRAIN_PAUSE = 0.001
_DRAIN_WAIT = 0.1  # the longest wait for the socket before libpq is asked again


@functools.cache
def libpq_copy_functions() -> tuple[int, int, int] | None:
    """The addresses of PQgetCopyData, PQfreemem and PQconsumeInput in the libpq psycopg uses, for
    :func:`copy_blocks` to call from C; None where that library cannot be told for sure (not Linux,
    more than one libpq loaded, another version than psycopg's), and the copy reads through psycopg."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {
                path
                for fields in (line.split(maxsplit=5) for line in maps)
                if len(fields) == 6 and (path := fields[5].strip())
                and os.path.basename(path).startswith("libpq") and ".so" in path
            }
    except OSError:
        return None
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop())  # loaded already: the very library psycopg calls
        lib.PQlibVersion.restype = ctypes.c_int
        if lib.PQlibVersion() != libpq.version():
            return None
        return tuple(  # type: ignore[return-value]
            ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            for name in ("PQgetCopyData", "PQfreemem", "PQconsumeInput")
        )
    except (OSError, AttributeError):
        return None


def copy_blocks(
    conn: psycopg.Connection[Any], statement: sql.Composed, *, direct: bool = True
) -> Generator[bytes | memoryview, None, None]:
    """The data of ``COPY … TO STDOUT`` on ``conn``, in blocks of one or more whole CopyData messages.

    Whatever libpq holds, or can read from the socket without waiting, is taken from it in C
    (:func:`_tuples.drain_copy`, given libpq's functions by :func:`libpq_copy_functions`), up to
    :data:`DRAIN_BYTES` per block: no Python work per row. Without those functions (or ``direct``
    False) each CopyData message is taken straight from psycopg's ``PGconn.get_copy_data``, a block
    each. When libpq has nothing whole buffered, the C path waits for the socket and
    :data:`DRAIN_PAUSE` more, then drains again; the per-message path lets psycopg's ``Copy.read``
    wait (and read the end of the copy, when it comes there). When the end comes in a direct read,
    its final result is read here, as psycopg would, and an error raised as psycopg raises it.
    """
    pgconn = conn.pgconn
    # (pgconn_ptr: the PGconn's address, in every psycopg 3 implementation; not in its type stubs)
    address: int | None = getattr(pgconn, "pgconn_ptr", None)
    drain = None
    if direct and address is not None and (functions := libpq_copy_functions()) is not None:
        drain = functools.partial(_tuples.drain_copy, *functions, address, DRAIN_BYTES)
    with conn.cursor() as cur, cur.copy(statement) as copy:
        while True:
            if drain is not None:
                status, data = drain()
                if data:
                    yield data
                if status == 1:
                    continue
                if status == 0:
                    # Nothing whole is buffered: wait for the socket (the GIL released), pause so
                    # that more arrives, and drain again. A timeout, not a wait for ever: a
                    # message already inside the SSL layer leaves the socket quiet.
                    select.select([pgconn.socket], [], [], _DRAIN_WAIT)
                    time.sleep(DRAIN_PAUSE)
                    continue
                nbytes = status
            else:
                nbytes, block = pgconn.get_copy_data(1)  # 1: never block
                if nbytes > 0:
                    yield block
                    continue
            if nbytes == 0:
                if not (waited := copy.read()):
                    return
                yield memoryview(waited)
            elif nbytes == -1:  # the end of the copy: its final result (an error, if the server failed)
                failed = None
                while (res := pgconn.get_result()) is not None:
                    if res.status != libpq.ExecStatus.COMMAND_OK and failed is None:
                        failed = res
                if failed is not None:
                    raise psycopg.errors.error_from_result(failed, encoding=conn.info.encoding)
                return
            else:
                raise psycopg.OperationalError(pgconn.get_error_message(conn.info.encoding))




