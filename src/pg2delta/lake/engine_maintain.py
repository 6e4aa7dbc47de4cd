"""Table maintenance through the engine: compaction, vacuum, checkpoints.

The one place where the engines differ most: Apache Spark with delta-spark has Delta's
``OPTIMIZE`` and ``VACUUM`` and writes checkpoints itself; pysail has none of these, so they
come from delta-rs, Delta's Rust implementation, on the same files. See :mod:`pg2delta.maintain`
for what runs them and when.
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from pg2delta.errors import LakeError
from pg2delta.lake.engine_session import EngineSession
from pg2delta.lake.sql import quote

# The lake layer (engine.py and its parts) logs under one name, as when it was one module.
log = logging.getLogger("pg2delta.lake.engine")

# The share of a table's key space that more than one file covers (overlapping) past which
# compaction sorts the table by its key (DeltaMaintenance.compact).
OVERLAP_SHARE = 0.1


def overlapping(table: Any, key: str) -> float:
    """The share of the key space of ``table``'s files (a delta-rs ``DeltaTable``; each file's range
    of the integer column ``key``, from the Delta log's statistics) that another file's range
    covers too; 0 for a key that is not an integer or without statistics. A few keys shared at the
    edges (as Delta's ``ZORDER BY`` leaves) count for little; files that each span the whole
    range, for nearly all."""
    adds = pa.table(table.get_add_actions(flatten=True))
    if f"min.{key}" not in adds.column_names or not pa.types.is_integer(adds.schema.field(f"min.{key}").type):
        return 0.0
    spans = sorted(
        (int(lo), int(hi))
        for lo, hi in zip(adds.column(f"min.{key}").to_pylist(), adds.column(f"max.{key}").to_pylist(), strict=True)
        if lo is not None and hi is not None
    )
    total = sum(hi - lo + 1 for lo, hi in spans)
    shared, reach = 0, None
    for lo, hi in spans:
        if reach is not None and lo <= reach:
            shared += min(hi, reach) - lo + 1
        reach = hi if reach is None else max(reach, hi)
    return shared / max(1, total)


# Delta's deletion vectors (Delta 3.1+ on Apache Spark for MERGE, UPDATE and DELETE): a MERGE marks
# the rows it replaces or deletes in a small file beside each data file it touches and writes only
# the new rows, instead of rewriting every row of those files. Readers must support the table
# feature (docs/concepts/deletion-vectors.md names those that do not).
DELETION_VECTORS = "delta.enableDeletionVectors"


class DeltaMaintenance(EngineSession):
    """Compaction, vacuum and checkpoints of a Delta table, on whichever engine runs."""

    def compact(self, uri: str, *, target_size: int = 0, key: str | None = None) -> None:
        """Rewrite the table's small files into large ones, in one commit that changes no row
        (``dataChange = false``): Delta's ``OPTIMIZE`` on Apache Spark, delta-rs's compaction elsewhere.

        With ``key`` (the table's first key column), a table whose files' key ranges overlap
        (:func:`overlapping`: the embedded engine writes a rewrite's rows in no order) is rewritten
        in key order instead, ``ZORDER BY`` that one column (a sort): each file then holds a key
        range apart from the others, and a window rewrites the files of its keys only
        (pg2delta.lake.engine_commits.key_ranges).

        A table with liquid clustering (Apache Spark) is compacted by a plain ``OPTIMIZE``, which
        clusters the files not clustered yet by its clustering columns (Delta refuses ``ZORDER BY``
        there)."""
        try:
            table = self._delta_rs(uri)
            clustered = "clustering" in (table.protocol().writer_features or [])
            if clustered and not self.classic:
                raise LakeError(f"cannot compact {uri}: it has liquid clustering, which the embedded engine cannot write "
                                "(pysail and delta-rs refuse to commit to it): run pg2delta maintain on Apache Spark")
            order = key is not None and not clustered and overlapping(table, key) > OVERLAP_SHARE
            if self.classic:
                if target_size:
                    self.spark.conf.set("spark.databricks.delta.optimize.maxFileSize", str(target_size))
                zorder = f" ZORDER BY ({quote(key)})" if order and key is not None else ""
                self._sql(f"OPTIMIZE {self.target(uri)}{zorder}", f"OPTIMIZE {uri}")
            elif order and key is not None:
                table.optimize.z_order([key], target_size=target_size or None, commit_properties=self._marked())
            else:
                table.optimize.compact(target_size=target_size or None, commit_properties=self._marked())
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot compact {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def vacuum(self, uri: str, *, retention_hours: int) -> int:
        """Remove the table's files that no version younger than ``retention_hours`` needs; returns
        how many files went, or -1 when the engine does not say (Apache Spark on object storage:
        see :meth:`_vacuumed`)."""
        try:
            if self.classic:
                before = self.lake.delta_version(uri)
                # Delta refuses a retention under 7 days unless told: the config says what to keep.
                self.spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
                # VACUUM lists the table's folders in parallelPartitionDiscovery.parallelism tasks,
                # 10,000 unless set: 20 s of empty tasks per table on a small cluster (measured on
                # local[2]). The cluster's cores are enough unless the session says otherwise.
                listing = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
                if self.remote:  # a Spark Connect server: its settings say what its cores are
                    cores = self.spark.conf.get("spark.default.parallelism", None)
                    if cores is not None and self.spark.conf.get(listing, None) is None:
                        self.spark.conf.set(listing, cores)
                elif not self.spark.sparkContext.getConf().contains(listing):
                    self.spark.conf.set(listing, str(max(self.spark.sparkContext.defaultParallelism, 1)))
                self._sql(f"VACUUM {self.target(uri)} RETAIN {retention_hours} HOURS", f"VACUUM {uri}")
                return self._vacuumed(uri, before)
            removed = self._delta_rs(uri).vacuum(
                retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False,
                commit_properties=self._marked(),
            )
            return len(removed)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot vacuum {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def _vacuumed(self, uri: str, before: int | None) -> int:
        """How many files the ``VACUUM`` of ``uri`` that followed its version ``before`` removed, from
        the ``VACUUM END`` commit Delta on Apache Spark writes on the file systems it logs vacuums
        on (local, HDFS, Azure and Google storage; not S3, unless
        ``spark.databricks.delta.vacuum.logging.enabled`` says so); -1 without one."""
        after = self.lake.delta_version(uri)
        if after is None or before is None or after <= before:
            return -1
        history = self._sql(f"DESCRIBE HISTORY {self.target(uri)} LIMIT {after - before}", f"DESCRIBE HISTORY {uri}")
        for commit in history:  # the commits since ``before``, newest first
            metrics = dict(commit["operationMetrics"] or {})
            if commit["operation"] == "VACUUM END" and "numDeletedFiles" in metrics:
                return int(metrics["numDeletedFiles"])
        return -1

    def checkpoint(self, uri: str) -> bool:
        """Write a checkpoint of the table's log where the engine does not (Apache Spark writes one
        every ten commits itself, and pysail too, but only in the windows' commits), then remove
        the log's commits older than ``delta.logRetentionDuration`` (30 days unless the table says)
        that the checkpoint makes unneeded, as Delta on Apache Spark does when it checkpoints:
        else a year of five-minute runs leaves 105,000 commit files that every reader lists.
        True when a checkpoint was written."""
        if self.classic:
            return False
        try:
            table = self._delta_rs(uri)
            table.create_checkpoint()
            table.cleanup_metadata()
            # The hint it leaves (_last_checkpoint) stays: without it every later load of the table
            # lists and replays more of the log (bench-year). A time travel below it that fails
            # drops it first (DeltaReads._read_version); the engine's next checkpoint writes it again.
            return True
        except Exception as exc:
            raise LakeError(f"cannot write a checkpoint of {uri}: {' '.join(str(exc).split())[:500]}") from exc
