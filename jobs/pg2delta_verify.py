"""spark-submit entry point: the same as ``pg2delta verify``, on the cluster's Spark session.

    spark-submit --packages io.delta:delta-spark_2.12:3.3.2 jobs/pg2delta_verify.py \
        --config conf/spark.toml [--table public.orders ...] [--show-values] [--json]

The engine defaults to ``spark`` (a classic session with delta-spark) unless ``--engine``
or the config says otherwise. Exit codes are those of ``pg2delta verify`` (0 equal, 20 differs).
"""

from __future__ import annotations

import sys

from pg2delta.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--engine" not in argv and not any(a.startswith("--engine=") for a in argv):
        argv = [*argv, "--engine", "spark"]
    sys.exit(main(["verify", *argv]))
