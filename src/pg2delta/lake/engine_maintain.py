"""Table maintenance through the engine: compaction, vacuum, checkpoints.

The one place where the engines differ most: Apache Spark with delta-spark has Delta's
``OPTIMIZE`` and ``VACUUM`` and writes checkpoints itself; pysail has none of these, so they
come from delta-rs, Delta's Rust implementation, on the same files. See :mod:`pg2delta.maintain`
for what runs them and when.
"""

from __future__ import annotations

from pg2delta.errors import LakeError
from pg2delta.lake.engine_session import EngineSession


class DeltaMaintenance(EngineSession):
    """Compaction, vacuum and checkpoints of a Delta table, on whichever engine runs."""

    def compact(self, uri: str, *, target_size: int = 0) -> None:
        """Rewrite the table's small files into large ones, in one commit that changes no row
        (``dataChange = false``): Delta's ``OPTIMIZE`` on Apache Spark, delta-rs's compaction elsewhere."""
        try:
            if self.classic:
                if target_size:
                    self.spark.conf.set("spark.databricks.delta.optimize.maxFileSize", str(target_size))
                self._sql(f"OPTIMIZE {self.target(uri)}", f"OPTIMIZE {uri}")
            else:
                self._delta_rs(uri).optimize.compact(target_size=target_size or None)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot compact {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def vacuum(self, uri: str, *, retention_hours: int) -> int:
        """Remove the table's files that no version younger than ``retention_hours`` needs; returns
        how many files went (delta-rs) or -1 when the engine does not say (Apache Spark)."""
        try:
            if self.classic:
                # Delta refuses a retention under 7 days unless told: the config says what to keep.
                self.spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
                # VACUUM lists the table's folders in parallelPartitionDiscovery.parallelism tasks,
                # 10,000 unless set: 20 s of empty tasks per table on a small cluster (measured on
                # local[2]). The cluster's cores are enough unless the session says otherwise.
                listing = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
                if not self.spark.sparkContext.getConf().contains(listing):
                    self.spark.conf.set(listing, str(max(self.spark.sparkContext.defaultParallelism, 1)))
                self._sql(f"VACUUM {self.target(uri)} RETAIN {retention_hours} HOURS", f"VACUUM {uri}")
                return -1
            removed = self._delta_rs(uri).vacuum(
                retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False
            )
            return len(removed)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot vacuum {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def checkpoint(self, uri: str) -> bool:
        """Write a checkpoint of the table's log where the engine does not (Apache Spark writes one
        every ten commits itself); True when one was written."""
        if self.classic:
            return False
        try:
            self._delta_rs(uri).create_checkpoint()
            # Readers find it by listing the log; with the hint pysail could not read the versions
            # before it (pg2delta.lake.lake_files.Lake.drop_checkpoint_hint).
            self.lake.drop_checkpoint_hint(uri)
            return True
        except Exception as exc:
            raise LakeError(f"cannot write a checkpoint of {uri}: {' '.join(str(exc).split())[:500]}") from exc
