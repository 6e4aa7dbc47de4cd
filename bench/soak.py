"""`make soak`: a mixed workload for a set time (or of a set size: ``--transactions``), pg2delta run
every few seconds as a new process, faults at random, then the lake compared with PostgreSQL, every
table, every row.

On a throwaway PostgreSQL (18 by default: ``--pg``), with the lake on the S3-compatible server of
the tests (S3Proxy, ``make s3proxy``) behind their fault-injecting proxy (tests/s3fault.py):

1. **workload** (bench/soak_workload.py): pgbench's own TPC-B script at ``--rate`` transactions a
   second, and beside it a writer that changes ``soak.items`` and its shape (columns added with
   and without defaults, dropped, renamed, widened) and truncates it or ``pgbench_history``; once
   each, a column with a default added to ``pgbench_history`` and ``pgbench_accounts.abalance``
   widened, under pgbench's feet. The config lets the lake follow all of it without a human
   (``dropped_columns = "drop"``, ``on_unfollowable = "resync"``), keeps a changelog of every table
   and maintains two tables a run every 20 s.
2. **runs**: ``pg2delta run`` (``python -m pg2delta.cli``, a new process each time, as a scheduler
   starts it) every ``--interval`` seconds (0.5x to 1.5x), about ``--fault-share`` of them with a
   fault, its kind drawn from a shuffled bag of every kind (so each comes once before any comes
   twice), at a random moment of the run (within the median time of the last five runs without
   one): ``sigkill``, ``sigterm``, ``terminate_backend`` (``pg_terminate_backend`` of the run's
   sessions), ``pg_restart`` (a fast restart of the server),
   ``store_cut`` (every write to the store answered ``500`` from then on) and ``store_throttle``
   (one request in 4 to 8 answered ``503 SlowDown``, the whole run or its first
   ``--throttle-seconds``). A fault whose run ended before it came is put back in the bag. Every
   exit code must be one the faults page documents for that fault (0, 73 for a slot still held by a
   killed run's session, 75, killed); any other is counted in ``soak_unexpected_exits`` with the
   run's last line. A run still going after ``--run-timeout`` gets SIGTERM as from a scheduler's
   timeout (``soak_timeouts``; 0 or 75 expected) and is killed, and counted unexpected, only if it
   is still going 120 s later. ``--shape-interval``: the seconds between the writer's schema changes
   and truncates, each of which ends a window (on Apache Spark a window is a ``MERGE`` per table,
   tens of seconds on a loaded machine).
3. **catch-up**: the workload stops; runs without faults until one finds nothing to do and the slot
   has passed the server's position at the stop.
4. **oracle** (bench/soak_lake.py): every table read back with delta-rs straight from the store,
   compared with PostgreSQL: ``soak_lost``, ``soak_duplicated``, ``soak_different``, and
   ``soak_changelog_duplicated``; exit 1 unless each is 0 and no exit was unexpected.

``soak_worst_lag_seconds``: the server's WAL position is sampled twice a second during the workload;
for each sample, the time until the end of the first run after which the slot had passed it (the
change's age when it reached the lake, to within the sampling). ``soak_changes_applied``: the
``changes`` of the runs that ended 0. ``soak_pgbench_transactions``: what each pgbench printed as
it ended (a time-bound soak gives it the time left, since a stopped one prints nothing). The seed is printed first: ``--seed`` replays the same
choices (the machine's timing still differs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from soak_lake import compare  # noqa: E402
from soak_workload import TABLES, Pgbench, ShapeWriter, prepare, schema_changes  # noqa: E402

from pg2delta.source.throwaway import ThrowawayPostgres, wait_ready  # noqa: E402
from s3fault import FaultProxy  # noqa: E402
from s3server import BUCKET, S3Server, s3proxy_jar  # noqa: E402

KINDS = ("sigkill", "sigterm", "terminate_backend", "pg_restart", "store_cut", "store_throttle")
KILLED = {-signal.SIGKILL: "killed", -signal.SIGTERM: "sigterm_before_handler"}
# The exit codes the faults page documents for each fault (negative: the signal killed it).
EXPECTED = {
    None: {0, 73},
    "sigkill": {0, 73, -signal.SIGKILL},
    "sigterm": {0, 73, 75, -signal.SIGTERM},
    "terminate_backend": {0, 73, 75},
    "pg_restart": {0, 73, 75},
    "store_cut": {0, 73, 75},
    "store_throttle": {0, 73},
}
SLOT = PUBLICATION = "soak"
EXTRA_RUNS = 30  # runs after a time-bound soak's workload, until every kind of fault happened
TERM_GRACE = 120.0  # seconds a run past --run-timeout has to end after its SIGTERM
# The tables with a changelog: the one without a key (a row applied twice is a copy more in both)
# and the one whose shape changes. Each changelog is one commit more per window.
CHANGELOG = ("public.pgbench_history", "soak.items")


@dataclass
class Soak:
    """One soak: the servers, the config, and what happened."""

    args: argparse.Namespace
    pg: ThrowawayPostgres
    store: S3Server | None
    proxy: FaultProxy | None
    work: Path
    root: str
    rng: random.Random
    kinds: tuple[str, ...] = KINDS
    config: Path = field(init=False)
    faults: Counter[str] = field(default_factory=Counter)
    exits: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    changes: int = 0
    runs: int = 0
    timeouts: int = 0
    durations: list[float] = field(default_factory=list)
    ends: list[tuple[float, int]] = field(default_factory=list)  # (time, slot's confirmed LSN) after each run
    _bag: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config = self.work / "soak.toml"
        sections = "".join(
            f'[tables."{t}"]\non_unfollowable = "resync"\n' + ('dropped_columns = "drop"\n' if t == "soak.items" else "")
            + ("changelog = true\n" if t in CHANGELOG else "")
            for t in TABLES
        )
        self.config.write_text(
            f'[source]\ndsn = "{self.pg.dsn}"\nslot = "{SLOT}"\npublication = "{PUBLICATION}"\n'
            f'[lake]\nroot = "{self.root}"\n'
            + ('[engine]\nkind = "spark"\n' if self.args.engine == "spark" else "")
            + f"[window]\nmax_changes = {self.args.window_changes}\n"
            '[maintain]\ninterval = "20s"\ntables_per_run = 2\nrun_budget = "10s"\n' + sections
        )

    # the CLI as a scheduler starts it

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
        if self.proxy is not None:
            env.update(self.proxy.env)
        return env

    def start(self, *args: str) -> subprocess.Popen[str]:
        log = open(self.work / f"run-{self.runs:04d}.log", "w")  # noqa: SIM115 (the child writes it)
        try:
            return subprocess.Popen(
                [sys.executable, "-m", "pg2delta.cli", *args, "--config", str(self.config), "--json"],
                env=self.env(), stdout=subprocess.PIPE, stderr=log, text=True,
            )
        finally:
            log.close()

    def last_line(self) -> str:
        lines = (self.work / f"run-{self.runs:04d}.log").read_text(errors="replace").strip().splitlines()
        mine = [line for line in lines if line.startswith("pg2delta")]
        return (mine or lines or [""])[-1][:300]

    # faults

    def next_fault(self) -> str | None:
        if self.rng.random() >= self.args.fault_share:
            return None
        if not self._bag:
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        return self._bag.pop()

    def inject(self, kind: str, proc: subprocess.Popen[str]) -> bool:
        """``kind`` into the running ``proc``; False when it was not done (the run ended first)."""
        if proc.poll() is not None:
            return False
        if kind in ("sigkill", "sigterm"):
            proc.send_signal(signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)
            return True
        if kind == "terminate_backend":
            return self._terminate(proc)
        if kind == "pg_restart":
            self.pg.restart()
            return True
        assert self.proxy is not None
        self.proxy.policy = lambda method, path, n: 500 if method in ("PUT", "POST", "DELETE") else None
        return True

    def _terminate(self, proc: subprocess.Popen[str]) -> bool:
        """``pg_terminate_backend`` of the run's sessions, as soon as it has one."""
        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            while proc.poll() is None:
                done = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name LIKE 'pg2delta%%' AND pid <> pg_backend_pid()"
                ).fetchone()
                if done and done[0]:
                    return True
                time.sleep(0.02)
        return False

    def run_once(self, kind: str | None) -> dict[str, Any] | None:
        """One run with ``kind`` injected at a random moment; its JSON report when it ended 0."""
        self.runs += 1
        if kind == "store_throttle" and self.proxy is not None:
            every = self.rng.randint(4, 8)
            until = time.monotonic() + (self.args.throttle_seconds or float("inf"))
            self.proxy.policy = lambda method, path, n: 503 if n % every == 0 and time.monotonic() < until else None
        recent = sorted(self.durations[-5:])  # the last runs without a fault: runs shorten once a backlog is gone
        typical = recent[len(recent) // 2] if recent else 3.0
        delay = self.rng.uniform(0.05, typical)
        t0 = time.monotonic()
        proc = self.start("run")
        injected = kind == "store_throttle"
        timed_out = False
        try:
            if kind not in (None, "store_throttle"):
                try:
                    proc.wait(delay)
                except subprocess.TimeoutExpired:
                    injected = self.inject(kind, proc)
            out, _ = proc.communicate(timeout=max(1.0, self.args.run_timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            out, timed_out = self._time_out(kind, proc), True
        finally:
            if self.proxy is not None:
                self.proxy.policy = lambda method, path, n: None
        return self._record(kind, injected, proc.returncode, out, time.monotonic() - t0, timed_out)

    def _time_out(self, kind: str | None, proc: subprocess.Popen[str]) -> str:
        """A run past ``--run-timeout`` stopped as a scheduler's timeout stops it (Airflow's
        ``execution_timeout``, a Kubernetes grace period): SIGTERM, which must end it promptly (exit
        75, or 0 had it just finished); SIGKILL and counted unexpected only when it is still going
        :data:`TERM_GRACE` seconds later."""
        self.timeouts += 1
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=TERM_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            self.unexpected.append(
                f"run {self.runs} ({kind}): past --run-timeout ({self.args.run_timeout:.0f} s), "
                f"still running {TERM_GRACE} s after SIGTERM, killed")
        return out

    def _record(self, kind: str | None, injected: bool, code: int, out: str, took: float,
                timed_out: bool = False) -> dict[str, Any] | None:
        self.faults[kind if injected and kind else "none" if kind is None else "missed"] += 1
        self.exits[KILLED.get(code, str(code))] += 1
        self.ends.append((time.time(), self.slot_lsn()))
        if kind and not injected:
            self._bag.append(kind)  # its run ended first: it comes again
        expected = EXPECTED[kind if injected else None] | (EXPECTED["sigterm"] if timed_out else set())
        killed_after_grace = timed_out and code == -signal.SIGKILL  # counted in _time_out
        if code not in expected and not killed_after_grace:
            self.unexpected.append(f"run {self.runs} ({kind}, injected={injected}): exit {code}: {self.last_line()}")
        print(f"run {self.runs}: fault={kind or '-'}{'' if injected or not kind else ' (missed)'}"
              f"{' (timed out: SIGTERM)' if timed_out else ''} exit={code} {took:.1f} s", flush=True)
        if code != 0:
            return None
        if kind is None or not injected:  # a fault that came too late: a run without one all the same
            self.durations.append(took)
        report: dict[str, Any] = json.loads(out) if out.strip().startswith("{") else {}
        self.changes += int(report.get("changes") or 0)
        return report

    def slot_lsn(self) -> int:
        try:
            with psycopg.connect(self.pg.dsn, connect_timeout=5) as conn:
                row = conn.execute("SELECT confirmed_flush_lsn - '0/0' FROM pg_replication_slots WHERE slot_name = %s",
                                   (SLOT,)).fetchone()
        except psycopg.OperationalError:
            return 0
        return int(row[0]) if row and row[0] is not None else 0


class WalSampler:
    """The server's WAL position twice a second, until :meth:`stop`."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wal", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()
                if row is not None:
                    self.samples.append((time.time(), int(row[0])))
            except psycopg.OperationalError:
                pass  # restarting

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def worst_lag(samples: list[tuple[float, int]], ends: list[tuple[float, int]]) -> float:
    """For each WAL sample, the time until the end of the first run after which the slot had passed
    it; the largest."""
    worst = 0.0
    for t, lsn in samples:
        done = next((end for end, confirmed in ends if end >= t and confirmed >= lsn), None)
        if done is not None:
            worst = max(worst, done - t)
    return worst


def _bootstrap(soak: Soak) -> None:
    proc = soak.start("bootstrap")
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"bootstrap failed ({proc.returncode}): {soak.last_line()}")
    soak.runs += 1
    print(f"bootstrap: {len(json.loads(out)['tables'])} tables", flush=True)


def _scheduled(soak: Soak, seconds: float, shapes: ShapeWriter) -> None:
    """Runs every ``--interval`` seconds (0.5x to 1.5x), with faults, for ``seconds``; then, the
    workload stopped (pgbench ends by itself at ``seconds``, the writer beside it is stopped), on
    until every kind of fault happened once, each run with a kind still missing (at most
    :data:`EXTRA_RUNS`): a slow machine's runs are slow, and those runs catch up rather than meet a
    workload that goes on growing."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        soak.run_once(soak.next_fault())
        time.sleep(soak.rng.uniform(0.5, 1.5) * soak.args.interval)
    shapes.stop()
    for _ in range(EXTRA_RUNS):
        missing = [k for k in soak.kinds if not soak.faults[k]]
        if not missing:
            break
        soak.run_once(soak.rng.choice(missing))
        time.sleep(soak.rng.uniform(0.5, 1.5) * soak.args.interval)


def _scheduled_for(soak: Soak, bench: Pgbench, shapes: ShapeWriter) -> None:
    """Runs as :func:`_scheduled` while pgbench does its ``--transactions`` (the writer beside it
    stops with it), then on until every kind of fault happened once (at most 40 runs more): the
    soak's length is set by the work, not by the clock, so a loaded machine's slower runs meet the
    same workload, not a larger one."""
    while not bench.finished.is_set():
        soak.run_once(soak.next_fault())
        time.sleep(soak.rng.uniform(0.5, 1.5) * soak.args.interval)
    shapes.stop()
    for _ in range(40):
        if all(soak.faults[k] for k in soak.kinds):
            break
        soak.run_once(soak.next_fault())
        time.sleep(soak.rng.uniform(0.5, 1.5) * soak.args.interval)


def _catch_up(soak: Soak, stop_lsn: int) -> int:
    """Runs without faults until one has nothing to do and the slot passed ``stop_lsn``."""
    for n in range(1, 31):
        report = soak.run_once(None)
        if report is not None and report.get("idle") and soak.slot_lsn() >= stop_lsn:
            return n
    soak.unexpected.append("not caught up after 30 runs without faults")
    return 30


def _current_lsn(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'").fetchone()
    return int(row[0]) if row else 0


def soak(args: argparse.Namespace, pg: ThrowawayPostgres, store: S3Server | None, work: Path) -> dict[str, Any]:
    """The soak on running servers; returns its figures."""
    proxy = FaultProxy(store).start() if store is not None else None
    # Apache Spark reaches the store through Hadoop's s3a; delta-rs (the oracle) reads the same keys as s3://
    scheme = "s3a" if args.engine == "spark" else "s3"
    root = f"{scheme}://{BUCKET}/soak-{uuid.uuid4().hex[:8]}" if store is not None else str(work / "lake")
    kinds = KINDS if store is not None else tuple(k for k in KINDS if not k.startswith("store_"))
    s = Soak(args, pg, store, proxy, work, root, random.Random(args.seed), kinds)
    try:
        prepare(pg, args.scale, PUBLICATION)
        _bootstrap(s)
        bench = Pgbench(pg, args.rate, total=args.transactions, seconds=0.0 if args.transactions else args.seconds).start()
        shapes = ShapeWriter(pg, args.seed, args.seconds, bench.progress if args.transactions else None,
                             every=args.shape_interval).start()
        sampler = WalSampler(pg.dsn)
        if args.transactions:
            _scheduled_for(s, bench, shapes)
        else:
            _scheduled(s, args.seconds, shapes)
        sampler.stop()
        shapes.stop()
        bench.stop()
        wait_ready(pg.dsn)
        stop_lsn = _current_lsn(pg.dsn)
        catchup = _catch_up(s, stop_lsn)
        options = store.storage_options if store is not None else {}
        result = compare(pg.dsn, root.replace("s3a://", "s3://", 1), TABLES, options)
    finally:
        if proxy is not None:
            proxy.stop()
    for note in result.notes[:20]:
        print(f"difference: {note}", flush=True)
    for line in s.unexpected:
        print(f"unexpected: {line}", flush=True)
    figures: dict[str, Any] = {"soak_runs": s.runs, "soak_catchup_runs": catchup}
    figures.update({f"soak_faults_{k}": s.faults[k] for k in kinds})
    figures["soak_faults_missed"] = s.faults["missed"]
    figures.update({f"soak_exit_{k}": v for k, v in sorted(s.exits.items())})
    figures.update({
        "soak_changes_applied": s.changes,
        "soak_worst_lag_seconds": round(worst_lag(sampler.samples, s.ends), 1),
        "soak_pgbench_transactions": bench.transactions,
        "soak_pgbench_starts": bench.starts,
        "soak_schema_changes": schema_changes(shapes.done),
        "soak_truncates": shapes.done["truncate_items"] + shapes.done["truncate_history"],
        "soak_rows_compared": result.rows,
        "soak_timeouts": s.timeouts,
        "soak_unexpected_exits": len(s.unexpected),
        "soak_lost": result.lost,
        "soak_duplicated": result.duplicated,
        "soak_different": result.different,
        "soak_changelog_duplicated": result.changelog_duplicated,
    })
    return figures


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env: Callable[[str, str], str] = lambda name, default: os.environ.get(name) or default  # noqa: E731
    ap.add_argument("--seconds", type=float, default=float(env("SOAK_SECONDS", "300")),
                    help="how long the workload and the faults go on (SOAK_SECONDS; default 300)")
    ap.add_argument("--transactions", type=int, default=0,
                    help="the workload's size instead of its time: pgbench's transactions at --rate (the writer beside "
                         "it stops with it); the runs go on until they are done and every kind of fault happened")
    ap.add_argument("--seed", type=int, default=int(env("SOAK_SEED", "0")) or None,
                    help="the random choices' seed (SOAK_SEED; default: a new one, printed)")
    ap.add_argument("--pg", type=int, default=int(env("SOAK_PG", "18")), help="PostgreSQL version (15 or 18)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between the end of a run and the next start (0.5x-1.5x)")
    ap.add_argument("--fault-share", type=float, default=0.5, help="share of the runs with a fault")
    ap.add_argument("--rate", type=float, default=30.0, help="pgbench transactions a second")
    ap.add_argument("--scale", type=int, default=1, help="pgbench's scale (100,000 accounts each)")
    ap.add_argument("--window-changes", type=int, default=2000, help="[window] max_changes")
    ap.add_argument("--run-timeout", type=float, default=900.0,
                    help="a run still going after this gets SIGTERM, as a scheduler's timeout sends it (soak_timeouts; "
                         "exit 75 or 0 expected), and is killed and counted unexpected if still going 120 s later")
    ap.add_argument("--throttle-seconds", type=float, default=0.0,
                    help="how long a store_throttle fault lasts from its run's start (default 0: the whole run)")
    ap.add_argument("--shape-interval", type=float, default=12.0,
                    help="seconds between soak.items' schema changes or truncates (0.5x-1.5x; each cuts a window)")
    ap.add_argument("--engine", choices=("embedded", "spark"), default=env("SOAK_ENGINE", "embedded"),
                    help="the runs' engine (SOAK_ENGINE): spark is Apache Spark + delta-spark in each run's own JVM "
                         "(a Python with pyspark and delta-spark; make soak SOAK_ENGINE=spark)")
    ap.add_argument("--local", action="store_true", help="the lake in a local folder: no object store, no store faults")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (the runs' logs) even when the soak passed")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: the servers stop too (finally)
    args.seed = args.seed or random.SystemRandom().randrange(1, 2**31)
    print(f"soak_seed={args.seed}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="pg2delta-soak-"))
    jar = None if args.local else s3proxy_jar()
    if not args.local and (jar is None or not jar.exists()):
        raise SystemExit("no S3Proxy jar: run `make s3proxy` (or --local for a lake without the object store)")
    pg = ThrowawayPostgres.start(args.pg, settings={"max_connections": "100"})
    store = S3Server.start(jar) if jar is not None else None
    try:
        figures = soak(args, pg, store, work)
    finally:
        if store is not None:
            store.stop()
        pg.stop()
    size = {"soak_transactions": args.transactions} if args.transactions else {"soak_seconds": args.seconds}
    figures = {**size, "soak_pg": args.pg, "soak_engine": args.engine, "soak_store": "local" if args.local else "s3", **figures}
    for name, value in figures.items():
        print(f"{name}={value}", flush=True)
    failed = any(figures[k] for k in ("soak_lost", "soak_duplicated", "soak_different", "soak_changelog_duplicated", "soak_unexpected_exits"))
    if failed or args.keep:
        print(f"the runs' logs: {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
