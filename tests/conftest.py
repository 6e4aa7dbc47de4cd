"""Shared fixtures: real throwaway PostgreSQL servers (15 from Debian, 18 from PyPI).

Tests marked ``integration`` get a fresh database on a real server with
``wal_level=logical``; every test names and drops its own slots and publications.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from engines import TEST_ENGINE, SharedEngine
from pg2delta.engine import Engine
from pg2delta.throwaway import ThrowawayPostgres, available_versions

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that use a server are integration tests, whether or not they say so.
    for item in items:
        if {"pg", "pgdb", "pg_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


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
