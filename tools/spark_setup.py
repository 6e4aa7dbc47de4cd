"""`make install-spark`: Delta's jars for this venv's pyspark, and a Spark config dir that loads them.

Resolves ``io.delta:delta-spark_<scala>:<delta-spark's version>`` (and what it depends on) from
Maven Central with Spark's own ``--packages`` resolution (Ivy) into a cache inside the checkout,
proves them with a Delta round trip, then writes ``<dir>/conf/spark-defaults.conf`` naming those
jars (``spark.jars``) and the two Delta session configs. Any Spark started with ``SPARK_CONF_DIR=<dir>/conf`` (``spark-submit``, the
tests, the benchmarks) then has Delta without further flags, and without the network once the
jars are cached. The local-mode settings below keep a test session light; a cluster has its own.

    python tools/spark_setup.py [--s3a] .cache/spark35

``--s3a`` adds hadoop-aws (``s3a://`` lakes) to the jars, for the object-store tests.
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


def main(argv: list[str]) -> int:
    s3a = "--s3a" in argv
    argv = [a for a in argv if a != "--s3a"]
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    conf_dir = root / "conf"
    conf_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "spark.jars.packages": packages(s3a),
        "spark.jars.ivy": str(root / "ivy"),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        **LOCAL,
    }
    (conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in settings.items()))
    import os

    os.environ["SPARK_CONF_DIR"] = str(conf_dir)
    from pyspark.sql import SparkSession

    t0 = time.monotonic()
    spark = SparkSession.builder.appName("pg2delta-setup").getOrCreate()
    try:  # a Delta round trip proves the jars load
        path = root / "probe"
        spark.range(3).write.format("delta").mode("overwrite").save(str(path))
        n = spark.read.format("delta").load(str(path)).count()
    finally:
        spark.stop()
    # From now on the cached jars themselves: no resolution (nor network) when a JVM starts.
    jars = sorted(str(p) for p in (root / "ivy" / "jars").glob("*.jar"))
    if n != 3 or not jars:
        print(f"spark {version('pyspark')} with {packages(s3a)}: the probe failed ({n} rows, jars {jars})", file=sys.stderr)
        return 1
    del settings["spark.jars.packages"], settings["spark.jars.ivy"]
    settings["spark.jars"] = ",".join(jars)
    (conf_dir / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in settings.items()))
    print(f"spark {version('pyspark')} with {packages(s3a)}: ok ({time.monotonic() - t0:.1f} s); SPARK_CONF_DIR={conf_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
