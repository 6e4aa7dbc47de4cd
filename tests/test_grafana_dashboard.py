"""The Grafana dashboard (examples/grafana/pg2delta.json) against the metrics pg2delta writes.

The dashboard's shape is checked without a server. Then real runs (one that applies windows, an
idle one, a failed one) and ``pg2delta status`` write their metrics files, a real Prometheus
(Debian's, `make monitoring`) scrapes them as node_exporter's textfile collector would serve them,
and every query of the dashboard, panels and variables, must return series: a metric renamed or
dropped on either side fails here. The run's counters are checked against its own report.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conftest import PG_VERSIONS
from pg2delta.source.throwaway import ThrowawayPostgres, _free_port
from workload import ACCT, TABLES, Workload, assert_lake_matches, cli, create_schema

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "pg2delta.json"
METRIC = re.compile(r"\bpg2delta_[a-z0-9_]+\b")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            out.append((f"variable {v['name']}", v["query"]["query"]))
    return out


def test_dashboard_shape() -> None:
    dash = _dashboard()
    assert dash["uid"] == "pg2delta" and dash["schemaVersion"] >= 36
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "slot", "table"} <= names
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["targets"], f"panel {p['title']!r} has no query"
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert METRIC.search(t["expr"]), (p["title"], t["expr"])
            assert 'slot="$slot"' in t["expr"], f"{p['title']}: not filtered by the slot variable"


class _Textfiles(http.server.BaseHTTPRequestHandler):
    """GET /metrics: every *.prom file of ``folder``, as node_exporter's textfile collector serves them."""

    folder: Path

    def do_GET(self) -> None:
        body = "".join(p.read_text() for p in sorted(self.folder.glob("*.prom"))).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """(the folder the metrics files go to, Prometheus's URL): a textfile endpoint on 127.0.0.1 and
    a real Prometheus scraping it every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: `make monitoring` installs it")
        pytest.skip("prometheus is not installed (`make monitoring`)")
    folder = tmp_path / "textfiles"
    folder.mkdir()
    handler = type("Handler", (_Textfiles,), {"folder": folder})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: pg2delta\n    static_configs: [{{targets: ['127.0.0.1:{httpd.server_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "prometheus did not become ready in 30 s"
            time.sleep(0.2)
        yield folder, url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        httpd.shutdown()


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def _wait_for(url: str, expr: str, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The result of `expr` (its series' outcome label, or their labels as text, to value) once
    `done` holds, or what it was after 60 s; with the scrape target's last error if it failed."""
    deadline = time.monotonic() + 60
    while True:
        got = {r["metric"].get("outcome", str(r["metric"])): float(r["value"][1]) for r in _query(url, expr)}
        if done(got) or time.monotonic() > deadline:
            if not done(got):
                with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=10) as r:
                    targets = json.load(r)["data"]["activeTargets"]
                raise AssertionError(f"{expr} = {got} after 60 s; targets: "
                                     f"{[(t['health'], t['lastError']) for t in targets]}")
            return got
        time.sleep(0.5)


def _label_values(url: str, expr: str) -> list[str]:
    m = re.fullmatch(r"label_values\((.+), (\w+)\)", expr)
    assert m, expr
    q = urllib.parse.urlencode({"match[]": m.group(1)})
    with urllib.request.urlopen(f"{url}/api/v1/label/{m.group(2)}/values?{q}", timeout=10) as r:
        return list(json.load(r)["data"])


@pytest.fixture
def keep_size_server() -> Iterator[ThrowawayPostgres]:
    """The newest server, with a max_slot_wal_keep_size (its metric is absent when unlimited)."""
    server = ThrowawayPostgres.start(max(PG_VERSIONS), settings={"max_slot_wal_keep_size": "'1GB'"})
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.monitoring
def test_every_dashboard_query_has_data(keep_size_server: ThrowawayPostgres, prometheus: tuple[Path, str],
                                        tmp_path: Path) -> None:
    folder, url = prometheus
    dsn = keep_size_server.dsn
    tag = uuid.uuid4().hex[:8]
    slot, pub, lake = f"slot_{tag}", f"pub_{tag}", tmp_path / "lake"
    create_schema(dsn, pub)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    config = tmp_path / "c.toml"
    config.write_text(
        f'[source]\ndsn = "{dsn}"\nslot = "{slot}"\npublication = "{pub}"\n'
        f'[lake]\nroot = "{lake}"\nchangelog = true\n'
        f'[tables."{ACCT.qualified}"]\nhistory = "scd2"\n'
    )
    run_file, status_file = folder / "run.prom", folder / "status.prom"
    with Workload(dsn, 7) as wl:
        wl.phase(30)

    ok = cli("run", "--config", str(config), "--json", "--metrics-file", str(run_file))
    assert ok.returncode == 0, ok.stderr[-3000:]
    summary = json.loads(ok.stdout)
    assert summary["changes"] > 0
    assert_lake_matches(dsn, lake)
    # Runs until one has nothing to do (the first may still pass over WAL without changes).
    outcomes_run = ["ok"]
    while outcomes_run[-1] != "idle":
        again = cli("run", "--config", str(config), "--json", "--metrics-file", str(run_file))
        assert again.returncode == 0, again.stderr[-3000:]
        outcomes_run.append("idle" if json.loads(again.stdout)["idle"] else "ok")
        assert len(outcomes_run) < 5, outcomes_run
    after_idle = run_file.read_text()
    # A run that fails (its server unreachable) still says so, under the slot of its config.
    bad = tmp_path / "bad.toml"
    bad.write_text(config.read_text().replace(dsn, f"host=127.0.0.1 port={_free_port()} dbname=postgres"))
    failed = cli("run", "--config", str(bad), "--metrics-file", str(run_file))
    assert failed.returncode not in (0, 1), failed.stderr[-3000:]
    status = cli("status", "--config", str(config), "--json", "--metrics-file", str(status_file))
    assert status.returncode == 0, status.stderr[-3000:]
    report = json.loads(status.stdout)

    # The counters carry over from run to run; the last success is the last idle run's.
    succeeded = re.search(r"^pg2delta_run_last_success_timestamp_seconds\{.*\} (\S+)$", after_idle, re.M)
    assert succeeded is not None
    s = f'slot="{slot}"'
    want = {"ok": outcomes_run.count("ok"), "idle": 1.0, "failed": 1.0}
    # Prometheus scrapes every second, from a moment of its own choosing: wait for a scrape that
    # saw the last files, then a few more, so that increase() has two samples.
    outcomes = _wait_for(url, f"pg2delta_runs_total{{{s}}}", lambda o: o == want)
    assert _wait_for(url, f"count_over_time(pg2delta_runs_total{{{s},outcome=\"failed\"}}[1m])", lambda o: o
                     and min(o.values()) >= 3)
    assert outcomes == want, (outcomes, outcomes_run)
    assert float(_query(url, f"pg2delta_run_exit_code{{{s}}}")[0]["value"][1]) == failed.returncode
    last_ok = float(_query(url, f"pg2delta_run_last_success_timestamp_seconds{{{s}}}")[0]["value"][1])
    assert last_ok == pytest.approx(float(succeeded.group(1)))
    total = float(_query(url, f"pg2delta_changes_applied_total{{{s}}}")[0]["value"][1])
    assert total == summary["changes"]
    # Rows applied per table, as status reads them from the applied log: what the run reported.
    applied = {
        (r["metric"]["table"], r["metric"]["op"]): float(r["value"][1])
        for r in _query(url, f"pg2delta_table_rows_applied_total{{{s}}}")
    }
    for t in report["tables"]:
        ran = summary["tables"].get(t["table"], {"inserts": 0, "updates": 0, "deletes": 0})
        for op in ("inserts", "updates", "deletes"):
            assert t["rows_applied"][op] == ran[op], (t["table"], op)
            assert applied[(t["table"], op.removesuffix("s"))] == ran[op], (t["table"], op)
    assert {t["table"] for t in report["tables"]} == {t.qualified for t in TABLES}

    # Every query of the dashboard returns series for this slot.
    for where, expr in _queries(_dashboard()):
        expr = expr.replace("$slot", slot).replace("$table", ".*")
        if expr.startswith("label_values("):
            assert _label_values(url, expr), f"{where}: {expr} has no values"
        else:
            assert _query(url, expr), f"{where}: {expr} returned nothing"
