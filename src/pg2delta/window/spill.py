"""A window larger than the memory budget: decoded changes spilled to staged Parquet files.

The reader keeps a window's decoded batches in memory until they pass ``window.memory_budget``
bytes; then every batch held so far goes to Parquet files under the lake's staging area (one file
per run of consecutive batches of one relation version, so files stay in commit order) and only a
small :class:`SpilledBatch` stays on the driver. A table with spilled batches is never gathered on
the driver again: its changes are conformed batch by batch into a staging directory and reduced to
one row per key by the engine (:func:`pg2delta.lake.staged_sql.final_source_sql`), where on a cluster the
executors do the work; its SCD2 history's versions are computed there as well (:mod:`pg2delta.apply.history`). Together with the decoder giving a large transaction out in parts
(``WindowDecoder(split_rows=...)``) the driver's memory does not follow the size of a transaction
or of a window.

The files live under ``_pg2delta/staging/slot-<slot>/<run id>/spill/`` and are removed when the window ends
(applied or failed); a killed run leaves them, and the slot's next run (or bootstrap, resync,
maintain: whatever takes the slot's lock next) removes them when it starts. Nothing about them is needed for exactly-once: a rerun reads the window again.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pg2delta.decode.changes import LSN_COL, TS_COL, ChangeBatch, RelationVersion
from pg2delta.errors import LakeError
from pg2delta.lake.engine import Lake
from pg2delta.memory import release_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SpilledBatch:
    """Rows of one relation version, in commit order, in a staged Parquet file."""

    relation: RelationVersion
    lake: Lake
    uri: str
    num_rows: int
    first_lsn: int
    max_lsn: int
    nbytes: int
    newest_ts: int | None  # the newest commit time of its rows (microseconds since 1970)

    spilled = True

    def load(self) -> pa.RecordBatch:
        try:
            with self.lake.fs.open_input_file(self.lake.fs_path(self.uri)) as f:
                table = pq.read_table(f)
        except (OSError, pa.ArrowException) as exc:
            raise LakeError(f"cannot read spilled changes {self.uri}: {exc}") from exc
        table = table.cast(self.relation.schema)
        batches = table.combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=self.relation.schema)


# Decoded bytes per spilled file at most (one batch larger than this is a file of its own).
SPILL_FILE_BYTES = 32 << 20

# What a window's table holds: batches in memory or spilled.
Batch = ChangeBatch | SpilledBatch


class Spiller:
    """Moves a window's batches out of memory once they pass ``budget`` bytes."""

    def __init__(self, lake: Lake, run_id: str, budget: int) -> None:
        self.lake = lake
        self.budget = budget
        self.root = f"{run_id}/spill-{uuid.uuid4().hex[:8]}"
        self.held = 0  # bytes of the batches still in memory
        self.spilled_rows = 0
        self.files = 0

    def add(self, batch: ChangeBatch) -> None:
        self.held += int(batch.batch.nbytes)

    def over(self) -> bool:
        return self.held > self.budget

    def spill(self, tables: Iterable[list[Batch]]) -> None:
        """Replace every in-memory batch of ``tables`` (lists changed in place) by spilled ones."""
        for batches in tables:
            batches[:] = self._spill_one(batches)
        log.info("window larger than the memory budget (%d bytes): %d rows spilled to %d files so far",
                 self.budget, self.spilled_rows, self.files)
        self.held = 0
        release_memory()

    def _spill_one(self, batches: Sequence[Batch]) -> list[Batch]:
        out: list[Batch] = []
        run: list[ChangeBatch] = []
        for b in batches:
            if isinstance(b, ChangeBatch) and (not run or run[-1].relation is b.relation):
                if b.num_rows:
                    run.append(b)
                continue
            if run:
                out.extend(self._write_parts(run))
                run = []
            if isinstance(b, ChangeBatch):
                if b.num_rows:
                    run.append(b)
            else:
                out.append(b)
        if run:
            out.extend(self._write_parts(run))
        return out

    def _write_parts(self, run: Sequence[ChangeBatch]) -> list[SpilledBatch]:
        # Files of at most about SPILL_FILE_BYTES, in order: each is loaded whole when the window's
        # changes are staged, so a file of the whole budget would be held again there at once.
        parts: list[SpilledBatch] = []
        group: list[ChangeBatch] = []
        size = 0
        for b in run:
            if group and size + int(b.batch.nbytes) > SPILL_FILE_BYTES:
                parts.append(self._write(group))
                group, size = [], 0
            group.append(b)
            size += int(b.batch.nbytes)
        if group:
            parts.append(self._write(group))
        return parts

    def _write(self, run: Sequence[ChangeBatch]) -> SpilledBatch:
        table = pa.Table.from_batches([b.batch for b in run])
        name = f"{self.root}/{run[0].relation.oid}-{self.files:06d}"
        uri = self.lake.stage(table, name)
        self.files += 1
        self.spilled_rows += table.num_rows
        newest = pc.max(table.column(TS_COL).cast(pa.int64())).as_py() if TS_COL in table.column_names else None
        return SpilledBatch(
            run[0].relation, self.lake, uri, table.num_rows, run[0].first_lsn, run[-1].max_lsn, int(table.nbytes),
            None if newest is None else int(newest),
        )

    def remove(self) -> None:
        """Remove the spilled files (the window is over)."""
        if self.files:
            self.lake.unstage_dir(self.root)


def newest_ts(batch: pa.RecordBatch, applied_lsn: int) -> int | None:
    """Commit time (microseconds since 1970) of the newest row at or after ``applied_lsn``."""
    if not batch.num_rows or TS_COL not in batch.schema.names:
        return None
    ts = batch.column(TS_COL)
    if applied_lsn:  # only the times, not the whole batch
        ts = ts.filter(pc.greater_equal(batch.column(LSN_COL), applied_lsn))
    newest = pc.max(ts.cast(pa.int64())).as_py() if len(ts) else None
    return None if newest is None else int(newest)
