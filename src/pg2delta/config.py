"""Configuration: frozen dataclasses loaded from a TOML file, then environment, then flags.

Precedence, lowest first: defaults < TOML file (``--config``) < ``PG2DELTA_*`` environment
variables < command-line flags. Secrets never belong in the file: leave the password out of
``dsn`` and let libpq find it (``PGPASSWORD``, ``~/.pgpass``, ``PGSERVICEFILE``), or pass the
whole DSN in ``PG2DELTA_DSN``. See ``conf/embedded.toml`` and ``conf/spark.toml`` for documented examples.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pg2delta import delta_features as features
from pg2delta.errors import ConfigError

ENGINES = ("embedded", "spark", "connect")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kind: str = "embedded"  # embedded | spark | connect
    remote: str | None = None  # sc://host:port for kind = "connect"
    connect_retry_seconds: int = 30  # kind "connect": pyspark's client retries a server gone quiet this long, then exit 75
    app_name: str = "pg2delta"  # the Spark application name (spark.app.name) of a session pg2delta starts
    spark_conf: tuple[tuple[str, str], ...] = ()  # [engine.spark_conf]: Spark settings of the session, name = "value"
    # Set from [lake] deletion_vectors (Config.deletion_vectors), not a setting of [engine].
    deletion_vectors: bool = True


@dataclass(frozen=True, slots=True)
class SourceConfig:
    dsn: str = ""  # libpq connection string or URI, without the password
    slot: str = "pg2delta"  # logical replication slot (pgoutput)
    publication: str = "pg2delta"  # publication naming the tables to replicate
    create_slot: bool = False  # create the slot if it is missing
    connect_timeout: int = 10  # seconds
    # Create the slot as a failover slot (PostgreSQL 17 and later), which a physical standby running
    # with sync_replication_slots = on keeps a copy of: after the standby's promotion, runs go on
    # from it. bootstrap and --create-slot create it so, a run makes an existing slot one; refused
    # (exit 78) on older servers. Operations > Faults: a primary failover.
    failover: bool = False
    # A physical standby that should hold the slot synchronized, checked by pg2delta status (exit 14
    # when a promotion now would leave the runs without their slot); --standby-dsn too. Empty: none.
    standby_dsn: str = ""


@dataclass(frozen=True, slots=True)
class WindowConfig:
    max_changes: int = 1_000_000  # changes per window (it ends at a commit); the server's peek stops past a tenth more rows
    max_bytes: int = 512 << 20  # bytes per window; the read stops at the first commit past it
    # Tables of one window merged at once (each its own Spark job, from its own driver thread): a
    # MERGE on Apache Spark has a fixed cost of about a second, so a window touching many tables
    # would otherwise cost that many seconds. 1 merges them one after the other.
    parallel_tables: int = 4
    # Bytes of decoded changes a window holds in memory; past them the window's changes spill to
    # staged Parquet files and are reduced by the engine (pg2delta.window.spill).
    memory_budget: int = 256 << 20
    # Rows of one open transaction the decoder holds before giving out its first part.
    split_rows: int = 50_000


PARTITION_MODES = ("leaf", "root")
DROPPED_COLUMN_MODES = ("keep", "drop")
NARROWING_MODES = ("refuse", "keep")
ON_UNFOLLOWABLE_MODES = ("stop", "resync")
DETACHED_PARTITION_MODES = ("stop", "keep")
HISTORY_MODES = ("none", "scd2")


@dataclass(frozen=True, slots=True)
class TableConfig:
    key: tuple[str, ...] = ()  # columns identifying a row, overriding the replica identity
    # On a partitioned table published without publish_via_partition_root: "leaf" gives every
    # partition its own Delta table (named after the partition), "root" writes the changes of all
    # its partitions into the Delta table named after this (root) table.
    partitions: str = "leaf"
    # Columns dropped in PostgreSQL (and the old names of renamed columns): "keep" leaves them in
    # the Delta table (their values stay, new rows hold NULL); "drop" removes them (a rewrite).
    dropped_columns: str = "keep"
    # A column whose type becomes narrower (int8 -> int4, numeric(12,2) -> numeric(10,2)): "refuse"
    # stops the run (exit 78, nothing applied); "keep" leaves the Delta column at its wider type.
    narrowing: str = "refuse"
    changelog: bool | None = None  # keep a changelog of this table (None: the [lake] changelog default)
    # "scd2": keep the table's history, a row per version of each key (pg2delta.apply.history); "none":
    # not; None: the [lake] history default.
    history: str | None = None
    # A change the lake cannot follow by changes alone (a type change that is not a widening, a
    # column added with values PostgreSQL does not keep, a key change inside a transaction, ...):
    # "stop" the run (exit 78, naming pg2delta resync), or "resync" the table right there.
    on_unfollowable: str = "stop"
    # A partition detached or dropped from this partitioned table while the lake writes it as one
    # Delta table (published via the root, or partitions = "root"): PostgreSQL sends nothing for its
    # rows. "stop" (exit 78, or a resync with on_unfollowable = "resync"), or "keep" them in the lake.
    detached_partitions: str = "stop"
    # Columns landed as HMAC-SHA-256 of their value under the lake's hash key ([lake] hash_key_env /
    # hash_key_file), 64 hex digits; NULL stays NULL. Also for key columns: equal values, equal hashes.
    hash: tuple[str, ...] = ()
    # Columns never landed (nor in the changelog, the history or any staged file). A key column
    # cannot be excluded. Where you can, leave them out of the publication instead (a column list).
    exclude: tuple[str, ...] = ()
    # properties, change_data_feed, column_mapping, partition_by, cluster_by: pg2delta.delta_features
    delta: features.FeatureSettings = field(default_factory=features.FeatureSettings)
    rows: features.RowSettings = field(default_factory=features.RowSettings)  # metadata, deletes: pg2delta.delta_features


@dataclass(frozen=True, slots=True)
class MaintainConfig:
    """``[maintain]``: table maintenance (``pg2delta maintain``, see maintain.py). Durations are
    strings like ``"90m"``, ``"24h"``, ``"7d"``."""

    # A run maintains, after its windows, the Delta tables maintained longer ago than this (at most
    # `tables_per_run` of them, the longest-waiting first), so a lake run every few minutes stays
    # compacted and vacuumed with nothing else scheduled. "" never: a separate `pg2delta maintain`
    # job does it (as a platform team would schedule it).
    interval: str = "1h"
    # At most this many Delta tables (a table, its changelog, its history, the lake's own logs
    # count one each) per run; the others wait for the next runs.
    tables_per_run: int = 4
    # A run starts no further table once its maintenance has taken this long.
    run_budget: str = "60s"
    # VACUUM keeps every file a Delta version younger than this needs (time travel, `pg2delta
    # versions --at-lsn`, backfill seeds); Delta's own default is 7 days. Maintenance keeps each
    # table's log (delta.logRetentionDuration) as long, at least a day: docs/operations/maintenance.md.
    retention: str = "7d"
    # Changelog rows committed longer ago than this are deleted ("" keeps them forever: a backfill
    # into a new copy replays the changelog from the lake's start).
    changelog_retention: str = ""
    # Compacted files aim at this size in bytes (0: the library's default, 100 MiB).
    target_file_size: int = 0
    # `pg2delta status` exits 9 when a table (or its changelog or history) has gone more commits
    # than this without a checkpoint (the engines write one every 10; 0: no check).
    alert_commits_since_checkpoint: int = 100
    # ... more commits than this without a compaction (0: no check).
    alert_commits_since_compaction: int = 1000
    # ... or holds more small files than this (0: no check).
    alert_small_files: int = 500
    # A data file under this many bytes is a small file (for `alert_small_files`).
    small_file_size: int = 8 * 1024 * 1024


# [lake] table_name: the catalog name of PostgreSQL's schema.table ({schema} and {table} replaced).
DEFAULT_TABLE_NAME = "{schema}_{table}"


@dataclass(frozen=True, slots=True)
class StorageConfig:
    """``[lake]``'s object-store settings: where an S3-compatible store is and how to address it.
    Never credentials: those come from the standard chain (environment, profile, instance role)."""

    # URL of an S3-compatible store, like "http://127.0.0.1:9000" ("": AWS itself); AWS_ENDPOINT_URL wins.
    endpoint: str = ""
    region: str = ""  # the store's region ("": AWS_REGION or the profile's); AWS_REGION wins
    # address buckets in the path (what S3-compatible stores take), not in the host name
    path_style: bool = True


# What each [lake] storage setting becomes: the standard variables pyarrow, delta-rs and pysail
# read, and Hadoop's s3a settings for Apache Spark (whose JVM reads no AWS_* variable but keys).
_S3A = "spark.hadoop.fs.s3a."


def storage_environment(storage: StorageConfig, env: Mapping[str, str]) -> dict[str, str]:
    """The ``AWS_*`` variables ``storage`` stands for that ``env`` does not set already (the
    environment wins over the file, as everywhere): the endpoint, the region, the addressing style,
    and ``AWS_ALLOW_HTTP`` when the endpoint (from either) is plain HTTP, which delta-rs and pysail
    otherwise refuse."""
    out: dict[str, str] = {}
    if storage.endpoint and not (env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL_S3")):
        out["AWS_ENDPOINT_URL"] = storage.endpoint
    if storage.region and not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        out["AWS_REGION"] = storage.region
    if not storage.path_style and "AWS_VIRTUAL_HOSTED_STYLE_REQUEST" not in env:
        out["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "true"  # path style is the libraries' default
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or out.get("AWS_ENDPOINT_URL", "")
    if endpoint.startswith("http://") and "AWS_ALLOW_HTTP" not in env:
        out["AWS_ALLOW_HTTP"] = "true"
    return out


def s3a_settings(storage: StorageConfig, env: Mapping[str, str]) -> dict[str, str]:
    """Hadoop's s3a settings for the same store: for an S3-compatible one (an endpoint, the file's
    else the environment's) the endpoint, path-style access and TLS; the region. Nothing for AWS
    itself without a region. Credentials stay with s3a's own chain (environment variables,
    profile, instance role)."""
    endpoint = storage.endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
    region = storage.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or ""
    out: dict[str, str] = {}
    if endpoint:
        out[_S3A + "endpoint"] = endpoint
        out[_S3A + "path.style.access"] = "true" if storage.path_style else "false"
        out[_S3A + "connection.ssl.enabled"] = "false" if endpoint.startswith("http://") else "true"
    if region:
        out[_S3A + "endpoint.region"] = region
    return out


def _object_store(root: str) -> bool:
    return root.startswith(("s3://", "s3a://"))


@dataclass(frozen=True, slots=True)
class Config:
    source: SourceConfig = field(default_factory=SourceConfig)
    lake_root: str = ""
    engine: EngineConfig = field(default_factory=EngineConfig)
    window: WindowConfig = field(default_factory=WindowConfig)
    tables: Mapping[str, TableConfig] = field(default_factory=dict)  # "schema.table" -> settings
    changelog: bool = False  # [lake] changelog: the default for tables that do not say
    history: str = "none"  # [lake] history: the default for tables that do not say
    maintain: MaintainConfig = field(default_factory=MaintainConfig)
    # [lake] database: register every Delta table pg2delta writes in the Spark session's catalog
    # (the Hive metastore, Glue, Unity Catalog: whatever the cluster is configured with) in this
    # database, named by [lake] table_name; "" registers nothing (pg2delta.lake.metastore).
    database: str = ""
    table_name: str = DEFAULT_TABLE_NAME
    # The tables pg2delta creates (on both engines) use Delta's deletion vectors, and `pg2delta
    # maintain` turns them on for those it finds without: a MERGE then marks the rows it replaces
    # instead of rewriting each file it touches. Readers must support them (the Deletion vectors
    # page names those that do not). The engine takes it as EngineConfig.deletion_vectors.
    deletion_vectors: bool = True
    # [lake] endpoint, region, path_style: the object store's (last, so that positional use of the fields above holds).
    storage: StorageConfig = field(default_factory=StorageConfig)
    # The environment variable holding the key of [tables."s.t"] hash (HMAC-SHA-256), at least 16
    # bytes; read when a table hashes a column. The key itself never goes in this file.
    hash_key_env: str = "PG2DELTA_HASH_KEY"
    # A file holding that key instead (its bytes, one trailing newline dropped), e.g. a mounted secret; wins over hash_key_env.
    hash_key_file: str = ""
    # The key itself, read at load from one of the two (empty when no table hashes a column); never printed.
    hash_key: bytes = field(default=b"", repr=False)
    # [lake] properties, change_data_feed, column_mapping: the Delta features of every table pg2delta creates.
    delta: features.FeatureSettings = field(default_factory=features.FeatureSettings)
    rows: features.RowSettings = field(default_factory=features.RowSettings)  # [lake] metadata, deletes: every table's default

    def table(self, schema: str, name: str) -> TableConfig:
        return self.tables.get(f"{schema}.{name}", TableConfig())

    def delta_features(self, schema: str, name: str) -> features.DeltaFeatures:
        """The Delta features of the table of ``schema.name``: its section's over the [lake] defaults."""
        return features.merged(self.delta, self.table(schema, name).delta)

    def changelog_of(self, schema: str, name: str) -> bool:
        """Whether every change of this table is also appended to its changelog (see ``changelog.py``)."""
        own = self.table(schema, name).changelog
        return self.changelog if own is None else own

    def catalog_name(self, schema: str, name: str) -> str | None:
        """``database.table`` under which the Delta table of PostgreSQL's ``schema.name`` is registered
        in the session's catalog (None: ``[lake] database`` is not set)."""
        if not self.database:
            return None
        return f"{self.database}.{self.table_name.format(schema=schema, table=name)}"

    def governed(self) -> bool:
        """Whether any table hashes or excludes a column."""
        return any(t.hash or t.exclude for t in self.tables.values())

    def history_of(self, schema: str, name: str) -> bool:
        """Whether the table's SCD2 history is kept (see ``history.py``)."""
        own = self.table(schema, name).history
        return (self.history if own is None else own) == "scd2"


_ENV: dict[str, tuple[str, str, type]] = {
    "PG2DELTA_DSN": ("source", "dsn", str),
    "PG2DELTA_SLOT": ("source", "slot", str),
    "PG2DELTA_PUBLICATION": ("source", "publication", str),
    "PG2DELTA_STANDBY_DSN": ("source", "standby_dsn", str),
    "PG2DELTA_LAKE": ("lake", "root", str),
    "PG2DELTA_ENGINE": ("engine", "kind", str),
    "PG2DELTA_REMOTE": ("engine", "remote", str),
    "PG2DELTA_CONNECT_RETRY_SECONDS": ("engine", "connect_retry_seconds", int),
    "PG2DELTA_MAX_CHANGES": ("window", "max_changes", int),
    "PG2DELTA_MAX_BYTES": ("window", "max_bytes", int),
    "PG2DELTA_MEMORY_BUDGET": ("window", "memory_budget", int),
    "PG2DELTA_PARALLEL_TABLES": ("window", "parallel_tables", int),
}


def _take(section: Mapping[str, Any], name: str, cls: type, where: str) -> dict[str, Any]:
    known = {f.name: f for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key not in known:
            raise ConfigError(f"unknown setting {where}.{key} (known: {', '.join(sorted(known))})")
        default = known[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise ConfigError(f"{where}.{key} must be true or false, not {value!r}")
        if isinstance(default, int) and not isinstance(default, bool) and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{where}.{key} must be a whole number, not {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise ConfigError(f"{where}.{key} must be a string, not {value!r}")
        out[key] = value
    return out


_FLAGS = {
    "dsn": ("source", "dsn"),
    "slot": ("source", "slot"),
    "publication": ("source", "publication"),
    "create_slot": ("source", "create_slot"),
    "standby_dsn": ("source", "standby_dsn"),
    "lake": ("lake", "root"),
    "engine": ("engine", "kind"),
    "remote": ("engine", "remote"),
    "max_changes": ("window", "max_changes"),
    "max_bytes": ("window", "max_bytes"),
    "memory_budget": ("window", "memory_budget"),
    "split_rows": ("window", "split_rows"),
}


def load(
    path: str | Path | None = None, *, env: Mapping[str, str] | None = None, need_source: bool = True, **flags: Any
) -> Config:
    """Build the configuration from file, environment and flags (None flags are ignored).

    ``need_source=False`` (``pg2delta backfill``, which reads only the lake) allows an empty DSN.
    """
    data = _read_file(path)
    sections = _sections(data, path)
    _override(sections, os.environ if env is None else env, flags)
    source = SourceConfig(**_take(sections["source"], "source", SourceConfig, "source"))
    database, table_name = _catalog_settings(sections["lake"])
    key_env, key_file = _hash_key_settings(sections["lake"])  # before the storage settings' credential check
    environ = os.environ if env is None else env
    storage = StorageConfig(**_take(_storage_section(sections["lake"]), "lake", StorageConfig, "lake"))
    lake_delta = features.feature_settings(sections["lake"], "lake", table=False)
    lake_root, changelog_default, history_default, deletion_vectors = _lake_settings(sections["lake"])
    eng = dict(sections["engine"])
    if "deletion_vectors" in eng:
        raise ConfigError("deletion_vectors is a [lake] setting, not an [engine] one")
    spark_conf = eng.pop("spark_conf", {})
    if not isinstance(spark_conf, dict) or not all(isinstance(v, str) for v in spark_conf.values()):
        raise ConfigError("[engine.spark_conf] must map setting names to strings")
    if _object_store(lake_root):
        # The settings for the lake's store, for the libraries of this process and Apache Spark's
        # s3a; what the environment or [engine.spark_conf] already says wins.
        if env is None:
            os.environ.update(storage_environment(storage, os.environ))
        spark_conf = {**s3a_settings(storage, environ), **spark_conf}
    kw = _take(eng, "engine", EngineConfig, "engine")
    engine = EngineConfig(**kw, spark_conf=tuple(spark_conf.items()), deletion_vectors=deletion_vectors)
    window = WindowConfig(**_take(sections["window"], "window", WindowConfig, "window"))
    maintain = MaintainConfig(**_take(sections["maintain"], "maintain", MaintainConfig, "maintain"))
    for key in ("interval", "retention", "changelog_retention", "run_budget"):
        value = getattr(maintain, key)
        if value or key in ("retention", "run_budget"):
            duration_seconds(value, f"maintain.{key}")
    if maintain.tables_per_run < 1:
        raise ConfigError("maintain.tables_per_run must be at least 1")
    raw_tables = data.get("tables", {})
    if not isinstance(raw_tables, dict):
        raise ConfigError("[tables] must be a table of \"schema.table\" sections")
    tables = {name: _table_config(name, settings) for name, settings in raw_tables.items()}
    hashing = any(t.hash for t in tables.values())
    config = Config(
        source=source, lake_root=lake_root, storage=storage, engine=engine, window=window, tables=tables, changelog=changelog_default,
        maintain=maintain, history=history_default, database=database, table_name=table_name,
        deletion_vectors=deletion_vectors, hash_key_env=key_env, hash_key_file=key_file,
        hash_key=hash_key(key_env, key_file, environ) if hashing else b"", delta=lake_delta, rows=features.row_settings(sections["lake"], "[lake]"),
    )
    validate(config, need_source=need_source)
    return config


def _read_file(path: str | Path | None) -> dict[str, Any]:
    """The TOML file's contents ({} without a file)."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None


def _sections(data: dict[str, Any], path: str | Path | None) -> dict[str, dict[str, Any]]:
    """The file's sections other than [tables], each a dict (empty when absent)."""
    unknown = set(data) - {"source", "lake", "engine", "window", "tables", "maintain"}
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)} in {path}")
    sections: dict[str, dict[str, Any]] = {}
    for name in ("source", "lake", "engine", "window", "maintain"):
        value = data.get(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table")
        sections[name] = dict(value)
    return sections


def _override(sections: dict[str, dict[str, Any]], env: Mapping[str, str], flags: dict[str, Any]) -> None:
    """The environment's settings over the file's, then the flags' over both."""
    for var, (section, key, typ) in _ENV.items():
        if var in env and env[var] != "":
            try:
                sections[section][key] = typ(env[var])
            except ValueError:
                raise ConfigError(f"{var}={env[var]!r} is not a valid {typ.__name__}") from None
    for flag, value in flags.items():
        if value is None:
            continue
        if flag not in _FLAGS:
            raise TypeError(f"unknown flag {flag}")
        section, key = _FLAGS[flag]
        sections[section][key] = value


def _catalog_settings(lake: dict[str, Any]) -> tuple[str, str]:
    """[lake] database and table_name, taken out of ``lake`` (see :attr:`Config.database`)."""
    database = lake.pop("database", "")
    table_name = lake.pop("table_name", DEFAULT_TABLE_NAME)
    for key, value in (("database", database), ("table_name", table_name)):
        if not isinstance(value, str):
            raise ConfigError(f"lake.{key} must be a string, not {value!r}")
    if database and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?", database):
        raise ConfigError(f"lake.database {database!r}: give a database name (letters, digits, _; catalog.database allowed)")
    try:
        sample = table_name.format(schema="s", table="t")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"lake.table_name {table_name!r}: only {{schema}} and {{table}} can be replaced ({exc})") from None
    if "{table}" not in table_name or not re.fullmatch(r"[A-Za-z0-9_]+", sample):
        raise ConfigError(f"lake.table_name {table_name!r} must name {{table}} and make a name of letters, digits and _")
    return database, table_name


_STORAGE_KEYS = frozenset(f.name for f in dataclasses.fields(StorageConfig))
# Names people give credentials; refused with a pointer to the standard chain.
_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "credential")


def _storage_section(lake: dict[str, Any]) -> dict[str, Any]:
    """[lake]'s object-store settings; a credential there is refused."""
    for name in lake:
        if name not in _STORAGE_KEYS and any(word in name.lower() for word in _CREDENTIAL_WORDS):
            raise ConfigError(
                f"lake.{name}: credentials never belong in the config file; use the standard chain "
                "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance or pod role)"
            )
    return {k: v for k, v in lake.items() if k in _STORAGE_KEYS}


DEFAULT_HASH_KEY_ENV = "PG2DELTA_HASH_KEY"
HASH_KEY_MIN_BYTES = 16


def _hash_key_settings(lake: dict[str, Any]) -> tuple[str, str]:
    """[lake] hash_key_env and hash_key_file, taken out of ``lake``: where the hash key is (never the key itself)."""
    key_env = lake.pop("hash_key_env", DEFAULT_HASH_KEY_ENV)
    key_file = lake.pop("hash_key_file", "")
    for name, value in (("hash_key_env", key_env), ("hash_key_file", key_file)):
        if not isinstance(value, str):
            raise ConfigError(f"lake.{name} must be a string, not {type(value).__name__}")
    if "hash_key" in lake:
        raise ConfigError("lake.hash_key: the hash key never belongs in the config file; name its environment "
                          "variable (lake.hash_key_env) or file (lake.hash_key_file)")
    return key_env, key_file


def hash_key(key_env: str, key_file: str, env: Mapping[str, str]) -> bytes:
    """The key of ``[tables."s.t"] hash``: the file's bytes (one trailing newline dropped) when
    ``key_file`` is set, else the environment variable's value (UTF-8). At least
    :data:`HASH_KEY_MIN_BYTES` bytes. Errors name where the key was looked for, never its value."""
    if key_file:
        try:
            with open(key_file, "rb") as fh:
                key = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read the hash key file lake.hash_key_file = {key_file!r}: {exc.strerror}") from None
        key = key[:-2] if key.endswith(b"\r\n") else key[:-1] if key.endswith(b"\n") else key
        where = f"the file {key_file}"
    else:
        key = env.get(key_env, "").encode()
        where = f"the environment variable {key_env}"
    if not key:
        raise ConfigError(f"[tables] hash needs a key: none in {where} (set it, or point lake.hash_key_env / "
                          "lake.hash_key_file elsewhere)")
    if len(key) < HASH_KEY_MIN_BYTES:
        raise ConfigError(f"the hash key in {where} is {len(key)} bytes: give at least {HASH_KEY_MIN_BYTES} "
                          "(a random 32-byte key, e.g. openssl rand -hex 32)")
    return key


def _lake_settings(lake: dict[str, Any]) -> tuple[str, bool, str, bool]:
    """[lake]: the root, the changelog default, the history default and whether the tables created
    use deletion vectors (:attr:`EngineConfig.deletion_vectors`, both engines; the storage
    settings are :func:`_storage_section`'s)."""
    known = {"root", "changelog", "history", "deletion_vectors", "metadata", "deletes", *_STORAGE_KEYS}
    if set(lake) - known:
        raise ConfigError(f"unknown setting(s) in [lake]: {sorted(set(lake) - known)}")
    lake_root = lake.get("root", "")
    if not isinstance(lake_root, str):
        raise ConfigError("lake.root must be a string")
    changelog_default = lake.get("changelog", False)
    if not isinstance(changelog_default, bool):
        raise ConfigError(f"lake.changelog must be true or false, not {changelog_default!r}")
    history_default = lake.get("history", "none")
    if history_default not in HISTORY_MODES:
        raise ConfigError(f"lake.history must be one of {', '.join(HISTORY_MODES)}, not {history_default!r}")
    deletion_vectors = lake.get("deletion_vectors", True)
    if not isinstance(deletion_vectors, bool):
        raise ConfigError(f"lake.deletion_vectors must be true or false, not {deletion_vectors!r}")
    return lake_root, changelog_default, str(history_default), deletion_vectors


# [tables."s.t"] settings that take one of a few words: setting -> allowed values (the first is the default).
_TABLE_MODES = {
    "partitions": PARTITION_MODES,
    "dropped_columns": DROPPED_COLUMN_MODES,
    "narrowing": NARROWING_MODES,
    "on_unfollowable": ON_UNFOLLOWABLE_MODES,
    "detached_partitions": DETACHED_PARTITION_MODES,
}


def _table_config(name: str, settings: object) -> TableConfig:
    """One ``[tables."schema.table"]`` section."""
    if "." not in name or not isinstance(settings, dict):
        raise ConfigError(f"[tables.{name!r}] must be named \"schema.table\" and hold settings")
    settings = dict(settings)
    delta = features.feature_settings(settings, f"[tables.{name!r}]", table=True)
    known_settings = {"key", "changelog", "history", "hash", "exclude", "metadata", "deletes", *_TABLE_MODES}
    unknown_settings = set(settings) - known_settings
    if unknown_settings:
        raise ConfigError(
            f"[tables.{name!r}]: unknown setting(s) {sorted(unknown_settings)} (known: {', '.join(sorted(known_settings))})"
        )
    key = settings.get("key", [])
    if not isinstance(key, list) or not all(isinstance(k, str) for k in key):
        raise ConfigError(f"[tables.{name!r}]: key must be a list of column names, like key = [\"col\", ...]")
    governed: dict[str, tuple[str, ...]] = {}
    for setting in ("hash", "exclude"):
        names = settings.get(setting, [])
        if not isinstance(names, list) or not all(isinstance(k, str) and k for k in names):
            raise ConfigError(f"[tables.{name!r}]: {setting} must be a list of column names, like {setting} = [\"col\", ...]")
        governed[setting] = tuple(names)
    both = sorted(set(governed["hash"]) & set(governed["exclude"]))
    if both:
        raise ConfigError(f"[tables.{name!r}]: column(s) {both} are both hashed and excluded: choose one")
    changelog = settings.get("changelog")
    if changelog is not None and not isinstance(changelog, bool):
        raise ConfigError(f"[tables.{name!r}] changelog must be true or false, not {changelog!r}")
    history = settings.get("history")  # None: the [lake] history default
    if history is not None and history not in HISTORY_MODES:
        raise ConfigError(f"[tables.{name!r}]: history must be one of {', '.join(HISTORY_MODES)}, not {history!r}")
    modes: dict[str, str] = {}
    for setting, allowed in _TABLE_MODES.items():
        value = settings.get(setting, allowed[0])
        if value not in allowed:
            raise ConfigError(f"[tables.{name!r}]: {setting} must be one of {', '.join(allowed)}, not {value!r}")
        modes[setting] = value
    return TableConfig(
        key=tuple(key), changelog=changelog, history=history, hash=governed["hash"], exclude=governed["exclude"],
        partitions=modes["partitions"], dropped_columns=modes["dropped_columns"], narrowing=modes["narrowing"],
        on_unfollowable=modes["on_unfollowable"], detached_partitions=modes["detached_partitions"], delta=delta, rows=features.row_settings(settings, f"[tables.{name!r}]"),
    )


def validate(config: Config, *, need_source: bool = True) -> None:
    if need_source and not config.source.dsn:
        raise ConfigError("no source DSN: set source.dsn, PG2DELTA_DSN or --dsn")
    if not config.lake_root:
        raise ConfigError("no lake root: set lake.root, PG2DELTA_LAKE or --lake")
    if config.engine.kind not in ENGINES:
        raise ConfigError(f"unknown engine {config.engine.kind!r}; choose one of {', '.join(ENGINES)}")
    w = config.window
    if min(w.max_changes, w.max_bytes, w.parallel_tables, w.memory_budget, w.split_rows) < 1:
        raise ConfigError(
            "window.max_changes, window.max_bytes, window.parallel_tables, window.memory_budget and "
            "window.split_rows must be positive"
        )
    if not config.source.slot or not config.source.publication:
        raise ConfigError("source.slot and source.publication must not be empty")
    if config.database and config.engine.kind == "embedded":
        raise ConfigError(
            f"lake.database = {config.database!r} registers tables in a Spark catalog, which the embedded engine "
            "does not keep: use [engine] kind = \"spark\" (or \"connect\"), or leave lake.database unset"
        )
    features.refuse_unwritable(config.engine.kind, config.delta, {n: t.delta for n, t in config.tables.items()})


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_seconds(text: str, where: str) -> int:
    """``"90m"``, ``"24h"``, ``"7d"`` (or ``"3600s"``) as seconds; :class:`ConfigError` otherwise."""
    value = text.strip()
    if len(value) >= 2 and value[-1] in _UNITS and value[:-1].isdigit():
        return int(value[:-1]) * _UNITS[value[-1]]
    raise ConfigError(f"{where} must be a duration like \"90m\", \"24h\" or \"7d\", not {text!r}")
