"""What the publication holds, read from the catalog: the published tables (columns, row filters,
what puts each in the publication, a partitioned table's leaves), as of one snapshot or now.

The bootstrap, the run (a table added to the publication, a partition attached or detached),
``pg2delta plan``, resync and verify all read the publication here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pg2delta.config import Config
from pg2delta.decode import pgoutput as po
from pg2delta.errors import (
    SchemaError,
)
from pg2delta.source.rewrites import filenodes_json, filenodes_of, filenodes_sql

log = logging.getLogger(__name__)


# --- what the publication holds ----------------------------------------------------------------

# ``membership``: what puts the table in the publication, as catalog row OIDs: the publication's
# own (FOR ALL TABLES), the pg_publication_rel rows of the table or of a partition ancestor, the
# pg_publication_namespace rows of their schemas (pg_partition_ancestors has no rows for a table
# outside a partition tree, hence the table's own OID beside it). A table removed from the publication and added
# back (or a publication dropped and created again) gets new rows, so a new membership: the changes
# made in between were never published (see tables_to_copy).
_MEMBERSHIP = """(SELECT string_agg(m, ',' ORDER BY m) FROM (
            SELECT 'all:' || p.oid FROM pg_publication p WHERE p.oid = pub.oid AND p.puballtables
            UNION ALL
            SELECT 'rel:' || pr.oid FROM pg_publication_rel pr
            WHERE pr.prpubid = pub.oid AND (pr.prrelid = c.oid OR pr.prrelid IN (SELECT relid FROM pg_partition_ancestors(c.oid)))
            UNION ALL
            SELECT 'schema:' || pn.oid FROM pg_publication_namespace pn
            WHERE pn.pnpubid = pub.oid AND pn.pnnspid IN (
                SELECT a.relnamespace FROM pg_class a
                WHERE a.oid = c.oid OR a.oid IN (SELECT relid FROM pg_partition_ancestors(c.oid)))
        ) AS ms(m))"""
# ``leaves``: a partitioned table's leaf partitions (OIDs), to notice one attached with rows in it.
_LEAVES = """(SELECT string_agg(l.relid::int8::text, ',' ORDER BY l.relid::int8)
        FROM pg_partition_tree(c.oid) l WHERE l.isleaf AND c.relkind = 'p')"""
# ``filenodes``: a partitioned table's leaves' relfilenodes, to notice a TRUNCATE of one of them
# (source/rewrites.py); read in the copy's snapshot, like the rest, they are the ones of its rows.
_FILENODES = "CASE WHEN c.relkind = 'p' THEN " + filenodes_sql("c.oid") + " END"
_TABLES_QUERY = """
SELECT c.oid::int8, pt.schemaname::text, pt.tablename::text, c.relkind::text, c.relreplident::text,
       pt.attnames::text[], pt.rowfilter::text, c.reltuples::float8,
       """ + _MEMBERSHIP + """, """ + _LEAVES + """, """ + _FILENODES + """
FROM pg_publication_tables pt
JOIN pg_publication pub ON pub.pubname = pt.pubname
JOIN pg_namespace n ON n.nspname = pt.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
WHERE pt.pubname = %s
ORDER BY 2, 3
"""

_MEMBERSHIPS_QUERY = """
SELECT c.oid::int8, """ + _MEMBERSHIP + """, """ + _LEAVES + """, c.relkind = 'p'
FROM pg_publication_tables pt
JOIN pg_publication pub ON pub.pubname = pt.pubname
JOIN pg_namespace n ON n.nspname = pt.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
WHERE pt.pubname = %s
"""


def publication_memberships(
    conn: psycopg.Connection[Any], publication: str
) -> dict[int, tuple[str | None, str | None, bool]]:
    """Per published table (OID), what puts it in the publication (see ``_MEMBERSHIP``), for a
    partitioned table (published via its root) its leaf partitions, and whether it is one; one query."""
    return {int(oid): (m, leaves, bool(p)) for oid, m, leaves, p in conn.execute(_MEMBERSHIPS_QUERY, (publication,)).fetchall()}


def partition_leaves(conn: psycopg.Connection[Any], names: Sequence[str]) -> dict[int, str | None]:
    """The leaf partitions of the partitioned tables ``names`` ("schema.table"; missing ones left out)."""
    out: dict[int, str | None] = {}
    for name in names:
        schema, _, table = name.partition(".")
        row = conn.execute(
            "SELECT c.oid::int8, " + _LEAVES + " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = %s AND c.relkind = 'p'",
            (schema, table),
        ).fetchone()
        if row is not None:
            out[int(row[0])] = row[1]
    return out


def rows_before_attach(conn: psycopg.Connection[Any], leaf: int) -> str | None:
    """The name of partition ``leaf`` if it holds rows older than its place in its partition tree
    (a row's ``xmin`` older than the newest ``pg_inherits`` link between it and the root, or the
    same transaction and an earlier command, ``cmin``): rows it had when it was attached, which
    PostgreSQL never sends. Rows inserted after the link in the transaction that made it (``CREATE
    TABLE … PARTITION OF`` then ``INSERT``) are sent. None otherwise (or gone). Reads the partition
    once; rows frozen past XID wraparound are not told apart."""
    name = relation_name(conn, leaf)
    if name is None:
        return None
    found = conn.execute(
        sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM ONLY {} t, ("
            "SELECT i.xmin AS x, i.cmin::text::int8 AS c FROM pg_inherits i "
            "WHERE i.inhrelid IN (SELECT relid FROM pg_partition_ancestors(%s)) "
            "ORDER BY age(i.xmin), i.cmin::text::int8 DESC LIMIT 1) l "
            "WHERE age(t.xmin) > age(l.x) OR (t.xmin = l.x AND t.cmin::text::int8 < l.c))"
        ).format(sql.Identifier(*name)),
        (leaf,),
    ).fetchone()
    return ".".join(name) if found is not None and found[0] else None


def relation_name(conn: psycopg.Connection[Any], oid: int) -> tuple[str, str] | None:
    """(schema, name) of relation ``oid``; None when it is gone."""
    row = conn.execute(
        "SELECT n.nspname::text, c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = %s",
        (oid,),
    ).fetchone()
    return (str(row[0]), str(row[1])) if row is not None else None


# Columns in attribute order, whether the column's type has a binary send function (for an
# array: its element's too), and whether the column is part of the replica identity index.
_COLUMNS_QUERY = """
SELECT a.attname::text, a.atttypid::int8, a.atttypmod::int4, a.attgenerated::text,
       t.typsend <> 0 AND coalesce(e.typsend <> 0, true),
       coalesce(a.attnum = ANY(i.indkey), false), a.attnum::int4
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A'
LEFT JOIN LATERAL (
    SELECT x.indkey::int2[] AS indkey FROM pg_index x
    WHERE x.indrelid = a.attrelid AND CASE %s WHEN 'd' THEN x.indisprimary WHEN 'i' THEN x.indisreplident ELSE false END
    LIMIT 1
) i ON true
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


@dataclass(frozen=True, slots=True)
class PublishedTable:
    """One table of the publication as pgoutput publishes it: columns, key flags, row filter."""

    relation: po.Relation  # what a Relation message of the table carries
    partitioned: bool
    row_filter: str | None
    text_columns: frozenset[str]  # types without a binary send function: copied as text
    estimated_rows: int | None  # pg_class.reltuples, for progress
    membership: str | None = None  # why the publication holds it (catalog row OIDs, see _TABLES_QUERY)
    leaves: str | None = None  # a partitioned table's leaf partitions (OIDs), when it was read
    attnums: str | None = None  # JSON {column: pg_attribute.attnum} of the published columns
    filenodes: str | None = None  # a partitioned table's leaves' relfilenodes (JSON), when it was read
    # ``partitions = "root"``: the published leaf partitions copied into this root's table, each as
    # (schema, name, row filter); empty for a table copied from itself.
    parts: tuple[tuple[str, str, str | None], ...] = ()
    # Why the table cannot be copied or compared as published (its leaves publish different
    # columns): raised by :meth:`usable` where the table itself is copied or verified, so that the
    # other tables of the publication can be.
    problem: str | None = None

    def usable(self) -> PublishedTable:
        """This table, or :class:`SchemaError` (exit 78) with :attr:`problem`."""
        if self.problem is not None:
            raise SchemaError(self.problem)
        return self

    @property
    def oid(self) -> int:
        return self.relation.oid

    @property
    def qualified(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"

    def select(self, cols: Sequence[sql.Composable]) -> sql.Composed:
        """``SELECT cols`` over the rows the publication sends of the table: under its row filter,
        ``ONLY`` its own unless partitioned; a table copied from its leaf partitions (``partitions
        = "root"``), each leaf ONLY its own rows under its own row filter, ``UNION ALL``."""
        rel = self.relation
        sources = [(s, n, f, True) for s, n, f in self.parts] or [
            (rel.namespace, rel.name, self.row_filter, not self.partitioned)
        ]
        selects: list[sql.Composable] = []
        for schema, name, row_filter, only in sources:
            query = sql.SQL("SELECT {cols} FROM {only}{table}").format(
                cols=sql.SQL(", ").join(cols) if cols else sql.SQL("NULL"),
                only=sql.SQL("ONLY ") if only else sql.SQL(""),
                table=sql.Identifier(schema, name),
            )
            if row_filter:
                query = sql.SQL("{} WHERE ({})").format(query, sql.SQL(row_filter))
            selects.append(query)
        return sql.SQL(" UNION ALL ").join(selects)


def published_tables(conn: psycopg.Connection[Any], publication: str) -> list[PublishedTable]:
    """The publication's tables with their published columns (PostgreSQL 15+ column lists) and row filters."""
    out: list[PublishedTable] = []
    for oid, schema, name, relkind, replident, attnames, rowfilter, reltuples, membership, leaves, nodes in conn.execute(
        _TABLES_QUERY, (publication,)
    ).fetchall():
        wanted = None if attnames is None else set(attnames)
        columns: list[po.RelationColumn] = []
        text_columns: set[str] = set()
        attnums: dict[str, int] = {}
        for att, typ, typmod, generated, has_send, in_identity, attnum in conn.execute(
            _COLUMNS_QUERY, (replident, oid)
        ).fetchall():
            if (att not in wanted) if wanted is not None else bool(generated):
                continue
            key = replident == "f" or bool(in_identity)
            columns.append(po.RelationColumn(1 if key else 0, str(att), int(typ), int(typmod)))
            attnums[str(att)] = int(attnum)
            if not has_send:
                text_columns.add(str(att))
        rel = po.Relation(None, int(oid), str(schema), str(name), str(replident), tuple(columns))
        estimate = int(reltuples) if reltuples is not None and reltuples >= 0 else None
        out.append(PublishedTable(rel, relkind == "p", rowfilter, frozenset(text_columns), estimate, membership, leaves,
                                  json.dumps(attnums, sort_keys=True), filenodes_json(filenodes_of(nodes))))
    return out


# ``partitions = "root"``: each published leaf partition's top root, when it has one.
_ROOTS_QUERY = """
SELECT l.oid, r.oid::int8, n.nspname::text, r.relname::text
FROM unnest(%s::int8[]) AS l(oid)
JOIN pg_class r ON r.oid = pg_partition_root(l.oid::oid) AND r.oid <> l.oid::oid
JOIN pg_namespace n ON n.oid = r.relnamespace
"""


def copied_tables(conn: psycopg.Connection[Any], config: Config) -> list[PublishedTable]:
    """What a copy makes Delta tables of: the publication's tables (:func:`published_tables`), with
    the published leaf partitions of a table configured ``partitions = "root"`` replaced by one
    entry for that root (OID and name the root's, as the run's changes of them are applied to it),
    copied from all of them (:attr:`PublishedTable.parts`)."""
    published = published_tables(conn, config.source.publication)
    if not any(t.partitions == "root" for t in config.tables.values()):
        return published
    roots = {
        int(leaf): (int(oid), str(schema), str(name))
        for leaf, oid, schema, name in conn.execute(_ROOTS_QUERY, ([t.oid for t in published],)).fetchall()
        if config.table(str(schema), str(name)).partitions == "root"
    }
    out: list[PublishedTable] = []
    grouped: dict[tuple[int, str, str], list[PublishedTable]] = {}
    for t in published:
        if t.oid in roots:
            grouped.setdefault(roots[t.oid], []).append(t)
        else:
            out.append(t)
    for (oid, schema, name), leaves in grouped.items():
        out.append(_rooted(conn, oid, schema, name, leaves))
    return sorted(out, key=lambda t: (t.relation.namespace, t.relation.name))


def _rooted(
    conn: psycopg.Connection[Any], oid: int, schema: str, name: str, leaves: Sequence[PublishedTable]
) -> PublishedTable:
    """One table for the root ``oid`` of ``leaves`` (``partitions = "root"``): their columns (they
    must publish the same ones, as one Delta table holds them, else :attr:`PublishedTable.problem`
    says so), each leaf's row filter, and the root's leaf partitions of now (the run compares them
    to notice one attached or detached)."""
    first = leaves[0]
    problem = next(
        (
            f"the partitions of {schema}.{name} (partitions = \"root\") publish different columns "
            f"({first.qualified}: {', '.join(c.name for c in first.relation.columns)}; {leaf.qualified}: "
            f"{', '.join(c.name for c in leaf.relation.columns)}): pg2delta copies them into one Delta "
            "table only when they publish the same columns; give them one column list in the publication"
            for leaf in leaves[1:]
            if leaf.relation.columns != first.relation.columns
        ),
        None,
    )
    estimates = [t.estimated_rows for t in leaves if t.estimated_rows is not None]
    return PublishedTable(
        dataclasses.replace(first.relation, oid=oid, namespace=schema, name=name),
        True,
        None,
        frozenset().union(*(t.text_columns for t in leaves)),
        sum(estimates) if estimates else None,
        leaves=partition_leaves(conn, [f"{schema}.{name}"]).get(oid),
        parts=tuple((t.relation.namespace, t.relation.name, t.row_filter) for t in leaves),
        problem=problem,
    )
