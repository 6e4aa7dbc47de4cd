"""What the source database knows about its types: :class:`PgTypeCatalog`.

The value decoder (:mod:`pg2delta.typemap`) resolves built-in types from the generated
table in :mod:`pg2delta._oids`; user-defined types (domains, enums, composites, ranges,
extension types and their arrays) need the catalog of the source database. Lookups are
cached for the life of the catalog object: a job run creates one per source connection.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import psycopg

from pg2delta.typemap import TypeInfo

_TYPE_QUERY = """
SELECT t.oid::int8, n.nspname::text, t.typname::text, t.typtype::text,
       t.typbasetype::int8, t.typtypmod::int4,
       CASE WHEN t.typsubscript = 'array_subscript_handler'::regproc THEN t.typelem ELSE 0 END::int8,
       coalesce(r.rngsubtype, mr.rngsubtype, 0)::int8,
       t.typsend::text
FROM pg_type t
JOIN pg_namespace n ON n.oid = t.typnamespace
LEFT JOIN pg_range r ON r.rngtypid = t.oid
LEFT JOIN pg_range mr ON mr.rngmultitypid = t.oid
WHERE t.oid = ANY(%s)
"""

_ATTNDIMS_QUERY = """
SELECT attname::text, attndims::int4 FROM pg_attribute
WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
"""


class PgTypeCatalog:
    """:class:`~pg2delta.typemap.TypeCatalog` backed by ``pg_type`` and ``pg_range`` (cached).

    The connection is used as is: run it in autocommit mode or let the caller manage
    the transaction the lookups run in.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._cache: dict[int, TypeInfo | None] = {}

    def type_info(self, oid: int) -> TypeInfo | None:
        if oid not in self._cache:
            self.preload([oid])
        return self._cache.get(oid)

    def preload(self, oids: Iterable[int]) -> None:
        """Look up many types in one query (and the types they refer to, transitively)."""
        todo = {o for o in oids if o not in self._cache}
        while todo:
            rows = self._conn.execute(_TYPE_QUERY, (sorted(todo),)).fetchall()
            found: dict[int, TypeInfo] = {}
            for oid, nsp, name, typtype, base, base_typmod, elem, subtype, send in rows:
                found[int(oid)] = TypeInfo(
                    oid=int(oid),
                    namespace=str(nsp),
                    name=str(name),
                    typtype=str(typtype),
                    base_oid=int(base),
                    elem_oid=int(elem),
                    subtype_oid=int(subtype),
                    base_typmod=int(base_typmod),
                    send_proc=str(send),
                )
            for oid in todo:
                self._cache[oid] = found.get(oid)
            refs = {
                r for info in found.values() for r in (info.base_oid, info.elem_oid, info.subtype_oid) if r
            }
            todo = {r for r in refs if r not in self._cache}

    def attndims(self, relation_oid: int) -> dict[str, int]:
        """Declared array dimensions per column (``pg_attribute.attndims``; 0 for non-arrays).

        PostgreSQL does not enforce them; pass ``max(attndims, 1)`` as ``ndims`` to
        :func:`pg2delta.typemap.codec_for` for array columns.
        """
        rows = self._conn.execute(_ATTNDIMS_QUERY, (relation_oid,)).fetchall()
        return {str(name): int(nd) for name, nd in rows}
