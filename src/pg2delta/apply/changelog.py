"""The changelog: every decoded change of a table, appended to a Delta table of its own.

Enabled per table (``[tables."s.t"] changelog = true``) or for all tables (``[lake] changelog =
true``). The changelog of ``schema.table`` lives at ``<lake>/_pg2delta/changelog/<schema>/<table>``,
one row per change, in the window that read it, before the table's own MERGE:

* ``_pg2delta_lsn`` commit LSN of the transaction, ``_pg2delta_pos`` position inside it (the two
  order the changelog), ``_pg2delta_op`` ``I``, ``U``, ``D`` or ``T`` (truncate),
  ``_pg2delta_xid``, ``_pg2delta_commit_ts`` (UTC), ``_pg2delta_toast`` (columns sent as unchanged
  TOAST: null in the row, the value did not change);
* the table's columns: the new row for ``I`` and ``U``; for ``D`` the old values PostgreSQL sent
  (the key, or the whole old row under ``REPLICA IDENTITY FULL``); all null for ``T``. An update
  that changes the key is two rows, a ``D`` of the old key then the ``U``, at consecutive positions.

Idempotent without a second log: a window's rows of one table land in one Delta commit, windows
are applied in commit order, and a transaction never spans two windows. So the changelog holds
exactly the transactions up to its largest ``_pg2delta_lsn``, and a replayed window (the slot
did not advance after a crash) appends only rows past it. This holds whatever crashed: between
the changelog commit and the table's MERGE, or after both.

Every window also appends one row per changelog table it touched to
``<lake>/_pg2delta/changelog_log`` (window, changelog Delta version, rows, key columns), before the
applied log's rows: ``pg2delta backfill`` checks with it that the changelog holds every window the
applied log says changed the table, and replays each window with the columns its MERGE set (a
column the source dropped keeps its last value in the table, as in the run).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.config import Config
from pg2delta.decode.changes import (
    LSN_COL,
    META_FIELDS,
    META_NAMES,
    OP_COL,
    POS_COL,
    TS_COL,
    XID_COL,
    BatchLike,
    RelationVersion,
    TruncateEvent,
)
from pg2delta.lake.applied_log import WINDOW_TABLE_FIELDS
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.types import arrow_type, spark_type, widens
from pg2delta.lsn import format_lsn

log = logging.getLogger(__name__)

CHANGELOG_ROOT = "_pg2delta/changelog"
CHANGELOG_LOG = "_pg2delta/changelog_log"
TRUNCATE_OP = "T"

CHANGELOG_LOG_SCHEMA = pa.schema(
    [
        *WINDOW_TABLE_FIELDS,
        ("changelog_version", pa.int64()),
        ("rows", pa.int64()),
        ("key_names", pa.list_(pa.string())),
        ("columns", pa.list_(pa.string())),  # the table's columns the window's MERGE set, in order
        ("applied_at", pa.timestamp("us", tz="UTC")),
    ]
)


def changelog_path(schema: str, table: str) -> str:
    """Where the changelog of ``schema.table`` lives, relative to the lake root."""
    return f"{CHANGELOG_ROOT}/{schema}/{table}"


def window_rows(batches: Sequence[pa.RecordBatch], truncates: Sequence[TruncateEvent]) -> pa.Table | None:
    """One window's changes of one table as changelog rows, in commit order (None: none)."""
    parts = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    seen: set[tuple[int, int]] = set()
    trunc_rows = []
    for t in truncates:
        if (t.commit_lsn, t.pos) in seen:
            continue
        seen.add((t.commit_lsn, t.pos))
        trunc_rows.append({LSN_COL: t.commit_lsn, POS_COL: t.pos, OP_COL: TRUNCATE_OP, XID_COL: t.xid, TS_COL: t.commit_ts})
    if trunc_rows:
        meta = pa.schema(list(META_FIELDS))
        ts = pa.array([r[TS_COL] for r in trunc_rows], type=pa.int64()).cast(meta.field(TS_COL).type)
        columns = {f.name: pa.array([r.get(f.name) for r in trunc_rows], type=f.type) for f in META_FIELDS if f.name != TS_COL}
        columns[TS_COL] = ts
        parts.append(pa.table({f.name: columns[f.name] for f in META_FIELDS}))
    if not parts:
        return None
    table = pa.concat_tables(parts, promote_options="permissive")
    # Every field nullable: pysail 0.7.2 silently drops new columns from a mergeSchema append
    # when a field of the appended data is declared NOT NULL.
    table = table.cast(pa.schema([f.with_nullable(True) for f in table.schema]))
    return table.sort_by([(LSN_COL, "ascending"), (POS_COL, "ascending")])


@dataclass
class ChangelogWriter:
    """Appends each window's changes of the changelog tables, and logs what it appended."""

    config: Config
    lake: Lake
    _last_lsn: dict[tuple[str, str], int | None] = field(default_factory=dict)
    _types: dict[str, dict[str, str] | None] = field(default_factory=dict)  # changelog column types by uri

    def enabled(self, version: RelationVersion) -> bool:
        return self.config.changelog_of(*version.qualified_name)

    def append(
        self,
        engine: Engine,
        run_id: str,
        window_start: int,
        window_end: int,
        tables: Sequence[tuple[RelationVersion, Sequence[BatchLike], Sequence[TruncateEvent]]],
    ) -> list[dict[str, Any]]:
        """Append the window's rows past each changelog's end; returns the changelog log rows to write."""
        logged: list[dict[str, Any]] = []
        now = int(time.time() * 1_000_000)
        for version, batches, truncates in tables:
            if not self.enabled(version):
                continue
            schema, name = version.qualified_name
            uri = self.lake.table_uri(changelog_path(schema, name))
            if (schema, name) not in self._last_lsn:
                self._last_lsn[(schema, name)] = engine.max_of(uri, LSN_COL)
            last = self._last_lsn[(schema, name)]
            if any(b.spilled for b in batches):
                appended, columns = self._append_spilled(engine, run_id, uri, version, batches, truncates, last)
                rows = None
            else:
                rows = window_rows([b.load() for b in batches], truncates)
                columns = [c for c in rows.column_names if c not in META_NAMES] if rows is not None and batches else list(version.column_names)
                if rows is not None and last is not None:
                    rows = rows.filter(pc.greater(rows.column(LSN_COL), last))
                appended = 0
            if rows is not None and rows.num_rows:
                rows = self._conform(engine, uri, rows)
                engine.append(uri, rows, fill_missing=True)
                known = self._types.get(uri) or {}
                self._types[uri] = {**{f.name: spark_type(f.type) for f in rows.schema}, **known}
                appended = rows.num_rows
                self._last_lsn[(schema, name)] = int(pc.max(rows.column(LSN_COL)).as_py())
                log.info("changelog %s.%s: %d rows appended", schema, name, appended)
            logged.append(
                {
                    "run_id": run_id,
                    "slot": self.config.source.slot,
                    "window_start": window_start,
                    "window_end": window_end,
                    "window_end_lsn": format_lsn(window_end),
                    "relation_oid": version.oid,
                    "schema_name": schema,
                    "table_name": name,
                    "changelog_version": self.lake.delta_version(uri),
                    "rows": appended,
                    "key_names": list(version.key_names),
                    "columns": columns,
                    "applied_at": now,
                }
            )
        return logged

    def _append_spilled(
        self,
        engine: Engine,
        run_id: str,
        uri: str,
        version: RelationVersion,
        batches: Sequence[BatchLike],
        truncates: Sequence[TruncateEvent],
        last: int | None,
    ) -> tuple[int, list[str]]:
        """The changelog rows of a spilled window (pg2delta.window.spill): staged batch by batch, appended in
        one commit. Returns the rows appended and the columns of the changes."""
        schema, name = version.qualified_name
        staged = f"{run_id}/changelog-{uuid.uuid4().hex[:8]}"
        columns: list[str] = []
        parts = [*([b] for b in batches), []]  # the truncates go in a part of their own
        appended, newest = 0, None
        try:
            for n, part in enumerate(parts):
                rows = window_rows([b.load() for b in part], [] if part else truncates)
                if rows is None:
                    continue
                for c in rows.column_names:
                    if c not in META_NAMES and c not in columns:
                        columns.append(c)
                if last is not None:
                    rows = rows.filter(pc.greater(rows.column(LSN_COL), last))
                if not rows.num_rows:
                    continue
                rows = self._conform(engine, uri, rows)
                self.lake.stage(rows, f"{staged}/part-{n:06d}")
                known = self._types.get(uri) or {}
                self._types[uri] = {**{f.name: spark_type(f.type) for f in rows.schema}, **known}
                appended += rows.num_rows
                high = int(pc.max(rows.column(LSN_COL)).as_py())
                newest = high if newest is None else max(newest, high)
            if appended:
                engine.append_staged(uri, self.lake.staging_uri(staged), fill_missing=True)
                self._last_lsn[(schema, name)] = newest
                log.info("changelog %s.%s: %d rows appended", schema, name, appended)
        finally:
            self.lake.unstage_dir(staged)
        return appended, columns or list(version.column_names)

    def _conform(self, engine: Engine, uri: str, rows: pa.Table) -> pa.Table:
        """Follow a widened column: rewrite the changelog once with the wider type (as the table's
        own rewrite does; a ``mergeSchema`` append cannot widen a column), and cast rows narrower
        than a column the changelog already holds wider (``narrowing = "keep"``)."""
        if uri not in self._types:
            self._types[uri] = engine.table_types(uri)
        current = self._types[uri]
        if current is None:
            return rows
        casts: dict[str, str] = {}
        for i, f in enumerate(rows.schema):
            have, new = current.get(f.name), spark_type(f.type)
            if have is None or have == new:
                continue
            if widens(have, new):
                casts[f.name] = new
            elif widens(new, have) and (wider := arrow_type(have)) is not None:
                rows = rows.set_column(i, f.with_type(wider), rows.column(i).cast(wider))
        if casts:
            engine.rewrite(uri, casts)
            self._types.pop(uri, None)
        return rows

    def log(self, engine: Engine, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        table = pa.Table.from_pylist(
            [{**r, "applied_at": None} for r in rows], schema=CHANGELOG_LOG_SCHEMA
        ).set_column(
            CHANGELOG_LOG_SCHEMA.get_field_index("applied_at"),
            "applied_at",
            pa.array([r["applied_at"] for r in rows], type=pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        )
        # As the applied log's rows: by delta-rs on the embedded engine (pysail's commits slow down
        # as a year of windows fills the log's checkpoint with tombstones).
        engine.append_log_rows(self.lake.table_uri(CHANGELOG_LOG), table)
