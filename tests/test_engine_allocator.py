"""The embedded engine's allocator gives freed memory back at once (pg2delta.ALLOCATOR)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pg2delta import ALLOCATOR

pytestmark = pytest.mark.e2e

START = """
import sys
from pg2delta.lake.engine import Engine, EngineConfig, Lake
engine = Engine.start(EngineConfig(), Lake(sys.argv[1]))
engine.stop()
"""


def _options(tmp_path: Path, **env: str) -> dict[str, str]:
    """The options mimalloc reports (MIMALLOC_VERBOSE) when a fresh process starts the embedded engine."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MIMALLOC_")} | {"MIMALLOC_VERBOSE": "1"} | env
    script = tmp_path / "start.py"  # a script, not ``python -c``: pyspark looks for a Spark home then
    script.write_text(START)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "lake")], env=full, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # Every mimalloc in the process reports its options after its "process init" line (pyarrow
    # brings one too, loaded before); pysail's, the engine's, is the last one loaded.
    blocks = done.stderr.split("mimalloc: process init")
    assert len(blocks) > 1, f"mimalloc reported nothing: {done.stderr[-2000:]}"
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
