"""The commit of a window's final rows of one table: a MERGE, an append, or on the embedded engine
a rewrite of the rows' key range.

A statement builder gives :meth:`Commits._commit` Spark SQL (a ``MERGE INTO``), an
:class:`pg2delta.lake.engine_session.AppendRows` (a table that held no row), or a
:class:`pg2delta.lake.engine_session.MergeRows`. The last is a ``MERGE`` everywhere but on the
embedded engine past :data:`EMBEDDED_REWRITE_ROWS` rows: pysail 0.7.2 plans a ``MERGE`` as a hash
join that collects the source, every column of every row, twice, and does not spill, so its
memory grows with the window (about 0.6 GB per million rows of a 10-column table, bench/README.md).
There the same rows are committed as one overwrite with ``replaceWhere``: the table's rows in the
key range of the source (its first key column's minimum and maximum), less the source's keys,
plus the source's rows that are not deletes. The join then collects the source's keys only, the
rows stream through to the writer, and Delta rewrites the files of that range only, in one commit
as the ``MERGE`` would make; a replay after a crash writes the same rows again.
"""

from __future__ import annotations

import logging
from typing import Any

from pg2delta.decode.changes import OP_COL
from pg2delta.errors import LakeError
from pg2delta.lake.engine_reads import DeltaReads
from pg2delta.lake.engine_session import AppendRows, MergeRows, Txn

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")

# Rows of a window's source from which the embedded engine commits a MergeRows as a rewrite of
# their key range rather than a MERGE (see the module's docstring). Below it a MERGE rewrites only
# the files holding a key of the source, where a rewrite takes every file of the key range: a few
# keys spread over a large table would rewrite all of it. Measured (bench/README.md): a pysail
# MERGE of 100,000 rows grows the process by about 190 MB, of 1,000,000 by 600-700 MB; the rewrite
# of 1,000,000 or 5,000,000 rows by 70-230 MB, in a fifth of the time.
EMBEDDED_REWRITE_ROWS = 100_000

# Spark types whose minimum and maximum bound a key range in replaceWhere; other keys' tables are
# rewritten whole (still one commit). Not floats (NaN sorts above every number and Parquet
# statistics leave it out), dates and times (literals in a time zone), nor strings (Delta keeps
# statistics of a string's first 32 characters, and random UUIDs span the whole table anyway).
_RANGE_TYPES = frozenset({"tinyint", "smallint", "int", "bigint"})


class Commits(DeltaReads):
    """How the engine commits a statement builder's result (:meth:`_commit`)."""

    def _commit(
        self,
        uri: str,
        view: str,
        statement: str | AppendRows | MergeRows,
        what: str,
        txn: Txn | None,
        *,
        rows: int | None = None,
    ) -> None:
        """Commit ``statement`` (Spark SQL, an :class:`AppendRows` or a :class:`MergeRows` of the
        temporary view ``view``, which holds ``rows`` rows when the caller knows) as one commit to the
        Delta table at ``uri``, with Delta's idempotent-write id ``txn`` where the engine has them."""
        if isinstance(statement, MergeRows):
            big = rows is None or rows >= EMBEDDED_REWRITE_ROWS
            if self.embedded and big and self._rewrite_range(uri, view, statement, what):
                return
            statement = statement.statement
        if isinstance(statement, str):
            with self._txn(txn):
                self._sql(statement, what)
            return
        from pg2delta.apply.merge import quote

        cols = ", ".join(quote(c) for c in statement.columns)
        try:
            writer = self.delta_writer(self.spark.sql(f"SELECT {cols} FROM {view} WHERE {statement.where}"), "append")
            if txn is not None and self.idempotent_writes:
                writer = writer.option("txnAppId", txn.app_id).option("txnVersion", str(txn.version))
            writer.save(uri)
        except Exception as exc:
            raise LakeError(f"append to {uri} failed: {' '.join(str(exc).split())[:500]}") from exc

    def _rewrite_range(self, uri: str, view: str, merge: MergeRows, what: str) -> bool:
        """``merge`` committed as an overwrite of the source's key range (see the module's docstring);
        False, having done nothing, when it must stay a ``MERGE``: fewer than
        :data:`EMBEDDED_REWRITE_ROWS` rows, or a table with columns the source does not set (a
        ``MERGE`` keeps their values in the rows it updates)."""
        from pyspark.sql import functions as F

        from pg2delta.apply.merge import key_equal, quote

        try:
            fields = {f.name: f for f in self.spark.read.format("delta").load(uri).schema.fields}
            source = self.spark.table(view)
            if set(fields) != set(merge.columns):
                return False
            first = merge.key_names[0]
            ranged = not merge.truncate and not merge.nullable_keys and fields[first].dataType.simpleString() in _RANGE_TYPES
            k = quote(first)
            stats = source.selectExpr("count(*) AS n", *([f"min({k}) AS lo", f"max({k}) AS hi"] if ranged else []))
            got = stats.collect()[0].asDict()
            if got["n"] < max(1, EMBEDDED_REWRITE_ROWS):
                return False
            where = _range(k, got["lo"], got["hi"]) if ranged else None
            keys = ", ".join(quote(c) for c in merge.key_names)
            nan_safe = self.nan_safe_keys(source.schema, merge.key_names)
            on = " AND ".join(
                key_equal(f"t.{quote(c)}", f"s.{quote(c)}", nullable=merge.nullable_keys, nan_safe=c in nan_safe)
                for c in merge.key_names
            )
            rest = (
                self.spark.sql(
                    f"SELECT t.* FROM (SELECT * FROM {self.target(uri)}{f' WHERE {where}' if where else ''}) AS t "
                    f"LEFT ANTI JOIN (SELECT {keys} FROM {view}) AS s ON {on}"
                )
                if not merge.truncate
                else None
            )
            sourced = source.where(f"{quote(OP_COL)} <> 'D'").select(*[
                (F.col(quote(c)) if source.schema[c].dataType == f.dataType else F.col(quote(c)).cast(f.dataType)).alias(c)
                for c, f in fields.items()
            ])
            rows = sourced if rest is None else rest.select(*[F.col(quote(c)) for c in fields]).unionByName(sourced)
            writer = self.delta_writer(rows, "overwrite")
            if where is not None:
                writer = writer.option("replaceWhere", where)
            writer.save(uri)
        except Exception as exc:
            raise LakeError(f"{what} (a rewrite of its key range) failed: {' '.join(str(exc).split())[:500]}") from exc
        log.debug("%s: %d rows committed as a rewrite of %s", uri, got["n"], where or "the whole table")
        return True


def _range(column: str, lo: Any, hi: Any) -> str:
    """Spark SQL: ``column`` (an integer) between ``lo`` and ``hi``.

    False, not NULL, on a row whose column is NULL: pysail's ``replaceWhere`` keeps only the rows
    where the condition is false, and a NULL there would remove a row it does not rewrite.
    """
    return f"{column} IS NOT NULL AND {column} >= {int(lo)} AND {column} <= {int(hi)}"
