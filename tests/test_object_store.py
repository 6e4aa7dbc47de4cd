"""The lake on an S3-compatible object store (S3Proxy on 127.0.0.1, tests/s3server.py).

The embedded engine with the lake at ``s3://``: every command (bootstrap, run killed and run
again, resync, backfill, maintain with VACUUM, verify, versions, status), the endpoint and the
credentials given only as the standard ``AWS_*`` variables. Every lake is read back by delta-rs
with the object store's options and compared with PostgreSQL. The server's conditional put
(``If-None-Match: *``), on which delta-rs's commits to S3 rely, is tested directly.
Apache Spark with ``s3a://`` through spark-submit: test_spark_cluster.py.
"""

from __future__ import annotations

import json
import signal
import uuid
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from deltalake import DeltaTable, write_deltalake

from changelog_support import setup_source
from conftest import newest_server_only
from engines import TEST_ENGINE
from lake_read import read_delta
from pg2delta.config import StorageConfig, load, storage_environment
from pg2delta.errors import ConfigError
from pg2delta.faults import FAULT_ENV
from pg2delta.lake.engine import EngineConfig
from pg2delta.lake.engine_session import S3A_RETRIES, s3a_retry_defaults
from pg2delta.lake.lake_files import Lake, s3_filesystem
from s3server import S3Server
from workload import TABLES, TableSpec, Workload, assert_same_rows, cli, confirmed_lsn, create_schema, pg_rows

META_PREFIX = "_pg2delta"


def s3_rows(server: S3Server, root: str, spec: TableSpec, version: int | None = None) -> tuple[list[str], list[tuple[Any, ...]]] | None:
    """The Delta table's columns and rows, read by delta-rs with the object store's options."""
    uri = f"{root}/{spec.schema}/{spec.name}"
    if not DeltaTable.is_deltatable(uri, storage_options=server.storage_options):
        return None
    table = read_delta(uri, version, storage_options=server.storage_options)  # deletion vectors too (Apache Spark's)
    names = [n for n in table.column_names if not n.startswith(META_PREFIX)]
    cols = [table.column(n).to_pylist() for n in names]
    return names, list(zip(*cols, strict=True)) if cols else []


def assert_s3_lake_matches(dsn: str, server: S3Server, root: str, context: str) -> None:
    with psycopg.connect(dsn) as conn:
        for spec in TABLES:
            names, pg = pg_rows(conn, spec)
            assert_same_rows(spec, names, pg, s3_rows(server, root, spec), f"{spec.qualified} ({context})")


def applied_log(server: S3Server, root: str) -> list[dict[str, Any]]:
    return DeltaTable(f"{root}/_pg2delta/applied_log", storage_options=server.storage_options).to_pyarrow_table().to_pylist()


def write_config(path: Any, dsn: str, slot: str, pub: str, root: str, extra: str = "") -> str:
    """A config naming the lake on S3, a changelog for every table, VACUUM without retention;
    nothing about the store in it: endpoint and credentials come from the environment."""
    path.write_text(
        f'[source]\ndsn = "{dsn}"\nslot = "{slot}"\npublication = "{pub}"\n'
        f'[lake]\nroot = "{root}"\nchangelog = true\n[window]\nmax_changes = 40\n[maintain]\nretention = "0h"\n{extra}'
    )
    return str(path)


def _ok(proc: Any, what: str) -> dict[str, Any]:
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}: {proc.stderr[-3000:]}"
    return json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}


def _fmt(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def test_storage_settings_become_the_standard_variables_and_s3a_settings(tmp_path: Any) -> None:
    storage = StorageConfig(endpoint="http://127.0.0.1:9000", region="eu-west-3")
    assert storage_environment(storage, {}) == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-3", "AWS_ALLOW_HTTP": "true",
    }
    # the environment wins over the file; an HTTPS endpoint needs no AWS_ALLOW_HTTP
    assert storage_environment(storage, {"AWS_ENDPOINT_URL": "https://s3.example", "AWS_REGION": "x"}) == {}
    assert storage_environment(StorageConfig(path_style=False), {}) == {"AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "true"}
    path = tmp_path / "c.toml"
    path.write_text(
        '[source]\ndsn = "x"\n[lake]\nroot = "s3a://b/p"\nendpoint = "http://127.0.0.1:9000"\npath_style = true\n'
        '[engine]\nkind = "spark"\n[engine.spark_conf]\n"spark.hadoop.fs.s3a.endpoint.region" = "mine"\n'
    )
    conf = dict(load(path, env={}).engine.spark_conf)
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert conf["spark.hadoop.fs.s3a.endpoint.region"] == "mine"  # [engine.spark_conf] wins
    assert not any("key" in k for k in conf)  # credentials stay with s3a's own chain


@pytest.mark.classic
@pytest.mark.deploy
@pytest.mark.skipif(TEST_ENGINE != "spark", reason="Hadoop's s3a settings are Apache Spark's (make test-spark)")
def test_a_users_s3a_settings_win_over_the_retry_defaults(shared_engine: Any, tmp_path: Any) -> None:
    """pg2delta bounds s3a's retries (S3A_RETRIES) only where nothing but Hadoop's own defaults names
    them: a user's ``spark.hadoop.*`` setting (spark-defaults.conf, ``--conf``, ``[engine.spark_conf]``)
    and a ``core-site.xml`` win. The Hadoop configuration is built as Spark builds a session's
    (SparkHadoopUtil.newConfiguration), in the JVM of the session pg2delta opened, which has the
    defaults where the tier's settings name nothing."""
    spark = shared_engine.start(EngineConfig(kind="spark"), Lake(str(tmp_path))).spark
    jvm = spark.sparkContext._jvm
    users = jvm.org.apache.spark.SparkConf(False).set("spark.hadoop.fs.s3a.attempts.maximum", "7")
    hadoop = jvm.org.apache.spark.deploy.SparkHadoopUtil.get().newConfiguration(users)
    site = tmp_path / "core-site.xml"
    site.write_text("<configuration><property><name>fs.s3a.retry.limit</name><value>9</value></property></configuration>")
    hadoop.addResource(jvm.org.apache.hadoop.fs.Path(site.as_uri()))
    assert hadoop.get("fs.s3a.retry.throttle.limit") != S3A_RETRIES["fs.s3a.retry.throttle.limit"]  # Hadoop's own
    s3a_retry_defaults(hadoop)
    got = {key: hadoop.get(key) for key in S3A_RETRIES}
    assert got == {**S3A_RETRIES, "fs.s3a.attempts.maximum": "7", "fs.s3a.retry.limit": "9"}, got
    session = spark.sparkContext._jsc.hadoopConfiguration()
    assert session.get("fs.s3a.retry.throttle.limit") == S3A_RETRIES["fs.s3a.retry.throttle.limit"]


def test_credentials_in_the_config_file_are_refused(tmp_path: Any) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[source]\ndsn = "x"\n[lake]\nroot = "s3://b/p"\naccess_key_id = "AKIAEXAMPLE"\n')
    with pytest.raises(ConfigError, match="credentials never belong in the config file") as err:
        load(path, env={})
    assert "AKIAEXAMPLE" not in str(err.value)


@pytest.mark.e2e
@pytest.mark.deploy
def test_the_server_honours_conditional_put(s3_server: S3Server, s3_lake: str) -> None:
    """delta-rs 1.x commits a version on S3 with a PUT of ``If-None-Match: *`` (no lock): the server
    must refuse the second PUT of a key, and a writer holding a stale version must not overwrite a
    commit another made meanwhile (it retries at the next version)."""
    key = f"/{s3_lake.removeprefix('s3://')}/probe"
    assert s3_server.request("PUT", key, b"first", {"If-None-Match": "*"}) == 200
    assert s3_server.request("PUT", key, b"second", {"If-None-Match": "*"}) == 412

    uri = f"{s3_lake}/t"
    write_deltalake(uri, pa.table({"a": [0]}), storage_options=s3_server.storage_options)
    stale = DeltaTable(uri, storage_options=s3_server.storage_options)
    write_deltalake(uri, pa.table({"a": [1]}), mode="append", storage_options=s3_server.storage_options)
    write_deltalake(stale, pa.table({"a": [2]}), mode="append")  # believes version 0 is the latest
    table = DeltaTable(uri, storage_options=s3_server.storage_options)
    assert table.version() == 2
    assert sorted(table.to_pyarrow_table().column("a").to_pylist()) == [0, 1, 2]


@pytest.mark.e2e
@pytest.mark.deploy
def test_the_applied_logs_digest_is_kept_on_s3(s3_server: S3Server, s3_lake: str) -> None:
    """A big file of the applied log (maintenance compacts a year into one) is reduced once and its
    digest kept on the store (pg2delta.lake.digests): a later reader makes the same of it."""
    from pg2delta.lake.applied_log import DIGEST, LOG_SCHEMA, LOG_TABLE, deciding_rows, log_rows
    from pg2delta.lake.digests import DIGESTS_ROOT

    rows = [{"run_id": f"r{w}", "slot": "s", "window_start": w, "window_end": w + 1, "relation_oid": 7,
             "schema_name": "bench", "table_name": "t", "delta_version": w, "kind": "window", "publication": f"p{w}"}
            for w in range(30_000)]
    uri = f"{s3_lake}/{LOG_TABLE}"
    write_deltalake(uri, pa.Table.from_pylist(rows, schema=LOG_SCHEMA), storage_options=s3_server.storage_options)
    whole = Lake(s3_lake).read_delta(uri)
    assert whole is not None and whole.num_rows == 30_000
    want = deciding_rows(whole)
    assert log_rows(Lake(s3_lake)) == want
    lake = Lake(s3_lake)
    kept = lake.fs.get_file_info(pafs.FileSelector(f"{lake.path}/{DIGESTS_ROOT}/{DIGEST.name}"))
    assert len(kept) == 1 and kept[0].size > 0  # nothing beside it either: the part file was moved
    assert log_rows(lake) == want


@pytest.mark.e2e
@pytest.mark.deploy
def test_runs_backfill_maintain_verify_versions_status_on_s3(
    pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, tmp_path: Any
) -> None:
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake)
    with Workload(pgdb, 71) as wl:
        wl.phase(45)
        _ok(cli("run", "--config", config), "first run")
        wl.phase(45)
        before = confirmed_lsn(pgdb, slot)
        killed = cli("run", "--config", config, env={FAULT_ENV: "between_tables"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert confirmed_lsn(pgdb, slot) == before, "the slot moved past a killed run"
        _ok(cli("run", "--config", config), "run after the kill")
        wl.phase(45)
        _ok(cli("run", "--config", config), "third run")
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "runs, one killed")

    # backfill into a copy on the store: equal to the tables as of the range's end (time travel)
    log = applied_log(s3_server, s3_lake)
    start, end = min(r["window_start"] for r in log), max(r["window_end"] for r in log)
    copy = f"{s3_lake}-copy"
    report = _ok(cli("backfill", "--config", config, "--from-lsn", _fmt(start), "--to-lsn", _fmt(end), "--into", copy, "--json"), "backfill")
    assert report["tables"], report
    for spec in TABLES:
        mine = [r for r in log if (r["schema_name"], r["table_name"]) == (spec.schema, spec.name)]
        version = max(mine, key=lambda r: r["window_end"])["delta_version"] if mine else None
        main = s3_rows(s3_server, s3_lake, spec, version) if version is not None else None
        got = s3_rows(s3_server, copy, spec)
        assert sorted(got[1] if got else [], key=repr) == sorted(main[1] if main else [], key=repr), spec.qualified

    # versions at the slot's position: the tables' latest versions
    at = confirmed_lsn(pgdb, slot)
    assert at is not None
    versions = _ok(cli("versions", "--config", config, "--at-lsn", at, "--json"), "versions")
    assert versions["tables"], versions

    verified = _ok(cli("verify", "--config", config, "--json"), "verify")
    assert verified["equal"] is True and set(verified["tables"]) == {t.qualified for t in TABLES}, verified

    # maintain: compaction and VACUUM (no retention: last, since verify and versions read the
    # versions the applied log names) remove files from the store, and change no row
    report = _ok(cli("maintain", "--config", config, "--json"), "maintain")
    assert sum(t.get("files_removed", 0) for t in report["tables"].values()) > 0, report
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "after maintain")
    status = _ok(cli("status", "--config", config, "--json"), "status")
    assert status["problems"] == [], status


@pytest.mark.e2e
@pytest.mark.deploy
def test_bootstrap_and_resync_on_s3(pg_server: Any, pgdb: str, s3_server: S3Server, s3_lake: str, tmp_path: Any) -> None:
    newest_server_only(pg_server, "the lake's store does not depend on the server")
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(pgdb, pub)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, s3_lake)
    with Workload(pgdb, 72) as wl:
        wl.phase(60, truncate=False)
        boot = _ok(cli("bootstrap", "--config", config, "--json"), "bootstrap")
        assert boot["created_slot"] is True, boot
        assert_s3_lake_matches(pgdb, s3_server, s3_lake, "bootstrap")
        wl.phase(40)
        _ok(cli("run", "--config", config), "run after the bootstrap")
        resync = _ok(cli("resync", "--config", config, "--table", TABLES[0].qualified, "--json"), "resync")
        assert resync, resync
        wl.phase(40)
        _ok(cli("run", "--config", config), "run after the resync")
    assert_s3_lake_matches(pgdb, s3_server, s3_lake, "bootstrap, resync, runs")
    # nothing left in the staging area on the store
    staged = [p for p in _listing(s3_lake + "/_pg2delta/staging") if p.endswith(".parquet")]
    assert not staged, staged


def _listing(uri: str) -> list[str]:
    return [i.path for i in s3_filesystem().get_file_info(pafs.FileSelector(uri.removeprefix("s3://"), recursive=True, allow_not_found=True))]
