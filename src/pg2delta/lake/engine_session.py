"""The Spark session under the engine, and what differs between the engines.

Starting one of the three engines (:func:`open_session`: pysail in this process, Apache Spark
with delta-spark, a Spark Connect server: Apache Spark's own, which gets Apache Spark's paths, or
another such as pysail's, which gets the embedded engine's) and :class:`EngineSession`, the base every part of
:class:`pg2delta.lake.engine.Engine` builds on: this thread's session, SQL whose failures become
:class:`LakeError`, Delta's idempotent-write settings, and the few SQL spellings that differ.
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pg2delta.config import ENGINES, EngineConfig
from pg2delta.errors import ConfigError, EngineUnavailable, LakeError, engine_unavailable
from pg2delta.lake.foreign import MARK, USER_METADATA
from pg2delta.lake.lake_files import Lake

log = logging.getLogger("pg2delta.lake.engine")

# Bytes per Parquet file the embedded engine writes into a Delta table. pysail's Delta writer
# keeps a file's rows in memory (row groups of a million rows) until it closes the file, so the
# file's size bounds what each of its writers holds: measured on a spilled window of 5,000,000
# inserts (bench/README.md), the append's peak fell by about 250 MB. ``pg2delta maintain``
# compacts them into larger files.
EMBEDDED_FILE_BYTES = 32 << 20


# pyspark 3.5's Spark Connect client deadlocks when a SparkSession is garbage-collected on one of
# its own release threads: __del__ closes the client, which joins the class-wide thread pool it is
# running on while SparkSession.stop() in the main thread holds the pool's lock (seen here with
# pyspark 3.5.9 after a few runs in one process; pyspark 4 no longer joins). Connect sessions are
# therefore kept referenced until the process exits, so their __del__ never runs mid-run: one per
# run, stopped, a few kilobytes each.
_CONNECT_SESSIONS: list[Any] = []

# pyspark's Spark Connect client retries a call that finds no server (gRPC UNAVAILABLE: the server
# killed or restarting, its host unreachable) 15 times over about ten minutes, waits from 50 ms
# growing 4 times up to 60 s (pyspark 3.5's retry_policy and 4.x's DefaultPolicy alike). On
# pg2delta's sessions the waits stop growing at CONNECT_MAX_WAIT_MS and add up to at most
# [engine] connect_retry_seconds; then the call's error ends the run with 75 (errors.engine_unavailable).
CONNECT_MAX_WAIT_MS = 5000
# A setting every session of a run on Apache Spark's Spark Connect server holds: a server that
# restarted since serves a new, empty session under the run's session id (Spark 3.5's silently,
# without the run's settings and views), which this tells apart before each statement.
SESSION_MARK = "pg2delta.session"

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
    # Every commit of the session says it is pg2delta's (pg2delta.lake.foreign): SQL ones too.
    USER_METADATA: MARK,
}


# Hadoop s3a's retries against a throttling or failing object store (S3 503 SlowDown, 500, a cut or
# hung connection), bounded so that a store that keeps failing ends the run in a couple of minutes
# (exit 75) instead of hours: hadoop-aws 3.3's defaults nest 21 AWS SDK attempts (fs.s3a.attempts.maximum,
# its own backoff up to 20 s each) inside 21 s3a attempts for a throttled request whose backoff
# doubles without a cap from 100 ms (fs.s3a.retry.throttle.*), and wait 200 s for a silent socket.
# Measured against a proxy answering 503 (docs/operations/faults.md). Milliseconds without a suffix:
# what the AWS SDK v1 builds (Hadoop 3.3) read too. Set only where nothing else did: core-site.xml,
# spark.hadoop.* (spark-defaults.conf, --conf, [engine.spark_conf]) and per-bucket settings win.
S3A_RETRIES = {
    "fs.s3a.attempts.maximum": "3",
    "fs.s3a.retry.throttle.limit": "6",
    "fs.s3a.retry.throttle.interval": "500",
    "fs.s3a.retry.limit": "4",
    "fs.s3a.retry.interval": "500",
    "fs.s3a.connection.timeout": "60000",
}


def s3a_retry_defaults(hadoop: Any) -> None:
    """:data:`S3A_RETRIES` into ``hadoop``, a session's Hadoop configuration (a JVM object), each
    where only Hadoop's own default (core-default.xml) names it; before the first ``s3a://`` access
    creates its file system."""
    for key, value in S3A_RETRIES.items():
        sources = hadoop.getPropertySources(key)
        if sources is None or all(str(source) == "core-default.xml" for source in sources):
            hadoop.set(key, value, "pg2delta")


# Delta's idempotent-write identifiers as session settings: a MERGE, DELETE or append made with
# them is skipped by Delta itself when the table already recorded a transaction of that app id
# with a version at least as high (delta-io/delta#1555, Delta 2.3 and later).
# When Delta's MERGE copies its source before reading it (auto: a source that is not a Delta table).
MATERIALIZE_SOURCE = "spark.databricks.delta.merge.materializeSource"

TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"


@dataclass(frozen=True, slots=True)
class Txn:
    """An idempotent-write identifier: the application and its monotonically growing version."""

    app_id: str
    version: int


@dataclass(frozen=True, slots=True)
class AppendRows:
    """What a statement builder returns instead of a MERGE for a table that held no row before the
    commit: append the source's rows matching ``where`` (Spark SQL), its ``columns``. Cheaper in time
    and memory than a MERGE, whose join would find nothing (a new table's first window)."""

    columns: tuple[str, ...]
    where: str
    source: str | None = None  # Spark SQL of the rows (a subquery over the view); None: the view itself


@dataclass(frozen=True, slots=True)
class MergeRows:
    """What a statement builder returns for a table that holds rows: the ``MERGE INTO`` of a
    window's final rows (``statement``), and what it does, so that the engine may commit the same
    rows another way (see :mod:`pg2delta.lake.engine_commits`): the source's rows are one per
    ``key_names`` with their ``columns`` and the op column; a delete removes the table's row of its
    key, any other op replaces it (or inserts it); ``truncate``: rows the source lacks are removed
    too. ``nullable_keys``: keys are matched null-safely. ``bounded``: the same ``MERGE`` with the
    source's key range as a condition on the table in its ``ON`` clause, when the caller knows the
    range (see :func:`pg2delta.apply.merge.merge_statement`), which Apache Spark commits instead.
    ``inserts_only``: every row is an insert that no row of the table can match, and a replay
    cannot land them twice (the caller's word, see :func:`pg2delta.apply.table._commit_kind`): the
    engine may append them without reading the table's state, under no idempotent-write id
    (:meth:`pg2delta.lake.engine_commits.Commits._commit_merge`). ``keys``: the source's keys, one
    per row, where one key column of integers or strings holds at most a few thousand, with which
    Apache Spark commits the rows as an overwrite of those keys (``Commits._replace_keys``)."""

    statement: str
    key_names: tuple[str, ...]
    columns: tuple[str, ...]
    truncate: bool
    nullable_keys: bool
    bounded: str | None = None
    inserts_only: bool = False
    keys: tuple[int, ...] | tuple[str, ...] | None = None


def _delta_jars_named(conf: dict[str, str]) -> bool:
    """Whether Spark will have jars it was told about: under ``spark-submit`` (the JVM is up, with
    its ``--packages``/``--jars``), ``spark.jars``/``spark.jars.packages`` in the config, pyspark's
    ``PYSPARK_SUBMIT_ARGS`` (``--jars``, ``--packages``, or a ``--properties-file`` naming them,
    which replaces ``spark-defaults.conf``), else Spark's own ``spark-defaults.conf``
    (``SPARK_CONF_DIR``, else ``SPARK_HOME/conf``)."""
    if "PYSPARK_GATEWAY_PORT" in os.environ or {"spark.jars", "spark.jars.packages"} & set(conf):
        return True
    submit_args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    if {"--jars", "--packages"} & set(submit_args):
        return True
    if "--properties-file" in submit_args[:-1]:  # replaces spark-defaults.conf (spark-submit's rule)
        return _names_jars(submit_args[submit_args.index("--properties-file") + 1])
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (
        os.path.join(os.environ["SPARK_HOME"], "conf") if os.environ.get("SPARK_HOME") else None
    )
    return conf_dir is not None and _names_jars(os.path.join(conf_dir, "spark-defaults.conf"))


def _names_jars(properties_file: str) -> bool:
    """Whether a Spark properties file sets ``spark.jars`` or ``spark.jars.packages``."""
    try:
        with open(properties_file, encoding="utf-8") as f:
            keys = {line.split(None, 1)[0] for line in f if line.strip() and not line.lstrip().startswith("#")}
    except OSError:
        return False
    return bool({"spark.jars", "spark.jars.packages"} & keys)


@dataclass(frozen=True, slots=True)
class OpenedSession:
    """A started session: the SparkSession, how to stop what was started for it, whether Apache
    Spark with delta-spark runs its statements (``classic``: a classic session in this process, or
    with ``remote`` Apache Spark's Spark Connect server), how another thread gets a session of its
    own (``new_session``; None: the threads share this one), and the SQL settings those need too."""

    spark: Any
    stop: Callable[[], None] | None = None
    classic: bool = False
    embedded: bool = False  # pysail in this process: the lake's files are this process's files too
    session_conf: dict[str, str] = field(default_factory=dict)
    remote: bool = False  # Apache Spark's driver is a Spark Connect server: no SparkContext here
    new_session: Callable[[], Any] | None = None
    lost: Callable[[], None] | None = None  # a Spark Connect server lost: its sessions' calls no longer retry


def open_session(config: EngineConfig) -> OpenedSession:
    """Start the engine ``config`` names; :class:`ConfigError` when it is unknown or not installed."""
    # pyspark warns about the installed pandas version on import, which we never use.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark(\.|$)")
    # pyspark 3.5's Connect client warns, in several lines, of each release of a server's results that
    # failed (a lost server: the run's one line says so; the server drops an abandoned operation).
    warnings.filterwarnings("ignore", message="ReleaseExecute failed", category=UserWarning)
    if config.kind not in ENGINES:
        raise ConfigError(f"unknown engine {config.kind!r}; choose one of {', '.join(ENGINES)}")
    try:
        if config.kind == "embedded":
            return _open_embedded()
        if config.kind == "connect":
            return _open_connect(config)
        return _open_classic(config)
    except ImportError as exc:
        extra = "embedded" if config.kind != "spark" else "spark"
        raise ConfigError(f"engine {config.kind!r} is not installed: {exc} (pip install 'pg2delta[{extra}]')") from exc


def _open_embedded() -> OpenedSession:
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

    return OpenedSession(spark, stop=stop, embedded=True)


def _marked_conf(config: EngineConfig) -> dict[str, str]:
    """``[engine.spark_conf]``, its commits' user metadata starting with pg2delta's mark (the
    config's own text after it)."""
    conf = dict(config.spark_conf)
    if not conf.get(USER_METADATA, MARK).startswith(MARK):
        conf[USER_METADATA] = f"{MARK}: {conf[USER_METADATA]}"
    return conf


def apache_spark(spark: Any) -> bool:
    """Whether the Spark Connect server behind ``spark`` is Apache Spark: its SQL ``version()``
    starts with the version it answers the client's version request with. pysail answers that
    request with the client's own version and ``version()`` with its own (``0.7.2``)."""
    try:
        found = str(spark.sql("SELECT version()").collect()[0][0]).split()
        return bool(found) and found[0] == str(spark.version)
    except Exception:  # a server without version(): not Apache Spark
        return False


def _reachable(remote: str, timeout: float = 10.0) -> None:
    """:class:`EngineUnavailable` (exit 75) unless the Spark Connect server at ``remote``
    (``sc://host[:port][/;params]``, port 15002 unless named) accepts a connection within
    ``timeout`` seconds: at once, not after the client's retries (``connect_retry_seconds``)."""
    import socket
    from urllib.parse import urlsplit

    try:
        url = urlsplit(remote.split("/;", 1)[0])
        host, port = url.hostname, url.port or 15002
    except ValueError as exc:
        raise ConfigError(f"engine 'connect': remote {remote!r} is not sc://host:port ({exc})") from exc
    if url.scheme != "sc" or not host:
        raise ConfigError(f"engine 'connect': remote {remote!r} is not sc://host:port")
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise EngineUnavailable(f"cannot reach the Spark Connect server at {remote}: {exc}") from exc


def connect_retries(seconds: float) -> int:
    """How many retries pyspark's Connect client makes on pg2delta's sessions: its waits (from 50 ms,
    4 times longer each, at most :data:`CONNECT_MAX_WAIT_MS`) add up to at most ``seconds``."""
    retries, total, wait = 0, 0, 50
    while total + wait <= seconds * 1000:
        retries, total, wait = retries + 1, total + wait, min(wait * 4, CONNECT_MAX_WAIT_MS)
    return retries


def _bound_retries(spark: Any, seconds: float) -> None:
    """A Connect session's client retries for at most about ``seconds`` (:func:`connect_retries`)."""
    client, retries = spark.client, connect_retries(seconds)
    if hasattr(client, "set_retry_policies"):  # pyspark 4
        from pyspark.sql.connect.client.retries import DefaultPolicy

        client.set_retry_policies([DefaultPolicy(max_retries=retries, max_backoff=CONNECT_MAX_WAIT_MS)])
    else:  # pyspark 3.5: the policy its calls and reattached executions read, a dict
        client._retry_policy.update(max_retries=retries, max_backoff=CONNECT_MAX_WAIT_MS)


def _open_connect(config: EngineConfig) -> OpenedSession:
    """A Spark Connect server's session. Apache Spark's server (with delta-spark: its SQL extension
    and catalog in the server's settings, docs/engines/connect.md) gets Apache Spark's statements
    and a session per thread, each with the classic session's SQL settings and
    ``[engine.spark_conf]`` (settings the server takes per session); another server (pysail's)
    the embedded engine's, on one shared session."""
    if not config.remote:
        raise ConfigError("engine 'connect' needs remote = \"sc://host:port\"")
    remote = config.remote
    _reachable(remote)
    from pyspark.sql import SparkSession

    opened: list[Any] = []

    def session() -> Any:
        made = SparkSession.builder.remote(remote).create()
        _bound_retries(made, config.connect_retry_seconds)
        _CONNECT_SESSIONS.append(made)
        opened.append(made)
        return made

    def lost() -> None:  # the cleanup after a call that found the server lost (views dropped, ...) fails at once
        for made in opened:
            _bound_retries(made, 0)

    def stop() -> None:
        lost()  # closing waits for the release of the session's results: not for a lost server
        for made in opened:
            made.stop()

    spark = session()
    if not apache_spark(spark):
        spark.conf.set(USER_METADATA, MARK)  # the mark of its SQL commits where the server has Delta's setting
        return OpenedSession(spark, stop=stop, lost=lost)
    conf = _marked_conf(config)
    session_conf = {**_CLASSIC_SQL_CONF, **conf, SESSION_MARK: uuid.uuid4().hex}
    for key, value in list(session_conf.items()):
        try:
            spark.conf.set(key, value)
        except Exception as exc:  # a static setting: the server's own (spark.master, spark.jars, ...)
            del session_conf[key]
            log.warning("[engine.spark_conf] %s is the Spark Connect server's to set, not a session's: ignored (%s)",
                        key, " ".join(str(exc).split())[:200])
    return OpenedSession(spark, stop=stop, classic=True, session_conf=session_conf, remote=True, new_session=session,
                         lost=lost)


def _open_classic(config: EngineConfig) -> OpenedSession:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(config.app_name)
    conf = _marked_conf(config)
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
    # A process that inherited pyspark's Spark Connect mode (set by a Connect session in its parent)
    # would take the classic builder for a Connect one and fail without a URL.
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)
    spark = builder.getOrCreate()
    s3a_retry_defaults(spark.sparkContext._jsc.hadoopConfiguration())
    session_conf = {k: v for k, v in _CLASSIC_SQL_CONF.items() if k not in conf}
    for key, value in session_conf.items():
        spark.conf.set(key, value)
    return OpenedSession(spark, classic=True, session_conf=session_conf, new_session=spark.newSession)


class EngineSession:
    """The session the engine's parts share, and the helpers they all use.

    Safe to use from several threads at once (``Job`` merges independent tables concurrently).
    Apache Spark gives every other thread a session of its own (a classic session's
    ``newSession()``: the same SparkContext, its own SQL settings and temporary views; on Apache
    Spark's Spark Connect server a new session of the server), so the per-statement
    idempotent-write settings of one thread never reach another's statement. pysail's session
    (embedded, or a pysail server at ``connect``) is shared: its statements carry no per-thread settings.
    ``classic``: Apache Spark with delta-spark runs the statements, in this process or (``remote``)
    in a Spark Connect server.
    """

    def __init__(
        self,
        spark: Any,
        lake: Lake,
        *,
        stop: Any = None,
        classic: bool = False,
        embedded: bool = False,
        session_conf: dict[str, str] | None = None,
        deletion_vectors: bool = True,
        remote: bool = False,
        new_session: Callable[[], Any] | None = None,
        lost: Callable[[], None] | None = None,
    ) -> None:
        self._main = spark
        self._lost = lost
        self.remote = remote
        self._new_session = new_session
        self.lake = lake
        self._stop = stop
        self.classic = classic
        self.embedded = embedded
        # Tables this engine creates use deletion vectors (EngineConfig.deletion_vectors), pysail's
        # too: it takes the property as an option of the creating writer (docs/concepts/deletion-vectors.md).
        self.deletion_vectors = deletion_vectors
        self._session_conf = dict(session_conf or {})
        self._owner = threading.get_ident()
        self._local = threading.local()
        # Old versions read from their files: (uri, version) -> the files to read, some of them
        # copies under the staging area (DeltaReads._read_version), removed when the engine stops.
        self._version_copies: dict[tuple[str, int], list[str]] = {}
        self._copies_folder = f"versions-{uuid.uuid4().hex}"
        # Per table, the columns (old, new) its window renames after reading its unchanged TOAST
        # (DeltaReads.renaming, pg2delta.lake.engine_reads.names_then).
        self._renaming: dict[str, list[tuple[str, str]]] = {}

    def adopt(self) -> None:
        """The calling thread uses the main session from now on (an engine started in a background
        thread, :meth:`pg2delta.apply.lakeside.Lakeside.start_engine_early`, is handed to the thread
        that asks for it first)."""
        self._owner = threading.get_ident()

    @property
    def spark(self) -> Any:
        """This thread's session: the main one, or on Apache Spark in another thread its own."""
        if self._new_session is None or threading.get_ident() == self._owner:
            return self._main
        session = getattr(self._local, "spark", None)
        if session is None:
            session = self._new_session()
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
        self._same_session()
        conf = self.spark.conf
        conf.set(TXN_APP_ID, txn.app_id)
        conf.set(TXN_VERSION, str(txn.version))
        try:
            yield
        finally:
            conf.unset(TXN_APP_ID)
            conf.unset(TXN_VERSION)

    @contextmanager
    def _source_as_is(self) -> Iterator[None]:
        """A ``MERGE`` in this block reads its source as it is (Apache Spark; unless the session
        sets :data:`MATERIALIZE_SOURCE` itself): Delta would otherwise copy a source that is not a
        Delta table into the executors' storage first, a Spark job of its own, to guard against a
        source that changes between the ``MERGE``'s two reads of it. pg2delta's sources are staged
        Parquet files nothing rewrites while the ``MERGE`` runs."""
        conf = self.spark.conf if self.classic else None
        if conf is None or conf.get(MATERIALIZE_SOURCE, None) is not None:
            yield
            return
        conf.set(MATERIALIZE_SOURCE, "none")
        try:
            yield
        finally:
            conf.unset(MATERIALIZE_SOURCE)

    def stop(self) -> None:
        try:
            if self._stop is not None:
                self._stop()
        finally:
            if self._version_copies:
                self.lake.unstage_dir(self._copies_folder)
                self._version_copies.clear()

    def delta_writer(self, df: Any, mode: str) -> Any:
        """``df.write`` into a Delta table with ``mode``, in files of at most about
        :data:`EMBEDDED_FILE_BYTES` on the embedded engine (Apache Spark's writer flushes its row
        groups as it goes, and sizes its files by its own settings)."""
        self._same_session()
        writer = df.write.format("delta").mode(mode).option("userMetadata", MARK)  # pg2delta.lake.foreign
        if self.embedded:
            writer = writer.option("target_file_size", str(EMBEDDED_FILE_BYTES))
        return writer

    def read_staged(self, staged: str) -> Any:
        """``spark.read.parquet`` of a staged Parquet file (:meth:`Lake.stage`). On Apache Spark its
        schema is given, read from the file's footer with pyarrow and mapped as Spark's own inference
        maps it (a timestamp without time zone as ``timestamp_ntz``): the inference is a Spark job.
        A type pyspark does not map from Arrow leaves it to the inference."""
        reader = self.spark.read
        if self.classic and staged.endswith(".parquet"):
            import pyarrow.parquet as pq
            from pyspark.sql.pandas.types import from_arrow_schema
            from pyspark.sql.types import StructField, StructType

            try:
                with self.lake.fs.open_input_file(self.lake.fs_path(staged)) as footer:
                    arrow = pq.read_schema(footer)
                mapped = from_arrow_schema(arrow, prefer_timestamp_ntz=True)
                reader = reader.schema(StructType([StructField(f.name, f.dataType, True) for f in mapped.fields]))
            except Exception:  # an Arrow type pyspark does not map (time, ...): Spark infers it
                reader = self.spark.read
        return reader.parquet(staged)

    @staticmethod
    def _delta_rs(uri: str) -> Any:
        """The Delta table at ``uri`` through delta-rs: what pysail lacks (Delta's maintenance
        commands, table properties of an existing table) comes from Delta's Rust implementation."""
        from deltalake import DeltaTable

        return DeltaTable("s3://" + uri[len("s3a://"):] if uri.startswith("s3a://") else uri)

    @staticmethod
    def _marked() -> Any:
        """delta-rs's commit properties of pg2delta's commits: the mark (pg2delta.lake.foreign.MARK)."""
        from deltalake import CommitProperties

        return CommitProperties(custom_metadata={"userMetadata": MARK})

    def nan_safe_keys(self, schema: Any, key_names: Sequence[str]) -> frozenset[str]:
        """The key columns of ``schema`` (a Spark ``StructType``) that joins with a Delta table must
        match NaN-safely (pg2delta.lake.sql.key_equal): the float ones, on pysail. Apache Spark
        does not trust float statistics as bounds of NaN."""
        if self.classic:
            return frozenset()
        from pyspark.sql import types as T

        floats = {f.name for f in schema.fields if isinstance(f.dataType, (T.FloatType, T.DoubleType))}
        return frozenset(k for k in key_names if k in floats)

    # --- SQL ------------------------------------------------------------------------------

    @staticmethod
    def target(uri: str) -> str:
        return "delta.`" + uri.replace("`", "``") + "`"

    def _same_session(self) -> None:
        """On Apache Spark's Spark Connect server, :class:`EngineUnavailable` unless this thread's
        session still holds the run's :data:`SESSION_MARK`: the server restarted during the run and
        lost the session's settings and views, so nothing more is sent."""
        mark = self._session_conf.get(SESSION_MARK) if self.remote else None
        try:
            found = None if mark is None else self.spark.conf.get(SESSION_MARK, None)
        except Exception as exc:
            self._gone(exc)
            raise
        if found != mark:
            self._gone(None)
            raise EngineUnavailable("the Spark Connect server restarted during the run and lost its session (settings, "
                                    "views): nothing more was sent; run again (the slot did not move past the lake)")

    def _gone(self, exc: BaseException | None) -> None:
        """After ``exc`` (None: a session lost), when it says the Spark Connect server is lost, the
        calls that follow (the failed window's cleanup) no longer wait out the client's retries."""
        if self._lost is not None and (exc is None or engine_unavailable(exc)):
            self._lost()

    def _sql(self, statement: str, what: str) -> list[Any]:
        self._same_session()
        try:
            return list(self.spark.sql(statement).collect())
        except Exception as exc:  # pyspark raises many unrelated types; keep the cause chain
            self._gone(exc)
            raise LakeError(f"{what} failed: {' '.join(str(exc).split())[:500]}") from exc

    def query(self, statement: str, what: str) -> list[Any]:
        """The rows of a (small: aggregates, a few rows) Spark SQL query; :class:`LakeError` on failure."""
        return self._sql(statement, what)

    def decimal_text(self, expr: str, scale: int) -> str:
        """Spark SQL for the plain text of a decimal with ``scale`` digits (``-0.0500``, never ``5.00E-2``).

        Apache Spark prints small decimals and zeros with a scale in scientific notation (Java's
        ``BigDecimal.toString``); ``format_number`` is exact for decimals there. pysail casts plainly,
        and its ``format_number`` goes through a double (wrong past 15 digits).
        """
        if self.classic:
            return f"replace(format_number({expr}, {scale}), ',', '')"
        return f"CAST({expr} AS STRING)"
