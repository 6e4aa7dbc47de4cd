"""pg2delta from Airflow on Apache Spark + Delta: ``spark-submit jobs/pg2delta_*.py`` through the
SparkSubmitOperator (``apache-airflow-providers-apache-spark``).

Three DAGs, as in ``pg2delta_embedded.py``: ``pg2delta_spark_run`` every 5 minutes,
``pg2delta_spark_bootstrap`` and ``pg2delta_spark_backfill`` by hand (the backfill reads
``from_lsn``, ``to_lsn`` and ``into``, the copy's lake root, from the run's configuration).

The Spark connection (``spark_default``, or ``PG2DELTA_SPARK_CONN_ID``) names the master and
``deploy-mode`` ``client``: pg2delta runs on the driver, whose Python must have pg2delta installed
(``pip install 'pg2delta[spark]'``; ``PG2DELTA_PYTHON`` below). Delta comes from ``packages`` and
its two session configs, as in docs/engines/spark-submit.md's command line; drop them where the
platform loads Delta already.

Exit codes: the SparkSubmitOperator fails the task on any non-zero exit of spark-submit and does
not tell codes apart, so every failure is retried ``retries`` times: right for 75 (retryable) and
73 (another run holds the slot), pointless for 78 (needs a human), which then fails after the
retries. Keep ``retries`` small, and alert on the task's failure. A run with nothing to do exits 0.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

try:  # Airflow 3
    from airflow.sdk import DAG, Param
except ImportError:  # Airflow 2.10
    from airflow import DAG  # type: ignore[no-redef]
    from airflow.models.param import Param  # type: ignore[no-redef]

JOBS = os.environ.get("PG2DELTA_JOBS", "/opt/pg2delta/jobs")  # the repository's jobs/ folder
CONFIG = os.environ.get("PG2DELTA_CONFIG", "/etc/pg2delta/spark.toml")
PYTHON = os.environ.get("PG2DELTA_PYTHON", "/opt/pg2delta/venv/bin/python")  # pg2delta installed here
CONN_ID = os.environ.get("PG2DELTA_SPARK_CONN_ID", "spark_default")
DELTA_PACKAGE = os.environ.get("PG2DELTA_DELTA_PACKAGE", "io.delta:delta-spark_2.12:3.3.2")  # 2.13:4.0.0 on Spark 4

SPARK_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    "spark.pyspark.python": PYTHON,
    "spark.pyspark.driver.python": PYTHON,
}


def pg2delta_job(task_id: str, script: str, args: list[str], **kwargs: object) -> SparkSubmitOperator:
    return SparkSubmitOperator(
        task_id=task_id,
        application=f"{JOBS}/{script}",
        application_args=["--config", CONFIG, *args],
        conn_id=CONN_ID,
        packages=DELTA_PACKAGE,
        conf=SPARK_CONF,
        name=f"pg2delta-{task_id}",
        **kwargs,  # type: ignore[arg-type]
    )


with DAG(
    dag_id="pg2delta_spark_run",
    description="spark-submit jobs/pg2delta_run.py every 5 minutes",
    schedule=timedelta(minutes=5),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["pg2delta"],
) as run_dag:
    pg2delta_job("run", "pg2delta_run.py", [], retries=2, retry_delay=timedelta(minutes=1),
                 execution_timeout=timedelta(minutes=30))

with DAG(
    dag_id="pg2delta_spark_bootstrap",
    description="once, by hand: spark-submit jobs/pg2delta_bootstrap.py",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    tags=["pg2delta"],
) as bootstrap_dag:
    pg2delta_job("bootstrap", "pg2delta_bootstrap.py", [], retries=0)

with DAG(
    dag_id="pg2delta_spark_backfill",
    description="by hand: spark-submit jobs/pg2delta_backfill.py over an LSN range",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    params={
        "from_lsn": Param(type="string", pattern="^[0-9A-Fa-f]+/[0-9A-Fa-f]+$"),
        "to_lsn": Param(type="string", pattern="^[0-9A-Fa-f]+/[0-9A-Fa-f]+$"),
        # Into a copy (an in-place backfill: the embedded DAG, or the CLI).
        "into": Param(type="string", minLength=1, description="lake root of the copy"),
    },
    tags=["pg2delta"],
) as backfill_dag:
    pg2delta_job(
        "backfill", "pg2delta_backfill.py",
        ["--from-lsn", "{{ params.from_lsn }}", "--to-lsn", "{{ params.to_lsn }}", "--into", "{{ params.into }}"],
        retries=2, retry_delay=timedelta(minutes=1),
    )

with DAG(
    dag_id="pg2delta_spark_maintain",
    description="daily: spark-submit jobs/pg2delta_maintain.py (OPTIMIZE, VACUUM, changelog expiry)",
    schedule=timedelta(days=1),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["pg2delta"],
) as maintain_dag:
    pg2delta_job("maintain", "pg2delta_maintain.py", [], retries=2, retry_delay=timedelta(minutes=10),
                 execution_timeout=timedelta(hours=2))
