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

import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from pg2delta.decode import pgoutput as po
from pg2delta.decode.events import (
    BEFORE_OP,
    LSN_COL,
    META_FIELDS,
    META_NAMES,
    OP_COL,
    POS_COL,
    TOAST_COL,
    TS_COL,
    XID_COL,
    BatchLike,
    ChangeBatch,
    DecodedChunk,
    KeyResolver,
    MessageEvent,
    RelationVersion,
    RowChunk,
    TruncateEvent,
)
from pg2delta.decode.governance import ColumnRuler, Governance
from pg2delta.decode.relations import RelationTimeline
from pg2delta.decode.rowbatch import OrderedRows, build_batch
from pg2delta.decode.transactions import CHANGE_TAGS, CommitOrder, TransactionScan, quiescent_cut
from pg2delta.decode.tuplewalk import be32
from pg2delta.decode.typemap import TypeCatalog, codec_for
from pg2delta.decode.typemap.datetime import PG_EPOCH_US
from pg2delta.errors import DecodeError

I64 = npt.NDArray[np.int64]

# Messages an open plain transaction may hold besides changes and still be given out in parts.
_SPLITTABLE_TAGS = np.array([po.RELATION, po.TYPE, po.TRUNCATE, po.MESSAGE, po.ORIGIN], dtype=np.uint8)


class WindowDecoder:
    """Decodes one or more chunks of a window, keeping relations and open transactions across chunks.

    A plain transaction still open after more than ``split_rows`` rows is given out in parts, as
    they arrive, with the commit LSN, time and xid its Begin message announces (positions go on
    across the parts), so memory does not follow the size of one transaction. Should it not
    commit in the window after all, :meth:`finish` names it in ``retracted``.

    The work is done by smaller units: :func:`pg2delta.decode.transactions.quiescent_cut` (where to cut
    what was fed), :class:`pg2delta.decode.transactions.TransactionScan` (which rows each transaction
    holds), :class:`pg2delta.decode.transactions.CommitOrder` (commit order and positions, across
    chunks), :class:`pg2delta.decode.relations.RelationTimeline` (the relation version of each change)
    and :func:`pg2delta.decode.rowbatch.build_batch` (tuples to Arrow).
    """

    def __init__(
        self,
        catalog: TypeCatalog | None = None,
        key_resolver: KeyResolver | None = None,
        *,
        keep_old: bool = False,
        split_rows: int | None = None,
        columns: ColumnRuler | None = None,
    ) -> None:
        self._catalog = catalog
        self._key_resolver = key_resolver
        self._columns = columns  # [tables."s.t"] hash and exclude (pg2delta.decode.governance)
        self._keep_old = keep_old
        self._split_rows = split_rows
        # The last commit LSN, and the transaction given out in parts so far.
        self._order = CommitOrder()
        self._relations: dict[int, RelationVersion] = {}
        self._versions = 0
        self._pending = RowChunk(b"", np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))

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
        cut = quiescent_cut(rows)
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
        if self._order.open_commit_lsn is not None:
            out.retracted = self._order.open_commit_lsn
            out.notes["incomplete_split_transactions"] += 1
            self._order.open_commit_lsn, self._order.pos_base = None, 0
        return out

    def _split_open(self) -> DecodedChunk:
        """Give out the rows of the open plain transaction so far (see the class docstring)."""
        rows = self._pending
        u8 = np.frombuffer(rows.buf, dtype=np.uint8)
        tags = u8[rows.starts]
        control = tags[~np.isin(tags, CHANGE_TAGS)]
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

    # Decoding -------------------------------------------------------------------------------

    def _decode(self, rows: RowChunk, *, final: bool = False, split: bool = False) -> DecodedChunk:
        """Decode rows in which every transaction is complete (but at the window's end, ``final``)."""
        out = DecodedChunk()
        at_start = dict(self._relations)  # versions in force before this chunk's Relation messages
        u8 = np.frombuffer(rows.buf, dtype=np.uint8)
        starts, ends, lsns = rows.starts, rows.ends, rows.lsns
        if (starts >= ends).any():
            i = int(np.flatnonzero(starts >= ends)[0])
            raise DecodeError("empty message", offset=0, lsn=int(lsns[i]))
        tags = u8[starts]
        scan = TransactionScan(rows, u8, tags, self._order, out.notes)
        scan.run(final=final)
        out.messages.extend(MessageEvent(None, 0, msg.lsn, msg) for msg in scan.loose_messages)
        out.last_commit_end_lsn = scan.last_commit_end_lsn
        out.transactions = len(scan.txns)
        order, position, is_event = self._order.place(scan, split=split)
        timeline = RelationTimeline(scan, at_start, self._add_relation)
        if not len(order):
            return out
        txns = scan.txns
        ordered = OrderedRows(
            rows, u8, tags, scan.in_stream, position, scan.txn_of_row,
            np.array([t.commit_lsn for t in txns], dtype=np.uint64).view(np.int64),
            np.array([t.commit_ts for t in txns], dtype=np.int64) + PG_EPOCH_US,
            np.array([-1 if t.xid is None else t.xid for t in txns], dtype=np.int64),
        )
        _add_events(out, scan, order[is_event[order]], position, timeline)
        self._add_changes(out, ordered, order[scan.is_change[order]], timeline)
        return out

    def _add_changes(self, out: DecodedChunk, ordered: OrderedRows, change_rows: I64, timeline: RelationTimeline) -> None:
        """One batch per relation version for the change rows (in commit order)."""
        if len(change_rows) == 0:
            return
        rows, tags = ordered.rows, ordered.tags
        # Relation OID of every change row (after the xid inside streams).
        oid_pos = rows.starts[change_rows] + 1 + 4 * ordered.in_stream[change_rows]
        short = oid_pos + 4 > rows.ends[change_rows]
        if short.any():
            bad = int(change_rows[np.flatnonzero(short)[0]])
            raise DecodeError(
                "message too short for its relation OID", tag=chr(int(tags[bad])), offset=1, lsn=int(rows.lsns[bad])
            )
        oids = be32(ordered.u8, oid_pos)
        for oid in np.unique(oids).tolist():
            sel = change_rows[oids == oid]  # in commit order
            # Which Relation message describes each row; consecutive rows of one version form a batch.
            vers, vidx = timeline.versions(oid, sel)
            breaks = np.flatnonzero(np.r_[True, vidx[1:] != vidx[:-1]])
            for lo, hi in zip(breaks.tolist(), [*breaks[1:].tolist(), len(sel)], strict=True):
                described = vers[int(vidx[lo])]
                assert described is not None
                batch = build_batch(described, ordered, sel[lo:hi], out.notes, keep_old=self._keep_old)
                out.changes.append(ChangeBatch(described, batch))

    # Relations ---------------------------------------------------------------------------

    def relation_version(self, rel: po.Relation) -> RelationVersion:
        """Codecs, key and Arrow schema of ``rel``, resolved as for a Relation message (the bootstrap copy uses this)."""
        return self._add_relation(rel)

    def _add_relation(self, rel: po.Relation) -> RelationVersion:
        """Resolve ``rel`` (codec per column, key, schema) into a new version, now the latest of its OID."""
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
        rules = self._columns(rel) if self._columns else None
        governance = None
        if rules:
            governance = Governance.resolve(
                f"{rel.namespace}.{rel.name}", names, [f.type for f in fields], [names[i] for i in key_indexes], rules
            )
            fields = governance.fields(fields)
        self._versions += 1
        version = RelationVersion(
            self._versions, rel, codecs, key_indexes, pa.schema([*fields, *META_FIELDS]), governance
        )
        self._relations[rel.oid] = version
        return version


def _add_events(out: DecodedChunk, scan: TransactionScan, event_rows: I64, position: I64, timeline: RelationTimeline) -> None:
    """The truncates and transactional messages at ``event_rows`` (in commit order)."""
    for i in event_rows.tolist():
        msg = scan.parsed[i]
        tx = scan.txns[int(scan.txn_of_row[i])]
        if isinstance(msg, po.Truncate):
            found = [(oid, timeline.version_at(oid, i)) for oid in msg.relation_oids]
            versions = tuple(v for _, v in found if v is not None)
            if len(versions) < len(found):
                raise timeline.undescribed(next(oid for oid, v in found if v is None), i)
            out.truncates.append(
                TruncateEvent(
                    tx.commit_lsn, 2 * int(position[i]) + 1, versions, msg.options, tx.xid, tx.commit_ts + PG_EPOCH_US
                )
            )
        elif isinstance(msg, po.LogicalMessage):
            out.messages.append(MessageEvent(tx.commit_lsn, 2 * int(position[i]) + 1, msg.lsn, msg))


__all__ = [
    "BEFORE_OP",
    "LSN_COL",
    "META_FIELDS",
    "META_NAMES",
    "OP_COL",
    "POS_COL",
    "TOAST_COL",
    "TS_COL",
    "XID_COL",
    "BatchLike",
    "ChangeBatch",
    "DecodedChunk",
    "KeyResolver",
    "MessageEvent",
    "RelationVersion",
    "RowChunk",
    "TruncateEvent",
    "WindowDecoder",
]
