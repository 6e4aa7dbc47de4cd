"""Which columns a relation's changes are merged on.

The decoder asks a :data:`KeyResolver` once per Relation message: the key configured for the
table (``[tables."s.t"] key``), else the replica identity the message flags (primary key or
identity index), else, for a ``REPLICA IDENTITY FULL`` table, its primary key as the catalog
has it now. The run, ``pg2delta plan`` and the copies of bootstrap and resync share it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow as pa

from pg2delta.config import Config
from pg2delta.decode import pgoutput as po
from pg2delta.errors import SchemaError

KeyResolver = Callable[[po.Relation], Sequence[str] | None]


def key_resolver(config: Config, conn: Any) -> KeyResolver:
    """The key rule of ``config``, reading primary keys over the catalog connection ``conn``."""

    def resolve(rel: po.Relation) -> Sequence[str] | None:
        configured = config.table(rel.namespace or "pg_catalog", rel.name).key
        if configured:
            return configured
        if rel.replica_identity != "f":
            return None  # the replica identity the message flags (primary key or index)
        rows = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisprimary "
            "ORDER BY array_position(i.indkey::int2[], a.attnum)",
            (rel.oid,),
        ).fetchall()
        if not rows:
            raise SchemaError(
                f"table {rel.namespace}.{rel.name} has REPLICA IDENTITY FULL and no primary key: "
                f"set [tables.\"{rel.namespace}.{rel.name}\"] key = [...] in the config"
            )
        return [str(r[0]) for r in rows]

    return resolve


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


__all__ = ["NAN", "KeyResolver", "key_resolver", "key_tuple", "key_tuples"]
