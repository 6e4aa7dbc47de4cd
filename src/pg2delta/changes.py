"""The window decoder: pgoutput rows in, ordered per-table Arrow batches out.

Rows arrive as they come from ``pg_logical_slot_peek_binary_changes``: one message per
row, in the order the server emits them. The decoder

* keeps the relation cache and resolves each column's codec once per Relation message;
* follows transactions (plain, streamed, two-phase) and assigns every change its
  commit LSN and its position inside the transaction; aborted streamed (sub)transactions
  are dropped;
* walks the tuples of Insert/Update/Delete messages of a whole chunk in one bounds-checked
  pass of the C extension ``_tuples.c`` (no per-field Python work), and converts each
  column in bulk with its codec;
* emits, per relation version, one Arrow record batch in commit order, plus truncates and
  logical messages with their positions.

An Update whose old key differs from its new key becomes two rows: a delete of the old
key and the update, at consecutive positions. With ``keep_old`` (for the changelog), an
Update that keeps its key but carries the whole old row (``REPLICA IDENTITY FULL``) is also
preceded by a ``B`` row holding that old row; the lake apply drops ``B`` rows. Columns sent as
unchanged TOAST (``u``) are null in the batch and named in ``_pg2delta_toast``.

Pure: bytes in, batches out; no database, no Spark.
"""

from __future__ import annotations

import bisect
import collections
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from pg2delta import _tuples
from pg2delta import pgoutput as po
from pg2delta.errors import DecodeError
from pg2delta.typemap import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_TOAST,
    ColumnCodec,
    TypeCatalog,
    codec_for,
)
from pg2delta.typemap.datetime import TS_MAX_US, TS_MIN_US

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

# Meta columns added to every change batch.
LSN_COL = "_pg2delta_lsn"  # commit LSN of the transaction
POS_COL = "_pg2delta_pos"  # position inside the transaction (ordering key together with the LSN)
OP_COL = "_pg2delta_op"  # 'I', 'U' or 'D' (and 'B', the old row before an update, with keep_old)
BEFORE_OP = "B"
TOAST_COL = "_pg2delta_toast"  # names of columns sent as unchanged TOAST, or null
XID_COL = "_pg2delta_xid"
TS_COL = "_pg2delta_commit_ts"
META_FIELDS = (
    pa.field(LSN_COL, pa.int64(), nullable=False),
    pa.field(POS_COL, pa.int64(), nullable=False),
    pa.field(OP_COL, pa.string(), nullable=False),
    pa.field(TOAST_COL, pa.list_(pa.string())),
    pa.field(XID_COL, pa.int64()),
    pa.field(TS_COL, pa.timestamp("us", tz="UTC")),
)
META_NAMES = frozenset(f.name for f in META_FIELDS)

PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in microseconds since 1970-01-01

_CHANGE_TAGS = np.array([po.INSERT, po.UPDATE, po.DELETE], dtype=np.uint8)
# Boundary messages that name a streamed transaction's xid right after the tag, and those
# that name a prepared transaction's gid.
_XID_TAGS = frozenset({po.STREAM_START, po.STREAM_COMMIT, po.STREAM_ABORT})
_GID_TAGS = frozenset({po.PREPARE, po.STREAM_PREPARE, po.COMMIT_PREPARED, po.ROLLBACK_PREPARED})
# Where the commit timestamp is in the messages that commit a transaction.
_COMMIT_TS_AT = {po.COMMIT: 18, po.STREAM_COMMIT: 22, po.COMMIT_PREPARED: 18}
# Messages a Stream Abort of a subtransaction drops (they carry the subtransaction's xid).
# Messages an open plain transaction may hold besides changes and still be given out in parts.
_SPLITTABLE_TAGS = np.array([po.RELATION, po.TYPE, po.TRUNCATE, po.MESSAGE, po.ORIGIN], dtype=np.uint8)
_STREAMED_TAGS = np.array(
    [po.INSERT, po.UPDATE, po.DELETE, po.TRUNCATE, po.RELATION, po.TYPE, po.MESSAGE], dtype=np.uint8
)


@dataclass(frozen=True, slots=True)
class RelationVersion:
    """One shape of a table, from one Relation message; ``version`` counts per decoder."""

    version: int
    relation: po.Relation
    codecs: tuple[ColumnCodec, ...]
    key_indexes: tuple[int, ...]  # columns identifying a row (see KeyResolver)
    schema: pa.Schema  # data columns then META_FIELDS

    @property
    def oid(self) -> int:
        return self.relation.oid

    @property
    def qualified_name(self) -> tuple[str, str]:
        return (self.relation.namespace or "pg_catalog", self.relation.name)

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.relation.columns)

    @property
    def key_names(self) -> tuple[str, ...]:
        return tuple(self.relation.columns[i].name for i in self.key_indexes)


# Given a Relation message, the names of the columns that identify a row, or None to use
# the columns the message flags as key (the replica identity). The job plugs in the
# table's primary key for REPLICA IDENTITY FULL tables, and configured overrides.
KeyResolver = Callable[[po.Relation], Sequence[str] | None]


class BatchLike(Protocol):
    """Rows of one relation version in commit order: a :class:`ChangeBatch` in memory, or spilled
    to a file (:class:`pg2delta.spill.SpilledBatch`)."""

    @property
    def relation(self) -> RelationVersion: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def first_lsn(self) -> int: ...
    @property
    def max_lsn(self) -> int: ...
    @property
    def spilled(self) -> bool: ...
    def load(self) -> pa.RecordBatch: ...


@dataclass(frozen=True, slots=True)
class ChangeBatch:
    relation: RelationVersion
    batch: pa.RecordBatch  # schema == relation.schema, rows in commit order

    spilled = False

    @property
    def num_rows(self) -> int:
        return int(self.batch.num_rows)

    @property
    def first_lsn(self) -> int:
        """Commit LSN of the first row (0 when empty)."""
        return int(self.batch.column(LSN_COL)[0].as_py()) if self.batch.num_rows else 0

    @property
    def max_lsn(self) -> int:
        """Commit LSN of the last row (0 when empty); rows are in commit order."""
        return int(self.batch.column(LSN_COL)[-1].as_py()) if self.batch.num_rows else 0

    def load(self) -> pa.RecordBatch:
        """The rows (a spilled batch reads them back from its file, see :mod:`pg2delta.spill`)."""
        return self.batch


@dataclass(frozen=True, slots=True)
class TruncateEvent:
    commit_lsn: int
    pos: int
    relations: tuple[RelationVersion, ...]
    options: int
    xid: int | None = None  # of the transaction, as in the change batches' _pg2delta_xid
    commit_ts: int | None = None  # microseconds since 1970-01-01 UTC, as in _pg2delta_commit_ts


@dataclass(frozen=True, slots=True)
class MessageEvent:
    commit_lsn: int | None  # None for non-transactional messages
    pos: int
    lsn: int
    message: po.LogicalMessage


@dataclass
class DecodedChunk:
    changes: list[ChangeBatch] = field(default_factory=list)
    truncates: list[TruncateEvent] = field(default_factory=list)
    messages: list[MessageEvent] = field(default_factory=list)
    transactions: int = 0
    last_commit_end_lsn: int | None = None
    notes: collections.Counter[str] = field(default_factory=collections.Counter)
    # The commit LSN of a transaction whose first part an earlier chunk gave out (the decoder splits
    # transactions larger than ``split_rows``) but that did not commit in the window: its changes,
    # truncates and messages must be dropped.
    retracted: int | None = None

    def extend(self, other: DecodedChunk) -> None:
        """Add what ``other`` decoded after this chunk (commit order is kept)."""
        self.changes.extend(other.changes)
        self.truncates.extend(other.truncates)
        self.messages.extend(other.messages)
        self.transactions += other.transactions
        if other.last_commit_end_lsn is not None:
            self.last_commit_end_lsn = other.last_commit_end_lsn
        self.notes.update(other.notes)
        if other.retracted is not None:
            self.retracted = other.retracted


@dataclass(frozen=True, slots=True)
class RowChunk:
    """Rows of the slot function: ``buf[starts[i]:ends[i]]`` is the message of row i, at ``lsns[i]``."""

    buf: bytes
    lsns: I64
    starts: I64
    ends: I64

    def __len__(self) -> int:
        return len(self.starts)

    @classmethod
    def from_messages(cls, rows: Sequence[tuple[int, bytes]]) -> RowChunk:
        """Build a chunk from (lsn, message bytes) pairs (tests, tools)."""
        lengths = np.fromiter((len(d) for _, d in rows), dtype=np.int64, count=len(rows))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        lsns = np.fromiter((lsn for lsn, _ in rows), dtype=np.uint64, count=len(rows)).view(np.int64)
        return cls(b"".join(d for _, d in rows), lsns, starts, ends)

    def take(self, lo: int, hi: int, *, compact: bool = False) -> RowChunk:
        """Rows [lo, hi): the leading rows share this chunk's buffer (unless ``compact``), later ones
        are copied compactly."""
        if lo >= hi:
            return RowChunk(b"", np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        if lo == 0 and not compact:
            return RowChunk(self.buf, self.lsns[:hi], self.starts[:hi], self.ends[:hi])
        base = int(self.starts[lo])
        top = int(self.ends[hi - 1])
        return RowChunk(
            self.buf[base:top],
            self.lsns[lo:hi].copy(),
            self.starts[lo:hi] - base,
            self.ends[lo:hi] - base,
        )

    @staticmethod
    def concat(a: RowChunk, b: RowChunk) -> RowChunk:
        if len(a) == 0:
            return b
        if len(b) == 0:
            return a
        shift = len(a.buf)
        return RowChunk(
            a.buf + b.buf,
            np.concatenate([a.lsns, b.lsns]),
            np.concatenate([a.starts, b.starts + shift]),
            np.concatenate([a.ends, b.ends + shift]),
        )


# --- tuple walk and byte gathers (the loops are in the C extension _tuples.c) ------------------


def _be32(u8: U8, pos: I64) -> I64:
    """The big-endian unsigned Int32 at each position (positions checked against the buffer)."""
    out = np.empty(4 * len(pos), dtype=np.uint8)
    _tuples.gather_fixed(u8, np.ascontiguousarray(pos, dtype=np.int64), 4, out, sys.byteorder == "little")
    return out.view(np.uint32).astype(np.int64)


@dataclass(slots=True)
class _Tuples:
    """Column-wise view of one TupleData per row: ``kinds/starts/lengths[col, row]``."""

    kinds: U8
    starts: I64
    lengths: I64

    @classmethod
    def empty(cls, ncols: int, n: int) -> _Tuples:
        return cls(np.empty((ncols, n), np.uint8), np.empty((ncols, n), np.int64), np.empty((ncols, n), np.int64))


def _walk_changes(
    buf: bytes, tags: U8, offs: I64, ends: I64, ncols: int
) -> tuple[_Tuples, _Tuples | None, U8, tuple[int, str, int] | None]:
    """Walk the tuples of Insert/Update/Delete messages, all rows in one pass.

    Row i has tag ``tags[i]``, its K/O/N marker at ``buf[offs[i]]`` and ends at ``ends[i]``.
    Returns the new tuples, the old tuples (None when no row has one), the old tuple's
    marker per row (``K``, ``O`` or 0) and, if a row is malformed, ``(row, reason, offset
    in buf)`` for the first one (the tuples are then incomplete). Rows without an old
    tuple read as all-NULL on the old side, Deletes on the new side.
    """
    n = len(tags)
    new, old = _Tuples.empty(ncols, n), _Tuples.empty(ncols, n)
    markers = np.empty(n, np.uint8)
    bad = _tuples.walk_changes(
        buf,
        np.ascontiguousarray(tags, dtype=np.uint8),
        np.ascontiguousarray(offs, dtype=np.int64),
        np.ascontiguousarray(ends, dtype=np.int64),
        ncols,
        new.kinds, new.starts, new.lengths,
        old.kinds, old.starts, old.lengths,
        markers,
    )
    if bad is not None:
        return new, None, markers, bad
    if not markers.any():
        return new, None, markers, None  # no old tuple, hence no Delete either
    # The walk writes only the tuples that are there.
    _fill_null(old, markers == 0)
    _fill_null(new, tags == po.DELETE)
    return new, old, markers, None


def _fill_null(t: _Tuples, rows: npt.NDArray[np.bool_]) -> None:
    if rows.all():
        t.kinds.fill(KIND_NULL)
        t.starts.fill(0)
        t.lengths.fill(0)
    elif rows.any():
        t.kinds[:, rows] = KIND_NULL
        t.starts[:, rows] = 0
        t.lengths[:, rows] = 0


def _differs(u8: U8, old: _Tuples, new: _Tuples, c: int) -> npt.NDArray[np.bool_]:
    """Rows whose column ``c`` differs between the old and the new tuple (unchanged TOAST counts as equal)."""
    ko, kn = old.kinds[c], new.kinds[c]
    lo, ln = old.lengths[c], new.lengths[c]
    differs = (ko != kn) | (lo != ln)
    differs &= kn != KIND_TOAST
    has_data = (kn == KIND_TEXT) | (kn == KIND_BINARY)
    cand = np.flatnonzero(~differs & has_data & (ln > 0))
    if len(cand):
        # Compare the bytes of all candidate values at once.
        lens = ln[cand]
        offs = np.repeat(np.cumsum(lens) - lens, lens)
        within = np.arange(int(lens.sum()), dtype=np.int64) - offs
        bo = np.repeat(old.starts[c, cand], lens) + within
        bn = np.repeat(new.starts[c, cand], lens) + within
        bad = (u8[bo] != u8[bn]).astype(np.int64)
        per_row = np.add.reduceat(bad, np.cumsum(lens) - lens)
        differs[cand[per_row > 0]] = True
    result: npt.NDArray[np.bool_] = differs
    return result


# --- transactions ------------------------------------------------------------------------


@dataclass(slots=True)
class _Txn:
    commit_lsn: int
    end_lsn: int
    commit_ts: int
    xid: int | None
    origin: str | None = None


@dataclass(slots=True)
class _Stream:
    xid: int
    ranges: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) row ranges of its segments


class WindowDecoder:
    """Decodes one or more chunks of a window, keeping relations and open transactions across chunks.

    A plain transaction still open after more than ``split_rows`` rows is given out in parts, as
    they arrive, with the commit LSN, time and xid its Begin message announces (positions go on
    across the parts), so memory does not follow the size of one transaction. Should it not
    commit in the window after all, :meth:`finish` names it in ``retracted``.
    """

    def __init__(
        self,
        catalog: TypeCatalog | None = None,
        key_resolver: KeyResolver | None = None,
        *,
        keep_old: bool = False,
        split_rows: int | None = None,
    ) -> None:
        self._catalog = catalog
        self._key_resolver = key_resolver
        self._keep_old = keep_old
        self._split_rows = split_rows
        # The transaction given out in parts so far: its commit LSN and the positions used.
        self._open_commit_lsn: int | None = None
        self._pos_base = 0
        self._relations: dict[int, RelationVersion] = {}
        self._versions = 0
        self._types: dict[int, po.Type] = {}
        self._pending = RowChunk(b"", np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._last_commit_lsn = -1

    # Public API ---------------------------------------------------------------------------

    @property
    def relations(self) -> dict[int, RelationVersion]:
        """The latest version of every relation seen so far, by OID."""
        return dict(self._relations)

    @property
    def pending_rows(self) -> int:
        """Rows of transactions still open at the end of what was fed (kept for the next chunk)."""
        return len(self._pending)

    def feed(self, chunk: RowChunk) -> DecodedChunk:
        """Decode every transaction that completes inside what has been fed so far."""
        rows = RowChunk.concat(self._pending, chunk)
        cut = self._quiescent_cut(rows)
        self._pending = rows.take(cut, len(rows))
        out = self._decode(rows.take(0, cut)) if cut else DecodedChunk()
        if self._split_rows is not None and len(self._pending) > self._split_rows:
            out.extend(self._split_open())
        return out

    def finish(self) -> DecodedChunk:
        """End of the window: decode what is left; rows of transactions still open are dropped (and counted).

        Transactions that committed after one that is still open (a streamed or prepared
        transaction) are decoded here, so nothing committed inside the window is lost.
        """
        rows = self._pending
        self._pending = rows.take(0, 0)
        out = self._decode(rows, final=True) if len(rows) else DecodedChunk()
        if self._open_commit_lsn is not None:
            out.retracted = self._open_commit_lsn
            out.notes["incomplete_split_transactions"] += 1
            self._open_commit_lsn, self._pos_base = None, 0
        return out

    def _split_open(self) -> DecodedChunk:
        """Give out the rows of the open plain transaction so far (see the class docstring)."""
        rows = self._pending
        u8 = np.frombuffer(rows.buf, dtype=np.uint8)
        tags = u8[rows.starts]
        control = tags[~np.isin(tags, _CHANGE_TAGS)]
        if tags[0] != po.BEGIN or not np.isin(control[1:], _SPLITTABLE_TAGS).all():
            return DecodedChunk()  # streams, prepared transactions: kept whole
        s, e = int(rows.starts[0]), int(rows.ends[0])
        begin = po.parse_message(memoryview(rows.buf)[s:e], lsn=int(rows.lsns[0]))
        assert isinstance(begin, po.Begin)
        # Closed for now by a Commit of our own, with what the Begin announced.
        commit = struct.pack(">cbQQq", b"C", 0, begin.final_lsn, begin.final_lsn, begin.commit_ts)
        closed = RowChunk.concat(rows, RowChunk.from_messages([(begin.final_lsn, commit)]))
        # The Begin, for the rest: copied out, for a slice would keep every row so far alive (and
        # the next chunk's concat would copy them all again).
        self._pending = rows.take(0, 1, compact=True)
        out = self._decode(closed, split=True)
        out.transactions = 0
        out.last_commit_end_lsn = None
        return out

    # Transaction boundaries -----------------------------------------------------------------

    @staticmethod
    def _quiescent_cut(rows: RowChunk) -> int:
        """Number of leading rows after which no transaction is open (so they can be decoded now)."""
        n = len(rows)
        if n == 0:
            return 0
        u8 = np.frombuffer(rows.buf, dtype=np.uint8)
        empty = rows.starts >= rows.ends
        if empty.any():
            i = int(np.flatnonzero(empty)[0])
            raise DecodeError("empty message", offset=0, lsn=int(rows.lsns[i]))
        tags = u8[rows.starts]
        ctrl = np.flatnonzero(~np.isin(tags, _CHANGE_TAGS))
        open_plain = False
        open_streams: set[int] = set()
        open_prepared: set[str] = set()
        in_segment = False
        cut = 0
        buf = rows.buf
        view = memoryview(buf)
        for i in ctrl.tolist():
            tag = int(tags[i])
            s, e = int(rows.starts[i]), int(rows.ends[i])
            if tag == po.BEGIN or tag == po.BEGIN_PREPARE:
                open_plain = True
            elif tag == po.COMMIT:
                open_plain = False
            elif tag == po.STREAM_STOP:
                in_segment = False
            elif tag in _XID_TAGS:
                if e - s < 5:
                    raise DecodeError("truncated: xid", tag=chr(tag), offset=1, lsn=int(rows.lsns[i]))
                xid = int.from_bytes(buf[s + 1 : s + 5], "big")
                if tag == po.STREAM_START:
                    in_segment = True
                    open_streams.add(xid)
                elif tag == po.STREAM_COMMIT:
                    open_streams.discard(xid)
                elif e - s >= 9 and int.from_bytes(buf[s + 5 : s + 9], "big") == xid:
                    open_streams.discard(xid)  # Stream Abort of the whole transaction
            elif tag in _GID_TAGS:
                lsn = int(rows.lsns[i])
                try:
                    msg = po.parse_message(view[s:e], lsn=lsn)
                except DecodeError as exc:
                    raise exc.with_lsn(lsn) from exc
                if isinstance(msg, po.Prepare):
                    open_plain = False
                    open_prepared.add(msg.gid)
                elif isinstance(msg, po.StreamPrepare):
                    open_streams.discard(msg.xid)
                    open_prepared.add(msg.gid)
                elif isinstance(msg, po.CommitPrepared | po.RollbackPrepared):
                    open_prepared.discard(msg.gid)
            else:
                continue
            if not (open_plain or open_streams or open_prepared or in_segment):
                cut = i + 1
        if not (open_plain or open_streams or open_prepared or in_segment):
            # Trailing changes outside any transaction cannot happen; let _decode report them.
            cut = n
        return cut

    # Decoding -------------------------------------------------------------------------------

    def _decode(self, rows: RowChunk, *, final: bool = False, split: bool = False) -> DecodedChunk:
        out = DecodedChunk()
        continued = self._open_commit_lsn  # a transaction given out in parts before
        at_start = dict(self._relations)  # versions in force before this chunk's Relation messages
        n = len(rows)
        u8 = np.frombuffer(rows.buf, dtype=np.uint8)
        starts, ends, lsns = rows.starts, rows.ends, rows.lsns
        if (starts >= ends).any():
            i = int(np.flatnonzero(starts >= ends)[0])
            raise DecodeError("empty message", offset=0, lsn=int(lsns[i]))
        tags = u8[starts]
        is_change = np.isin(tags, _CHANGE_TAGS)
        in_stream = np.zeros(n, dtype=bool)
        covered = np.zeros(n, dtype=bool)  # inside a transaction or a stream segment
        txn_of_row = np.full(n, -1, dtype=np.int64)
        # Where a Relation message at a row takes effect: its own row in a plain or prepared
        # transaction (pgoutput counts it as sent), the Stream Commit or Stream Prepare of a
        # streamed transaction; -1 for aborted streams.
        effect_row = np.full(n, -1, dtype=np.int64)
        stream_of_row = np.full(n, -1, dtype=np.int64)
        txns: list[_Txn] = []
        event_rows: list[int] = []  # Truncate and transactional Message rows
        relation_rows: list[int] = []
        parsed: dict[int, po.Message] = {}

        plain_begin: int | None = None
        plain_xid: int | None = None
        plain_origin: str | None = None
        segment_start: int | None = None
        segment_xid: int | None = None
        streams: dict[int, _Stream] = {}
        prepared: dict[str, list[tuple[int, int]]] = {}  # gid -> row ranges

        def commit(ranges: list[tuple[int, int]], txn: _Txn) -> None:
            # Commit order is LSN order; everything downstream orders by commit LSN.
            if txn.commit_lsn <= self._last_commit_lsn and not (txns == [] and txn.commit_lsn == continued):
                raise DecodeError(
                    f"commit LSN {txn.commit_lsn:#x} is not after the previous commit's {self._last_commit_lsn:#x}",
                    offset=0, lsn=lsn,
                )
            if not TS_MIN_US <= txn.commit_ts + PG_EPOCH_US <= TS_MAX_US:
                # A real server's clock cannot be there; the lake could not hold it either.
                tag = int(tags[i])
                raise DecodeError(
                    "commit timestamp outside 0001-01-01 .. 9999-12-31", tag=chr(tag), offset=_COMMIT_TS_AT.get(tag), lsn=lsn
                )
            self._last_commit_lsn = txn.commit_lsn
            tid = len(txns)
            txns.append(txn)
            for lo, hi in ranges:
                txn_of_row[lo:hi] = tid

        for i in np.flatnonzero(~is_change).tolist():
            s, e, lsn = int(starts[i]), int(ends[i]), int(lsns[i])
            inside = segment_start is not None
            try:
                msg = po.parse_message(memoryview(rows.buf)[s:e], in_stream=inside, lsn=lsn)
            except DecodeError as exc:
                raise exc.with_lsn(lsn) from exc
            if inside and not isinstance(
                msg, po.Relation | po.Type | po.Truncate | po.LogicalMessage | po.StreamStop
            ):
                raise DecodeError(f"{type(msg).__name__} inside a stream segment", tag=chr(int(tags[i])), offset=0, lsn=lsn)
            if isinstance(msg, po.Begin | po.BeginPrepare):
                if plain_begin is not None:
                    raise DecodeError("Begin inside a transaction", tag=chr(int(tags[i])), offset=0, lsn=lsn)
                plain_begin, plain_xid, plain_origin = i, msg.xid, None
            elif isinstance(msg, po.Commit):
                if plain_begin is None:
                    raise DecodeError("Commit without Begin", tag="C", offset=0, lsn=lsn)
                covered[plain_begin + 1 : i] = True
                effect_row[plain_begin + 1 : i] = np.arange(plain_begin + 1, i)
                commit([(plain_begin + 1, i)], _Txn(msg.commit_lsn, msg.end_lsn, msg.commit_ts, plain_xid, plain_origin))
                out.last_commit_end_lsn = msg.end_lsn
                plain_begin = None
            elif isinstance(msg, po.Origin):
                plain_origin = msg.name
            elif isinstance(msg, po.Relation):
                parsed[i] = msg
                relation_rows.append(i)
            elif isinstance(msg, po.Type):
                self._types[msg.oid] = msg
            elif isinstance(msg, po.Truncate):
                parsed[i] = msg
                event_rows.append(i)
            elif isinstance(msg, po.LogicalMessage):
                if msg.transactional:
                    parsed[i] = msg
                    event_rows.append(i)
                else:
                    out.messages.append(MessageEvent(None, 0, msg.lsn, msg))
            elif isinstance(msg, po.StreamStart):
                if plain_begin is not None:
                    raise DecodeError("Stream Start inside a transaction", tag="S", offset=0, lsn=lsn)
                segment_start, segment_xid = i, msg.xid
                streams.setdefault(msg.xid, _Stream(msg.xid))
            elif isinstance(msg, po.StreamStop):
                if segment_start is None or segment_xid is None:
                    raise DecodeError("Stream Stop without Stream Start", tag="E", offset=0, lsn=lsn)
                in_stream[segment_start + 1 : i] = True
                covered[segment_start + 1 : i] = True
                stream_of_row[segment_start + 1 : i] = segment_xid
                streams[segment_xid].ranges.append((segment_start + 1, i))
                segment_start = segment_xid = None
            elif isinstance(msg, po.StreamCommit):
                stream = streams.pop(msg.xid, None)
                for lo, hi in stream.ranges if stream else []:
                    effect_row[lo:hi] = i
                commit(stream.ranges if stream else [], _Txn(msg.commit_lsn, msg.end_lsn, msg.commit_ts, msg.xid))
                out.last_commit_end_lsn = msg.end_lsn
            elif isinstance(msg, po.StreamAbort):
                self._abort_stream(rows, u8, streams, msg)
                out.notes["streamed_aborts"] += 1
            elif isinstance(msg, po.Prepare):
                if plain_begin is None:
                    raise DecodeError("Prepare without Begin Prepare", tag="P", offset=0, lsn=lsn)
                covered[plain_begin + 1 : i] = True
                effect_row[plain_begin + 1 : i] = np.arange(plain_begin + 1, i)
                prepared[msg.gid] = [(plain_begin + 1, i)]
                plain_begin = None
            elif isinstance(msg, po.StreamPrepare):
                stream = streams.pop(msg.xid, None)
                for lo, hi in stream.ranges if stream else []:
                    effect_row[lo:hi] = i
                prepared[msg.gid] = stream.ranges if stream else []
            elif isinstance(msg, po.CommitPrepared):
                ranges = prepared.pop(msg.gid, [])
                if not ranges:
                    # Prepared in an earlier window: its changes were not in this one.
                    out.notes["commit_prepared_without_prepare"] += 1
                commit(ranges, _Txn(msg.commit_lsn, msg.end_lsn, msg.commit_ts, msg.xid))
                out.last_commit_end_lsn = msg.end_lsn
            elif isinstance(msg, po.RollbackPrepared):
                prepared.pop(msg.gid, None)

        # What is still open at the end (only at the end of a window: feed() cuts before it).
        open_rows = 0
        if plain_begin is not None:
            covered[plain_begin + 1 :] = True
            effect_row[plain_begin + 1 :] = np.arange(plain_begin + 1, n)
            open_rows += n - plain_begin
        if segment_start is not None:
            covered[segment_start + 1 :] = True
            open_rows += n - segment_start
        open_rows += sum(hi - lo for st in streams.values() for lo, hi in st.ranges)
        open_rows += sum(hi - lo for ranges in prepared.values() for lo, hi in ranges)
        if prepared:
            out.notes["prepared_not_committed_in_window"] += len(prepared)
        if final and open_rows:
            out.notes["incomplete_transaction_rows"] += open_rows
        stray = is_change & ~covered
        if stray.any():
            bad = int(np.flatnonzero(stray)[0])
            raise DecodeError("change outside any transaction", tag=chr(int(tags[bad])), offset=0, lsn=int(lsns[bad]))

        out.transactions = len(txns)
        # Commit order: transactions in commit order, rows in stream order inside each.
        # Changes of aborted or unfinished transactions keep txn -1 and are dropped.
        is_event = np.zeros(n, dtype=bool)
        is_event[event_rows] = True
        keep_rows = np.flatnonzero((is_change | is_event) & (txn_of_row >= 0))
        order = keep_rows[np.lexsort((keep_rows, txn_of_row[keep_rows]))]
        # Position inside the transaction, counting changes, truncates and messages.
        counted = np.ones(len(order), dtype=np.int64)
        tid_sorted = txn_of_row[order]
        first_of_txn = np.r_[True, tid_sorted[1:] != tid_sorted[:-1]] if len(order) else np.zeros(0, bool)
        csum = np.cumsum(counted)
        base = np.maximum.accumulate(np.where(first_of_txn, csum - counted, 0)) if len(order) else csum
        position = np.zeros(n, dtype=np.int64)
        position[order] = csum - counted - base
        if continued is not None and txns and txns[0].commit_lsn == continued:
            # The rest of a transaction given out in parts: positions go on from its last part.
            first = order[tid_sorted == 0]
            position[first] += self._pos_base
            if split:
                self._pos_base += len(first)
            else:
                self._open_commit_lsn, self._pos_base = None, 0
        elif split:
            self._open_commit_lsn, self._pos_base = txns[-1].commit_lsn, int((tid_sorted == len(txns) - 1).sum())

        # Relation versions, in the order they take effect.
        effective = sorted((int(effect_row[i]), i) for i in relation_rows if effect_row[i] >= 0)
        versions_of: dict[int, list[tuple[int, RelationVersion]]] = collections.defaultdict(list)
        own: dict[tuple[int, int], list[tuple[int, RelationVersion]]] = collections.defaultdict(list)
        for eff, i in effective:
            rel = parsed[i]
            assert isinstance(rel, po.Relation)
            try:
                version = self._add_relation(rel)
            except DecodeError as exc:
                raise exc.with_lsn(int(lsns[i])) from exc
            versions_of[rel.oid].append((eff, version))
            if stream_of_row[i] >= 0:
                own[(int(stream_of_row[i]), rel.oid)].append((i, version))
        for lst in own.values():
            lst.sort(key=lambda x: x[0])

        def version_at(oid: int, row: int) -> RelationVersion | None:
            """The version a change at ``row`` was sent with, None if never described."""
            if stream_of_row[row] >= 0:
                # A streamed transaction describes its relations itself.
                mine = own.get((int(stream_of_row[row]), oid), [])
                k = bisect.bisect_left(mine, row, key=lambda x: x[0]) - 1
                if k >= 0:
                    return mine[k][1]
            known = versions_of.get(oid, [])
            k = bisect.bisect_left(known, row, key=lambda x: x[0]) - 1
            return known[k][1] if k >= 0 else at_start.get(oid)

        def undescribed(oid: int, row: int) -> DecodeError:
            return DecodeError(
                f"change for relation {oid} that was never described by a Relation message",
                tag=chr(int(tags[row])), offset=1, lsn=int(lsns[row]),
            )

        if not len(order):
            return out
        commit_lsn_of_txn = np.array([t.commit_lsn for t in txns], dtype=np.uint64).view(np.int64)
        ts_of_txn = np.array([t.commit_ts for t in txns], dtype=np.int64) + PG_EPOCH_US
        xid_of_txn = np.array([-1 if t.xid is None else t.xid for t in txns], dtype=np.int64)

        for i in order[is_event[order]].tolist():
            msg = parsed[i]
            tx = txns[int(txn_of_row[i])]
            if isinstance(msg, po.Truncate):
                found = [(oid, version_at(oid, i)) for oid in msg.relation_oids]
                versions = tuple(v for _, v in found if v is not None)
                if len(versions) < len(found):
                    raise undescribed(next(oid for oid, v in found if v is None), i)
                out.truncates.append(
                    TruncateEvent(
                        tx.commit_lsn, 2 * int(position[i]) + 1, versions, msg.options, tx.xid, tx.commit_ts + PG_EPOCH_US
                    )
                )
            elif isinstance(msg, po.LogicalMessage):
                out.messages.append(MessageEvent(tx.commit_lsn, 2 * int(position[i]) + 1, msg.lsn, msg))

        change_rows = order[is_change[order]]
        if len(change_rows) == 0:
            return out
        # Relation OID of every change row (after the xid inside streams).
        oid_pos = starts[change_rows] + 1 + 4 * in_stream[change_rows]
        short = oid_pos + 4 > ends[change_rows]
        if short.any():
            bad = int(change_rows[np.flatnonzero(short)[0]])
            raise DecodeError("message too short for its relation OID", tag=chr(int(tags[bad])), offset=1, lsn=int(lsns[bad]))
        oids = _be32(u8, oid_pos)
        for oid in np.unique(oids).tolist():
            sel = change_rows[oids == oid]  # in commit order
            # Which Relation message describes each row; consecutive rows of one version form a batch.
            known = versions_of.get(oid, [])
            vers: list[RelationVersion | None] = [at_start.get(oid), *(v for _, v in known)]
            index_of = {id(v): k for k, v in enumerate(vers)}
            vidx = np.empty(len(sel), dtype=np.int64)
            plain = stream_of_row[sel] < 0
            if plain.any():
                bounds = np.array([r for r, _ in known], dtype=np.int64)
                vidx[plain] = np.searchsorted(bounds, sel[plain], side="left")
            for j in np.flatnonzero(~plain).tolist():
                v = version_at(oid, int(sel[j]))
                vidx[j] = 0 if v is None else index_of[id(v)]
            if vers[0] is None and (vidx == 0).any():
                raise undescribed(oid, int(sel[np.flatnonzero(vidx == 0)[0]]))
            breaks = np.flatnonzero(np.r_[True, vidx[1:] != vidx[:-1]])
            for lo, hi in zip(breaks.tolist(), [*breaks[1:].tolist(), len(sel)], strict=True):
                described = vers[int(vidx[lo])]
                assert described is not None
                batch = self._build_batch(
                    described, rows, u8, tags, sel[lo:hi], in_stream, position, txn_of_row,
                    commit_lsn_of_txn, ts_of_txn, xid_of_txn, out.notes,
                )
                out.changes.append(ChangeBatch(described, batch))
        return out

    def _abort_stream(self, rows: RowChunk, u8: U8, streams: dict[int, _Stream], msg: po.StreamAbort) -> None:
        stream = streams.get(msg.xid)
        if stream is None:
            return
        if msg.subxid == msg.xid:
            del streams[msg.xid]
            return
        # Drop the subtransaction's changes and everything streamed after its first change
        # (its own subtransactions), as PostgreSQL's apply worker does.
        kept: list[tuple[int, int]] = []
        for lo, hi in stream.ranges:
            idx = np.arange(lo, hi)
            change = np.isin(u8[rows.starts[idx]], _STREAMED_TAGS)
            xpos = rows.starts[idx] + 1
            valid = change & (xpos + 4 <= rows.ends[idx])
            xids = np.where(valid, _be32(u8, np.where(valid, xpos, 0)), -1)
            hit = np.flatnonzero(xids == msg.subxid)
            if len(hit):
                first = int(idx[hit[0]])
                if first > lo:
                    kept.append((lo, first))
                break
            kept.append((lo, hi))
        stream.ranges = kept

    # Relations ---------------------------------------------------------------------------

    def relation_version(self, rel: po.Relation) -> RelationVersion:
        """Codecs, key and Arrow schema of ``rel``, resolved as for a Relation message (the bootstrap copy uses this)."""
        return self._add_relation(rel)

    def _add_relation(self, rel: po.Relation) -> RelationVersion:
        # Declared array dimensions, when the catalog can tell (PostgreSQL does not enforce them).
        dims_of = getattr(self._catalog, "attndims", None)
        ndims: dict[str, int] = dims_of(rel.oid) if callable(dims_of) else {}
        codecs = tuple(
            codec_for(c.type_oid, c.type_modifier, self._catalog, ndims=max(ndims.get(c.name, 1), 1))
            for c in rel.columns
        )
        names = [c.name for c in rel.columns]
        key_names: Sequence[str] | None = self._key_resolver(rel) if self._key_resolver else None
        if key_names is None:
            key_indexes = tuple(i for i, c in enumerate(rel.columns) if c.is_key)
        else:
            missing = [k for k in key_names if k not in names]
            if missing:
                raise DecodeError(
                    f"key column(s) {missing} not published for {rel.namespace}.{rel.name}", tag="R", offset=0
                )
            key_indexes = tuple(names.index(k) for k in key_names)
        fields = [pa.field(c.name, codec.arrow_type) for c, codec in zip(rel.columns, codecs, strict=True)]
        clash = META_NAMES & set(names)
        if clash:
            raise DecodeError(f"column name(s) {sorted(clash)} are reserved by pg2delta", tag="R", offset=0)
        self._versions += 1
        version = RelationVersion(self._versions, rel, codecs, key_indexes, pa.schema([*fields, *META_FIELDS]))
        self._relations[rel.oid] = version
        return version

    # Tuples -> Arrow ---------------------------------------------------------------------

    def _build_batch(
        self,
        version: RelationVersion,
        rows: RowChunk,
        u8: U8,
        tags: U8,
        sel: I64,
        in_stream: npt.NDArray[np.bool_],
        position: I64,
        txn_of_row: I64,
        commit_lsn_of_txn: I64,
        ts_of_txn: I64,
        xid_of_txn: I64,
        notes: collections.Counter[str],
    ) -> pa.RecordBatch:
        """One record batch for rows ``sel`` (already in commit order) of one relation version."""
        ncols = len(version.relation.columns)
        ends = rows.ends[sel]
        p = rows.starts[sel] + 5 + 4 * in_stream[sel]  # after tag, [xid], oid: the K/O/N marker
        row_tags = tags[sel]

        new_t, old_t, marker, bad = _walk_changes(rows.buf, row_tags, p, ends, ncols)
        if bad is not None:
            j, what, at = bad
            row = int(sel[j])
            s, e = int(rows.starts[row]), int(rows.ends[row])
            # The reference parser gives the most precise message; fall back to the walk's.
            try:
                po.parse_message(memoryview(rows.buf)[s:e], in_stream=bool(in_stream[row]), lsn=int(rows.lsns[row]))
            except DecodeError as exc:
                raise exc.with_lsn(int(rows.lsns[row])) from None
            raise DecodeError(
                f"{what} for relation {version.qualified_name[0]}.{version.qualified_name[1]}",
                tag=chr(int(tags[row])), offset=at - s, lsn=int(rows.lsns[row]),
            )
        n_in = len(sel)
        pos_in = 2 * position[sel] + 1
        tid_in = txn_of_row[sel]
        columns: list[tuple[U8, I64, I64]] = []  # kinds, starts, lengths of the output rows per column
        if old_t is None:
            # Inserts and updates without an old tuple (the usual case): one output row per
            # message, the new tuple as it is.
            n_out = n_in
            op = np.where(row_tags == po.INSERT, ord("I"), ord("U")).astype(np.uint8)
            pos, tid = pos_in, tid_in
            use_old = np.zeros(n_out, dtype=bool)
            columns = [(new_t.kinds[c], new_t.starts[c], new_t.lengths[c]) for c in range(ncols)]
        else:
            has_old = marker != 0  # Updates with K/O, every Delete
            has_new = row_tags != po.DELETE
            # Which rows need a delete of their old key first: updates whose key changed.
            key_changed = np.zeros(n_in, dtype=bool)
            upd_old = has_old & has_new
            if upd_old.any() and version.key_indexes:
                for c in version.key_indexes:
                    key_changed |= upd_old & _differs(u8, old_t, new_t, c)
            # Updates that keep their key but carry the whole old row: a 'B' row first, if asked.
            before = upd_old & (marker == ord("O")) & ~key_changed if self._keep_old else np.zeros(n_in, dtype=bool)
            # Output rows: for each source row, optionally an old-key delete (or 'B'), then the row itself.
            extra = key_changed | before
            n_out = n_in + int(extra.sum())
            src = np.repeat(np.arange(n_in), 1 + extra.astype(np.int64))
            first_of_pair = np.r_[True, src[1:] != src[:-1]]
            is_old_delete = first_of_pair & key_changed[src]
            is_before = first_of_pair & before[src]
            use_old = is_old_delete | is_before | (row_tags[src] == po.DELETE)
            op = np.where(
                is_before, ord(BEFORE_OP),
                np.where(use_old, ord("D"), np.where(row_tags[src] == po.INSERT, ord("I"), ord("U"))),
            ).astype(np.uint8)
            pos = pos_in[src] - (is_old_delete | is_before)
            tid = tid_in[src]
            # REPLICA IDENTITY FULL sends the whole old row ('O'): a value the new tuple leaves
            # out as unchanged TOAST is the old one.
            full_old = (marker == ord("O"))[src] & ~use_old
            for c in range(ncols):
                old_k = old_t.kinds[c, src]
                take_old = use_old | (
                    full_old & (new_t.kinds[c, src] == KIND_TOAST) & ((old_k == KIND_TEXT) | (old_k == KIND_BINARY))
                )
                columns.append((
                    np.where(take_old, old_k, new_t.kinds[c, src]),
                    np.where(take_old, old_t.starts[c, src], new_t.starts[c, src]),
                    np.where(take_old, old_t.lengths[c, src], new_t.lengths[c, src]),
                ))

        arrays: list[pa.Array] = []
        toast_any = np.zeros(n_out, dtype=bool)
        toast_cols: list[npt.NDArray[np.bool_]] = []
        any_old = bool(use_old.any())
        for c, (codec, (kinds, cstarts, clens)) in enumerate(zip(version.codecs, columns, strict=True)):
            is_toast = kinds == KIND_TOAST
            if any_old:
                is_toast &= ~use_old
            if is_toast.any():
                toast_any |= is_toast
            toast_cols.append(is_toast)
            try:
                arrays.append(codec.decode(rows.buf, cstarts, clens, kinds, notes))
            except DecodeError as exc:
                raise DecodeError(
                    f"column {version.relation.columns[c].name!r} of {'.'.join(version.qualified_name)}: {exc.reason}",
                    tag=None, offset=None, lsn=int(rows.lsns[sel[0]]),
                ) from exc
        if toast_any.any():
            names = version.column_names
            lists: list[list[str] | None] = [None] * n_out
            for j in np.flatnonzero(toast_any).tolist():
                lists[j] = [names[c] for c in range(ncols) if toast_cols[c][j]]
            toast = pa.array(lists, type=pa.list_(pa.string()))
        else:
            toast = pa.nulls(n_out, type=pa.list_(pa.string()))
        # One-character strings: offsets 0, 1, 2, ... over the op bytes.
        ops = pa.Array.from_buffers(
            pa.string(), n_out, [None, pa.py_buffer(np.arange(n_out + 1, dtype=np.int32)), pa.py_buffer(op)]
        )
        xids = xid_of_txn[tid]
        meta = [
            pa.array(commit_lsn_of_txn[tid], type=pa.int64()),
            pa.array(pos, type=pa.int64()),
            ops,
            toast,
            pa.array(xids, type=pa.int64(), mask=xids < 0),
            pa.array(ts_of_txn[tid], type=pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        ]
        return pa.RecordBatch.from_arrays([*arrays, *meta], schema=version.schema)
