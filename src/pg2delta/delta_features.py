"""The Delta features of the tables pg2delta creates: table properties, partitioning, liquid
clustering, Change Data Feed and column mapping (``[lake]`` defaults and ``[tables."s.t"]``
settings), and which engine can write which; and the settings of the row columns pg2delta adds
(:class:`RowSettings`: row metadata and soft deletes, pg2delta.apply.rowmeta).

Pure: settings in, a :class:`DeltaFeatures` per table (or a :class:`ConfigError`) out. The lake
layer applies them (:mod:`pg2delta.lake.engine_features`); docs/concepts/delta-features.md says
which readers read which feature.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pg2delta.errors import ConfigError

CHANGE_DATA_FEED = "delta.enableChangeDataFeed"
COLUMN_MAPPING = "delta.columnMapping.mode"
APPEND_ONLY = "delta.appendOnly"
# How long Delta keeps a table's commits (JSON) before a checkpoint cleans them up; Delta's default
# is 30 days. Time travel to a version needs its commits (or a checkpoint at or after them) and
# its files: VACUUM's retention keeps the files, this keeps the log.
LOG_RETENTION = "delta.logRetentionDuration"
DELTA_LOG_RETENTION_HOURS = 30 * 24
MIN_LOG_RETENTION_HOURS = 24
COLUMN_MAPPING_MODES = ("none", "name")
MAX_CLUSTER_COLUMNS = 4  # Delta's limit on liquid clustering columns
# Column mapping needs these protocol versions; Delta 3.3 refuses the mode without them.
COLUMN_MAPPING_PROTOCOL = {"delta.minReaderVersion": "2", "delta.minWriterVersion": "5"}
# Properties pg2delta sets itself on every table it creates (pg2delta.lake.engine_writes.STATS_COLUMNS).
OWN_PROPERTIES = frozenset({"delta.dataSkippingStatsColumns", "delta.dataSkippingNumIndexedCols"})

# Properties that turn a table feature on (value "true", or any value but "none" for the column
# mapping mode), and that feature's name in a table's protocol.
FEATURE_PROPERTIES = {
    CHANGE_DATA_FEED: "changeDataFeed",
    COLUMN_MAPPING: "columnMapping",
    "delta.enableDeletionVectors": "deletionVectors",
    "delta.enableRowTracking": "rowTracking",
    "delta.enableTypeWidening": "typeWidening",
    "delta.enableIcebergCompatV1": "icebergCompatV1",
    "delta.enableIcebergCompatV2": "icebergCompatV2",
    "delta.universalFormat.enabledFormats": "icebergCompatV2",
    "delta.checkpointPolicy": "v2Checkpoint",
    "delta.enableInCommitTimestamps": "inCommitTimestamp",
}

# Writer features of a table that the embedded engine cannot write correctly (pysail 0.7.2 for the
# commits, delta-rs 1.x for maintenance and properties): a table that has one is refused before
# anything is written. Deletion vectors are not among them: pysail writes them, and the tables
# Apache Spark creates have them (a lake can move between the engines).
EMBEDDED_UNWRITABLE = frozenset({
    "changeDataFeed", "columnMapping", "clustering", "rowTracking", "domainMetadata", "typeWidening",
    "typeWidening-preview", "icebergCompatV1", "icebergCompatV2", "identityColumns", "generatedColumns",
    "v2Checkpoint", "inCommitTimestamp", "allowColumnDefaults", "vacuumProtocolCheck",
})

# The settings of this module, in [lake] and in [tables."s.t"] (the last two per table only).
LAKE_KEYS = ("properties", "change_data_feed", "column_mapping")
TABLE_KEYS = (*LAKE_KEYS, "partition_by", "cluster_by")


@dataclass(frozen=True, slots=True)
class FeatureSettings:
    """What ``[lake]`` (the default) or one ``[tables."s.t"]`` section says of Delta features."""

    # Delta table properties of the tables pg2delta creates, like { "delta.logRetentionDuration" = "interval 60 days" }; set on existing tables before their next write. A table's own override [lake]'s by name.
    properties: tuple[tuple[str, str], ...] = ()
    # Change Data Feed (delta.enableChangeDataFeed): readers get each window's inserts, updates and deletes (Spark's table_changes). Apache Spark only. Unset: [lake]'s (false).
    change_data_feed: bool | None = None
    # "name": column mapping by name (delta.columnMapping.mode; readers need Delta 1.2+). Apache Spark only. Unset: [lake]'s ("none").
    column_mapping: str | None = None
    # Partition columns of the table (per table only); an existing table keeps its own until a resync writes it whole.
    partition_by: tuple[str, ...] = ()
    # Liquid clustering columns (per table only; at most 4 integer, decimal, string, date or timestamp columns). Apache Spark only: the table is created clustered and pg2delta maintain's OPTIMIZE clusters its files; an existing unpartitioned table is clustered in one commit.
    cluster_by: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DeltaFeatures:
    """The Delta features one table pg2delta creates gets: its properties (Change Data Feed and
    column mapping among them) and its partition or clustering columns."""

    properties: tuple[tuple[str, str], ...] = ()
    partition_by: tuple[str, ...] = ()
    cluster_by: tuple[str, ...] = ()

    @property
    def props(self) -> dict[str, str]:
        return dict(self.properties)

    def features(self) -> list[str]:
        """The table features these settings turn on (protocol names), sorted."""
        on = {f for p, f in FEATURE_PROPERTIES.items() if _turns_on(p, self.props.get(p))}
        on |= {p.removeprefix("delta.feature.") for p, v in self.properties if p.startswith("delta.feature.") and v != "disabled"}
        return sorted(on | ({"clustering"} if self.cluster_by else set()))

    @property
    def column_mapping(self) -> bool:
        return self.props.get(COLUMN_MAPPING, "none") != "none"


NO_FEATURES = DeltaFeatures()


def _turns_on(prop: str, value: str | None) -> bool:
    if value is None:
        return False
    if prop in (COLUMN_MAPPING, "delta.universalFormat.enabledFormats", "delta.checkpointPolicy"):
        return value.lower() not in ("none", "", "classic")
    return value.lower() == "true"


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def feature_settings(section: dict[str, Any], where: str, *, table: bool) -> FeatureSettings:
    """The Delta feature settings of ``section`` (a ``[lake]`` or ``[tables."s.t"]`` dict), taken out of it."""
    props = section.pop("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, str | bool | int) for v in props.values()):
        raise ConfigError(f"{where}.properties must map Delta table properties to values, like "
                          "properties = { \"delta.logRetentionDuration\" = \"interval 60 days\" }")
    for name, value in props.items():
        if not name.startswith("delta."):
            raise ConfigError(f"{where}.properties: {name!r} is not a Delta table property (they start with \"delta.\")")
        if name in OWN_PROPERTIES:
            raise ConfigError(f"{where}.properties: pg2delta sets {name} itself (which columns keep statistics)")
        if name == APPEND_ONLY and _text(value).lower() == "true":
            raise ConfigError(f"{where}.properties: {APPEND_ONLY} = true forbids the updates and deletes pg2delta applies")
    cdf = section.pop("change_data_feed", None)
    if cdf is not None and not isinstance(cdf, bool):
        raise ConfigError(f"{where}.change_data_feed must be true or false, not {cdf!r}")
    mapping = section.pop("column_mapping", None)
    if mapping is not None and mapping not in COLUMN_MAPPING_MODES:
        raise ConfigError(f"{where}.column_mapping must be one of {', '.join(COLUMN_MAPPING_MODES)}, not {mapping!r}")
    columns: dict[str, tuple[str, ...]] = {}
    for key in ("partition_by", "cluster_by"):
        value = section.pop(key, [])
        if value and not table:
            raise ConfigError(f"{where}.{key} is a per-table setting: put it in a [tables.\"schema.table\"] section")
        if not isinstance(value, list) or not all(isinstance(c, str) and c for c in value):
            raise ConfigError(f"{where}.{key} must be a list of column names, like {key} = [\"col\", ...]")
        columns[key] = tuple(value)
    if columns["partition_by"] and columns["cluster_by"]:
        raise ConfigError(f"{where}: a Delta table is partitioned or clustered, not both: choose partition_by or cluster_by")
    cluster = columns["cluster_by"]
    if len(cluster) > MAX_CLUSTER_COLUMNS or len(set(cluster)) != len(cluster):
        raise ConfigError(f"{where}.cluster_by: at most {MAX_CLUSTER_COLUMNS} distinct columns (Delta's limit), not {list(cluster)}")
    return FeatureSettings(tuple((k, _text(v)) for k, v in props.items()), cdf, mapping, columns["partition_by"], columns["cluster_by"])


def merged(lake: FeatureSettings, table: FeatureSettings) -> DeltaFeatures:
    """The features of a table: its own settings over the ``[lake]`` defaults (properties merged by name)."""
    props = {**dict(lake.properties), **dict(table.properties)}
    cdf = table.change_data_feed if table.change_data_feed is not None else lake.change_data_feed
    if cdf is not None:
        props[CHANGE_DATA_FEED] = _text(cdf)
    mapping = table.column_mapping or lake.column_mapping
    if mapping is not None:
        props[COLUMN_MAPPING] = mapping
    if props.get(COLUMN_MAPPING, "none") != "none":
        props = {**COLUMN_MAPPING_PROTOCOL, **props}
    return DeltaFeatures(tuple(sorted(props.items())), table.partition_by, table.cluster_by)


# Delta's interval units ("interval 7 days", "interval 36 hours"), in hours; months and years are
# not a fixed length, so they are not read.
_INTERVAL_HOURS = {
    "nanosecond": 1 / 3.6e12, "microsecond": 1 / 3.6e9, "millisecond": 1 / 3.6e6, "second": 1 / 3600, "minute": 1 / 60,
    "hour": 1.0, "day": 24.0, "week": 168.0,
}
_INTERVAL_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]+?)s?\b")


def interval_hours(text: str | None) -> float | None:
    """The length in hours of a Delta interval property (``"interval 7 days"``, ``"interval 1 day
    12 hours"``); None where it cannot be read that way (months, years, a negative or other text)."""
    if text is None:
        return None
    body = text.strip().lower()
    if not body.startswith("interval"):
        return None
    body = body.removeprefix("interval").strip()
    parts = _INTERVAL_PART.findall(body)
    if not parts or _INTERVAL_PART.sub("", body).strip():
        return None
    hours = 0.0
    for number, unit in parts:
        if unit not in _INTERVAL_HOURS:
            return None
        hours += float(number) * _INTERVAL_HOURS[unit]
    return hours


def _interval(hours: int) -> str:
    if hours % 24 == 0:
        days = hours // 24
        return f"interval {days} day{'' if days == 1 else 's'}"
    return f"interval {hours} hour{'' if hours == 1 else 's'}"


def log_retention(current: str | None, retention_hours: int) -> str | None:
    """The ``delta.logRetentionDuration`` to set on a table whose value is ``current`` (None: not
    set), so that its log is kept at least as long as VACUUM keeps its files (``retention_hours``,
    ``[maintain] retention``): time travel and backfill seeds need both. None: leave it.

    - Not set: Delta keeps 30 days of log, which on a table committed every five minutes is about
      9,000 JSON commits listed by every reader; pg2delta keeps as much as the files (at least a
      day), unless that is 30 days anyway.
    - Set shorter than the files' retention: raised to it (else time travel inside the retention
      fails on the log, not the files).
    - Set as long or longer, or in units this cannot read (months): left as the user set it."""
    want = max(retention_hours, MIN_LOG_RETENTION_HOURS)
    if current is None:
        return None if want == DELTA_LOG_RETENTION_HOURS else _interval(want)
    hours = interval_hours(current)
    if hours is None or hours >= retention_hours:
        return None
    return _interval(want)


DELETE_MODES = ("hard", "soft")


@dataclass(frozen=True, slots=True)
class RowSettings:
    """Row metadata and soft deletes (docs/concepts/row-metadata.md, pg2delta.apply.rowmeta): what
    ``[lake]`` (every table's default: false, "hard") or one ``[tables."s.t"]`` section says."""

    # true: every row holds _pg2delta_lsn, _pg2delta_commit_ts and _pg2delta_op of its last change
    # (unset: the [lake] setting; unset there: false).
    metadata: bool | None = None
    # "soft": a deleted row stays, _pg2delta_deleted = true (implies metadata); "hard": it leaves the
    # table (unset: the [lake] setting; unset there: "hard").
    deletes: str | None = None


def row_settings(section: Mapping[str, Any], where: str) -> RowSettings:
    """The row settings of ``section`` (a ``[lake]`` or ``[tables."s.t"]`` dict; not set: None)."""
    metadata, deletes = section.get("metadata"), section.get("deletes")
    if (metadata is not None and not isinstance(metadata, bool)) or deletes not in (None, *DELETE_MODES):
        raise ConfigError(f"{where}: metadata must be true or false and deletes \"hard\" or \"soft\", not {metadata!r}, {deletes!r}")
    return RowSettings(metadata, deletes)


def refuse_unwritable(engine: str, lake: FeatureSettings, tables: Mapping[str, FeatureSettings]) -> None:
    """:class:`ConfigError` (exit 78) for a table feature the configured engine cannot write: the
    embedded engine writes no Change Data Feed, column mapping, liquid clustering (``cluster_by``),
    deletion vectors or any other feature of :data:`FEATURE_PROPERTIES` (pysail 0.7.2 and delta-rs
    1.6 refuse to commit to a clustered table: "Unsupported table features required")."""
    if engine != "embedded":
        return
    where: Iterable[tuple[str, FeatureSettings]] = [("[lake]", lake), *((f"[tables.\"{n}\"]", s) for n, s in tables.items())]
    for name, settings in where:
        features = merged(lake if name != "[lake]" else FeatureSettings(), settings).features()
        if features:
            raise ConfigError(
                f"{name} asks for the Delta feature(s) {', '.join(features)}, which the embedded engine (pysail) cannot "
                "write: run on Apache Spark ([engine] kind = \"spark\"), or remove them; nothing was written"
            )


__all__ = [
    "CHANGE_DATA_FEED", "COLUMN_MAPPING", "EMBEDDED_UNWRITABLE", "FEATURE_PROPERTIES", "LAKE_KEYS", "LOG_RETENTION",
    "MAX_CLUSTER_COLUMNS", "NO_FEATURES", "TABLE_KEYS", "DeltaFeatures", "FeatureSettings", "RowSettings", "feature_settings",
    "interval_hours", "log_retention", "merged", "refuse_unwritable", "row_settings",
]
