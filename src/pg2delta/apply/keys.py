"""Key values as Python tuples that compare and hash as PostgreSQL's keys do (NaN included).

Which columns a relation is keyed on is :func:`pg2delta.source.keys.key_resolver`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa

# PostgreSQL orders NaN as one value, equal to itself, so a float key can hold it (once); Python's
# NaN equals nothing, and each one read from Arrow is a new object. Key tuples made with these
# functions hold this one NaN instead, so they compare and hash as PostgreSQL's keys do (a tuple
# compares its items by identity first). -0.0 and 0.0 are already equal in both.
NAN = float("nan")


def key_tuples(columns: Iterable[pa.Array | pa.ChunkedArray]) -> list[tuple[Any, ...]]:
    """The key of every row of the key ``columns`` as a tuple (see :data:`NAN`)."""
    values = [
        [NAN if v != v else v for v in c.to_pylist()] if pa.types.is_floating(c.type) else c.to_pylist() for c in columns
    ]
    return list(zip(*values, strict=True))


def key_tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    """``values`` (of one key) as a tuple that equals :func:`key_tuples`' one for the same key."""
    return tuple(NAN if isinstance(v, float) and v != v else v for v in values)


__all__ = ["NAN", "key_tuple", "key_tuples"]
