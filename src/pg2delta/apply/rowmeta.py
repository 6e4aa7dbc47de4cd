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

from pg2delta.config import Config
from pg2delta.decode.events import DELETED_COL, LSN_COL, OP_COL, TS_COL
from pg2delta.errors import SchemaError

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


__all__ = ["ROW_META", "check_row_columns", "metadata", "row_columns", "soft_deletes"]
