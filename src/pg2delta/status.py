"""``pg2delta status``: where the slot is, how far behind the server, and what the lake holds."""

from __future__ import annotations

from typing import Any

from pg2delta.config import Config
from pg2delta.engine import Engine, Lake
from pg2delta.errors import SourceStateError
from pg2delta.job import LOG_TABLE
from pg2delta.lsn import format_lsn
from pg2delta.slot import SlotSource


def status(config: Config) -> dict[str, Any]:
    with SlotSource(config.source.dsn, config.source.slot, config.source.publication) as src:
        info = src.slot_info()
        if info is None:
            raise SourceStateError(f"replication slot {config.source.slot!r} does not exist")
        server = src.current_lsn()
    confirmed = info.confirmed_flush_lsn
    slot = {
        "name": info.name,
        "plugin": info.plugin,
        "confirmed_flush_lsn": format_lsn(confirmed) if confirmed is not None else None,
        "restart_lsn": format_lsn(info.restart_lsn) if info.restart_lsn is not None else None,
        "lag_bytes": server - confirmed if confirmed is not None else None,
        "wal_status": info.wal_status,
        "safe_wal_size": info.safe_wal_size,
        "active_pid": info.active_pid,
    }
    lake = Lake(config.lake_root)
    tables: list[dict[str, Any]] = []
    if lake.delta_version(lake.table_uri(LOG_TABLE)) is not None:
        engine = Engine.start(config.engine, lake)
        try:
            latest: dict[int, dict[str, Any]] = {}
            for row in engine.read_table(lake.table_uri(LOG_TABLE)):
                if row.get("slot") != config.source.slot or row.get("relation_oid") is None:
                    continue  # rows without a table mark a bootstrap's start
                oid = int(row["relation_oid"])
                if oid not in latest or int(row["window_end"]) > int(latest[oid]["window_end"]):
                    latest[oid] = row
        finally:
            engine.stop()
        for row in sorted(latest.values(), key=lambda r: (r["schema_name"], r["table_name"])):
            tables.append(
                {
                    "table": f"{row['schema_name']}.{row['table_name']}",
                    "applied_lsn": row["window_end_lsn"],
                    "delta_version": row["delta_version"],
                    "applied_at": row["applied_at"],
                }
            )
    return {"slot": slot, "server_lsn": format_lsn(server), "tables": tables}
