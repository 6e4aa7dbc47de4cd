"""The source side of ``pg2delta verify`` for a table with hashed or excluded columns
(``[tables."s.t"] hash``/``exclude``, :mod:`pg2delta.decode.governance`).

PostgreSQL cannot compute the lake's hash without the key, and the key never goes to the server
(it would show in its activity and its logs). So the table is copied in verify's snapshot through
the copy path, which hashes and leaves out columns here, as every copy does, into the lake's
staging area; the engine then reads those files as the source side, with the same SQL as the
lake's side. Nothing raw is staged; the files are removed afterwards.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pyarrow.fs as pafs

from pg2delta.config import Config
from pg2delta.copy.staging import stage_table
from pg2delta.decode.changes import WindowDecoder
from pg2delta.lake.engine import Engine
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.copy import CopyPlan
from pg2delta.source.keys import column_rules, key_resolver
from pg2delta.source.publication import PublishedTable

log = logging.getLogger(__name__)


@contextmanager
def governed_source(
    engine: Engine, conn: psycopg.Connection[Any], config: Config, table: PublishedTable
) -> Iterator[str | None]:
    """A temporary view of ``table`` as the lake would land it, copied over ``conn`` (in its
    snapshot); None when no column of it is hashed or excluded (PostgreSQL's SQL compares it then)."""
    rules = column_rules(config, conn)
    version = None
    if rules is not None:
        version = WindowDecoder(PgTypeCatalog(conn), key_resolver(config, conn), columns=rules).relation_version(table.relation)
    if version is None or version.governance is None:
        yield None
        return
    lake = engine.lake
    name = f"verify-{uuid.uuid4().hex[:12]}"
    folder = f"{lake.path}/{lake.staging_rel}/{name}"
    try:
        rows, _ = stage_table(conn, CopyPlan.make(table, version), lake, folder, lambda _rows, _new: None)
        files = sorted(i.base_name for i in lake.fs.get_file_info(pafs.FileSelector(folder)) if i.base_name.endswith(".parquet"))
        log.info("verify: %s copied with its hashed and excluded columns as the lake lands them (%d rows)", table.qualified, rows)
        with engine.files_view([lake.staging_uri(f"{name}/{f}") for f in files]) as view:
            yield view
    finally:
        lake.unstage_dir(name)


__all__ = ["governed_source"]
