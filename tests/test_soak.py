"""`make soak`'s short version: bench/soak.py with a fixed seed, the lake on the S3-compatible server
behind the fault-injecting proxy, the embedded engine, for a workload of a set size (1,800 pgbench
transactions, 60 s at its rate) rather than a set time: a loaded machine's slower runs meet the
same workload, not a larger one, and the test's length follows the work (runs, windows) it does.

pgbench's TPC-B script, schema changes and truncates; ``pg2delta run`` every few seconds as a new
process, each kind of fault at least once (SIGKILL and SIGTERM mid-run, ``pg_terminate_backend``,
a PostgreSQL restart, the object store cut and throttled); then runs until caught up, and every
table read back with delta-rs against PostgreSQL: nothing lost, nothing duplicated, nothing
different, no changelog row twice, and no exit code the faults page does not name.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.deploy]

REPO = Path(__file__).resolve().parent.parent
KINDS = ("sigkill", "sigterm", "terminate_backend", "pg_restart", "store_cut", "store_throttle")


def test_a_short_soak_loses_and_duplicates_nothing() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--transactions", "1800", "--seed", "20261127", "--fault-share", "0.8"],
        capture_output=True, text=True, timeout=2400, cwd=REPO,
    )
    out = done.stdout
    figures = dict(line.split("=", 1) for line in out.splitlines() if re.fullmatch(r"soak_\w+=\S+", line))
    assert done.returncode == 0 and "soak_lost" in figures, f"exit {done.returncode}\n{out[-4000:]}\n{done.stderr[-3000:]}"
    for name in ("soak_lost", "soak_duplicated", "soak_different", "soak_changelog_duplicated", "soak_unexpected_exits"):
        assert figures[name] == "0", f"{name}={figures[name]}\n{out[-4000:]}"
    missing = [k for k in KINDS if int(figures[f"soak_faults_{k}"]) < 1]
    assert not missing, f"faults that never happened: {missing}\n{out[-4000:]}"
    # the workload did what it says: pgbench transactions, schema changes, truncates, changes applied
    for name in ("soak_pgbench_transactions", "soak_schema_changes", "soak_truncates", "soak_changes_applied", "soak_rows_compared"):
        assert int(figures[name]) > 0, f"{name}={figures[name]}\n{out[-4000:]}"
