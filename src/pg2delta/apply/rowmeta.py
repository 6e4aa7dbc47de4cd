"""Row metadata and soft deletes: which of pg2delta's row columns a Delta table carries, and the
refusal of a table landed with other settings.

``[tables."s.t"] metadata = true`` (or ``[lake] metadata``) keeps in every row ``_pg2delta_lsn``,
``_pg2delta_commit_ts`` and ``_pg2delta_op`` of its last change; ``deletes = "soft"`` (which implies
them) keeps deleted rows with ``_pg2delta_deleted = true``. The values come with the changes
(pg2delta.decode.events' meta columns) and the copies (pg2delta.source.copy); the MERGE sets them
(pg2delta.apply.merge). A Delta table landed without them (or with them) is refused once the
settings change: its rows would hold no value, or stale ones (docs: Row metadata and soft deletes).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pg2delta.config import Config
from pg2delta.decode.events import DELETED_COL, LSN_COL, OP_COL, TS_COL
from pg2delta.errors import SchemaError
from pg2delta.lake.sql import key_equal, quote

ROW_META = (LSN_COL, TS_COL, OP_COL)


def soft_deletes(config: Config, schema: str, name: str) -> bool:
    """Whether deleted rows of ``schema.name`` stay in its Delta table, marked (``deletes = "soft"``)."""
    own = config.table(schema, name).rows.deletes
    return (config.rows.deletes if own is None else own) == "soft"


def metadata(config: Config, schema: str, name: str) -> bool:
    """Whether the rows of ``schema.name`` carry the row metadata (``metadata = true``, or soft deletes)."""
    own = config.table(schema, name).rows.metadata
    return bool(config.rows.metadata if own is None else own) or soft_deletes(config, schema, name)


def row_columns(config: Config, schema: str, name: str) -> tuple[str, ...]:
    """The row columns the Delta table of ``schema.name`` carries besides its own: none, the row
    metadata, or the row metadata and ``_pg2delta_deleted``."""
    if not metadata(config, schema, name):
        return ()
    return (*ROW_META, DELETED_COL) if soft_deletes(config, schema, name) else ROW_META


def check_row_columns(config: Config, schema: str, name: str, lake_columns: Collection[str] | None, *, source_name: str) -> None:
    """Refuse (exit 78, or a resync with ``on_unfollowable = "resync"``) a window into a Delta table
    (``lake_columns``; None: no table yet) landed with other ``metadata`` / ``deletes`` settings."""
    if lake_columns is None:
        return
    have = set(lake_columns)  # a keyless table's _pg2delta_lsn is its key: TS_COL tells the metadata
    wanted = row_columns(config, schema, name)
    problems = []
    if (TS_COL in have) != (TS_COL in wanted):
        problems.append(f"metadata = {str(TS_COL in wanted).lower()} now, the table was landed with "
                        f"metadata = {str(TS_COL in have).lower()}")
    if (DELETED_COL in have) != (DELETED_COL in wanted):
        problems.append(f"deletes = \"{'soft' if DELETED_COL in wanted else 'hard'}\" now, the table was landed "
                        f"with deletes = \"{'soft' if DELETED_COL in have else 'hard'}\"")
    if not problems:
        return
    raise SchemaError(
        f"{schema}.{name}: {'; '.join(problems)}: turning row metadata or soft deletes on or off rewrites the "
        f"table once: copy it again with pg2delta resync --table {source_name} (or set on_unfollowable = "
        "\"resync\"); nothing of this window was applied"
    )


@dataclass(frozen=True, slots=True)
class KeptRows:
    """What a soft-delete table keeps of its rows when a copy at a snapshot replaces it (``pg2delta
    resync``, ``on_unfollowable = "resync"``, a table copied again): the copy holds PostgreSQL's
    rows, the rows the table had marked deleted stay as they are, and its live rows the copy lacks
    (deleted in PostgreSQL while the slot's changes of the table were not applied) stay marked
    deleted at the snapshot: its LSN ``lsn`` and time ``ts`` (microseconds since 1970), op ``D``.
    A key the copy holds is the copy's row, live. ``key_names``: the copy's key (none: a keyless
    table, whose rows cannot be told apart from the copy's; its rows marked deleted by truncates
    stay, its live ones are the copy's; likewise a table that lacks a column of the copy's key).
    ``nullable_keys``: a key set in the config (NULL equals NULL)."""

    key_names: tuple[str, ...]
    lsn: int
    ts: int
    nullable_keys: bool = False

    def sql(self, table: str, copy: str, table_columns: Collection[str]) -> str:
        """Spark SQL of the rows the Delta table (view ``table``, its columns ``table_columns``) keeps
        beside the copy (view ``copy``), in the table's columns (the engine conforms them to the copy's)."""
        have = set(table_columns)
        deleted = f"t.{quote(DELETED_COL)}" if DELETED_COL in have else "false"
        made = {
            DELETED_COL: "true",
            TS_COL: self._mark(deleted, TS_COL, f"timestamp_micros(CAST({int(self.ts)} AS BIGINT))", have),
            OP_COL: self._mark(deleted, OP_COL, "'D'", have),
        }
        keyed = bool(self.key_names) and set(self.key_names) <= have
        if self.key_names:  # a keyless table's _pg2delta_lsn is its key
            made[LSN_COL] = self._mark(deleted, LSN_COL, f"CAST({int(self.lsn)} AS BIGINT)", have)
        cols = ", ".join(f"{made.get(c, f't.{quote(c)}')} AS {quote(c)}" for c in dict.fromkeys([*table_columns, *made]))
        if not keyed:
            return f"SELECT {cols} FROM {table} AS t WHERE {deleted}"
        keys = ", ".join(quote(k) for k in self.key_names)
        on = " AND ".join(key_equal(f"t.{quote(k)}", f"c.{quote(k)}", nullable=self.nullable_keys) for k in self.key_names)
        return (
            f"SELECT {cols} FROM {table} AS t LEFT JOIN (SELECT DISTINCT {keys}, true AS {_IN_COPY} FROM {copy}) AS c "
            f"ON {on} WHERE c.{_IN_COPY} IS NULL"
        )

    @staticmethod
    def _mark(deleted: str, column: str, value: str, have: Collection[str]) -> str:
        """A kept row's ``column``: its own if it was marked deleted, else the snapshot's ``value``."""
        return f"CASE WHEN {deleted} THEN t.{quote(column)} ELSE {value} END" if column in have else value


_IN_COPY = "__pg2delta_in_copy"


__all__ = ["ROW_META", "KeptRows", "check_row_columns", "metadata", "row_columns", "soft_deletes"]
