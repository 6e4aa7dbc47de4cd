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
"""

from __future__ import annotations

import os
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
