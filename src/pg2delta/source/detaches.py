"""Where in the slot's backlog a partition left its root: the commit of its ``DETACH PARTITION``.

With its leaves published one by one (``publish_via_partition_root = false``), a partition
detached from its root and still published on its own (``FOR ALL TABLES``, its schema, or named
itself) keeps sending its changes under its own OID, before the detach and after it alike;
pgoutput says nothing of the detach. Before it the rows were the root's, after it they are the
table's own. The ``DETACH`` wrote the partition's ``pg_class`` row (``relispartition``), so
that row's ``xmin`` names its transaction, and the backlog decoded with ``test_decoding``
(``skip-empty-xacts`` off: a transaction of DDL alone is listed too) gives that transaction's
commit position (:func:`detach_positions`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pg2delta.lsn import format_lsn, parse_lsn
from pg2delta.source.rewrites import decode_backlog
from pg2delta.source.slot import connect

log = logging.getLogger(__name__)

# Per table: the transaction that last wrote its pg_class row, whether that transaction ended
# before the slot's catalog_xmin (so before the slot's position: not in its backlog), and whether
# it wrote the row of the table's first column too, as a DETACH does (each column's inheritance
# count goes down) and a later GRANT, ALTER TABLE … ADD COLUMN or other change of the table's
# own row does not.
_XMIN_QUERY = """
SELECT c.oid::int8, c.xmin::text, age(c.xmin) > age(s.catalog_xmin),
       coalesce((SELECT a.xmin = c.xmin FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                 ORDER BY a.attnum LIMIT 1), false)
FROM pg_class c, pg_replication_slots s
WHERE c.oid = ANY(%s::oid[]) AND s.slot_name = %s
"""

# The end of the commit of each transaction named (test_decoding's COMMIT line: its end), and how
# many changes of published tables it made (a change in the DETACH's own transaction may be on
# either side of it).
_COMMITS_QUERY = """
SELECT xid::text, max(lsn) FILTER (WHERE data LIKE 'COMMIT %%')::text, count(*) FILTER (WHERE data LIKE 'table %%')
FROM pg_logical_slot_peek_changes(%s, NULL, NULL, 'include-xids', '1', 'skip-empty-xacts', '0')
WHERE xid::text = ANY(%s::text[])
GROUP BY xid
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
        for xid, found in wanted.items():
            for oid, witness in found:
                out[oid] = _position(xid, commits.get(xid), witness)
    log.info("decoded the backlog of slot %s for the DETACH of %d table(s): %s", slot, len(out),
             ", ".join(f"{oid} at {format_lsn(d.lsn)}" if d.lsn is not None else f"{oid} unknown" for oid, d in sorted(out.items())))
    return out


def _commits(conn: Any, slot: str, xids: list[str]) -> dict[str, tuple[int, int]]:
    return {str(x): (parse_lsn(str(end)), int(n)) for x, end, n in decode_backlog(conn, slot, _COMMITS_QUERY, (xids,))
            if end is not None}


def _position(xid: str, commit: tuple[int, int] | None, witness: bool) -> Detach:
    if not witness:
        return Detach(None, f"its catalog row was written again since the DETACH (xid {xid}, not its columns' too)")
    if commit is None:
        return Detach(None, f"the transaction that detached it (xid {xid}) is not in the slot's backlog")
    end, changes = commit
    if changes:
        return Detach(None, f"the transaction that detached it (xid {xid}) changed rows too")
    return Detach(end)


__all__ = ["Detach", "detach_positions"]
