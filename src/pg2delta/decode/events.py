"""What the decoder gives out: change batches per relation version, truncates, logical messages,
the meta columns every batch carries, and the slot's rows as they come in.

Plain values, no logic beyond their own shape; :mod:`pg2delta.decode.changes` makes them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from pg2delta.decode import pgoutput as po
from pg2delta.decode.governance import Governance
from pg2delta.decode.typemap import ColumnCodec

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
# Row metadata ([tables."s.t"] metadata, deletes = "soft"): LSN_COL, TS_COL and OP_COL of a row's
# last change kept in the Delta table's row, and with soft deletes whether that change removed it.
DELETED_COL = "_pg2delta_deleted"
COPY_OP = "S"  # OP_COL of a row copied at a snapshot (bootstrap, resync)
TRUNCATE_MARK_OP = "T"  # OP_COL of a row a TRUNCATE marked deleted
ROW_META_FIELDS = (
    pa.field(LSN_COL, pa.int64()),
    pa.field(TS_COL, pa.timestamp("us", tz="UTC")),
    pa.field(OP_COL, pa.string()),
)
DELETED_FIELD = pa.field(DELETED_COL, pa.bool_())

@dataclass(frozen=True, slots=True)
class RelationVersion:
    """One shape of a table, from one Relation message; ``version`` counts per decoder."""

    version: int
    relation: po.Relation
    codecs: tuple[ColumnCodec, ...]
    key_indexes: tuple[int, ...]  # columns identifying a row (see KeyResolver)
    schema: pa.Schema  # the landed data columns (hashed ones as strings, excluded ones left out) then META_FIELDS
    # [tables."s.t"] hash and exclude resolved against the columns (pg2delta.decode.governance); None: every column as it is.
    governance: Governance | None = None

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
    to a file (:class:`pg2delta.window.spill.SpilledBatch`)."""

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
        """The rows (a spilled batch reads them back from its file, see :mod:`pg2delta.window.spill`)."""
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
