"""``pg2delta backfill``: the changelog's changes of an LSN range, re-applied.

The oracle is the main table itself as of the range's end: Delta time travel (read with delta-rs)
to the version the applied log recorded for the last window ending at or before that LSN.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from changelog_support import setup_source, write_config
from lake_read import read_delta
from test_job_errors import assert_one_line_error
from workload import ACCT, EVENTS, TABLES, TableSpec, Workload, assert_lake_matches, cli, lake_files

pytestmark = pytest.mark.e2e

EXIT_OK, EXIT_IDLE, EXIT_NEEDS_HUMAN = 0, 3, 78  # EXIT_IDLE: with --idle-exit-code 3


def _log(lake: Path, name: str = "applied_log") -> list[dict[str, Any]]:
    path = lake / "_pg2delta" / name
    return read_delta(str(path)).to_pylist() if (path / "_delta_log").is_dir() else []


def _rows(table: pa.Table) -> list[tuple[tuple[str, Any], ...]]:
    return sorted((tuple(sorted(r.items())) for r in table.to_pylist()), key=repr)


def _main_as_of(lake: Path, spec: TableSpec, lsn: int) -> list[tuple[tuple[str, Any], ...]]:
    """The main table as the last window ending at or before ``lsn`` left it (time travel)."""
    mine = [r for r in _log(lake) if (r["schema_name"], r["table_name"]) == (spec.schema, spec.name) and r["window_end"] <= lsn]
    if not mine:
        return []
    version = max(mine, key=lambda r: r["window_end"])["delta_version"]
    return _rows(read_delta(str(lake / spec.schema / spec.name), version=version))


def _copy(path: Path, spec: TableSpec) -> list[tuple[tuple[str, Any], ...]]:
    table = path / spec.schema / spec.name
    return _rows(read_delta(str(table))) if (table / "_delta_log").is_dir() else []


def _fmt(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _history(pgdb: str, tmp_path: Path, seed: int, runs: int = 3) -> tuple[Path, Path, list[int]]:
    """A lake with changelogs kept over several runs of small windows; returns (config, lake, window ends)."""
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, max_changes=40)
    with Workload(pgdb, seed) as wl:
        for _ in range(runs):
            wl.phase(45)
            proc = cli("run", "--config", str(config))
            assert proc.returncode == 0, proc.stderr[-3000:]
    assert_lake_matches(pgdb, lake)
    ends = sorted({r["window_end"] for r in _log(lake)})
    assert len(ends) >= 4, ends
    return config, lake, ends


def _backfill(config: Path, a: int | str, b: int | str, *extra: str) -> Any:
    a_text = a if isinstance(a, str) else _fmt(a)
    b_text = b if isinstance(b, str) else _fmt(b)
    return cli("backfill", "--config", str(config), "--from-lsn", a_text, "--to-lsn", b_text, *extra)


def test_backfill_into_fresh_path_equals_time_travel(pgdb: str, tmp_path: Path) -> None:
    config, lake, ends = _history(pgdb, tmp_path, 31)
    start = min(r["window_start"] for r in _log(lake))
    for n, b in enumerate([ends[len(ends) // 2], ends[-1]]):
        into = tmp_path / f"copy{n}"
        proc = _backfill(config, start, b, "--into", str(into), "--json")
        assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
        assert json.loads(proc.stdout)["tables"], proc.stdout
        assert not list((into / "_pg2delta" / "staging").glob("backfill-*")), "the backfill's staging folder left"
        for spec in TABLES:
            assert _copy(into, spec) == _main_as_of(lake, spec, b), f"{spec.qualified} as of {_fmt(b)}"
        # The same backfill again: nothing to do (exit 0 by default, and it says so), nothing written.
        files = lake_files(into)
        again = _backfill(config, start, b, "--into", str(into), "--json")
        assert again.returncode == EXIT_OK, again.stderr[-3000:]
        assert json.loads(again.stdout)["idle"] is True, again.stdout
        assert lake_files(into) == files


def _seed_version(lake: Path, spec: TableSpec, lsn: int) -> int | None:
    mine = [r for r in _log(lake) if r["table_name"] == spec.name and r["window_end"] <= lsn]
    return max(mine, key=lambda r: r["window_end"])["delta_version"] if mine else None


def test_backfill_from_the_middle_is_seeded_by_time_travel(pgdb: str, tmp_path: Path) -> None:
    config, lake, ends = _history(pgdb, tmp_path, 32, runs=4)
    b = ends[-1]
    checkpoint_file = lake / ACCT.schema / ACCT.name / "_delta_log" / "_last_checkpoint"
    checkpoint = json.loads(checkpoint_file.read_text())["version"] if checkpoint_file.exists() else 0
    seeds = [(a, _seed_version(lake, ACCT, a)) for a in ends[1:-1]]
    readable = [a for a, v in seeds if v is not None and v >= checkpoint]
    assert readable, (seeds, checkpoint)
    into = tmp_path / "copy"
    files = lake_files(lake)
    proc = _backfill(config, readable[0], b, "--into", str(into), "--table", ACCT.qualified, "--json")
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    report = json.loads(proc.stdout)["tables"]
    assert list(report) == [ACCT.qualified] and report[ACCT.qualified]["seed_version"] is not None
    assert _copy(into, ACCT) == _main_as_of(lake, ACCT, b)
    assert not (into / EVENTS.schema / EVENTS.name).exists()
    assert lake_files(lake) == files  # the lake itself was only read
    # A seed below the latest checkpoint (pysail cannot time-travel there; the engine reads the
    # files the log lists at that version) gives the same copy.
    older = [a for a, v in seeds if v is not None and 0 < v < checkpoint]
    assert older, (seeds, checkpoint)
    other = tmp_path / "copy2"
    proc = _backfill(config, older[0], b, "--into", str(other), "--table", ACCT.qualified)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert _copy(other, ACCT) == _main_as_of(lake, ACCT, b)


def test_backfill_in_place(pgdb: str, tmp_path: Path) -> None:
    config, lake, ends = _history(pgdb, tmp_path, 33)
    start = min(r["window_start"] for r in _log(lake))
    files = lake_files(lake)
    # The lake is current: re-applying its whole history in place changes nothing (the code
    # asked for a backfill with nothing to do).
    proc = _backfill(config, start, ends[-1], "--idle-exit-code", str(EXIT_IDLE))
    assert proc.returncode == EXIT_IDLE, proc.stderr[-3000:]
    assert lake_files(lake) == files
    # A table already past --to-lsn is refused: some rows would move back in time.
    acct_ends = sorted(r["window_end"] for r in _log(lake) if r["table_name"] == ACCT.name)
    early = next(e for e in ends if e < acct_ends[-1])
    refused = _backfill(config, start, early, "--table", ACCT.qualified)
    assert_one_line_error(refused, EXIT_NEEDS_HUMAN, "past --to-lsn", ACCT.qualified)
    assert lake_files(lake) == files


def test_backfill_errors(pgdb: str, tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    # acct's changelog is turned on only from the second run; events never has one.
    first = write_config(tmp_path / "c1.toml", pgdb, slot, pub, lake, default=True,
                         changelog={ACCT.qualified: False, EVENTS.qualified: False})
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, default=True, changelog={EVENTS.qualified: False})
    with Workload(pgdb, 34) as wl:
        wl.phase(40, truncate=False)
        assert cli("run", "--config", str(first)).returncode == 0
        wl.phase(40, truncate=False)
        assert cli("run", "--config", str(config)).returncode == 0
    applied = _log(lake)
    start = min(r["window_start"] for r in applied)
    end = max(r["window_end"] for r in applied)
    acct_cl = min(r["window_start"] for r in _log(lake, "changelog_log") if r["table_name"] == ACCT.name)
    files = lake_files(lake)
    cases = [
        ((end, start), "must be before"),
        ((start, start), "must be before"),
        ((start - 1, end), "earlier than the lake's start"),
        ((start, end + 1), "past the last window"),
        ((start, end, "--table", EVENTS.qualified), "has no changelog"),
        ((start, end, "--table", "public.nosuch"), "has no changelog"),
        ((start, end, "--table", ACCT.qualified, "--into", str(tmp_path / "copy")), "does not cover"),
        ((start, end, "--into", f"{tmp_path}/x/../lake/"), "another path than the lake"),
        (("zz", end), "not an lsn"),
        ((start, "1/2/3"), "not an lsn"),
        ((start, end, "--table", "nodot"), "schema.table"),
    ]
    for args, fragment in cases:
        proc = _backfill(config, *args)  # type: ignore[arg-type]
        assert_one_line_error(proc, EXIT_NEEDS_HUMAN, fragment)
        assert lake_files(lake) == files, args
        assert not (tmp_path / "copy").exists()
    # From where acct's changelog starts, the range is covered.
    ok = _backfill(config, acct_cl, end, "--table", ACCT.qualified, "--into", str(tmp_path / "copy"))
    assert ok.returncode == EXIT_OK, ok.stderr[-3000:]
    assert _copy(tmp_path / "copy", ACCT) == _main_as_of(lake, ACCT, end)
    copied = _log(tmp_path / "copy")
    assert copied and {(r["kind"], r["table_name"]) for r in copied} == {("backfill", ACCT.name)}, copied


def test_backfill_follows_added_and_dropped_columns(pgdb: str, tmp_path: Path) -> None:
    import psycopg

    lake = tmp_path / "lake"
    slot, pub = setup_source(pgdb)
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake)

    def run() -> None:
        proc = cli("run", "--config", str(config))
        assert proc.returncode == 0, proc.stderr[-3000:]

    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO acct (id, name, big) SELECT g, 'n' || g, g FROM generate_series(1, 20) g")
        run()
        conn.execute("ALTER TABLE acct ADD COLUMN extra integer")
        conn.execute("UPDATE acct SET extra = id * 10, name = 'renamed' WHERE id <= 10")
        run()
        conn.execute("ALTER TABLE acct DROP COLUMN name")
        conn.execute("UPDATE acct SET big = -big WHERE id BETWEEN 5 AND 15")  # name is gone: the lake keeps its value
        conn.execute("DELETE FROM acct WHERE id = 20")
        run()
    ends = sorted({r["window_end"] for r in _log(lake)})
    start = min(r["window_start"] for r in _log(lake))
    for n, b in enumerate([ends[0], ends[-1]]):
        into = tmp_path / f"copy{n}"
        proc = _backfill(config, start, b, "--into", str(into), "--table", ACCT.qualified)
        assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
        assert _copy(into, ACCT) == _main_as_of(lake, ACCT, b), f"as of {_fmt(b)}"


def test_backfill_killed_half_way_resumes(pgdb: str, tmp_path: Path) -> None:
    import signal

    from pg2delta.faults import FAULT_ENV

    config, lake, ends = _history(pgdb, tmp_path, 35)
    start, b = min(r["window_start"] for r in _log(lake)), ends[-1]
    into = tmp_path / "copy"
    args = ("--into", str(into), "--max-changes", "30")
    killed = cli("backfill", "--config", str(config), "--from-lsn", _fmt(start), "--to-lsn", _fmt(b), *args,
                 env={FAULT_ENV: "backfill_after_merge"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert any((into / spec.schema / spec.name / "_delta_log").is_dir() for spec in TABLES)
    again = _backfill(config, start, b, *args)
    assert again.returncode == EXIT_OK, again.stderr[-3000:]
    for spec in TABLES:
        assert _copy(into, spec) == _main_as_of(lake, spec, b), spec.qualified
    files = lake_files(into)
    assert _backfill(config, start, b, *args, "--idle-exit-code", str(EXIT_IDLE)).returncode == EXIT_IDLE
    assert lake_files(into) == files
