"""The soak's workload (bench/soak.py): pgbench's own TPC-B script, and beside it a writer that
changes a table of its own, changes its shape and truncates.

- **pgbench** (the server's own ``pgbench``, builtin ``tpcb-like``: ``UPDATE`` of an account, a
  teller and a branch and an ``INSERT`` into ``pgbench_history``, which has no key) at a fixed
  rate, started again whenever it exits before the end (a PostgreSQL restart aborts its clients).
- **the shape writer**: inserts, updates and deletes in ``soak.items`` every fraction of a second,
  and every 6 to 18 s (``every``) a schema change of it (a column added, with or without a default, dropped,
  renamed, widened: smallint -> integer -> bigint, numeric(8,2) -> numeric(12,2)) or a
  ``TRUNCATE`` (of ``soak.items`` with rows inserted in the same transaction, or of
  ``pgbench_history``); at fixed points of the soak, once each, a column added with a default to
  ``pgbench_history`` and ``pgbench_accounts.abalance`` widened to bigint under pgbench's feet.

Both survive a server restart: they connect again and go on.
"""

from __future__ import annotations

import random
import re
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from pg2delta.source.throwaway import ThrowawayPostgres

ITEMS_DDL = """
CREATE SCHEMA soak;
CREATE TABLE soak.items (id bigint PRIMARY KEY, qty smallint, price numeric(8,2), note text, at timestamptz);
INSERT INTO soak.items SELECT g, (g % 100)::smallint, (g % 997) * 1.25, 'row ' || g, timestamptz '2026-01-01 00:00:00+00' + g * interval '1 minute'
FROM generate_series(1, 2000) g;
"""
PGBENCH_TABLES = ("public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers", "public.pgbench_history")
TABLES = (*PGBENCH_TABLES, "soak.items")
WIDER = {"smallint": "integer", "integer": "bigint", "numeric(8,2)": "numeric(12,2)"}


def prepare(pg: ThrowawayPostgres, scale: int, publication: str) -> None:
    """pgbench's tables (``pgbench -i``: accounts, branches, tellers with keys, history without),
    ``soak.items``, and a publication of all five."""
    done = subprocess.run(
        [str(pg.bindir / "pgbench"), "-i", "-s", str(scale), "-I", "dtgvp", "-q", *_conn_args(pg)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pgbench -i failed ({done.returncode}): {done.stderr[-2000:]}")
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        conn.execute(ITEMS_DDL)
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            sql.Identifier(publication),
            sql.SQL(", ").join(sql.Identifier(*t.split(".")) for t in TABLES),
        ))


def _conn_args(pg: ThrowawayPostgres) -> list[str]:
    return ["-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "postgres"]


@dataclass
class Pgbench:
    """pgbench at ``rate`` transactions a second on ``clients`` connections until :meth:`stop`, or
    until ``total`` transactions are done (0: no such bound), when :attr:`finished` is set, or for
    ``seconds`` from :meth:`start`. pgbench prints the count of its transactions only when it ends
    by itself: a SIGINT kills it without a word (pgbench 18, tried), so a time-bound one is given
    the time left (``-T``) rather than stopped, or its transactions would go uncounted."""

    pg: ThrowawayPostgres
    rate: float
    total: int = 0
    seconds: float = 0.0
    clients: int = 2
    transactions: int = 0
    starts: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _proc: subprocess.Popen[str] | None = None
    _thread: threading.Thread | None = None
    _started: float | None = None

    def start(self) -> Pgbench:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="pgbench", daemon=True)
        self._thread.start()
        return self

    def progress(self) -> float:
        """The share of the time ``total`` takes at ``rate`` gone since :meth:`start` (0 without a
        bound): pgbench, held to its rate, is never ahead of it, so a change made at a share below 1
        comes while pgbench is still writing (its count is known only when a pgbench ends)."""
        if not self.total or self._started is None:
            return 0.0
        return min(1.0, (time.monotonic() - self._started) * self.rate / self.total)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.total and self.transactions >= self.total:
                self.finished.set()
                return
            # -t: transactions per client, what is left of the total (a restart aborts its clients)
            left = self.seconds - (time.monotonic() - (self._started or 0.0)) if self.seconds else 3600.0
            if left < 1:
                return
            bound = ["-t", str(-(-(self.total - self.transactions) // self.clients))] if self.total else ["-T", str(int(left))]
            self.starts += 1
            argv = [str(self.pg.bindir / "pgbench"), "-n", "-c", str(self.clients), "-j", "1",
                    "-R", str(self.rate), *bound, *_conn_args(self.pg)]
            self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            out, _ = self._proc.communicate()
            found = re.search(r"number of transactions actually processed: (\d+)", out)
            self.transactions += int(found.group(1)) if found else 0
            if not self._stop.is_set() and not (self.total and self.transactions >= self.total):
                time.sleep(0.5)  # its clients aborted (a server restart): start it again

    def stop(self) -> None:
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(2)  # SIGINT: pgbench stops and prints its summary
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._thread is not None:
            self._thread.join(60)


@dataclass
class ShapeWriter:
    """Changes ``soak.items`` (rows, shape, truncates) until :meth:`stop`; counts what it did. Its
    once-only changes come at fixed shares of the soak: of ``seconds``, or of ``progress()`` (the
    share of the workload done) when given."""

    pg: ThrowawayPostgres
    seed: int
    seconds: float
    progress: Callable[[], float] | None = None
    every: float = 12.0  # seconds between schema changes or truncates (0.5x-1.5x)
    done: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _next_id: int = 100_000
    _next_col: int = 0

    def start(self) -> ShapeWriter:
        self._thread = threading.Thread(target=self._loop, name="shapes", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)

    def _loop(self) -> None:
        rng = random.Random(self.seed)
        started = time.monotonic()
        once = [(0.3, self._history_default), (0.6, self._widen_abalance), (0.8, lambda c: self._a_truncate(c, rng))]
        next_shape = started + rng.uniform(2, 6) * self.every / 12
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.pg.dsn, autocommit=True, connect_timeout=5, application_name="soak-shapes")
                elapsed = self.progress() if self.progress else (time.monotonic() - started) / self.seconds
                if once and elapsed >= once[0][0]:
                    once.pop(0)[1](conn)
                elif time.monotonic() >= next_shape:
                    self._shape_or_truncate(conn, rng)
                    next_shape = time.monotonic() + rng.uniform(0.5, 1.5) * self.every
                else:
                    self._rows(conn, rng)
            except psycopg.OperationalError as exc:  # the server restarting
                self.done["reconnects"] += 1
                self.errors.append(str(exc).strip().splitlines()[0])
                conn = None
                time.sleep(0.5)
            self._stop.wait(rng.uniform(0.05, 0.3))
        if conn is not None:
            conn.close()

    # rows

    def _columns(self, conn: psycopg.Connection[Any]) -> dict[str, str]:
        rows = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = 'soak.items'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        ).fetchall()
        return {str(n): str(t) for n, t in rows}

    def _value(self, rng: random.Random, type_: str) -> Any:
        if rng.random() < 0.1:
            return None
        if type_ == "smallint":
            return rng.randint(-30_000, 30_000)
        if type_ in ("integer", "bigint"):
            return rng.randint(-(2**31) + 1, 2**31 - 1) if type_ == "integer" else rng.randint(-(2**62), 2**62)
        if type_.startswith("numeric"):
            return Decimal(rng.randint(-999_999, 999_999)) / 100
        if type_ == "text":
            return "".join(rng.choice("abcdefgh éØ'\"") for _ in range(rng.randint(0, 30)))
        return None  # at: left to its default (NULL)

    def _rows(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        cols = {n: t for n, t in self._columns(conn).items() if n not in ("id", "at")}
        names = list(cols)
        what = rng.random()
        with conn.transaction():
            if what < 0.45:
                for _ in range(rng.randint(1, 8)):
                    self._next_id += 1
                    values = [self._value(rng, cols[n]) for n in names]
                    conn.execute(sql.SQL("INSERT INTO soak.items (id, {}) VALUES (%s, {})").format(
                        sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL(", ").join(sql.Placeholder() * len(names)),
                    ), [self._next_id, *values])
                self.done["item_inserts"] += 1
            elif what < 0.85:
                column = rng.choice(names)
                conn.execute(sql.SQL("UPDATE soak.items SET {} = %s WHERE id IN (SELECT id FROM soak.items ORDER BY random() LIMIT %s)").format(
                    sql.Identifier(column)), (self._value(rng, cols[column]), rng.randint(1, 20)))
                self.done["item_updates"] += 1
            else:
                conn.execute("DELETE FROM soak.items WHERE id IN (SELECT id FROM soak.items ORDER BY random() LIMIT %s)",
                             (rng.randint(1, 5),))
                self.done["item_deletes"] += 1

    # shapes and truncates

    def _shape_or_truncate(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        cols = self._columns(conn)
        added = [n for n in cols if n.startswith("c")]
        widenable = [n for n, t in cols.items() if t in WIDER]
        choices = ["add", "add_default", "truncate_items", "truncate_history"]
        choices += ["drop", "rename"] * bool(added) + ["widen"] * bool(widenable)
        what = rng.choice(choices)
        self.done[what] += 1
        if what in ("add", "add_default"):
            self._next_col += 1
            type_ = rng.choice(["smallint", "integer", "text", "numeric(8,2)"])
            default = sql.SQL(" DEFAULT {}").format(sql.Literal(self._value(rng, type_) or 7)) if what == "add_default" else sql.SQL("")
            conn.execute(sql.SQL("ALTER TABLE soak.items ADD COLUMN {} {}{}").format(
                sql.Identifier(f"c{self._next_col}"), sql.SQL(type_), default))
        elif what == "drop":
            conn.execute(sql.SQL("ALTER TABLE soak.items DROP COLUMN {}").format(sql.Identifier(rng.choice(added))))
        elif what == "rename":
            self._next_col += 1
            conn.execute(sql.SQL("ALTER TABLE soak.items RENAME COLUMN {} TO {}").format(
                sql.Identifier(rng.choice(added)), sql.Identifier(f"c{self._next_col}")))
        elif what == "widen":
            column = rng.choice(widenable)
            conn.execute(sql.SQL("ALTER TABLE soak.items ALTER COLUMN {} TYPE {}").format(
                sql.Identifier(column), sql.SQL(WIDER[cols[column]])))
        elif what == "truncate_items":
            with conn.transaction():
                conn.execute("TRUNCATE soak.items")
                self._rows(conn, rng)  # rows after the truncate, same transaction
        else:
            conn.execute("TRUNCATE pgbench_history")

    def _a_truncate(self, conn: psycopg.Connection[Any], rng: random.Random) -> None:
        """A truncate of soak.items (rows after it, same transaction) when the random draws gave none
        yet: a soak whose workload ends early (a fast machine) still has one."""
        if self.done["truncate_items"] + self.done["truncate_history"]:
            return
        self.done["truncate_items"] += 1
        with conn.transaction():
            conn.execute("TRUNCATE soak.items")
            self._rows(conn, rng)

    def _history_default(self, conn: psycopg.Connection[Any]) -> None:
        """A column with a default on a table with rows: older rows hold it as PostgreSQL reads them."""
        conn.execute("ALTER TABLE pgbench_history ADD COLUMN soak_note text DEFAULT 'before the soak'")
        self.done["history_add_default"] += 1

    def _widen_abalance(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute("ALTER TABLE pgbench_accounts ALTER COLUMN abalance TYPE bigint")
        self.done["accounts_widen"] += 1


def schema_changes(done: Counter[str]) -> int:
    """How many schema changes ``done`` (a :class:`ShapeWriter`'s counts) holds."""
    return sum(done[k] for k in ("add", "add_default", "drop", "rename", "widen", "history_add_default", "accounts_widen"))


__all__ = ["PGBENCH_TABLES", "TABLES", "Pgbench", "ShapeWriter", "prepare", "schema_changes"]
