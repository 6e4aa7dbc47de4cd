"""Which columns a relation's changes are merged on.

The decoder asks a :data:`~pg2delta.decode.changes.KeyResolver` once per Relation message: the key
configured for the table (``[tables."s.t"] key``), else the replica identity the message flags
(primary key or identity index), else, for a ``REPLICA IDENTITY FULL`` table, its primary key as
the catalog has it now. The run, ``pg2delta plan`` and the copies of bootstrap and resync share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pg2delta.config import Config
from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import KeyResolver
from pg2delta.errors import SchemaError


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


__all__ = ["KeyResolver", "key_resolver"]
