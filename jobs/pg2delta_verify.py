"""``pg2delta verify`` on the cluster's Spark session (engine ``spark`` unless ``--engine`` names another):

    spark-submit --packages io.delta:delta-spark_2.12:3.3.2 jobs/pg2delta_verify.py \
        --config conf/spark.toml [--table public.orders ...] [--show-values] [--json]

Exit codes are those of ``pg2delta verify`` (0 equal, 20 differs).
"""

from pg2delta.cli import spark_submit

if __name__ == "__main__":
    spark_submit("verify")
