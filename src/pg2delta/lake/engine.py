"""Everything that touches Spark or Delta, behind one small class.

The rest of pg2delta never imports pyspark. Three engines, chosen in config:

* ``embedded`` (default): pysail, a Spark Connect server started in this process (no JVM);
* ``spark``: Apache Spark with delta-spark, a classic session (what ``spark-submit`` gives);
* ``connect``: a Spark Connect server at ``remote = "sc://host:port"``: Apache Spark's own with
  delta-spark (a driver that outlives the runs) gets Apache Spark's statements, another (pysail's)
  the embedded engine's (:func:`pg2delta.lake.engine_session.apache_spark` tells them apart).

Only APIs that pyspark 3.5 and 4.x share are used, and only SQL that both Apache Spark
with delta-spark and pysail accept: data reaches Spark as Parquet files read with
``spark.read.parquet`` (``createDataFrame`` from Arrow exists only from 4.0), tables are
created and widened with (empty) appends using ``mergeSchema`` (pysail has no
``ALTER TABLE ADD COLUMNS``), and every change lands through ``MERGE INTO delta.`path``` (on the
embedded engine, a window of many rows through an overwrite of its key range instead, see
:mod:`pg2delta.lake.engine_commits`).

The engine is one object, :class:`Engine`, made of parts that each hold one kind of work, in
modules next to this one:

* :mod:`pg2delta.lake.engine_session`: starting and stopping the session, per-thread sessions,
  SQL whose failures become :class:`LakeError`, Delta's idempotent writes, engine differences;
* :mod:`pg2delta.lake.engine_reads`: reads of Delta tables (schemas, rows, versions, time travel);
* :mod:`pg2delta.lake.engine_commits`: the commit of a window's final rows (MERGE, append, or the
  embedded engine's rewrite of their key range);
* :mod:`pg2delta.lake.engine_writes`: commits (create and widen, rewrite, MERGE, append, delete);
* :mod:`pg2delta.lake.engine_staged`: a spilled window's changes reduced and filled in the engine;
* :mod:`pg2delta.lake.engine_maintain`: compaction, vacuum and checkpoints (delta-rs on pysail);
* :mod:`pg2delta.lake.lake_files`: the lake's files through pyarrow alone (:class:`Lake`: Delta logs,
  staging), no engine.

Each part is a class over :class:`pg2delta.lake.engine_session.EngineSession` and :class:`Engine`
inherits them all, so the parts share one session (and its per-thread sessions) and callers keep
calling ``engine.merge(...)``; a part that needs another's methods inherits that part
(writes and the staged reduce read tables as of a version). Import what the rest of pg2delta
needs from here: ``Engine``, ``EngineConfig``, ``Lake``, ``Txn``. The parts log as
``pg2delta.lake.engine``, as the one module did.
"""

from __future__ import annotations

from typing import Any

from pg2delta.config import ENGINES, EngineConfig
from pg2delta.delta_features import DeltaFeatures
from pg2delta.lake.engine_commits import replaced_keys
from pg2delta.lake.engine_features import creating
from pg2delta.lake.engine_maintain import DeltaMaintenance
from pg2delta.lake.engine_session import (
    TXN_APP_ID,
    TXN_VERSION,
    AppendRows,
    MergeRows,
    Txn,
    open_session,
)
from pg2delta.lake.engine_staged import StagedReduce
from pg2delta.lake.engine_writes import DeltaWrites, create_empty, creating_table
from pg2delta.lake.lake_files import Lake

__all__ = ["ENGINES", "TXN_APP_ID", "TXN_VERSION", "AppendRows", "Engine", "EngineConfig", "Lake", "MergeRows", "Txn", "replaced_keys"]


class Engine(DeltaWrites, StagedReduce, DeltaMaintenance):
    """A SparkSession that applies staged changes to Delta tables: the parts above, on one session.

    Safe to use from several threads at once (see :class:`pg2delta.lake.engine_session.EngineSession`).
    """

    @classmethod
    def start(cls, config: EngineConfig, lake: Lake) -> Engine:
        """Start the engine ``config`` names (:func:`pg2delta.lake.engine_session.open_session`) on ``lake``."""
        opened = open_session(config)
        return cls(
            opened.spark, lake, stop=opened.stop, classic=opened.classic, embedded=opened.embedded,
            session_conf=opened.session_conf, deletion_vectors=config.deletion_vectors,
            remote=opened.remote, new_session=opened.new_session, lost=opened.lost,
        )

    def new_table_writer(self, writer: Any, df: Any, uri: str) -> Any:
        """What an append that creates a table (:mod:`pg2delta.lake.engine_commits`) sets: the
        statistics columns every table pg2delta creates has (:func:`pg2delta.lake.engine_writes.stats_properties`),
        on Apache Spark deletion vectors (:data:`pg2delta.lake.engine_maintain.DELETION_VECTORS`), and
        the table's configured features (:mod:`pg2delta.lake.engine_features`).

        A table with column mapping or liquid clustering is created empty first, in a commit of its
        own (:func:`pg2delta.lake.engine_writes.create_empty`): Delta 3.3 takes the first
        commit of a column-mapped table, holding rows, for a column rename, which it refuses on a
        table with a change data feed (``DELTA_BLOCK_COLUMN_MAPPING_AND_CDC_OPERATION``), and
        Delta's DataFrame writer cannot cluster a table. An overwrite into it forgets the clustering
        columns: its caller sets them again (:meth:`pg2delta.lake.engine_features.TableFeatures.keep_clustered`)."""
        features = self.features(uri)
        if not features.column_mapping and not features.cluster_by:
            return creating_table(writer, df.schema, deletion_vectors=self.deletion_vectors, features=features)
        create_empty(self, uri, df)
        return creating(writer, DeltaFeatures(partition_by=features.partition_by))

    def with_lake(self, lake: Lake, *, deletion_vectors: bool | None = None) -> Engine:
        """An engine on the same session writing another lake (its owner stops the session);
        ``deletion_vectors``: :attr:`EngineConfig.deletion_vectors` if not this engine's."""
        engine = Engine(
            self._main, lake, classic=self.classic, embedded=self.embedded, session_conf=self._session_conf,
            deletion_vectors=self.deletion_vectors if deletion_vectors is None else deletion_vectors,
            remote=self.remote, new_session=self._new_session, lost=self._lost,
        )
        engine.features_of = self.features_of
        return engine
