"""What the source database knows about its types: :class:`PgTypeCatalog`.

The value decoder (:mod:`pg2delta.decode.typemap`) resolves built-in types from the generated
table in :mod:`pg2delta.decode._oids`; user-defined types (domains, enums, composites, ranges,
extension types and their arrays) need the catalog of the source database. Lookups are
cached for the life of the catalog object: a job run creates one per source connection.

The catalog also prints binary values of types pg2delta has no decoder for
(:meth:`PgTypeCatalog.render_binary`): the server reads them with the type's own receive
function and prints them with its output function.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq

from pg2delta.decode.typemap import TypeInfo
from pg2delta.errors import ConnectionFailed

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

# What each relation holding the rows of ``oid`` (the relation itself, or the leaf partitions of a
# partitioned table: only they have storage and missing values) says about columns ``names``.
_ADDED_COLUMNS_QUERY = """
WITH rels AS (
    SELECT coalesce(
        (SELECT array_agg(relid) FROM pg_partition_tree(%(oid)s::oid::regclass) WHERE isleaf AND relid <> %(oid)s::oid),
        ARRAY[%(oid)s::oid]
    ) AS oids
)
SELECT a.attrelid::int8, a.attname::text, a.atthasmissing, a.attmissingval::text, t.typdelim::text,
       a.atthasdef OR a.attgenerated <> '' OR a.attidentity <> '' OR t.typdefaultbin IS NOT NULL
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid, rels
WHERE a.attrelid = ANY(rels.oids) AND a.attname = ANY(%(names)s) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attrelid
"""

_ATTNUMS_QUERY = """
SELECT attname::text, attnum::int4 FROM pg_attribute
WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
"""

_DROPPED_ATTNUMS_QUERY = """
SELECT attnum::int4 FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND attisdropped
"""

_ATTNDIMS_QUERY = """
SELECT attname::text, attndims::int4 FROM pg_attribute
WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped
"""


# Parameters per statement when printing binary values (the protocol allows 65535).
_RENDER_BATCH = 1000
# The session settings text forms assume (see pg2delta.decode.typemap); set once before printing.
_RENDER_SETTINGS = (
    "SELECT set_config('DateStyle', 'ISO', false), set_config('IntervalStyle', 'postgres', false), "
    "set_config('TimeZone', 'UTC', false), set_config('extra_float_digits', '3', false), "
    "set_config('bytea_output', 'hex', false)"
)


@dataclass(frozen=True, slots=True)
class AddedColumn:
    """What ``pg_attribute`` says, now, about the value a column has in rows written before it was added.

    ``missing``: ``attmissingval`` as text (a one-element array such as ``{7}``) when
    ``atthasmissing``: the value PostgreSQL reads for those rows, fixed when the column was added
    with a non-volatile default. ``has_default``: the column has some default that PostgreSQL may
    have computed for those rows instead (``pg_attrdef``: a default or a generation expression; an
    identity; a default of its type, e.g. a domain's). ``delim``: the type's array delimiter.
    """

    relation_oid: int
    name: str
    missing: str | None
    has_default: bool
    delim: str = ","


class PgTypeCatalog:
    """:class:`~pg2delta.decode.typemap.TypeCatalog` backed by ``pg_type`` and ``pg_range`` (cached).

    The connection is used as is: run it in autocommit mode or let the caller manage
    the transaction the lookups run in.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._cache: dict[int, TypeInfo | None] = {}
        self._render_ready = False

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The catalog connection (the key and column rules read the catalog over it too)."""
        return self._conn

    def _query(self, query: str, params: tuple[object, ...] | dict[str, object]) -> list[Any]:
        try:
            return self._conn.execute(query, params).fetchall()
        except psycopg.OperationalError as exc:
            raise ConnectionFailed(f"lost the catalog connection to PostgreSQL: {' '.join(str(exc).split())}") from exc

    def type_info(self, oid: int) -> TypeInfo | None:
        if oid not in self._cache:
            self.preload([oid])
        return self._cache.get(oid)

    def preload(self, oids: Iterable[int]) -> None:
        """Look up many types in one query (and the types they refer to, transitively)."""
        todo = {o for o in oids if o not in self._cache}
        while todo:
            rows = self._query(_TYPE_QUERY, (sorted(todo),))
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
        :func:`pg2delta.decode.typemap.codec_for` for array columns.
        """
        rows = self._query(_ATTNDIMS_QUERY, (relation_oid,))
        return {str(name): int(nd) for name, nd in rows}

    def attnums(self, relation_oid: int) -> dict[str, int]:
        """The relation's columns now, by name, with their ``pg_attribute.attnum``: a column keeps its
        number through renames and type changes, ``ADD COLUMN`` takes a number above every other
        (dropped columns included), and a number is never reused."""
        return {str(name): int(num) for name, num in self._query(_ATTNUMS_QUERY, (relation_oid,))}

    def dropped_attnums(self, relation_oid: int) -> set[int]:
        """The ``attnum`` of each column dropped from the relation (PostgreSQL keeps them, nameless)."""
        return {int(num) for (num,) in self._query(_DROPPED_ATTNUMS_QUERY, (relation_oid,))}

    def added_columns(self, relation_oid: int, names: Sequence[str]) -> dict[str, list[AddedColumn]]:
        """Per column name, what :class:`AddedColumn` the catalog has now for the relation, or for each
        leaf partition of a partitioned table (where ``atthasmissing`` is kept). A name no longer
        in the table (dropped or renamed since) is absent.

        ``attmissingval`` is printed under the settings text forms assume (as :meth:`render_binary`).
        """
        self._render_settings()
        rows = self._query(_ADDED_COLUMNS_QUERY, {"oid": relation_oid, "names": list(names)})
        out: dict[str, list[AddedColumn]] = {}
        for oid, name, hasmissing, missing, delim, has_default in rows:
            out.setdefault(str(name), []).append(
                AddedColumn(
                    relation_oid=int(oid),
                    name=str(name),
                    missing=str(missing) if hasmissing and missing is not None else None,
                    has_default=bool(has_default),
                    delim=str(delim or ","),
                )
            )
        return out

    def _render_settings(self) -> None:
        if not self._render_ready:
            self._query(_RENDER_SETTINGS, ())
            self._render_ready = True

    def render_binary(self, type_oid: int, values: Sequence[bytes]) -> list[str]:
        """The text output of binary values of type ``type_oid``, as the server prints them.

        Each value goes to the server as a binary parameter of that type (read by the type's
        receive function, typmod -1) and comes back in text format (its output function),
        under the settings pg2delta's text forms assume (this changes the session's
        ``DateStyle``, ``IntervalStyle``, ``TimeZone``, ``extra_float_digits`` and
        ``bytea_output``). Bytes the receive function rejects raise ValueError; a lost
        connection raises :class:`~pg2delta.errors.ConnectionFailed`.
        """
        self._render_settings()
        out: list[str] = []
        encoding = self._conn.info.encoding
        for i in range(0, len(values), _RENDER_BATCH):
            chunk = list(values[i : i + _RENDER_BATCH])
            query = "SELECT " + ", ".join(f"${k + 1}" for k in range(len(chunk)))
            try:
                res = self._conn.pgconn.exec_params(
                    query.encode(), chunk, [type_oid] * len(chunk), [1] * len(chunk), 0
                )
            except psycopg.OperationalError as exc:
                raise ConnectionFailed(f"lost the catalog connection to PostgreSQL: {exc}") from exc
            if res.status != pq.ExecStatus.TUPLES_OK:
                err = psycopg.errors.error_from_result(res, encoding=encoding)
                if self._conn.pgconn.status != pq.ConnStatus.OK:
                    raise ConnectionFailed(f"lost the catalog connection to PostgreSQL: {err.diag.message_primary}") from err
                # The statement only reads the parameters: what the server refuses is the bytes
                # (invalid_binary_representation, "insufficient data left in message", ...).
                raise ValueError(err.diag.message_primary or "invalid value") from None
            for k in range(len(chunk)):
                value = res.get_value(0, k)
                if value is None:  # a receive function never returns NULL for non-NULL input
                    raise ValueError("the server printed NULL")
                out.append(bytes(value).decode(encoding))
        return out
