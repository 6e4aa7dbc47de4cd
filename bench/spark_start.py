"""How the benchmarks start Apache Spark's driver JVM (docs/engines/spark-submit.md, "Faster starts").

``make install-spark`` (tools/spark_setup.py) leaves in its cache folder ``conf/spark-defaults.conf``
(Delta's jars, ``local[2]``), ``conf/spark-s3a.conf`` (the same plus hadoop-aws and the AWS SDK),
``empty-conf/`` and the class-data archive ``spark.jsa``. A :class:`SparkStart` is one way to start
with them, for a ``spark-submit`` (:meth:`SparkStart.env` and :meth:`SparkStart.flags`) and for a
session pyspark starts itself in a child process (the same :meth:`SparkStart.env`):

* ``fast``: what the docs recommend for scheduled runs and ``make test-spark`` uses (the
  Makefile's ``FAST_JVM``): the archive, the client compiler alone with the full compiler's code
  cache (240 MB, not its own 48 MB), the serial collector, the settings as ``--properties-file``
  beside an empty ``SPARK_CONF_DIR``;
* ``tiered``: the same with the full (tiered) compiler, for JVMs that live long (a backfill);
* ``plain``: ``SPARK_CONF_DIR`` holding ``spark-defaults.conf``, no JVM options.

:class:`ConnectServer` starts Apache Spark's Spark Connect server with one of them: a driver that
outlives the runs, which ``pg2delta run --engine connect`` processes use in turn (the tests use it too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STARTS = ("fast", "tiered", "plain")


@dataclass(frozen=True)
class SparkStart:
    """How a spark-submit (or a session pyspark starts) starts: one of :data:`STARTS`."""

    name: str
    cache: Path  # make install-spark's: conf/spark-defaults.conf, conf/spark-s3a.conf, empty-conf/, spark.jsa

    def __post_init__(self) -> None:
        if self.name not in STARTS:
            raise ValueError(f"unknown Spark start {self.name!r} (one of {', '.join(STARTS)})")

    def properties(self, s3a: bool = False) -> Path:
        """The settings file: Delta's jars, and with ``s3a`` hadoop-aws and the AWS SDK too."""
        return self.cache / "conf" / ("spark-s3a.conf" if s3a else "spark-defaults.conf")

    def jvm_options(self) -> str:
        """``SPARK_SUBMIT_OPTS`` of the driver JVM ("" for ``plain``)."""
        if self.name == "plain":
            return ""
        client_only = " -XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m" if self.name == "fast" else ""
        return (f"-XX:SharedArchiveFile={self.cache / 'spark.jsa'}{client_only} -XX:+UseSerialGC "
                "-Xlog:disable -Xlog:all=warning:stderr")

    def env(self, python: str | Path, s3a: bool = False) -> dict[str, str]:
        """The environment of a child process that starts Spark: this one's without pg2delta's,
        PostgreSQL's and Spark's variables, ``python`` as the executors' (where pyspark and pg2delta
        are), and this start's settings (``PYSPARK_SUBMIT_ARGS`` for a session pyspark starts itself,
        which a ``spark-submit``'s driver ignores)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG", "SPARK_", "PYSPARK_"))}
        env["PYSPARK_PYTHON"] = str(python)
        if self.name == "plain":
            env["SPARK_CONF_DIR"] = str(self.cache / "conf")
            if s3a:
                env["PYSPARK_SUBMIT_ARGS"] = f"--properties-file {self.properties(s3a=True)} pyspark-shell"
        else:
            env["SPARK_CONF_DIR"] = str(self.cache / "empty-conf")
            env["SPARK_SUBMIT_OPTS"] = self.jvm_options()
            env["PYSPARK_SUBMIT_ARGS"] = f"--properties-file {self.properties(s3a)} pyspark-shell"
        return env

    def flags(self, jars: tuple[str, ...] = (), s3a: bool = False) -> list[str]:
        """spark-submit's flags: the settings file (always with ``s3a``, else for the starts beside
        an empty ``SPARK_CONF_DIR``), and ``jars`` added to Delta's."""
        flags = ["--properties-file", str(self.properties(s3a))] if s3a or self.name != "plain" else []
        if jars:  # --jars replaces spark.jars: name Delta's too
            delta = next(line.split(None, 1)[1].strip() for line in self.properties(s3a).read_text().splitlines()
                         if line.startswith("spark.jars "))
            flags += ["--jars", ",".join((delta, *jars))]
        return flags

    def check(self) -> None:
        """SystemExit unless ``make install-spark`` left what this start needs."""
        for needed in (self.properties(), self.cache / "spark.jsa", self.cache / "empty-conf"):
            if not needed.exists():
                raise SystemExit(f"no {needed} (make install-spark)")


# Apache Spark's Spark Connect server (docs/engines/connect.md): a driver that outlives the runs.
CONNECT_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def connect_jar(spark_submit: str | Path, cache: Path, env: dict[str, str]) -> str | None:
    """The Spark Connect server's jar for the pyspark beside ``spark_submit``: None from Spark 4 on
    (it ships with Spark); for Spark 3.5 ``org.apache.spark:spark-connect_2.12`` of pyspark's version,
    else of the newest earlier patch release Maven Central has (not every pyspark release has one
    there), from the Ivy cache of ``make install-spark`` (``cache``), resolved into it by an
    untimed ``spark-submit --packages`` if not there yet."""
    python = Path(spark_submit).parent / "python"
    found = subprocess.run([str(python), "-c", "import pyspark; print(pyspark.__version__)"],
                           capture_output=True, text=True, check=True, env=env).stdout.strip()
    major, minor, patch = (int(p) for p in found.split(".")[:3])
    if major >= 4:
        return None
    jars = cache / "ivy" / "jars"
    for release in range(patch, -1, -1):
        jar = jars / f"org.apache.spark_spark-connect_2.12-{major}.{minor}.{release}.jar"
        if jar.is_file():
            return str(jar)
    with tempfile.TemporaryDirectory(prefix="pg2delta-connect-jar-") as work:
        (Path(work) / "nothing.py").write_text("")
        for release in range(patch, -1, -1):
            subprocess.run([str(spark_submit), "--packages", f"org.apache.spark:spark-connect_2.12:{major}.{minor}.{release}",
                            "--conf", f"spark.jars.ivy={cache / 'ivy'}", str(Path(work) / "nothing.py")],
                           capture_output=True, check=False, env=env, cwd=work)
            jar = jars / f"org.apache.spark_spark-connect_2.12-{major}.{minor}.{release}.jar"
            if jar.is_file():
                return str(jar)
    raise RuntimeError(f"no org.apache.spark:spark-connect_2.12:{major}.{minor}.x could be resolved into {jars}")


@dataclass
class ConnectServer:
    """A running Spark Connect server of Apache Spark with Delta (``local[2]``, the settings of
    ``make install-spark``), in a process group of its own; :meth:`stop` ends it."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def remote(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, spark_submit: str | Path, start: SparkStart, log: Path, *, jars: tuple[str, ...] = (),
              timeout: float = 300.0, port: int | None = None) -> ConnectServer:
        """``spark-submit --class SparkConnectServer`` with ``start``'s settings (its JVM options:
        ``tiered`` suits a long-lived driver), Delta's jars and ``jars``, on ``port`` (a free one
        unless named: a restarted server's); returns once the server answers (``timeout`` seconds,
        else RuntimeError with the log's end)."""
        python = Path(spark_submit).parent / "python"
        env = start.env(python)
        env["PATH"] = f"{Path(spark_submit).parent}{os.pathsep}{env.get('PATH', '')}"
        found = connect_jar(spark_submit, start.cache, env)
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        argv = [str(spark_submit), "--class", CONNECT_CLASS, "--name", "pg2delta-connect",
                *start.flags(tuple(j for j in (*jars, found) if j)),
                "--conf", f"spark.connect.grpc.binding.port={port}", "spark-internal"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        server = cls(proc, port, log)
        deadline = time.monotonic() + timeout
        while "Spark Connect server started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"the Spark Connect server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        return server

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 30 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
