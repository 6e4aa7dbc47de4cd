"""``[lake] database``: the lake's tables in the Spark session's catalog (Spark's built-in Hive
metastore, on Derby in the test's folder), through ``spark-submit`` as users run it.

A bootstrap registers every table (and a history and the changelogs); a column added in
PostgreSQL reaches readers of ``bronze.<name>`` with no catalog change; a table created by a
later run is registered by that run; ``spark.table("bronze.<name>")`` in another ``spark-submit``
holds what PostgreSQL holds; ``status`` names each table's catalog entry.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from conftest import PG_VERSIONS
from pg2delta.source.throwaway import ThrowawayPostgres
from test_spark_submit import pytestmark as spark_submit_marks
from test_spark_submit import spark_submit
from workload import ACCT, EVENTS, TABLES, Workload, assert_lake_matches, cli, create_schema

pytestmark = [*spark_submit_marks, pytest.mark.deploy]  # spark-submit's tier and markers

READER = '''
import json, sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.getOrCreate()
out = {}
for row in spark.sql("SHOW TABLES IN bronze").collect():
    df = spark.table(f"bronze.{row.tableName}")
    out[row.tableName] = {"columns": df.columns, "rows": df.count(),
                          "keys": sorted(r[0] for r in df.select(df.columns[0]).collect() if r[0] is not None)}
print("CATALOG " + json.dumps(out, default=str))
'''


def _hive_conf(tmp_path: Path) -> dict[str, str]:
    return {
        "spark.sql.shuffle.partitions": "2",  # small windows (test_spark_submit.SMALL_WINDOWS)
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.sql.catalogImplementation": "hive",
        "spark.sql.warehouse.dir": str(tmp_path / "warehouse"),
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={tmp_path / 'metastore_db'};create=true",
    }


def _driver(tmp_path: Path) -> dict[str, str]:
    """Derby's log in the test's folder, not the working directory (a JVM option: on the command line)."""
    return {"spark.driver.extraJavaOptions": f"-Dderby.system.home={tmp_path}"}


def _pg_keys(dsn: str, qualified: str, column: str) -> list[object]:
    with psycopg.connect(dsn) as conn:
        return sorted(r[0] for r in conn.execute(f"SELECT {column} FROM {qualified}") if r[0] is not None)


@pytest.fixture
def own_server() -> Iterator[str]:
    pg = ThrowawayPostgres.start(PG_VERSIONS[-1])
    try:
        yield pg.dsn
    finally:
        pg.stop()


def test_tables_registered_in_the_hive_metastore(own_server: str, tmp_path: Path) -> None:
    pgdb = own_server
    tag = uuid.uuid4().hex[:8]
    slot, pub, lake = f"slot_{tag}", f"pub_{tag}", tmp_path / "lake"
    tables = [t for t in TABLES if t.qualified != EVENTS.qualified]
    create_schema(pgdb, pub, tables=tables)  # events comes later: a table a run creates
    with Workload(pgdb, 99) as wl:
        wl.phase(15)
    conf = "\n".join(f'"{k}" = "{v}"' for k, v in _hive_conf(tmp_path).items())
    config = tmp_path / "spark.toml"
    config.write_text(
        f'[source]\ndsn = "{pgdb}"\nslot = "{slot}"\npublication = "{pub}"\n'
        f'[lake]\nroot = "{lake}"\nchangelog = true\ndatabase = "bronze"\n'
        f'[engine]\nkind = "spark"\n[engine.spark_conf]\n{conf}\n'
        f'[tables."{ACCT.qualified}"]\nhistory = "scd2"\n'
    )
    boot = spark_submit("pg2delta_bootstrap.py", "--config", str(config), conf=_driver(tmp_path))
    assert boot.returncode == 0, boot.stderr[-3000:]
    assert "registered" in boot.stderr, boot.stderr[-3000:]

    # A column added in PostgreSQL, a table added to the publication, changes to all of them.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {ACCT.qualified} ADD COLUMN note text")
        conn.execute(f"UPDATE {ACCT.qualified} SET note = 'n' || id WHERE id % 3 = 0")
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute(f"ALTER PUBLICATION {pub} ADD TABLE {EVENTS.qualified}")
        conn.execute("INSERT INTO events (kind, n) SELECT 'late', g FROM generate_series(1, 40) g")
    ran = spark_submit("pg2delta_run.py", "--config", str(config), conf=_driver(tmp_path))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert_lake_matches(pgdb, lake, TABLES, context="run with [lake] database")

    reader = tmp_path / "read_catalog.py"
    reader.write_text(READER)
    read = spark_submit(str(reader), conf=_hive_conf(tmp_path) | _driver(tmp_path))
    assert read.returncode == 0, read.stderr[-3000:]
    found = json.loads(next(line for line in read.stdout.splitlines() if line.startswith("CATALOG "))[8:])
    expected = {f"{t.schema}_{t.name}" for t in TABLES}
    # A changelog exists once its table had a change.
    expected |= {f"{t.schema}_{t.name}__changelog" for t in TABLES if (lake / "_pg2delta" / "changelog" / t.schema / t.name).is_dir()}
    expected |= {f"{ACCT.schema}_{ACCT.name}__history"}
    assert set(found) == expected, sorted(found)
    for spec in TABLES:
        got = found[f"{spec.schema}_{spec.name}"]
        with psycopg.connect(pgdb) as conn:
            cols = [r[0] for r in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped ORDER BY attnum", (spec.qualified,))]
        # A keyless table also holds each row's commit position (_pg2delta_lsn, _pg2delta_pos).
        assert [c for c in got["columns"] if not c.startswith("_pg2delta_")] == cols, (spec.qualified, got["columns"])
        assert got["keys"] == _pg_keys(pgdb, spec.qualified, cols[0]), spec.qualified
    assert "note" in found[f"{ACCT.schema}_{ACCT.name}"]["columns"]

    status = cli("status", "--config", str(config), "--json")
    assert status.returncode == 0, status.stderr[-3000:]
    names = {t["table"]: t["catalog_name"] for t in json.loads(status.stdout)["tables"]}
    assert names == {t.qualified: f"bronze.{t.schema}_{t.name}" for t in TABLES}, names
