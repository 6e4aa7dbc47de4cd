"""The embedded engine's allocator gives freed memory back at once (pg2delta.ALLOCATOR), except in
a whole-table copy (pg2delta.BULK_ALLOCATOR, set by ``pg2delta bootstrap`` and ``resync``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from lake_read import read_delta
from pg2delta import ALLOCATOR, BULK_ALLOCATOR

pytestmark = pytest.mark.e2e

START = """
import sys
import pg2delta
if sys.argv[2:] == ["bulk"]:
    print("switched" if pg2delta.use_bulk_allocator() else "kept")
from pg2delta.lake.engine import Engine, EngineConfig, Lake
engine = Engine.start(EngineConfig(), Lake(sys.argv[1]))
engine.stop()
"""


def _env(**env: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MIMALLOC_", "PG2DELTA_"))} | {"MIMALLOC_VERBOSE": "1"} | env


def _options(tmp_path: Path, *args: str, **env: str) -> dict[str, str]:
    """The options mimalloc reports (MIMALLOC_VERBOSE) when a fresh process starts the embedded engine
    (``args`` "bulk": after ``use_bulk_allocator()``, whose answer is the option ``switched``)."""
    script = tmp_path / "start.py"  # a script, not ``python -c``: pyspark looks for a Spark home then
    script.write_text(START)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "lake"), *args], env=_env(**env), capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return _last_block(done.stderr) | {"switched": str("switched" in done.stdout.split())}


def _last_block(stderr: str) -> dict[str, str]:
    # Every mimalloc in the process reports its options after its "process init" line (pyarrow
    # brings one too, loaded before); pysail's, the engine's, is the last one loaded.
    blocks = stderr.split("mimalloc: process init")
    assert len(blocks) > 1, f"mimalloc reported nothing: {stderr[-2000:]}"
    options = {}
    for line in blocks[-1].splitlines():
        if line.startswith("option '"):
            name, _, value = line[len("option '"):].partition("': ")
            options[name] = value.strip()
    return options


def test_the_engine_starts_with_memory_returned_at_once(tmp_path: Path) -> None:
    options = _options(tmp_path)
    assert ALLOCATOR == {"MIMALLOC_PURGE_DELAY": "0", "MIMALLOC_ARENA_EAGER_COMMIT": "0"}
    assert options["purge_delay"] == "0", options
    assert options["arena_eager_commit"] == "0", options


def test_what_the_environment_sets_wins(tmp_path: Path) -> None:
    options = _options(tmp_path, MIMALLOC_PURGE_DELAY="250")
    assert options["purge_delay"] == "250", options
    assert options["arena_eager_commit"] == "0", options


def test_a_whole_table_copy_keeps_freed_pages_a_moment(tmp_path: Path) -> None:
    options = _options(tmp_path, "bulk")
    assert BULK_ALLOCATOR == {"MIMALLOC_PURGE_DELAY": "25"}
    assert options["switched"] == "True", options
    assert options["purge_delay"] == "25", options
    assert options["arena_eager_commit"] == "0", options


def test_a_whole_table_copy_keeps_what_the_environment_sets(tmp_path: Path) -> None:
    options = _options(tmp_path, "bulk", MIMALLOC_PURGE_DELAY="0")
    assert options["switched"] == "False", options
    assert options["purge_delay"] == "0", options


def _bulk_delays(stderr: str) -> list[str]:
    """The purge delay of each mimalloc a CLI process loaded, in order."""
    return [line.split(":")[1].strip() for line in stderr.splitlines() if line.startswith("option 'purge_delay'")]


def test_bootstrap_and_resync_copy_with_the_bulk_allocator(pgdb: str, tmp_path: Path) -> None:
    """The real CLI, in processes of its own: the engine it starts, and the worker processes it
    forks, read the bulk setting; the rows arrive."""
    with psycopg.connect(pgdb, autocommit=True) as conn:
        for name in ("a", "b"):
            conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v text)")
            conn.execute(f"INSERT INTO {name} SELECT g, 'v' || g FROM generate_series(1, 1000) g")
        conn.execute("CREATE PUBLICATION bulk_pub FOR TABLE a, b")
    args = ["--dsn", pgdb, "--slot", "bulk_slot", "--publication", "bulk_pub", "--lake", str(tmp_path / "lake")]
    for command in (["bootstrap"], ["resync", "--table", "public.a", "--table", "public.b"]):
        done = subprocess.run(
            [sys.executable, "-m", "pg2delta.cli", *command, *args, "--parallel", "2"],
            env=_env(), capture_output=True, text=True, timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        # One report per mimalloc loaded: the CLI's pyarrow (loaded before the command is known:
        # the run's setting), the engine's, the worker server's pyarrow; the last two in bulk.
        delays = _bulk_delays(done.stderr)
        assert delays[0] == "0" and delays[1:].count("25") >= 2 and "0" not in delays[1:], (command, delays)
    lake = read_delta(str(tmp_path / "lake" / "public" / "b"))
    assert sorted(lake.column("id").to_pylist()) == list(range(1, 1001))
