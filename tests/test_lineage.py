"""OpenLineage events of the commands that write, through the openlineage-python client's own file
transport, configured the standard way (``OPENLINEAGE__TRANSPORT__*`` variables).

A bootstrap, runs, a resync, a maintain and a failed run against a real server and lake: each
command's START and COMPLETE (or FAIL) share a run id; COMPLETE names the PostgreSQL tables it
read and the Delta tables it wrote, with their schema as delta-rs reads it, the rows the command's
own report gives, and the LSN range. Unconfigured, nothing is emitted and nothing printed.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
from deltalake import DeltaTable

from conftest import newest_server_only
from pg2delta.lineage import postgres_dataset
from pg2delta.source.throwaway import ThrowawayPostgres
from workload import TABLES, Workload, assert_lake_matches, cli, create_schema


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _by_run(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        runs.setdefault(e["run"]["runId"], []).append(e)
    return runs


def _check_outputs(complete: dict[str, Any], lake: Path, rows: dict[str, int]) -> None:
    """The COMPLETE event's outputs: one per table of ``rows`` (``schema.table`` -> rows written), at its
    folder in ``lake``, with the schema delta-rs reads there and the row count."""
    outputs = {o["name"]: o for o in complete["outputs"]}
    assert set(outputs) == {str(lake / Path(*t.split(".", 1))) for t in rows}, sorted(outputs)
    for table, n in rows.items():
        out = outputs[str(lake / Path(*table.split(".", 1)))]
        assert out["namespace"] == "file"
        columns = [f.name for f in DeltaTable(out["name"]).schema().fields]
        assert [f["name"] for f in out["facets"]["schema"]["fields"]] == columns, table
        assert out["outputFacets"]["outputStatistics"]["rowCount"] == n, table


def test_commands_emit_lineage(pgdb: str, pg_server: ThrowawayPostgres, tmp_path: Path) -> None:
    newest_server_only(pg_server, "the events do not depend on the server")
    tag = uuid.uuid4().hex[:8]
    slot, pub, lake = f"slot_{tag}", f"pub_{tag}", tmp_path / "lake"
    create_schema(pgdb, pub)
    with psycopg.connect(pgdb, autocommit=True) as conn:
        conn.execute("INSERT INTO events (kind, n) SELECT 'seed', g FROM generate_series(1, 50) g")
    events_file = tmp_path / "lineage" / "events.jsonl"
    events_file.parent.mkdir()
    env = {
        "OPENLINEAGE__TRANSPORT__TYPE": "file",
        "OPENLINEAGE__TRANSPORT__LOG_FILE_PATH": str(events_file),
        "OPENLINEAGE__TRANSPORT__APPEND": "true",
        "OPENLINEAGE_NAMESPACE": "lake-team",
        "OPENLINEAGE_PARENT_ID": "airflow/cdc_dag.pg2delta_run/01890000-0000-7000-8000-000000000001",
    }
    common = ["--dsn", pgdb, "--slot", slot, "--publication", pub, "--lake", str(lake)]

    booted = cli("bootstrap", *common, "--json", env=env)
    assert booted.returncode == 0, booted.stderr[-3000:]
    boot_report = json.loads(booted.stdout)
    # Unconfigured: no event, and nothing but pg2delta's own report on standard output.
    with Workload(pgdb, 17) as wl:
        wl.phase(20)
        before = _events(events_file)
        plain = cli("run", *common, "--json")
        assert plain.returncode == 0, plain.stderr[-3000:]
        json.loads(plain.stdout)  # the report alone (the client's console transport would print events)
        assert _events(events_file) == before
        wl.phase(40)
    ran = cli("run", *common, "--json", env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    run_report = json.loads(ran.stdout)
    assert_lake_matches(pgdb, lake)
    resynced = cli("resync", *common, "--table", "public.events", "--json", env=env)
    assert resynced.returncode == 0, resynced.stderr[-3000:]
    maintained = cli("maintain", *common, "--json", env=env)
    assert maintained.returncode == 0, maintained.stderr[-3000:]
    failed = cli("run", "--dsn", pgdb, "--slot", f"missing_{tag}", "--publication", pub, "--lake", str(lake), env=env)
    assert failed.returncode != 0

    runs = _by_run(_events(events_file))
    assert len(runs) == 5, {k: [e["eventType"] for e in v] for k, v in runs.items()}
    by_job = {evs[0]["job"]["name"] + ("!" if evs[-1]["eventType"] == "FAIL" else ""): evs for evs in runs.values()}
    assert set(by_job) == {f"{slot}.bootstrap", f"{slot}.run", f"{slot}.resync", f"{slot}.maintain",
                           f"missing_{tag}.run!"}, sorted(by_job)
    for evs in runs.values():
        assert [e["eventType"] for e in evs] in (["START", "COMPLETE"], ["START", "FAIL"])
        for e in evs:
            assert e["job"]["namespace"] == "lake-team" and e["producer"] and e["schemaURL"].startswith("https://")
            parent = e["run"]["facets"]["parent"]
            assert (parent["job"]["namespace"], parent["job"]["name"]) == ("airflow", "cdc_dag.pg2delta_run")
            assert parent["run"]["runId"] == env["OPENLINEAGE_PARENT_ID"].rsplit("/", 1)[1]
            assert e["run"]["facets"]["processing_engine"]["name"] == "pg2delta"
            assert e["job"]["facets"]["jobType"]["processingType"] == "BATCH"

    # The run: inputs are the changed PostgreSQL tables, outputs their Delta tables.
    complete = by_job[f"{slot}.run"][-1]
    changed = {name: t["inserts"] + t["updates"] + t["deletes"] for name, t in run_report["tables"].items()}
    assert changed and set(changed) <= {t.qualified for t in TABLES}
    assert {(i["namespace"], i["name"]) for i in complete["inputs"]} == {postgres_dataset(pgdb, t) for t in changed}
    assert all(i["namespace"].startswith("postgres://") for i in complete["inputs"])
    _check_outputs(complete, lake, changed)
    facet = complete["run"]["facets"]["pg2delta"]
    assert (facet["slot"], facet["command"], facet["fromLsn"], facet["toLsn"]) == (
        slot, "run", run_report["from_lsn"], run_report["to_lsn"]
    )
    # The bootstrap: every published table, with the rows it copied, and the slot's start.
    boot = by_job[f"{slot}.bootstrap"][-1]
    _check_outputs(boot, lake, {n: t["rows"] for n, t in boot_report["tables"].items()})
    assert boot["run"]["facets"]["pg2delta"]["fromLsn"] == boot_report["start_lsn"]
    # The resync: the table copied again, with the rows it copied.
    resync_report = json.loads(resynced.stdout)
    _check_outputs(by_job[f"{slot}.resync"][-1], lake, {n: t["rows"] for n, t in resync_report["tables"].items()})
    # maintain: every Delta table it maintained, no inputs.
    maintain_report = json.loads(maintained.stdout)
    assert len(by_job[f"{slot}.maintain"][-1]["outputs"]) == len(maintain_report["tables"])
    assert by_job[f"{slot}.maintain"][-1]["inputs"] == []
    # The failed run: its one-line error.
    fail = by_job[f"missing_{tag}.run!"][-1]
    message = fail["run"]["facets"]["errorMessage"]["message"]
    assert message and message in failed.stderr, (message, failed.stderr[-1000:])
