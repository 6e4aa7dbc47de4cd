"""The source side: one logical replication slot (pgoutput), read by bounded, streamed windows.

Reading never consumes the slot: rows come from ``pg_logical_slot_peek_binary_changes``
streamed through ``COPY ... TO STDOUT (FORMAT binary)``, so client memory stays bounded
whatever the window size. The slot moves only through :meth:`SlotSource.advance`, which
the job calls after every Delta commit of the window has succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import psycopg
from psycopg import sql

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
_ROW_PREFIX = 26  # int16 nfields, int32 len, int64 lsn, int32 len, int32 xid, int32 len


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
        cols += ", invalidation_reason" if self.server_version >= 170000 else ", NULL"
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

    def create_slot(self) -> SlotInfo:
        try:
            self._query("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (self.slot,))
        except psycopg.errors.DuplicateObject:
            pass
        except psycopg.Error as exc:
            raise SourceStateError(f"cannot create slot {self.slot!r}: {' '.join(str(exc).split())}") from exc
        log.info("created replication slot %s", self.slot)
        info = self.slot_info()
        assert info is not None
        return info

    def check(self, *, create: bool = False) -> SlotInfo:
        """The slot, checked to be usable by this job; raises SourceStateError otherwise."""
        info = self.slot_info()
        if info is None:
            if not create:
                raise SourceStateError(
                    f"replication slot {self.slot!r} does not exist; create it with --create-slot "
                    "(or pg2delta bootstrap) and run again"
                )
            info = self.create_slot()
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
                "drop it and bootstrap the lake again (README: recovering from an invalidated slot)"
            )
        if info.active_pid is not None:
            raise SlotBusy(f"slot {self.slot!r} is in use by server process {info.active_pid}; this run did nothing")
        if not self._query("SELECT 1 FROM pg_publication WHERE pubname = %s", (self.publication,)):
            raise SourceStateError(f"publication {self.publication!r} does not exist in database {dbname!r}")
        return info

    def flush_lsn(self) -> int:
        (value,) = self._query("SELECT pg_current_wal_flush_lsn()")[0]
        lsn = _lsn_value(value)
        assert lsn is not None
        return lsn

    def locked_bounds(self, until_lsn: int | None, *, create: bool = False) -> tuple[int, int]:
        """Take the slot's lock, check the slot, and return where a run starts (its confirmed
        position) and where it stops: ``until_lsn``, never beyond the server's flushed WAL (the
        slot cannot go there, and a window logged as ending there would make every later change
        look applied)."""
        self.lock()
        info = self.check(create=create)
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
        chunk_rows: int = 50_000,
        chunk_bytes: int = 32 << 20,
    ) -> Iterator[RowChunk | WindowRead]:
        """Stream the window's rows as :class:`RowChunk` objects, then one :class:`WindowRead`.

        Stops at ``upto_lsn``, after ``max_changes`` rows (at a transaction boundary, as the
        server does), or at the first commit after ``max_bytes`` bytes, whichever comes first.
        """
        query = _peek_copy(self.slot, upto_lsn, max_changes, self.peek_options())
        total_rows = 0
        total_bytes = 0
        last_commit: int | None = None
        pieces: list[bytes] = []
        piece_bytes = 0
        capped_by_bytes = False
        header_seen = False
        cur = self.conn.cursor()
        try:
            with cur.copy(query) as copy:
                for data in copy:
                    piece = bytes(data)
                    if not header_seen:
                        if not piece.startswith(_COPY_SIGNATURE):
                            raise DecodeError("COPY stream without binary signature", offset=0)
                        piece = piece[_COPY_HEADER_LEN:]
                        header_seen = True
                        if not piece:
                            continue
                    if piece == b"\xff\xff":  # end-of-data marker
                        continue
                    pieces.append(piece)
                    piece_bytes += len(piece)
                    total_rows += 1
                    if len(piece) > _ROW_PREFIX and piece[_ROW_PREFIX] == po.COMMIT:
                        last_commit = int.from_bytes(piece[6:14], "big")
                        if max_bytes is not None and total_bytes + piece_bytes >= max_bytes:
                            capped_by_bytes = True
                    if capped_by_bytes or len(pieces) >= chunk_rows or piece_bytes >= chunk_bytes:
                        total_bytes += piece_bytes
                        yield _frame(pieces)
                        pieces, piece_bytes = [], 0
                        if capped_by_bytes:
                            break
                if capped_by_bytes:
                    # Stop the server, then take what it sent before stopping: psycopg leaves a COPY TO
                    # left early unread, and the connection would refuse every later command.
                    self.conn.cancel_safe()
                    for _ in copy:
                        pass
        except psycopg.errors.QueryCanceled:
            if not capped_by_bytes:
                raise ConnectionFailed("the window read was cancelled by the server") from None
        except psycopg.Error as exc:
            raise _read_error(self.slot, exc) from exc
        finally:
            cur.close()
        if pieces:
            total_bytes += piece_bytes
            yield _frame(pieces)
        capped = capped_by_bytes or (max_changes is not None and total_rows >= max_changes)
        yield WindowRead(total_rows, total_bytes, last_commit, capped)

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


def _frame(pieces: list[bytes]) -> RowChunk:
    """Binary COPY rows (lsn pg_lsn, xid xid, data bytea) -> a RowChunk, checked in bulk."""
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    buf = b"".join(pieces)
    row_ends = np.cumsum(lengths)
    row_starts = row_ends - lengths
    u8 = np.frombuffer(buf, dtype=np.uint8)
    if (lengths < _ROW_PREFIX).any():
        raise DecodeError("COPY row shorter than its fixed fields", offset=0)
    head = np.array([0, 3, 0, 0, 0, 8], dtype=np.uint8)
    ok = np.ones(len(pieces), dtype=bool)
    for k, b in enumerate(head):
        ok &= u8[row_starts + k] == b
    ok &= (u8[row_starts + 14] == 0) & (u8[row_starts + 15] == 0) & (u8[row_starts + 16] == 0) & (u8[row_starts + 17] == 4)
    data_len = (
        (u8[row_starts + 22].astype(np.int64) << 24)
        | (u8[row_starts + 23].astype(np.int64) << 16)
        | (u8[row_starts + 24].astype(np.int64) << 8)
        | u8[row_starts + 25]
    )
    ok &= row_starts + _ROW_PREFIX + data_len == row_ends
    if not ok.all():
        raise DecodeError("COPY row is not (pg_lsn, xid, bytea)", offset=int(np.flatnonzero(~ok)[0]))
    lsn = np.zeros(len(pieces), dtype=np.uint64)
    for k in range(8):
        lsn = (lsn << np.uint64(8)) | u8[row_starts + 6 + k].astype(np.uint64)
    return RowChunk(buf, lsn.view(np.int64), row_starts + _ROW_PREFIX, row_ends)
