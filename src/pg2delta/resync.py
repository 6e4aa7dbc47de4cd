"""``pg2delta resync --table s.t``: copy tables again, online, and let the slot's changes follow on.

For what the changes alone cannot bring into the lake: a column added with a volatile default or
as a stored generated column (PostgreSQL rewrites the table and sends no rows), a default whose
value PostgreSQL no longer keeps, rows of a partition attached to a published root, a table
removed from the publication and added back, a lake table damaged by hand. A table configured
``partitions = "root"`` is copied from all its published leaf partitions into its one Delta table
(a partition attached with rows, detached, dropped or truncated alone).

1. Takes the slot's advisory lock (a run holding it: exit 73; runs started meanwhile exit 73 and
   the next scheduled one carries on) and checks the slot; the slot does not move.
2. Copies the named tables at the exported snapshot of a TEMPORARY slot created now (consistent
   point L), chunked and in parallel exactly like the bootstrap (``bootstrap.copy_at_new_snapshot``:
   staged Parquet chunks, memory bounded by two chunks per worker).
3. Replaces each Delta table's rows in ONE commit (an overwrite: earlier versions stay readable by
   time travel) and records the copy in the applied log as applied through L.
4. The next ``run`` skips the slot's changes of those tables that committed before L (the copy
   holds them) and applies those after it, by the applied-LSN rule every window already follows.

L is at or after every window the applied log names (a window never ends past the server's WAL,
and the temporary slot starts at the WAL's current end), so no applied change of the table is
lost by the overwrite. Killed at any point, the old table stays intact and readable (the copy
becomes visible in one commit, and the applied log row follows it; a copy committed without its
row is simply done again), and running the same command again finishes it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pg2delta.apply.lakeside import Lakeside
from pg2delta.config import Config
from pg2delta.copy.copier import DEFAULT_PARALLEL, CopyInto, TableCopy, copy_at_new_snapshot
from pg2delta.errors import ConfigError, SourceStateError
from pg2delta.lake.foreign import forget
from pg2delta.metastore import register_written
from pg2delta.source.publication import copied_tables
from pg2delta.source.slot import SlotSource

log = logging.getLogger(__name__)


def resync(config: Config, tables: Sequence[str], *, parallel: int = DEFAULT_PARALLEL) -> list[TableCopy]:
    """Copy ``tables`` ("schema.table", published) again at a new snapshot; see the module docstring."""
    if not tables:
        raise ConfigError("pg2delta resync needs at least one --table schema.table")
    if parallel < 1:
        raise ConfigError("--parallel must be at least 1")
    for name in tables:
        _split(name)
    job = Lakeside(config)
    try:
        with SlotSource(
            config.source.dsn, config.source.slot, config.source.publication, connect_timeout=config.source.connect_timeout
        ) as src:
            src.lock()
            job.lake.own_staging(config.source.slot)
            src.check()
            if src.server_version < 150000:
                raise SourceStateError("pg2delta resync needs PostgreSQL 15 or newer (publication column lists and row filters)")
            job.lake.check_writable()
            published = {t.qualified: t for t in copied_tables(src.conn, config)}
            unknown = sorted(set(tables) - set(published))
            if unknown:
                raise ConfigError(
                    f"not in publication {config.source.publication!r}: {', '.join(unknown)} "
                    f"(published: {', '.join(sorted(published)) or 'none'})"
                )
            oids = {published[name].oid for name in tables}
            log.info("resyncing %s at a new snapshot; the slot stays at its place", ", ".join(sorted(tables)))
            copied = copy_at_new_snapshot(CopyInto(config, job.writer, job.history), src, oids, parallel=parallel)
            # Copied anew: what another writer did to them is gone (pg2delta.lake.foreign).
            forget(job.lake, config.source.slot, [(c.schema, c.table) for c in copied])
        register_written(config, job.lake, job.started_engine)  # [lake] database: a table that had no catalog entry gets one
        return copied
    finally:
        job.close()


def _split(name: str) -> tuple[str, str]:
    schema, sep, table = name.partition(".")
    if not sep or not schema or not table:
        raise ConfigError(f"--table {name!r}: give it as schema.table")
    return schema, table
