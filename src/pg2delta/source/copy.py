"""One table's binary ``COPY ... TO STDOUT`` decoded into Arrow by the change path's own codecs.

:class:`CopyPlan` (the statement, the codecs, the Delta table's schema) and :class:`CopyRows` (the
CopyData blocks walked in C and decoded a chunk at a time). Where the rows go is the copy's
(:mod:`pg2delta.copy`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from psycopg import sql

from pg2delta.decode.changes import LSN_COL, META_FIELDS, META_NAMES, POS_COL, RelationVersion
from pg2delta.decode.events import COPY_OP, DELETED_FIELD, ROW_META_FIELDS
from pg2delta.decode.typemap import KIND_BINARY, KIND_TEXT
from pg2delta.errors import (
    DecodeError,
)
from pg2delta.source.copydata import CopyWalk
from pg2delta.source.publication import PublishedTable

log = logging.getLogger(__name__)

_CHUNK_ROWS = 65_536  # rows decoded at once per worker

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


# --- COPY binary rows -> Arrow --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CopyMeta:
    """The row metadata of a table's copied rows ([tables."s.t"] metadata, pg2delta.apply.rowmeta):
    ``_pg2delta_lsn`` the snapshot's LSN (its consistent point), ``_pg2delta_commit_ts`` ``ts``
    (microseconds since 1970: PostgreSQL's transaction_timestamp() in the snapshot, after every
    copied row's commit), ``_pg2delta_op`` ``S``; with ``soft`` deletes ``_pg2delta_deleted`` false."""

    lsn: int
    ts: int
    soft: bool = False


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """How one table is copied: the COPY statement, the codecs, and the Arrow schema of the Delta table."""

    table: PublishedTable
    version: RelationVersion
    keyless: bool  # no key: rows carry _pg2delta_lsn = 0 and a row number, as the change path keys them
    schema: pa.Schema
    text_columns: tuple[bool, ...]
    meta: CopyMeta | None = None

    @classmethod
    def make(cls, table: PublishedTable, version: RelationVersion, meta: CopyMeta | None = None) -> CopyPlan:
        keyless = not version.key_indexes
        # The landed columns (hashed ones as strings, excluded ones left out: pg2delta.decode.governance).
        fields = [f for f in version.schema if f.name not in META_NAMES]
        if keyless:
            named = {f.name: f for f in META_FIELDS}
            fields += [named[LSN_COL], named[POS_COL]]
        if meta is not None:  # a keyless table's _pg2delta_lsn is its key (0 in copied rows): kept so
            fields += [f for f in ROW_META_FIELDS if not (keyless and f.name == LSN_COL)]
            fields += [DELETED_FIELD] if meta.soft else []
        text = tuple(
            c.name in table.text_columns or codec.server_printed
            for c, codec in zip(table.relation.columns, version.codecs, strict=True)
        )
        return cls(table, version, keyless, pa.schema(fields), text, meta)

    def statement(self) -> sql.Composed:
        cols: list[sql.Composable] = []
        for c, as_text in zip(self.table.relation.columns, self.text_columns, strict=True):
            ident = sql.Identifier(c.name)
            if as_text:
                # The type's output function, as pgoutput's text format and the change path's server printing give it.
                cols.append(sql.SQL("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END").format(c=ident))
            else:
                cols.append(ident)
        # A table copied from its leaf partitions (partitions = "root"): all leaves in one query
        # (one snapshot, one walk of the rows).
        # In key order (by position: a column printed as text has no name): the table's files then
        # hold key ranges apart, and a window's rewrite takes the files of its keys only
        # (pg2delta.lake.engine_commits.key_ranges).
        query = self.table.select(cols)
        if self.version.key_indexes:
            order = sql.SQL(", ").join(sql.Literal(i + 1) for i in self.version.key_indexes)
            query = sql.SQL("{} ORDER BY {}").format(query, order)
        return sql.SQL("COPY ({}) TO STDOUT (FORMAT binary)").format(query)

    def decode(
        self, buf: bytes, kinds: U8, starts: I64, lengths: I64, first_row: int, notes: collections.Counter[str]
    ) -> pa.RecordBatch:
        """Walked COPY rows ((column, row) kinds, starts and lengths in ``buf``) -> one record batch
        of the Delta table's schema."""
        rel = self.table.relation
        arrays: list[pa.Array] = []
        for c, codec in enumerate(self.version.codecs):
            try:
                arrays.append(codec.decode(buf, starts[c], lengths[c], kinds[c], notes))
            except DecodeError as exc:
                raise DecodeError(
                    f"column {rel.columns[c].name!r} of {self.table.qualified}, copy row {first_row}+: {exc.reason}"
                ) from exc
        if self.version.governance is not None:
            arrays = self.version.governance.apply(arrays)
        n = kinds.shape[1]
        if self.keyless:
            arrays.append(pa.array(np.zeros(n, dtype=np.int64)))
            arrays.append(pa.array(np.arange(first_row, first_row + n, dtype=np.int64)))
        if self.meta is not None:
            if not self.keyless:
                arrays.append(pa.array(np.full(n, self.meta.lsn, dtype=np.int64)))
            arrays.append(pa.array(np.full(n, self.meta.ts, dtype=np.int64)).cast(pa.timestamp("us", tz="UTC")))
            arrays.append(pa.array([COPY_OP] * n, type=pa.string()))
            if self.meta.soft:
                arrays.append(pa.array(np.zeros(n, dtype=bool)))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)


class CopyRows:
    """Binary COPY data, as psycopg hands its CopyData blocks over, -> record batches of a table.

    The blocks are appended to one buffer; every ``_CHUNK_BYTES`` the buffer's rows are walked in C
    (``_tuples.walk_copy``: field count, then per field its length, -1 for NULL, and the bytes, every
    read bounds-checked) into at most ``_CHUNK_ROWS`` rows at a time, and each column decoded by the
    change path's codec over the whole chunk. No Python work per row but the append of its block.
    """

    def __init__(self, plan: CopyPlan) -> None:
        self.plan = plan
        ncols = max(len(plan.table.relation.columns), 1)  # a SELECT without columns sends one NULL field
        value_kinds = bytes(KIND_TEXT if t else KIND_BINARY for t in plan.text_columns).ljust(ncols, b"b")
        qualified = plan.table.qualified
        self.walk = CopyWalk(
            ncols, value_kinds, _CHUNK_ROWS, f"COPY of {qualified}",
            "malformed binary COPY row {row} of " + qualified.replace("{", "{{").replace("}", "}}") + ": {reason}",
        )
        self.notes: collections.Counter[str] = collections.Counter()  # clamped values and the like
        self.rows = 0

    def feed(self, buf: bytes, emit: Callable[[pa.RecordBatch], None], *, last: bool = False) -> bytearray:
        """Decode the whole rows of ``buf`` and hand their batches to ``emit``; returns the bytes
        left over (a row cut at the end, to be completed by the next blocks)."""

        def take(kinds: Any, starts: Any, lengths: Any) -> bool:
            emit(self.plan.decode(buf, kinds, starts, lengths, self.rows, self.notes))
            self.rows += kinds.shape[1]
            return True

        return bytearray(buf[self.walk.walk(buf, take, last=last):])
