"""`make bench-bootstrap`: the initial copy, next to a plain binary COPY of the same tables.

One run, one throwaway PostgreSQL (15 by default) and a temporary lake:

1. ``--tables`` tables of ``--rows`` rows each (default 2 x 1,000,000), of the same mixed
   10-column shape as the other benchmarks, in one publication;
2. **reference**: ``COPY public.<table> TO STDOUT (FORMAT binary)`` of every table into nothing
   (psycopg reads each row and drops it), the tables spread over ``--parallel`` connections as
   the bootstrap spreads them, best of ``--repeat``; one connection after the other is shown too;
3. **bootstrap**: ``pg2delta.bootstrap.run_bootstrap(config, parallel=--parallel)`` on the embedded
   engine (pysail) into a temporary lake, timed once from the call to its return (slot creation,
   engine start and the Delta commits included), then the busy CPU seconds of the whole machine
   during the reference and during the bootstrap (from /proc/stat: on 2 cores both are CPU-bound),
   then the time spent in each stage of this process (the engine starts in a thread while the slot
   is created; with ``--parallel`` > 1 the tables are read, decoded and staged in worker
   processes, and only the commits, up to ``--parallel`` at once, are timed here);
4. every Delta table is read back with deltalake (an independent reader) and must hold the same
   rows as PostgreSQL: same count and same sums of two columns; otherwise exit 1.

The last line is ``bootstrap_vs_copy=<bootstrap rows/s divided by the reference's rows/s>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from bench_decode import INSERT, StageTimer, best_of
from deltalake import DeltaTable
from psycopg import sql

from pg2delta import bootstrap as bs
from pg2delta import config as cfgmod
from pg2delta import use_bulk_allocator
from pg2delta.copy import copier
from pg2delta.lake.engine import Engine
from pg2delta.lake.engine_writes import DeltaWrites
from pg2delta.source.copy import CopyPlan
from pg2delta.source.throwaway import ThrowawayPostgres

SLOT = "bench_boot_slot"
PUB = "bench_boot_pub"
COLUMNS = """(
    id bigint PRIMARY KEY,
    qty int NOT NULL,
    ref int,
    name text NOT NULL,
    note text,
    amount numeric(12,2),
    at timestamptz NOT NULL,
    doc jsonb,
    flag bool,
    score float8
)"""


def make_tables(dsn: str, tables: int, rows: int) -> list[str]:
    names = [f"bench_copy_{i}" for i in range(tables)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(f"CREATE TABLE public.{name} {COLUMNS}")
            insert = INSERT.replace("public.bench_mixed", f"public.{name}")
            for lo in range(1, rows + 1, 200_000):
                conn.execute(insert, (lo, min(lo + 199_999, rows)))
            conn.execute(f"VACUUM ANALYZE public.{name}")
        conn.execute(f"CREATE PUBLICATION {PUB} FOR TABLE {', '.join('public.' + n for n in names)}")
    return names


def copy_into_nothing(dsn: str, table: str) -> int:
    """Plain binary COPY of one table, every row read by psycopg and dropped; returns rows."""
    pieces = 0
    first = last = b""
    query = sql.SQL("COPY {} TO STDOUT (FORMAT binary)").format(sql.Identifier("public", table))
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur, cur.copy(query) as copy:
        for data in copy:
            if not pieces:
                first = bytes(data)
            pieces += 1
            last = data
    # The 19-byte header may come alone or with the first row; the 2-byte trailer comes alone.
    return pieces - (bytes(last) == b"\xff\xff") - (len(first) == 19)


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every process: the server's, ours, the engine's,
    and anyone else's), from /proc/stat; 0.0 where there is none."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def copy_all(dsn: str, tables: list[str], parallel: int) -> int:
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(tables)))) as pool:
        return sum(pool.map(lambda t: copy_into_nothing(dsn, t), tables))


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:>12,.0f} rows/s  ({seconds:6.2f} s)"


class ThreadSafeTimer(StageTimer):
    """StageTimer whose sums may be added to from several copy threads."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._local = threading.local()

    def wrap(self, owner: object, name: str, label: str | None = None, key: object = None) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        # A classmethod is called bound to its class; anything else as it is.
        call = getattr(owner, name) if isinstance(original, classmethod) else original
        stage = label or name

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[stage] += time.perf_counter() - t0
                    self.calls[stage] += 1

        setattr(owner, name, staticmethod(timed) if isinstance(original, classmethod) else timed)
        self._undo.append(lambda: setattr(owner, name, original))


# (label, owner, attribute); indented stages are part of the one above. With --parallel > 1 the
# tables are read, decoded and staged in worker processes, which these wrappers do not see.
# An engine method is wrapped on the part of Engine that defines it (the owner's own __dict__).
STAGES: list[tuple[str, object, str]] = [
    ("engine start (pysail)", Engine, "start"),
    ("copy all tables (wall)", copier.Copier, "copy_all"),
    ("  stage: COPY -> Arrow -> Parquet (in this process)", copier, "stage_table"),
    ("    decode COPY rows -> Arrow", CopyPlan, "decode"),
    ("  commit: Delta + applied log", copier.Copier, "_commit"),
    ("    Delta commit: adopted (adopt_copy)", DeltaWrites, "adopt_copy"),
    ("    Delta commit: rewritten (replace_table)", DeltaWrites, "replace_table"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows per table (default 1,000,000)")
    ap.add_argument("--tables", type=int, default=2, help="tables (default 2)")
    ap.add_argument("--parallel", type=int, default=2, help="tables copied at once, both sides (default 2)")
    ap.add_argument("--pg", type=int, default=15, choices=(15, 18), help="PostgreSQL major version (default 15)")
    ap.add_argument("--repeat", type=int, default=3, help="reference timings; the best counts (default 3)")
    ap.add_argument("--keep-lake", action="store_true", help="keep the temporary lake and print where it is")
    args = ap.parse_args(argv)
    use_bulk_allocator()  # as `pg2delta bootstrap` does, before the engine or the workers load mimalloc

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"pyspark\..*")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pg2delta").setLevel(logging.INFO)

    pg = ThrowawayPostgres.start(args.pg)
    lake = Path(tempfile.mkdtemp(prefix="pg2delta-bench-boot-lake-"))
    ok = False
    try:
        dsn = pg.dsn
        t_load = time.perf_counter()
        tables = make_tables(dsn, args.tables, args.rows)
        total = args.tables * args.rows
        print(f"tables: {args.tables} x {args.rows:,} rows (10 columns), loaded in {time.perf_counter() - t_load:.1f} s; "
              f"PostgreSQL {args.pg}, parallel {args.parallel}; MIMALLOC_PURGE_DELAY={os.environ.get('MIMALLOC_PURGE_DELAY')}")

        t_seq, n_seq = best_of(args.repeat, lambda: copy_all(dsn, tables, 1))
        t_par, n_par = best_of(args.repeat, lambda: copy_all(dsn, tables, args.parallel))
        cpu0 = busy_cpu_seconds()
        copy_all(dsn, tables, args.parallel)
        cpu_ref = busy_cpu_seconds() - cpu0
        assert n_seq == n_par == total, (n_seq, n_par, total)

        config = cfgmod.load(env={}, dsn=dsn, slot=SLOT, publication=PUB, lake=str(lake), engine="embedded")
        timer = ThreadSafeTimer()
        for label, owner, attr in STAGES:
            timer.wrap(owner, attr, label)
        t0, cpu0 = time.perf_counter(), busy_cpu_seconds()
        report = bs.run_bootstrap(config, parallel=args.parallel)
        t_boot = time.perf_counter() - t0
        cpu_boot = busy_cpu_seconds() - cpu0
        timer.restore()
        copied = sum(t.rows for t in report.copied)

        print(f"rates in rows per second, {total:,} rows:")
        print(f"  COPY TO STDOUT (FORMAT binary), dropped, 1 connection     {rate(total, t_seq)}")
        print(f"  COPY TO STDOUT (FORMAT binary), dropped, {args.parallel} connection(s)  {rate(total, t_par)}   <- reference")
        print(f"  pg2delta bootstrap, end to end                           {rate(copied, t_boot)}")
        print(f"busy CPU of the machine ({os.cpu_count()} cores): reference {cpu_ref:.2f} s, bootstrap {cpu_boot:.2f} s "
              "(every process: PostgreSQL's backends, the workers, the engine)")
        where = "in this process" if args.parallel == 1 else f"staging in {args.parallel} worker processes, not timed"
        print(f"bootstrap stages ({t_boot:.2f} s wall; {where}):")
        for label, _owner, _attr in STAGES:
            secs = timer.seconds[label]
            print(f"  {label:<52} {secs:8.2f} s  ({timer.calls[label]} calls)")

        mismatches = []
        with psycopg.connect(dsn) as conn:
            for name in tables:
                row = conn.execute(f"SELECT count(*), sum(qty), sum(amount) FROM public.{name}").fetchone()
                assert row is not None
                dt = pa.table(DeltaTable(str(lake / "public" / name)).scan(columns=["qty", "amount"]).read_all())
                got = (dt.num_rows, pc.sum(dt.column("qty")).as_py(), Decimal(pc.sum(dt.column("amount")).as_py()))
                want = (int(row[0]), int(row[1]), Decimal(row[2]))
                print(f"check {name}: PostgreSQL {want[0]:,} rows (sum qty {want[1]}, sum amount {want[2]}); "
                      f"Delta {got[0]:,} rows (sum qty {got[1]}, sum amount {got[2]})")
                if got != want:
                    mismatches.append(name)
        if mismatches or copied != total:
            print(f"MISMATCH in {mismatches or 'row count'}; lake kept at {lake}", file=sys.stderr)
            return 1
        ok = True
        print(f"bootstrap_vs_copy={(copied / t_boot) / (total / t_par):.2f}")
        return 0
    finally:
        pg.stop()
        if args.keep_lake or not ok:
            print(f"lake: {lake}", file=sys.stderr)
        else:
            shutil.rmtree(lake, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
