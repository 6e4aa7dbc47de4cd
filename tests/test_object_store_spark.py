"""Apache Spark with the lake at ``s3a://`` on the S3-compatible server, through ``spark-submit``.

hadoop-aws (and the AWS SDK bundle it was built with) comes from Maven Central with Delta's jars
(``tools/spark_setup.py --s3a``, in ``spark-s3a.conf`` beside ``spark-defaults.conf``); the store's endpoint and credentials only
as the standard ``AWS_*`` variables: pg2delta gives s3a the endpoint, path-style access and TLS
settings (pg2delta.config.s3a_settings), s3a takes the credentials from the environment itself.
A run killed between its tables' commits and run again, then ``verify``; the lake read back by
delta-rs with the object store's options and compared with PostgreSQL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from changelog_support import setup_source
from engines import TEST_ENGINE, spark_properties, spark_submit_flags
from pg2delta.faults import FAULT_ENV
from s3server import S3Server
from test_object_store import assert_s3_lake_matches
from workload import TABLES, Workload, confirmed_lsn

REPO = Path(__file__).resolve().parents[1]
SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.classic,
    pytest.mark.deploy,
    pytest.mark.skipif(
        TEST_ENGINE != "spark" or not SPARK_SUBMIT.exists() or spark_properties(s3a=True) is None,
        reason="spark-submit with hadoop-aws comes with make install-spark (make test-spark)",
    ),
]


def _submit(job: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``spark-submit jobs/<job> ...`` with the jars of ``make install-spark``'s ``spark-s3a.conf`` (Delta, hadoop-aws)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    full["PYSPARK_PYTHON"] = sys.executable
    full.update(env or {})
    return subprocess.run(
        [str(SPARK_SUBMIT), *spark_submit_flags(s3a=True), "--master", "local[2]", str(REPO / "jobs" / job), *args],
        capture_output=True, text=True, env=full, timeout=600,
    )


def test_run_killed_then_verify_through_spark_submit_on_s3a(pgdb: str, s3_server: S3Server, s3_lake: str, tmp_path: Any) -> None:
    root = "s3a://" + s3_lake.removeprefix("s3://")
    slot, pub = setup_source(pgdb)
    config = tmp_path / "spark.toml"
    config.write_text(
        f'[source]\ndsn = "{pgdb}"\nslot = "{slot}"\npublication = "{pub}"\n'
        f'[lake]\nroot = "{root}"\n[engine]\nkind = "spark"\n'
    )
    with Workload(pgdb, 81) as wl:
        wl.phase(40)
        first = _submit("pg2delta_run.py", "--config", str(config))
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        wl.phase(40)
        before = confirmed_lsn(pgdb, slot)
        killed = _submit("pg2delta_run.py", "--config", str(config), env={FAULT_ENV: "between_tables"})
        assert killed.returncode != 0, killed.stdout[-2000:]
        assert confirmed_lsn(pgdb, slot) == before, "the slot moved past a killed run"
        again = _submit("pg2delta_run.py", "--config", str(config))
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    verified = _submit("pg2delta_verify.py", "--config", str(config), "--json")
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]
    # Spark's Python runner merges the driver's log into stdout (docs/engines/spark-submit.md): the report is the JSON object in it
    text = verified.stdout
    report, _ = json.JSONDecoder().raw_decode(text[text.index("\n{") + 1 :] if not text.startswith("{") else text)
    # the tables of the lake (one the workload never touched has none); all of them equal
    assert report["equal"] is True and report["tables"] and set(report["tables"]) <= {t.qualified for t in TABLES}, report
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "spark-submit on s3a, one run killed")
