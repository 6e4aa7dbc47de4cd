"""A table's COPY staged as Parquet files under the lake's staging area, here or in worker processes.

:func:`stage_table` reads one table's COPY (inside the snapshot), decodes it and writes Delta
data files; :class:`Workers` are the processes that do it for several tables at once (reading the
COPY is CPU-bound Python), each reporting its progress through a queue.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from pg2delta.config import Config
from pg2delta.decode.changes import WindowDecoder
from pg2delta.errors import (
    ConnectionFailed,
    Pg2DeltaError,
    SourceStateError,
)
from pg2delta.lake.engine import Lake
from pg2delta.lake.engine_session import EMBEDDED_FILE_BYTES
from pg2delta.lake.engine_writes import copy_file_options
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.copy import CopyMeta, CopyPlan, CopyRows
from pg2delta.source.copydata import copy_blocks
from pg2delta.source.keys import column_rules, key_resolver
from pg2delta.source.publication import PublishedTable
from pg2delta.source.slot import connect
from pg2delta.source.snapshot import Snapshot, open_snapshot

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # COPY bytes gathered before their rows are walked and decoded
# A staged Parquet file (a Delta data file once adopted) ends past this many rows or bytes: a
# table of millions of rows is tens of files, each one key range (the COPY is in key order), of
# which a window rewrites those it touches; the bytes are those of the embedded engine's own files.
_FILE_ROWS = 1_048_576
_FILE_BYTES = EMBEDDED_FILE_BYTES
# ... and past 1/_FILES_PER_TABLE of the table's estimated rows (pg_class.reltuples), down to
# _MIN_FILE_ROWS: a table of 2,000,000 rows is some 30 files rather than 2, of which a window
# touching recent keys rewrites one or two.
_FILES_PER_TABLE = 64
_MIN_FILE_ROWS = 65_536


def file_rows(estimated_rows: int | None) -> int:
    """Rows per staged file of a table of about ``estimated_rows`` rows (None: unknown)."""
    if not estimated_rows:
        return _FILE_ROWS
    return min(_FILE_ROWS, max(_MIN_FILE_ROWS, estimated_rows // _FILES_PER_TABLE))


def stage_table(
    conn: psycopg.Connection[Any],
    plan: CopyPlan,
    lake: Lake,
    stage_dir: str,
    report: Callable[[int, int], None],
) -> tuple[int, dict[str, int]]:
    """COPY one table on ``conn`` (inside the snapshot) into Parquet files under ``stage_dir``.

    Memory holds two chunks of rows at a time (one being decoded, one being written).
    ``report(rows so far, new rows)`` is called after every chunk is written. Returns the rows copied and the decoder's notes (clamped values and the like).
    """
    lake.fs.create_dir(stage_dir, recursive=True)
    parts = _Parts(lake, stage_dir, plan.schema, file_rows(plan.table.estimated_rows))
    write = parts.write

    walker = CopyRows(plan)
    # The Parquet writes (pyarrow, without the GIL) run in a thread while the next chunk is read
    # and decoded: at most one batch waits for its write, so memory holds two chunks at most. A
    # chunk is reported once it is written (the fault point in ``report`` finds it on disk).
    pending: list[tuple[Future[None], int, int]] = []

    def settle() -> None:
        while pending:
            written, so_far, new = pending.pop()
            written.result()
            report(so_far, new)

    def emit(batch: pa.RecordBatch) -> None:
        settle()
        pending.append((writes.submit(write, batch), walker.rows, batch.num_rows))

    writes = ThreadPoolExecutor(1, thread_name_prefix="pg2delta-stage")
    try:
        buf = bytearray()
        blocks = copy_blocks(conn, plan.statement())
        try:
            for data in blocks:  # CopyData blocks: a row each (the first after the file header)
                buf += data
                if len(buf) >= CHUNK_BYTES:
                    buf = walker.feed(bytes(buf), emit)
        finally:
            blocks.close()  # stopped early: psycopg cancels the COPY and reads what is left of it
        walker.feed(bytes(buf), emit, last=True)
        settle()
        if parts.writer is None:  # an empty table: one empty file gives the schema
            write(pa.RecordBatch.from_pylist([], schema=plan.schema))
    except psycopg.OperationalError as exc:
        raise ConnectionFailed(f"lost the connection copying {plan.table.qualified}: {' '.join(str(exc).split())}") from exc
    except psycopg.Error as exc:
        raise _copy_failed(plan.table.qualified, exc) from exc
    finally:
        writes.shutdown(wait=True)
        parts.close()
    return walker.rows, dict(walker.notes)


def _copy_failed(name: str, exc: psycopg.Error) -> SourceStateError:
    """The error of a table's copy that PostgreSQL refused. The COPY is parsed against the catalog as
    it is now, not as of the copy's snapshot: a column renamed or dropped since the snapshot (an
    ALTER TABLE meanwhile; found by make soak) is gone from it, and the next run copies the new shape."""
    text = " ".join(str(exc).split())
    if isinstance(exc, psycopg.errors.UndefinedColumn | psycopg.errors.UndefinedTable):
        return SourceStateError(
            f"cannot copy {name}: its shape changed after the copy's snapshot (ALTER TABLE meanwhile; run again): {text}",
            retryable=True,
        )
    return SourceStateError(f"cannot copy {name}: {text}")


class _Parts:
    """The staged Parquet files of one table, ``rows`` rows or ``_FILE_BYTES`` each, written as Delta data files
    (the embedded engine's lake takes them as they are: adopt_copy)."""

    def __init__(self, lake: Lake, stage_dir: str, schema: pa.Schema, rows: int) -> None:
        self.lake, self.stage_dir, self.schema, self.rows = lake, stage_dir, schema, rows
        self.writer: pq.ParquetWriter | None = None
        self.out: Any = None
        self.files = 0
        self.file_rows = 0

    def write(self, batch: pa.RecordBatch) -> None:
        at = 0
        while True:
            if self.writer is None or self.file_rows >= self.rows or self.out.tell() >= _FILE_BYTES:
                self.close()
                self.out = self.lake.fs.open_output_stream(f"{self.stage_dir}/part-{self.files:05d}.parquet")
                self.writer = pq.ParquetWriter(self.out, self.schema, **copy_file_options(self.schema))
                self.files += 1
                self.file_rows = 0
            part = batch.slice(at, self.rows - self.file_rows)
            self.writer.write_batch(part)
            self.file_rows += part.num_rows
            at += part.num_rows
            if at >= batch.num_rows:
                return

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# --- worker processes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageTask:
    config: Config
    snapshot: Snapshot
    table: PublishedTable
    stage_dir: str
    meta: CopyMeta | None = None


@dataclass(frozen=True, slots=True)
class _Staged:
    rows: int = 0
    notes: dict[str, int] = field(default_factory=dict)
    error: tuple[str, str, bool] | None = None  # kind, message, retryable of a Pg2DeltaError


_progress_queue: Any = None
_abort: Any = None


# The forkserver listens on a Unix socket in multiprocessing's temporary folder, made under TMPDIR
# on its first use, and a socket's path holds at most 107 bytes: under a long TMPDIR (a YARN
# container's, a spark-submit driver's in a test's folder) the bootstrap stopped with "AF_UNIX path
# too long". Past this length that one folder is made under /tmp instead.
_SOCKET_DIR_MAX = 60


def _short_socket_dir() -> None:
    if len(tempfile.gettempdir()) <= _SOCKET_DIR_MAX or not os.access("/tmp", os.W_OK):
        return
    import multiprocessing.util

    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        multiprocessing.util.get_temp_dir()  # made now, under /tmp; kept (and removed) by multiprocessing
    finally:
        tempfile.tempdir = saved


def _worker_context() -> Any:
    """Workers are forked from a forkserver that has imported this module once (a fresh process,
    never this one: it may run the engine's threads), so each worker starts without importing
    pyarrow, psycopg and the decoder again (0.4 s of CPU each)."""
    _short_socket_dir()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


class Workers:
    """The worker processes that stage tables (forked from the forkserver, see
    :func:`_worker_context`), started as soon as a bootstrap knows it will copy in parallel: they
    get ready while the slot is created, the catalog read and the engine started."""

    def __init__(self, n: int) -> None:
        ctx = _worker_context()
        self.queue: Any = ctx.Queue()
        self.abort: Any = ctx.Event()  # set when a table failed: the others stop at their next chunk
        level = logging.getLogger("pg2delta").getEffectiveLevel()
        # The object store's settings as this command has them ([lake] endpoint... become AWS_*
        # variables at config load): the forkserver, started by an earlier command of this process,
        # would hand its workers the environment of its own start.
        storage = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        self.pool = ProcessPoolExecutor(
            max_workers=n, mp_context=ctx, initializer=_init_worker, initargs=(self.queue, self.abort, level, storage)
        )
        for _ in range(n):  # one process is spawned per task submitted while none is idle
            self.pool.submit(_ready)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ready() -> None:
    """A worker's first task: nothing, once its process has started and imported this module."""


def _init_worker(queue: Any, abort: Any, level: int, storage: dict[str, str]) -> None:
    global _progress_queue, _abort
    _progress_queue, _abort = queue, abort
    for name in [k for k in os.environ if k.startswith("AWS_") and k not in storage]:
        del os.environ[name]
    os.environ.update(storage)
    # The bootstrap that started this worker may die (a kill, an OOM): the worker then ends too, busy
    # or idle, rather than copy for nobody and hold the job's output pipes open.
    parent = multiprocessing.parent_process()
    if parent is not None:
        def watch(sentinel: int = parent.sentinel) -> None:
            multiprocessing.connection.wait([sentinel])
            os._exit(1)

        threading.Thread(target=watch, name="pg2delta parent watch", daemon=True).start()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def stage_in_worker(task: StageTask) -> _Staged:
    """In a worker process: import the snapshot, COPY one table, stage it; the parent commits it."""
    cfg = task.config
    lake = Lake(cfg.lake_root)
    try:
        conn = connect(cfg.source.dsn, application_name="pg2delta bootstrap copy", connect_timeout=cfg.source.connect_timeout)
        catalog_conn = connect(cfg.source.dsn, application_name="pg2delta catalog", connect_timeout=cfg.source.connect_timeout)
        try:
            open_snapshot(conn, task.snapshot)
            decoder = WindowDecoder(PgTypeCatalog(catalog_conn), key_resolver(cfg, catalog_conn),
                                    columns=column_rules(cfg, catalog_conn))
            plan = CopyPlan.make(task.table, decoder.relation_version(task.table.relation), task.meta)

            def report(rows: int, new: int) -> None:
                if _abort.is_set():
                    raise SourceStateError("stopped: another table of this bootstrap failed")
                _progress_queue.put((task.table.oid, rows, new))

            rows, notes = stage_table(conn, plan, lake, task.stage_dir, report)
            return _Staged(rows, notes)
        finally:
            conn.close()
            catalog_conn.close()
    except Pg2DeltaError as exc:
        return _Staged(error=(exc.kind.value, str(exc), exc.retryable))
