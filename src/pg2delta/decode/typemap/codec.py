"""A column's codec: :class:`ColumnCodec` decodes one column of a window chunk to one Arrow array.

The values are byte ranges of the chunk's buffer, each with its kind (:data:`KIND_TEXT`,
:data:`KIND_BINARY`, :data:`KIND_NULL`, :data:`KIND_TOAST`); the codec splits them by wire
format and hands each part to its type's handler, bulk path first, per-value reference path
when the bulk path declines, and turns the handler's complaints into DecodeError naming the row.
"""

from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from pg2delta.decode.typemap.handler import Bad, BadAt, Handler, Notes, Part
from pg2delta.errors import DecodeError

KIND_NULL = ord("n")
KIND_TOAST = ord("u")
KIND_TEXT = ord("t")
KIND_BINARY = ord("b")


class ColumnCodec:
    """How one relation column decodes: its PostgreSQL type, its Arrow type, and :meth:`decode`."""

    __slots__ = ("arrow_type", "handler", "pg_type")

    def __init__(self, pg_type: str, handler: Handler) -> None:
        self.pg_type = pg_type
        self.handler = handler
        self.arrow_type: pa.DataType = handler.arrow_type

    def __repr__(self) -> str:
        return f"ColumnCodec({self.pg_type!r}, {self.arrow_type})"

    @property
    def server_printed(self) -> bool:
        """True for types pg2delta has no decoder for: their values are stored as the server prints them."""
        return self.handler.server_printed

    def decode(
        self,
        buf: bytes,
        starts: NDArray[np.int64],
        lengths: NDArray[np.int64],
        kinds: NDArray[np.uint8],
        notes: Notes | None = None,
        *,
        reference: bool = False,
    ) -> pa.Array:
        """One Arrow value per row; ``reference=True`` uses the per-value path only (for tests)."""
        if notes is None:
            notes = collections.Counter()
        kinds = np.asarray(kinds, dtype=np.uint8)
        n = len(kinds)
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(starts) != n or len(lengths) != n:
            raise DecodeError(f"{self.pg_type}: starts, lengths and kinds differ in length")
        is_b = kinds == KIND_BINARY
        n_b = int(np.count_nonzero(is_b))
        if n_b == n:  # all binary, no NULLs (the usual case with binary replication)
            is_t = valid = np.zeros(0, dtype=bool)
            t_rows, b_rows = np.zeros(0, dtype=np.int64), np.arange(n, dtype=np.int64)
            nvalid = n
        else:
            is_t = kinds == KIND_TEXT
            valid = is_t | is_b
            odd = np.flatnonzero(~valid & (kinds != KIND_NULL) & (kinds != KIND_TOAST))
            if len(odd):
                raise DecodeError(
                    f"{self.pg_type} value at row {int(odd[0])}: unknown value kind {int(kinds[odd[0]])}"
                )
            t_rows, b_rows = np.flatnonzero(is_t), np.flatnonzero(is_b)
            nvalid = len(t_rows) + len(b_rows)
        if nvalid == 0:
            return pa.nulls(n, type=self.arrow_type)
        raw = np.frombuffer(buf, dtype=np.uint8)
        parts = []
        for rows, binary in ((t_rows, False), (b_rows, True)):
            if len(rows):
                rs, rl = (starts, lengths) if len(rows) == n else (starts[rows], lengths[rows])
                if len(rs) and (rs.min() < 0 or rl.min() < 0 or (rs + rl).max() > len(buf)):
                    oob = np.flatnonzero((rs < 0) | (rl < 0) | (rs + rl > len(buf)))
                    raise DecodeError(f"{self.pg_type} value at row {int(rows[oob[0]])}: byte range outside the buffer")
                part = Part(buf, raw, rs, rl, rows, notes)
                parts.append(self._decode_part(part, binary, reference))
        if len(parts) == 1 and nvalid == n:
            return parts[0]
        values = pa.concat_arrays(parts) if len(parts) > 1 else parts[0]
        index = np.zeros(n, dtype=np.int64)
        index[t_rows] = np.arange(len(t_rows))
        index[b_rows] = len(t_rows) + np.arange(len(b_rows))
        return values.take(pa.array(index, mask=~valid))

    def _decode_part(self, part: Part, binary: bool, reference: bool) -> pa.Array:
        h = self.handler
        try:
            built = h.build(part, binary, reference)
            if built is not None:
                return built
            if not reference:
                snapshot = collections.Counter(part.notes)
                fast = h.vec_binary(part) if binary else h.vec_text(part)
                if fast is not None:
                    return fast
                part.notes.clear()
                part.notes.update(snapshot)
        except BadAt as exc:
            row = int(part.rows[exc.index])
            raise DecodeError(f"{self.pg_type} value at row {row}: {exc.reason}") from None
        except Bad as exc:  # about the whole column chunk, not one value
            raise DecodeError(f"{self.pg_type}: {exc}") from None
        ref = h.ref_binary if binary else h.ref_text
        out = []
        notes = part.notes
        for i, data in enumerate(part.values()):
            try:
                out.append(ref(data, notes))
            except Bad as exc:
                raise DecodeError(f"{self.pg_type} value at row {int(part.rows[i])}: {exc}") from None
        try:
            return h.from_python(out)
        except (pa.ArrowInvalid, OverflowError, ValueError) as exc:
            raise DecodeError(f"{self.pg_type}: values do not fit {self.arrow_type}") from exc
