"""Exported snapshots: a slot created with ``(SNAPSHOT 'export')`` and connections that read as of it.

A copy reads every table as of the slot's consistent point (bootstrap, a table added later, a
resync, verify's read of the source): :class:`ExportedSnapshot` holds the replication connection
that exported it, :func:`open_snapshot` makes another connection read as of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq as libpq
from psycopg import sql

from pg2delta.errors import (
    ConfigError,
    ConnectionFailed,
    SourceStateError,
)

log = logging.getLogger(__name__)


# --- snapshots ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    slot: str
    consistent_lsn: int
    name: str  # for SET TRANSACTION SNAPSHOT


class ExportedSnapshot:
    """A replication connection that created a slot and exported its snapshot; keep it idle while copying."""

    def __init__(
        self, dsn: str, slot: str, *, temporary: bool, connect_timeout: int = 10, failover: bool = False
    ) -> None:
        self.conn = replication_connect(dsn, "pg2delta bootstrap", connect_timeout)
        if failover and (version := self.conn.info.server_version) < FAILOVER_VERSION:
            self.close()
            refuse_failover(version)
        # (FAILOVER: PostgreSQL 17 and later; a temporary slot cannot be one)
        command = sql.SQL("CREATE_REPLICATION_SLOT {} {} LOGICAL pgoutput (SNAPSHOT 'export'{})").format(
            sql.Identifier(slot), sql.SQL("TEMPORARY") if temporary else sql.SQL(""),
            sql.SQL(", FAILOVER true") if failover and not temporary else sql.SQL(""),
        )
        try:
            res = self.conn.pgconn.exec_(command.as_bytes(self.conn))
        except psycopg.OperationalError as exc:
            self.close()
            raise ConnectionFailed(f"lost the replication connection creating slot {slot!r}: {exc}") from exc
        if res.status != libpq.ExecStatus.TUPLES_OK:
            err = psycopg.errors.error_from_result(res, encoding=self.conn.info.encoding)
            self.close()
            text = " ".join((err.diag.message_primary or str(err)).split())
            if isinstance(err, psycopg.errors.DuplicateObject):
                raise SourceStateError(
                    f"replication slot {slot!r} was created by someone else meanwhile: {text}"
                ) from err
            raise SourceStateError(f"cannot create replication slot {slot!r}: {text}") from err
        values = [res.get_value(0, i) for i in range(res.nfields)]
        names = [bytes(res.fname(i) or b"").decode() for i in range(res.nfields)]
        row = {n: bytes(v).decode() if v is not None else None for n, v in zip(names, values, strict=True)}
        lsn, snap = row.get("consistent_point"), row.get("snapshot_name")
        if not lsn or not snap:
            self.close()
            raise SourceStateError(f"the server did not export a snapshot for slot {slot!r}")
        hi, lo = lsn.split("/")
        self.snapshot = Snapshot(slot, (int(hi, 16) << 32) | int(lo, 16), snap)
        log.info(
            "created %sslot %s at %s, exported snapshot %s",
            "temporary " if temporary else "failover " if failover else "", slot, lsn, snap,
        )

    def close(self) -> None:
        try:
            self.conn.close()
        except psycopg.Error:
            log.debug("could not close the replication connection")

    def __enter__(self) -> ExportedSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def replication_connect(dsn: str, application_name: str, connect_timeout: int) -> psycopg.Connection[Any]:
    """A replication connection (``replication=database``, autocommit), for the commands only it
    runs (``CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')``, ``ALTER_REPLICATION_SLOT``)."""
    try:
        return psycopg.connect(
            dsn, autocommit=True, replication="database", application_name=application_name,
            connect_timeout=connect_timeout,
        )
    except psycopg.OperationalError as exc:
        text = " ".join(str(exc).split())
        if "replication" in text or "password" in text or "does not exist" in text:
            raise ConnectionFailed(
                f"cannot open a replication connection (the role needs REPLICATION and pg_hba.conf a "
                f"replication entry for this database): {text}",
                retryable=False,
            ) from exc
        raise ConnectionFailed(f"cannot open a replication connection: {text}") from exc


# PostgreSQL 17: failover slots, synchronized to physical standbys (pg2delta.source.failover).
FAILOVER_VERSION = 170000


def refuse_failover(server_version: int) -> None:
    """``[source] failover = true`` on a server older than 17: one line, exit 78."""
    if server_version < FAILOVER_VERSION:
        raise ConfigError(
            f"[source] failover = true needs PostgreSQL 17 or newer (failover slots); this server runs "
            f"PostgreSQL {server_version // 10000}: set failover = false, or upgrade the server"
        )


def open_snapshot(conn: psycopg.Connection[Any], snapshot: Snapshot) -> None:
    """Make ``conn`` (autocommit) read as of ``snapshot``, in a read-only REPEATABLE READ transaction."""
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot.name)))
        # Text forms of types without a decoder, as the change path has them.
        conn.execute("SET LOCAL TimeZone = 'UTC'")
    except (psycopg.errors.InvalidParameterValue, psycopg.errors.UndefinedObject) as exc:
        raise SourceStateError(
            f"the snapshot exported by slot {snapshot.slot!r} can no longer be imported "
            f"({' '.join(str(exc).split())}): its replication connection closed; run pg2delta bootstrap "
            "again, it copies the tables still missing at a new snapshot"
        ) from exc
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"lost a copy connection: {' '.join(str(exc).split())}") from exc
