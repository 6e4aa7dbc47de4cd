"""``pg2delta status``: its report against what PostgreSQL and delta-rs say, its exit codes with a
slot really pushed past ``max_slot_wal_keep_size`` and invalidated by a checkpoint, and its
Prometheus metrics file.

Every command is the real CLI in a child process; the lake is read back with delta-rs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from prometheus_client.parser import text_string_to_metric_families

from changelog_support import changelog_rows, write_config
from conftest import PG_VERSIONS, newest_server_only
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import ACCT, EVENTS, TABLES, Workload, assert_lake_matches, cli, create_schema, lsn_int

EXIT_OK, EXIT_LAG, EXIT_UNRESERVED, EXIT_INVALIDATED, EXIT_NEEDS_HUMAN = 0, 10, 11, 12, 78


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"slot_{tag}", f"pub_{tag}"


def _status(config: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    proc = cli("status", "--config", str(config), "--json", *extra)
    assert proc.stdout, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _slot_row(dsn: str, slot: str) -> dict[str, Any]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute("SELECT * FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        names = [d.name for d in cur.description or ()]
        row = cur.fetchone()
    assert row is not None
    return dict(zip(names, row, strict=True))


def _metrics(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_status_reports_what_postgres_and_delta_say(pgdb: str, tmp_path: Path) -> None:
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake)  # a changelog for every table
    with Workload(pgdb, 91) as wl:
        wl.phase(40)
    run = cli("run", "--config", str(config))
    assert run.returncode == 0, run.stderr[-3000:]
    assert_lake_matches(pgdb, lake)

    code, report, _ = _status(config)
    assert code == EXIT_OK and report["exit_code"] == EXIT_OK and report["problems"] == [], report
    assert report["schema_version"] == 1 and report["command"] == "status"
    slot_report = report["slot"]
    row = _slot_row(pgdb, slot)
    assert slot_report["confirmed_flush_lsn"] == str(row["confirmed_flush_lsn"])
    assert slot_report["restart_lsn"] == str(row["restart_lsn"])
    assert slot_report["wal_status"] == "reserved" and slot_report["invalidated"] is False
    assert slot_report["lag_bytes"] == lsn_int(report["server"]["flush_lsn"]) - lsn_int(str(row["confirmed_flush_lsn"]))
    assert slot_report["retained_wal_bytes"] == (
        lsn_int(report["server"]["current_lsn"]) - lsn_int(str(row["restart_lsn"]))
    )
    assert report["server"]["max_slot_wal_keep_size_bytes"] is None  # -1: unlimited

    tables = {t["table"]: t for t in report["tables"]}
    assert set(tables) == {t.qualified for t in TABLES}, sorted(tables)
    newest = None
    for spec in TABLES:
        t = tables[spec.qualified]
        if not (lake / spec.schema / spec.name).exists():
            # The windows held only a truncate of a table with no Delta table yet: nothing to write.
            assert t["delta_version"] is None and t["files"] is None and t["logged_delta_version"] is None, t
            continue
        dt = DeltaTable(str(lake / spec.schema / spec.name))
        assert t["delta_version"] == dt.version() == t["logged_delta_version"], t
        adds = pa.table(dt.get_add_actions(flatten=True)).to_pydict()
        assert t["files"] == len(adds["path"]) and t["size_bytes"] == sum(adds["size_bytes"]), t
        cl = DeltaTable(str(lake / "_pg2delta" / "changelog" / spec.schema / spec.name))
        assert t["changelog"]["delta_version"] == cl.version(), t
        assert t["history"] is None, t  # no history = "scd2" in this config
        # The commit time recorded for the table is that of the newest change its changelog holds.
        commit = max(r["_pg2delta_commit_ts"] for r in changelog_rows(lake, spec))
        assert t["last_commit_ts"] == commit.isoformat().replace("+00:00", "Z"), (t, commit)
        newest = max(newest or commit, commit)
    assert report["lake"]["last_commit_ts"] == newest.isoformat().replace("+00:00", "Z")

    # A change the lake does not have yet: the slot is behind, by bytes and by time.
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO events (kind) VALUES ('late')")
    metrics_file = tmp_path / "metrics" / "pg2delta.prom"
    metrics_file.parent.mkdir()
    code, report, err = _status(config, "--max-lag-bytes", "0", "--metrics-file", str(metrics_file))
    assert code == EXIT_LAG and [p["kind"] for p in report["problems"]] == ["lag_bytes"], report
    assert "lag_bytes" in err
    assert report["slot"]["lag_bytes"] > 0 and report["slot"]["lag_seconds"] > 0
    code, report, _ = _status(config, "--max-lag-seconds", "0")
    assert code == EXIT_LAG and [p["kind"] for p in report["problems"]] == ["lag_seconds"], report
    code, report, _ = _status(config, "--max-lag-seconds", "86400", "--max-lag-bytes", str(1 << 40))
    assert code == EXIT_OK, report

    # The metrics file: written whole (nothing else left in its folder), the same numbers.
    assert [p.name for p in metrics_file.parent.iterdir()] == ["pg2delta.prom"]
    metrics = _metrics(metrics_file)
    s = (("slot", slot),)
    assert metrics[("pg2delta_status_exit_code", s)] == EXIT_LAG
    assert metrics[("pg2delta_slot_lag_bytes", s)] > 0
    assert metrics[("pg2delta_slot_invalidated", s)] == 0
    assert metrics[("pg2delta_slot_wal_status", (("slot", slot), ("wal_status", "reserved")))] == 1
    assert metrics[("pg2delta_slot_wal_status", (("slot", slot), ("wal_status", "lost")))] == 0
    acct = (("slot", slot), ("table", ACCT.qualified))
    assert metrics[("pg2delta_table_delta_version", acct)] == tables[ACCT.qualified]["delta_version"]
    assert metrics[("pg2delta_table_size_bytes", acct)] == tables[ACCT.qualified]["size_bytes"]
    assert metrics[("pg2delta_table_applied_lsn", acct)] == lsn_int(tables[ACCT.qualified]["applied_lsn"])

    bad = cli("status", "--config", str(config), "--max-lag-bytes", "-1")
    assert bad.returncode == EXIT_NEEDS_HUMAN and "max-lag-bytes" in bad.stderr, bad.stderr


@pytest.fixture(params=PG_VERSIONS, ids=lambda v: f"pg{v}")
def small_keep(request: pytest.FixtureRequest) -> Iterator[ThrowawayPostgres]:
    """A server that keeps at most 1 MB of WAL for a slot past max_wal_size's own."""
    server = ThrowawayPostgres.start(request.param, settings={"max_slot_wal_keep_size": "'1MB'"})
    try:
        yield server
    finally:
        server.stop()


def test_status_exit_codes_with_a_slot_pushed_out(small_keep: ThrowawayPostgres, tmp_path: Path) -> None:
    dsn = small_keep.dsn
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(dsn, pub, tables=[EVENTS])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        conn.execute("INSERT INTO events (kind, n) SELECT 'k', g FROM generate_series(1, 20) g")
        conn.execute("CREATE TABLE filler (id int, pad text)")  # not published: WAL only
    config = write_config(tmp_path / "c.toml", dsn, slot, pub, lake, default=False)
    assert cli("run", "--config", str(config)).returncode == 0
    code, report, _ = _status(config)
    assert code == EXIT_OK and report["server"]["max_slot_wal_keep_size_bytes"] == 1 << 20, report

    # Three segments of WAL past the slot, no checkpoint yet: the server still has the WAL but
    # will remove it at the next checkpoint.
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(3):
            conn.execute("INSERT INTO filler SELECT g, repeat('x', 2000) FROM generate_series(1, 8000) g")
            conn.execute("SELECT pg_switch_wal()")
    code, report, err = _status(config, "--max-lag-bytes", "0")
    assert report["slot"]["wal_status"] == "unreserved", report["slot"]
    # Worst first: unreserved (11) over the lag (10); both are listed.
    assert code == EXIT_UNRESERVED and {p["kind"] for p in report["problems"]} == {"unreserved", "lag_bytes"}, report
    assert "unreserved" in err and report["slot"]["retained_wal_bytes"] > 1 << 20

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
    metrics_file = tmp_path / "status.prom"
    code, report, err = _status(config, "--metrics-file", str(metrics_file))
    row = _slot_row(dsn, slot)
    assert row["wal_status"] == "lost", row
    assert code == EXIT_INVALIDATED and report["exit_code"] == EXIT_INVALIDATED, report
    assert report["slot"]["invalidated"] is True and report["slot"]["wal_status"] == "lost"
    if small_keep.version >= 17:
        assert report["slot"]["invalidation_reason"] == row["invalidation_reason"] == "wal_removed"
    assert "invalidated" in err and "bootstrap" in err
    assert [t["table"] for t in report["tables"]] == [EVENTS.qualified]  # the lake is still reported
    metrics = _metrics(metrics_file)
    assert metrics[("pg2delta_slot_invalidated", (("slot", slot),))] == 1
    assert metrics[("pg2delta_status_exit_code", (("slot", slot),))] == EXIT_INVALIDATED

    # The job itself refuses the slot: one line, needs a human, nothing written.
    before = sorted(p.name for p in (lake / "public" / "events" / "_delta_log").iterdir())
    refused = cli("run", "--config", str(config))
    assert refused.returncode == EXIT_NEEDS_HUMAN, refused.stderr[-3000:]
    assert "invalidated" in refused.stderr and "bootstrap" in refused.stderr
    assert sorted(p.name for p in (lake / "public" / "events" / "_delta_log").iterdir()) == before


EXIT_MAINTENANCE = 9


def _expected_log_figures(table: Path, small: int) -> dict[str, int]:
    """The maintenance figures of a Delta table as delta-rs reads its history and files."""
    dt = DeltaTable(str(table))
    history = sorted(dt.history(), key=lambda c: c["version"])
    compacted = max((c["version"] for c in history if c.get("operation") == "OPTIMIZE"), default=-1)
    checkpoints = [int(p.name[:20]) for p in (table / "_delta_log").glob("*.checkpoint*.parquet")]
    sizes = pa.table(dt.get_add_actions(flatten=True)).column("size_bytes").to_pylist()
    return {
        "commits_since_checkpoint": dt.version() - max(checkpoints, default=-1),
        "commits_since_compaction": sum(
            1 for c in history if c["version"] > compacted and c.get("operation") not in ("VACUUM START", "VACUUM END")
        ),
        "small_files": sum(1 for size in sizes if size < small),
    }


@pytest.mark.classic
def test_status_warns_when_maintenance_falls_behind(pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path) -> None:
    """Per table, its changelog too: commits since the last checkpoint and compaction, small files;
    exit 9 past the [maintain] alert_* thresholds, in the JSON, the text and the metrics file; 0
    once `pg2delta maintain` has run."""
    newest_server_only(pg_server, "the figures are read from the lake only")
    slot, pub = _names()
    lake = tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    config = write_config(tmp_path / "c.toml", pgdb, slot, pub, lake, changelog={ACCT.qualified: True}, default=False)
    small = 1 << 20
    config.write_text(config.read_text() + "[maintain]\ninterval = \"\"\nalert_commits_since_compaction = 4\n"
                      f"alert_small_files = 3\nsmall_file_size = {small}\n")
    with psycopg.connect(pgdb, autocommit=True) as conn:
        for k in range(6):
            conn.execute("INSERT INTO acct (id, name, big) VALUES (%s, 'x', %s)", (k + 1, k))
    run = cli("run", "--config", str(config), "--max-changes", "1")
    assert run.returncode == 0, run.stderr[-3000:]

    metrics_file = tmp_path / "pg2delta.prom"
    code, report, err = _status(config, "--metrics-file", str(metrics_file))
    assert code == EXIT_MAINTENANCE == report["exit_code"], report["problems"]
    assert report["thresholds"]["alert_small_files"] == 3
    acct = next(t for t in report["tables"] if t["table"] == ACCT.qualified)
    table, changelog = lake / ACCT.schema / ACCT.name, lake / "_pg2delta" / "changelog" / ACCT.schema / ACCT.name
    for entry, path in ((acct, table), (acct["changelog"], changelog)):
        expected = _expected_log_figures(path, small)
        assert {k: entry[k] for k in expected} == expected, (path, entry)
    assert acct["small_files"] >= 6 and acct["commits_since_compaction"] >= 6, acct
    kinds = {(p["kind"], p["table"]) for p in report["problems"]}
    assert kinds == {("maintenance", ACCT.qualified)}, report["problems"]
    assert "alert_small_files = 3" in err and "alert_commits_since_compaction = 4" in err
    assert any("changelog: small files" in p["message"] for p in report["problems"])
    metrics = _metrics(metrics_file)
    labels = (("part", "table"), ("slot", slot), ("table", ACCT.qualified))
    assert metrics[("pg2delta_status_exit_code", (("slot", slot),))] == EXIT_MAINTENANCE
    for figure in ("commits_since_checkpoint", "commits_since_compaction", "small_files"):
        assert metrics[(f"pg2delta_table_{figure}", labels)] == acct[figure]
    assert metrics[("pg2delta_table_small_files", (("part", "changelog"), *labels[1:]))] == acct["changelog"]["small_files"]
    text = cli("status", "--config", str(config))
    assert text.returncode == EXIT_MAINTENANCE and "since the last compaction" in text.stdout, text.stdout

    done = cli("maintain", "--config", str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    code, report, _ = _status(config)
    assert code == EXIT_OK and report["problems"] == [], report["problems"]
    acct = next(t for t in report["tables"] if t["table"] == ACCT.qualified)
    assert acct["commits_since_compaction"] == 0 and acct["small_files"] == 1, acct
    assert acct == {**acct, **_expected_log_figures(table, small)}
    assert_lake_matches(pgdb, lake)
