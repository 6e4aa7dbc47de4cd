"""Everything that touches Spark or Delta, behind one small class.

The rest of pg2delta never imports pyspark. Three engines, chosen in config:

* ``embedded`` (default): pysail, a Spark Connect server started in this process (no JVM);
* ``spark``: Apache Spark with delta-spark, a classic session (what ``spark-submit`` gives);
* ``connect``: any Spark Connect server at ``remote = "sc://host:port"``.

Only APIs that pyspark 3.5 and 4.x share are used, and only SQL that both Apache Spark
with delta-spark and pysail accept: data reaches Spark as Parquet files read with
``spark.read.parquet`` (``createDataFrame`` from Arrow exists only from 4.0), tables are
created and widened with (empty) appends using ``mergeSchema`` (pysail has no
``ALTER TABLE ADD COLUMNS``), and every change lands through ``MERGE INTO delta.`path```.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
import warnings
from collections import defaultdict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pg2delta.errors import ConfigError, DataError, LakeError
from pg2delta.memory import release_memory

log = logging.getLogger(__name__)

ENGINES = ("embedded", "spark", "connect")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    kind: str = "embedded"  # embedded | spark | connect
    remote: str | None = None  # sc://host:port for kind = "connect"
    app_name: str = "pg2delta"
    spark_conf: tuple[tuple[str, str], ...] = ()


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for a lake URI (Hadoop's s3a:// is plain S3 to pyarrow)."""
    if uri.startswith("s3a://"):
        uri = "s3://" + uri[len("s3a://") :]
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError):
        fs, path = pafs.LocalFileSystem(), uri
    return fs, path


# pyspark 3.5's Spark Connect client deadlocks when a SparkSession is garbage-collected on one of
# its own release threads: __del__ closes the client, which joins the class-wide thread pool it is
# running on while SparkSession.stop() in the main thread holds the pool's lock (seen here with
# pyspark 3.5.9 after a few runs in one process; pyspark 4 no longer joins). Connect sessions are
# therefore kept referenced until the process exits, so their __del__ never runs mid-run: one per
# run, stopped, a few kilobytes each.
_CONNECT_SESSIONS: list[Any] = []

# Session settings of a classic Spark session, unless the config names them. Staged Parquet comes
# from pyarrow, which writes dates and timestamps in the proleptic Gregorian calendar as PostgreSQL
# does; Spark 3.5 refuses to read (or write) one before 1582-10-15 or 1900-01-01 unless told
# which calendar the file uses (READ_ANCIENT_DATETIME). Spark 4 defaults to CORRECTED already.
# Spark writes timestamps as INT96 unless told otherwise; other Delta readers (delta-rs, DuckDB)
# read INT96 as nanoseconds and cannot hold PostgreSQL's range (years 1 to 9999) that way.
_CLASSIC_SQL_CONF = {
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.parquet.datetimeRebaseModeInRead": "CORRECTED",
    "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInRead": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
}


# Delta's idempotent-write identifiers as session settings: a MERGE, DELETE or append made with
# them is skipped by Delta itself when the table already recorded a transaction of that app id
# with a version at least as high (delta-io/delta#1555, Delta 2.3 and later).
TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"


@dataclass(frozen=True, slots=True)
class Txn:
    """An idempotent-write identifier: the application and its monotonically growing version."""

    app_id: str
    version: int


def _delta_jars_named(conf: dict[str, str]) -> bool:
    """Whether Spark will have jars it was told about: under ``spark-submit`` (the JVM is up, with
    its ``--packages``/``--jars``), or ``spark.jars``/``spark.jars.packages`` in the config or in
    Spark's own ``spark-defaults.conf`` (``SPARK_CONF_DIR``, else ``SPARK_HOME/conf``)."""
    if "PYSPARK_GATEWAY_PORT" in os.environ or {"spark.jars", "spark.jars.packages"} & set(conf):
        return True
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (
        os.path.join(os.environ["SPARK_HOME"], "conf") if os.environ.get("SPARK_HOME") else None
    )
    if conf_dir is None:
        return False
    try:
        with open(os.path.join(conf_dir, "spark-defaults.conf"), encoding="utf-8") as f:
            keys = {line.split(None, 1)[0] for line in f if line.strip() and not line.lstrip().startswith("#")}
    except OSError:
        return False
    return bool({"spark.jars", "spark.jars.packages"} & keys)


class Lake:
    """Files under the lake root: Delta logs and staged Parquet, through pyarrow's filesystems."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        self.fs, self.path = _filesystem(self.root)

    def table_uri(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _local(self, uri: str) -> str:
        return _filesystem(uri)[1]

    def check_writable(self) -> None:
        probe = f"{self.path}/_pg2delta/.write-probe-{uuid.uuid4().hex}"
        try:
            self.fs.create_dir(f"{self.path}/_pg2delta", recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
            self.fs.delete_file(probe)
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot write to the lake at {self.root}: {exc}") from exc

    def delta_version(self, uri: str) -> int | None:
        """The latest commit version of the Delta table at ``uri``, or None if there is none."""
        log_dir = f"{self._local(uri)}/_delta_log"
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(log_dir, allow_not_found=True))
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot list {log_dir}: {exc}") from exc
        versions = [int(m.group(1)) for i in infos if (m := re.fullmatch(r"(\d{20})\.json", i.base_name))]
        return max(versions) if versions else None

    def snapshot_at(self, uri: str, version: int) -> tuple[list[str], str | None]:
        """The data files and the schema (Spark's StructType JSON) of the Delta table at ``uri`` as
        of ``version``, replayed from its JSON commits.

        For reading an old version where the engine cannot time-travel (pysail 0.7.2 fails for any
        version below its latest checkpoint, though the commits are all there). Refuses what
        plain Parquet files cannot express: deletion vectors and column mapping.
        """
        local = self._local(uri)
        files: dict[str, None] = {}
        schema: str | None = None
        for v in range(version + 1):
            name = f"{local}/_delta_log/{v:020d}.json"
            try:
                with self.fs.open_input_stream(name) as f:
                    lines = f.read().decode().splitlines()
            except (OSError, pa.ArrowException) as exc:
                raise LakeError(f"cannot read version {version} of {uri}: commit {v} is gone ({exc})") from exc
            for line in lines:
                action = json.loads(line) if line.strip() else {}
                if "add" in action:
                    if action["add"].get("deletionVector"):
                        raise LakeError(f"cannot read version {version} of {uri} from its files: it has deletion vectors")
                    files[unquote(action["add"]["path"])] = None
                elif "remove" in action:
                    files.pop(unquote(action["remove"]["path"]), None)
                elif "metaData" in action:
                    conf = action["metaData"].get("configuration") or {}
                    if conf.get("delta.columnMapping.mode", "none") != "none":
                        raise LakeError(f"cannot read version {version} of {uri} from its files: it uses column mapping")
                    schema = action["metaData"].get("schemaString")
        return [p if "://" in p or p.startswith("/") else f"{uri}/{p}" for p in files], schema

    def files_now(self, uri: str) -> tuple[int, dict[str, int]] | None:
        """The latest version of the Delta table at ``uri`` and its data files with their sizes in
        bytes (paths as the log names them), from its log alone: the newest classic checkpoint
        (single or multi-part Parquet) and the JSON commits after it. None when there is no table;
        a LakeError when the log cannot be read this way (a V2 checkpoint and no JSON commits
        before it)."""
        local = self._local(uri)
        log_dir = f"{local}/_delta_log"
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(log_dir, allow_not_found=True))
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot list {log_dir}: {exc}") from exc
        commits: set[int] = set()
        parts: dict[tuple[int, int], set[str]] = defaultdict(set)  # (version, parts) -> files
        for info in infos:
            if m := re.fullmatch(r"(\d{20})\.json", info.base_name):
                commits.add(int(m.group(1)))
            elif m := re.fullmatch(r"(\d{20})\.checkpoint\.parquet", info.base_name):
                parts[(int(m.group(1)), 1)].add(info.path)
            elif m := re.fullmatch(r"(\d{20})\.checkpoint\.\d{10}\.(\d{10})\.parquet", info.base_name):
                parts[(int(m.group(1)), int(m.group(2)))].add(info.path)
        if not commits:
            return None
        latest = max(commits)
        complete = [v for (v, n), names in parts.items() if len(names) == n and v <= latest]
        start = max(complete) if complete else -1
        files: dict[str, int] = {}
        try:
            if start >= 0:
                n = next(n for (v, n) in parts if v == start and len(parts[(v, n)]) == n)
                for name in sorted(parts[(start, n)]):
                    with self.fs.open_input_file(name) as f:
                        table = pq.read_table(f, columns=["add"])
                    for add in table.column("add").to_pylist():
                        if add is not None:
                            files[unquote(add["path"])] = int(add.get("size") or 0)
            for v in range(start + 1, latest + 1):
                with self.fs.open_input_stream(f"{log_dir}/{v:020d}.json") as f:
                    lines = f.read().decode().splitlines()
                for line in lines:
                    action = json.loads(line) if line.strip() else {}
                    if "add" in action:
                        files[unquote(action["add"]["path"])] = int(action["add"].get("size") or 0)
                    elif "remove" in action:
                        files.pop(unquote(action["remove"]["path"]), None)
        except (OSError, pa.ArrowException, KeyError, StopIteration) as exc:
            raise LakeError(f"cannot read the Delta log of {uri}: {exc}") from exc
        return latest, files

    def read_delta(self, uri: str) -> pa.Table | None:
        """A small, unpartitioned Delta table pg2delta wrote (its applied log), read with pyarrow from
        the files its log lists: no engine. Columns added later are null in older files."""
        found = self.files_now(uri)
        if found is None:
            return None
        _, files = found
        pieces = []
        try:
            for path in sorted(files):
                full = path if "://" in path or path.startswith("/") else f"{self._local(uri)}/{path}"
                with self.fs.open_input_file(self._local(full)) as f:
                    pieces.append(pq.read_table(f))
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot read {uri}: {exc}") from exc
        if not pieces:
            return pa.table({})
        return pa.concat_tables(pieces, promote_options="permissive")

    def stage(self, table: pa.Table, name: str) -> str:
        """Write ``table`` as one Parquet file under the lake's staging area; returns its URI."""
        rel = f"_pg2delta/staging/{name}.parquet"
        local = f"{self.path}/{rel}"
        try:
            self.fs.create_dir(local.rsplit("/", 1)[0], recursive=True)
            with self.fs.open_output_stream(local) as out:
                pq.write_table(table, out, compression="zstd")
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot write staging file {local}: {exc}") from exc
        return self.table_uri(rel)

    def staging_uri(self, name: str) -> str:
        """The URI of ``name`` (a file or directory) in the lake's staging area."""
        return self.table_uri(f"_pg2delta/staging/{name}")

    def unstage_dir(self, name: str) -> None:
        """Remove the directory ``name`` of the staging area, with everything in it."""
        try:
            self.fs.delete_dir(f"{self.path}/_pg2delta/staging/{name}")
        except FileNotFoundError:
            pass
        except (OSError, pa.ArrowException):
            log.warning("could not remove staging directory %s", name)

    def unstage(self, uri: str) -> None:
        try:
            self.fs.delete_file(self._local(uri))
        except (OSError, pa.ArrowException):
            log.warning("could not remove staging file %s", uri)


class Engine:
    """A SparkSession that applies staged changes to Delta tables.

    Safe to use from several threads at once (``Job`` merges independent tables concurrently).
    A classic session gives every other thread a session of its own (``newSession()``: the same
    SparkContext, its own SQL settings and temporary views), so the per-statement idempotent-write
    settings of one thread never reach another's statement. A Spark Connect session (embedded,
    connect) is shared: its statements carry no per-thread settings.
    """

    def __init__(
        self, spark: Any, lake: Lake, *, stop: Any = None, classic: bool = False, session_conf: dict[str, str] | None = None
    ) -> None:
        self._main = spark
        self.lake = lake
        self._stop = stop
        self.classic = classic
        self._session_conf = dict(session_conf or {})
        self._owner = threading.get_ident()
        self._local = threading.local()

    def with_lake(self, lake: Lake) -> Engine:
        """An engine on the same session writing another lake (its owner stops the session)."""
        return Engine(self._main, lake, classic=self.classic, session_conf=self._session_conf)

    @property
    def spark(self) -> Any:
        """This thread's session: the main one, or for a classic engine in another thread its own."""
        if not self.classic or threading.get_ident() == self._owner:
            return self._main
        session = getattr(self._local, "spark", None)
        if session is None:
            session = self._main.newSession()
            for key, value in self._session_conf.items():
                session.conf.set(key, value)
            self._local.spark = session
        return session

    @property
    def idempotent_writes(self) -> bool:
        """Whether Delta itself recognises a replayed commit (:class:`Txn`); delta-spark does,
        pysail 0.7 has no ``txnAppId``."""
        return self.classic

    @contextmanager
    def _txn(self, txn: Txn | None) -> Iterator[None]:
        """Statements in this block carry ``txn`` as Delta's idempotent-write session settings."""
        if txn is None or not self.idempotent_writes:
            yield
            return
        conf = self.spark.conf
        conf.set(TXN_APP_ID, txn.app_id)
        conf.set(TXN_VERSION, str(txn.version))
        try:
            yield
        finally:
            conf.unset(TXN_APP_ID)
            conf.unset(TXN_VERSION)

    # --- life cycle ----------------------------------------------------------------------

    @classmethod
    def start(cls, config: EngineConfig, lake: Lake) -> Engine:
        # pyspark warns about the installed pandas version on import, which we never use.
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark(\.|$)")
        if config.kind not in ENGINES:
            raise ConfigError(f"unknown engine {config.kind!r}; choose one of {', '.join(ENGINES)}")
        try:
            if config.kind == "embedded":
                return cls._start_embedded(config, lake)
            if config.kind == "connect":
                if not config.remote:
                    raise ConfigError("engine 'connect' needs remote = \"sc://host:port\"")
                from pyspark.sql import SparkSession

                spark = SparkSession.builder.remote(config.remote).getOrCreate()
                _CONNECT_SESSIONS.append(spark)
                return cls(spark, lake)
            return cls._start_classic(config, lake)
        except ImportError as exc:
            extra = "embedded" if config.kind != "spark" else "spark"
            raise ConfigError(f"engine {config.kind!r} is not installed: {exc} (pip install 'pg2delta[{extra}]')") from exc

    @classmethod
    def _start_embedded(cls, config: EngineConfig, lake: Lake) -> Engine:
        from pysail.spark import SparkConnectServer
        from pyspark.sql import SparkSession

        # pysail logs session starts at info and task aborts at shutdown at warn, straight to
        # stderr; our own log and one-line errors must stay readable there.
        os.environ.setdefault("RUST_LOG", "error")
        server = SparkConnectServer("127.0.0.1", 0)
        server.start(background=True)
        _, port = server.listening_address
        spark = SparkSession.builder.remote(f"sc://127.0.0.1:{port}").getOrCreate()
        _CONNECT_SESSIONS.append(spark)

        def stop() -> None:
            try:
                spark.stop()
            finally:
                server.stop()

        return cls(spark, lake, stop=stop)

    @classmethod
    def _start_classic(cls, config: EngineConfig, lake: Lake) -> Engine:
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(config.app_name)
        conf = dict(config.spark_conf)
        conf.setdefault("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        conf.setdefault("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        for key, value in conf.items():
            builder = builder.config(key, value)
        if not _delta_jars_named(conf):
            try:  # outside spark-submit: let delta-spark name its jars for this pyspark
                from delta import configure_spark_with_delta_pip

                builder = configure_spark_with_delta_pip(builder)
            except ImportError:
                pass
        spark = builder.getOrCreate()
        session_conf = {k: v for k, v in _CLASSIC_SQL_CONF.items() if k not in conf}
        for key, value in session_conf.items():
            spark.conf.set(key, value)
        return cls(spark, lake, classic=True, session_conf=session_conf)

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()

    # --- Delta tables ---------------------------------------------------------------------

    @staticmethod
    def target(uri: str) -> str:
        return "delta.`" + uri.replace("`", "``") + "`"

    def _sql(self, statement: str, what: str) -> list[Any]:
        try:
            return list(self.spark.sql(statement).collect())
        except Exception as exc:  # pyspark raises many unrelated types; keep the cause chain
            raise LakeError(f"{what} failed: {' '.join(str(exc).split())[:500]}") from exc

    def ensure_table(self, uri: str, staged: str, columns: Sequence[str], current: Collection[str] | None = None) -> bool:
        """Create the Delta table, or add columns it lacks, with the schema of ``columns`` of ``staged``.

        ``current``: the table's columns when the caller knows them (saves reading its schema).
        Returns True when the table's schema changed.
        """
        from pg2delta.merge import quote

        existing = self.lake.delta_version(uri)
        try:
            df = self.spark.read.parquet(staged).select(*[quote(c) for c in columns]).limit(0)
            if existing is None:
                df.write.format("delta").mode("append").save(uri)
                log.info("created delta table %s", uri)
                return True
            if current is None:
                current = set(self.spark.read.format("delta").load(uri).columns)
            if set(columns) - set(current):
                df.write.format("delta").mode("append").option("mergeSchema", "true").save(uri)
                log.info("added columns %s to %s", sorted(set(columns) - set(current)), uri)
                return True
            return False
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot create or widen delta table {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def table_types(self, uri: str, *, version: int | None = None) -> dict[str, str] | None:
        """The Delta table's columns and their Spark type names, in order (as of ``version``, default
        the latest); None if there is no table."""
        if self.lake.delta_version(uri) is None:
            return None
        try:
            reader = self.spark.read.format("delta")
            if version is not None:
                reader = reader.option("versionAsOf", version)
            schema = reader.load(uri).schema
        except Exception as exc:
            if version is None:
                raise LakeError(f"cannot read the schema of {uri}: {' '.join(str(exc).split())[:500]}") from exc
            # pysail 0.7.2 cannot time-travel below its latest checkpoint: the log has the schema.
            from pyspark.sql.types import StructType

            _, text = self.lake.snapshot_at(uri, version)
            if text is None:
                raise LakeError(f"cannot read the schema of {uri} at version {version}: no metadata") from exc
            schema = StructType.fromJson(json.loads(text))
        return {f.name: f.dataType.simpleString() for f in schema.fields}

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
        from pg2delta.merge import quote

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
            out.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(uri)
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

    def has_rows(self, uri: str, *, version: int | None = None) -> bool:
        """Whether the Delta table at ``uri`` (as of ``version``) holds any row; False if there is no table."""
        if self.lake.delta_version(uri) is None:
            return False
        try:
            return bool(self._read_version(uri, version).limit(1).count())
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot read {uri} at version {version}: {' '.join(str(exc).split())[:500]}") from exc

    def merge(self, uri: str, staged: str, statement_for: Any, *, txn: Txn | None = None) -> None:
        """Run the MERGE built by ``statement_for(target, source_view)`` with ``staged`` as the source.

        With ``txn``, Delta skips the MERGE when the table already committed that transaction
        (where the engine supports it, :attr:`idempotent_writes`).
        """
        view = f"pg2delta_src_{uuid.uuid4().hex[:12]}"
        try:
            self.spark.read.parquet(staged).createOrReplaceTempView(view)
        except Exception as exc:
            raise LakeError(f"cannot read staged changes {staged}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            with self._txn(txn):
                self._sql(statement_for(self.target(uri), view), f"MERGE into {uri}")
        finally:
            try:
                self.spark.catalog.dropTempView(view)
            except Exception:
                log.debug("could not drop temp view %s", view)

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
    ) -> int:
        """Reduce the staged changes under ``changes_dir`` to one row per key in the engine and MERGE them
        (a spilled window, see :mod:`pg2delta.spill`); returns the number of rows merged.

        ``toast_columns``: the columns some change sent as unchanged TOAST; their values come from
        earlier changes of the row, else from the table at ``lookup_version``. ``work``: a name in the
        staging area for the intermediate results (removed here). ``rows``: how many changes are
        staged; past :data:`REDUCE_BUCKET_ROWS` the reduce runs as several queries, each over the keys
        of one hash bucket, so the engine's memory does not follow the window's size (not with
        unchanged TOAST, whose values follow a row through key changes, from one key to another).
        The one MERGE reads every bucket's rows.
        """
        steps = _Steps(self, work)
        buckets = 1 if toast_columns else max(1, -(-rows // REDUCE_BUCKET_ROWS))
        try:
            final = steps.filled(
                uri, changes_dir, key_names=key_names, data_columns=data_columns, toast_columns=toast_columns,
                lookup_version=lookup_version, nullable_keys=nullable_keys, optional=optional, every_row=False,
                buckets=buckets,
            )
            merged = int(self.spark.sql(f"SELECT count(*) AS n FROM {final}").collect()[0]["n"])
            log.debug("%s: %d rows to merge", uri, merged)
            with self._txn(txn):
                self._sql(statement_for(self.target(uri), final), f"MERGE into {uri}")
            return merged
        except (LakeError, DataError):
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
        :func:`pg2delta.merge.ordered_changes_sql`)."""
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

    # --- maintenance (see maintain.py) ----------------------------------------------------------

    def _delta_rs(self, uri: str) -> Any:
        """The Delta table at ``uri`` through delta-rs: the engines without Delta's maintenance
        commands (pysail) get them from the library Delta's Rust implementation ships."""
        from deltalake import DeltaTable

        return DeltaTable("s3://" + uri[len("s3a://"):] if uri.startswith("s3a://") else uri)

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
            return True
        except Exception as exc:
            raise LakeError(f"cannot write a checkpoint of {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def delete_where(self, uri: str, condition: str) -> None:
        """``DELETE FROM`` the table the rows matching the Spark SQL ``condition`` (one commit)."""
        self._sql(f"DELETE FROM {self.target(uri)} WHERE {condition}", f"DELETE FROM {uri}")

    def replace_table(self, uri: str, staged_dir: str) -> None:
        """Make the Delta table at ``uri`` hold exactly the Parquet files under ``staged_dir``, in one commit.

        The table is created when missing; an existing one is overwritten (schema included),
        so readers see either the old table or the whole new one, never part of it.
        """
        try:
            (
                self.spark.read.parquet(staged_dir)
                .write.format("delta")
                .mode("overwrite")
                .option("overwriteSchema", "true")
                .save(uri)
            )
        except Exception as exc:
            raise LakeError(f"cannot write {uri} from {staged_dir}: {' '.join(str(exc).split())[:500]}") from exc

    def delete_all(self, uri: str, *, txn: Txn | None = None) -> None:
        with self._txn(txn):
            self._sql(f"DELETE FROM {self.target(uri)}", f"DELETE FROM {uri}")

    def read_rows(
        self,
        uri: str,
        key_names: Sequence[str],
        keys: Sequence[tuple[object, ...]],
        columns: Sequence[str],
        *,
        version: int | None = None,
        nullable_keys: bool = False,
    ) -> list[dict[str, Any]]:
        """Rows of the Delta table whose key is one of ``keys`` (few: used to fill unchanged TOAST).

        With ``version``, the table as of that Delta version (time travel); columns the table
        did not have then come back as None. ``nullable_keys`` matches keys null-safely.
        """
        from pg2delta.merge import quote

        if not keys or self.lake.delta_version(uri) is None:
            return []
        keyset = pa.table({k: [key[i] for key in keys] for i, k in enumerate(key_names)})
        staged = self.lake.stage(keyset, f"lookup-{uuid.uuid4().hex}")
        key_view = f"pg2delta_keys_{uuid.uuid4().hex[:12]}"
        table_view = f"pg2delta_table_{uuid.uuid4().hex[:12]}"
        try:
            table = self._read_version(uri, version)
            present = set(table.columns)
            table.createOrReplaceTempView(table_view)
            self.spark.read.parquet(staged).createOrReplaceTempView(key_view)
        except Exception as exc:
            self.lake.unstage(staged)
            raise LakeError(f"cannot read {uri} at version {version}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            eq = "<=>" if nullable_keys else "="
            on = " AND ".join(f"t.{quote(k)} {eq} k.{quote(k)}" for k in key_names)
            cols = ", ".join(
                f"t.{quote(c)}" if c in present else f"NULL AS {quote(c)}" for c in dict.fromkeys([*key_names, *columns])
            )
            rows = self._sql(f"SELECT {cols} FROM {table_view} AS t JOIN {key_view} AS k ON {on}", f"lookup in {uri}")
            return [r.asDict(recursive=True) for r in rows]
        finally:
            for view in (key_view, table_view):
                try:
                    self.spark.catalog.dropTempView(view)
                except Exception:
                    log.debug("could not drop temp view %s", view)
            self.lake.unstage(staged)

    def decimal_text(self, expr: str, scale: int) -> str:
        """Spark SQL for the plain text of a decimal with ``scale`` digits (``-0.0500``, never ``5.00E-2``).

        Apache Spark prints small decimals and zeros with a scale in scientific notation (Java's
        ``BigDecimal.toString``); ``format_number`` is exact for decimals there. pysail casts plainly,
        and its ``format_number`` goes through a double (wrong past 15 digits).
        """
        if self.classic:
            return f"replace(format_number({expr}, {scale}), ',', '')"
        return f"CAST({expr} AS STRING)"

    def query(self, statement: str, what: str) -> list[Any]:
        """The rows of a (small: aggregates, a few rows) Spark SQL query; :class:`LakeError` on failure."""
        return self._sql(statement, what)

    @contextmanager
    def version_view(self, uri: str, version: int) -> Iterator[str]:
        """A temporary view of the Delta table at ``uri`` as of ``version``, dropped afterwards."""
        view = f"pg2delta_version_{uuid.uuid4().hex[:12]}"
        try:
            self._read_version(uri, version).createOrReplaceTempView(view)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(f"cannot read {uri} at version {version}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            yield view
        finally:
            try:
                self.spark.catalog.dropTempView(view)
            except Exception:
                log.debug("could not drop temp view %s", view)

    def read_version(self, uri: str, version: int | None) -> Any:
        """The Delta table at ``uri`` as of ``version`` (None: the latest) as a DataFrame."""
        return self._read_version(uri, version)

    def _read_version(self, uri: str, version: int | None) -> Any:
        """The Delta table at ``uri`` (as of ``version``) as a DataFrame."""
        if version is None:
            return self.spark.read.format("delta").load(uri)
        try:
            table = self.spark.read.format("delta").option("versionAsOf", version).load(uri)
            table.columns  # noqa: B018 -- resolves the snapshot now, so a failure is caught here
            return table
        except Exception as exc:
            # pysail 0.7.2 cannot time-travel below its latest checkpoint: read the files the
            # JSON commits list at that version instead, with that version's schema.
            log.debug("time travel to version %d of %s failed (%s); reading its files", version, uri, exc)
            files, text = self.lake.snapshot_at(uri, version)
            if text is None:
                raise LakeError(f"cannot read {uri} at version {version}: no metadata") from exc
            from pyspark.sql.types import StructType

            schema = StructType.fromJson(json.loads(text))
            return self.spark.read.schema(schema).parquet(*files) if files else self.spark.createDataFrame([], schema)

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

    def append_staged(self, uri: str, staged: str, *, fill_missing: bool = False, txn: Txn | None = None) -> None:
        """:meth:`append` of the staged Parquet file or directory ``staged`` (its files' schemas merged)."""
        try:
            df = self.spark.read.option("mergeSchema", "true").parquet(staged)
            if fill_missing and self.lake.delta_version(uri) is not None:
                from pyspark.sql import functions as F

                have = set(df.columns)
                for f in self.spark.read.format("delta").load(uri).schema.fields:
                    if f.name not in have:
                        df = df.withColumn(f.name, F.lit(None).cast(f.dataType))
            writer = df.write.format("delta").mode("append").option("mergeSchema", "true")
            if txn is not None and self.idempotent_writes:
                writer = writer.option("txnAppId", txn.app_id).option("txnVersion", str(txn.version))
            writer.save(uri)
        except Exception as exc:
            raise LakeError(f"cannot append to {uri}: {' '.join(str(exc).split())[:500]}") from exc

    def read_table(self, uri: str) -> list[dict[str, Any]]:
        """All rows of a (small) Delta table, or [] if it does not exist."""
        if self.lake.delta_version(uri) is None:
            return []
        try:
            return [r.asDict(recursive=True) for r in self.spark.read.format("delta").load(uri).collect()]
        except Exception as exc:
            raise LakeError(f"cannot read {uri}: {' '.join(str(exc).split())[:500]}") from exc

    # --- changelog and backfill (see changelog.py, backfill.py) ---------------------------------

    def max_of(self, uri: str, column: str) -> int | None:
        """The largest value of an integer column of the Delta table at ``uri`` (None: empty or missing)."""
        from pg2delta.merge import quote

        if self.lake.delta_version(uri) is None:
            return None
        rows = self._sql(f"SELECT max({quote(column)}) AS m FROM {self.target(uri)}", f"reading max({column}) of {uri}")
        value = rows[0]["m"] if rows else None
        return None if value is None else int(value)

    def history_high(self, uri: str, pairs: Sequence[tuple[str, str]]) -> int | None:
        """The largest of the ``(lsn, pos)`` column pairs' LSNs over rows whose position is not negative
        (an SCD2 history's window-written bounds, see history.py; None: empty or missing)."""
        from pg2delta.merge import quote

        if self.lake.delta_version(uri) is None:
            return None
        parts = ", ".join(
            f"max(CASE WHEN {quote(pos)} >= 0 THEN {quote(lsn)} END) AS m{i}" for i, (lsn, pos) in enumerate(pairs)
        )
        rows = self._sql(f"SELECT {parts} FROM {self.target(uri)}", f"reading the high-water LSN of {uri}")
        values = [int(v) for v in (rows[0] if rows else []) if v is not None]
        return max(values) if values else None

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
                empty.write.format("delta").mode("append").save(uri)
            elif set(columns) - set(self.spark.read.format("delta").load(uri).columns):
                empty.write.format("delta").mode("append").option("mergeSchema", "true").save(uri)
            df.createOrReplaceTempView(view)
        except Exception as exc:
            raise LakeError(f"cannot stage the copy for {uri}: {' '.join(str(exc).split())[:500]}") from exc
        try:
            self._sql(statement_for(self.target(uri), view, columns), f"MERGE into {uri}")
        finally:
            try:
                self.spark.catalog.dropTempView(view)
            except Exception:
                log.debug("could not drop temp view %s", view)

    def read_arrow(self, uri: str, where: str) -> pa.Table:
        """The rows of the Delta table at ``uri`` matching the SQL condition ``where``, as Arrow.

        They travel through a Parquet directory under the lake's staging area (Spark 3.5 has no
        Arrow collect); use it for bounded slices, not whole large tables.
        """
        rel = f"_pg2delta/staging/export-{uuid.uuid4().hex}"
        local = f"{self.lake.path}/{rel}"
        try:
            self.spark.read.format("delta").load(uri).where(where).write.mode("overwrite").parquet(self.lake.table_uri(rel))
            infos = self.lake.fs.get_file_info(pafs.FileSelector(local, allow_not_found=True, recursive=True))
            files = sorted(i.path for i in infos if i.is_file and i.base_name.endswith(".parquet"))
            tables = [pq.read_table(f, filesystem=self.lake.fs) for f in files]
        except Exception as exc:
            raise LakeError(f"cannot read {uri} where {where}: {' '.join(str(exc).split())[:500]}") from exc
        finally:
            try:
                self.lake.fs.delete_dir(local)
            except (OSError, pa.ArrowException):
                log.debug("could not remove export directory %s", local)
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def check_version(self, uri: str, version: int) -> None:
        """Raise :class:`LakeError` unless the Delta table at ``uri`` can be read as of ``version``."""
        try:
            _ = self._read_version(uri, version).columns
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(
                f"cannot read {uri} as of Delta version {version} (time travel): {' '.join(str(exc).split())[:300]}"
            ) from exc

    def copy_table(self, source: str, version: int, target: str) -> None:
        """Write the Delta table ``source`` as of ``version`` (time travel) as a new table at ``target``."""
        try:
            self._read_version(source, version).write.format("delta").mode("append").save(target)
        except LakeError:
            raise
        except Exception as exc:
            raise LakeError(
                f"cannot copy {source} at version {version} to {target}: {' '.join(str(exc).split())[:500]}"
            ) from exc


# Staged changes per query of a bucketed reduce (Engine.merge_reduced).
REDUCE_BUCKET_ROWS = 500_000


class _Steps:
    """The temporary views and intermediate Parquet results of a computation over staged changes
    (:meth:`Engine.merge_reduced`, :meth:`Engine.stage_filled`); :meth:`close` drops and removes them."""

    def __init__(self, engine: Engine, work: str) -> None:
        self.engine = engine
        self.work = work
        self.views: list[str] = []

    def view(self, df: Any) -> str:
        name = f"pg2delta_{uuid.uuid4().hex[:12]}"
        df.createOrReplaceTempView(name)
        self.views.append(name)
        return name

    def write(self, df: Any, target: str) -> bool:
        """``df`` written to ``target`` as Parquet; False when nothing was written: pysail writes
        nothing at all for an empty result (Apache Spark a file with the schema)."""
        lake = self.engine.lake
        df.write.mode("overwrite").parquet(target)
        release_memory()
        return bool(lake.fs.get_file_info(lake._local(target)).type != pafs.FileType.NotFound)

    def materialized(self, df: Any, part: str, *, target: str | None = None) -> str:
        # Written out and read back: the next step starts from files, not from a growing plan.
        target = target or self.engine.lake.staging_uri(f"{self.work}/{part}")
        if not self.write(df, target):
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
    ) -> str:
        """The view of the staged changes' final rows per key (``every_row``: of every change), their
        unchanged TOAST filled from earlier changes of the row, else from the table at ``lookup_version``;
        :class:`DataError` when neither has a value. ``buckets`` > 1 (no ``toast_columns``): computed
        one hash bucket of the keys at a time, each written out before the next starts."""
        from pg2delta import merge as m

        engine, spark = self.engine, self.engine.spark
        if buckets > 1 and not toast_columns:
            by_key = ", ".join(m.quote(k) for k in key_names)
            source = spark.read.parquet(changes_dir)
            parts: list[str] = []
            last = ""
            for i in range(buckets):
                changes = self.view(source.where(f"pmod(hash({by_key}), {buckets}) = {i}"))
                ordered = self.view(spark.sql(m.ordered_changes_sql(changes, key_names, (), truncates)))
                last = m.final_source_sql(
                    ordered, None, None, key_names, data_columns, (),
                    nullable_keys=nullable_keys, optional=optional, every_row=every_row,
                )
                target = engine.lake.staging_uri(f"{self.work}/final-{i:04d}")
                if self.write(spark.sql(last), target):
                    parts.append(target)
            log.debug("%s: the staged changes reduced in %d buckets", uri, buckets)
            return self.view(spark.read.parquet(*parts)) if parts else self.view(spark.sql(last))
        changes = self.view(spark.read.parquet(changes_dir))
        ordered = self.view(spark.sql(m.ordered_changes_sql(changes, key_names, toast_columns, truncates)))
        chain = lake = None
        if toast_columns:
            chain = self.materialized(
                spark.sql(m.toast_chain_sql(ordered, key_names, toast_columns, every_row=every_row)), "chain-0"
            )
            step = 0
            while spark.sql(f"SELECT 1 FROM {chain} WHERE {m.unresolved_sql(chain, toast_columns)} LIMIT 1").collect():
                step += 1
                if step > 64:
                    raise LakeError(f"unchanged TOAST of {uri}: the chain of key changes did not resolve in 64 steps")
                chain = self.materialized(spark.sql(m.resolve_step_sql(chain, toast_columns)), f"chain-{step}")
            if (lookup_version is None or lookup_version >= 0) and engine.lake.delta_version(uri) is not None:
                table = engine.read_version(uri, lookup_version)
                present = set(table.columns)
                cols = [
                    m.quote(c) if c in present else f"NULL AS {m.quote(c)}"
                    for c in dict.fromkeys([*key_names, *toast_columns])
                ]
                lake = self.view(table.selectExpr(*cols, f"true AS {m.PRESENT}"))
        final_sql = m.final_source_sql(
            ordered, chain, lake, key_names, data_columns, toast_columns,
            nullable_keys=nullable_keys, optional=optional, every_row=every_row,
        )
        final = self.materialized(spark.sql(final_sql), "final")
        log.debug("%s: the staged changes with their unchanged TOAST filled", uri)
        if chain is not None:
            lost = spark.sql(f"SELECT {m.LAKE_KEY} FROM {final} WHERE {m.MISSING} LIMIT 1").collect()
            if lost:
                raise DataError(
                    f"cannot recover an unchanged TOAST value in {uri} (row {lost[0][0].asDict()}): the row is "
                    "neither in this window nor in the lake; run pg2delta bootstrap for this table "
                    "or set REPLICA IDENTITY FULL on it"
                )
        return final

    def close(self) -> None:
        spark = self.engine.spark
        for name in self.views:
            try:
                spark.catalog.dropTempView(name)
            except Exception:
                log.debug("could not drop temp view %s", name)
        self.engine.lake.unstage_dir(self.work)
