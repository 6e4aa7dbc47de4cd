"""``pg2delta run --metrics-file``: how each scheduled run ended, as Prometheus text.

A run is a process that a scheduler starts every few minutes; nothing stays up between runs for a
Prometheus server to scrape. So each run rewrites one file for node_exporter's textfile collector
(atomically: a temporary file renamed over it), whether it succeeded, had nothing to do or failed:

- gauges of the run that wrote the file: its exit code, when it finished, how long it took, the
  windows, rows read and changes it applied;
- ``pg2delta_run_last_success_timestamp_seconds``: carried over from the previous file when a run
  fails, so "no successful run for an hour" is one expression;
- counters across runs (``pg2delta_runs_total`` by outcome, ``pg2delta_changes_applied_total``): the
  previous file's values plus this run's, so ``increase()`` works as for a long-lived exporter
  (deleting the file resets them, as a restart resets an exporter's).

``pg2delta status --metrics-file`` writes the slot's and the tables' side (pg2delta.status);
``examples/grafana/`` holds a dashboard over both files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# How a run ended: "ok" (windows applied), "idle" (nothing to do), "failed" (any other exit code).
OUTCOMES = ("ok", "idle", "failed")


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How one run ended; a failed run has no windows, rows or changes to report (its windows'
    commits, if any, show in ``pg2delta status``'s metrics)."""

    slot: str
    exit_code: int
    seconds: float
    idle: bool = False
    windows: int = 0
    rows_read: int = 0
    changes: int = 0

    @property
    def outcome(self) -> str:
        if self.idle:
            return "idle"
        return "ok" if self.exit_code == 0 else "failed"


def _previous(path: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of the file the last run wrote (none if there is none, or it does not parse)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    out = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    except ValueError:
        log.warning("run metrics: %s does not parse; counters start again from zero", path)
        return {}
    return out


def write_run_metrics(path: str, run: RunOutcome, now: float | None = None) -> None:
    """Rewrite ``path`` with ``run``'s metrics and the counters carried over from the file there."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

    finished = time.time() if now is None else now
    before = _previous(path)
    slot = (("slot", run.slot),)
    reg = CollectorRegistry()

    def gauge(metric: str, doc: str, value: float | None) -> None:
        if value is not None:
            Gauge(metric, doc, ["slot"], registry=reg).labels(slot=run.slot).set(value)

    gauge("pg2delta_run_exit_code", "Exit code of the last pg2delta run (0 ok; see the exit code table)",
          run.exit_code)
    gauge("pg2delta_run_finished_timestamp_seconds", "When the last pg2delta run ended", finished)
    gauge("pg2delta_run_duration_seconds", "How long the last pg2delta run took, from its command line parsed to its end", run.seconds)
    success = finished if run.outcome != "failed" else before.get(("pg2delta_run_last_success_timestamp_seconds", slot))
    gauge("pg2delta_run_last_success_timestamp_seconds", "When a pg2delta run last ended without an error", success)
    gauge("pg2delta_run_windows", "Windows the last pg2delta run applied", run.windows)
    gauge("pg2delta_run_rows_read", "Rows the last pg2delta run read from the slot", run.rows_read)
    gauge("pg2delta_run_changes", "Changes the last pg2delta run applied to the lake", run.changes)

    runs = Counter("pg2delta_runs", "pg2delta runs by outcome (ok, idle, failed)", ["slot", "outcome"], registry=reg)
    for outcome in OUTCOMES:
        key = ("pg2delta_runs_total", (("outcome", outcome), ("slot", run.slot)))
        runs.labels(slot=run.slot, outcome=outcome).inc(before.get(key, 0.0) + (1 if outcome == run.outcome else 0))
    changes = Counter("pg2delta_changes_applied", "Changes pg2delta runs applied to the lake", ["slot"], registry=reg)
    changes.labels(slot=run.slot).inc(before.get(("pg2delta_changes_applied_total", slot), 0.0) + run.changes)
    write_to_textfile(path, reg)


__all__ = ["OUTCOMES", "RunOutcome", "write_run_metrics"]
