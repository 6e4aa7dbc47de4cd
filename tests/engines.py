"""The engine the tests run on: ``PG2DELTA_TEST_ENGINE`` = ``embedded`` (default) or ``spark``.

Every in-process run of a test session shares one engine (one pysail server, or one classic
SparkSession with delta-spark) instead of starting one per run: a classic session costs seconds
to start. Runs in child processes (the CLI, ``spark-submit``) get the same engine kind through
``PG2DELTA_ENGINE``; a classic Spark child finds Delta's jars through ``SPARK_CONF_DIR``
(written by ``make install-spark``, see tools/spark_setup.py).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pg2delta.lake.engine import Engine, EngineConfig, Lake

TEST_ENGINE = os.environ.get("PG2DELTA_TEST_ENGINE", "embedded")
if TEST_ENGINE not in ("embedded", "spark"):
    raise RuntimeError(f"PG2DELTA_TEST_ENGINE={TEST_ENGINE!r}: choose embedded or spark")


class SharedEngine:
    """Stands in for ``Engine.start`` during a test session: one session of the engine under test."""

    def __init__(self) -> None:
        self._first: Engine | None = None
        self._start = Engine.start

    def start(self, config: EngineConfig, lake: Lake) -> Engine:
        if config.kind == "connect":  # a test that names a server of its own
            return self._start(config, lake)
        if self._first is None:
            with _long_lived_jvm():
                self._first = self._start(EngineConfig(kind=TEST_ENGINE, spark_conf=config.spark_conf), lake)
        return self._first.with_lake(lake, deletion_vectors=config.deletion_vectors)

    @property
    def spark(self) -> Any:
        return None if self._first is None else self._first.spark

    def close(self) -> None:
        if self._first is not None:
            self._first.stop()
            self._first = None


@contextmanager
def _long_lived_jvm() -> Iterator[None]:
    """The shared classic session's JVM without ``-XX:TieredStopAtLevel=1``, which the Makefile
    gives the tests' JVMs (``SPARK_SUBMIT_OPTS``): the client compiler alone starts a JVM that lives
    for one CLI run faster, but this one runs every in-process MERGE of the test process, and there
    the full compiler pays (measured: two in-process classic tests took 140 s with it, 101-120 s
    without)."""
    opts = os.environ.get("SPARK_SUBMIT_OPTS")
    if opts is None or "-XX:TieredStopAtLevel=1" not in opts:
        yield
        return
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(o for o in opts.split() if o != "-XX:TieredStopAtLevel=1")
    try:
        yield
    finally:
        os.environ["SPARK_SUBMIT_OPTS"] = opts


def child_env() -> dict[str, str]:
    """Environment entries that make a child process run on the engine under test."""
    return {"PG2DELTA_ENGINE": TEST_ENGINE} if TEST_ENGINE != "embedded" else {}


def spark_properties(s3a: bool = False) -> Path | None:
    """The Spark properties file of the Spark tiers' JVMs, for a ``spark-submit`` a test starts.

    ``make test-spark`` gives its JVMs a fast start (tools/spark_setup.py): an empty
    ``SPARK_CONF_DIR`` and the settings as ``--properties-file`` in ``PYSPARK_SUBMIT_ARGS``, which
    only a session pyspark starts itself reads. ``s3a``: ``spark-s3a.conf`` beside it (hadoop-aws
    and the AWS SDK too). ``None``: no such file (``SPARK_CONF_DIR``'s ``spark-defaults.conf``, if
    any, applies by itself)."""
    args = shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS", ""))
    if "--properties-file" in args[:-1]:
        found = Path(args[args.index("--properties-file") + 1])
    elif os.environ.get("SPARK_CONF_DIR"):
        found = Path(os.environ["SPARK_CONF_DIR"]) / "spark-defaults.conf"
    else:
        return None
    if s3a:
        found = found.with_name("spark-s3a.conf")
    return found if found.is_file() else None


def spark_submit_flags(s3a: bool = False) -> list[str]:
    """``--properties-file <file>`` for a test's ``spark-submit`` (see :func:`spark_properties`)."""
    found = spark_properties(s3a)
    return ["--properties-file", str(found)] if found is not None else []
