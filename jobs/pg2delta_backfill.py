"""``pg2delta backfill`` on the cluster's Spark session (engine ``spark`` unless ``--engine`` names another):

    spark-submit --packages io.delta:delta-spark_2.12:3.3.2 jobs/pg2delta_backfill.py \
        --config conf/spark.toml --from-lsn A --to-lsn B [--table s.t ...] [--into PATH]

Exit codes are those of ``pg2delta backfill``.
"""

from pg2delta.cli import spark_submit

if __name__ == "__main__":
    spark_submit("backfill")
