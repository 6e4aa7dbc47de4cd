"""A source pinned at one point in time: a TEMPORARY logical slot's consistent point ``L`` and a
connection that reads the snapshot it exported (``pg2delta verify`` compares the lake with it)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from pg2delta.config import SourceConfig
from pg2delta.source.slot import connect
from pg2delta.source.snapshot import ExportedSnapshot, open_snapshot

log = logging.getLogger(__name__)


@contextmanager
def pinned_source(cfg: SourceConfig, application_name: str) -> Iterator[tuple[int, psycopg.Connection[Any]]]:
    """A temporary slot's consistent point L, and a connection reading the snapshot it exported
    (with the job's DateStyle, IntervalStyle and shortest-exact floats)."""
    name = f"pg2delta_verify_{uuid.uuid4().hex[:12]}"
    with ExportedSnapshot(cfg.dsn, name, temporary=True, connect_timeout=cfg.connect_timeout) as exported:
        conn = connect(cfg.dsn, application_name=application_name, connect_timeout=cfg.connect_timeout)
        try:
            open_snapshot(conn, exported.snapshot)
            conn.execute("SET LOCAL DateStyle = 'ISO'")
            conn.execute("SET LOCAL IntervalStyle = 'postgres'")
            conn.execute("SET LOCAL extra_float_digits = 1")
            yield exported.snapshot.consistent_lsn, conn
        finally:
            conn.close()
            # Dropped with its connection anyway, but only once the server's walsender has exited:
            # drop it now, so nothing sees it after the caller returned.
            drop = sql.SQL("DROP_REPLICATION_SLOT {}").format(sql.Identifier(name)).as_bytes(exported.conn)
            res = exported.conn.pgconn.exec_(drop)
            if res.status != psycopg.pq.ExecStatus.COMMAND_OK:
                log.debug("could not drop the temporary slot %s: %s", name, res.error_message)


__all__ = ["pinned_source"]
