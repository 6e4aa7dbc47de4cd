"""``pg2delta bootstrap`` on the cluster's Spark session (engine ``spark`` unless ``--engine`` names another):

    spark-submit --packages io.delta:delta-spark_2.12:3.3.2 jobs/pg2delta_bootstrap.py \
        --config conf/spark.toml [--parallel 4] [--resume]

Exit codes are those of ``pg2delta bootstrap``.
"""

from pg2delta.cli import spark_submit

if __name__ == "__main__":
    spark_submit("bootstrap")
