"""``pg2delta maintain`` on the cluster's Spark session (engine ``spark`` unless ``--engine`` names another):

    spark-submit --packages io.delta:delta-spark_2.12:3.3.2 jobs/pg2delta_maintain.py \
        --config conf/spark.toml

Exit codes are those of ``pg2delta maintain``.
"""

from pg2delta.cli import spark_submit

if __name__ == "__main__":
    spark_submit("maintain")
