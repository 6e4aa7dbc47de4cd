"""Transactions in a window's rows: where to cut, which rows each one holds, and in what order.

* :func:`quiescent_cut`: how many leading rows can be decoded now (no transaction open after them);
* :class:`TransactionScan`: one pass over a chunk's control messages (plain, streamed and two-phase
  transaction boundaries, Relation, Type, Truncate, Message, Origin) that tells which committed
  transaction each row belongs to, where each Relation message takes effect, which rows are inside
  stream segments, and drops aborted streamed (sub)transactions;
* :class:`CommitOrder`: what the decoder keeps between chunks about commit order (commit LSNs must
  rise; the plain transaction given out in parts so far) and each kept row's position inside its
  transaction (:meth:`CommitOrder.place`).

Pure: numpy arrays over the rows' bytes in, plain values out; errors are :class:`DecodeError`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pg2delta.decode import pgoutput as po
from pg2delta.decode.tuplewalk import be32
from pg2delta.decode.typemap.datetime import PG_EPOCH_US, TS_MAX_US, TS_MIN_US
from pg2delta.errors import DecodeError

if TYPE_CHECKING:
    from pg2delta.decode.events import RowChunk

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

CHANGE_TAGS = np.array([po.INSERT, po.UPDATE, po.DELETE], dtype=np.uint8)
# Boundary messages that name a streamed transaction's xid right after the tag, and those
# that name a prepared transaction's gid.
_XID_TAGS = frozenset({po.STREAM_START, po.STREAM_COMMIT, po.STREAM_ABORT})
_GID_TAGS = frozenset({po.PREPARE, po.STREAM_PREPARE, po.COMMIT_PREPARED, po.ROLLBACK_PREPARED})
# Where the commit timestamp is in the messages that commit a transaction.
_COMMIT_TS_AT = {po.COMMIT: 18, po.STREAM_COMMIT: 22, po.COMMIT_PREPARED: 18}
# Messages a Stream Abort of a subtransaction drops (they carry the subtransaction's xid).
_STREAMED_TAGS = np.array(
    [po.INSERT, po.UPDATE, po.DELETE, po.TRUNCATE, po.RELATION, po.TYPE, po.MESSAGE], dtype=np.uint8
)
# Messages a stream segment may hold besides changes.
_IN_SEGMENT = (po.Relation, po.Type, po.Truncate, po.LogicalMessage, po.StreamStop)


def quiescent_cut(rows: RowChunk) -> int:
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
    ctrl = np.flatnonzero(~np.isin(tags, CHANGE_TAGS))
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
            if _two_phase(view[s:e], int(rows.lsns[i]), open_streams, open_prepared):
                open_plain = False
        else:
            continue
        if not (open_plain or open_streams or open_prepared or in_segment):
            cut = i + 1
    if not (open_plain or open_streams or open_prepared or in_segment):
        # Trailing changes outside any transaction cannot happen; let the decoder report them.
        cut = n
    return cut


def _two_phase(message: memoryview, lsn: int, open_streams: set[int], open_prepared: set[str]) -> bool:
    """Follow one two-phase message (:data:`_GID_TAGS`) in :func:`quiescent_cut`'s open transactions;
    True for a Prepare, which also ends the plain transaction it prepares."""
    try:
        msg = po.parse_message(message, lsn=lsn)
    except DecodeError as exc:
        raise exc.with_lsn(lsn) from exc
    if isinstance(msg, po.Prepare):
        open_prepared.add(msg.gid)
        return True
    if isinstance(msg, po.StreamPrepare):
        open_streams.discard(msg.xid)
        open_prepared.add(msg.gid)
    elif isinstance(msg, po.CommitPrepared | po.RollbackPrepared):
        open_prepared.discard(msg.gid)
    return False


@dataclass(slots=True)
class Txn:
    """A transaction that committed in the chunk (commit time in microseconds since 2000-01-01)."""

    commit_lsn: int
    end_lsn: int
    commit_ts: int
    xid: int | None
    origin: str | None = None


@dataclass(slots=True)
class _Stream:
    """A streamed transaction not yet committed, prepared or aborted in the chunk: its segments' rows."""

    xid: int
    ranges: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) row ranges of its segments


@dataclass(slots=True)
class CommitOrder:
    """What a decoder keeps between chunks about commit order.

    ``last_commit_lsn``: commits must come in LSN order. ``open_commit_lsn`` and ``pos_base``: the
    plain transaction given out in parts so far (see :class:`pg2delta.decode.changes.WindowDecoder`), its
    commit LSN and the positions its parts used.
    """

    last_commit_lsn: int = -1
    open_commit_lsn: int | None = None
    pos_base: int = 0

    def place(self, scan: TransactionScan, *, split: bool) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
        """The kept rows (changes, truncates, messages of committed transactions) in commit order,
        every row's position inside its transaction, and which rows are truncates or messages.

        With ``split`` the chunk's last transaction is the open one given out in parts: its
        positions are remembered, so that the next part goes on from them.
        """
        n = len(scan.txn_of_row)
        txns, txn_of_row = scan.txns, scan.txn_of_row
        # Commit order: transactions in commit order, rows in stream order inside each.
        # Changes of aborted or unfinished transactions keep txn -1 and are dropped.
        is_event = np.zeros(n, dtype=bool)
        is_event[scan.event_rows] = True
        keep_rows = np.flatnonzero((scan.is_change | is_event) & (txn_of_row >= 0))
        order = keep_rows[np.lexsort((keep_rows, txn_of_row[keep_rows]))]
        # Position inside the transaction, counting changes, truncates and messages.
        counted = np.ones(len(order), dtype=np.int64)
        tid_sorted = txn_of_row[order]
        first_of_txn = np.r_[True, tid_sorted[1:] != tid_sorted[:-1]] if len(order) else np.zeros(0, bool)
        csum = np.cumsum(counted)
        base = np.maximum.accumulate(np.where(first_of_txn, csum - counted, 0)) if len(order) else csum
        position = np.zeros(n, dtype=np.int64)
        position[order] = csum - counted - base
        continued = self.open_commit_lsn
        if continued is not None and txns and txns[0].commit_lsn == continued:
            # The rest of a transaction given out in parts: positions go on from its last part.
            first = order[tid_sorted == 0]
            position[first] += self.pos_base
            if split:
                self.pos_base += len(first)
            else:
                self.open_commit_lsn, self.pos_base = None, 0
        elif split:
            self.open_commit_lsn, self.pos_base = txns[-1].commit_lsn, int((tid_sorted == len(txns) - 1).sum())
        return order, position, is_event


class TransactionScan:
    """One pass over the control messages of a chunk (:meth:`run`), and what it found.

    Per row: ``txn_of_row`` (index into ``txns``, the transactions committed in the chunk in commit
    order; -1 for rows of aborted or unfinished ones), ``in_stream`` (inside a stream segment: the
    message carries an xid), ``stream_of_row`` (that xid, else -1) and ``effect_row`` (where a
    Relation message takes effect: its own row in a plain or prepared transaction, as pgoutput
    counts it as sent, the Stream Commit or Stream Prepare of a streamed one; -1 for aborted
    streams). Also the Truncate and transactional Message rows (``event_rows``), the Relation rows
    (``relation_rows``), those messages parsed (``parsed``), the non-transactional messages
    (``loose_messages``) and the end LSN of the last commit. Counts go to ``notes``.
    """

    def __init__(
        self,
        rows: RowChunk,
        u8: U8,
        tags: U8,
        order: CommitOrder,
        notes: collections.Counter[str],
    ) -> None:
        n = len(rows)
        self.rows, self.u8, self.tags = rows, u8, tags
        self.is_change = np.isin(tags, CHANGE_TAGS)
        self.in_stream = np.zeros(n, dtype=bool)
        self.covered = np.zeros(n, dtype=bool)  # inside a transaction or a stream segment
        self.txn_of_row = np.full(n, -1, dtype=np.int64)
        self.effect_row = np.full(n, -1, dtype=np.int64)
        self.stream_of_row = np.full(n, -1, dtype=np.int64)
        self.txns: list[Txn] = []
        self.event_rows: list[int] = []  # Truncate and transactional Message rows
        self.relation_rows: list[int] = []
        self.parsed: dict[int, po.Message] = {}
        self.loose_messages: list[po.LogicalMessage] = []
        self.last_commit_end_lsn: int | None = None
        self._order = order
        self._continued = order.open_commit_lsn  # a transaction given out in parts before
        self._notes = notes
        self._plain_begin: int | None = None
        self._plain_xid: int | None = None
        self._plain_origin: str | None = None
        self._segment_start: int | None = None
        self._segment_xid: int | None = None
        self._streams: dict[int, _Stream] = {}
        self._prepared: dict[str, list[tuple[int, int]]] = {}  # gid -> row ranges

    def run(self, *, final: bool) -> None:
        """Scan every control message, then what is still open at the end (``final``: the window's end)."""
        on = _HANDLERS
        for i in np.flatnonzero(~self.is_change).tolist():
            msg = self._parse(i)
            handle = on.get(type(msg))
            if handle is not None:
                handle(self, i, msg)
        self._close(final=final)

    def _parse(self, i: int) -> po.Message:
        rows = self.rows
        s, e, lsn = int(rows.starts[i]), int(rows.ends[i]), int(rows.lsns[i])
        inside = self._segment_start is not None
        try:
            msg = po.parse_message(memoryview(rows.buf)[s:e], in_stream=inside, lsn=lsn)
        except DecodeError as exc:
            raise exc.with_lsn(lsn) from exc
        if inside and not isinstance(msg, _IN_SEGMENT):
            raise DecodeError(f"{type(msg).__name__} inside a stream segment", tag=chr(int(self.tags[i])), offset=0, lsn=lsn)
        return msg

    def _commit(self, i: int, ranges: list[tuple[int, int]], txn: Txn) -> None:
        """Transaction ``txn`` (rows ``ranges``) committed at row ``i``."""
        lsn = int(self.rows.lsns[i])
        order = self._order
        # Commit order is LSN order; everything downstream orders by commit LSN.
        if txn.commit_lsn <= order.last_commit_lsn and not (self.txns == [] and txn.commit_lsn == self._continued):
            raise DecodeError(
                f"commit LSN {txn.commit_lsn:#x} is not after the previous commit's {order.last_commit_lsn:#x}",
                offset=0, lsn=lsn,
            )
        if not TS_MIN_US <= txn.commit_ts + PG_EPOCH_US <= TS_MAX_US:
            # A real server's clock cannot be there; the lake could not hold it either.
            tag = int(self.tags[i])
            raise DecodeError(
                "commit timestamp outside 0001-01-01 .. 9999-12-31", tag=chr(tag), offset=_COMMIT_TS_AT.get(tag), lsn=lsn
            )
        order.last_commit_lsn = txn.commit_lsn
        tid = len(self.txns)
        self.txns.append(txn)
        for lo, hi in ranges:
            self.txn_of_row[lo:hi] = tid

    # Plain and prepared transactions ------------------------------------------------------

    def _begin(self, i: int, msg: po.Begin | po.BeginPrepare) -> None:
        if self._plain_begin is not None:
            raise DecodeError("Begin inside a transaction", tag=chr(int(self.tags[i])), offset=0, lsn=int(self.rows.lsns[i]))
        self._plain_begin, self._plain_xid, self._plain_origin = i, msg.xid, None

    def _end_plain(self, i: int, what: str, tag: str) -> tuple[int, int]:
        """Close the plain transaction at row ``i`` (a Commit or Prepare): its rows."""
        begin = self._plain_begin
        if begin is None:
            raise DecodeError(what, tag=tag, offset=0, lsn=int(self.rows.lsns[i]))
        self.covered[begin + 1 : i] = True
        self.effect_row[begin + 1 : i] = np.arange(begin + 1, i)
        self._plain_begin = None
        return begin + 1, i

    def _commit_plain(self, i: int, msg: po.Commit) -> None:
        xid, origin = self._plain_xid, self._plain_origin
        rows = self._end_plain(i, "Commit without Begin", "C")
        self._commit(i, [rows], Txn(msg.commit_lsn, msg.end_lsn, msg.commit_ts, xid, origin))
        self.last_commit_end_lsn = msg.end_lsn

    def _origin(self, i: int, msg: po.Origin) -> None:
        self._plain_origin = msg.name

    def _prepare(self, i: int, msg: po.Prepare) -> None:
        self._prepared[msg.gid] = [self._end_plain(i, "Prepare without Begin Prepare", "P")]

    def _commit_prepared(self, i: int, msg: po.CommitPrepared) -> None:
        ranges = self._prepared.pop(msg.gid, [])
        if not ranges:
            # Prepared in an earlier window: its changes were not in this one.
            self._notes["commit_prepared_without_prepare"] += 1
        self._commit(i, ranges, Txn(msg.commit_lsn, msg.end_lsn, msg.commit_ts, msg.xid))
        self.last_commit_end_lsn = msg.end_lsn

    def _rollback_prepared(self, i: int, msg: po.RollbackPrepared) -> None:
        self._prepared.pop(msg.gid, None)

    # Relations, types, truncates, messages ----------------------------------------------------

    def _relation(self, i: int, msg: po.Relation) -> None:
        self.parsed[i] = msg
        self.relation_rows.append(i)

    def _type(self, i: int, msg: po.Type) -> None:
        """Nothing kept: columns' types are looked up in the catalog (``typemap.resolve``)."""

    def _event(self, i: int, msg: po.Truncate | po.LogicalMessage) -> None:
        self.parsed[i] = msg
        self.event_rows.append(i)

    def _message(self, i: int, msg: po.LogicalMessage) -> None:
        if msg.transactional:
            self._event(i, msg)
        else:
            self.loose_messages.append(msg)

    # Streamed transactions ---------------------------------------------------------------

    def _stream_start(self, i: int, msg: po.StreamStart) -> None:
        if self._plain_begin is not None:
            raise DecodeError("Stream Start inside a transaction", tag="S", offset=0, lsn=int(self.rows.lsns[i]))
        self._segment_start, self._segment_xid = i, msg.xid
        self._streams.setdefault(msg.xid, _Stream(msg.xid))

    def _stream_stop(self, i: int, msg: po.StreamStop) -> None:
        start, xid = self._segment_start, self._segment_xid
        if start is None or xid is None:
            raise DecodeError("Stream Stop without Stream Start", tag="E", offset=0, lsn=int(self.rows.lsns[i]))
        self.in_stream[start + 1 : i] = True
        self.covered[start + 1 : i] = True
        self.stream_of_row[start + 1 : i] = xid
        self._streams[xid].ranges.append((start + 1, i))
        self._segment_start = self._segment_xid = None

    def _end_stream(self, i: int, xid: int) -> list[tuple[int, int]]:
        """The rows of streamed transaction ``xid``, ended at row ``i`` (its Relation messages take effect there)."""
        stream = self._streams.pop(xid, None)
        for lo, hi in stream.ranges if stream else []:
            self.effect_row[lo:hi] = i
        return stream.ranges if stream else []

    def _stream_commit(self, i: int, msg: po.StreamCommit) -> None:
        ranges = self._end_stream(i, msg.xid)
        self._commit(i, ranges, Txn(msg.commit_lsn, msg.end_lsn, msg.commit_ts, msg.xid))
        self.last_commit_end_lsn = msg.end_lsn

    def _stream_prepare(self, i: int, msg: po.StreamPrepare) -> None:
        self._prepared[msg.gid] = self._end_stream(i, msg.xid)

    def _stream_abort(self, i: int, msg: po.StreamAbort) -> None:
        stream = self._streams.get(msg.xid)
        if stream is not None:
            if msg.subxid == msg.xid:
                del self._streams[msg.xid]
            else:
                self._drop_subtransaction(stream, msg.subxid)
        self._notes["streamed_aborts"] += 1

    def _drop_subtransaction(self, stream: _Stream, subxid: int) -> None:
        # Drop the subtransaction's changes and everything streamed after its first change
        # (its own subtransactions), as PostgreSQL's apply worker does.
        rows, u8 = self.rows, self.u8
        kept: list[tuple[int, int]] = []
        for lo, hi in stream.ranges:
            idx = np.arange(lo, hi)
            change = np.isin(u8[rows.starts[idx]], _STREAMED_TAGS)
            xpos = rows.starts[idx] + 1
            valid = change & (xpos + 4 <= rows.ends[idx])
            xids = np.where(valid, be32(u8, np.where(valid, xpos, 0)), -1)
            hit = np.flatnonzero(xids == subxid)
            if len(hit):
                first = int(idx[hit[0]])
                if first > lo:
                    kept.append((lo, first))
                break
            kept.append((lo, hi))
        stream.ranges = kept

    # The end ------------------------------------------------------------------------------

    def _close(self, *, final: bool) -> None:
        """Count what is still open at the end (only at the end of a window: feed() cuts before it)
        and refuse changes outside any transaction."""
        n = len(self.txn_of_row)
        open_rows = 0
        if self._plain_begin is not None:
            self.covered[self._plain_begin + 1 :] = True
            self.effect_row[self._plain_begin + 1 :] = np.arange(self._plain_begin + 1, n)
            open_rows += n - self._plain_begin
        if self._segment_start is not None:
            self.covered[self._segment_start + 1 :] = True
            open_rows += n - self._segment_start
        open_rows += sum(hi - lo for st in self._streams.values() for lo, hi in st.ranges)
        open_rows += sum(hi - lo for ranges in self._prepared.values() for lo, hi in ranges)
        if self._prepared:
            self._notes["prepared_not_committed_in_window"] += len(self._prepared)
        if final and open_rows:
            self._notes["incomplete_transaction_rows"] += open_rows
        stray = self.is_change & ~self.covered
        if stray.any():
            bad = int(np.flatnonzero(stray)[0])
            raise DecodeError(
                "change outside any transaction", tag=chr(int(self.tags[bad])), offset=0, lsn=int(self.rows.lsns[bad])
            )


# What the scan does for each control message. Unbound, so that a scan holds no reference to
# itself: it (and the chunk's rows it holds) is freed when the decoder is done with it, not when
# the cyclic garbage collector next runs.
_HANDLERS: dict[type, Callable[[TransactionScan, int, Any], None]] = {
    po.Begin: TransactionScan._begin,
    po.BeginPrepare: TransactionScan._begin,
    po.Commit: TransactionScan._commit_plain,
    po.Origin: TransactionScan._origin,
    po.Relation: TransactionScan._relation,
    po.Type: TransactionScan._type,
    po.Truncate: TransactionScan._event,
    po.LogicalMessage: TransactionScan._message,
    po.StreamStart: TransactionScan._stream_start,
    po.StreamStop: TransactionScan._stream_stop,
    po.StreamCommit: TransactionScan._stream_commit,
    po.StreamAbort: TransactionScan._stream_abort,
    po.Prepare: TransactionScan._prepare,
    po.StreamPrepare: TransactionScan._stream_prepare,
    po.CommitPrepared: TransactionScan._commit_prepared,
    po.RollbackPrepared: TransactionScan._rollback_prepared,
}
