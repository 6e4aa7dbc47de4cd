"""A seeded random workload for end-to-end tests, and the oracle that checks the lake.

The workload drives a real PostgreSQL database through several connections at once:
interleaved transactions committed in random order, rolled-back transactions and
savepoints, primary-key changing updates, large random (incompressible) TOASTed text
values updated partially (so pgoutput sends them as unchanged TOAST), deletes, truncates
(one table, and two at once), multi-row statements and large transactions that spill.

Every connection owns a disjoint slice of every keyed table, so interleaved transactions
never wait for each other's row locks; truncates run only when no transaction is open.

The oracle is PostgreSQL itself: :func:`assert_lake_matches` reads each Delta table with
delta-rs (independent of the engine that wrote it) and compares it row for row with a
``SELECT`` of the same table, sorted by key. Keyless tables are compared as multisets, so a
row lost or applied twice is a failure.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from engines import child_env
from lake_read import read_delta

META_PREFIX = "_pg2delta_"


@dataclass(frozen=True)
class TableSpec:
    schema: str
    name: str
    key: tuple[str, ...]  # empty: no key (insert-only)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def ident(self) -> sql.Composable:
        return sql.Identifier(self.schema, self.name)


ACCT = TableSpec("public", "acct", ("id",))
PAIR = TableSpec("shop", "pair", ("region", "n"))
FULLID = TableSpec("public", "fullid", ("id",))
EVENTS = TableSpec("public", "events", ())
TABLES = (ACCT, PAIR, FULLID, EVENTS)

DDL = """
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE acct (
    id integer PRIMARY KEY,
    big bigint,
    name text,
    amount numeric(12,2),
    at timestamptz,
    doc jsonb,
    flag boolean,
    blob bytea,
    body text
);
CREATE TABLE shop.pair (
    region text NOT NULL,
    n integer NOT NULL,
    qty bigint,
    note text,
    at timestamptz,
    PRIMARY KEY (region, n)
);
CREATE TABLE fullid (
    id bigint PRIMARY KEY,
    val text,
    amount numeric(12,2),
    flag boolean,
    body text
);
ALTER TABLE fullid REPLICA IDENTITY FULL;
CREATE TABLE events (
    at timestamptz,
    kind text,
    n integer,
    payload jsonb,
    raw bytea
);
"""


def create_schema(dsn: str, publication: str, *, tables: Sequence[TableSpec] = TABLES) -> None:
    """The workload's tables and a publication of them (events has no key: insert-only)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DDL)
        # Autovacuum would write WAL between runs; the tests want a quiet server.
        for t in TABLES:
            conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = off)").format(t.ident))
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(publication), sql.SQL(", ").join(t.ident for t in tables)
            )
        )


# --- the random workload -------------------------------------------------------------------


@dataclass
class _Conn:
    index: int
    conn: psycopg.Connection[Any]
    in_txn: bool = False
    savepoint: bool = False


@dataclass
class Workload:
    """A seeded workload over :data:`TABLES`; call :meth:`phase` between job runs."""

    dsn: str
    seed: int
    connections: int = 3
    rng: random.Random = field(init=False)
    _conns: list[_Conn] = field(init=False, default_factory=list)
    _next: list[int] = field(init=False, default_factory=list)
    log: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._next = [0] * self.connections

    # life cycle

    def __enter__(self) -> Workload:
        for k in range(self.connections):
            conn = psycopg.connect(self.dsn, autocommit=True, application_name=f"workload-{k}")
            self._conns.append(_Conn(k, conn))
        return self

    def __exit__(self, *exc: object) -> None:
        for c in self._conns:
            c.conn.close()
        self._conns.clear()

    # values

    def _new_id(self, k: int) -> int:
        """A fresh key owned by connection ``k`` (ids are k mod the connection count)."""
        self._next[k] += 1
        return self._next[k] * self.connections + k

    def _text(self) -> str | None:
        r = self.rng.random()
        if r < 0.1:
            return None
        if r < 0.15:
            return ""
        alphabet = "abcdefghijklmnopqrstuvwxyz ÄéØ😀'\"\\\n\t,"
        return "".join(self.rng.choice(alphabet) for _ in range(self.rng.randint(1, 40)))

    def _toast(self) -> str:
        """A random text of 9-14 kB that does not compress, so it is stored out of line."""
        n = self.rng.randint(9_000, 14_000)
        return f"{self.rng.getrandbits(4 * n):0{n}x}"[:n]

    def _maybe_toast(self, p: float = 0.3) -> str | None:
        return self._toast() if self.rng.random() < p else self._text()

    def _numeric(self) -> Decimal | None:
        if self.rng.random() < 0.1:
            return None
        return Decimal(self.rng.randint(-9_999_999_999, 9_999_999_999)) / 100

    def _ts(self) -> datetime | None:
        if self.rng.random() < 0.1:
            return None
        base = datetime(1990, 1, 1, tzinfo=UTC)
        return base + timedelta(microseconds=self.rng.randint(0, 60 * 365 * 86_400 * 10**6))

    def _json(self) -> str | None:
        if self.rng.random() < 0.1:
            return None
        doc: dict[str, Any] = {
            "k": self.rng.randint(-1000, 1000),
            "s": self._text(),
            "l": [self.rng.random() < 0.5 for _ in range(self.rng.randint(0, 4))],
            "n": {"x": self.rng.choice([None, 1.5, "é", []])},
        }
        return json.dumps(doc)

    def _bytes(self) -> bytes | None:
        if self.rng.random() < 0.1:
            return None
        return self.rng.randbytes(self.rng.randint(0, 64))

    def _bool(self) -> bool | None:
        return self.rng.choice([True, False, None])

    def _big(self) -> int | None:
        return self.rng.choice([None, 0, -(2**63), 2**63 - 1, self.rng.randint(-(10**15), 10**15)])

    # statements per connection (each touches only its own slice)

    def _own_keys(self, c: _Conn, spec: TableSpec, limit: int) -> list[tuple[Any, ...]]:
        if spec is PAIR:
            q = sql.SQL("SELECT region, n FROM shop.pair WHERE region LIKE %s ORDER BY region, n")
            rows = c.conn.execute(q, (f"r{c.index}%",)).fetchall()
        else:
            q = sql.SQL("SELECT id FROM {} WHERE id %% %s = %s ORDER BY id").format(spec.ident)
            rows = c.conn.execute(q, (self.connections, c.index)).fetchall()
        if not rows:
            return []
        return self.rng.sample(rows, min(limit, len(rows)))

    def _acct_row(self, k: int, body: bool = True) -> tuple[Any, ...]:
        return (
            self._new_id(k), self._big(), self._text(), self._numeric(), self._ts(), self._json(),
            self._bool(), self._bytes(), self._maybe_toast() if body else self._text(),
        )

    def _insert_acct(self, c: _Conn) -> None:
        rows = [self._acct_row(c.index) for _ in range(self.rng.randint(1, 6))]
        with c.conn.cursor() as cur:
            cur.executemany("INSERT INTO acct VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)", rows)
        # and one multi-row statement
        rows = [self._acct_row(c.index, body=False) for _ in range(self.rng.randint(2, 8))]
        values = sql.SQL(", ").join(sql.SQL("(%s, %s, %s, %s, %s, %s, %s, %s, %s)") for _ in rows)
        c.conn.execute(sql.SQL("INSERT INTO acct VALUES {}").format(values), [v for r in rows for v in r])

    def _bulk_acct(self, c: _Conn) -> None:
        """Hundreds of rows in one statement: the transaction spills past logical_decoding_work_mem."""
        first = self._new_id(c.index)
        count = self.rng.randint(200, 600)
        for _ in range(count):
            self._new_id(c.index)
        c.conn.execute(
            "INSERT INTO acct (id, big, name, amount, at, doc, flag) "
            "SELECT %s + g * %s, g::bigint * 1000003, 'bulk ' || g, (g %% 997) * 1.25, "
            "timestamptz '2020-01-01 00:00:00+00' + g * interval '1 second', jsonb_build_object('g', g), g %% 2 = 0 "
            "FROM generate_series(0, %s) g",
            (first, self.connections, count - 1),
        )

    def _update_acct(self, c: _Conn) -> None:
        keys = [k[0] for k in self._own_keys(c, ACCT, self.rng.randint(1, 8))]
        if not keys:
            return
        what = self.rng.randrange(4)
        if what == 0:  # leaves body alone: unchanged TOAST
            c.conn.execute("UPDATE acct SET amount = %s, flag = NOT coalesce(flag, false) WHERE id = ANY(%s)",
                           (self._numeric(), keys))
        elif what == 1:
            c.conn.execute("UPDATE acct SET body = %s, name = %s WHERE id = %s", (self._maybe_toast(0.6), self._text(), keys[0]))
        elif what == 2:
            c.conn.execute("UPDATE acct SET doc = %s, blob = %s, at = %s, big = %s WHERE id = ANY(%s)",
                           (self._json(), self._bytes(), self._ts(), self._big(), keys))
        else:  # primary key change, body unchanged
            for key in keys[:2]:
                c.conn.execute("UPDATE acct SET id = %s, name = %s WHERE id = %s", (self._new_id(c.index), self._text(), key))

    def _delete_acct(self, c: _Conn) -> None:
        keys = [k[0] for k in self._own_keys(c, ACCT, self.rng.randint(1, 4))]
        if keys:
            c.conn.execute("DELETE FROM acct WHERE id = ANY(%s)", (keys,))

    def _pair(self, c: _Conn) -> None:
        what = self.rng.randrange(4)
        if what == 0 or (what == 3 and self.rng.random() < 0.5):
            rows = [
                (f"r{c.index}-{self.rng.randint(0, 3)}", self._new_id(c.index), self._big(), self._text(), self._ts())
                for _ in range(self.rng.randint(1, 10))
            ]
            with c.conn.cursor() as cur:
                cur.executemany("INSERT INTO shop.pair VALUES (%s, %s, %s, %s, %s)", rows)
            return
        keys = self._own_keys(c, PAIR, self.rng.randint(1, 5))
        if not keys:
            return
        if what == 1:
            for region, n in keys:
                c.conn.execute("UPDATE shop.pair SET qty = %s, note = %s WHERE region = %s AND n = %s",
                               (self._big(), self._text(), region, n))
        elif what == 2:  # composite key change: one part, then the other
            region, n = keys[0]
            new_region = f"r{c.index}-{self.rng.randint(4, 9)}"
            c.conn.execute("UPDATE shop.pair SET region = %s WHERE region = %s AND n = %s", (new_region, region, n))
            c.conn.execute("UPDATE shop.pair SET n = %s, qty = qty / 2 WHERE region = %s AND n = %s",
                           (self._new_id(c.index), new_region, n))
        else:
            for region, n in keys:
                c.conn.execute("DELETE FROM shop.pair WHERE region = %s AND n = %s", (region, n))

    def _fullid(self, c: _Conn) -> None:
        what = self.rng.randrange(5)
        if what == 0:
            rows = [(self._new_id(c.index), self._text(), self._numeric(), self._bool(), self._maybe_toast(0.4))
                    for _ in range(self.rng.randint(1, 5))]
            with c.conn.cursor() as cur:
                cur.executemany("INSERT INTO fullid VALUES (%s, %s, %s, %s, %s)", rows)
            return
        keys = [k[0] for k in self._own_keys(c, FULLID, self.rng.randint(1, 5))]
        if not keys:
            return
        if what == 1:  # body unchanged
            c.conn.execute("UPDATE fullid SET val = %s, amount = %s WHERE id = ANY(%s)", (self._text(), self._numeric(), keys))
        elif what == 2:
            c.conn.execute("UPDATE fullid SET id = %s, flag = %s WHERE id = %s", (self._new_id(c.index), self._bool(), keys[0]))
        elif what == 3:
            c.conn.execute("UPDATE fullid SET body = %s WHERE id = %s", (self._maybe_toast(0.5), keys[0]))
        else:
            c.conn.execute("DELETE FROM fullid WHERE id = ANY(%s)", (keys,))

    def _events(self, c: _Conn) -> None:
        rows = [(self._ts(), self.rng.choice(["click", "view", None]), self.rng.randint(0, 5), self._json(), self._bytes())
                for _ in range(self.rng.randint(1, 8))]
        if self.rng.random() < 0.3:
            rows += rows[:2]  # exact duplicates: a keyless table must keep both
        values = sql.SQL(", ").join(sql.SQL("(%s, %s, %s, %s, %s)") for _ in rows)
        c.conn.execute(sql.SQL("INSERT INTO events VALUES {}").format(values), [v for r in rows for v in r])

    def _statement(self, c: _Conn) -> None:
        ops: list[tuple[float, Callable[[_Conn], None]]] = [
            (3, self._insert_acct), (3, self._update_acct), (1.5, self._delete_acct), (0.3, self._bulk_acct),
            (2, self._pair), (2, self._fullid), (1.5, self._events),
        ]
        fn = self.rng.choices([f for _, f in ops], weights=[w for w, _ in ops])[0]
        self.log.append(f"conn{c.index}: {fn.__name__}")
        fn(c)

    # transactions

    def _begin(self, c: _Conn) -> None:
        c.conn.execute("BEGIN")
        c.in_txn = True

    def _end(self, c: _Conn) -> None:
        if c.savepoint:
            c.conn.execute("RELEASE SAVEPOINT sp" if self.rng.random() < 0.5 else "ROLLBACK TO SAVEPOINT sp")
            c.savepoint = False
        verb = "ROLLBACK" if self.rng.random() < 0.15 else "COMMIT"
        self.log.append(f"conn{c.index}: {verb}")
        c.conn.execute(verb)
        c.in_txn = False

    def _truncate(self) -> None:
        assert not any(c.in_txn for c in self._conns)
        conn = self._conns[0].conn
        what = self.rng.choice(["events", "pair+fullid", "events", "acct"])
        self.log.append(f"truncate {what}")
        if what == "events":
            conn.execute("TRUNCATE events")
        elif what == "pair+fullid":
            conn.execute("TRUNCATE shop.pair, fullid")
        else:
            conn.execute("BEGIN")
            conn.execute("TRUNCATE acct")
            self._insert_acct(self._conns[0])  # rows after the truncate, same transaction
            conn.execute("COMMIT")

    def phase(self, steps: int = 40, *, truncate: bool = True) -> None:
        """``steps`` random actions: statements inside interleaved transactions, commits and rollbacks."""
        for _ in range(steps):
            if truncate and not any(x.in_txn for x in self._conns) and self.rng.random() < 0.15:
                self._truncate()
                continue
            c = self.rng.choice(self._conns)
            r = self.rng.random()
            if not c.in_txn and r < 0.5:
                self._begin(c)
            elif c.in_txn and r < 0.18:
                self._end(c)
                continue
            elif c.in_txn and not c.savepoint and r < 0.25:
                c.conn.execute("SAVEPOINT sp")
                c.savepoint = True
            elif c.in_txn and c.savepoint and r < 0.3:
                c.conn.execute("ROLLBACK TO SAVEPOINT sp")  # undoes what the savepoint covered
                c.savepoint = False
            self._statement(c)  # inside the transaction, or autocommit
        open_ = [c for c in self._conns if c.in_txn]
        self.rng.shuffle(open_)
        for c in open_:
            self._end(c)
        if truncate and self.rng.random() < 0.5:
            self._truncate()
            for _ in range(3):
                self._statement(self.rng.choice(self._conns))

    def commit_all(self) -> None:
        for c in self._conns:
            if c.in_txn:
                c.conn.execute("COMMIT")
                c.in_txn = False


# --- the oracle --------------------------------------------------------------------------


def published_table(dsn: str, create: str, name: str, *statements: str) -> tuple[str, str]:
    """``create`` a table ``name``, a publication of it and a slot (new names, returned as (slot,
    publication)), then run ``statements`` (changes the slot will hold)."""
    tag = uuid.uuid4().hex[:8]
    slot, pub = f"slot_{tag}", f"pub_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(create)
        conn.execute(f"CREATE PUBLICATION {pub} FOR TABLE {name}")
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        for statement in statements:
            conn.execute(statement)
    return slot, pub



def one_transaction(dsn: str, *statements: str) -> None:
    """``statements`` in one transaction: one window of the slot."""
    with psycopg.connect(dsn) as conn:
        for statement in statements:
            conn.execute(statement)


def vectors_config(dsn: str, slot: str, pub: str, lake: Path, *, max_changes: int, deletion_vectors: bool = True) -> Any:
    """The default config of a run into ``lake`` with ``[lake] deletion_vectors`` set as given."""
    import dataclasses

    from pg2delta.config import load

    cfg = load(None, env={}, dsn=dsn, slot=slot, publication=pub, lake=str(lake), max_changes=max_changes)
    engine = dataclasses.replace(cfg.engine, deletion_vectors=deletion_vectors)
    return dataclasses.replace(cfg, engine=engine, deletion_vectors=deletion_vectors)

def pg_rows(conn: psycopg.Connection[Any], spec: TableSpec) -> tuple[list[str], list[tuple[Any, ...]]]:
    """The table's column names and rows as ``conn`` sees them (jsonb as text, as the lake holds it)."""
    cols = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (spec.qualified,),
    ).fetchall()
    names = [str(n) for n, _ in cols]
    select = sql.SQL(", ").join(
        sql.SQL("{}::text").format(sql.Identifier(n)) if t in ("jsonb", "json") else sql.Identifier(n) for n, t in cols
    )
    rows = conn.execute(sql.SQL("SELECT {} FROM {}").format(select, spec.ident)).fetchall()
    return names, rows


def _sort_key(row: tuple[Any, ...], idx: Sequence[int]) -> tuple[Any, ...]:
    return tuple((row[i] is None, repr(type(row[i])), row[i] if row[i] is not None else 0) for i in idx)


def _short(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v[:40] + f"...({len(v)} chars)" if isinstance(v, str) and len(v) > 60 else v for v in row)


def lake_rows(
    lake: str | Path, spec: TableSpec, *, version: int | None = None
) -> tuple[list[str], list[tuple[Any, ...]]] | None:
    """The Delta table's columns and rows read with delta-rs (as of ``version``), or None if there is none."""
    path = Path(lake) / spec.schema / spec.name
    if not (path / "_delta_log").is_dir():
        return None
    table = read_delta(str(path), version=version)
    names = [n for n in table.column_names if not n.startswith(META_PREFIX)]
    cols = [table.column(n).to_pylist() for n in names]
    return names, list(zip(*cols, strict=True)) if cols else []


def assert_lake_matches(dsn: str, lake: str | Path, tables: Sequence[TableSpec] = TABLES, *, context: str = "") -> None:
    """Every table of the lake equals the same table in PostgreSQL, row for row, sorted by key."""
    with psycopg.connect(dsn) as conn:
        for spec in tables:
            names, pg = pg_rows(conn, spec)
            where = f"{spec.qualified}{' (' + context + ')' if context else ''}"
            assert_same_rows(spec, names, pg, lake_rows(lake, spec), where)


def assert_same_rows(
    spec: TableSpec,
    names: list[str],
    pg: list[tuple[Any, ...]],
    got: tuple[list[str], list[tuple[Any, ...]]] | None,
    where: str,
) -> None:
    """The lake's rows ``got`` (from :func:`lake_rows`) equal PostgreSQL's ``pg`` row for row, sorted by key."""
    if got is None:
        assert not pg, f"{where}: no Delta table in the lake, {len(pg)} rows in PostgreSQL"
        return
    lake_names, lake_data = got
    assert lake_names == names, f"{where}: lake columns {lake_names} != PostgreSQL columns {names}"
    idx = [names.index(k) for k in spec.key] if spec.key else list(range(len(names)))
    pg_sorted = sorted(pg, key=lambda r: _sort_key(r, idx))
    lake_sorted = sorted(lake_data, key=lambda r: _sort_key(r, idx))
    if spec.key:
        pg_keys = [tuple(r[i] for i in idx) for r in pg_sorted]
        lake_keys = [tuple(r[i] for i in idx) for r in lake_sorted]
        missing = sorted(set(pg_keys) - set(lake_keys), key=repr)[:5]
        extra = sorted(set(lake_keys) - set(pg_keys), key=repr)[:5]
        assert len(set(lake_keys)) == len(lake_keys), f"{where}: duplicate keys in the lake"
        assert not missing and not extra, (
            f"{where}: {len(pg)} rows in PostgreSQL, {len(lake_data)} in the lake; "
            f"missing from the lake {missing}, not in PostgreSQL {extra}"
        )
    else:
        assert len(lake_sorted) == len(pg_sorted), (
            f"{where}: {len(pg_sorted)} rows in PostgreSQL, {len(lake_sorted)} in the lake"
        )
    for a, b in zip(pg_sorted, lake_sorted, strict=True):
        if a != b:
            diff = [n for n, x, y in zip(names, a, b, strict=True) if x != y]
            raise AssertionError(
                f"{where}: row differs in {diff}:\n  PostgreSQL {_short(a)}\n  lake       {_short(b)}"
            )


# --- the slot and the CLI -----------------------------------------------------------------


def confirmed_lsn(dsn: str, slot: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return None if row is None else row[0]


def lsn_int(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


# ``cli()`` runs the CLI in this test process (on the session's shared engine) unless a test
# needs a process of its own: a fault point kills the process it fires in. PG2DELTA_TEST_CLI=child
# runs every call as a child process instead.
_CLI_IN_PROCESS = os.environ.get("PG2DELTA_TEST_CLI", "in-process") != "child"
_CLI_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the CLI's own (cli.py)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, child: bool = False
) -> subprocess.CompletedProcess[str]:
    """``python -m pg2delta.cli ...``: the real CLI's ``main``, its exit code, standard output and
    standard error (log lines included), with the environment a child process would get. In a
    child process when ``child`` is set or a fault point is asked for (``env``), else in this
    process (a child costs an interpreter and an engine start: seconds, on Apache Spark a JVM)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PG2DELTA_", "PG"))}
    full_env.update(child_env())
    full_env.update(env or {})
    argv = [sys.executable, "-m", "pg2delta.cli", *args]
    if child or not _CLI_IN_PROCESS or "PG2DELTA_CRASH_AT" in full_env:
        done = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout)
        if done.returncode < 0:  # killed: its sessions (the slot's lock among them) end a moment later
            wait_for_sessions_to_end(_dsn_of(args))
        return done
    return subprocess.CompletedProcess(argv, *_cli_here(list(args), full_env))


def _dsn_of(args: Sequence[str]) -> str | None:
    """The DSN a CLI call names: ``--dsn``, else its config file's ``[source] dsn``."""
    import tomllib

    flags = dict(itertools.pairwise(args))
    if "--dsn" in flags:
        return flags["--dsn"]
    if "--config" in flags:
        return tomllib.loads(Path(flags["--config"]).read_text()).get("source", {}).get("dsn")
    return None


def wait_for_sessions_to_end(dsn: str | None, timeout: float = 30) -> None:
    """Wait until no pg2delta session is left in ``dsn``'s database: the server ends the session
    of a killed client when it reads the closed socket, which can take a moment on a busy machine,
    and until then the session holds the slot's lock (a rerun would exit 73)."""
    import time

    if dsn is None:
        return
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            left = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND application_name LIKE 'pg2delta%'"
            ).fetchone()
            if left is None or left[0] == 0:
                return
            time.sleep(0.05)


def _cli_here(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``pg2delta.cli.main(args)`` here under ``env``; (exit code, stdout, stderr)."""
    import contextlib
    import io
    import logging

    from pg2delta import cli as cli_module

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(_CLI_LOG_FORMAT))
    root = logging.getLogger()
    level, saved_env = root.level, dict(os.environ)
    root.addHandler(handler)  # before main(): its logging.basicConfig then adds nothing
    root.setLevel(logging.DEBUG if {"-v", "--verbose"} & set(args) else logging.INFO)
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_module.main(args)
            except SystemExit as exc:  # argparse
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        root.removeHandler(handler)
        root.setLevel(level)
    return code, out.getvalue(), err.getvalue()


def lake_files(lake: str | Path) -> dict[str, tuple[int, str]]:
    """Every file under the lake with its size and SHA-256: a fingerprint to prove a run wrote nothing."""
    root = Path(lake)
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in root.rglob("*")
        if p.is_file()
    }
