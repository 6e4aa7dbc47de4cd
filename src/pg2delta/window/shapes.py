"""The shape of a Relation message (columns, their types, the key), and where a window must end
so that each of its tables holds changes of one shape only.

Pure: relation versions and batches in, shapes and a commit LSN out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa

from pg2delta.decode.changes import META_NAMES, BatchLike, RelationVersion
from pg2delta.lake.types import spark_type


@dataclass(frozen=True, slots=True)
class Shape:
    """The columns (name, Arrow type) and key of one Relation message."""

    columns: tuple[tuple[str, pa.DataType], ...]
    key: tuple[str, ...]

    def signature(self) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        return tuple((n, spark_type(t)) for n, t in self.columns), self.key



def shape_of(version: RelationVersion) -> Shape:
    """The shape of the rows a Relation message describes: data columns, their Arrow types, the key."""
    fields = [f for f in version.schema if f.name not in META_NAMES]
    return Shape(tuple((f.name, f.type) for f in fields), version.key_names)


def shape_cut(tables: Sequence[Sequence[BatchLike]], truncate_lsns: Sequence[int] = ()) -> int | None:
    """The commit LSN of the first transaction after the window's first one that changes a table's
    shape (columns, types or key), or None: the window ends there, so every later window starts
    with one shape per table. Shapes changing inside the first transaction stay in the window.

    ``tables``: each table's batches of the window, in commit order; ``truncate_lsns``: the commit
    LSNs of the window's truncates.
    """
    lsns = [b.first_lsn for batches in tables for b in batches if b.num_rows]
    lsns += list(truncate_lsns)
    if not lsns:
        return None
    first = min(lsns)
    cut: int | None = None
    for batches in tables:
        prev = None
        for b in batches:
            if not b.num_rows:
                continue
            sig = shape_of(b.relation).signature()
            lsn0 = b.first_lsn
            if prev is not None and sig != prev and lsn0 > first:
                cut = lsn0 if cut is None else min(cut, lsn0)
                break
            prev = sig
    return cut
