"""``pg2delta verify``: the lake against the source, exactly, at one point in time.

A live source cannot be compared with a lake that lags it, so both are pinned to one LSN ``L``:

1. a TEMPORARY logical slot is created with an exported snapshot (bootstrap's
   :class:`~pg2delta.source.snapshot.ExportedSnapshot`): ``L`` is its consistent point, and a connection
   imports the snapshot (``REPEATABLE READ``, ``SET TRANSACTION SNAPSHOT``) at once;
2. the real slot is applied up to ``L`` (:meth:`pg2delta.job.Job.run` with ``until_lsn=L``), and the
   applied log gives each table's Delta version holding the source's state at ``L``
   (:func:`pg2delta.versions.versions_at`), so a concurrent run cannot move what is compared;
3. per table, both sides compute the same aggregates in their own SQL: row counts, then per bucket
   of keys (the first ``d`` hex digits of the md5 of the key's canonical text) the row count and
   the sum of a 60-bit prefix of each row's md5. Buckets that differ are split one hex digit
   deeper until they are small, and only then are those buckets' keys and row hashes fetched and
   compared in Python. The driver holds aggregates of at most 16 ** :data:`MAX_DEPTH` buckets of
   the first level (and of the large differing buckets' sub-buckets after it) and the rows of small
   buckets, never a table.

Canonical text: each column becomes, on both sides, a text that is equal exactly when the values
are equal under the documented type mapping (:mod:`pg2delta.canonical`). A lake column type with no
shared form (none pg2delta writes today) is not compared; the table's report names it
(``columns_not_compared``). The row hash is md5 of a row's text; the key text is the same over the
key columns, and is what the report prints (decoded back to the key's canonical values).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from pg2delta.canonical import (
    ColumnType,
    comparable,
    decode_items,
    pg_item,
    pg_value,
    spark_item,
    spark_value,
)
from pg2delta.config import Config
from pg2delta.copy.governed import governed_source
from pg2delta.errors import ConfigError, LakeError, SchemaError
from pg2delta.job import Job
from pg2delta.lake.applied_log import LOG_TABLE
from pg2delta.lake.foreign import ForeignCommit, remembered, scan, with_known
from pg2delta.lsn import format_lsn
from pg2delta.progress import Progress
from pg2delta.source.pinned import pinned_source

if TYPE_CHECKING:
    from pg2delta.lake.engine import Engine
    from pg2delta.source.publication import PublishedTable

log = logging.getLogger(__name__)

MISSING = "missing_in_lake"  # the source has the key, the lake does not
EXTRA = "extra_in_lake"  # the lake has the key, the source does not
DIFFERENT = "different_values"  # both have the key with different values
KINDS = (MISSING, EXTRA, DIFFERENT)

BUCKET_ROWS = 2_000  # rows per bucket the first level aims at, and the most fetched per bucket
MAX_DEPTH = 4  # hex digits of the first level at most: 65,536 buckets held at once
FETCH_ROWS = 50_000  # rows fetched per query at the end
DEFAULT_MAX_DIFFERENCES = 1_000  # differing keys reported per table; then narrowing stops

# --- the report ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Difference:
    kind: str  # one of KINDS
    key: dict[str, str | None]  # the key's canonical values
    columns: tuple[str, ...] = ()  # DIFFERENT: the columns that differ
    source: dict[str, str | None] | None = None  # --show-values: canonical values, source side
    lake: dict[str, str | None] | None = None  # --show-values: canonical values, lake side


@dataclass
class TableResult:
    schema: str
    table: str
    delta_version: int | None = None
    source_rows: int = 0
    lake_rows: int = 0
    differences: list[Difference] = field(default_factory=list)
    truncated: bool = False  # more differences than were narrowed down (max_differences)
    skipped: str | None = None  # why the table was not compared (no key)
    columns_not_compared: list[str] = field(default_factory=list)
    buckets_compared: int = 0
    # Commits another writer made since pg2delta's last one (pg2delta.lake.foreign), newest first:
    # the table is compared as readers read it, its latest version, and is not equal while any remain.
    foreign_commits: list[ForeignCommit] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def equal(self) -> bool:
        if self.foreign_commits:
            return False
        return self.skipped is not None or (not self.differences and self.source_rows == self.lake_rows)


@dataclass
class VerifyReport:
    slot: str
    at_lsn: int
    tables: list[TableResult] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(t.equal for t in self.tables)


# --- the two sides ------------------------------------------------------------------------------


Buckets = dict[str, tuple[int, int]]  # hex prefix -> (rows, sum of 60-bit row-hash prefixes)
Rows = dict[str, list[tuple[str, str]]]  # key text -> [(row hash, row text)] (several: duplicate keys)


def _in_list(prefixes: Sequence[str]) -> str:
    return ", ".join(f"'{p}'" for p in prefixes)  # hex digits only: nothing to escape


class _Side:
    """Aggregates of one side's table over the key text ``k`` and row text ``t`` (subclasses: dialects)."""

    hash60 = ""  # SQL: the 60-bit integer prefix of the hex md5 ``r``

    def __init__(self, key_text: str, row_text: str) -> None:
        self.key_text = key_text
        self.row_text = row_text

    def query(self, statement: str, what: str) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def source(self, *, texts: bool) -> str:
        raise NotImplementedError

    def _base(self, texts: bool) -> str:
        extra = f", {self.key_text} AS k, {self.row_text} AS t" if texts else ""
        return f"SELECT md5({self.key_text}) AS h, md5({self.row_text}) AS r{extra} FROM {self.source(texts=texts)}"

    def count(self) -> int:
        [(n,)] = self.query(f"SELECT count(*) FROM {self.source(texts=False)}", "counting rows")
        return int(n)

    def buckets(self, depth: int, within: Sequence[str] | None, within_depth: int) -> Buckets:
        where = f" WHERE substr(q.h, 1, {within_depth}) IN ({_in_list(within)})" if within else ""
        rows = self.query(
            f"SELECT substr(q.h, 1, {depth}) AS b, count(*) AS n, sum({self.hash60}) AS s "
            f"FROM ({self._base(False)}) q{where} GROUP BY substr(q.h, 1, {depth})",
            f"hashing buckets of {depth} hex digits",
        )
        return {str(b): (int(n), int(s)) for b, n, s in rows}

    def rows(self, prefixes: Sequence[str], depth: int) -> Rows:
        out: Rows = {}
        for k, r, t in self.query(
            f"SELECT q.k, q.r, q.t FROM ({self._base(True)}) q WHERE substr(q.h, 1, {depth}) IN ({_in_list(prefixes)})",
            "fetching the rows of differing buckets",
        ):
            out.setdefault(str(k), []).append((str(r), str(t)))
        return out


class SourceSide(_Side):
    """The source table in the exported snapshot (PostgreSQL SQL); published rows and columns only."""

    hash60 = "('x' || substr(q.r, 1, 15))::bit(60)::bigint"

    def __init__(self, conn: psycopg.Connection[Any], table: PublishedTable, key: Sequence[ColumnType],
                 columns: Sequence[ColumnType]) -> None:
        def text(cols: Sequence[ColumnType]) -> str:
            parts = [pg_item(pg_value(sql.Identifier(c.name).as_string(conn), c)) for c in cols]
            return " || ".join(parts) if parts else "''"

        super().__init__(text(key), text(columns))
        self.conn = conn
        # The rows and columns a copy reads: a partitions = "root" table, its leaves' UNION ALL.
        self._from = table.select([sql.Identifier(c.name) for c in table.relation.columns]).as_string(conn)

    def source(self, *, texts: bool) -> str:
        return f"({self._from}) AS s"

    def query(self, statement: str, what: str) -> list[tuple[Any, ...]]:
        try:
            return list(self.conn.execute(statement.encode()).fetchall())
        except psycopg.Error as exc:
            raise SchemaError(f"{what} in the source failed: {' '.join(str(exc).split())[:500]}") from exc


class LakeSide(_Side):
    """The Delta table at one version (Spark SQL through the engine, a temporary view)."""

    hash60 = "CAST(conv(substr(q.r, 1, 15), 16, 10) AS DECIMAL(38,0))"

    def __init__(self, engine: Engine, view: str, key: Sequence[ColumnType], columns: Sequence[ColumnType]) -> None:
        from pg2delta.lake.sql import quote

        def text(cols: Sequence[ColumnType]) -> str:
            parts = [spark_item(spark_value(quote(c.name), c, engine.decimal_text)) for c in cols]
            return f"concat({', '.join(parts)})" if parts else "''"

        super().__init__(text(key), text(columns))
        self.engine = engine
        self.view = view

    def source(self, *, texts: bool) -> str:
        return self.view

    def query(self, statement: str, what: str) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self.engine.query(statement, f"{what} in the lake")]


# --- narrowing ---------------------------------------------------------------------------------


def first_depth(rows: int) -> int:
    """Hex digits of the first level: about :data:`BUCKET_ROWS` rows a bucket, at most 16**4 buckets."""
    if rows <= BUCKET_ROWS:
        return 1
    return max(1, min(MAX_DEPTH, math.ceil(math.log(rows / BUCKET_ROWS, 16))))


def _row_differences(src: Rows, lake: Rows, key: Sequence[str], columns: Sequence[str], show: bool) -> list[Difference]:
    """Keys whose rows differ between the two sides' rows of the same buckets."""
    out: list[Difference] = []
    for k in sorted(set(src) | set(lake)):
        mine, theirs = src.get(k, []), lake.get(k, [])
        key_values = dict(zip(key, decode_items(k), strict=True))
        if mine and theirs and mine[0][0] != theirs[0][0]:
            a, b = decode_items(mine[0][1]), decode_items(theirs[0][1])
            changed = tuple(c for c, x, y in zip(columns, a, b, strict=True) if x != y)
            values = (dict(zip(changed, (a[columns.index(c)] for c in changed), strict=True)),
                      dict(zip(changed, (b[columns.index(c)] for c in changed), strict=True))) if show else (None, None)
            out.append(Difference(DIFFERENT, key_values, changed, *values))
        for t in mine[len(theirs):]:  # in the source only (or more often there)
            out.append(Difference(MISSING, key_values, (), *((_named(columns, t[1]), None) if show else (None, None))))
        for t in theirs[len(mine):]:
            out.append(Difference(EXTRA, key_values, (), *((None, _named(columns, t[1])) if show else (None, None))))
    return out


def _named(columns: Sequence[str], text: str) -> dict[str, str | None]:
    return dict(zip(columns, decode_items(text), strict=True))


def _batches(prefixes: Sequence[str], sizes: dict[str, int]) -> Iterator[list[str]]:
    """Prefixes grouped so that one fetch brings at most about :data:`FETCH_ROWS` rows."""
    batch: list[str] = []
    rows = 0
    for p in prefixes:
        if batch and rows + sizes[p] > FETCH_ROWS:
            yield batch
            batch, rows = [], 0
        batch.append(p)
        rows += sizes[p]
    if batch:
        yield batch


def both(source: Callable[[], Any], lake: Callable[[], Any]) -> tuple[Any, Any]:
    """``source()`` in a worker thread while ``lake()`` runs here: PostgreSQL and the engine hash at
    the same time. The engine stays on this thread (a classic session's views belong to it)."""
    if isinstance(getattr(getattr(source, "func", source), "__self__", None), LakeSide):  # pg2delta.copy.governed's copy: here too
        return source(), lake()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pg2delta-verify") as pool:
        pending = pool.submit(source)
        try:
            theirs = lake()
        except BaseException:
            try:  # the source's query finishes before the connection is reused; the lake's error wins
                pending.result()
            except Exception:
                log.debug("the source's query failed too", exc_info=True)
            raise
        return pending.result(), theirs


def narrow(src: _Side, lake: _Side, result: TableResult, *, key: Sequence[str], columns: Sequence[str],
           show: bool, max_differences: int, progress: Progress | None = None) -> None:
    """Compare bucket aggregates level by level; fetch the rows of small differing buckets."""
    depth, within, within_depth = first_depth(max(result.source_rows, result.lake_rows)), None, 0
    while True:
        a, b = both(partial(src.buckets, depth, within, within_depth), partial(lake.buckets, depth, within, within_depth))
        result.buckets_compared += len(set(a) | set(b))
        if progress is not None and within is None:
            progress.move_to(result.source_rows, rows=result.source_rows)
        differing = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
        sizes = {p: max(a.get(p, (0, 0))[0], b.get(p, (0, 0))[0]) for p in differing}
        small = [p for p in differing if sizes[p] <= BUCKET_ROWS or depth >= 32]
        deeper = [p for p in differing if p not in set(small)]
        batches = list(_batches(small, sizes))
        for i, batch in enumerate(batches):
            mine, theirs = both(partial(src.rows, batch, depth), partial(lake.rows, batch, depth))
            found = _row_differences(mine, theirs, key, columns, show)
            result.differences.extend(found)
            if len(result.differences) >= max_differences:
                more = len(result.differences) > max_differences or i + 1 < len(batches) or bool(deeper)
                result.truncated = more
                del result.differences[max_differences:]
                return
        if not deeper:
            return
        log.info("verify: %s: %d bucket(s) of %d hex digit(s) differ and are large: one digit deeper",
                 result.name, len(deeper), depth)
        within, within_depth, depth = deeper, depth, depth + 1


# --- one table ------------------------------------------------------------------------------------

_BASE_TYPES = """
SELECT a.attname::text, CASE WHEN b.typcategory = 'A' THEN e.typname ELSE b.typname END::text
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
JOIN pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
LEFT JOIN pg_type e ON e.oid = b.typelem
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
"""

def _key_columns(conn: psycopg.Connection[Any], config: Config, table: PublishedTable, logged: str | None) -> list[str]:
    """The columns the lake merges the table on: the applied log's, else the job's key rule."""
    import json

    from pg2delta.source.keys import key_resolver

    if logged:
        return [str(c) for c in json.loads(logged)]
    rel = table.relation
    resolved = key_resolver(config, conn)(rel)
    if resolved is not None:
        return list(resolved)
    return [c.name for c in rel.columns if c.flags & 1]  # the replica identity the relation flags


@dataclass(frozen=True, slots=True)
class TableToVerify:
    schema: str
    table: str
    uri: str
    version: int  # the latest: what readers read
    logged_key: str | None  # the applied log's key_columns (JSON) for the table at that version
    foreign: tuple[ForeignCommit, ...] = ()  # commits pg2delta did not make since its last one


def _columns(
    conn: psycopg.Connection[Any], config: Config, table: PublishedTable, lake_types: dict[str, str], result: TableResult
) -> list[ColumnType]:
    """The columns both sides have (name order), noting the others in ``result``."""
    from pg2delta.decode.events import DELETED_COL, META_FIELDS

    meta = {f.name for f in META_FIELDS} | {DELETED_COL}  # pg2delta's columns (the row metadata too)
    base = {str(n): str(t) for n, t in conn.execute(_BASE_TYPES, (table.relation.oid,)).fetchall()}
    published = {c.name for c in table.relation.columns}
    excluded = set(config.table(table.relation.namespace, table.relation.name).exclude)
    out: list[ColumnType] = []
    for name in sorted(published | (set(lake_types) - meta)):
        delta = lake_types.get(name)
        if name not in published:
            result.columns_not_compared.append(f"{name} (in the lake only)")
        elif delta is None:
            result.columns_not_compared.append(f"{name} ({'excluded' if name in excluded else 'not in the lake'})")
        elif not comparable(delta):
            result.columns_not_compared.append(f"{name} ({delta}: no shared canonical form)")
        else:
            out.append(ColumnType(name, delta, base.get(name, "")))
    return out


def verify_table(
    engine: Engine, conn: psycopg.Connection[Any], config: Config, published: PublishedTable, t: TableToVerify,
    *, show: bool, max_differences: int,
) -> TableResult:
    """Compare one table of the lake at ``t.version`` with the source in ``conn``'s snapshot."""
    from pg2delta.decode.events import DELETED_COL, POS_COL
    result = TableResult(t.schema, t.table, t.version, foreign_commits=list(t.foreign))
    lake_types = engine.table_types(t.uri, version=t.version) or {}
    if POS_COL in lake_types:
        result.skipped = "no key (rows are appended, keyed by their commit position): not compared"
        return result
    columns = _columns(conn, config, published, lake_types, result)
    key_names = _key_columns(conn, config, published, t.logged_key)
    by_name = {c.name: c for c in columns}
    if not key_names or any(k not in by_name for k in key_names):
        raise SchemaError(f"table {result.name}: no key both sides can compare (key {key_names or 'none'})")
    key = [by_name[k] for k in key_names]
    with governed_source(engine, conn, config, published) as staged, engine.version_view(t.uri, t.version) as view:
        src = SourceSide(conn, published, key, columns) if staged is None else LakeSide(engine, staged, key, columns)
        live = f"(SELECT * FROM {view} WHERE NOT coalesce(`{DELETED_COL}`, false)) AS live" if DELETED_COL in lake_types else view
        lake = LakeSide(engine, live, key, columns)  # with soft deletes, the live rows
        result.source_rows, result.lake_rows = both(src.count, lake.count)
        with Progress(f"verify {result.name}", total=result.source_rows, unit="rows", logger=log,
                      line=lambda p: f"verify: {result.name}: {p.rows} rows hashed") as progress:
            narrow(src, lake, result, key=key_names, columns=[c.name for c in columns], show=show,
                   max_differences=max_differences, progress=progress)
    log.info("verify: %s at delta version %d: %d source rows, %d lake rows, %d difference(s)",
             result.name, t.version, result.source_rows, result.lake_rows, len(result.differences))
    return result


# --- the command ----------------------------------------------------------------------------------


def _tables_at(engine: Engine, config: Config, lsn: int, wanted: Sequence[str]) -> list[TableToVerify]:
    """Per table to verify, its Delta version holding the source's state at ``lsn`` (see versions.py)."""
    from pg2delta.source.slot import SlotSource
    from pg2delta.versions import EXACT, versions_at

    cfg = config.source
    with SlotSource(cfg.dsn, cfg.slot, cfg.publication, connect_timeout=cfg.connect_timeout) as src:
        info = src.slot_info()  # before the applied log (see versions.py)
    uri = engine.lake.table_uri(LOG_TABLE)
    if engine.lake.delta_version(uri) is None:
        raise LakeError(f"no applied log at {uri}: nothing was applied to this lake yet")
    rows = engine.read_table(uri)
    report = versions_at(rows, cfg.slot, lsn, lake_root=config.lake_root,
                         slot_confirmed=None if info is None else info.confirmed_flush_lsn)
    found = {t.name: t for t in report.tables}
    missing = [n for n in wanted if n not in found]
    if missing:
        raise ConfigError(f"not a table of the lake (slot {cfg.slot!r}): {', '.join(missing)}")
    known = remembered(engine.lake, cfg.slot)
    out: list[TableToVerify] = []
    for name in list(wanted) or sorted(found):
        t = found[name]
        if t.status != EXACT or t.delta_version is None:
            # A run between the pinning and verify's own run moved the slot past L: a new pin works.
            raise LakeError(f"{name}: no Delta version holds the source's state at {format_lsn(lsn)} "
                            f"({t.status}: {t.message}); run pg2delta verify again", retryable=True)
        logged = [r for r in rows if r.get("slot") == cfg.slot and r.get("schema_name") == t.schema
                  and r.get("table_name") == t.table and r.get("key_columns") and int(r["window_end"]) <= lsn]
        key = max(logged, key=lambda r: int(r["window_end"]))["key_columns"] if logged else None
        # Readers read the latest version: verify holds the slot's lock, so no run commits meanwhile.
        uri = engine.lake.table_uri(t.schema, t.table)
        latest = engine.lake.delta_version(uri)
        commits, own = scan(engine.lake, uri, t.delta_version, latest=latest)
        if own is not None:  # a run between verify's and its lock
            raise LakeError(f"{name}: a run committed past {format_lsn(lsn)} meanwhile; run pg2delta verify again",
                            retryable=True)
        out.append(TableToVerify(t.schema, t.table, uri, t.delta_version if latest is None else latest, key,
                                 with_known(commits, known.get((t.schema, t.table)))))
    return out


def verify(
    config: Config, tables: Sequence[str] = (), *, show_values: bool = False,
    max_differences: int = DEFAULT_MAX_DIFFERENCES, job_factory: Callable[[Config], Any] | None = None,
) -> VerifyReport:
    """``pg2delta verify``: apply the slot up to a fresh snapshot's LSN, then compare every table there."""
    from pg2delta.config import validate
    from pg2delta.source.publication import copied_tables
    from pg2delta.source.slot import SlotSource
    validate(config)
    bad = [n for n in tables if n.count(".") != 1 or not all(n.split("."))]
    if bad:
        raise ConfigError(f"--table takes schema.table: {', '.join(bad)}")
    with pinned_source(config.source, "pg2delta verify") as (lsn, conn):
        log.info("verify: source pinned at %s", format_lsn(lsn))
        job = (job_factory or Job)(config)
        job.on_foreign = "remember"  # its run writes over a damaged table, which stays damaged until a resync
        try:
            job.run(until_lsn=lsn)
            cfg = config.source
            with SlotSource(cfg.dsn, cfg.slot, cfg.publication, connect_timeout=cfg.connect_timeout) as held:
                held.lock()  # no run commits while the latest versions are compared
                engine = job.engine
                todo = _tables_at(engine, config, lsn, tables)
                # As a copy makes them: a partitions = "root" table is the root, read from its leaves.
                published = {t.qualified: t for t in copied_tables(conn, config)}
                report = VerifyReport(config.source.slot, lsn)
                for t in todo:
                    pub = published.get(f"{t.schema}.{t.table}")
                    if pub is None:
                        result = TableResult(t.schema, t.table, t.version, skipped="not in the publication")
                    else:
                        result = verify_table(engine, conn, config, pub.usable(), t, show=show_values,
                                              max_differences=max_differences)
                    if result.skipped and tables:  # asked for by name: say why it cannot be compared
                        raise SchemaError(f"cannot verify {result.name}: {result.skipped}")
                    report.tables.append(result)
            return report
        finally:
            job.close()


def to_json(report: VerifyReport) -> dict[str, Any]:
    """The ``--json`` form (``schema_version`` 1; see docs/commands/verify.md)."""
    def diff(d: Difference) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": d.kind, "key": d.key}
        if d.kind == DIFFERENT:
            out["columns"] = list(d.columns)
        if d.source is not None or d.lake is not None:
            out["source"], out["lake"] = d.source, d.lake
        return out

    return {
        "schema_version": 1,
        "slot": report.slot,
        "at_lsn": format_lsn(report.at_lsn),
        "equal": report.equal,
        "tables": {
            t.name: {
                "equal": t.equal, "delta_version": t.delta_version, "source_rows": t.source_rows,
                "lake_rows": t.lake_rows, "skipped": t.skipped, "truncated": t.truncated,
                "columns_not_compared": t.columns_not_compared, "buckets_compared": t.buckets_compared,
                "foreign_commits": [c.to_json() for c in t.foreign_commits],
                "differences": [diff(d) for d in t.differences],
            }
            for t in report.tables
        },
    }
