"""Commits to Delta tables through the engine: MERGE, appends, deletes, rewrites.

Every statement that makes a Delta commit from staged Parquet: creating and widening a table,
rewriting it with wider types, the MERGE of a window's changes (with Delta's idempotent-write
settings where the engine has them, :class:`pg2delta.lake.engine_session.Txn`), appends, deletes, a
table replaced by a copy, and a copy of a table as of an old version (backfill's seed).
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from pg2delta.delta_features import NO_FEATURES, DeltaFeatures
from pg2delta.errors import LakeError
from pg2delta.faults import fault_point
from pg2delta.lake.conflicts import committing
from pg2delta.lake.engine_commits import Commits
from pg2delta.lake.engine_features import TableFeatures, creating, quote_text
from pg2delta.lake.engine_maintain import DELETION_VECTORS
from pg2delta.lake.engine_session import Txn
from pg2delta.lake.foreign import TRUNCATE_PREDICATE
from pg2delta.lake.lake_files import metadata_at, property_on
from pg2delta.lake.sql import quote

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")

# Which columns a table keeps Delta statistics (min, max, null count per file) of. Parquet and
# Delta leave NaN out of a float column's min and max, and pysail 0.7.2 (DataFusion) takes them as
# bounds of every non-null value (apache/datafusion#24804): a file holding [NaN, 2.5] has min =
# max = 2.5, so pysail reads the NaN back as 2.5, rewrites it so in the next MERGE touching the
# file, and skips the file when it looks for the NaN (a NaN key's update became a second row).
# So every table pg2delta creates keeps statistics of its other columns only, as Delta's default
# does of the first 32 columns. A float column added later is not named, so it has none either.
STATS_COLUMNS = "delta.dataSkippingStatsColumns"
INDEXED_COLUMNS = "delta.dataSkippingNumIndexedCols"
_STATS_FIRST = 32


# Commits between two checkpoints of a log pg2delta appends to with delta-rs (DeltaWrites.append_log_rows):
# every ten, as pysail and Apache Spark write them.
LOG_CHECKPOINT_INTERVAL = 10


def _stats_arrow_type(t: pa.DataType) -> bool:
    checks = (pa.types.is_integer, pa.types.is_decimal, pa.types.is_string, pa.types.is_large_string, pa.types.is_date,
              pa.types.is_timestamp)
    return any(bool(check(t)) for check in checks)


def stats_columns(schema: Any) -> list[str]:
    """The columns of ``schema`` (a Spark ``StructType`` or an Arrow schema) a table keeps Delta
    statistics of: of the first 32, the integers, decimals, strings, dates and timestamps (Delta
    refuses other types there; floats are left out, see :data:`STATS_COLUMNS`)."""
    if isinstance(schema, pa.Schema):
        return [f.name for f in list(schema)[:_STATS_FIRST] if _stats_arrow_type(f.type)]
    from pyspark.sql import types as T

    eligible = (T.IntegralType, T.DecimalType, T.StringType, T.DateType, T.TimestampType, T.TimestampNTZType)
    return [f.name for f in list(schema.fields)[:_STATS_FIRST] if isinstance(f.dataType, eligible)]


def stats_properties(schema: Any, exclude: Collection[str] = ()) -> dict[str, str]:
    """The table properties that keep Delta statistics of the :func:`stats_columns` of ``schema``
    only (a Spark ``StructType`` or an Arrow schema), but the partition columns ``exclude`` (Delta
    keeps none of those: Apache Spark refuses to name them)."""
    names = [quote(n) for n in stats_columns(schema) if n not in exclude]
    if not names:
        return {INDEXED_COLUMNS: "0"}
    return {STATS_COLUMNS: ",".join(names)}


def copy_file_options(schema: pa.Schema) -> dict[str, Any]:
    """``pyarrow.parquet.ParquetWriter`` keywords for the Parquet files a table's copy is staged in:
    files the embedded engine's lake takes as the table's own, unrewritten
    (:meth:`DeltaWrites.adopt_copy`), so written as Delta data files are, with statistics of the
    :func:`stats_columns` (the commit takes them from the footers) and none of the other columns.
    zstd: as fast to write as snappy here, half the bytes (``bench/README.md``). No dictionaries:
    they doubled the write."""
    return {"compression": "zstd", "use_dictionary": False, "write_statistics": stats_columns(schema) or False}


# Bytes of staged Parquet one Apache Spark task reads at most when a copy's files become a table
# (_save_file_per_task): more than a copy's file holds (pg2delta.copy.staging bounds them at
# about 32 MiB), and the cost of opening one as large, so no two share a task.
COPY_TASK_BYTES = 128 << 20

# The names adopt_copy gives the files it moves into a table's folder.
_ADOPTED = re.compile(r"part-\d{5}-[0-9a-f]{32}\.zstd\.parquet")


def _delete_all(target: str, classic: bool) -> str:
    """``DELETE`` of every row; on the embedded engine with a predicate true for every row, which its
    commit shows in ``operationParameters`` as pg2delta's (its SQL commits carry no user metadata:
    pg2delta.lake.foreign)."""
    return f"DELETE FROM {target}" + ("" if classic else f" WHERE {TRUNCATE_PREDICATE}")




def creating_table(writer: Any, schema: Any, *, deletion_vectors: bool = False, features: DeltaFeatures = NO_FEATURES) -> Any:
    """``writer`` (of a Delta table that does not exist yet) with :func:`stats_properties`, with
    :data:`DELETION_VECTORS` when ``deletion_vectors``, and with the table's configured ``features``
    (:func:`pg2delta.lake.engine_features.creating`)."""
    for key, value in stats_properties(schema, features.partition_by).items():
        writer = writer.option(key, value)
    if deletion_vectors:
        writer = writer.option(DELETION_VECTORS, "true")
    return creating(writer, features)


class TableStats(TableFeatures):
    """Which columns an existing table keeps Delta statistics of (:func:`stats_properties`)."""

    def enable_deletion_vectors(self, uri: str) -> bool:
        """Make the existing table use deletion vectors (:data:`DELETION_VECTORS`, one commit that
        upgrades its protocol: readers without the feature can no longer read it) where this engine
        creates tables with them (:attr:`deletion_vectors`, unless the config says otherwise).
        True when it changed."""
        if not self.deletion_vectors:
            return False
        if property_on(metadata_at(self.lake, uri), DELETION_VECTORS):
            return False
        self._set_properties(uri, {DELETION_VECTORS: "true"})
        log.info("%s uses deletion vectors from now on", uri)
        return True

    def keep_stats_of(self, uri: str, schema: Any = None, exclude: Collection[str] = ()) -> bool:
        """Make the existing table keep statistics of the columns :func:`stats_properties` names for
        ``schema`` (its schema from the next commit on; default the table's own, for a table an
        earlier version created, which keeps them of every column) that it has now, in one commit
        when they differ. Columns ``schema`` adds get none (Delta refuses to name a column the
        table does not have yet), as columns added by a schema merge; nor do its partition columns
        and ``exclude`` (the ones it is about to be partitioned by). True when it changed."""
        from pyspark.sql.types import StructType

        try:
            current = self.spark.read.format("delta").load(uri).schema
        except Exception as exc:
            raise LakeError(f"cannot read the schema of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        now = set(current.fieldNames())
        schema = current if schema is None else StructType([f for f in schema.fields if f.name in now])
        want = stats_properties(schema, {*exclude, *self.partition_columns(uri)})
        have = self.table_properties(uri)
        if all(have.get(k) == v for k, v in want.items()) and not (INDEXED_COLUMNS in want and have.get(STATS_COLUMNS)):
            return False
        try:
            if self.classic:
                sets = ", ".join(f"'{k}' = '{v}'" for k, v in want.items())
                self._sql(f"ALTER TABLE {self.target(uri)} SET TBLPROPERTIES ({sets})", f"ALTER TABLE {uri}")
                if INDEXED_COLUMNS in want and STATS_COLUMNS in have:
                    self._sql(f"ALTER TABLE {self.target(uri)} UNSET TBLPROPERTIES ('{STATS_COLUMNS}')", f"ALTER TABLE {uri}")
            else:
                # pysail has no ALTER TABLE; an empty list of columns means none to it and to delta-rs.
                props = dict(want, **({STATS_COLUMNS: ""} if INDEXED_COLUMNS in want and STATS_COLUMNS in have else {}))
                self._delta_rs(uri).alter.set_table_properties(props, commit_properties=self._marked())
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot set the statistics columns of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        log.info("%s keeps statistics of %s", uri, want.get(STATS_COLUMNS) or "no column")
        return True


def _save_file_per_task(writer: Any, uri: str, spark: Any) -> None:
    """``writer.save(uri)``; on Apache Spark (``spark``, a classic session; None elsewhere) its reads
    of staged Parquet (a copy's files, each one key range in key order, pg2delta.copy.staging) take
    each file whole into a task of its own, so that the table's files written from them keep their
    key ranges apart: by default Spark packs small files into one task, largest first."""
    if spark is None:
        writer.save(uri)
        return
    settings = {"spark.sql.files.maxPartitionBytes": str(COPY_TASK_BYTES), "spark.sql.files.openCostInBytes": str(COPY_TASK_BYTES)}
    before = {k: spark.conf.get(k, None) for k in settings}
    for k, v in settings.items():
        spark.conf.set(k, v)
    try:
        writer.save(uri)
    finally:
        for k, v in before.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


def _with_kept(writes: DeltaWrites, uri: str, df: Any, keep: Any, views: list[str]) -> Any:
    """``df`` (a table's copy) and the rows of the Delta table at ``uri`` that stay beside it (soft
    deletes' rows, pg2delta.apply.rowmeta.KeptRows): ``keep(table view, copy view, table columns)``
    is their Spark SQL, conformed here to ``df``'s columns and types (a column the table lacks:
    NULL); ``df`` alone when ``keep`` is None or there is no table. ``views``: the temporary views
    made (see :func:`_temp_views`)."""
    if keep is None or writes.lake.delta_version(uri) is None:
        return df
    spark = writes.spark
    table = spark.read.format("delta").load(uri)
    names = [f"pg2delta_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    table.createOrReplaceTempView(names[0])
    df.createOrReplaceTempView(names[1])
    views.extend(names)
    kept = spark.sql(keep(names[0], names[1], table.columns))
    have = set(kept.columns)
    return df.unionByName(kept.selectExpr(*(
        f"CAST({quote(f.name) if f.name in have else 'NULL'} AS {f.dataType.simpleString()}) AS {quote(f.name)}"
        for f in df.schema.fields
    )))


@contextlib.contextmanager
def _temp_views(spark: Any) -> Iterator[list[str]]:
    """A list to name temporary views in, each dropped at the end (once what reads them is written)."""
    views: list[str] = []
    try:
        yield views
    finally:
        for name in views:
            spark.catalog.dropTempView(name)


def _replace(writes: DeltaWrites, uri: str, staged_dir: str, keep: Any) -> None:
    """One attempt of :meth:`DeltaWrites.replace_table`."""
    with _temp_views(writes.spark) as views:
        try:
            df = _with_kept(writes, uri, writes.spark.read.parquet(staged_dir), keep, views)
            writer = writes.delta_writer(df, "overwrite").option("overwriteSchema", "true")
            clustered: tuple[str, ...] = ()
            if writes.lake.delta_version(uri) is None:
                writer = writes.new_table_writer(writer, df, uri)
            else:  # written whole: partitioned as configured now
                writes.check_features(uri)
                clustered = writes.clustering_columns(uri)
                parts = DeltaFeatures(partition_by=writes.features(uri).partition_by)
                writes.keep_stats_of(uri, df.schema, exclude=parts.partition_by)
                writer = creating(writer, parts)
            _save_file_per_task(writer, uri, writes.spark if writes.classic else None)
            writes.keep_clustered(uri, clustered)  # Delta's overwrite forgets the clustering columns
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot write {uri} from {staged_dir}: {' '.join(str(exc).split())[:500]}") from exc


def _add_columns(writes: DeltaWrites, uri: str, df: Any, staged: str, added: Sequence[str]) -> None:
    """Add the columns ``added`` of ``df`` (no rows of ``staged``) to the existing Delta table at
    ``uri``: a ``mergeSchema`` append. pysail 0.7.2 commits nothing there when the table has a NOT NULL column
    (a keyless table's position columns, ``_pg2delta_lsn`` and ``_pg2delta_pos``): the next MERGE
    then failed, every run after it too (found by ``make soak``: a column added to pgbench_history).
    So on the embedded engine the columns still missing after it are added by delta-rs, in one
    metadata-only commit marked as pg2delta's."""
    writes.delta_writer(df, "append").option("mergeSchema", "true").save(uri)
    if not writes.classic:
        import pyarrow.dataset as ds
        from deltalake import Schema

        table = writes._delta_rs(uri)
        have = {f.name for f in table.schema().fields}
        arrow = ds.dataset(writes.lake.fs_path(staged), filesystem=writes.lake.fs, format="parquet").schema
        missing = [f.with_nullable(True) for f in arrow if f.name in added and f.name not in have]
        if missing:
            table.alter.add_columns(
                list(Schema.from_arrow(pa.schema(missing)).fields),
                commit_properties=writes._marked(),
            )
    log.info("added columns %s to %s", list(added), uri)


def create_empty(writes: DeltaWrites, uri: str, df: Any) -> None:
    """Create the Delta table at ``uri`` with the columns of ``df`` and no rows, with its configured
    features (:func:`creating_table`), through ``writes`` (the engine). A clustered one
    (``cluster_by``, Apache Spark) is a ``CREATE TABLE ... CLUSTER BY ... AS SELECT`` of no rows:
    Delta's DataFrame writer cannot cluster (Delta 3.3's has no ``clusterBy``, Delta 4.0 ignores
    Spark 4's). Delta clusters only by columns with statistics (:func:`stats_columns`): another is
    refused first."""
    features, empty = writes.features(uri), df.limit(0)
    if not features.cluster_by:
        creating_table(writes.delta_writer(empty, "append"), empty.schema, deletion_vectors=writes.deletion_vectors,
                       features=features).save(uri)
        return
    with_stats = stats_columns(empty.schema)
    unfit = [c for c in features.cluster_by if c not in with_stats]
    if not writes.classic or unfit:
        raise LakeError(
            f"cannot create {uri} clustered by ({', '.join(features.cluster_by)}): "
            + ("the embedded engine (pysail) cannot write clustered tables" if not writes.classic else
               f"{', '.join(unfit)} has no statistics (Delta clusters by integer, decimal, string, date or "
               "timestamp columns among the first 32, or is not a column of the table)")
            + "; change cluster_by; nothing was written"
        )
    props = {**stats_properties(empty.schema), **({DELETION_VECTORS: "true"} if writes.deletion_vectors else {}), **features.props}
    view = f"pg2delta_new_{uuid.uuid4().hex[:12]}"
    with _temp_views(writes.spark) as views:
        empty.createOrReplaceTempView(view)
        views.append(view)
        writes._sql(
            f"CREATE TABLE {writes.target(uri)} USING DELTA CLUSTER BY ({', '.join(quote(c) for c in features.cluster_by)}) "
            f"TBLPROPERTIES ({', '.join(f'{quote_text(k)} = {quote_text(v)}' for k, v in props.items())}) AS SELECT * FROM {view}",
            f"CREATE TABLE {uri} CLUSTER BY ({', '.join(features.cluster_by)})",
        )
    log.info("created delta table %s clustered by (%s)", uri, ", ".join(features.cluster_by))


class DeltaWrites(Commits, TableStats):
    """What the engine commits to Delta tables (reads, for a copy as of a version, included)."""

    def ensure_table(self, uri: str, staged: str, columns: Sequence[str], current: Collection[str] | None = None) -> bool:
        """Create the Delta table, or add columns it lacks, with the schema of ``columns`` of ``staged``.

        ``current``: the table's columns when the caller knows them (then no read, a Spark job on
        Apache Spark, when it has them all). Returns True when the table's schema changed."""
        self.check_features(uri)
        existing = self.lake.delta_version(uri)
        try:
            if existing is not None and current is None:
                current = set(self.spark.read.format("delta").load(uri).columns)
            if existing is not None and not set(columns) - set(current or ()):
                return False
            df = self.read_staged(staged).select(*[quote(c) for c in columns]).limit(0)
            if existing is None:
                create_empty(self, uri, df)
                log.info("created delta table %s", uri)
                return True
            _add_columns(self, uri, df, staged, sorted(set(columns) - set(current or ())))
            return True
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot create or widen delta table {uri}: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}") from exc

    def rewrite(
        self, uri: str, casts: dict[str, str], *, drop: Sequence[str] = (), fill: pa.Table | None = None
    ) -> None:
        """Rewrite the Delta table with the columns in ``casts`` cast to wider Spark types, without ``drop``,
        and with every row holding the values of the one row of ``fill`` in its columns (added at the
        end when the table lacks them, replaced when it has them).

        One commit (an overwrite with ``overwriteSchema``) that both Apache Spark with delta-spark
        and pysail accept; pysail has no ``ALTER TABLE``, and Delta's in-place type widening needs a
        table feature that not every reader supports. Earlier versions stay readable (time travel).
        """
        self.check_features(uri)
        staged = self.lake.stage(fill, f"fill-{uuid.uuid4().hex}") if fill is not None else None
        filled = list(fill.column_names) if fill is not None else []
        try:
            df = self.spark.read.format("delta").load(uri)
            cols = [
                f"CAST({quote(c)} AS {casts[c]}) AS {quote(c)}" if c in casts else quote(c)
                for c in df.columns
                if c not in drop and c not in filled
            ]
            out = df.selectExpr(*cols)
            if staged is not None:
                # One row: every row of the table gets its values.
                order = [c for c in df.columns if c not in drop] + [c for c in filled if c not in df.columns]
                out = out.crossJoin(self.spark.read.parquet(staged)).selectExpr(*[quote(c) for c in order])
            self.keep_stats_of(uri, out.schema)  # a column widened to a float keeps none
            clustered = self.clustering_columns(uri)
            self.delta_writer(out, "overwrite").option("overwriteSchema", "true").save(uri)
            self.keep_clustered(uri, clustered)  # Delta's overwrite forgets the clustering columns
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot rewrite {uri} with new column types or values: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            if staged is not None:
                self.lake.unstage(staged)
        log.info(
            "rewrote %s: wider columns %s, dropped columns %s, columns set in every row %s",
            uri, ", ".join(f"{c} {t}" for c, t in sorted(casts.items())) or "none", ", ".join(drop) or "none",
            ", ".join(filled) or "none",
        )

    def merge(
        self, uri: str, staged: str, statement_for: Any, *, txn: Txn | None = None, rows: int | None = None
    ) -> None:
        """Run the MERGE built by ``statement_for(target, source_view)`` (or the append of an
        :class:`pg2delta.lake.engine_session.AppendRows` it returns) with ``staged`` as the source.

        With ``txn``, Delta skips the MERGE when the table already committed that transaction
        (where the engine supports it, :attr:`idempotent_writes`). ``rows``: how many rows ``staged``
        holds, when known (see :meth:`pg2delta.lake.engine_commits.Commits._commit`).
        """
        view = f"pg2delta_src_{uuid.uuid4().hex[:12]}"
        try:
            self.read_staged(staged).createOrReplaceTempView(view)
        except Exception as exc:
            raise LakeError(f"cannot read staged changes {staged}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            with self._source_as_is():
                self._commit(uri, view, statement_for(self.target(uri), view), f"MERGE into {uri}", txn, rows=rows)
        finally:
            try:
                self.spark.catalog.dropTempView(view)
            except Exception:
                log.debug("could not drop temp view %s", view)

    def delete_where(self, uri: str, condition: str) -> None:
        """``DELETE FROM`` the table the rows matching the Spark SQL ``condition`` (one commit)."""
        self._sql(f"DELETE FROM {self.target(uri)} WHERE {condition}", f"DELETE FROM {uri}")

    def replace_table(self, uri: str, staged_dir: str, keep: Any = None) -> None:
        """Make the Delta table at ``uri`` hold exactly the Parquet files under ``staged_dir`` (and the
        existing rows ``keep`` keeps, see :func:`_with_kept`), in one commit. The table is created when
        missing; an existing one is overwritten (schema included), so readers see either the old table
        or the whole new one, never part of it. Made again, as a run's commits are
        (:func:`pg2delta.lake.conflicts.committing`), when another writer's commit met it: the staged
        files are still there and the rows kept are read again from the table as it is then."""
        committing(self.lake, uri, f"the copy's commit to {uri}", lambda: _replace(self, uri, staged_dir, keep))

    def adopt_copy(self, uri: str, staged_dir: str, schema: pa.Schema) -> bool:
        """Make the Parquet files under ``staged_dir`` (a table's copy, written with
        :func:`copy_file_options` and ``schema``) version 0 of the new Delta table at ``uri`` without
        rewriting a row: they move into the table's folder and delta-rs converts it (Delta's
        ``CONVERT TO DELTA``: one commit adding the files, their statistics read from the footers)
        with :func:`stats_properties`.

        Only where the files are this process's own (the embedded engine, a lake on the local
        filesystem) and nothing is at ``uri`` yet; returns False, having done nothing, otherwise
        (then :meth:`replace_table` writes the table). Files an earlier copy moved there before it
        died, without its commit, are removed first. Not made again on a failure, as
        :meth:`replace_table` is: no other writer's commit can meet the first version of a table, no
        object store throttles a local disk, and the staged files are gone once moved (the next
        ``bootstrap`` or ``resync`` stages the table anew: ``copy_adopt_moved``).
        """
        if not self.embedded or not isinstance(self.lake.fs, pafs.LocalFileSystem) or self.features(uri) != NO_FEATURES:
            return False
        from deltalake import convert_to_deltalake

        fs = self.lake.fs
        folder = self.lake.fs_path(uri)
        try:
            there = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
            if any(i.type != pafs.FileType.File or not _ADOPTED.fullmatch(i.base_name) for i in there):
                return False  # a Delta table, or files that are not ours
            for info in there:
                fs.delete_file(info.path)
            staged = fs.get_file_info(pafs.FileSelector(self.lake.fs_path(staged_dir)))
            files = sorted(i.path for i in staged if i.type == pafs.FileType.File and i.base_name.endswith(".parquet"))
            fs.create_dir(folder, recursive=True)
            tag = uuid.uuid4().hex
            for n, path in enumerate(files):
                fs.move(path, f"{folder}/part-{n:05d}-{tag}.zstd.parquet")
            fault_point("copy_adopt_moved")  # the files are in the table's folder, no Delta log says so
            convert_to_deltalake(folder, mode="error", configuration=stats_properties(schema))
        except Exception as exc:
            raise LakeError(f"cannot commit the copy of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        log.info("committed the copy's %d file(s) as version 0 of %s", len(files), uri)
        if self.deletion_vectors:
            # delta-rs's conversion cannot turn them on (its protocol upgrade adds a reader feature
            # Delta 3.3 refuses): a commit of their own, as maintain makes for an older table.
            try:
                self.enable_deletion_vectors(uri)
            except LakeError as exc:
                log.warning("%s: deletion vectors not turned on (%s); pg2delta maintain turns them on", uri, exc)
        return True

    def delete_all(self, uri: str, *, txn: Txn | None = None) -> None:
        self.check_features(uri)
        self._committed(uri, _delete_all(self.target(uri), self.classic), f"DELETE FROM {uri}", txn)

    def append(self, uri: str, table: pa.Table, *, fill_missing: bool = False, txn: Txn | None = None) -> None:
        """Append ``table`` to the Delta table at ``uri`` (created if missing; new columns added).

        ``fill_missing``: columns of the table that ``table`` lacks are written as NULL (pysail
        refuses an append without them). ``txn``: skipped by Delta when already committed.
        """
        staged = self.lake.stage(table, f"append-{uuid.uuid4().hex}")
        try:
            self.append_staged(uri, staged, fill_missing=fill_missing, txn=txn)
        finally:
            self.lake.unstage(staged)

    def append_log_rows(self, uri: str, table: pa.Table) -> None:
        """Append ``table``, rows of a log of pg2delta's own, to the Delta table at ``uri`` in one
        commit, as :meth:`append` would: by delta-rs on the embedded engine (:func:`_append_by_delta_rs`)."""
        if self.classic or self.lake.delta_version(uri) is None:
            self.append(uri, table)
        else:
            _append_by_delta_rs(self, uri, table)

    def append_staged(self, uri: str, staged: str, *, fill_missing: bool = False, txn: Txn | None = None) -> None:
        """:meth:`append` of the staged file or directory ``staged`` (schemas merged), retried as :meth:`_commit` is."""
        committing(self.lake, uri, f"append to {uri}", lambda: self._append_once(uri, staged, fill_missing, txn))

    def _append_once(self, uri: str, staged: str, fill_missing: bool, txn: Txn | None) -> None:
        try:
            df = self.read_staged(staged) if staged.endswith(".parquet") else self.spark.read.option("mergeSchema", "true").parquet(staged)
            exists = self.lake.delta_version(uri) is not None
            if fill_missing and exists:
                from pyspark.sql import functions as F

                have = set(df.columns)
                for f in self.spark.read.format("delta").load(uri).schema.fields:
                    if f.name not in have:
                        df = df.withColumn(f.name, F.lit(None).cast(f.dataType))
            writer = self.delta_writer(df, "append").option("mergeSchema", "true")
            if not exists:
                writer = creating_table(writer, df.schema)
            self.with_txn(writer, txn).save(uri)
        except Exception as exc:
            raise LakeError(f"cannot append to {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def merge_from_copy(
        self, uri: str, staged_dir: str, extra: Sequence[str], statement_for: Any, *, internal: Collection[str] = ()
    ) -> None:
        """MERGE the rows of the Parquet files under ``staged_dir`` (a table's copy), with the
        ``extra`` SQL expressions as further columns, into ``uri`` (created, or widened with the
        columns it lacks, first; ``internal`` columns of the source are not the table's):
        ``statement_for(target, source_view, columns)`` builds the statement."""
        view = f"pg2delta_copy_{uuid.uuid4().hex[:12]}"
        try:
            df = self.spark.read.option("mergeSchema", "true").parquet(staged_dir).selectExpr("*", *extra)
            columns = [c for c in df.columns if c not in internal]
            empty = df.select(*[df[c] for c in columns]).limit(0)
            if self.lake.delta_version(uri) is None:
                create_empty(self, uri, empty)
            elif set(columns) - set(self.spark.read.format("delta").load(uri).columns):
                self.delta_writer(empty, "append").option("mergeSchema", "true").save(uri)
            df.createOrReplaceTempView(view)
        except Exception as exc:
            raise LakeError(f"cannot stage the copy for {uri}: {' '.join(str(exc).split())[:500]}") from exc
        try:  # made again when another writer's commit met it, as a run's MERGE is
            self._committed(uri, statement_for(self.target(uri), view, columns), f"MERGE into {uri}", None)
        finally:
            try:
                self.spark.catalog.dropTempView(view)
            except Exception:
                log.debug("could not drop temp view %s", view)

    def copy_table(self, source: str, version: int, target: str, *, creator: Any = None) -> None:
        """Write ``source`` as of ``version`` as a new table ``target``, as ``creator`` (its lake's engine) creates it."""
        try:
            df = self._read_version(source, version)
            (creator or self).new_table_writer(self.delta_writer(df, "append"), df, target).save(target)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(
                f"cannot copy {source} at version {version} to {target}: {' '.join(str(exc).split())[:500]}"
            ) from exc


def _append_by_delta_rs(writes: DeltaWrites, uri: str, table: pa.Table) -> None:
    """:meth:`DeltaWrites.append_log_rows` on the embedded engine: ``table`` appended to the
    existing Delta table at ``uri`` by delta-rs (new columns added), marked as pg2delta's, in one
    commit, retried as :meth:`DeltaWrites.append_staged` is.

    A run appends to the applied log after every window, and pysail's commit reads the log's
    checkpoint again and again, which a week of five-minute runs fills with tombstones (about
    6,000 removed files): measured on the applied log after 2,000 runs, a one-row append took
    delta-rs 0.050 s against 0.015 s on a fresh log of the same files, and pysail's one-row
    overwrite of that lake's table 0.126 s against 0.035 s (make bench-year's engine floor). A
    commit whose version is a multiple of :data:`LOG_CHECKPOINT_INTERVAL` writes a checkpoint, as
    pysail's and Apache Spark's do (delta-rs's own default is every 100), after the commit: one that
    fails is a warning, not the run's failure (the window is logged; the next checkpoint, or
    maintenance's, covers these commits too)."""
    from deltalake import DeltaTable, write_deltalake

    def attempt() -> DeltaTable:
        try:
            log_table: DeltaTable = writes._delta_rs(uri)
            # No commit retry of delta-rs's own: at a version found taken it would append again on
            # top, twice if the taken version is this append's with its answer lost (pg2delta.errors.
            # _COMMIT_TAKEN); committing() decides by what landed, as for the engine's appends.
            marked = writes._marked()
            marked.max_commit_retries = 0
            write_deltalake(log_table, table, mode="append", schema_mode="merge", commit_properties=marked)
            return log_table
        except Exception as exc:
            raise LakeError(f"cannot append to {uri}: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}") from exc
    log_table = committing(writes.lake, uri, f"append to {uri}", attempt)
    version = log_table.version()
    if version % LOG_CHECKPOINT_INTERVAL == 0:
        try:
            log_table.create_checkpoint()
        except Exception as exc:  # any failure of delta-rs's: the append stands
            log.warning("could not write the checkpoint of %s at version %d (%s: %s); the next one covers it",
                        uri, version, type(exc).__name__, " ".join(str(exc).split())[:300])
