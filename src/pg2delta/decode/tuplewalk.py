"""The tuple walk: the TupleData of a chunk's Insert/Update/Delete messages, column-wise.

One bounds-checked pass of the C extension ``_tuples.c`` walks the tuples of all rows at once
and records, per column and row, the value's kind (``n``, ``u``, ``t``, ``b``), start and length
in the chunk's buffer; no per-field Python work. :func:`be32` gathers big-endian Int32 fields at
many positions at once, :func:`differs` compares a column's old and new values row by row.

Pure: numpy arrays over bytes in, numpy arrays out.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pg2delta.decode import _tuples
from pg2delta.decode import pgoutput as po
from pg2delta.decode.typemap import KIND_BINARY, KIND_NULL, KIND_TEXT, KIND_TOAST

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


def be32(u8: U8, pos: I64) -> I64:
    """The big-endian unsigned Int32 at each position (positions checked against the buffer)."""
    out = np.empty(4 * len(pos), dtype=np.uint8)
    _tuples.gather_fixed(u8, np.ascontiguousarray(pos, dtype=np.int64), 4, out, sys.byteorder == "little")
    return out.view(np.uint32).astype(np.int64)


@dataclass(slots=True)
class Tuples:
    """Column-wise view of one TupleData per row: ``kinds/starts/lengths[col, row]``."""

    kinds: U8
    starts: I64
    lengths: I64

    @classmethod
    def empty(cls, ncols: int, n: int) -> Tuples:
        return cls(np.empty((ncols, n), np.uint8), np.empty((ncols, n), np.int64), np.empty((ncols, n), np.int64))


def walk_changes(
    buf: bytes, tags: U8, offs: I64, ends: I64, ncols: int
) -> tuple[Tuples, Tuples | None, U8, tuple[int, str, int] | None]:
    """Walk the tuples of Insert/Update/Delete messages, all rows in one pass.

    Row i has tag ``tags[i]``, its K/O/N marker at ``buf[offs[i]]`` and ends at ``ends[i]``.
    Returns the new tuples, the old tuples (None when no row has one), the old tuple's
    marker per row (``K``, ``O`` or 0) and, if a row is malformed, ``(row, reason, offset
    in buf)`` for the first one (the tuples are then incomplete). Rows without an old
    tuple read as all-NULL on the old side, Deletes on the new side.
    """
    n = len(tags)
    new, old = Tuples.empty(ncols, n), Tuples.empty(ncols, n)
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


def _fill_null(t: Tuples, rows: npt.NDArray[np.bool_]) -> None:
    if rows.all():
        t.kinds.fill(KIND_NULL)
        t.starts.fill(0)
        t.lengths.fill(0)
    elif rows.any():
        t.kinds[:, rows] = KIND_NULL
        t.starts[:, rows] = 0
        t.lengths[:, rows] = 0


def differs(u8: U8, old: Tuples, new: Tuples, c: int) -> npt.NDArray[np.bool_]:
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
