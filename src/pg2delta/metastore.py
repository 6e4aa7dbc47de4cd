"""Tables in the Spark session's catalog: ``[lake] database`` (see :attr:`pg2delta.config.Config.database`).

Users query the lake as ``bronze.public_orders``, not by path. With ``[lake] database`` set, a
command that wrote the lake (run, bootstrap, resync, backfill in place) ends by registering every
Delta table of the slot that the catalog does not hold yet, as an external Delta table at its
location (``CREATE TABLE … USING DELTA LOCATION …``): the table, and its SCD2 history
(``<name>__history``) and changelog (``<name>__changelog``) where they exist. The catalog is
whatever the session is configured with: the Hive metastore, AWS Glue, Unity Catalog.

A Delta table's schema lives in its own log, so the catalog needs no update after a schema
change, a resync or a backfill in place: readers see the new columns at once. Registration runs
after the window's commits and the slot's advance; should it fail (the metastore unreachable), the
command exits with the error, nothing is lost, and the next command registers what is missing.
A name the catalog already holds is left alone, wherever it points: ``status`` shows each
table's catalog name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pg2delta.apply.changelog import changelog_path
from pg2delta.apply.history import history_table
from pg2delta.config import Config
from pg2delta.lake.applied_log import LOG_TABLE, table_names
from pg2delta.lake.engine import Engine, Lake
from pg2delta.lake.sql import quote, sql_string

log = logging.getLogger(__name__)

HISTORY_NAME_SUFFIX = "__history"
CHANGELOG_NAME_SUFFIX = "__changelog"


def slot_tables(config: Config, lake: Lake) -> list[tuple[str, str]]:
    """(schema, table) of every Delta table of this slot, as its applied log names them."""
    applied = lake.read_delta(lake.table_uri(LOG_TABLE))
    if applied is None or applied.num_rows == 0:
        return []
    import pyarrow.compute as pc

    mine = pc.and_(pc.fill_null(pc.equal(applied.column("slot"), config.source.slot), False),
                   pc.is_valid(applied.column("relation_oid")))
    return sorted(table_names(applied.filter(mine)))


def catalog_tables(config: Config, lake: Lake) -> dict[str, str]:
    """``database.name`` -> location of every Delta table of the slot that exists, with its history
    and changelog (empty when ``[lake] database`` is not set)."""
    out: dict[str, str] = {}
    for schema, table in slot_tables(config, lake):
        name = config.catalog_name(schema, table)
        if name is None:
            return {}
        candidates = (
            (name, lake.table_uri(schema, table)),
            (name + HISTORY_NAME_SUFFIX, lake.table_uri(schema, history_table(table))),
            (name + CHANGELOG_NAME_SUFFIX, lake.table_uri(changelog_path(schema, table))),
        )
        for qualified, uri in candidates:
            if lake.delta_version(uri) is not None:
                out[qualified] = uri
    return out


def register_written(config: Config, lake: Lake, engine: Callable[[], Engine] | None) -> list[str]:
    """At the end of a command that wrote ``lake``: :func:`register` with its engine (``engine()``,
    asked for only then), when ``[lake] database`` is set and the command started one (``engine``
    None: it started none)."""
    if not config.database or engine is None:
        return []
    return register(engine(), config, lake)


def _identifier(dotted: str) -> str:
    return ".".join(quote(part) for part in dotted.split("."))


def register(engine: Any, config: Config, lake: Lake) -> list[str]:
    """Register the slot's Delta tables the catalog does not hold (see the module's docstring);
    returns the names registered."""
    wanted = catalog_tables(config, lake)
    if not wanted:
        return []
    database = _identifier(config.database)
    engine.query(f"CREATE DATABASE IF NOT EXISTS {database}", f"create database {config.database}")
    # SHOW TABLES: (namespace, tableName, isTemporary); names come back in lower case.
    have = {str(row[1]).lower() for row in engine.query(f"SHOW TABLES IN {database}", f"list {config.database}")}
    done = []
    for qualified, uri in sorted(wanted.items()):
        if qualified.rsplit(".", 1)[1].lower() in have:
            continue
        engine.query(
            f"CREATE TABLE IF NOT EXISTS {_identifier(qualified)} USING DELTA LOCATION {sql_string(uri)}",
            f"register {qualified}",
        )
        done.append(qualified)
    if done:
        log.info("registered %d table(s) in catalog database %s: %s", len(done), config.database, ", ".join(done))
    return done


__all__ = ["CHANGELOG_NAME_SUFFIX", "HISTORY_NAME_SUFFIX", "catalog_tables", "register", "register_written", "slot_tables"]
