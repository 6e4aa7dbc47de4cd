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
from pg2delta.decode.governance import ColumnRuler, ColumnRules
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


def column_rules(config: Config, conn: Any) -> ColumnRuler | None:
    """``[tables."s.t"] hash`` and ``exclude`` of a relation: its own table's and those of its
    partition ancestors (a partitioned table's rules hold for each of its partitions, whatever
    ``partitions`` says and however the publication sends them). None when no table has any."""
    if not config.governed():
        return None

    def rules(rel: po.Relation) -> ColumnRules | None:
        names = [(rel.namespace or "pg_catalog", rel.name)]
        names += [(str(s), str(t)) for s, t in conn.execute(
            "SELECT n.nspname, c.relname FROM pg_partition_ancestors(%s::regclass) a JOIN pg_class c ON c.oid = a.relid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE a.relid <> %s::regclass",
            (rel.oid, rel.oid),
        ).fetchall()]
        hashed: set[str] = set()
        excluded: set[str] = set()
        for schema, name in names:
            table = config.table(schema, name)
            hashed.update(table.hash)
            excluded.update(table.exclude)
        if not hashed and not excluded:
            return None
        return ColumnRules(frozenset(hashed), frozenset(excluded), config.hash_key)

    return rules


__all__ = ["ColumnRuler", "KeyResolver", "column_rules", "key_resolver"]
