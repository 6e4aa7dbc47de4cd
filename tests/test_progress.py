"""Progress on a terminal: bars with rows/s and an ETA; under a scheduler, plain log lines.

The real CLI runs with its stderr on a pseudo-terminal (as in a shell) and on a pipe (as under
cron or Airflow); bootstrap and run draw bars only on the terminal, and the lake is right both ways.
"""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from changelog_support import write_config
from conftest import PG_VERSIONS
from engines import child_env
from pg2delta.errors import ConfigError
from pg2delta.progress import PROGRESS_ENV, Progress, bars_wanted
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import Workload, assert_lake_matches, cli, create_schema


@pytest.fixture
def pgdb(pgdb: str, pg_server: ThrowawayPostgres) -> str:
    """The newest server only: progress does not depend on the server."""
    if pg_server.version != max(PG_VERSIONS):
        pytest.skip("progress does not depend on the server: run against the newest server only")
    return pgdb

def _cli_on_a_terminal(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The CLI with stderr on a pseudo-terminal: (exit code, what the terminal got, stdout)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    full_env.update(child_env())
    full_env.update(env or {})
    full_env["COLUMNS"] = "160"
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pg2delta.cli", *args], stdout=subprocess.PIPE, stderr=terminal,
        stdin=subprocess.DEVNULL, env=full_env, text=True,
    )
    os.close(terminal)
    seen = bytearray()
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read() if proc.stdout else ""
    code = proc.wait(timeout=300)
    os.close(controller)
    return code, seen.decode(errors="replace"), out


@pytest.mark.e2e
def test_bars_on_a_terminal_log_lines_under_a_scheduler(pgdb: str, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    create_schema(pgdb, pub)
    lake = tmp_path / "lake"
    wl = Workload(pgdb, 11)
    with wl:
        wl.phase(40)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("ANALYZE")  # pg_class.reltuples: the bootstrap's estimate of rows to copy
    config = write_config(tmp_path / "p.toml", pgdb, slot, pub, lake, default=False)

    code, terminal, _ = _cli_on_a_terminal("bootstrap", "--config", str(config))
    assert code == 0, terminal[-3000:]
    # tqdm's bar: "copy: 100%|█████| 1.23k/1.23k [00:01<00:00, 950rows/s, ...]"
    assert re.search(r"copy: +\d+%\|", terminal), terminal[-3000:]
    assert "rows/s" in terminal
    assert re.search(r"\d+/\d+ tables", terminal)
    # Log lines still reach the terminal, above the bar.
    assert "bootstrap" in terminal and "INFO" in terminal
    assert_lake_matches(pgdb, lake)

    with wl:
        wl.phase(60)
    code, terminal, out = _cli_on_a_terminal("run", "--config", str(config), "--max-changes", "50", "--json")
    assert code == 0, terminal[-3000:]
    assert re.search(r"run: +100%\|", terminal), terminal[-3000:]  # through the whole LSN range
    assert re.search(r"[\d,]+ rows, [\d,]+ rows/s", terminal), terminal[-3000:]
    assert "<00:00" in terminal or re.search(r"<\d\d:\d\d", terminal)  # tqdm's ETA
    assert '"changes"' in out  # the report on stdout is untouched by the bar
    assert_lake_matches(pgdb, lake)

    # Under a scheduler (stderr is a pipe): no bar, no carriage returns, the usual log lines.
    with wl:
        wl.phase(20)
    plain = cli("run", "--config", str(config), "--max-changes", "50")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "\r" not in plain.stderr and "%|" not in plain.stderr
    assert "INFO" in plain.stderr
    assert_lake_matches(pgdb, lake)

    # PG2DELTA_PROGRESS=off keeps a terminal plain too.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("UPDATE acct SET name = 'p' || id")
    code, terminal, _ = _cli_on_a_terminal("run", "--config", str(config), env={PROGRESS_ENV: "off"})
    assert code == 0, terminal[-3000:]
    assert "%|" not in terminal
    assert_lake_matches(pgdb, lake)


def test_progress_without_a_bar_logs_rate_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a terminal a Progress logs lines the caller builds, with rows/s and an ETA."""
    monkeypatch.setattr("pg2delta.progress.LOG_SECONDS", 0.0)
    stream = io.StringIO()
    logger = logging.getLogger("pg2delta.test_progress")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with Progress(
            "x", total=1000, unit="rows", logger=logger, bar=False,
            line=lambda p: f"done {p.position}/{p.total}, eta {p.eta() is not None}",
        ) as p:
            assert not p.drawn
            p.advance(250, rows=250)
            p.move_to(500, rows=500)
            p.move_to(400)  # never backwards
            assert p.position == 500 and p.rows == 500 and p.rate() > 0
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines == ["done 250/1000, eta True", "done 500/1000, eta True", "done 500/1000, eta True"]


def test_progress_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "on")
    assert bars_wanted()
    monkeypatch.setenv(PROGRESS_ENV, "off")
    assert not bars_wanted()
    monkeypatch.setenv(PROGRESS_ENV, "sometimes")
    with pytest.raises(ConfigError, match="auto, on or off"):
        bars_wanted()
