"""A spilled window's changes, reduced and filled inside the engine.

A window too large for memory reaches the lake as staged Parquet (see :mod:`pg2delta.window.spill`); the
engine then does in SQL what :mod:`pg2delta.apply.merge` does in Arrow for a small one: orders each
key's changes, fills unchanged TOAST values from earlier changes of the row or from the table,
and keeps one final row per key (:meth:`StagedReduce.merge_reduced`, then the MERGE) or every
change (:meth:`StagedReduce.stage_filled`, for the SCD2 history). Each step is written out as
Parquet and read back (:class:`_Steps`), so the next starts from files rather than a growing plan;
past :data:`REDUCE_BUCKET_ROWS` staged changes the reduce runs one hash bucket of the keys at a time.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from pg2delta.decode.changes import OP_COL, POS_COL
from pg2delta.decode.events import DELETED_COL
from pg2delta.errors import DataError, LakeError, Pg2DeltaError
from pg2delta.lake import staged_sql
from pg2delta.lake.engine_commits import Commits
from pg2delta.lake.engine_reads import names_then
from pg2delta.lake.engine_session import Txn
from pg2delta.lake.sql import quote

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")

# Staged changes per query of a bucketed reduce (StagedReduce.merge_reduced).
REDUCE_BUCKET_ROWS = 500_000


class StagedReduce(Commits):
    """The reduce of staged changes in the engine, and what is computed from them."""

    def merge_reduced(
        self,
        uri: str,
        changes_dir: str,
        statement_for: Any,
        *,
        work: str,
        key_names: Sequence[str],
        data_columns: Sequence[str],
        toast_columns: Sequence[str],
        lookup_version: int | None,
        nullable_keys: bool,
        optional: Collection[str] = (),
        txn: Txn | None = None,
        rows: int = 0,
        bucket_files: Sequence[Sequence[str]] = (),
        distinct_keys: bool = False,
    ) -> int:
        """Reduce the staged changes under ``changes_dir`` to one row per key in the engine and MERGE them
        (a spilled window, see :mod:`pg2delta.window.spill`); returns the number of rows merged.

        ``toast_columns``: the columns some change sent as unchanged TOAST; their values come from
        earlier changes of the row, else from the table at ``lookup_version``. ``work``: a name in the
        staging area for the intermediate results (removed here). ``rows``: how many changes are
        staged; past :data:`REDUCE_BUCKET_ROWS` the reduce runs as several queries, each over the keys
        of one hash bucket, so the engine's memory does not follow the window's size (not with
        unchanged TOAST, whose values follow a row through key changes, from one key to another).
        ``bucket_files``: the staged files of each bucket, when the driver wrote them in buckets of
        the key (pg2delta.apply.stage.key_buckets); each query then reads its bucket's files only,
        rather than every file through a hash filter. The one MERGE reads every bucket's rows.
        ``distinct_keys``: no key has more than one staged change (inserts only, under a key
        PostgreSQL keeps unique): the changes are the final rows, merged as they are, with no reduce.
        """
        steps = _Steps(self, work)
        buckets = 1 if toast_columns else len(bucket_files) or max(1, -(-rows // REDUCE_BUCKET_ROWS))
        try:
            if distinct_keys and not toast_columns:
                cols = [quote(c) for c in dict.fromkeys([*data_columns, OP_COL, POS_COL])]
                final = steps.view(self.spark.read.parquet(changes_dir).selectExpr(*cols))
                log.debug("%s: %d staged inserts of distinct keys, merged as they are", uri, rows)
                self._commit(uri, final, statement_for(self.target(uri), final), f"MERGE into {uri}", txn, rows=rows)
                return rows
            final = steps.filled(
                uri, changes_dir, key_names=key_names, data_columns=data_columns, toast_columns=toast_columns,
                lookup_version=lookup_version, nullable_keys=nullable_keys, optional=optional, every_row=False,
                buckets=buckets, bucket_files=bucket_files if buckets > 1 else (),
            )
            merged = int(self.spark.sql(f"SELECT count(*) AS n FROM {final}").collect()[0]["n"])
            log.debug("%s: %d rows to merge", uri, merged)
            self._commit(uri, final, statement_for(self.target(uri), final), f"MERGE into {uri}", txn, rows=merged)
            return merged
        except Pg2DeltaError:  # its own, and the commit's refusals (pg2delta.lake.conflicts: 21, 75) as they are
            raise
        except Exception as exc:
            raise LakeError(f"cannot reduce the staged changes of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            steps.close()

    def stage_filled(
        self,
        uri: str,
        changes_dir: str,
        then: Sequence[Any],
        summary: Any,
        *,
        out: str,
        work: str,
        key_names: Sequence[str],
        data_columns: Sequence[str],
        toast_columns: Sequence[str],
        lookup_version: int | None,
        nullable_keys: bool,
        optional: Collection[str] = (),
        truncates: Sequence[tuple[int, int]] = (),
    ) -> tuple[str, dict[str, Any]]:
        """Every staged change under ``changes_dir`` (a spilled window of the table at ``uri``) with its
        unchanged TOAST filled in the engine, as :meth:`merge_reduced` fills the final rows, then each
        of the SQL builders ``then`` (``view -> statement``) applied in turn, every result written to
        Parquet and read back; the last one is written to the staging area's ``out``. Returns its URI
        and the first row of ``summary(view of it)`` (a small aggregate). ``work`` as in :meth:`merge_reduced`;
        ``truncates``: (commit LSN, position) of the truncates among the changes (see
        :func:`pg2delta.lake.staged_sql.ordered_changes_sql`)."""
        steps = _Steps(self, work)
        try:
            current = steps.filled(
                uri, changes_dir, key_names=key_names, data_columns=data_columns, toast_columns=toast_columns,
                lookup_version=lookup_version, nullable_keys=nullable_keys, optional=optional, every_row=True,
                truncates=truncates,
            )
            target = self.lake.staging_uri(out)
            for n, build in enumerate(then):
                last = n == len(then) - 1
                current = steps.materialized(self.spark.sql(build(current)), f"then-{n}", target=target if last else None)
            rows = self.spark.sql(summary(current)).collect()
            return target, (rows[0].asDict() if rows else {})
        except (LakeError, DataError):
            raise
        except Exception as exc:
            raise LakeError(f"cannot compute from the staged changes of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            steps.close()


class _Steps:
    """The temporary views and intermediate Parquet results of a computation over staged changes
    (:meth:`StagedReduce.merge_reduced`, :meth:`StagedReduce.stage_filled`); :meth:`close` drops and removes them."""

    def __init__(self, engine: StagedReduce, work: str) -> None:
        self.engine = engine
        self.work = work
        self.views: list[str] = []

    def view(self, df: Any) -> str:
        name = f"pg2delta_{uuid.uuid4().hex[:12]}"
        df.createOrReplaceTempView(name)
        self.views.append(name)
        return name

    def materialized(self, df: Any, part: str, *, target: str | None = None) -> str:
        # Written out and read back: the next step starts from files, not from a growing plan.
        target = target or self.engine.lake.staging_uri(f"{self.work}/{part}")
        if not self.engine.stage_rows(df, target):
            return self.view(df)  # the plan itself, which yields no rows either
        return self.view(self.engine.spark.read.parquet(target))

    def filled(
        self,
        uri: str,
        changes_dir: str,
        *,
        key_names: Sequence[str],
        data_columns: Sequence[str],
        toast_columns: Sequence[str],
        lookup_version: int | None,
        nullable_keys: bool,
        optional: Collection[str],
        every_row: bool,
        truncates: Sequence[tuple[int, int]] = (),
        buckets: int = 1,
        bucket_files: Sequence[Sequence[str]] = (),
    ) -> str:
        """The view of the staged changes' final rows per key (``every_row``: of every change), their
        unchanged TOAST filled from earlier changes of the row, else from the table at ``lookup_version``;
        :class:`DataError` when neither has a value. ``buckets`` > 1 (no ``toast_columns``): computed
        one hash bucket of the keys at a time, each written out before the next starts."""
        spark = self.engine.spark
        if buckets > 1 and not toast_columns:
            return self._reduced_in_buckets(
                uri, changes_dir, key_names=key_names, data_columns=data_columns, nullable_keys=nullable_keys,
                optional=optional, every_row=every_row, truncates=truncates, buckets=buckets,
                bucket_files=bucket_files,
            )
        changes = self._soft(self.view(spark.read.parquet(changes_dir)), key_names, data_columns)
        ordered = self.view(spark.sql(staged_sql.ordered_changes_sql(changes, key_names, toast_columns, truncates)))
        chain = lake = None
        if toast_columns:
            chain = self._toast_chain(uri, ordered, key_names, toast_columns, every_row=every_row)
            lake = self._lake_values(uri, key_names, toast_columns, lookup_version)
        final_sql = staged_sql.final_source_sql(
            ordered, chain, lake, key_names, data_columns, toast_columns,
            nullable_keys=nullable_keys, optional=optional, every_row=every_row,
            nan_safe_keys=self.engine.nan_safe_keys(spark.table(changes).schema, key_names),
        )
        final = self.materialized(spark.sql(final_sql), "final")
        log.debug("%s: the staged changes with their unchanged TOAST filled", uri)
        if chain is not None:
            lost = spark.sql(f"SELECT {staged_sql.LAKE_KEY} FROM {final} WHERE {staged_sql.MISSING} LIMIT 1").collect()
            if lost:
                raise DataError(
                    f"cannot recover an unchanged TOAST value in {uri} (row {lost[0][0].asDict()}): the row is "
                    "neither in this window nor in the lake; run pg2delta bootstrap for this table "
                    "or set REPLICA IDENTITY FULL on it"
                )
        return final

    def _reduced_in_buckets(
        self,
        uri: str,
        changes_dir: str,
        *,
        key_names: Sequence[str],
        data_columns: Sequence[str],
        nullable_keys: bool,
        optional: Collection[str],
        every_row: bool,
        truncates: Sequence[tuple[int, int]],
        buckets: int,
        bucket_files: Sequence[Sequence[str]] = (),
    ) -> str:
        """:meth:`filled` without unchanged TOAST, one hash bucket of the keys at a time: the files
        of each of ``bucket_files``, else every staged file through a hash filter of the key."""
        engine, spark = self.engine, self.engine.spark
        by_key = ", ".join(quote(k) for k in key_names)
        source = spark.read.parquet(changes_dir)
        parts: list[str] = []
        last = ""
        for i in range(buckets):
            if bucket_files:
                if not bucket_files[i]:
                    continue
                changes = self.view(spark.read.parquet(*bucket_files[i]))
            else:
                changes = self.view(source.where(f"pmod(hash({by_key}), {buckets}) = {i}"))
            changes = self._soft(changes, key_names, data_columns)
            ordered = self.view(spark.sql(staged_sql.ordered_changes_sql(changes, key_names, (), truncates)))
            last = staged_sql.final_source_sql(
                ordered, None, None, key_names, data_columns, (),
                nullable_keys=nullable_keys, optional=optional, every_row=every_row,
            )
            target = engine.lake.staging_uri(f"{self.work}/final-{i:04d}")
            if self.engine.stage_rows(spark.sql(last), target):
                parts.append(target)
        log.debug("%s: the staged changes reduced in %d buckets", uri, buckets)
        return self.view(spark.read.parquet(*parts)) if parts else self.view(spark.sql(last))

    def _soft(self, changes: str, key_names: Sequence[str], data_columns: Sequence[str]) -> str:
        """``changes`` of a soft-delete table (``_pg2delta_deleted`` among ``data_columns``) with each
        delete's values (:func:`pg2delta.lake.staged_sql.soft_deletes_sql`); others as they are."""
        if DELETED_COL not in data_columns:
            return changes
        return self.view(self.engine.spark.sql(staged_sql.soft_deletes_sql(changes, key_names, data_columns)))

    def _toast_chain(
        self, uri: str, ordered: str, key_names: Sequence[str], toast_columns: Sequence[str], *, every_row: bool
    ) -> str:
        """The view of each change's unchanged TOAST values filled from earlier changes of the row,
        following it through key changes: resolved one step at a time (at most 64), each written out."""
        spark = self.engine.spark
        chain = self.materialized(
            spark.sql(staged_sql.toast_chain_sql(ordered, key_names, toast_columns, every_row=every_row)), "chain-0"
        )
        step = 0
        while spark.sql(f"SELECT 1 FROM {chain} WHERE {staged_sql.unresolved_sql(chain, toast_columns)} LIMIT 1").collect():
            step += 1
            if step > 64:
                raise LakeError(f"unchanged TOAST of {uri}: the chain of key changes did not resolve in 64 steps")
            chain = self.materialized(spark.sql(staged_sql.resolve_step_sql(chain, toast_columns)), f"chain-{step}")
        return chain

    def _lake_values(
        self, uri: str, key_names: Sequence[str], toast_columns: Sequence[str], lookup_version: int | None
    ) -> str | None:
        """The view of the table's keys and TOAST columns at ``lookup_version`` (a negative one: none
        to look at), each row marked present; None when there is no table."""
        engine = self.engine
        if (lookup_version is None or lookup_version >= 0) and engine.lake.delta_version(uri) is not None:
            table = engine.read_version(uri, lookup_version)
            present = set(table.columns)
            cols = [
                quote(c) if c == then else f"NULL AS {quote(c)}" if then is None else f"{quote(then)} AS {quote(c)}"
                for c, then in names_then(engine, uri, lookup_version, present, [*key_names, *toast_columns]).items()
            ]
            return self.view(table.selectExpr(*cols, f"true AS {staged_sql.PRESENT}"))
        return None

    def close(self) -> None:
        spark = self.engine.spark
        for name in self.views:
            try:
                spark.catalog.dropTempView(name)
            except Exception:
                log.debug("could not drop temp view %s", name)
        self.engine.lake.unstage_dir(self.work)
