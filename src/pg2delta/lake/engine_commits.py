"""The commit of a window's final rows of one table: a MERGE, an append, on Apache Spark an
overwrite of the window's keys, or on the embedded engine a rewrite of the files that hold the
rows' keys.

A statement builder gives :meth:`Commits._commit` Spark SQL (a ``MERGE INTO``), an
:class:`pg2delta.lake.engine_session.AppendRows` (a table that held no row), or a
:class:`pg2delta.lake.engine_session.MergeRows`. The last is a ``MERGE`` everywhere but on the
embedded engine. pysail 0.7.2 plans a ``MERGE`` as a hash join that collects the source, every
column of every row, twice, without spilling (about 0.6 GB per million rows of a 10-column table,
bench/README.md), and took 1.2-3.4 times as long as the rewrite below for the same windows
(docs/concepts/layout.md). There the same rows
are committed as one overwrite with ``replaceWhere``: the table's rows in the key ranges of the
files that can hold a key of the source (the Delta log's statistics of the first key column, see
:func:`key_ranges`), less the source's keys, plus the source's rows that are not deletes. The
other files stay as they are; the join collects the source's keys only; the rows stream through
to the writer, in one commit as the ``MERGE`` would make; a replay after a crash writes the same
rows again. Into a table with deletion vectors larger than a few megabytes, a window of up to
:data:`EMBEDDED_VECTOR_MERGE_ROWS` rows whose keys are in files holding more than
:data:`VECTOR_MERGE_FROM_FRACTION` of its rows is pysail's ``MERGE`` instead, which writes a
deletion vector on each file that holds a key of the window and the new rows in a new file
(:meth:`RangeRewrites._merges_with_vectors`): scattered keys touch every file of a large table,
which the rewrite would write again whole.

On Apache Spark a window of at most :data:`REPLACE_KEYS_MAX` keys is committed as one overwrite
with ``replaceWhere`` of exactly those keys (:meth:`Commits._replace_keys`): Delta deletes the
table's rows of the keys (a deletion vector on each file that holds one, on a table with them) and
writes the window's rows that are not deletes, in one commit, as the ``MERGE`` would leave the
table. It needs fewer Spark jobs than the ``MERGE``'s join (measured in new spark-submits, a window
of 1,200 keys into 2,000,000 rows: 5.0 s against 7.2 s, bench/README.md); past a few thousand
keys the condition's list costs more than the join saves.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.decode.changes import OP_COL
from pg2delta.decode.events import DELETED_COL
from pg2delta.delta_features import CHANGE_DATA_FEED
from pg2delta.errors import LakeError
from pg2delta.lake.conflicts import committing
from pg2delta.lake.engine_maintain import DELETION_VECTORS
from pg2delta.lake.engine_reads import DeltaReads
from pg2delta.lake.engine_session import AppendRows, MergeRows, Txn
from pg2delta.lake.lake_files import key_bounds, metadata_at, property_on
from pg2delta.lake.sql import key_equal, quote, sql_string
from pg2delta.memory import release_memory

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")

# Rows of a window's source from which the embedded engine commits a MergeRows as a rewrite (see
# the module's docstring): every window with rows. Measured: the rewrite of 10 updates into 1,000
# rows took 0.03 s, pysail's MERGE 0.26 s; a MERGE of 1,000,000 rows grew the process by 600-700 MB,
# their rewrite by 70-230 MB, in a fifth of the time (bench/README.md).
EMBEDDED_REWRITE_ROWS = 1

# Rows of a window's source up to which the embedded engine commits it into a table with deletion
# vectors (past VECTORS_FROM_BYTES) as pysail's MERGE, which writes vectors (RangeRewrites._merges_with_vectors).
# Measured in one session, pysail 0.7.2, 2,000,000 rows in 16 files, scattered keys: 1,200 keys
# 0.40 s, 100,000 keys 0.84 s, 300,000 keys 1.19 s; the MERGE collects the window twice, every
# column, without spilling (about 0.6 GB per million rows of a 10-column table).
EMBEDDED_VECTOR_MERGE_ROWS = 200_000
# The share of a table's rows in the files that hold a window's keys up to which the embedded engine
# rewrites those files rather than merging with deletion vectors: pysail's MERGE reads the whole
# table. Measured with make bench-scale (new processes): 1,000 updates to the newest 1 % of
# 20,000,000 rows (1 file of 64) 2.8 s as the rewrite, 6.7 s as the MERGE; 1,200 scattered keys
# (every file) 15.9 s against 6.4 s.
VECTOR_MERGE_FROM_FRACTION = 0.125

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
BUCKET_WINDOW_ROWS = 100_000
_HASH_TYPES = frozenset({"tinyint", "smallint", "int", "bigint", "string", "decimal", "date", "timestamp", "boolean"})

# Rows of a window up to which its keys are read into this process to find the files that hold
# one (Commits._replaced); past it the rewrite takes the files of the window's whole key range.
KEY_LIST_ROWS = 2_000_000
# Key ranges a rewrite's condition names at most (key_ranges).
MAX_RANGES = 64

# Bytes of data files up to which Apache Spark's MERGE into a table with deletion vectors rewrites
# the files it touches instead of writing vectors (Commits._rewrite_if_small: a small table's
# MERGE costs 11 Spark jobs that way, 18 with vectors), and Delta's session setting that says which.
VECTORS_FROM_BYTES = 8 << 20
MERGE_VECTORS = "spark.databricks.delta.merge.deletionVectors.persistent"
# The same for a DELETE, and an overwrite's replaceWhere (Commits._replace_keys): measured in one
# session on a 10,000-row table in one file, 20 keys a window, medians of 6: 1.09 s rewriting the
# file, 1.23 s writing a vector.
DELETE_VECTORS = "spark.databricks.delta.delete.deletionVectors.persistent"

# Keys of a window up to which Apache Spark commits its rows as one overwrite of those keys
# (Commits._replace_keys) rather than a MERGE. Measured in one session on 2,000,000 rows with
# deletion vectors, scattered keys: 1,200 keys 1.6-2.2 s against the MERGE's 4.2-4.6 s, 10,000
# 4.0 s against 5.0 s, 50,000 9.5 s against 4.9 s (the condition's list of literals, planned and
# evaluated per row, grows with the window; the MERGE's join does not).
REPLACE_KEYS_MAX = 5_000
# Delta's check that every row an overwrite with replaceWhere writes meets its condition: a
# generated expression of the whole list per row (at 200,000 keys it ran out of the driver's
# memory compiling it). The rows written are the window's own, whose keys the list is made of.
REPLACE_WHERE_CHECK = "spark.databricks.delta.replaceWhere.constraintCheck.enabled"
ESCAPED_LITERALS = "spark.sql.parser.escapedStringLiterals"


class RangeRewrites(DeltaReads):
    """The embedded engine's commit of a :class:`MergeRows` as an overwrite of the source's key
    range (:meth:`_rewrite_range`, see the module's docstring), and the staged results it reads back."""

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
        :data:`EMBEDDED_REWRITE_ROWS` rows, a table with columns the source does not set (a
        ``MERGE`` keeps their values in the rows it updates), or where the ``MERGE`` writing
        deletion vectors costs less (:meth:`_merges_with_vectors`).

        Which side of the join pysail collects follows its estimates (a range filter on the table
        makes it guess the table's side smaller, every column of it): past
        :data:`REWRITE_BUCKET_ROWS` rows on either side, the new rows of the range are computed one
        hash bucket of the key at a time into the staging area, each bucket's join bounded whichever
        side it collects, and the overwrite then reads them back."""

        work = f"rewrite-{uuid.uuid4().hex}"
        views: list[str] = []
        try:
            schema = self.log_schema(uri) or self.spark.read.format("delta").load(uri).schema
            fields = {f.name: f for f in schema.fields}
            source = self.spark.table(view)
            if set(fields) != set(merge.columns) or DELETED_COL in fields:
                # Soft deletes (pg2delta.apply.merge.SoftDeletes) keep a deleted row's values: a MERGE.
                return False
            first = merge.key_names[0]
            ranged = not merge.truncate and not merge.nullable_keys and fields[first].dataType.simpleString() in _RANGE_TYPES
            k = quote(first)
            stats = source.selectExpr("count(*) AS n", *([f"min({k}) AS lo", f"max({k}) AS hi"] if ranged else []))
            got = stats.collect()[0].asDict()
            if got["n"] < max(1, EMBEDDED_REWRITE_ROWS):
                return False
            # The source in the table's types (a key compared or hashed in another type differs).
            cast = self._view(views, _typed(source, fields, *([] if OP_COL in fields else [OP_COL])))
            where, in_range, total = self._replaced(uri, first, cast, got) if ranged else (None, None, None)
            if self._merges_with_vectors(uri, merge, fields, got["n"], (in_range, total)):
                return False
            # The range's rows as a subquery, not a view: pysail loads the table (lists its log,
            # reads its checkpoint) for each statement naming it, a view's creation included.
            ranged_rows = f"(SELECT * FROM {self.target(uri)}{'' if where is None else f' WHERE {where}'}) AS ranged"
            if in_range is None:
                in_range = 0 if merge.truncate else int(self.spark.sql(f"SELECT * FROM {ranged_rows}").count())
            buckets, rows = self._new_rows(merge, fields, (cast, ranged_rows), got["n"], in_range, work)
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

    def _merges_with_vectors(self, uri: str, merge: MergeRows, fields: dict[str, Any], rows: int,
                             touched: tuple[int | None, int | None]) -> bool:
        """Whether the embedded engine commits a window of ``rows`` rows into the table at ``uri``
        as pysail's ``MERGE``, which writes a deletion vector on each file that holds a key of the
        window and the new rows in a new file, rather than rewriting the files that hold its keys
        (:meth:`_rewrite_range`), which hold ``touched`` = (``in_range``, ``total``): that many of
        the table's rows (None: the log does not say, or the rewrite would be of the whole table).
        ``fields``: the table's columns. A table with deletion
        vectors (its log's properties) holding more than :data:`VECTORS_FROM_BYTES` (a small
        table's rewrite is cheaper and leaves no vectors to read), a window of at most
        :data:`EMBEDDED_VECTOR_MERGE_ROWS` rows (the ``MERGE`` collects the window, every column,
        without spilling), whose files hold more than :data:`VECTOR_MERGE_FROM_FRACTION` of the
        table's rows (pysail's ``MERGE`` reads the whole table whatever it touches; rewriting a few
        files costs less). Not for inserts alone: the rewrite's key ranges of new keys
        hold no file, so it writes their rows and reads nothing, where the ``MERGE`` joins them
        with the whole table (2,000,000 rows: 2.0-2.5 s against 1.5-1.8 s, make bench-scale); nor
        for a truncate (the ``MERGE`` would mark every row of the table; the rewrite writes the
        window's rows alone), keys matched null-safely or of floats (matched by an expression, not
        a hash join of the columns)."""
        in_range, total = touched
        plain_keys = all(fields[c].dataType.simpleString().split("(")[0] in _HASH_TYPES for c in merge.key_names)
        if merge.inserts_only or merge.truncate or merge.nullable_keys or not plain_keys:
            return False
        if rows > EMBEDDED_VECTOR_MERGE_ROWS or not self.deletion_vectors:
            return False
        if in_range is not None and total and in_range <= total * VECTOR_MERGE_FROM_FRACTION:
            return False
        try:
            meta = metadata_at(self.lake, uri)
        except LakeError:
            return False
        if not property_on(meta, DELETION_VECTORS):
            return False
        if self._small(uri):
            return False
        log.info("%s: %d rows merged, deletion vectors on the files they touch", uri, rows)
        return True

    def _small(self, uri: str) -> bool:
        """Whether the Delta table at ``uri`` holds at most :data:`VECTORS_FROM_BYTES` of data
        files, by its log (False where the log cannot tell without the engine)."""
        try:
            found = self.lake.files_now(uri)
        except LakeError:
            return False
        return found is not None and sum(found[1].values()) <= VECTORS_FROM_BYTES

    def _new_rows(
        self, merge: MergeRows, fields: dict[str, Any], views: tuple[str, str], n: int, in_range: int, work: str
    ) -> tuple[int, Any]:
        """How many hash buckets of the key the new rows of the range are computed in, and those
        rows: of the relations ``views`` (the view of the window's rows in the table's types, the
        subquery of the table's rows of the range) holding ``n`` and ``in_range`` rows; in buckets, each is staged under ``work`` first (see
        :meth:`_rewrite_range`)."""
        source, ranged_rows = views
        hashable = all(fields[c].dataType.simpleString().split("(")[0] in _HASH_TYPES for c in merge.key_names)
        # The join holds the range's rows (every column) or the window's keys (a few): the
        # window's rows count for a quarter. A truncate's has no join. A window of fewer than
        # BUCKET_WINDOW_ROWS rows is the smaller side by far whatever the range: its keys are held,
        # in one query (in buckets, each would read the whole range again).
        bucketed = hashable and not merge.truncate and n >= BUCKET_WINDOW_ROWS
        buckets = max(1, -(-max(n // 4, in_range) // REWRITE_BUCKET_ROWS)) if bucketed else 1
        if buckets == 1:
            return 1, self._range_rows(merge, fields, source, ranged_rows, None)
        keys = ", ".join(quote(c) for c in merge.key_names)
        parts = []
        for i in range(buckets):
            part = self.lake.staging_uri(f"{work}/part-{i:04d}")
            bucket = f"pmod(hash({keys}), {buckets}) = {i}"
            if self.stage_rows(self._range_rows(merge, fields, source, ranged_rows, bucket), part):
                parts.append(part)
        if not parts:
            return buckets, self.spark.sql(f"SELECT * FROM {ranged_rows}").limit(0)
        return buckets, _typed(self.spark.read.parquet(*parts), fields)

    def _replaced(self, uri: str, first: str, source: str, got: dict[str, Any]) -> tuple[str, int | None, int | None]:
        """The condition of the rewrite's ``replaceWhere``, the rows of the table it meets and the
        table's rows, when the log says: the key ranges of the files that hold a key of the window, and of its keys no
        file holds (:func:`key_ranges`), from the Delta log's statistics of the first key column
        ``first``; the window's range (``got``: its ``lo`` and ``hi``) when the log has no
        statistics of it, or the window has more than :data:`KEY_LIST_ROWS` rows (its keys are read
        into this process)."""
        k = quote(first)
        whole = _range(k, got["lo"], got["hi"]), None, None
        if got["n"] > KEY_LIST_ROWS:
            return whole
        try:  # from the log's tail, not a delta-rs load: that lists the whole log and reads the removed files too
            bounds = key_bounds(self.lake, uri, first)
        except LakeError:  # a log that reading cannot follow (column mapping, a V2 checkpoint)
            bounds = _delta_rs_bounds(self._delta_rs(uri), first)
        if bounds is None:
            return whole
        lo, hi, counts, all_files = bounds
        distinct = self.spark.sql(f"SELECT DISTINCT {k} AS k FROM {source}")
        if hasattr(distinct, "toArrow"):  # pyspark 4; 3.5's Connect client has toPandas only
            keys = distinct.toArrow().column("k").to_numpy()
        else:
            keys = distinct.toPandas()["k"].to_numpy()
        keys = np.sort(keys.astype(np.int64))
        ranges = key_ranges(keys, lo, hi)
        meets = np.zeros(len(lo), dtype=bool)
        for a, b in ranges:
            meets |= (lo <= b) & (hi >= a)
        if len(lo) != all_files or counts is None:
            return _ranges(k, ranges), None, None
        return _ranges(k, ranges), int(np.sum(counts[meets])), int(np.sum(counts))

    def _view(self, views: list[str], df: Any) -> str:
        name = f"pg2delta_rewrite_{uuid.uuid4().hex[:12]}"
        df.createOrReplaceTempView(name)
        views.append(name)
        return name

    def _range_rows(self, merge: MergeRows, fields: dict[str, Any], source: str, table: str, bucket: str | None) -> Any:
        """The new rows of the range (of one hash ``bucket`` of the key): the rows of the relation
        ``table`` (the range's, a subquery with its alias) less the keys of the view ``source`` (the window's rows in the
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


class Commits(RangeRewrites):
    """How the engine commits a statement builder's result (:meth:`_commit`)."""

    def with_txn(self, writer: Any, txn: Txn | None) -> Any:
        """``writer`` (a DataFrame writer into Delta) with ``txn`` as Delta's idempotent-write options."""
        if txn is None or not self.idempotent_writes:
            return writer
        return writer.option("txnAppId", txn.app_id).option("txnVersion", str(txn.version))

    def _commit(self, uri: str, view: str, statement: str | AppendRows | MergeRows, what: str, txn: Txn | None,
                *, rows: int | None = None) -> None:
        """Commit ``statement`` (Spark SQL, an :class:`AppendRows` or a :class:`MergeRows` of the
        temporary view ``view``, which holds ``rows`` rows when the caller knows) as one commit to the
        Delta table at ``uri``, with Delta's idempotent-write id ``txn`` where the engine has them;
        again when another writer's commit met it (:func:`pg2delta.lake.conflicts.committing`)."""
        committing(self.lake, uri, what, lambda: self._commit_once(uri, view, statement, what, txn, rows=rows))

    def _commit_once(
        self, uri: str, view: str, statement: str | AppendRows | MergeRows, what: str, txn: Txn | None, *, rows: int | None
    ) -> None:
        if isinstance(statement, MergeRows):
            self._commit_merge(uri, view, statement, what, txn, rows=rows)
            return
        if isinstance(statement, str):
            with self._txn(txn):
                self._sql(statement, what)
            return
        self._append(uri, view, statement, txn)

    def _append(self, uri: str, view: str, append: AppendRows, txn: Txn | None) -> None:
        """``append``'s rows of the temporary view ``view`` appended to the Delta table at ``uri``
        (created by the append when missing, in one commit), with Delta's idempotent-write id ``txn``."""
        cols = ", ".join(quote(c) for c in append.columns)
        try:
            relation = view if append.source is None else f"{append.source} AS a"
            rows_df = self.spark.sql(f"SELECT {cols} FROM {relation} WHERE {append.where}")
            writer = self.delta_writer(rows_df, "append")
            if self.lake.delta_version(uri) is None:  # the append creates the table: one commit
                writer = self.new_table_writer(writer, rows_df, uri)
            self.with_txn(writer, txn).save(uri)
        except Exception as exc:
            raise LakeError(f"append to {uri} failed: {' '.join(str(exc).split())[:500]}") from exc

    def _commit_merge(self, uri: str, view: str, merge: MergeRows, what: str, txn: Txn | None, *, rows: int | None) -> None:
        """``merge`` committed as it costs the engine least: the embedded engine rewrites its key
        range (:meth:`_rewrite_range`) where that costs less than a ``MERGE`` writing deletion
        vectors (:meth:`_merges_with_vectors`); Apache Spark's ``MERGE`` is bounded by the source's
        key range (Delta prunes the files it reads by the ``ON`` clause's conditions on the table)
        and rewrites a small table's files (:meth:`_rewrite_if_small`).

        Rows that are inserts alone (``merge.inserts_only``) are a blind append on Apache Spark:
        one Spark job, where the ``MERGE`` costs eight or more, three of them to rebuild the
        table's state from its log, which an append without Delta's idempotent-write id does not
        read (the caller vouches that a replay cannot land the rows twice). A retry after another
        writer's commit follows :func:`pg2delta.lake.conflicts.committing`. Apache Spark only: its
        commits say they are pg2delta's, where pysail's append would read as another writer's
        (:mod:`pg2delta.lake.foreign`)."""
        if merge.inserts_only and self.classic:
            self._append(uri, view, AppendRows(merge.columns, f"{quote(OP_COL)} <> 'D'"), None)
            log.info("%s: inserts alone, committed as a blind append", uri)
            return
        if self.embedded and (rows is None or rows >= EMBEDDED_REWRITE_ROWS) and self._rewrite_range(uri, view, merge, what):
            return
        if self.classic and self._replace_keys(uri, view, merge, txn):
            return
        with self._txn(txn), self._rewrite_if_small(uri):
            self._sql(merge.bounded if self.classic and merge.bounded else merge.statement, what)

    def _replace_keys(self, uri: str, view: str, merge: MergeRows, txn: Txn | None) -> bool:
        """``merge`` committed on Apache Spark as one overwrite with ``replaceWhere`` of the
        source's keys (``merge.keys``; see the module's docstring); False, having done nothing,
        where it must stay a ``MERGE``: no keys given or more than :data:`REPLACE_KEYS_MAX`, a
        truncate (rows the source lacks go too), keys matched null-safely, a table with columns the
        source does not set (the ``MERGE`` keeps their values in the rows it updates) or soft
        deletes, a table whose log does not say its columns, and a table with a change data feed
        (its readers get an update as an update, where the overwrite records a delete and an
        insert)."""
        keys = merge.keys
        if not keys or len(keys) > REPLACE_KEYS_MAX or len(merge.key_names) != 1 or merge.truncate or merge.nullable_keys:
            return False
        if isinstance(keys[0], str) and str(self.spark.conf.get(ESCAPED_LITERALS, "false")).lower() == "true":
            return False  # the session reads a backslash in a literal as itself: in_keys's escapes would be wrong
        try:
            meta = metadata_at(self.lake, uri)
        except LakeError:
            return False
        if meta is None or property_on(meta, CHANGE_DATA_FEED):
            return False
        from pyspark.sql.types import StructType

        try:
            fields = {f.name: f for f in StructType.fromJson(json.loads(meta["schemaString"])).fields}
        except (ValueError, KeyError, TypeError) as exc:  # a type this pyspark does not know: the MERGE
            log.debug("%s: schema not read from the log (%s), committed as a MERGE", uri, exc)
            return False
        if set(fields) != set(merge.columns) or DELETED_COL in fields:
            return False
        rows = _typed(self.spark.sql(f"SELECT * FROM {view} WHERE {quote(OP_COL)} <> 'D'"), fields)
        writer = self.delta_writer(rows, "overwrite").option("replaceWhere", in_keys(quote(merge.key_names[0]), keys))
        try:
            with self._unless_set(REPLACE_WHERE_CHECK, "false"), self._rewrite_if_small(uri, DELETE_VECTORS):
                self.with_txn(writer, txn).save(uri)
        except Exception as exc:
            raise LakeError(f"overwrite of {len(keys)} keys of {uri} failed: {' '.join(str(exc).split())[:500]}") from exc
        log.info("%s: %d keys committed as an overwrite of those keys", uri, len(keys))
        return True

    @contextmanager
    def _rewrite_if_small(self, uri: str, setting: str = MERGE_VECTORS) -> Iterator[None]:
        """A ``MERGE`` in this block (Apache Spark; with ``setting`` :data:`DELETE_VECTORS`, a
        ``DELETE`` or an overwrite's ``replaceWhere``) rewrites the files it touches rather than writing
        deletion vectors when the table at ``uri`` holds at most :data:`VECTORS_FROM_BYTES` (its
        files' sizes in the Delta log, read with pyarrow: no Spark job). Deletion vectors save
        rewriting the untouched rows of large files, at the price of more Spark queries per
        ``MERGE`` (18 jobs against 11 for a small table: the vectors' rows found and written),
        which cost more than rewriting a small table's files (bench/README.md). The table keeps
        the feature; a ``MERGE`` into it once it is larger writes vectors again. A session that
        sets ``setting`` itself (``[engine]``'s Spark settings) decides alone."""
        if not self.classic or not self.deletion_vectors or self.spark.conf.get(setting, None) is not None or not self._small(uri):
            yield
            return
        with self._unless_set(setting, "false"):
            yield

    @contextmanager
    def _unless_set(self, setting: str, value: str) -> Iterator[None]:
        """The session's ``setting`` is ``value`` in this block, unless the session sets it itself
        (``[engine]``'s Spark settings), which then decides."""
        conf = self.spark.conf
        if conf.get(setting, None) is not None:
            yield
            return
        conf.set(setting, value)
        try:
            yield
        finally:
            conf.unset(setting)

    def update(self, uri: str, statement_for: Callable[[str], str], *, txn: Txn | None = None) -> None:
        """The ``UPDATE`` ``statement_for(target)`` of the Delta table at ``uri``, in one commit."""
        self._committed(uri, statement_for(self.target(uri)), f"UPDATE {uri}", txn)

    def _committed(self, uri: str, statement: str, what: str, txn: Txn | None) -> None:
        """The Spark SQL ``statement``: one commit to ``uri`` with the id ``txn``, retried as :meth:`_commit` is."""
        def attempt() -> None:
            with self._txn(txn):
                self._sql(statement, what)
        committing(self.lake, uri, what, attempt)

    def new_table_writer(self, writer: Any, df: Any, uri: str) -> Any:
        """``writer`` (of ``df``) of a commit that creates the Delta table ``uri``, with what the
        engine creates tables with (see :meth:`pg2delta.lake.engine.Engine.new_table_writer`)."""
        return writer


def _delta_rs_bounds(table: Any, first: str) -> tuple[Any, Any, Any, int] | None:
    """:func:`pg2delta.lake.lake_files.key_bounds` of the column ``first``, from delta-rs's ``table``."""
    files = pa.table(table.get_add_actions(flatten=True))
    names = files.schema.names
    if f"min.{first}" not in names or f"max.{first}" not in names or "num_records" not in names:
        return None
    all_files = files.num_rows
    files = files.filter(pc.and_(pc.is_valid(files.column(f"min.{first}")), pc.is_valid(files.column(f"max.{first}"))))
    counts = files.column("num_records")
    return (files.column(f"min.{first}").to_numpy(), files.column(f"max.{first}").to_numpy(),
            None if counts.null_count else counts.to_numpy(zero_copy_only=False), all_files)


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


def key_ranges(keys: Any, mins: Any, maxs: Any, *, limit: int = MAX_RANGES) -> list[tuple[int, int]]:
    """The key ranges a window's rewrite replaces: the range of each file (``mins[i]`` to
    ``maxs[i]``, its statistics) that holds one of the window's ``keys`` (sorted, distinct
    integers), and runs of the keys no file's range holds (new keys) that no file's range meets;
    overlapping and adjacent ranges merged. A file whose range holds no key meets none of them, so
    a rewrite of these ranges leaves it untouched. Past ``limit`` ranges, those with the narrowest
    gaps between them are joined (a condition of thousands of ranges costs more to evaluate on
    every row than the rows in the gaps)."""
    keys = np.asarray(keys, dtype=np.int64)
    lo = np.asarray(mins, dtype=np.int64)
    hi = np.asarray(maxs, dtype=np.int64)
    if keys.size == 0:
        return []
    at = np.searchsorted(keys, lo, side="left")
    hit = (at < keys.size) & (keys[np.minimum(at, keys.size - 1)] <= hi)
    ranges = list(zip(lo[hit].tolist(), hi[hit].tolist(), strict=True))
    # A key is in some file when the files starting at or before it reach it.
    order = np.argsort(lo, kind="stable")
    starts = lo[order]
    reach = np.maximum.accumulate(hi[order]) if lo.size else hi
    before = np.searchsorted(starts, keys, side="right") - 1
    covered = (before >= 0) & (reach[np.maximum(before, 0)] >= keys) if lo.size else np.zeros(keys.size, bool)
    loose = keys[~covered]
    if loose.size:
        # Consecutive loose keys share a run unless a file starts between them.
        cut = np.searchsorted(starts, loose[1:], side="left") > np.searchsorted(starts, loose[:-1], side="right")
        for run in np.split(loose, np.flatnonzero(cut) + 1):
            ranges.append((int(run[0]), int(run[-1])))
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    if len(merged) > limit:
        gaps = np.array([b[0] - a[1] for a, b in itertools.pairwise(merged)], dtype=np.float64)
        joined = set(np.argsort(gaps, kind="stable")[: len(merged) - limit].tolist())
        out = [merged[0]]
        for i, r in enumerate(merged[1:]):
            out[-1:] = [(out[-1][0], r[1])] if i in joined else [out[-1], r]
        merged = out
    return merged


def replaced_keys(column: pa.ChunkedArray) -> tuple[int, ...] | tuple[str, ...] | None:
    """A window's keys (its one key column, ``column``) as :attr:`MergeRows.keys`: integers or
    strings, none NULL, at most :data:`REPLACE_KEYS_MAX` of them; None otherwise."""
    kind = column.type
    if len(column) == 0 or len(column) > REPLACE_KEYS_MAX or column.null_count:
        return None
    if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return None
    return tuple(column.to_pylist())


def in_keys(column: str, keys: tuple[int, ...] | tuple[str, ...]) -> str:
    """Spark SQL: ``column`` is one of ``keys`` (integers or strings, none NULL), false (not NULL)
    on a NULL; bounded by their smallest and largest too, which Delta's file skipping reads from
    each file's statistics where it would not from the list."""
    ordered: list[Any] = sorted(set(keys))
    texts = [str(int(k)) for k in ordered] if isinstance(ordered[0], int) else [sql_string(str(k)) for k in ordered]
    return (f"{column} IS NOT NULL AND {column} >= {texts[0]} AND {column} <= {texts[-1]} "
            f"AND {column} IN ({', '.join(texts)})")


def _ranges(column: str, ranges: list[tuple[int, int]]) -> str:
    """Spark SQL: ``column`` (an integer) in one of ``ranges``, false (not NULL) on a NULL (see :func:`_range`)."""
    if not ranges:
        return "false"
    parts = [f"{column} = {a}" if a == b else f"({column} >= {a} AND {column} <= {b})" for a, b in ranges]
    return f"{column} IS NOT NULL AND ({' OR '.join(parts)})"
