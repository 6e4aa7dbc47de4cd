"""The throwaway server's programs (initdb, pg_ctl) run as its OS user beside a busy engine.

gRPC, the embedded engine's client in the test process, has fork handlers that aborted a child
started with fork() now and then (initdb "failed (-6)" in CI). The programs are started through
setpriv instead, so Python uses vfork(), which runs no handler.
"""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from pg2delta.source.throwaway import _as_user, _server_user

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root starts the server as another OS user")


def test_programs_run_as_the_server_user_beside_a_busy_engine_session() -> None:
    pysail = pytest.importorskip("pysail.spark")
    from pyspark.sql import SparkSession

    user = _server_user()
    assert user is not None
    server = pysail.SparkConnectServer("127.0.0.1", 0)
    server.start(background=True)
    spark = SparkSession.builder.remote(f"sc://127.0.0.1:{server.listening_address[1]}").getOrCreate()
    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:  # keeps gRPC's threads polling while the children start
        try:
            while not stop.is_set():
                spark.range(1000).count()
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        # Started with user= instead, 15, 4 and 0 of 1,000 such starts aborted in three tries.
        results = [subprocess.run(_as_user(["id", "-u"], user), capture_output=True, text=True) for _ in range(1000)]
    finally:
        stop.set()
        thread.join()
        spark.stop()
        server.stop()
    assert not errors, errors
    failed = [(r.returncode, r.stderr[:200]) for r in results if r.returncode != 0]
    assert not failed, failed
    assert {r.stdout.strip() for r in results} == {str(user.pw_uid)}
    group = subprocess.run(_as_user(["id", "-g"], user), capture_output=True, text=True, check=True)
    assert group.stdout.strip() == str(user.pw_gid)
