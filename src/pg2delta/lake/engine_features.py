"""The Delta features of the tables pg2delta writes: what a new table is created with, and the
check of an existing one before the engine writes to it.

:mod:`pg2delta.delta_features` turns the configuration into a
:class:`~pg2delta.delta_features.DeltaFeatures` per table; the operation that owns the engine
tells it which table gets which (:attr:`TableFeatures.features_of`). A new table is created with
its properties (Change Data Feed, column mapping and any other ``delta.*``) and partition
columns. An existing one is checked once per engine before its first write (on Apache Spark only
when the configuration asks for features, through ``DESCRIBE DETAIL``; delta-rs elsewhere): a writer feature
this engine cannot write (:data:`pg2delta.delta_features.EMBEDDED_UNWRITABLE`), or
``delta.appendOnly``, is refused (exit 78) before anything is written; properties the
configuration asks for and the table lacks are set in one commit (``ALTER TABLE ... SET
TBLPROPERTIES``, on the embedded engine through a name in pysail's catalog); different partition columns
are left as they are, with a warning: they take effect when the table is written whole again
(``pg2delta resync``). Liquid clustering columns (Apache Spark) are set in place, one ``ALTER
TABLE ... CLUSTER BY`` commit that rewrites no file, on a table that is not partitioned; Delta
forgets them when a table is overwritten (measured on Delta 3.3 and 4.0), so they are set again
after each overwrite (:meth:`TableFeatures.keep_clustered`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pg2delta.delta_features import (
    APPEND_ONLY,
    CHANGE_DATA_FEED,
    COLUMN_MAPPING,
    COLUMN_MAPPING_PROTOCOL,
    EMBEDDED_UNWRITABLE,
    LOG_RETENTION,
    NO_FEATURES,
    DeltaFeatures,
    interval_hours,
    log_retention,
)
from pg2delta.errors import LakeError
from pg2delta.lake.engine_session import EngineSession
from pg2delta.lake.lake_files import metadata_at, protocol_at
from pg2delta.lake.sql import quote, sql_string

log = logging.getLogger("pg2delta.lake.engine")


def _no_features(schema: str, table: str) -> DeltaFeatures:
    return NO_FEATURES


def creating(writer: Any, features: DeltaFeatures) -> Any:
    """``writer`` (of a Delta table that does not exist yet, or one written whole again) with the
    table's properties and partition columns."""
    for key, value in features.properties:
        writer = writer.option(key, value)
    return writer.partitionBy(*features.partition_by) if features.partition_by else writer


class TableFeatures(EngineSession):
    """Which Delta features each table gets, and the check of an existing table's."""

    # (schema, table) -> the features of the Delta table pg2delta writes for PostgreSQL's schema.table
    # (set by the operation that owns the engine, pg2delta.apply.lakeside; none by default).
    features_of: Callable[[str, str], DeltaFeatures] = staticmethod(_no_features)

    def features(self, uri: str) -> DeltaFeatures:
        """The features of the table at ``uri``: one of the source's tables (``<root>/<schema>/<table>``),
        never pg2delta's own (``_pg2delta/...``)."""
        root = self.lake.root.rstrip("/") + "/"
        parts = uri[len(root):].strip("/").split("/") if uri.startswith(root) else []
        if len(parts) != 2 or parts[0].startswith("_pg2delta"):
            return NO_FEATURES
        return self.features_of(parts[0], parts[1])

    def table_properties(self, uri: str) -> dict[str, str]:
        """The Delta table's properties (its metadata's configuration)."""
        try:
            if self.classic:
                rows = self._sql(f"SHOW TBLPROPERTIES {self.target(uri)}", f"SHOW TBLPROPERTIES {uri}")
                return {str(r[0]): str(r[1]) for r in rows}
            return dict(self._delta_rs(uri).metadata().configuration)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot read the properties of {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def partition_columns(self, uri: str) -> list[str]:
        """The partition columns of the existing table at ``uri``."""
        try:
            return list(self._delta_rs(uri).metadata().partition_columns)
        except Exception as exc:
            raise LakeError(f"cannot read the partition columns of {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def _logged_protocol(self, uri: str) -> tuple[dict[str, str], tuple[str, ...], set[str], tuple[int, int]] | None:
        """The table's properties, partition columns, writer features and (reader, writer)
        protocol versions, from its log alone (no delta-rs load: a listing of the log and a read
        of its checkpoint, which grow with the log); None where the log cannot tell that way."""
        meta, protocol = metadata_at(self.lake, uri), protocol_at(self.lake, uri)
        if meta is None or protocol is None:
            return None
        have = {str(k): str(v) for k, v in (meta.get("configuration") or {}).items()}
        versions = (int(protocol["minReaderVersion"]), int(protocol["minWriterVersion"]))
        return have, tuple(meta.get("partitionColumns") or ()), set(protocol.get("writerFeatures") or []), versions

    def check_features(self, uri: str) -> None:
        """Before this engine's first write to the existing table at ``uri``: refuse a table it cannot
        write, set the properties the configuration asks for that it lacks (see the module's docstring)."""
        checked: set[str] = self.__dict__.setdefault("_features_checked", set())
        want = self.features(uri)
        if uri in checked or (self.classic and want == NO_FEATURES) or self.lake.delta_version(uri) is None:
            return  # Delta on Apache Spark refuses what it cannot write itself
        try:
            if self.classic:  # the lake may be where delta-rs does not reach (hdfs://, abfss://)
                detail = self._detail(uri)
                have, parts = {str(k): str(v) for k, v in (detail.get("properties") or {}).items()}, tuple(detail["partitionColumns"])
                features, versions = set(detail.get("tableFeatures") or []), (detail["minReaderVersion"], detail["minWriterVersion"])
                clustered = tuple(detail.get("clusteringColumns") or ())
            elif (logged := self._logged_protocol(uri)) is not None:
                have, parts, features, versions = logged
                clustered = ()
            else:
                dt = self._delta_rs(uri)
                protocol, meta = dt.protocol(), dt.metadata()
                have, parts = dict(meta.configuration), tuple(meta.partition_columns)
                features, versions = set(protocol.writer_features or []), (protocol.min_reader_version, protocol.min_writer_version)
                clustered = ()
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot read the protocol of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        features |= {"changeDataFeed"} if have.get(CHANGE_DATA_FEED, "false").lower() == "true" else set()
        features |= {"columnMapping"} if have.get(COLUMN_MAPPING, "none") != "none" else set()
        unwritable = sorted(features & EMBEDDED_UNWRITABLE) if not self.classic else []
        if unwritable:
            raise LakeError(
                f"the Delta table {uri} has the feature(s) {', '.join(unwritable)}, which the embedded engine (pysail) "
                "cannot write: run on Apache Spark ([engine] kind = \"spark\"); nothing was written"
            )
        if have.get(APPEND_ONLY, "false").lower() == "true":
            raise LakeError(f"the Delta table {uri} is append-only ({APPEND_ONLY} = true): pg2delta applies updates and "
                            "deletes to it; unset the property; nothing was written")
        missing = {k: v for k, v in want.properties if have.get(k) != v and k not in COLUMN_MAPPING_PROTOCOL}
        if COLUMN_MAPPING in missing and (versions[0] < 2 or versions[1] < 5):
            missing.update(COLUMN_MAPPING_PROTOCOL)
        if missing:
            self._set_properties(uri, missing)
        if want.partition_by and parts != want.partition_by:
            log.warning("%s is partitioned by (%s), not by (%s) as configured: the partition columns change when the "
                        "table is written whole again (pg2delta resync)", uri, ", ".join(parts), ", ".join(want.partition_by))
        if self.classic and want.cluster_by:
            self._cluster(uri, clustered, parts)
        checked.add(uri)

    def clustering_columns(self, uri: str) -> tuple[str, ...]:
        """The liquid clustering columns of the existing table at ``uri`` (Apache Spark; none elsewhere)."""
        return tuple(self._detail(uri).get("clusteringColumns") or ()) if self.classic else ()

    def _detail(self, uri: str) -> dict[str, Any]:
        """``DESCRIBE DETAIL`` of the table at ``uri`` (Apache Spark)."""
        return dict(self._sql(f"DESCRIBE DETAIL {self.target(uri)}", f"DESCRIBE DETAIL {uri}")[0].asDict())

    def keep_clustered(self, uri: str, before: Sequence[str]) -> None:
        """After an overwrite of the table at ``uri``, which Delta leaves without clustering columns:
        cluster it again by the configured ``cluster_by``, or else by the columns it had ``before``
        (its own, set by someone else), those of them it still has."""
        if not self.classic:
            return
        want = self.features(uri).cluster_by or tuple(before)
        if not want:
            return
        detail = self._detail(uri)
        have = set(self.spark.read.format("delta").load(uri).columns)
        self._cluster(uri, tuple(detail.get("clusteringColumns") or ()), tuple(detail["partitionColumns"]),
                      tuple(c for c in want if c in have))

    def _cluster(self, uri: str, now: tuple[str, ...], parts: tuple[str, ...], want: tuple[str, ...] | None = None) -> None:
        """Make the existing table at ``uri`` (clustered by ``now``, partitioned by ``parts``) clustered
        by ``want`` (default: as configured), in one commit that rewrites no file (``ALTER TABLE ...
        CLUSTER BY``); a partitioned table cannot be (a warning: ``pg2delta resync`` writes it whole)."""
        want = self.features(uri).cluster_by if want is None else want
        if not want or now == want:
            return
        if parts:
            log.warning("%s is partitioned by (%s), so it cannot be clustered by (%s) as configured: the table is "
                        "clustered when it is written whole again (pg2delta resync)", uri, ", ".join(parts), ", ".join(want))
            return
        self._sql(f"ALTER TABLE {self.target(uri)} CLUSTER BY ({', '.join(quote(c) for c in want)})",
                  f"ALTER TABLE {uri} CLUSTER BY ({', '.join(want)})")
        log.info("%s is clustered by (%s) from now on (liquid clustering; OPTIMIZE clusters its files)", uri, ", ".join(want))

    def rename_columns(self, uri: str, renames: Sequence[tuple[str, str]]) -> None:
        """Rename the columns ``(old, new)`` of the table at ``uri``, which maps columns by name
        (``ALTER TABLE ... RENAME COLUMN``, one commit each, no file rewritten; Apache Spark). A
        rename the table already has (made by a run that stopped before its log row) is skipped."""
        if not renames:
            return
        self.check_features(uri)
        if not self.classic:
            raise LakeError(f"cannot rename columns of {uri} on the embedded engine (pysail has no ALTER TABLE)")
        try:
            have = set(self.spark.read.format("delta").load(uri).columns)
        except Exception as exc:
            raise LakeError(f"cannot read the columns of {uri}: {' '.join(str(exc).split())[:500]}") from exc
        for old, new in renames:
            if old not in have and new in have:
                continue
            self._sql(f"ALTER TABLE {self.target(uri)} RENAME COLUMN {quote(old)} TO {quote(new)}",
                      f"ALTER TABLE {uri} RENAME COLUMN {old} TO {new}")
            log.info("renamed column %s of %s to %s (column mapping)", old, uri, new)

    def keep_log_for(self, uri: str, retention_hours: int) -> str | None:
        """Make the existing table at ``uri`` keep its log (``delta.logRetentionDuration``) as long
        as VACUUM keeps its files (``retention_hours``), as
        :func:`pg2delta.delta_features.log_retention` decides, unless the configuration sets the
        property for it; the value set (one commit), or None when nothing changed."""
        if LOG_RETENTION in self.features(uri).props:
            return None  # [lake] or [tables."s.t"] properties: check_features sets what they say
        try:
            meta = metadata_at(self.lake, uri)
        except LakeError:  # a log pyarrow cannot list: the engine's own reading
            meta = None
        have = (
            {str(k): str(v) for k, v in (meta.get("configuration") or {}).items()} if meta is not None
            else self.table_properties(uri)
        )
        current = have.get(LOG_RETENTION)
        value = log_retention(current, retention_hours)
        if current is not None and interval_hours(current) is None:
            log.warning("%s keeps its log for %s (%s), which pg2delta cannot compare with [maintain] retention = %d hours: "
                        "time travel and backfill need both", uri, current, LOG_RETENTION, retention_hours)
        if value is None:
            return None
        if current is not None:
            log.warning("%s kept its log for %s only (%s), less than [maintain] retention keeps its files: raised to %s",
                        uri, current, LOG_RETENTION, value)
        self._set_properties(uri, {LOG_RETENTION: value})
        return value

    def _set_properties(self, uri: str, props: dict[str, str]) -> None:
        """Set ``props`` on the existing table at ``uri`` in one commit (``ALTER TABLE ... SET
        TBLPROPERTIES``).

        pysail 0.7.2 alters a table's properties by a name in its catalog only (not
        ``delta.`path```): on the embedded engine the table is named for the statement and the name
        dropped after (its files stay). delta-rs 1.6 is not used: its protocol upgrade adds the
        ``variantType`` reader feature (measured on a table with deletion vectors), which Delta 3.3
        refuses to read."""
        sets = ", ".join(f"{quote_text(k)} = {quote_text(v)}" for k, v in sorted(props.items()))
        alter = f"ALTER TABLE {{}} SET TBLPROPERTIES ({sets})"
        if self.classic:
            self._sql(alter.format(self.target(uri)), f"ALTER TABLE {uri} SET TBLPROPERTIES")
        else:
            name = f"pg2delta_props_{uuid.uuid4().hex[:12]}"
            self._sql(f"CREATE TABLE {name} USING delta LOCATION {sql_string(uri)}", f"naming {uri}")
            try:
                self._sql(alter.format(name), f"ALTER TABLE {uri} SET TBLPROPERTIES")
            finally:
                self._sql(f"DROP TABLE IF EXISTS {name}", f"dropping the name of {uri}")
        log.info("set %s on %s", ", ".join(f"{k} = {v}" for k, v in sorted(props.items())), uri)


def quote_text(value: str) -> str:
    """``value`` as a Spark SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


__all__ = ["TableFeatures", "creating", "quote_text"]
