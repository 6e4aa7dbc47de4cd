"""The source side: one logical replication slot (pgoutput), read by bounded, streamed windows.

Reading never consumes the slot: rows come from ``pg_logical_slot_peek_binary_changes``
streamed through ``COPY ... TO STDOUT (FORMAT binary)``, so client memory stays bounded
whatever the window size (the COPY's blocks and rows: :mod:`pg2delta.source.copydata`). The slot
moves only through :meth:`SlotSource.advance`, which the job calls after every Delta commit of the
window has succeeded.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import psycopg
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
from pg2delta.source.copydata import TRAILER, CopyWalk, copy_blocks

log = logging.getLogger(__name__)

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

    @staticmethod
    def columns(server_version: int) -> str:
        """The columns of ``pg_replication_slots`` :meth:`from_row` reads, as the server has them (NULL where it has not)."""
        cols = "slot_name, plugin, slot_type, database, confirmed_flush_lsn, restart_lsn, wal_status, safe_wal_size, active_pid, two_phase"
        cols += ", conflicting" if server_version >= 160000 else ", NULL"
        return cols + (", invalidation_reason, failover, synced" if server_version >= 170000 else ", NULL, NULL, NULL")

    @classmethod
    def from_row(cls, r: Sequence[object]) -> SlotInfo:
        """The slot of a row of :meth:`columns`."""
        return cls(
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

    QUERY: ClassVar[str] = (
        "SELECT current_setting('server_version_num')::int, pg_is_in_recovery(), "
        "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_flush_lsn() END, "
        "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END, "
        "(SELECT CASE WHEN setting::bigint < 0 THEN NULL ELSE setting::bigint * "
        "  pg_size_bytes(CASE WHEN unit ~ '^[0-9]' THEN unit ELSE '1' || unit END) END "
        "  FROM pg_settings WHERE name = 'max_slot_wal_keep_size'), "
        "(extract(epoch FROM clock_timestamp()) * 1000000)::int8"
    )

    @classmethod
    def from_row(cls, r: Sequence[object]) -> ServerState:
        """The state of the row :data:`QUERY` returns."""
        flush, current = _lsn_value(r[2]), _lsn_value(r[3])
        return cls(
            version_num=int(str(r[0])),
            in_recovery=bool(r[1]),
            flush_lsn=flush or 0,
            current_lsn=current or 0,
            max_slot_wal_keep_size=None if r[4] is None else int(str(r[4])),
            now_us=int(str(r[5])),
        )


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
        rows = self._query(
            f"SELECT {SlotInfo.columns(self.server_version)} FROM pg_replication_slots WHERE slot_name = %s", (self.slot,)
        )
        return SlotInfo.from_row(rows[0]) if rows else None

    def server_state(self) -> ServerState:
        return ServerState.from_row(self._query(ServerState.QUERY)[0])

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
                framer.more = after is not None and bytes(after) != TRAILER
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
                        while len(after) < len(TRAILER) and (following := next(it, None)) is not None:
                            after += following
                        if after:
                            self.more = after != TRAILER
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
