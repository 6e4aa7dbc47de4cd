"""A training run for a class-data archive of the driver's JVM (docs/engines/spark-submit.md,
"Faster starts"): what a run asks of Spark and Delta, on a scratch table it creates and removes.

    SPARK_CONF_DIR=<an empty folder> \
    SPARK_SUBMIT_OPTS="-XX:ArchiveClassesAtExit=/opt/pg2delta/spark.jsa -XX:TieredStopAtLevel=1" \
    spark-submit --properties-file /opt/pg2delta/spark.conf jobs/pg2delta_cds_training.py /tmp/pg2delta-training

The JVM writes the archive when it exits. Runs then start with ``-XX:SharedArchiveFile=...`` in
``SPARK_SUBMIT_OPTS``, the same empty ``SPARK_CONF_DIR`` and the same ``--properties-file``.
"""

import shutil
import sys
import uuid
from pathlib import Path

from pyspark.sql import SparkSession


def main(scratch: str) -> None:
    path = str(Path(scratch) / f"table-{uuid.uuid4().hex[:8]}")
    spark = SparkSession.builder.appName("pg2delta-cds-training").getOrCreate()
    try:
        spark.sql(f"CREATE TABLE delta.`{path}` (id BIGINT, v STRING) USING DELTA "
                  "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
        spark.range(1000).selectExpr("id", "CAST(id AS STRING) AS v").write.format("delta").mode("append").save(path)
        spark.range(0, 1200, 7).selectExpr("id", "'u' AS v", "id % 3 = 0 AS gone").createOrReplaceTempView("src")
        spark.sql(f"MERGE INTO delta.`{path}` t USING src s ON t.id = s.id "
                  "WHEN MATCHED AND s.gone THEN DELETE WHEN MATCHED THEN UPDATE SET v = s.v "
                  "WHEN NOT MATCHED AND NOT s.gone THEN INSERT (id, v) VALUES (s.id, s.v)")
        spark.sql(f"DELETE FROM delta.`{path}` WHERE id < 10")
        rows = spark.read.format("delta").load(path).count()
        spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    finally:
        spark.stop()
        shutil.rmtree(path, ignore_errors=True)
    print(f"trained: {rows} rows")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
