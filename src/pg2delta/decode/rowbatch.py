"""Tuples to Arrow: the record batch of one relation version's rows in a decoded chunk.

:func:`build_batch` takes the rows (already in commit order) of one relation version and

* walks their tuples (:func:`pg2delta.decode.tuplewalk.walk_changes`), the reference parser naming a
  malformed row;
* lays out the output rows (:func:`_output_rows`): one per message, plus a delete of the old key
  before an Update that changes its key and, with ``keep_old``, a ``B`` row before an Update that
  keeps its key but carries the whole old row;
* converts each column in bulk with its codec and names the unchanged TOAST columns
  (:func:`_data_columns`);
* adds the meta columns (:func:`_meta_columns`) from the chunk's commit order (:class:`OrderedRows`).

Pure: numpy arrays over the chunk's bytes in, one Arrow record batch out.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from pg2delta.decode import pgoutput as po
from pg2delta.decode.tuplewalk import Tuples, differs, walk_changes
from pg2delta.decode.typemap import KIND_BINARY, KIND_TEXT, KIND_TOAST
from pg2delta.errors import DecodeError

if TYPE_CHECKING:
    from pg2delta.decode.events import RelationVersion, RowChunk

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
Mask = npt.NDArray[np.bool_]

_OP_BEFORE = ord("B")  # pg2delta.decode.changes.BEFORE_OP


@dataclass(frozen=True, slots=True)
class OrderedRows:
    """One chunk's rows with their commit order: what every batch of the chunk reads.

    Per row: ``tags``, ``in_stream`` (the message carries an xid), ``position`` inside its
    transaction and ``txn_of_row`` (index into the per-transaction arrays: commit LSN, commit
    time in microseconds since 1970, xid or -1).
    """

    rows: RowChunk
    u8: U8
    tags: U8
    in_stream: Mask
    position: I64
    txn_of_row: I64
    commit_lsn_of_txn: I64
    ts_of_txn: I64
    xid_of_txn: I64


@dataclass(slots=True)
class _OutputRows:
    """The batch's rows: op byte, position, transaction, whether from the old tuple, and per column
    the kinds, starts and lengths of the values."""

    op: U8
    pos: I64
    tid: I64
    use_old: Mask
    columns: list[tuple[U8, I64, I64]]

    @property
    def n(self) -> int:
        return len(self.op)


def build_batch(
    version: RelationVersion, ordered: OrderedRows, sel: I64, notes: collections.Counter[str], *, keep_old: bool
) -> pa.RecordBatch:
    """One record batch for rows ``sel`` (already in commit order) of one relation version."""
    ncols = len(version.relation.columns)
    rows, tags, in_stream = ordered.rows, ordered.tags, ordered.in_stream
    ends = rows.ends[sel]
    p = rows.starts[sel] + 5 + 4 * in_stream[sel]  # after tag, [xid], oid: the K/O/N marker
    row_tags = tags[sel]

    new_t, old_t, marker, bad = walk_changes(rows.buf, row_tags, p, ends, ncols)
    if bad is not None:
        raise _malformed(version, ordered, sel, bad) from None
    pos_in = 2 * ordered.position[sel] + 1
    tid_in = ordered.txn_of_row[sel]
    if old_t is None:
        # Inserts and updates without an old tuple (the usual case): one output row per
        # message, the new tuple as it is.
        op = np.where(row_tags == po.INSERT, ord("I"), ord("U")).astype(np.uint8)
        columns = [(new_t.kinds[c], new_t.starts[c], new_t.lengths[c]) for c in range(ncols)]
        out = _OutputRows(op, pos_in, tid_in, np.zeros(len(sel), dtype=bool), columns)
    else:
        out = _output_rows(version, ordered.u8, row_tags, pos_in, tid_in, new_t, old_t, marker, keep_old=keep_old)
    arrays, toast = _data_columns(version, rows, sel, out, notes)
    return pa.RecordBatch.from_arrays([*arrays, *_meta_columns(ordered, out, toast)], schema=version.schema)


def _malformed(version: RelationVersion, ordered: OrderedRows, sel: I64, bad: tuple[int, str, int]) -> DecodeError:
    """The error for the first malformed row the walk found (the reference parser's, when it has one)."""
    rows = ordered.rows
    j, what, at = bad
    row = int(sel[j])
    s, e = int(rows.starts[row]), int(rows.ends[row])
    # The reference parser gives the most precise message; fall back to the walk's.
    try:
        po.parse_message(memoryview(rows.buf)[s:e], in_stream=bool(ordered.in_stream[row]), lsn=int(rows.lsns[row]))
    except DecodeError as exc:
        return exc.with_lsn(int(rows.lsns[row]))
    return DecodeError(
        f"{what} for relation {version.qualified_name[0]}.{version.qualified_name[1]}",
        tag=chr(int(ordered.tags[row])), offset=at - s, lsn=int(rows.lsns[row]),
    )


def _output_rows(
    version: RelationVersion,
    u8: U8,
    row_tags: U8,
    pos_in: I64,
    tid_in: I64,
    new_t: Tuples,
    old_t: Tuples,
    marker: U8,
    *,
    keep_old: bool,
) -> _OutputRows:
    """The output rows of messages some of which carry an old tuple (Updates with K/O, Deletes)."""
    n_in = len(row_tags)
    has_old = marker != 0  # Updates with K/O, every Delete
    has_new = row_tags != po.DELETE
    # Which rows need a delete of their old key first: updates whose key changed.
    key_changed = np.zeros(n_in, dtype=bool)
    upd_old = has_old & has_new
    if upd_old.any() and version.key_indexes:
        for c in version.key_indexes:
            key_changed |= upd_old & differs(u8, old_t, new_t, c)
    # Updates that keep their key but carry the whole old row: a 'B' row first, if asked.
    before = upd_old & (marker == ord("O")) & ~key_changed if keep_old else np.zeros(n_in, dtype=bool)
    # Output rows: for each source row, optionally an old-key delete (or 'B'), then the row itself.
    extra = key_changed | before
    src = np.repeat(np.arange(n_in), 1 + extra.astype(np.int64))
    first_of_pair = np.r_[True, src[1:] != src[:-1]]
    is_old_delete = first_of_pair & key_changed[src]
    is_before = first_of_pair & before[src]
    use_old = is_old_delete | is_before | (row_tags[src] == po.DELETE)
    op = np.where(
        is_before, _OP_BEFORE,
        np.where(use_old, ord("D"), np.where(row_tags[src] == po.INSERT, ord("I"), ord("U"))),
    ).astype(np.uint8)
    pos = pos_in[src] - (is_old_delete | is_before)
    # REPLICA IDENTITY FULL sends the whole old row ('O'): a value the new tuple leaves
    # out as unchanged TOAST is the old one.
    full_old = (marker == ord("O"))[src] & ~use_old
    columns: list[tuple[U8, I64, I64]] = []
    for c in range(len(version.relation.columns)):
        old_k = old_t.kinds[c, src]
        take_old = use_old | (
            full_old & (new_t.kinds[c, src] == KIND_TOAST) & ((old_k == KIND_TEXT) | (old_k == KIND_BINARY))
        )
        columns.append((
            np.where(take_old, old_k, new_t.kinds[c, src]),
            np.where(take_old, old_t.starts[c, src], new_t.starts[c, src]),
            np.where(take_old, old_t.lengths[c, src], new_t.lengths[c, src]),
        ))
    return _OutputRows(op, pos, tid_in[src], use_old, columns)


def _data_columns(
    version: RelationVersion, rows: RowChunk, sel: I64, out: _OutputRows, notes: collections.Counter[str]
) -> tuple[list[pa.Array], pa.Array]:
    """Every data column converted by its codec, and the ``_pg2delta_toast`` column."""
    n_out = out.n
    arrays: list[pa.Array] = []
    toast_any = np.zeros(n_out, dtype=bool)
    toast_cols: list[Mask] = []
    use_old = out.use_old
    any_old = bool(use_old.any())
    for c, (codec, (kinds, cstarts, clens)) in enumerate(zip(version.codecs, out.columns, strict=True)):
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
    governance = version.governance
    if governance is not None:
        # Hashed and excluded columns (pg2delta.decode.governance): nothing downstream sees a raw value.
        arrays = governance.apply(arrays)
        toast_any = np.zeros(n_out, dtype=bool)
        for c, is_toast in enumerate(toast_cols):
            if governance.kept(c):
                toast_any |= is_toast
            else:
                toast_cols[c] = np.zeros(n_out, dtype=bool)
    if toast_any.any():
        names = version.column_names
        lists: list[list[str] | None] = [None] * n_out
        for j in np.flatnonzero(toast_any).tolist():
            lists[j] = [names[c] for c in range(len(toast_cols)) if toast_cols[c][j]]
        toast = pa.array(lists, type=pa.list_(pa.string()))
    else:
        toast = pa.nulls(n_out, type=pa.list_(pa.string()))
    return arrays, toast


def _meta_columns(ordered: OrderedRows, out: _OutputRows, toast: pa.Array) -> list[pa.Array]:
    """The meta columns (``META_FIELDS``), ``toast`` among them."""
    n_out, tid = out.n, out.tid
    # One-character strings: offsets 0, 1, 2, ... over the op bytes.
    ops = pa.Array.from_buffers(
        pa.string(), n_out, [None, pa.py_buffer(np.arange(n_out + 1, dtype=np.int32)), pa.py_buffer(out.op)]
    )
    xids = ordered.xid_of_txn[tid]
    return [
        pa.array(ordered.commit_lsn_of_txn[tid], type=pa.int64()),
        pa.array(out.pos, type=pa.int64()),
        ops,
        toast,
        pa.array(xids, type=pa.int64(), mask=xids < 0),
        pa.array(ordered.ts_of_txn[tid], type=pa.int64()).cast(pa.timestamp("us", tz="UTC")),
    ]
