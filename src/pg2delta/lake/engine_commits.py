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
import uuid
from typing import Any

from pg2delta.decode.changes import OP_COL
from pg2delta.errors import LakeError
from pg2delta.lake.engine_reads import DeltaReads
from pg2delta.lake.engine_session import AppendRows, MergeRows, Txn
from pg2delta.lake.sql import key_equal, quote
from pg2delta.memory import release_memory

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

# Rows of the table in the source's range (or four times as many rows of the source, whose keys
# alone the join holds) past which the new rows are computed in hash buckets of the key
# (Commits._rewrite_range); key types hashed alike on both sides once cast to the table's (not
# floats: NaN and -0.0).
REWRITE_BUCKET_ROWS = 500_000
_HASH_TYPES = frozenset({"tinyint", "smallint", "int", "bigint", "string", "decimal", "date", "timestamp", "boolean"})


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
        cols = ", ".join(quote(c) for c in statement.columns)
        try:
            writer = self.delta_writer(self.spark.sql(f"SELECT {cols} FROM {view} WHERE {statement.where}"), "append")
            if txn is not None and self.idempotent_writes:
                writer = writer.option("txnAppId", txn.app_id).option("txnVersion", str(txn.version))
            writer.save(uri)
        except Exception as exc:
            raise LakeError(f"append to {uri} failed: {' '.join(str(exc).split())[:500]}") from exc

    def stage_rows(self, df: Any, target: str) -> bool:
        """``df`` written to the staging area's ``target`` as Parquet, to be read back once, whole;
        False when nothing was written: pysail writes nothing at all for an empty result (Apache
        Spark a file with the schema)."""
        writer = df.write.mode("overwrite")
        if not self.classic:
            # No statistics: pysail would read a NaN back as the file's other value (see
            # pg2delta.lake.engine_writes.STATS_COLUMNS).
            writer = writer.option("statistics_enabled", "none")
        writer.parquet(target)
        release_memory()
        return self.lake.exists(target)

    def _rewrite_range(self, uri: str, view: str, merge: MergeRows, what: str) -> bool:
        """``merge`` committed as an overwrite of the source's key range (see the module's docstring);
        False, having done nothing, when it must stay a ``MERGE``: fewer than
        :data:`EMBEDDED_REWRITE_ROWS` rows, or a table with columns the source does not set (a
        ``MERGE`` keeps their values in the rows it updates).

        Which side of the join pysail collects follows its estimates (a range filter on the table
        makes it guess the table's side smaller, every column of it): past
        :data:`REWRITE_BUCKET_ROWS` rows on either side, the new rows of the range are computed one
        hash bucket of the key at a time into the staging area, each bucket's join bounded whichever
        side it collects, and the overwrite then reads them back."""

        work = f"rewrite-{uuid.uuid4().hex}"
        views: list[str] = []
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
            # The source in the table's types (a key compared or hashed in another type differs).
            cast = self._view(views, _typed(source, fields, OP_COL))
            table = self.spark.read.format("delta").load(uri)
            if where is not None:
                table = table.where(where)
            in_range = 0 if merge.truncate else int(table.count())
            ranged_rows = self._view(views, table)
            hashable = all(fields[c].dataType.simpleString().split("(")[0] in _HASH_TYPES for c in merge.key_names)
            # The join holds the range's rows (every column) or the window's keys (a few): the
            # window's rows count for a quarter. A truncate's has no join.
            buckets = max(1, -(-max(got["n"] // 4, in_range) // REWRITE_BUCKET_ROWS)) if hashable and not merge.truncate else 1
            if buckets == 1:
                rows = self._range_rows(merge, fields, cast, ranged_rows, None)
            else:
                keys = ", ".join(quote(c) for c in merge.key_names)
                parts = []
                for i in range(buckets):
                    part = self.lake.staging_uri(f"{work}/part-{i:04d}")
                    bucket = f"pmod(hash({keys}), {buckets}) = {i}"
                    if self.stage_rows(self._range_rows(merge, fields, cast, ranged_rows, bucket), part):
                        parts.append(part)
                rows = _typed(self.spark.read.parquet(*parts), fields) if parts else table.limit(0)
            writer = self.delta_writer(rows, "overwrite")
            if where is not None:
                writer = writer.option("replaceWhere", where)
            writer.save(uri)
        except Exception as exc:
            raise LakeError(f"{what} (a rewrite of its key range) failed: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            for name in views:
                try:
                    self.spark.catalog.dropTempView(name)
                except Exception:
                    log.debug("could not drop temp view %s", name)
            self.lake.unstage_dir(work)
        log.debug(
            "%s: %d rows committed as a rewrite of %s (%d rows before, %d bucket(s))",
            uri, got["n"], where or "the whole table", in_range, buckets,
        )
        return True

    def _view(self, views: list[str], df: Any) -> str:
        name = f"pg2delta_rewrite_{uuid.uuid4().hex[:12]}"
        df.createOrReplaceTempView(name)
        views.append(name)
        return name

    def _range_rows(self, merge: MergeRows, fields: dict[str, Any], source: str, table: str, bucket: str | None) -> Any:
        """The new rows of the range (of one hash ``bucket`` of the key): the rows of the view
        ``table`` (the range's) less the keys of the view ``source`` (the window's rows in the
        table's types, and the op), plus its rows that are not deletes. The two are joined by name as
        DataFrames: pysail's SQL ``UNION ALL`` refuses a timestamp's time zone spelled "UTC" on one
        side and "Etc/UTC" on the other. (SQL and ``selectExpr`` only: pyspark 3.5's
        ``pyspark.sql.functions`` take the classic path unless this process's environment says Connect.)"""
        also = f" AND {bucket}" if bucket else ""
        cols = [quote(c) for c in fields]
        sourced = self.spark.sql(f"SELECT {', '.join(cols)} FROM {source} WHERE {quote(OP_COL)} <> 'D'{also}")
        if merge.truncate:
            return sourced
        nan_safe = self.nan_safe_keys(self.spark.table(source).schema, merge.key_names)
        on = " AND ".join(
            key_equal(f"t.{quote(c)}", f"s.{quote(c)}", nullable=merge.nullable_keys, nan_safe=c in nan_safe)
            for c in merge.key_names
        )
        keys = ", ".join(quote(c) for c in merge.key_names)
        kept = self.spark.sql(
            f"SELECT t.* FROM (SELECT * FROM {table} WHERE true{also}) AS t "
            f"LEFT ANTI JOIN (SELECT {keys} FROM {source} WHERE true{also}) AS s ON {on}"
        )
        return kept.selectExpr(*cols).unionByName(sourced)


def _typed(df: Any, fields: dict[str, Any], *also: str) -> Any:
    """``df``'s columns ``fields`` (and ``also``) in the table's types. A column already of its type
    is left alone: cast, a timestamp's time zone would read "Etc/UTC" where the table's reads "UTC",
    which pysail's union of the rows it keeps with the new ones (``replaceWhere``) refuses."""
    have = {f.name: f.dataType for f in df.schema.fields}
    return df.selectExpr(
        *[
            quote(c) if have[c] == f.dataType else f"CAST({quote(c)} AS {f.dataType.simpleString()}) AS {quote(c)}"
            for c, f in fields.items()
        ],
        *[quote(c) for c in also],
    )


def _range(column: str, lo: Any, hi: Any) -> str:
    """Spark SQL: ``column`` (an integer) between ``lo`` and ``hi``.

    False, not NULL, on a row whose column is NULL: pysail's ``replaceWhere`` keeps only the rows
    where the condition is false, and a NULL there would remove a row it does not rewrite.
    """
    return f"{column} IS NOT NULL AND {column} >= {int(lo)} AND {column} <= {int(hi)}"
