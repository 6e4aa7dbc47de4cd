"""`make install-spark`: Delta's jars for this venv's pyspark, a Spark config that loads them, and a
class-data archive that starts Spark's JVM in half the time.

Resolves ``io.delta:delta-spark_<scala>:<delta-spark's version>`` (and what it depends on) from
Maven Central with Spark's own ``--packages`` resolution (Ivy) into a cache inside the checkout,
proves them with a Delta round trip, then writes into ``<dir>``:

* ``conf/spark-defaults.conf``: those jars (``spark.jars``), the two Delta session configs and the
  local-mode settings below. Any Spark started with ``SPARK_CONF_DIR=<dir>/conf`` (``spark-submit``,
  the tests, the benchmarks) has Delta without further flags, and without the network once the jars
  are cached. A cluster has its own settings.
* with ``--s3a``, ``conf/spark-s3a.conf``: the same plus hadoop-aws and the AWS SDK bundle it was
  built with (``s3a://`` lakes). They stay out of ``spark-defaults.conf``: the bundle alone is
  280 MB, which every JVM that names it copies to its executor (measured: 1.5-2 s of a 19 s run).
* ``spark.jsa``, a dynamic class-data-sharing archive of the JVM's classes after a training
  ``spark-submit jobs/pg2delta_cds_training.py`` (a session, a Delta write, a ``MERGE`` with
  deletion vectors, a read), and
  ``empty-conf/``. The JVM maps the archive instead of loading and verifying some 20,000 classes
  from jars, but only with the class path it was built with, and refuses a non-empty directory on
  it, such as a ``SPARK_CONF_DIR`` holding ``spark-defaults.conf``. So a fast start reads its
  settings from a properties file instead::

      SPARK_CONF_DIR=<dir>/empty-conf \
      SPARK_SUBMIT_OPTS="-XX:SharedArchiveFile=<dir>/spark.jsa -XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=240m -Xlog:disable -Xlog:all=warning:stderr" \
      spark-submit --properties-file <dir>/conf/spark-defaults.conf jobs/pg2delta_run.py ...

  (``PYSPARK_SUBMIT_ARGS="--properties-file <dir>/conf/spark-defaults.conf pyspark-shell"`` for a
  session pyspark starts itself). An archive that does not match (another JDK, other jars) is
  ignored with a warning and the JVM starts as usual. See docs/engines/spark-submit.md.

    python tools/spark_setup.py [--s3a] .cache/spark35
"""

from __future__ import annotations

import sys
import time
from importlib.metadata import version
from pathlib import Path

LOCAL = {
    "spark.master": "local[2]",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.driver.memory": "2g",
    "spark.sql.session.timeZone": "UTC",
}


def hadoop_version() -> str:
    """The Hadoop version of the installed pyspark's jars (hadoop-aws must match it exactly)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    found = sorted(jars.glob("hadoop-client-api-*.jar"))
    if not found:
        raise SystemExit(f"no hadoop-client-api jar in {jars}")
    return found[-1].name[len("hadoop-client-api-") : -len(".jar")]


def packages(s3a: bool = False) -> str:
    """The Maven coordinates of Delta for the installed pyspark and delta-spark, and with ``s3a``
    Hadoop's S3 connector of the same Hadoop (it brings the AWS SDK bundle it was built with:
    hadoop-aws 3.3.4 and aws-java-sdk-bundle 1.12.262 for Spark 3.5)."""
    scala = "2.13" if int(version("pyspark").split(".")[0]) >= 4 else "2.12"
    coords = [f"io.delta:delta-spark_{scala}:{version('delta-spark')}"]
    if s3a:
        coords.append(f"org.apache.hadoop:hadoop-aws:{hadoop_version()}")
    return ",".join(coords)


def probe(root: Path, coords: str) -> list[str]:
    """Resolves ``coords`` into ``<root>/ivy``, proves them with a Delta round trip in a new JVM,
    and returns the jar files that JVM was given (``sc.listJars()``), in ``<root>/ivy/jars``."""
    import os

    conf_dir = root / "probe-conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    write_properties(conf_dir / "spark-defaults.conf", {"spark.jars.packages": coords, "spark.jars.ivy": str(root / "ivy")})
    os.environ["SPARK_CONF_DIR"] = str(conf_dir)
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.appName("pg2delta-setup").getOrCreate()
    try:  # a Delta round trip proves the jars load
        path = root / "probe"
        spark.range(3).write.format("delta").mode("overwrite").save(str(path))
        n = spark.read.format("delta").load(str(path)).count()
        names = spark.sparkContext._jsc.sc().listJars().mkString("\n").split("\n")
    finally:
        spark.stop()
    jars = sorted(str(root / "ivy" / "jars" / name.rsplit("/", 1)[-1]) for name in names if name)
    if n != 3 or not jars or not all(Path(j).is_file() for j in jars):
        raise SystemExit(f"spark {version('pyspark')} with {coords}: the probe failed ({n} rows, jars {jars})")
    return jars


def write_properties(path: Path, jars: dict[str, str]) -> None:
    """A Spark properties file: ``jars`` (``spark.jars``, or the packages to resolve), Delta's two
    session configs and the local-mode settings."""
    settings = {
        **jars,
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        **LOCAL,
    }
    path.write_text("".join(f"{k} {v}\n" for k, v in settings.items()))


def train_archive(root: Path) -> Path:
    """``<root>/spark.jsa``: the classes of a training spark-submit (see the module's docstring)."""
    import os
    import shutil
    import subprocess
    import tempfile

    archive, empty = root / "spark.jsa", root / "empty-conf"
    empty.mkdir(exist_ok=True)
    archive.unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="pg2delta-cds-"))
    try:
        env = {
            **os.environ,
            "SPARK_CONF_DIR": str(empty),
            "SPARK_SUBMIT_OPTS": f"-XX:ArchiveClassesAtExit={archive} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            "PYSPARK_PYTHON": sys.executable,
        }
        done = subprocess.run(
            [str(Path(sys.executable).parent / "spark-submit"), "--properties-file", str(root / "conf" / "spark-defaults.conf"),
             str(Path(__file__).resolve().parents[1] / "jobs" / "pg2delta_cds_training.py"), str(work)],
            capture_output=True, text=True, env=env, cwd=work, check=False,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if done.returncode != 0 or not archive.is_file():
        raise SystemExit(f"the class-data archive was not written (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return archive


def main(argv: list[str]) -> int:
    import json
    import shutil
    import subprocess

    if argv[:1] == ["--probe"] and len(argv) == 3:  # in a process of its own: one JVM per set of packages
        print(json.dumps(probe(Path(argv[1]), argv[2])))
        return 0
    s3a = "--s3a" in argv
    argv = [a for a in argv if a != "--s3a"]
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    (root / "conf").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def jars_of(coords: str) -> list[str]:
        done = subprocess.run([sys.executable, __file__, "--probe", str(root), coords], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"resolving {coords} failed:\n{done.stderr[-3000:]}")
        return list(json.loads(done.stdout.strip().splitlines()[-1]))

    write_properties(root / "conf" / "spark-defaults.conf", {"spark.jars": ",".join(jars_of(packages()))})
    if s3a:
        write_properties(root / "conf" / "spark-s3a.conf", {"spark.jars": ",".join(jars_of(packages(s3a=True)))})
    archive = train_archive(root)
    shutil.rmtree(root / "probe", ignore_errors=True)
    shutil.rmtree(root / "probe-conf", ignore_errors=True)
    print(f"spark {version('pyspark')} with {packages(s3a)}: ok ({time.monotonic() - t0:.1f} s); "
          f"SPARK_CONF_DIR={root / 'conf'}; class-data archive {archive} ({archive.stat().st_size >> 20} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
