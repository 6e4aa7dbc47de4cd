"""pg2delta from Airflow with the ``pg2delta`` command on the embedded engine (BashOperator).

Three DAGs:

* ``pg2delta_embedded_run`` — every 5 minutes: ``pg2delta run``, then ``pg2delta status`` (which
  fails the task on an invalidated slot, ``wal_status`` unreserved or lag over the threshold, and
  writes a Prometheus metrics file when asked).
* ``pg2delta_embedded_bootstrap`` — by hand, once: creates the slot and copies every published table.
* ``pg2delta_embedded_backfill`` — by hand, with ``from_lsn``/``to_lsn`` (and ``into``, ``tables``)
  in the run's configuration: replays the changelog.

pg2delta's exit codes (docs/reference/exit-codes.md) become task states:

* 0 — success (a run with nothing to do too);
* 73 — another run holds the slot: the task is *skipped* (the next scheduled run does the work);
* 75 — retryable (server unreachable, connection lost): the task fails and Airflow *retries* it;
* 78, 70 — needs a human / a bug: the task *fails without retries*; retrying cannot help.

Set ``PG2DELTA_BIN`` (the ``pg2delta`` command of the virtual environment pg2delta is installed in)
and ``PG2DELTA_CONFIG`` (its TOML config) in the workers' environment, or pass ``pg2delta`` and
``config`` in a run's configuration. Keep the database password out of the config: libpq reads
``PGPASSWORD``, ``~/.pgpass`` or a service file.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from typing import Any

try:  # Airflow 3
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import DAG, Param
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
except ImportError:  # Airflow 2.10
    from airflow import DAG  # type: ignore[no-redef]
    from airflow.exceptions import AirflowException, AirflowFailException  # type: ignore[no-redef]
    from airflow.models.param import Param  # type: ignore[no-redef]
    from airflow.operators.bash import BashOperator  # type: ignore[no-redef]

EXIT_BUSY = 73  # another run holds the slot
EXIT_NO_RETRY = {78, 70}  # needs a human, a bug in pg2delta

PG2DELTA = os.environ.get("PG2DELTA_BIN", "pg2delta")
CONFIG = os.environ.get("PG2DELTA_CONFIG", "/etc/pg2delta/embedded.toml")
RETRY_DELAY = timedelta(seconds=float(os.environ.get("PG2DELTA_RETRY_DELAY_SECONDS", "60")))


class Pg2DeltaOperator(BashOperator):
    """A pg2delta command: 73 skips the task, 78 and 70 fail it without retries, 75 is retried."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("skip_on_exit_code", [EXIT_BUSY])
        kwargs.setdefault("append_env", True)
        super().__init__(**kwargs)

    def execute(self, context: Any) -> Any:
        try:
            return super().execute(context)
        except AirflowException as exc:
            process = getattr(self.subprocess_hook, "sub_process", None)
            code = getattr(process, "returncode", None)
            if code in EXIT_NO_RETRY:
                raise AirflowFailException(
                    f"pg2delta exited {code}: it needs a human (see the task log's 'pg2delta:' line); not retried"
                ) from exc
            raise


# The command and its arguments reach bash as environment variables, so paths need no quoting.
ENV = {"PG2DELTA": "{{ params.pg2delta }}", "PG2DELTA_CONFIG": "{{ params.config }}"}
COMMON_PARAMS = {
    "pg2delta": Param(PG2DELTA, type="string", description="the pg2delta command"),
    "config": Param(CONFIG, type="string", description="pg2delta's TOML config"),
}

with DAG(
    dag_id="pg2delta_embedded_run",
    description="pg2delta run every 5 minutes on the embedded engine, then pg2delta status",
    schedule=timedelta(minutes=5),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,  # runs on one slot never overlap (a second one would exit 73 anyway)
    params={
        **COMMON_PARAMS,
        "max_lag_bytes": Param(1 << 30, type="integer", minimum=0, description="status fails above this lag"),
        "metrics_file": Param("", type="string", description="a .prom file for node_exporter, or empty"),
    },
    tags=["pg2delta"],
) as run_dag:
    run = Pg2DeltaOperator(
        task_id="run",
        bash_command='"$PG2DELTA" run --config "$PG2DELTA_CONFIG"',
        env=ENV,
        retries=3,
        retry_delay=RETRY_DELAY,
        execution_timeout=timedelta(minutes=30),
    )
    status = Pg2DeltaOperator(
        task_id="status",
        bash_command=(
            'set -- --config "$PG2DELTA_CONFIG" --max-lag-bytes "$MAX_LAG_BYTES"; '
            'if [ -n "$METRICS_FILE" ]; then set -- "$@" --metrics-file "$METRICS_FILE"; fi; '
            '"$PG2DELTA" status "$@"'
        ),
        env={**ENV, "MAX_LAG_BYTES": "{{ params.max_lag_bytes }}", "METRICS_FILE": "{{ params.metrics_file }}"},
        retries=0,  # 10, 11, 12 are states to look at, not failures to retry
    )
    run >> status

with DAG(
    dag_id="pg2delta_embedded_bootstrap",
    description="once, by hand: create the slot and copy every published table into the lake",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    params={**COMMON_PARAMS, "parallel": Param(2, type="integer", minimum=1)},
    tags=["pg2delta"],
) as bootstrap_dag:
    Pg2DeltaOperator(
        task_id="bootstrap",
        bash_command='"$PG2DELTA" bootstrap --config "$PG2DELTA_CONFIG" --parallel "$PARALLEL"',
        env={**ENV, "PARALLEL": "{{ params.parallel }}"},
        # Not retried blindly: once the slot exists a second bootstrap is refused (78); see the
        # docs/commands/bootstrap.md for --resume.
        retries=0,
    )

with DAG(
    dag_id="pg2delta_embedded_backfill",
    description="by hand: replay the changelog's changes of an LSN range, in place or into a copy",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    params={
        **COMMON_PARAMS,
        "from_lsn": Param("0/0", type="string", pattern="^[0-9A-Fa-f]+/[0-9A-Fa-f]+$"),
        "to_lsn": Param("0/0", type="string", pattern="^[0-9A-Fa-f]+/[0-9A-Fa-f]+$"),
        "into": Param("", type="string", description="a lake root for the copy; empty: in place"),
        "tables": Param([], type="array", description="schema.table names; empty: every table with a changelog"),
    },
    tags=["pg2delta"],
) as backfill_dag:
    Pg2DeltaOperator(
        task_id="backfill",
        bash_command=(
            'set -- --config "$PG2DELTA_CONFIG" --from-lsn "$FROM_LSN" --to-lsn "$TO_LSN"; '
            'if [ -n "$INTO" ]; then set -- "$@" --into "$INTO"; fi; '
            'for t in $TABLES; do set -- "$@" --table "$t"; done; '
            '"$PG2DELTA" backfill "$@"'
        ),
        env={
            **ENV,
            "FROM_LSN": "{{ params.from_lsn }}",
            "TO_LSN": "{{ params.to_lsn }}",
            "INTO": "{{ params.into }}",
            "TABLES": "{{ params.tables | join(' ') }}",
        },
        retries=2,  # a backfill reads only the lake; a stopped one continues where it was
        retry_delay=RETRY_DELAY,
    )

with DAG(
    dag_id="pg2delta_embedded_maintain",
    description="daily: compact small files, vacuum, checkpoint, expire changelog rows (docs: operations/maintenance)",
    schedule=timedelta(days=1),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    params=COMMON_PARAMS,
    tags=["pg2delta"],
) as maintain_dag:
    Pg2DeltaOperator(
        task_id="maintain",
        bash_command='"$PG2DELTA" maintain --config "$PG2DELTA_CONFIG"',
        env=ENV,
        # 73 (a run holds the slot's lock) skips the task: tomorrow's maintenance does the work.
        retries=2,
        retry_delay=RETRY_DELAY,
        execution_timeout=timedelta(hours=2),
    )
