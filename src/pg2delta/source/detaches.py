"""Where in the slot's backlog a partition left its root: the commit of its ``DETACH PARTITION``.

With its leaves published one by one (``publish_via_partition_root = false``), a partition
detached from its root and still published on its own (``FOR ALL TABLES``, its schema, or named
itself) keeps sending its changes under its own OID, before the detach and after it alike;
pgoutput says nothing of the detach. Before it the rows were the root's, after it they are the
table's own. The ``DETACH`` wrote the partition's ``pg_class`` row (``relispartition``) and every
column's ``pg_attribute`` row (each column's inheritance count goes down), so where the
transaction that last wrote the ``pg_class`` row wrote every column's too, it may be the
``DETACH``; the backlog decoded with ``test_decoding`` (``skip-empty-xacts`` off: a transaction
of DDL alone is listed too) gives its commit position (:func:`detach_positions`).

A later ``ALTER TABLE`` can write the same rows (``ALTER COLUMN … TYPE`` of every column, or a
``SET STATISTICS`` of each with a ``SET (fillfactor …)``: measured on PostgreSQL 15 and 18), so
that transaction is taken for the ``DETACH`` only where its WAL records, read with
``pg_walinspect`` (PostgreSQL 15+, an extension installed in the database), show it deleted a
``pg_inherits`` row, as a ``DETACH`` does and an ``ALTER TABLE`` of a table that is no partition
does not. ``DETACH PARTITION … CONCURRENTLY`` is two transactions: the first marks the partition
detach-pending (its ``pg_inherits`` row updated), the second writes those rows and deletes it,
so the second is found: the partition's changes committed between the two (by transactions
that still saw it attached, or written to it directly) are the root's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from pg2delta.lsn import format_lsn, parse_lsn
from pg2delta.source.rewrites import decode_backlog
from pg2delta.source.slot import connect

log = logging.getLogger(__name__)

# Per table: the transaction that last wrote its pg_class row, whether that transaction ended
# before the slot's catalog_xmin (so before the slot's position: not in its backlog), and whether
# it wrote the rows of all the table's columns too, as a DETACH does and a later GRANT, ALTER
# TABLE … ADD COLUMN, or ALTER COLUMN … TYPE of some of its columns does not.
_XMIN_QUERY = """
SELECT c.oid::int8, c.xmin::text, age(c.xmin) > age(s.catalog_xmin),
       EXISTS (SELECT FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)
       AND NOT EXISTS (SELECT FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                       AND a.xmin <> c.xmin)
FROM pg_class c, pg_replication_slots s
WHERE c.oid = ANY(%s::oid[]) AND s.slot_name = %s
"""

# The start and the end of the commit of each transaction named (test_decoding's BEGIN and COMMIT
# lines), and how many rows it changed, its tables rewritten included (a change in the DETACH's own
# transaction may be on either side of it; a rewrite is an ALTER TABLE's).
_COMMITS_QUERY = """
SELECT xid::text, min(lsn) FILTER (WHERE data LIKE 'BEGIN %%')::text, max(lsn) FILTER (WHERE data LIKE 'COMMIT %%')::text,
       count(*) FILTER (WHERE data LIKE 'table %%')
FROM pg_logical_slot_peek_changes(%s, NULL, NULL, 'include-xids', '1', 'skip-empty-xacts', '0', 'include-rewrites', '1')
WHERE xid::text = ANY(%s::text[])
GROUP BY xid
"""

# The schema pg_walinspect is installed in, if it is.
_WALINSPECT_QUERY = "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'pg_walinspect'"

# Whether the transaction deleted a pg_inherits row between its first WAL record and its commit
# (a Heap DELETE whose block is of pg_inherits' file in this database).
_DELETED_INHERITS_QUERY = """
SELECT count(*) FROM {schema}.pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)
WHERE xid::text = %s AND resource_manager = 'Heap' AND record_type = 'DELETE'
  AND block_ref LIKE '%%/' || (SELECT oid FROM pg_database WHERE datname = current_database())
                   || '/' || pg_relation_filenode('pg_catalog.pg_inherits') || ' fork main %%'
"""


@dataclass(frozen=True, slots=True)
class Detach:
    """Where a partition left its root: changes committed before ``lsn`` are the root's, the
    others the table's own (0: before the slot's position). ``lsn`` None: cannot tell, ``why``."""

    lsn: int | None
    why: str = ""


def detach_positions(dsn: str, slot: str, tables: Iterable[int], *, connect_timeout: int = 10) -> dict[int, Detach]:
    """Per table of ``tables`` (OIDs of former partitions, not partitions now), where its
    ``DETACH`` committed in the backlog of ``slot`` (see :class:`Detach`). The backlog is decoded
    once, from a temporary copy of the slot with ``test_decoding``; raises
    :class:`~pg2delta.source.rewrites.DecodeUnavailable` where it cannot be."""
    with connect(dsn, application_name="pg2delta detaches", connect_timeout=connect_timeout) as conn:
        rows = conn.execute(_XMIN_QUERY, (sorted(tables), slot)).fetchall()
        out: dict[int, Detach] = {}
        wanted: dict[str, list[tuple[int, bool]]] = {}
        for oid, xmin, older, witness in rows:
            if older:
                out[int(str(oid))] = Detach(0)
            else:
                wanted.setdefault(str(xmin), []).append((int(str(oid)), bool(witness)))
        commits = _commits(conn, slot, sorted(wanted)) if wanted else {}
        proof = _Proof(conn)
        for xid, found in wanted.items():
            for oid, witness in found:
                out[oid] = _position(xid, commits.get(xid), witness, proof)
    log.info("decoded the backlog of slot %s for the DETACH of %d table(s): %s", slot, len(out),
             ", ".join(f"{oid} at {format_lsn(d.lsn)}" if d.lsn is not None else f"{oid} unknown" for oid, d in sorted(out.items())))
    return out


def _commits(conn: Any, slot: str, xids: list[str]) -> dict[str, tuple[int, int, int]]:
    return {str(x): (parse_lsn(str(begin)), parse_lsn(str(end)), int(n))
            for x, begin, end, n in decode_backlog(conn, slot, _COMMITS_QUERY, (xids,)) if begin is not None and end is not None}


class _Proof:
    """Whether a transaction deleted a ``pg_inherits`` row, from its WAL records (pg_walinspect)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.schema: str | None = None
        self.unusable = ""

    def detached(self, xid: str, begin: int, end: int) -> bool | None:
        """True or False; None where pg_walinspect cannot tell (:attr:`unusable` says why)."""
        if self.schema is None and not self.unusable:
            row = self.conn.execute(_WALINSPECT_QUERY).fetchone()
            if row is None:
                self.unusable = "pg_walinspect, which tells a DETACH from a later ALTER TABLE, is not installed in the database (CREATE EXTENSION pg_walinspect)"
            else:
                self.schema = str(row[0])
        if self.schema is None:
            return None
        query = sql.SQL(_DELETED_INHERITS_QUERY).format(schema=sql.Identifier(self.schema))
        try:
            row = self.conn.execute(query, (format_lsn(begin), format_lsn(end), xid)).fetchone()
        except psycopg.Error as exc:  # not allowed (superuser or pg_read_server_files), WAL gone
            self.unusable = f"pg_walinspect cannot read the WAL of the transaction: {' '.join(str(exc).split())}"
            return None
        return bool(row and row[0])


def _position(xid: str, commit: tuple[int, int, int] | None, witness: bool, proof: _Proof) -> Detach:
    if not witness:
        return Detach(None, f"its catalog row was written again since the DETACH (xid {xid}, not all its columns' too)")
    if commit is None:
        return Detach(None, f"the transaction that detached it (xid {xid}) is not in the slot's backlog")
    begin, end, changes = commit
    if changes:
        return Detach(None, f"the transaction that last wrote its catalog rows (xid {xid}) changed or rewrote rows too")
    detached = proof.detached(xid, begin, end)
    if detached is None:
        return Detach(None, f"{proof.unusable}; the transaction that last wrote its catalog rows is xid {xid}")
    if not detached:
        return Detach(None, f"the transaction that last wrote its catalog rows (xid {xid}) detached no partition: "
                            "an ALTER TABLE of it since its DETACH")
    return Detach(end)


__all__ = ["Detach", "detach_positions"]
