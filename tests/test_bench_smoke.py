"""The benchmarks still run: `make bench-decode`'s, `make bench`'s, `make bench-bootstrap`'s,
`make bench-maintain`'s and `make bench-spark`'s 50-table part (with the engine's floor under it)
on tiny windows, embedded engine, each as the Makefile starts it. Nothing here is timed: the figures' values are the benchmarks' business
(bench/README.md); this only proves each one runs to its figures and its own check of the lake
passes (a rename in src/ broke `make bench` and `make bench-spark` for days, unseen, and
pyarrow 26's string views `make bench-maintain`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

REPO = Path(__file__).resolve().parent.parent


def _figures(*argv: str) -> dict[str, str]:
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if re.fullmatch(r"\w+=\S+.*", line))


def test_bench_decode_prints_its_ratio() -> None:
    figures = _figures("bench/bench_decode.py", "--changes", "4000", "--repeat", "1")
    assert float(figures["decode_vs_server"]) > 0 and float(figures["framing_decode_vs_server"]) > 0


def test_bench_e2e_applies_the_window_and_prints_its_ratio() -> None:
    done = subprocess.run([sys.executable, "bench/bench_e2e.py", "--changes", "4000", "--repeat", "1", "--no-fixed-costs"],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    check = next(line for line in done.stdout.splitlines() if line.startswith("check: "))
    postgres, delta = check.removeprefix("check: PostgreSQL ").split("; Delta ")
    assert postgres == delta, check  # the bench's own read-back of the lake, with delta-rs
    assert float(done.stdout.rsplit("e2e_vs_server=", 1)[1].split()[0]) > 0


def test_bench_spark_tables_part_with_its_floor() -> None:
    done = subprocess.run(
        [sys.executable, "bench/bench_spark.py", "--one-engine", "embedded", "--tables", "3", "--rows", "30", "--parallel", "4"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    seconds = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert set(seconds) == {"first:4", "next:4", "floor_merge:4", "floor_append:4"}
    assert all(s > 0 for s in seconds.values())


def test_bench_bootstrap_prints_its_ratio() -> None:
    figures = _figures("bench/bench_bootstrap.py", "--rows", "2000", "--repeat", "1")
    assert float(figures["bootstrap_vs_copy"]) > 0


def test_bench_maintain_compacts_and_prints_its_speedups() -> None:
    figures = _figures("bench/bench_maintain.py", "--windows", "10", "--probe", "2", "--repeat", "1")
    assert int(figures["files_after"].split()[0]) < int(figures["files_before"].split()[0])
    assert float(figures["read_speedup"]) > 0 and float(figures["window_speedup"]) > 0
