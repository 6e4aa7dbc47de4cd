"""A primary failover, as a run and ``pg2delta status`` see it (Operations > Faults: a primary failover).

The slot lives on the primary. With ``[source] failover = true`` it is a failover slot
(PostgreSQL 17 and later), which a physical standby that synchronizes slots keeps a copy of
(pg2delta.source.failover); after the standby's promotion, the job's DSN pointed at it, runs go on
from the copy. The copy follows the primary's slot with a delay, so it can start behind what the
lake holds: the run reads those windows again and the applied log skips, table by table, what is
applied already (the same path as a rerun after a crash between a window's log row and the slot's
advance), and says so. Nothing is skipped by position. A lake past the promotion's switch point (the
primary did not wait for the standby) holds changes the server never had: the run stops (78).

Without a copy (not a failover slot, not yet sync-ready, a standby that does not synchronize), the
promoted server has no slot: a run stops with exit 78 and says so, whatever ``create_slot`` says. A
slot created now would start at the server's current position, and the changes between the lake
and it would be missing for good; only a new bootstrap gives the lake the source's state again.

``status`` reports whether the slot is a failover slot and, given the standby (``[source]
standby_dsn``, ``--standby-dsn``), whether a promotion now would keep it: problem ``failover``,
exit 14, naming each reason.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from pg2delta.config import Config
from pg2delta.errors import EXIT_STATUS_FAILOVER, ConnectionFailed, SourceStateError
from pg2delta.lake.applied_log import log_rows
from pg2delta.lake.engine import Lake
from pg2delta.lsn import format_lsn
from pg2delta.source.failover import (
    StandbyCopy,
    create_slot,
    make_failover,
    read_standby,
    standbys_in_the_way,
    synchronized_standby_slots,
    timeline_start,
)
from pg2delta.source.slot import SlotInfo, SlotSource, connect
from pg2delta.source.snapshot import FAILOVER_VERSION, refuse_failover
from pg2delta.versions import applied_through

log = logging.getLogger(__name__)

FAULTS_PAGE = "docs: operations/faults, A primary failover"


def run_bounds(src: SlotSource, config: Config, lake: Lake, until_lsn: int | None, *, create: bool) -> tuple[int, int]:
    """A run's :meth:`SlotSource.locked_bounds`: the slot's lock taken, the slot created when it is
    missing and may be (a failover slot with ``[source] failover``), an existing one made a failover
    slot when the config asks, the slot checked; where the run starts and stops."""
    cfg = config.source
    src.lock()
    if cfg.failover:
        refuse_failover(src.server_version)
    info = src.slot_info()
    if info is None:
        lost(lake, config)
        if create:
            create_slot(src, failover=cfg.failover)
    elif cfg.failover and info.failover is False:
        make_failover(cfg.dsn, cfg.slot, connect_timeout=cfg.connect_timeout)
    info = src.check()
    if info.synced and info.confirmed_flush_lsn is not None:
        behind_the_lake(config, info.confirmed_flush_lsn, applied_through(log_rows(lake), cfg.slot))
    start, upper = src.bounds(info, until_lsn)
    not_held(src, info, start, upper)
    return start, upper


def not_held(src: SlotSource, info: SlotInfo, start: int, upper: int) -> None:
    """Stop (75) before a read of a failover slot the primary would hold for good: a standby of its
    ``synchronized_standby_slots`` down (or gone, or invalidated) and behind ``upper``."""
    if info.failover and start < upper and (stuck := standbys_in_the_way(src, upper)):
        raise SourceStateError(
            f"the primary gives out failover slot {info.name!r}'s changes only once the standbys of "
            f"synchronized_standby_slots have received them, and would wait for {', '.join(stuck)}: this run "
            "read nothing (retry once the standby is back, or take it out of synchronized_standby_slots and "
            f"reload; {FAULTS_PAGE})", retryable=True,
        )


def lost(lake: Lake, config: Config) -> None:
    """The slot is missing: when the lake holds changes of it, stop (exit 78) rather than create it."""
    through = applied_through(log_rows(lake), config.source.slot)
    if through is None:
        return  # a lake without this slot's changes: create_slot may create it
    raise SourceStateError(
        f"replication slot {config.source.slot!r} does not exist on this server, but the lake at {config.lake_root} "
        f"holds its changes up to {format_lsn(through)}: it was dropped, or this server is a promoted standby "
        "that held no synchronized copy of it (not a failover slot, or its copy was not sync-ready yet). A slot "
        "created now would miss the changes in between, so pg2delta creates none (--create-slot neither): "
        f"bootstrap a new lake ({FAULTS_PAGE})"
    )


def behind_the_lake(config: Config, start: int, through: int | None) -> None:
    """A synchronized slot starting before what the lake holds (its copy lagged the primary's slot
    when the standby was promoted): say so, after checking that the lake holds nothing past the
    promotion's switch point. WAL past it is the promoted server's own, so the lake would hold
    changes this server never had, and would take its new changes at those positions for applied."""
    slot = config.source.slot
    if through is None or start >= through:
        return
    switch = timeline_start(config.source.dsn, connect_timeout=config.source.connect_timeout)
    if switch is not None and through > switch:
        raise SourceStateError(
            f"the lake at {config.lake_root} holds changes of slot {slot!r} up to {format_lsn(through)}, past "
            f"{format_lsn(switch)}, where this server's timeline begins (its promotion): it holds changes this server "
            "never received (the former primary did not wait for this standby: synchronized_standby_slots), and "
            f"runs from here would miss changes: bootstrap a new lake ({FAULTS_PAGE})"
        )
    log.warning(
        "slot %s (synchronized from the former primary) starts at %s, behind the lake, which holds every change "
        "up to %s: the windows in between are read again, and the changes each table's applied log shows "
        "applied are skipped table by table, not applied twice", slot, format_lsn(start), format_lsn(through),
    )


# --- pg2delta status ------------------------------------------------------------------------


def status_section(config: Config, info: SlotInfo, version_num: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """``status``'s ``standby`` section (None without a standby to check) and its ``failover``
    problems (exit 14): the slot not a failover slot though the config asks, or a standby that a
    promotion now would leave the runs without their slot on."""
    cfg = config.source
    why: list[str] = []
    if cfg.failover and version_num < FAILOVER_VERSION:
        why.append(f"[source] failover = true, but the server runs PostgreSQL {version_num // 10000} (17 or newer has failover slots)")
    elif cfg.failover and info.failover is False:
        why.append(f"slot {info.name} is not a failover slot yet (the next run makes it one: [source] failover = true)")
    standby = None
    if cfg.standby_dsn:
        standby = _standby(config, info, why)
    if not why:
        return standby, []
    return standby, [{
        "kind": "failover",
        "exit_code": EXIT_STATUS_FAILOVER,
        "message": "a promotion of the standby now would leave pg2delta without its slot: " + "; ".join(why)
        + f" ({FAULTS_PAGE})",
    }]


def _standby(config: Config, info: SlotInfo, why: list[str]) -> dict[str, Any]:
    """The ``standby`` section; adds to ``why`` what keeps it from being ready for a promotion."""
    cfg = config.source
    try:
        copy = read_standby(cfg.standby_dsn, cfg.slot, connect_timeout=cfg.connect_timeout)
    except (ConnectionFailed, psycopg.Error) as exc:
        why.append(f"cannot read the standby: {' '.join(str(exc).split())}")
        return {"reachable": False, "ready": False}
    with connect(cfg.dsn, application_name="pg2delta status", connect_timeout=cfg.connect_timeout) as conn:
        names = synchronized_standby_slots(conn)
    why.extend(_not_ready(copy, info, names))
    behind = None
    if copy.confirmed_flush_lsn is not None and info.confirmed_flush_lsn is not None:
        behind = max(0, info.confirmed_flush_lsn - copy.confirmed_flush_lsn)
    return {
        "reachable": True,
        "host": copy.host,
        "port": copy.port,
        "version_num": copy.version_num,
        "in_recovery": copy.in_recovery,
        "replay_lsn": None if copy.replay_lsn is None else format_lsn(copy.replay_lsn),
        "sync_replication_slots": copy.sync_replication_slots,
        "hot_standby_feedback": copy.hot_standby_feedback,
        "primary_slot_name": copy.primary_slot_name or None,
        "primary_waits_for_it": None if names is None else copy.primary_slot_name in names,
        "slot_present": copy.present,
        "slot_sync_ready": copy.sync_ready,
        "slot_synced": copy.synced,
        "slot_confirmed_flush_lsn": None if copy.confirmed_flush_lsn is None else format_lsn(copy.confirmed_flush_lsn),
        "slot_behind_bytes": behind,
        "slot_invalidation_reason": copy.invalidation_reason,
        "ready": not why,
    }


def _not_ready(copy: StandbyCopy, info: SlotInfo, names: list[str] | None) -> list[str]:
    """Why a promotion of the standby now would not keep the slot, or could lose changes the lake holds."""
    slot = info.name
    if not copy.in_recovery:
        return ["the standby is not in recovery (promoted already, or not a standby)"]
    if copy.version_num < FAILOVER_VERSION:
        return [f"the standby runs PostgreSQL {copy.version_num // 10000}, which synchronizes no slots (17 and later do)"]
    why = []
    if info.failover is False:
        why.append(f"slot {slot} is not a failover slot (set [source] failover = true)")
    if not copy.sync_replication_slots:
        why.append("the standby runs with sync_replication_slots = off")
    if not copy.hot_standby_feedback:
        why.append("the standby runs with hot_standby_feedback = off (slot synchronization needs it)")
    if not copy.primary_slot_name:
        why.append("the standby has no primary_slot_name (slot synchronization needs a physical slot on the primary)")
    elif names is not None and copy.primary_slot_name not in names:
        why.append(
            f"the primary's synchronized_standby_slots does not name the standby's slot {copy.primary_slot_name}: "
            "the lake could take changes the standby has not received, which a promotion would lose"
        )
    if copy.conninfo_names_dbname is False:
        why.append("the standby's primary_conninfo names no dbname (slot synchronization needs one)")
    if not copy.present:
        why.append(f"the standby holds no copy of slot {slot}")
    elif copy.invalidation_reason is not None or copy.conflicting:
        why.append(f"the standby's copy of slot {slot} is invalidated ({copy.invalidation_reason or 'conflicting'})")
    elif not copy.sync_ready:
        why.append(
            f"the standby's copy of slot {slot} is not sync-ready yet: it becomes so once the primary's slot moves "
            "past what the standby reserved (the next runs advance it; pg_log_standby_snapshot() on the primary "
            "makes it sooner)"
        )
    return why
