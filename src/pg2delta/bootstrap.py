"""Bootstrap: every published table copied into Delta exactly as of the replication slot's start.

``pg2delta bootstrap``

1. takes the slot's advisory lock and checks the publication and the lake; the slot must not
   exist yet (an existing slot resumes an interrupted bootstrap of this lake, or needs ``--resume``);
2. creates the slot on a replication connection with
   ``CREATE_REPLICATION_SLOT <slot> LOGICAL pgoutput (SNAPSHOT 'export')``: the server returns the
   slot's consistent point L and exports a snapshot that holds exactly the transactions whose commit
   record starts before L, while the slot will emit exactly those whose commit record starts at or
   after L (its ``confirmed_flush_lsn`` is L);
3. records L in the applied log as the lake's start (a ``kind = 'bootstrap'`` row without a table);
4. copies every published table with worker connections that import that snapshot
   (``REPEATABLE READ``, ``SET TRANSACTION SNAPSHOT``), several tables at once: ``COPY (SELECT
   <published columns> FROM <table> WHERE <row filter>) TO STDOUT (FORMAT binary)``, decoded
   column-wise into Arrow by the change path's own codecs, written as Parquet chunks under the
   lake's staging area (memory is bounded by two chunks per worker), then made visible in ONE Delta
   commit that replaces the table: a reader sees no table or the whole copy, never part of it;
5. records each finished table in the applied log as applied through L (``kind = 'bootstrap'``).

A table configured ``partitions = "root"`` is copied as one table (:func:`copied_tables`): its
published leaf partitions, each ``FROM ONLY`` itself under its own column list and row filter, in
one ``COPY (… UNION ALL …)`` into the root's Delta table, recorded under the root's OID: the owner
the run applies every leaf's changes to, so its applied-LSN filter covers them all.

``pg2delta run`` then applies, per table, only the changes whose commit LSN is at or after the LSN
the table was copied at (the job's applied-LSN filter), so nothing is lost or applied twice, for
keyless (insert-only) tables too.

**Copies at a later snapshot.** An exported snapshot lives only as long as the replication
connection that exported it. Tables copied later get a snapshot of their own from a TEMPORARY slot
created the same way: a resumed bootstrap (tables the interrupted one did not finish), and tables
added to the publication after the bootstrap (``run`` copies them first, before its windows). The
temporary slot's consistent point L2 is at or after the main slot's position (both come from the
same WAL; the main slot cannot be ahead of the server); the table is recorded as applied through L2
and the main slot's changes of it before L2, which the snapshot holds already, are skipped. In a
bootstrapped lake, ``run`` skips the changes of a published table that has no copy yet (one added
to the publication while the run was reading): the next run copies it at a snapshot after them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

import numpy as np
import numpy.typing as npt
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
from psycopg import pq as libpq
from psycopg import sql

from pg2delta.apply.keys import key_resolver
from pg2delta.apply.lakeside import Lakeside
from pg2delta.config import Config
from pg2delta.decode import pgoutput as po
from pg2delta.decode.changes import LSN_COL, META_FIELDS, POS_COL, RelationVersion, WindowDecoder
from pg2delta.decode.typemap import KIND_BINARY, KIND_TEXT
from pg2delta.errors import (
    ConfigError,
    ConnectionFailed,
    DecodeError,
    ErrorKind,
    Pg2DeltaError,
    SchemaError,
    SourceStateError,
)
from pg2delta.faults import fault_point
from pg2delta.lake.applied_log import KIND_BOOTSTRAP, LoggedTable, log_row, log_rows
from pg2delta.lake.applied_log import append as append_log
from pg2delta.lake.engine import Lake
from pg2delta.lake.engine_writes import copy_file_options
from pg2delta.lsn import format_lsn
from pg2delta.progress import Progress, percent
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.rewrites import filenodes_json, filenodes_of, filenodes_sql
from pg2delta.source.slot import CopyWalk, SlotSource, connect, copy_blocks

log = logging.getLogger(__name__)

STAGING = "_pg2delta/staging/bootstrap"
DEFAULT_PARALLEL = 2

_CHUNK_ROWS = 65_536  # rows decoded at once per worker
_CHUNK_BYTES = 8 << 20  # COPY bytes gathered before their rows are walked and decoded
_FILE_ROWS = 1_048_576  # rows per staged Parquet file

I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]


# --- what the lake already holds ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LakeBootstrap:
    """What the applied log says about the bootstrap of one slot's lake."""

    start_lsn: int | None  # the slot's consistent point when the bootstrap created it; None: never bootstrapped
    copied: dict[int, int]  # relation OID -> LSN its copy is as of (only copies of this bootstrap)


def lake_state(rows: Sequence[dict[str, Any]], slot: str) -> LakeBootstrap:
    """Read the bootstrap rows of ``slot`` from the applied log's rows."""
    mine = [r for r in rows if r.get("slot") == slot and r.get("kind") == KIND_BOOTSTRAP]
    starts = [int(r["window_end"]) for r in mine if r.get("relation_oid") is None]
    if not starts:
        return LakeBootstrap(None, {})
    start = max(starts)  # a slot dropped and bootstrapped again starts later: older copies do not count
    copied: dict[int, int] = {}
    for r in mine:
        if r.get("relation_oid") is None or int(r["window_end"]) < start:
            continue
        oid = int(r["relation_oid"])
        copied[oid] = max(copied.get(oid, 0), int(r["window_end"]))
    return LakeBootstrap(start, copied)


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


# --- snapshots ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    slot: str
    consistent_lsn: int
    name: str  # for SET TRANSACTION SNAPSHOT


class ExportedSnapshot:
    """A replication connection that created a slot and exported its snapshot; keep it idle while copying."""

    def __init__(self, dsn: str, slot: str, *, temporary: bool, connect_timeout: int = 10) -> None:
        try:
            self.conn = psycopg.connect(
                dsn, autocommit=True, replication="database", application_name="pg2delta bootstrap",
                connect_timeout=connect_timeout,
            )
        except psycopg.OperationalError as exc:
            text = " ".join(str(exc).split())
            if "replication" in text or "password" in text or "does not exist" in text:
                raise ConnectionFailed(
                    f"cannot open a replication connection (the role needs REPLICATION and pg_hba.conf a "
                    f"replication entry for this database): {text}",
                    retryable=False,
                ) from exc
            raise ConnectionFailed(f"cannot open a replication connection: {text}") from exc
        command = sql.SQL("CREATE_REPLICATION_SLOT {} {} LOGICAL pgoutput (SNAPSHOT 'export')").format(
            sql.Identifier(slot), sql.SQL("TEMPORARY") if temporary else sql.SQL("")
        )
        try:
            res = self.conn.pgconn.exec_(command.as_bytes(self.conn))
        except psycopg.OperationalError as exc:
            self.close()
            raise ConnectionFailed(f"lost the replication connection creating slot {slot!r}: {exc}") from exc
        if res.status != libpq.ExecStatus.TUPLES_OK:
            err = psycopg.errors.error_from_result(res, encoding=self.conn.info.encoding)
            self.close()
            text = " ".join((err.diag.message_primary or str(err)).split())
            if isinstance(err, psycopg.errors.DuplicateObject):
                raise SourceStateError(
                    f"replication slot {slot!r} was created by someone else meanwhile: {text}"
                ) from err
            raise SourceStateError(f"cannot create replication slot {slot!r}: {text}") from err
        values = [res.get_value(0, i) for i in range(res.nfields)]
        names = [bytes(res.fname(i) or b"").decode() for i in range(res.nfields)]
        row = {n: bytes(v).decode() if v is not None else None for n, v in zip(names, values, strict=True)}
        lsn, snap = row.get("consistent_point"), row.get("snapshot_name")
        if not lsn or not snap:
            self.close()
            raise SourceStateError(f"the server did not export a snapshot for slot {slot!r}")
        hi, lo = lsn.split("/")
        self.snapshot = Snapshot(slot, (int(hi, 16) << 32) | int(lo, 16), snap)
        log.info(
            "created %sslot %s at %s, exported snapshot %s",
            "temporary " if temporary else "", slot, lsn, snap,
        )

    def close(self) -> None:
        try:
            self.conn.close()
        except psycopg.Error:
            log.debug("could not close the replication connection")

    def __enter__(self) -> ExportedSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_snapshot(conn: psycopg.Connection[Any], snapshot: Snapshot) -> None:
    """Make ``conn`` (autocommit) read as of ``snapshot``, in a read-only REPEATABLE READ transaction."""
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot.name)))
        # Text forms of types without a decoder, as the change path has them.
        conn.execute("SET LOCAL TimeZone = 'UTC'")
    except (psycopg.errors.InvalidParameterValue, psycopg.errors.UndefinedObject) as exc:
        raise SourceStateError(
            f"the snapshot exported by slot {snapshot.slot!r} can no longer be imported "
            f"({' '.join(str(exc).split())}): its replication connection closed; run pg2delta bootstrap "
            "again, it copies the tables still missing at a new snapshot"
        ) from exc
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"lost a copy connection: {' '.join(str(exc).split())}") from exc


# --- COPY binary rows -> Arrow --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """How one table is copied: the COPY statement, the codecs, and the Arrow schema of the Delta table."""

    table: PublishedTable
    version: RelationVersion
    keyless: bool  # no key: rows carry _pg2delta_lsn = 0 and a row number, as the change path keys them
    schema: pa.Schema
    text_columns: tuple[bool, ...]

    @classmethod
    def make(cls, table: PublishedTable, version: RelationVersion) -> CopyPlan:
        keyless = not version.key_indexes
        fields = [version.schema.field(c.name) for c in table.relation.columns]
        if keyless:
            meta = {f.name: f for f in META_FIELDS}
            fields += [meta[LSN_COL], meta[POS_COL]]
        text = tuple(
            c.name in table.text_columns or codec.server_printed
            for c, codec in zip(table.relation.columns, version.codecs, strict=True)
        )
        return cls(table, version, keyless, pa.schema(fields), text)

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
        return sql.SQL("COPY ({}) TO STDOUT (FORMAT binary)").format(self.table.select(cols))

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
        n = kinds.shape[1]
        if self.keyless:
            arrays.append(pa.array(np.zeros(n, dtype=np.int64)))
            arrays.append(pa.array(np.arange(first_row, first_row + n, dtype=np.int64)))
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


# --- progress -------------------------------------------------------------------------------------


class _Progress:
    """Rows copied against ``pg_class.reltuples``, with rate and ETA: a bar on a terminal, a log
    line every few seconds otherwise (see progress.py); no row values."""

    def __init__(self, tables: Sequence[PublishedTable]) -> None:
        self.lock = threading.Lock()
        self.total_tables = len(tables)
        self.done_tables = 0
        self.current: dict[str, tuple[int, int | None]] = {}
        estimate = sum(t.estimated_rows or 0 for t in tables)
        self.bar = Progress("copy", total=estimate, unit="rows", logger=log, line=self._line)

    def _line(self, p: Progress) -> str:
        eta = p.eta()
        each = ", ".join(
            f"{name} {done}" + (f"/~{est} ({percent(done, est)})" if est else "")
            for name, (done, est) in sorted(self.current.items())
        )
        return (
            f"bootstrap: {self.done_tables}/{self.total_tables} tables done, {p.rows} of ~{p.total or 0} rows, "
            f"{p.rate():.0f} rows/s, eta {f'{eta:.0f} s' if eta is not None else 'unknown'}; copying {each}"
        )

    def update(self, table: PublishedTable, table_rows: int, new_rows: int) -> None:
        with self.lock:
            self.current[table.qualified] = (table_rows, table.estimated_rows)
            rows = self.bar.rows + new_rows
            self.bar.move_to(rows, rows=rows, note=f"{self.done_tables}/{self.total_tables} tables")

    def finished(self, table: PublishedTable) -> None:
        with self.lock:
            self.done_tables += 1
            self.current.pop(table.qualified, None)
            self.bar.move_to(self.bar.position, note=f"{self.done_tables}/{self.total_tables} tables")

    def close(self) -> None:
        self.bar.close()


# --- the copy --------------------------------------------------------------------------------------


@dataclass
class TableCopy:
    schema: str
    table: str
    relation_oid: int
    rows: int
    snapshot_lsn: int
    delta_version: int | None
    seconds: float
    path: str


@dataclass
class BootstrapReport:
    slot: str
    start_lsn: int  # the lake's start: the slot's consistent point when bootstrap created it
    created_slot: bool
    copied: list[TableCopy] = field(default_factory=list)
    already_copied: list[str] = field(default_factory=list)  # finished by an earlier, interrupted bootstrap


class Copier:
    """Copies tables into the lake at one exported snapshot, ``parallel`` tables at a time.

    With ``parallel`` > 1 every table is read, decoded and staged in a worker process of its
    own (reading the COPY is CPU-bound Python: threads would share one core through the
    GIL); the Delta commits stay in this process, each started as soon as its table is staged
    (up to ``parallel`` at once), and the applied log takes one table's row at a time.
    """

    def __init__(
        self, job: Lakeside, snapshot: Snapshot, run_id: str, *, parallel: int, workers: Workers | None = None,
        start_row: Callable[[], None] | None = None,
    ) -> None:
        self.job = job
        self.snapshot = snapshot
        self.run_id = run_id
        self.parallel = max(1, parallel)
        self.staging = f"{STAGING}/{job.config.source.slot}/{run_id}"
        self.workers = workers  # started early by the caller, else started here when needed
        # Logs the lake's start (a fresh bootstrap): once, while the workers read the tables and
        # before the first commit, so that the engine's work overlaps the copy.
        self._start_row = start_row
        self._logging = threading.Lock()

    def plans(self, catalog_conn: psycopg.Connection[Any], tables: Sequence[PublishedTable]) -> list[CopyPlan]:
        catalog = PgTypeCatalog(catalog_conn)
        decoder = WindowDecoder(catalog, key_resolver(self.job.config, catalog_conn))
        return [CopyPlan.make(t.usable(), decoder.relation_version(t.relation)) for t in tables]

    def _stage_rel(self, table: PublishedTable) -> str:
        return f"{self.staging}/{table.relation.namespace}.{table.relation.name}"

    def copy_all(self, plans: Sequence[CopyPlan]) -> list[TableCopy]:
        if not plans:
            self.log_start()
            return []
        progress = _Progress([p.table for p in plans])
        todo = sorted(plans, key=lambda p: -(p.table.estimated_rows or 0))  # the largest first
        try:
            if self.parallel == 1 or len(todo) == 1:
                self.log_start()
                return self._copy_here(todo, progress)
            if self.workers is not None:
                return self._copy_in_workers(todo, progress, self.workers)
            with Workers(min(self.parallel, len(todo))) as workers:
                return self._copy_in_workers(todo, progress, workers)
        finally:
            progress.close()

    def log_start(self) -> None:
        """Log the lake's start (``start_row``) unless done already."""
        if self._start_row is not None:
            self._start_row()
            self._start_row = None

    def _copy_here(self, todo: Sequence[CopyPlan], progress: _Progress) -> list[TableCopy]:
        cfg = self.job.config
        results: list[TableCopy] = []
        conn = connect(cfg.source.dsn, application_name="pg2delta bootstrap copy", connect_timeout=cfg.source.connect_timeout)
        try:
            open_snapshot(conn, self.snapshot)
            for plan in todo:
                t0 = time.monotonic()

                def report(rows: int, new: int, plan: CopyPlan = plan) -> None:
                    progress.update(plan.table, rows, new)
                    fault_point("bootstrap_mid_table")

                stage_dir = f"{self.job.lake.path}/{self._stage_rel(plan.table)}"
                rows, notes = stage_table(conn, plan, self.job.lake, stage_dir, report)
                results.append(self._commit(plan, rows, notes, t0, progress))
        finally:
            conn.close()
        return results

    def _copy_in_workers(self, todo: Sequence[CopyPlan], progress: _Progress, workers: Workers) -> list[TableCopy]:
        """Stage every table in a worker process; commit each as soon as it is staged, in a thread
        of this process (up to ``parallel`` commits at once: one table's Delta write need not wait
        for another's)."""
        by_oid = {p.table.oid: p for p in todo}
        staging: dict[Future[Any], tuple[CopyPlan, float]] = {}
        for plan in todo:
            task = _StageTask(
                self.job.config, self.snapshot, plan.table,
                f"{self.job.lake.path}/{self._stage_rel(plan.table)}",
            )
            staging[workers.pool.submit(_stage_in_worker, task)] = (plan, time.monotonic())
        commits: list[Future[Any]] = []
        pending: set[Future[Any]] = set(staging)
        with ThreadPoolExecutor(min(self.parallel, len(todo)), thread_name_prefix="pg2delta-commit") as committing:
            try:
                self.log_start()  # while the workers copy
                while pending:
                    done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                    while True:
                        try:
                            oid, rows, new = workers.queue.get_nowait()
                        except Empty:
                            break
                        progress.update(by_oid[oid].table, rows, new)
                        fault_point("bootstrap_mid_table")
                    for fut in done:
                        if fut not in staging:
                            fut.result()  # a commit: raises what it raised
                            continue
                        plan, t0 = staging[fut]
                        staged = fut.result()
                        if staged.error is not None:
                            kind, message, retryable = staged.error
                            raise Pg2DeltaError(message, kind=ErrorKind(kind), retryable=retryable)
                        commit = committing.submit(self._commit, plan, staged.rows, staged.notes, t0, progress)
                        commits.append(commit)
                        pending.add(commit)
            except BaseException:
                workers.abort.set()
                workers.pool.shutdown(wait=True, cancel_futures=True)
                raise
        return [c.result() for c in commits]

    def _commit(self, plan: CopyPlan, rows: int, notes: dict[str, int], t0: float, progress: _Progress) -> TableCopy:
        """Make the staged copy of a table visible in one Delta commit and record it in the applied log."""
        table = plan.table

        for name, count in sorted(notes.items()):
            log.warning("copy note: %s: %s = %d", table.qualified, name, count)
        rel = table.relation
        lake = self.job.lake
        stage_rel = self._stage_rel(table)
        uri = lake.table_uri(rel.namespace, rel.name)
        staged = lake.table_uri(stage_rel)
        # A new table takes the staged files as they are, where the engine allows (the history's
        # MERGE of the copy reads them afterwards: then the engine writes the table).
        history = self.job.history.enabled(rel.namespace, rel.name)
        if history or not self.job.engine.adopt_copy(uri, staged, plan.schema):
            self.job.engine.replace_table(uri, staged)
        with self._logging:  # the applied log (and the history) take one table's rows at a time
            return self._log_copy(plan, rows, t0, progress, uri, stage_rel)

    def _log_copy(
        self, plan: CopyPlan, rows: int, t0: float, progress: _Progress, uri: str, stage_rel: str
    ) -> TableCopy:
        table = plan.table
        rel = table.relation
        lake = self.job.lake
        version = lake.delta_version(uri)
        # The history (history = "scd2") ends its current versions and opens the copy's rows.
        self.job.history.copied(self.job.engine, rel.namespace, rel.name, lake.table_uri(stage_rel), self.snapshot.consistent_lsn)
        fault_point("copy_after_replace")  # the copy is the table's latest version, the log does not say so yet
        append_log_row(
            self.job, self.run_id, self.snapshot.consistent_lsn, table, rows, version, key=plan.version.key_names
        )
        fault_point("bootstrap_after_table")
        try:
            lake.fs.delete_dir(f"{lake.path}/{stage_rel}")
        except OSError:
            log.warning("could not remove staging folder %s", stage_rel)
        progress.finished(table)
        seconds = time.monotonic() - t0
        log.info(
            "copied %s: %d rows at %s in %.1f s (%.0f rows/s) -> delta version %s",
            table.qualified, rows, format_lsn(self.snapshot.consistent_lsn), seconds,
            rows / max(seconds, 1e-9), version,
        )
        return TableCopy(rel.namespace, rel.name, rel.oid, rows, self.snapshot.consistent_lsn, version, seconds, uri)


def stage_table(
    conn: psycopg.Connection[Any],
    plan: CopyPlan,
    lake: Lake,
    stage_dir: str,
    report: Callable[[int, int], None],
) -> tuple[int, dict[str, int]]:
    """COPY one table on ``conn`` (inside the snapshot) into Parquet files under ``stage_dir``.

    Memory holds two chunks of rows at a time (one being decoded, one being written).
    ``report(rows so far, new rows)`` is called after every chunk is written. Returns the rows copied and the decoder's notes (clamped values and the like).
    """
    lake.fs.create_dir(stage_dir, recursive=True)
    files = 0
    writer: pq.ParquetWriter | None = None
    file_rows = 0

    def write(batch: pa.RecordBatch) -> None:
        nonlocal writer, files, file_rows
        if writer is None or file_rows >= _FILE_ROWS:
            if writer is not None:
                writer.close()
            out = lake.fs.open_output_stream(f"{stage_dir}/part-{files:05d}.parquet")
            # Written as Delta data files: the embedded engine's lake takes them as they are (adopt_copy).
            writer = pq.ParquetWriter(out, plan.schema, **copy_file_options(plan.schema))
            files += 1
            file_rows = 0
        writer.write_batch(batch)
        file_rows += batch.num_rows

    walker = CopyRows(plan)
    # The Parquet writes (pyarrow, without the GIL) run in a thread while the next chunk is read
    # and decoded: at most one batch waits for its write, so memory holds two chunks at most. A
    # chunk is reported once it is written (the fault point in ``report`` finds it on disk).
    pending: list[tuple[Future[None], int, int]] = []

    def settle() -> None:
        while pending:
            written, so_far, new = pending.pop()
            written.result()
            report(so_far, new)

    def emit(batch: pa.RecordBatch) -> None:
        settle()
        pending.append((writes.submit(write, batch), walker.rows, batch.num_rows))

    writes = ThreadPoolExecutor(1, thread_name_prefix="pg2delta-stage")
    try:
        buf = bytearray()
        blocks = copy_blocks(conn, plan.statement())
        try:
            for data in blocks:  # CopyData blocks: a row each (the first after the file header)
                buf += data
                if len(buf) >= _CHUNK_BYTES:
                    buf = walker.feed(bytes(buf), emit)
        finally:
            blocks.close()  # stopped early: psycopg cancels the COPY and reads what is left of it
        walker.feed(bytes(buf), emit, last=True)
        settle()
        if writer is None:  # an empty table: one empty file gives the schema
            write(pa.RecordBatch.from_pylist([], schema=plan.schema))
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"lost the connection copying {plan.table.qualified}: {' '.join(str(exc).split())}") from exc
    except psycopg.Error as exc:
        raise SourceStateError(f"cannot copy {plan.table.qualified}: {' '.join(str(exc).split())}") from exc
    finally:
        writes.shutdown(wait=True)
        if writer is not None:
            writer.close()
    return walker.rows, dict(walker.notes)


# --- worker processes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StageTask:
    config: Config
    snapshot: Snapshot
    table: PublishedTable
    stage_dir: str


@dataclass(frozen=True, slots=True)
class _Staged:
    rows: int = 0
    notes: dict[str, int] = field(default_factory=dict)
    error: tuple[str, str, bool] | None = None  # kind, message, retryable of a Pg2DeltaError


_progress_queue: Any = None
_abort: Any = None


def _worker_context() -> Any:
    """Workers are forked from a forkserver that has imported this module once (a fresh process,
    never this one: it may run the engine's threads), so each worker starts without importing
    pyarrow, psycopg and the decoder again (0.4 s of CPU each)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class Workers:
    """The worker processes that stage tables (forked from the forkserver, see
    :func:`_worker_context`), started as soon as a bootstrap knows it will copy in parallel: they
    get ready while the slot is created, the catalog read and the engine started."""

    def __init__(self, n: int) -> None:
        ctx = _worker_context()
        self.queue: Any = ctx.Queue()
        self.abort: Any = ctx.Event()  # set when a table failed: the others stop at their next chunk
        level = logging.getLogger("pg2delta").getEffectiveLevel()
        self.pool = ProcessPoolExecutor(
            max_workers=n, mp_context=ctx, initializer=_init_worker, initargs=(self.queue, self.abort, level)
        )
        for _ in range(n):  # one process is spawned per task submitted while none is idle
            self.pool.submit(_ready)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ready() -> None:
    """A worker's first task: nothing, once its process has started and imported this module."""


def _init_worker(queue: Any, abort: Any, level: int) -> None:
    global _progress_queue, _abort
    _progress_queue, _abort = queue, abort
    # The bootstrap that started this worker may die (a kill, an OOM): the worker then ends too, busy
    # or idle, rather than copy for nobody and hold the job's output pipes open.
    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch(sentinel: int = parent.sentinel) -> None:
            multiprocessing.connection.wait([sentinel])
            os._exit(1)

        threading.Thread(target=watch, name="pg2delta parent watch", daemon=True).start()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _stage_in_worker(task: _StageTask) -> _Staged:
    """In a worker process: import the snapshot, COPY one table, stage it; the parent commits it."""
    cfg = task.config
    job = Lakeside(cfg)  # for its lake; no engine is started here
    try:
        conn = connect(cfg.source.dsn, application_name="pg2delta bootstrap copy", connect_timeout=cfg.source.connect_timeout)
        catalog_conn = connect(cfg.source.dsn, application_name="pg2delta catalog", connect_timeout=cfg.source.connect_timeout)
        try:
            open_snapshot(conn, task.snapshot)
            decoder = WindowDecoder(PgTypeCatalog(catalog_conn), key_resolver(cfg, catalog_conn))
            plan = CopyPlan.make(task.table, decoder.relation_version(task.table.relation))

            def report(rows: int, new: int) -> None:
                if _abort.is_set():
                    raise SourceStateError("stopped: another table of this bootstrap failed")
                _progress_queue.put((task.table.oid, rows, new))

            rows, notes = stage_table(conn, plan, job.lake, task.stage_dir, report)
            return _Staged(rows, notes)
        finally:
            conn.close()
            catalog_conn.close()
    except Pg2DeltaError as exc:
        return _Staged(error=(exc.kind.value, str(exc), exc.retryable))


def append_log_row(
    job: Lakeside,
    run_id: str,
    lsn: int,
    table: PublishedTable | None,
    rows: int,
    version: int | None,
    *,
    key: Sequence[str] | None = None,
) -> None:
    """A ``kind = 'bootstrap'`` row: a table copied as of ``lsn`` (keyed on ``key``), or (no table) the lake's start."""
    logged = None if table is None else LoggedTable(
        table.oid, table.relation.namespace, table.relation.name, version, rows, 0, 0, False, None,
        None if key is None else tuple(key), table.membership, table.leaves, table.attnums, table.filenodes,
    )
    append_log(job.engine, job.lake, [log_row(job.config.source.slot, run_id, lsn, lsn, logged, kind=KIND_BOOTSTRAP)])


@contextlib.contextmanager
def _slot_staging(job: Lakeside) -> Iterator[None]:
    """This slot's staging folder for a copy: emptied first of what an interrupted copy staged
    (never visible in any Delta table), and removed when the copy ends."""
    path = f"{job.lake.path}/{STAGING}/{job.config.source.slot}"

    def remove() -> bool:
        try:
            job.lake.fs.delete_dir(path)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)
            return False

    if remove():
        log.info("removed staging files of an interrupted copy")
    try:
        yield
    finally:
        remove()


def _read_state(job: Lakeside) -> LakeBootstrap:
    return lake_state(log_rows(job.lake), job.config.source.slot)


def copy_at_new_snapshot(job: Lakeside, src: SlotSource, missing: set[int], *, parallel: int) -> list[TableCopy]:
    """Copy the tables ``missing`` (OIDs) at the snapshot of a temporary slot created now."""
    cfg = job.config
    info = src.slot_info()
    tmp = f"pg2delta_tmp_{uuid.uuid4().hex[:16]}"
    run_id = uuid.uuid4().hex
    with _slot_staging(job), ExportedSnapshot(
        cfg.source.dsn, tmp, temporary=True, connect_timeout=cfg.source.connect_timeout
    ) as exported:
        snap = exported.snapshot
        if info is not None and info.confirmed_flush_lsn is not None and snap.consistent_lsn < info.confirmed_flush_lsn:
            raise SourceStateError(
                f"the new snapshot ({format_lsn(snap.consistent_lsn)}) is before slot {cfg.source.slot!r} "
                f"({format_lsn(info.confirmed_flush_lsn)}); nothing was copied"
            )
        copier = Copier(job, snap, run_id, parallel=parallel)
        catalog_conn = connect(cfg.source.dsn, application_name="pg2delta catalog", connect_timeout=cfg.source.connect_timeout)
        try:
            # The publication as of the snapshot: the tables the slot publishes from its consistent point.
            open_snapshot(catalog_conn, snap)
            tables = [t for t in copied_tables(catalog_conn, cfg) if t.oid in missing]
            plans = copier.plans(catalog_conn, tables)
            catalog_conn.execute("COMMIT")
            return copier.copy_all(plans)
        finally:
            catalog_conn.close()


def copy_new_tables(job: Lakeside, src: SlotSource, *, parallel: int = DEFAULT_PARALLEL) -> bool:
    """Before a run's windows: copy the published tables a bootstrapped lake has no copy of.

    Returns whether the lake was bootstrapped for this slot (then the run skips the changes of
    tables without a copy). A lake never bootstrapped is left alone: its tables are created from
    the first changes the slot sends, as before.
    """
    bootstrapped, missing, names = tables_to_copy(job, src)
    if missing:
        log.info("the publication has %d table(s) the lake has no copy of: %s; copying them first", len(names), ", ".join(names))
        copy_at_new_snapshot(job, src, missing, parallel=parallel)
    return bootstrapped


def tables_to_copy(job: Lakeside, src: SlotSource) -> tuple[bool, set[int], list[str]]:
    """Whether the lake was bootstrapped for this slot, and the published tables it has no copy of
    (OIDs, and their names sorted): what :func:`copy_new_tables` copies, without copying."""
    state = _read_state(job)
    if state.start_lsn is None:
        return False, set(), []
    published = copied_tables(src.conn, job.config)
    missing = {t.oid for t in published if t.oid not in state.copied}
    return True, missing, sorted(t.qualified for t in published if t.oid in missing)


def bootstrap(job: Lakeside, *, parallel: int = DEFAULT_PARALLEL, resume: bool = False) -> BootstrapReport:
    """``pg2delta bootstrap``: create the slot and copy every published table as of its consistent point.

    On a slot that exists, resume: copy the tables the lake has no copy of (an interrupted
    bootstrap) at a new snapshot. A slot the lake knows nothing of needs ``resume=True``.
    """
    cfg = job.config
    if parallel < 1:
        raise ConfigError("--parallel must be at least 1")
    with SlotSource(cfg.source.dsn, cfg.source.slot, cfg.source.publication, connect_timeout=cfg.source.connect_timeout) as src:
        src.lock()
        job.lake.own_staging(cfg.source.slot)
        info = src.slot_info()
        if info is not None:
            src.check()  # the slot is usable (plugin, database, not invalidated, not in use)
        elif not src._query("SELECT 1 FROM pg_publication WHERE pubname = %s", (cfg.source.publication,)):
            (dbname,) = src._query("SELECT current_database()")[0]
            raise SourceStateError(f"publication {cfg.source.publication!r} does not exist in database {dbname!r}")
        if src.server_version < 150000:
            raise SourceStateError("pg2delta bootstrap needs PostgreSQL 15 or newer (publication column lists and row filters)")
        job.lake.check_writable()
        state = _read_state(job)
        if info is not None:
            assert info.confirmed_flush_lsn is not None
            if state.start_lsn is None and not resume:
                raise SourceStateError(
                    f"replication slot {cfg.source.slot!r} already exists and the lake at {cfg.lake_root} holds no "
                    "bootstrap of it: pass --resume to copy every published table at a new snapshot and keep the "
                    f"slot's later changes, or drop the slot (SELECT pg_drop_replication_slot('{cfg.source.slot}')) "
                    "and bootstrap again"
                )
            start = state.start_lsn
            if start is None:
                start = info.confirmed_flush_lsn
                append_log_row(job, uuid.uuid4().hex, start, None, 0, None)
                state = LakeBootstrap(start, {})
            published = copied_tables(src.conn, cfg)
            report = BootstrapReport(cfg.source.slot, start, created_slot=False)
            report.already_copied = sorted(t.qualified for t in published if t.oid in state.copied)
            missing = {t.oid for t in published if t.oid not in state.copied}
            log.info(
                "resuming the bootstrap of slot %s: %d table(s) copied already, %d to copy",
                cfg.source.slot, len(report.already_copied), len(missing),
            )
            if missing:
                report.copied = copy_at_new_snapshot(job, src, missing, parallel=parallel)
            return report

        run_id = uuid.uuid4().hex
        # What the copy needs gets ready while the slot is created and the catalog read: the
        # engine starts in a thread, the worker processes start (the snapshot's table list,
        # read below, is what is copied; this one only says how many workers are worth starting).
        job.start_engine_early()
        n_workers = min(parallel, len(copied_tables(src.conn, cfg)))
        with contextlib.ExitStack() as stack:
            stack.enter_context(_slot_staging(job))  # left last, once the workers have stopped
            workers = stack.enter_context(Workers(n_workers)) if n_workers > 1 else None
            exported = stack.enter_context(ExportedSnapshot(
                cfg.source.dsn, cfg.source.slot, temporary=False, connect_timeout=cfg.source.connect_timeout
            ))
            snap = exported.snapshot
            report = BootstrapReport(cfg.source.slot, snap.consistent_lsn, created_slot=True)
            # The lake's start is logged before the first table's commit, while the tables are read.
            copier = Copier(
                job, snap, run_id, parallel=parallel, workers=workers,
                start_row=lambda: append_log_row(job, run_id, snap.consistent_lsn, None, 0, None),
            )
            try:
                catalog_conn = connect(
                    cfg.source.dsn, application_name="pg2delta catalog", connect_timeout=cfg.source.connect_timeout
                )
                try:
                    open_snapshot(catalog_conn, snap)
                    tables = copied_tables(catalog_conn, cfg)
                    plans = copier.plans(catalog_conn, tables)
                    catalog_conn.execute("COMMIT")
                    log.info(
                        "copying %d table(s) as of %s with %d worker(s)",
                        len(plans), format_lsn(snap.consistent_lsn), min(parallel, max(len(plans), 1)),
                    )
                    report.copied = copier.copy_all(plans)
                finally:
                    catalog_conn.close()
            except Exception:
                # The slot exists now: whatever failed before the first commit (the catalog, a
                # table's key), the lake's start is still logged, so the next bootstrap resumes
                # this one instead of asking for --resume.
                try:
                    copier.log_start()
                except Exception as exc:
                    log.warning("could not log the lake's start: %s", exc)
                raise
        return report


def run_bootstrap(config: Any, *, parallel: int = DEFAULT_PARALLEL, resume: bool = False) -> BootstrapReport:
    """The function the CLI and jobs/ call: a job's engine, one bootstrap, engine stopped."""
    job = Lakeside(config)
    try:
        return bootstrap(job, parallel=parallel, resume=resume)
    finally:
        job.close()


__all__ = [
    "BootstrapReport",
    "Copier",
    "CopyPlan",
    "ExportedSnapshot",
    "LakeBootstrap",
    "PublishedTable",
    "TableCopy",
    "bootstrap",
    "copied_tables",
    "copy_new_tables",
    "lake_state",
    "published_tables",
    "run_bootstrap",
    ]
