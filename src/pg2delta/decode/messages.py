"""The pgoutput messages as immutable values: their tags, column values and one frozen dataclass per
message, as :func:`pg2delta.decode.pgoutput.parse_message` gives them out (import them from there).

Layouts and field meanings follow "Logical Replication Message Formats" of the PostgreSQL
documentation, protocol versions 1 to 4.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

# --------------------------------------------------------------------------- tags

BEGIN = ord("B")
MESSAGE = ord("M")
COMMIT = ord("C")
ORIGIN = ord("O")
RELATION = ord("R")
TYPE = ord("Y")
INSERT = ord("I")
UPDATE = ord("U")
DELETE = ord("D")
TRUNCATE = ord("T")
STREAM_START = ord("S")
STREAM_STOP = ord("E")
STREAM_COMMIT = ord("c")
STREAM_ABORT = ord("A")
BEGIN_PREPARE = ord("b")
PREPARE = ord("P")
COMMIT_PREPARED = ord("K")
ROLLBACK_PREPARED = ord("r")
STREAM_PREPARE = ord("p")

# Markers inside Insert / Update / Delete.


# ------------------------------------------------------------------ column values


class NullType(enum.Enum):
    """The type of :data:`NULL`, a SQL NULL column value ('n')."""

    NULL = "n"

    def __repr__(self) -> str:
        return "NULL"


class UnchangedToastType(enum.Enum):
    """The type of :data:`UNCHANGED_TOAST`: a TOASTed value the update left alone ('u'); not sent."""

    UNCHANGED_TOAST = "u"

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


NULL = NullType.NULL
UNCHANGED_TOAST = UnchangedToastType.UNCHANGED_TOAST


@dataclass(frozen=True, slots=True)
class Text:
    """A column value in the type's text output format ('t')."""

    data: bytes


@dataclass(frozen=True, slots=True)
class Binary:
    """A column value in the type's binary send format ('b')."""

    data: bytes


ColumnValue: TypeAlias = NullType | UnchangedToastType | Text | Binary
TupleData: TypeAlias = tuple[ColumnValue, ...]

# ----------------------------------------------------------------------- messages


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts: int
    xid: int


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    xid: int | None
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin:
    commit_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class RelationColumn:
    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """Part of the replica identity (flag bit 1)."""
        return bool(self.flags & 1)


@dataclass(frozen=True, slots=True)
class Relation:
    xid: int | None
    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]

    @property
    def key_names(self) -> tuple[str, ...]:
        """Names of the replica identity columns, in column order."""
        return tuple(c.name for c in self.columns if c.flags & 1)


@dataclass(frozen=True, slots=True)
class Type:
    xid: int | None
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert:
    xid: int | None
    relation_oid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    xid: int | None
    relation_oid: int
    old_kind: str | None
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    xid: int | None
    relation_oid: int
    old_kind: str
    old: TupleData


@dataclass(frozen=True, slots=True)
class Truncate:
    xid: int | None
    options: int
    relation_oids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & 2)


@dataclass(frozen=True, slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    xid: int
    subxid: int
    abort_lsn: int | None
    abort_ts: int | None


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


Message: TypeAlias = (
    Begin
    | LogicalMessage
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)
