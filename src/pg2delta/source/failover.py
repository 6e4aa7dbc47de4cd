"""Failover slots (PostgreSQL 17 and later) on the server's side: the slot created as one or made
one, and what a physical standby holds of it.

A logical slot created with ``failover`` is copied to every physical standby that runs with
``sync_replication_slots = on`` (and ``hot_standby_feedback = on``, ``primary_slot_name`` naming a
physical slot on the primary, a ``primary_conninfo`` that names a database). The copy is
*sync-ready* once the primary's slot has moved past what the standby reserved when it first copied
it; until then it is ``temporary`` there, and a promotion drops it. After a promotion the copy is
the slot (``synced`` stays true), and runs against the promoted server go on from it.
pg2delta.failover decides what a run and ``pg2delta status`` make of all this.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq as libpq
from psycopg import sql

from pg2delta.errors import ConnectionFailed, SourceStateError
from pg2delta.lsn import format_lsn
from pg2delta.source.slot import SlotSource, _lsn_value, connect
from pg2delta.source.snapshot import FAILOVER_VERSION, refuse_failover, replication_connect

log = logging.getLogger(__name__)


def create_slot(src: SlotSource, *, failover: bool) -> None:
    """``run --create-slot``: create the slot, as a failover slot when ``failover`` (refused before 17)."""
    if failover:
        refuse_failover(src.server_version)
    # pg_create_logical_replication_slot(name, plugin, temporary, twophase, failover)
    query = "SELECT pg_create_logical_replication_slot(%s, 'pgoutput'" + (", false, false, true)" if failover else ")")
    try:
        src._query(query, (src.slot,))
    except psycopg.errors.DuplicateObject:
        return
    except psycopg.Error as exc:
        raise SourceStateError(f"cannot create slot {src.slot!r}: {' '.join(str(exc).split())}") from exc
    log.info("created %sreplication slot %s", "failover " if failover else "", src.slot)


def make_failover(dsn: str, slot: str, *, connect_timeout: int) -> None:
    """Make an existing slot a failover slot (``ALTER_REPLICATION_SLOT … (FAILOVER true)``, which
    only a replication connection runs; PostgreSQL 17 and later)."""
    conn = replication_connect(dsn, "pg2delta", connect_timeout)
    try:
        command = sql.SQL("ALTER_REPLICATION_SLOT {} (FAILOVER true)").format(sql.Identifier(slot))
        res = conn.pgconn.exec_(command.as_bytes(conn))
        if res.status != libpq.ExecStatus.COMMAND_OK:
            err = psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
            text = " ".join((err.diag.message_primary or str(err)).split())
            raise SourceStateError(f"cannot make slot {slot!r} a failover slot ([source] failover = true): {text}") from err
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"lost the replication connection altering slot {slot!r}: {exc}") from exc
    finally:
        conn.close()
    log.warning("slot %s is a failover slot now ([source] failover = true): standbys that synchronize slots copy it", slot)


_WAITED_FOR = """
SELECT btrim(n, ' "'), s.slot_type, s.active, s.restart_lsn::text, s.wal_status
FROM unnest(string_to_array(current_setting('synchronized_standby_slots', true), ',')) AS n
LEFT JOIN pg_replication_slots s ON s.slot_name = btrim(n, ' "')
WHERE btrim(n, ' "') <> ''
"""


def standbys_in_the_way(src: SlotSource, upper: int) -> list[str]:
    """The standbys a read of the (failover) slot up to ``upper`` would wait for without end: the
    primary gives out a failover slot's changes only once every physical slot of its
    ``synchronized_standby_slots`` has received their WAL, and waits for one that is gone, invalidated,
    or inactive (its standby down) and behind. An active standby that is behind is a short wait."""
    if src.server_version < FAILOVER_VERSION:
        return []
    stuck = []
    for name, kind, active, restart, wal_status in src._query(_WAITED_FOR):
        lsn = _lsn_value(restart)
        if kind is None:
            stuck.append(f"{name} (no such slot)")
        elif lsn is None or wal_status == "lost":
            stuck.append(f"{name} (invalidated)")
        elif not active and lsn < upper:
            stuck.append(f"{name} (inactive: its standby is down or disconnected, at {format_lsn(lsn)})")
    return stuck


def timeline_start(dsn: str, *, connect_timeout: int) -> int | None:
    """Where the server's current timeline began (its last promotion's switch point, from
    ``TIMELINE_HISTORY``); None on timeline 1, a server never promoted. WAL positions up to it are
    the former primary's, past it the promoted server's own."""
    conn = replication_connect(dsn, "pg2delta", connect_timeout)
    try:
        timeline = int(_replication_row(conn, "IDENTIFY_SYSTEM")["timeline"] or 1)
        if timeline == 1:
            return None
        content = _replication_row(conn, f"TIMELINE_HISTORY {timeline}")["content"] or ""
    finally:
        conn.close()
    # One line per earlier timeline: "parent TLI <tab> switch point <tab> reason"; the last is ours.
    lines = [line.split() for line in content.splitlines() if line.strip() and not line.startswith("#")]
    return _lsn_value(lines[-1][1]) if lines else None


def _replication_row(conn: psycopg.Connection[Any], command: str) -> dict[str, str | None]:
    """The one row a replication command answers, by column name."""
    try:
        res = conn.pgconn.exec_(command.encode())
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"lost the replication connection ({command}): {exc}") from exc
    if res.status != libpq.ExecStatus.TUPLES_OK or res.ntuples != 1:
        err = psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
        raise SourceStateError(f"{command} failed: {' '.join(str(err).split())}") from err
    return {
        bytes(res.fname(i) or b"").decode(): None if (v := res.get_value(0, i)) is None else bytes(v).decode()
        for i in range(res.nfields)
    }


@dataclass(frozen=True, slots=True)
class StandbyCopy:
    """What a physical standby holds of the slot, and its settings that keep the copy synchronized."""

    host: str
    port: int
    version_num: int
    in_recovery: bool
    replay_lsn: int | None
    sync_replication_slots: bool | None  # None: before 17
    hot_standby_feedback: bool
    primary_slot_name: str  # '' when unset
    conninfo_names_dbname: bool | None  # None: primary_conninfo not readable by this role
    present: bool  # the standby has a slot of that name
    sync_ready: bool = False  # the copy is persistent: a promotion keeps it (temporary until then)
    synced: bool | None = None
    failover: bool | None = None
    confirmed_flush_lsn: int | None = None
    invalidation_reason: str | None = None
    conflicting: bool | None = None


_STANDBY = """
SELECT current_setting('server_version_num')::int, pg_is_in_recovery(), pg_last_wal_replay_lsn()::text,
       current_setting('sync_replication_slots', true), current_setting('hot_standby_feedback'),
       current_setting('primary_slot_name', true),
       (SELECT setting FROM pg_settings WHERE name = 'primary_conninfo')
"""
_STANDBY_SLOT = """
SELECT NOT temporary, synced, failover, confirmed_flush_lsn::text, invalidation_reason, conflicting
FROM pg_replication_slots WHERE slot_name = %s
"""


def read_standby(dsn: str, slot: str, *, connect_timeout: int) -> StandbyCopy:
    """The standby at ``dsn`` and its copy of ``slot`` (raises ConnectionFailed when unreachable)."""
    with connect(dsn, application_name="pg2delta status", connect_timeout=connect_timeout) as conn:
        version, recovery, replay, sync, feedback, primary_slot, conninfo = _one(conn, _STANDBY, ())
        base: dict[str, Any] = {
            "host": conn.info.host, "port": conn.info.port, "version_num": int(str(version)),
            "in_recovery": bool(recovery), "replay_lsn": _lsn_value(replay),
            "sync_replication_slots": None if sync is None else sync == "on", "hot_standby_feedback": feedback == "on",
            "primary_slot_name": str(primary_slot or ""),
            "conninfo_names_dbname": None if conninfo is None else "dbname" in str(conninfo),
        }
        row = conn.execute(_STANDBY_SLOT, (slot,)).fetchone() if int(str(version)) >= FAILOVER_VERSION else None
    if row is None:
        return StandbyCopy(**base, present=False)
    ready, synced, failover, confirmed, reason, conflicting = row
    return StandbyCopy(
        **base, present=True, sync_ready=bool(ready), synced=bool(synced), failover=bool(failover),
        confirmed_flush_lsn=_lsn_value(confirmed), invalidation_reason=None if reason is None else str(reason),
        conflicting=None if conflicting is None else bool(conflicting),
    )


def synchronized_standby_slots(conn: psycopg.Connection[Any]) -> list[str] | None:
    """The primary's ``synchronized_standby_slots``: the physical slots whose standbys must have
    received WAL before a failover slot's changes are given out (None: before 17)."""
    if conn.info.server_version < FAILOVER_VERSION:
        return None
    (value,) = _one(conn, "SELECT current_setting('synchronized_standby_slots', true)", ())
    return [name.strip().strip('"') for name in str(value or "").split(",") if name.strip()]


def _one(conn: psycopg.Connection[Any], query: str, params: tuple[object, ...]) -> tuple[Any, ...]:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return tuple(row)
