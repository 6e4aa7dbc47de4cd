"""`make bench`: the whole job, slot to Delta, next to PostgreSQL's own peek rate for the same window.

One run, one throwaway PostgreSQL (15 by default) and a temporary lake:

1. the same window as ``bench_decode.py`` (``--changes`` inserts and updates of a mixed
   10-column table, in transactions of ``--txn-rows`` rows);
2. **server**: ``COPY (SELECT data FROM pg_logical_slot_peek_binary_changes(...)) TO STDOUT
   (FORMAT binary)`` into nothing, best of ``--repeat``, before the job consumes the window;
3. **job**: ``pg2delta.job.Job(config).run()`` on the embedded engine (pysail; ``--engine spark``
   for Apache Spark + Delta, see bench_spark.py), timed once
   from the job object's creation to its return, engine start included; the time spent in
   each stage is added up by wrapping the job's functions in this process;
4. the Delta table is read back with deltalake (an independent reader) and must hold the
   same rows as PostgreSQL: same count and same sum of two columns; otherwise exit 1.

The last line is ``e2e_vs_server=<job changes/s divided by the server's changes/s>``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
from bench_decode import (
    PUB,
    SLOT,
    TABLE,
    StageTimer,
    add_window_args,
    best_of,
    make_window,
    rate,
    server_copy,
)

import pg2delta.apply.stage as stagemod
import pg2delta.apply.table as applymod
import pg2delta.job as jobmod
from pg2delta import config as cfgmod
from pg2delta.apply.lakeside import Lakeside
from pg2delta.decode.changes import WindowDecoder
from pg2delta.lake import applied_log
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.engine_writes import DeltaWrites
from pg2delta.source.slot import SlotSource


def time_generator(timer: StageTimer, owner: Any, name: str, label: str) -> None:
    """Wrap a generator method so that the time spent producing its items is added up."""
    original = owner.__dict__[name]

    def timed(*args: Any, **kwargs: Any) -> Iterator[Any]:
        gen = original(*args, **kwargs)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(gen)
            except StopIteration:
                timer.seconds[label] += time.perf_counter() - t0
                return
            timer.seconds[label] += time.perf_counter() - t0
            timer.calls[label] += 1
            yield item

    setattr(owner, name, timed)
    timer._undo.append(lambda: setattr(owner, name, original))


# (label, owner, attribute), in the order they are printed; indented stages are part of the one above.
# An engine method is wrapped on the part of Engine that defines it (the owner's own __dict__).
STAGES: list[tuple[str, Any, str]] = [
    ("read applied log", jobmod, "applied_lsns"),
    ("  engine start", Engine, "start"),
    ("read: peek COPY + framing", SlotSource, "read_window"),
    ("decode: WindowDecoder.feed", WindowDecoder, "feed"),
    ("apply table (reduce + stage + MERGE)", applymod.TableApplier, "apply"),
    ("  reduce_changes", stagemod, "reduce_changes"),
    ("  fill TOAST lookups", applymod, "fill_lookups"),
    ("  stage Parquet", Lake, "stage"),
    ("  ensure_table", DeltaWrites, "ensure_table"),
    ("  MERGE", DeltaWrites, "merge"),
    ("append applied log", applied_log, "append"),
    ("advance slot", SlotSource, "advance"),
    ("engine stop", Lakeside, "close"),
]


def instrument() -> StageTimer:
    timer = StageTimer()
    for label, owner, attr in STAGES:
        if attr == "read_window":
            time_generator(timer, owner, attr, label)
        else:
            timer.wrap(owner, attr, label)
    return timer


def add_e2e_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the end-to-end run (shared with bench_spark.py)."""
    add_window_args(ap)
    ap.add_argument("--repeat", type=int, default=3, help="server timings; the best counts (default 3)")
    ap.add_argument("--max-changes", type=int, default=None, help="window.max_changes of the job (default: the job's)")
    ap.add_argument("--keep-lake", action="store_true", help="keep the temporary lake and print where it is")
    ap.add_argument("--engine", default="embedded", choices=("embedded", "spark"), help="engine.kind (default embedded)")
    ap.add_argument("--no-fixed-costs", action="store_true", help="skip the idle and 10,000-change runs after the window")


def cli_run(dsn: str, lake: Path, engine: str) -> tuple[float, dict[str, Any]]:
    """``pg2delta run --json`` in a child process, as a scheduler starts it: (seconds, its report)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    args = [sys.executable, "-m", "pg2delta.cli", "run", "--dsn", dsn, "--slot", SLOT, "--publication", PUB,
            "--lake", str(lake), "--engine", engine, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"pg2delta run exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return seconds, json.loads(done.stdout)


def fixed_costs(dsn: str, lake: Path, engine: str) -> None:
    """What a run costs when there is (almost) nothing to do: the process, the engine, the checks."""
    seconds, report = cli_run(dsn, lake, engine)
    assert report["changes"] == 0, report  # (the slot may still move over WAL of other tables)
    print(f"idle run (pg2delta run in a new process, no changes to apply): {seconds:.2f} s")
    print(f"idle_run_seconds={seconds:.2f}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for lo in range(1, 10_001, 1000):
            conn.execute(f"UPDATE {TABLE} SET qty = qty + 1 WHERE id BETWEEN %s AND %s", (lo, lo + 999))
    seconds, report = cli_run(dsn, lake, engine)
    assert report["changes"] == 10_000, report
    print(f"small run (pg2delta run in a new process, 10,000 updates in 10 transactions): {seconds:.2f} s")
    print(f"small_run_seconds={seconds:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_e2e_args(ap)
    args = ap.parse_args(argv)
    measured = measure(args)
    if measured is None:
        return 1
    print(f"e2e_vs_server={measured.ratio:.2f}")
    return 0


@dataclass(frozen=True)
class Measured:
    """One end-to-end run: the ratio, the server's COPY seconds, and the Delta table the run wrote
    (still there with ``--keep-lake``)."""

    ratio: float
    server_seconds: float
    table: Path


def measure(args: argparse.Namespace) -> Measured | None:
    """One end-to-end run as the module docstring says; None when the lake is wrong."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pg2delta").setLevel(logging.INFO)

    win = make_window(args.pg, args.changes, txn_rows=args.txn_rows, update_share=args.update_share)
    lake = Path(tempfile.mkdtemp(prefix="pg2delta-bench-lake-"))
    ok = False
    try:
        dsn, n = win.pg.dsn, win.changes
        t_server, (server_rows, first_row) = best_of(args.repeat, lambda: server_copy(dsn, win.upto))

        config = cfgmod.load(
            env={}, dsn=dsn, slot=SLOT, publication=PUB, lake=str(lake), engine=args.engine,
            max_changes=args.max_changes,
        )
        timer = instrument()
        t0 = time.perf_counter()
        job = jobmod.Job(config)
        try:
            report = job.run()
        finally:
            job.close()
        t_job = time.perf_counter() - t0
        timer.restore()

        read_rows = sum(w.rows for w in report.windows)
        applied = report.changes
        print(f"window: {server_rows:,} slot rows, {n:,} changes; the job read {read_rows:,} rows "
              f"in {len(report.windows)} window(s) (window.max_changes={config.window.max_changes:,}), "
              f"counted {applied:,} changes")
        t_engine = timer.seconds["  engine start"] + timer.seconds["engine stop"]
        print("rates in changes (Insert/Update messages) per second:")
        print(f"  server  COPY (peek) TO STDOUT, dropped (best of {args.repeat}) {rate(n, t_server)}   <- reference")
        print(f"          (first row after {first_row:.2f} s, in the last of those runs)")
        print(f"  job     Job(config).run(), end to end           {rate(n, t_job)}")
        print(f"  job     without engine start/stop               {rate(n, t_job - t_engine)}")
        print(f"job stages ({t_job:.2f} s in all; indented stages are part of the one above):")
        for label, _owner, _attr in STAGES:
            secs = timer.seconds[label]
            print(f"  {label:<40} {secs:7.2f} s  {100 * secs / t_job:5.1f}%  ({timer.calls[label]} calls)")
        top = sum(timer.seconds[label] for label, _o, _a in STAGES if not label.startswith(" "))
        print(f"  {'(not in a stage above)':<40} {t_job - top:7.2f} s")

        # The lake against PostgreSQL, read with delta-rs.
        from deltalake import DeltaTable

        schema, name = TABLE.split(".")
        with psycopg.connect(dsn) as conn:
            row = conn.execute(f"SELECT count(*), sum(qty), sum(amount) FROM {TABLE}").fetchone()
        assert row is not None
        pg_count, pg_qty, pg_amount = int(row[0]), int(row[1]), row[2]
        # delta-rs's scan reads deletion vectors (the tables Apache Spark creates have them), to_pyarrow_table does not.
        table = pa.table(DeltaTable(str(lake / schema / name)).scan(columns=["qty", "amount"]).read_all())
        delta_count = table.num_rows
        delta_qty = int(table.column("qty").to_numpy().sum())
        delta_amount = sum(v for v in table.column("amount").to_pylist() if v is not None)
        print(f"check: PostgreSQL {pg_count:,} rows (sum qty {pg_qty}, sum amount {pg_amount}); "
              f"Delta {delta_count:,} rows (sum qty {delta_qty}, sum amount {delta_amount})")
        ok = (pg_count, pg_qty, pg_amount) == (delta_count, delta_qty, delta_amount) and applied == n
        if not ok:
            print("MISMATCH: the Delta table does not hold what PostgreSQL holds", file=sys.stderr)
            return None
        if not args.no_fixed_costs:
            fixed_costs(dsn, lake, args.engine)
        return Measured((n / t_job) / (n / t_server), t_server, lake / schema / name)
    finally:
        win.pg.stop()
        if args.keep_lake or not ok:
            print(f"lake kept at {lake}", file=sys.stderr)
        else:
            shutil.rmtree(lake, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
