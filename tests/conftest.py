"""Shared fixtures: real throwaway PostgreSQL servers (15 from Debian, 18 from PyPI).

Tests marked ``integration`` get a fresh database on a real server with
``wal_level=logical``; every test names and drops its own slots and publications.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from engines import TEST_ENGINE, SharedEngine
from pg2delta.lake.engine import Engine
from pg2delta.source.throwaway import ThrowawayPostgres, available_versions
from s3server import BUCKET, S3Server, s3proxy_jar

# pyspark's Connect client takes a __main__ without __file__ (a pytest-xdist worker runs as
# `python -c ...`) for a doctest run of its own, unless the session is interactive, and then
# looks for a Spark installation, which the pyspark-client package has not. The worker is marked
# interactive (sys.ps1) rather than given a __main__ file, which spawned processes would re-run.
_main = sys.modules["__main__"]
if getattr(_main, "__spec__", None) is None and not hasattr(_main, "__file__") and not hasattr(sys, "ps1"):
    sys.ps1 = ""

PG_VERSIONS = [int(v) for v in os.environ.get("PG2DELTA_TEST_PG", "").split(",") if v] or available_versions()
if TEST_ENGINE != "embedded" and "PG2DELTA_TEST_PG" not in os.environ:
    # The server and the engine are independent: the embedded run covers every server, the
    # classic engine runs against the newest one.
    PG_VERSIONS = PG_VERSIONS[-1:]


def newest_server_only(pg_server: ThrowawayPostgres, why: str) -> None:
    """Skip unless ``pg_server`` is the newest server under test: for tests of the lake's side, which
    does not depend on the server (each run of them on another server costs CI time only)."""
    if pg_server.version != max(PG_VERSIONS):
        pytest.skip(f"{why}: run against the newest server only")


# The slowest tests go to the test workers first, the slowest of all first, so that two workers
# (pytest-xdist) end together rather than one finishing a long test alone at the end; from the
# --durations of the clean-clone CI run at 0c80ead (embedded or Apache Spark 3.5, seconds). The
# short soak and the Airflow DAGs mostly wait (on pgbench's rate, on Airflow): first, beside the
# side tiers' installs. Before, the soak was handed out at the 907th of 1,016 tests and the Hive
# catalog at the 42nd of 45, each near its tier's end.
SLOW_FIRST = (
    "tests/test_soak.py",  # embedded 224
    "tests/test_spark_submit.py",  # Spark 309
    "tests/test_spark_cluster.py",  # Spark 260: a master, a worker and several spark-submits
    "tests/test_job_e2e.py::test_float_keys_with_nan",  # Spark 143
    "tests/test_maintain_defaults.py::test_time_travel_and_backfill_across_a_vacuum",  # Spark 117
    "tests/test_catalog.py",  # Spark 108
    "tests/test_type_fidelity.py",  # Spark 74 for the matrix, then its checks
    "tests/test_maintain.py::test_maintain_compacts_and_changes_no_row",  # Spark 74
    "tests/test_bootstrap.py::test_bootstrap_killed",  # Spark 70
    "tests/test_airflow.py",  # embedded 59
    "tests/test_maintain_defaults.py::test_run_killed_in_its_maintenance",  # Spark 60
    "tests/test_dist.py",  # embedded 49
    "tests/test_connect_server.py",  # Spark 49
    "tests/test_delta_features.py::test_liquid_clustering",  # Spark 48
    "tests/test_row_metadata.py::test_soft_deletes",  # Spark 46
    "tests/test_object_store_faults.py",  # embedded 23-41 each
    "tests/test_together.py",  # embedded 20-28 each
    "tests/test_spill.py::test_spilled_window_equals_in_memory",
)


# Files whose tests share a module-scoped fixture that costs a lot to build (the type matrix, an
# Airflow home): all their tests go to one test worker, which builds it once.
ONE_WORKER = ("tests/test_type_fidelity.py", "tests/test_airflow.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's ``load`` distribution (each worker is handed a test or two as it goes), except
    that the tests of each :data:`ONE_WORKER` file are handed out together."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduler(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER else nodeid

    return Scheduler(config, log)


def _slow_first(item: pytest.Item) -> tuple[int, int, int]:
    rank = next((i for i, prefix in enumerate(SLOW_FIRST) if item.nodeid.startswith(prefix)), None)
    if rank is None:
        return (1, 0, 0)
    # By server among the slow ones too, then slowest first: a test process keeps one server at a
    # time (pg_server is a parametrized session fixture), and each change of version stops one and
    # starts another.
    callspec = getattr(item, "callspec", None)
    return (0, int(callspec.params.get("pg_server", 0)) if callspec is not None else 0, rank)


def pytest_itemcollected(item: pytest.Item) -> None:
    # Tests that use a server are integration tests, whether or not they say so (marked as each is
    # collected, so that -m "not integration" deselects them).
    if {"pg", "pgdb", "pg_server"} & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.integration)


# Tests of the lake's side, run against the newest server only (as newest_server_only does from
# inside a test, but skipped before their fixtures start): a crash and its replay, spilling and
# reducing on the driver, maintenance, backfill from the lake's own versions, signals, the staging
# disk, the lake's store and its faults, Delta's features, the SCD2 history and the changelog's
# configuration, how a window is committed (rewrites, tables in parallel), damage to the lake and
# verify's side of it, views at a Delta version, command-line and config errors found before the
# server is asked anything. Against an older server they prove nothing the newest does not: the
# server's side (the protocol, types, catalog queries, snapshots, slots, DDL, key changes, TOAST,
# replica identity, partitions as published, failover) keeps every server. docs/development.md
# ("Which server, which engine") has the list.
LAKE_SIDE = (
    "tests/test_together.py::test_crash_in_the_window_of_a_widening",
    "tests/test_history.py::test_spilled_history_equals_in_memory",
    "tests/test_history.py::test_history_equals_the_versions",  # the SCD2 rows from the changelog
    "tests/test_history.py::test_added_column_and_resync",  # the history's columns; the resync's copy: test_resync
    "tests/test_backfill.py::",  # the lake's changelog and versions only, and the command's errors
    "tests/test_progress.py::test_bars_on_a_terminal_log_lines_under_a_scheduler",
    "tests/test_engine_allocator.py::test_bootstrap_and_resync_copy_with_the_bulk_allocator",
    "tests/test_job_faults.py::test_crash_at_point_then_rerun",
    "tests/test_job_faults.py::test_crash_between_tables_with_small_windows",
    "tests/test_job_faults.py::test_kill_in_a_later_window",
    "tests/test_job_faults.py::test_crash_after_the_first_window_appended_then_rerun",
    "tests/test_job_faults.py::test_replay_key_change",  # a crash's replay of key changes
    "tests/test_job_faults.py::test_unchanged_toast_replay_across_a_delta_checkpoint",
    "tests/test_schema_changes.py::test_crash_after_",  # a crash's replay of a schema change and a default
    "tests/test_resync.py::test_resync_killed_then_run_again",
    "tests/test_parallel_apply.py::",  # tables committed in parallel, a crash among them
    "tests/test_changelog.py::test_replayed_window_adds_nothing_twice",
    "tests/test_changelog.py::test_changelog_only_where_configured",
    "tests/test_changelog.py::test_changelog_follows_new_columns",  # the column's decoding: test_schema_changes
    "tests/test_spill.py::test_spilled_window_equals_in_memory",
    "tests/test_spill.py::test_kill_while_spilling_then_rerun",
    "tests/test_spill.py::test_spilled_window_in_driver_buckets_equals_in_memory",
    "tests/test_spill.py::test_spilled_inserts_are_merged_without_a_reduce",
    "tests/test_merge_rewrite.py::",  # a window committed as a rewrite of its key range
    "tests/test_run_toll.py::test_first_window_and_inserts_alone_are_appends",
    "tests/test_sigterm.py::",
    "tests/test_io_faults.py::test_staging_disk_full",
    "tests/test_job_e2e.py::test_float_keys_with_nan",
    "tests/test_job_errors.py::test_unwritable_lake",
    "tests/test_job_errors.py::test_broken_toml",
    "tests/test_job_errors.py::test_unknown_config_key",
    "tests/test_job_errors.py::test_until_lsn_garbage",
    "tests/test_verify.py::test_corrupted_lake_names_exactly_the_corrupted_keys",  # the lake's side of verify
    "tests/test_verify.py::test_keyless_tables_are_skipped",
    "tests/test_verify.py::test_bad_input_is_one_line",
    "tests/test_lake_changed.py::",  # another writer's damage to the lake, found and repaired
    "tests/test_versions.py::test_open_at_lsn_registers_views_at_those_versions",
    "tests/test_row_metadata.py::test_row_metadata_through",
    "tests/test_row_metadata.py::test_soft_deletes",
    "tests/test_concurrent_writers.py::",
    "tests/test_governance.py::test_hashed_and_excluded_columns_never_land_raw",
    "tests/test_governance.py::test_changed_settings_are_refused_until_a_resync",
    "tests/test_governance.py::test_an_excluded_key_column_is_refused",
    # newest_server_only inside each of their tests too (a test run by itself says why it skips)
    "tests/test_maintain.py::",
    "tests/test_maintain_defaults.py::",
    "tests/test_deletion_vectors.py::",
    "tests/test_delta_features.py::",
    "tests/test_object_store.py::",
    "tests/test_object_store_faults.py::",
    "tests/test_lineage.py::",
    "tests/test_dist.py::",
    "tests/test_status.py::test_status_warns_when_maintenance_falls_behind",
    "tests/test_bootstrap.py::test_new_tables_take_the_staged_files_unless_their_folder_holds_others",
    "tests/test_bootstrap.py::test_bootstrap_killed_around_a_copy_adopted",
    "tests/test_bootstrap.py::test_bootstrap_writes_key_ranges_in_files_and_a_run_rewrites_one",
    "tests/test_bootstrap.py::test_bootstrap_under_a_long_tmpdir",
    "tests/test_schema_changes.py::test_columns_added_to_a_table_without_a_key",
    "tests/test_history.py::test_crash_in_a_spilled_window_then_rerun",
    "tests/test_history.py::test_crash_then_rerun_gives_the_same_history",
)


def _older_server(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("pg_server", max(PG_VERSIONS)) != max(PG_VERSIONS)


@pytest.hookimpl(trylast=True)  # after pytest grouped the tests by server
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _older_server(item) and any(item.nodeid.startswith(prefix) for prefix in LAKE_SIDE):
            item.add_marker(pytest.mark.skip(reason="the lake's side: run against the newest server only (conftest.LAKE_SIDE)"))
    items.sort(key=_slow_first)  # stable: the others keep their order


def pytest_configure(config: pytest.Config) -> None:
    # (here rather than in pyproject.toml's list, whose change rebuilds every venv of the Makefile)
    config.addinivalue_line(
        "markers", "compat: end-to-end tests the compat tier runs again on the oldest stack (make test-compat)"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"pg2delta engine under test: {TEST_ENGINE}; PostgreSQL {', '.join(map(str, PG_VERSIONS))}"


@pytest.fixture(scope="session", autouse=True)
def shared_engine() -> Iterator[SharedEngine]:
    """One engine for every in-process run of this test process (see tests/engines.py)."""
    shared = SharedEngine()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "start", shared.start)
        try:
            yield shared
        finally:
            shared.close()


@pytest.fixture(scope="session", params=PG_VERSIONS, ids=lambda v: f"pg{v}")
def pg_server(request: pytest.FixtureRequest) -> Iterator[ThrowawayPostgres]:
    server = ThrowawayPostgres.start(request.param, settings={"logical_decoding_work_mem": "64kB"})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg(pg_server: ThrowawayPostgres) -> ThrowawayPostgres:
    return pg_server


@pytest.fixture
def pgdb(pg_server: ThrowawayPostgres) -> Iterator[str]:
    """A DSN for a brand-new database on the server, dropped (with its slots) afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_server.dsn_for(name)
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One S3-compatible server (S3Proxy) for every object-store test of this test process."""
    jar = s3proxy_jar()
    if jar is None or not jar.exists():
        pytest.fail("no S3Proxy jar: run `make s3proxy` (the object-store tests need a real S3 server)")
    server = S3Server.start(jar)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_lake(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A lake root of its own on the S3 server, ``s3://lake/<random>``, with the server's endpoint
    and credentials in the standard variables (as a user's shell would have them) for this test."""
    s3_server.check_alive()
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
