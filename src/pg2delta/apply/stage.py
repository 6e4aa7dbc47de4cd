"""Reduce and stage: a target's changes of a window, ready for the MERGE.

:func:`table_changes` conforms the window's batches of one Delta table to its plan's shape and
keeps the ones the MERGE applies (at or after the table's applied LSN, after the window's last
truncate); :func:`reduce` turns them into one final state per key (what the run merges and what
``pg2delta plan`` counts). A window spilled past ``window.memory_budget`` is never gathered on the
driver: :func:`stage_changes` conforms and filters it batch by batch into Parquet files in the
lake's staging area (:class:`StagedChanges`), which the engine reduces and merges. Past
:data:`~pg2delta.lake.engine_staged.REDUCE_BUCKET_ROWS` changes it writes them in buckets of the
key (:func:`key_buckets`), so that each of the engine's reduce queries reads one bucket's files only.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.apply.merge import Reduced, reduce_changes
from pg2delta.apply.schema import Plan, conform, conform_batches
from pg2delta.apply.targets import Target, live
from pg2delta.decode import _tuples
from pg2delta.decode.changes import BEFORE_OP, LSN_COL, META_NAMES, OP_COL, POS_COL, TOAST_COL, TruncateEvent
from pg2delta.decode.events import DELETED_FIELD
from pg2delta.errors import SchemaError
from pg2delta.lake import engine_staged
from pg2delta.lake.engine import Lake
from pg2delta.window.spill import SpilledBatch, newest_ts


@dataclass
class StagedChanges:
    """A table's changes of a spilled window, conformed and filtered, as Parquet files in the staging
    area (``name`` there, at ``uri``), with what the run reports of them."""

    name: str | None
    uri: str | None
    rows: int = 0
    files: int = 0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    toast_columns: tuple[str, ...] = ()
    # The files of each bucket of the key (:func:`key_buckets`), when written in buckets; empty otherwise.
    buckets: list[list[str]] = field(default_factory=list)


# Conformed changes held per bucket before they are written (all buckets' files at once).
BUCKET_BUFFER_BYTES = 128 << 20

_MIX = np.uint64(0x9E3779B97F4A7C15)
_NULL_HASH = np.uint64(0x5BD1E9955BD1E995)


def key_buckets(table: pa.Table, key_names: Sequence[str], buckets: int) -> np.ndarray | None:
    """Each row's bucket (0 to ``buckets`` - 1) by the values of its key: rows with equal keys get
    one bucket, whatever batch, file or process they come from (the hash of the values' bytes, each
    column in its one conformed type). None where a key column's type is not hashed here (the
    engine then puts the rows in buckets itself)."""
    h = np.zeros(table.num_rows, dtype=np.uint64)
    for name in key_names:
        part = _column_hash(table.column(name).combine_chunks())
        if part is None:
            return None
        h = (h ^ part) * _MIX
    h ^= h >> np.uint64(29)
    return (h % np.uint64(buckets)).astype(np.int64)


def _column_hash(arr: pa.Array) -> np.ndarray | None:
    """A 64-bit hash of each value of ``arr`` (one for every NULL); None for a type not hashed here."""
    t, n, offset = arr.type, len(arr), arr.offset
    out: np.ndarray
    if pa.types.is_boolean(t):
        out = arr.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint64)
    elif pa.types.is_floating(t):
        # Equal numbers, equal bits: -0.0 as 0.0, every NaN as one.
        x = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False) + 0.0
        out = np.where(np.isnan(x), np.nan, x).view(np.uint64)
    elif pa.types.is_decimal128(t) or pa.types.is_fixed_size_binary(t):
        width = t.byte_width
        starts = (np.arange(n, dtype=np.int64) + offset) * width
        out = np.empty(n, dtype=np.uint64)
        _tuples.hash_ranges(arr.buffers()[1] or b"", starts, np.full(n, width, dtype=np.int64), out)
    elif pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        kind = np.int64 if pa.types.is_large_string(t) or pa.types.is_large_binary(t) else np.int32
        offsets = np.frombuffer(arr.buffers()[1], dtype=kind)[offset : offset + n + 1].astype(np.int64)
        out = np.empty(n, dtype=np.uint64)
        _tuples.hash_ranges(arr.buffers()[2] or b"", offsets[:-1], np.diff(offsets), out)
    elif pa.types.is_integer(t) or pa.types.is_temporal(t):
        width = t.bit_width // 8
        if width not in (1, 2, 4, 8):
            return None
        out = np.frombuffer(arr.buffers()[1], dtype=f"u{width}")[offset : offset + n].astype(np.uint64)
    else:
        return None
    if arr.null_count:
        out = np.where(arr.is_null().to_numpy(zero_copy_only=False), _NULL_HASH, out)
    return out


def filtered(table: pa.Table, mask: pa.ChunkedArray | pa.Array) -> pa.Table:
    """``table.filter(mask)``, without copying every column when every row is kept (the usual case:
    no changelog-only rows, nothing before the applied LSN or the last truncate)."""
    return table if pc.all(mask, skip_nulls=False).as_py() else table.filter(mask)


def table_changes(
    tgt: Target, pl: Plan | None, applied_lsn: int, *, whole: bool = False
) -> tuple[pa.Table | None, list[TruncateEvent], set[str]]:
    """The window's changes of ``tgt`` to merge (in the plan's shape, after its applied LSN and its
    last truncate: ``whole``, before it too), its truncates, and the columns kept by updates (see :func:`conform`)."""
    truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
    changes, kept_by_update = conform(live(tgt, applied_lsn), pl) if pl is not None else (None, set())
    if changes is not None and applied_lsn:
        changes = filtered(changes, pc.greater_equal(changes.column(LSN_COL), applied_lsn))
    if truncates and changes is not None and not whole:
        last = max(truncates, key=lambda t: (t.commit_lsn, t.pos))
        lsn, pos = changes.column(LSN_COL), changes.column(POS_COL)
        after = pc.or_(
            pc.greater(lsn, last.commit_lsn),
            pc.and_(pc.equal(lsn, last.commit_lsn), pc.greater(pos, last.pos)),
        )
        changes = filtered(changes, after)
    return changes, truncates, kept_by_update

def stage_changes(
    lake: Lake,
    tgt: Target,
    pl: Plan,
    applied_lsn: int,
    name: str | None,
    *,
    whole: bool = False,
    bucket_key: Sequence[str] = (),
    soft: bool = False,
) -> tuple[StagedChanges, set[str]]:
    """:func:`table_changes` for a window with spilled batches: conformed and filtered batch by
    batch into Parquet files under the staging area's ``name`` (None: only counted, for
    ``pg2delta plan``), never gathered on the driver. Returns them and the columns kept by updates.
    ``whole``: the changes before the window's last truncate too (for the history). ``bucket_key``:
    past ``engine_staged.REDUCE_BUCKET_ROWS`` changes, the files are written in buckets of these columns
    (:attr:`StagedChanges.buckets`), at most :data:`BUCKET_BUFFER_BYTES` held for it. ``soft``: each
    change also holds ``_pg2delta_deleted`` (whether it is a delete), for soft deletes' MERGE."""
    truncates = [t for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
    last = max(truncates, key=lambda t: (t.commit_lsn, t.pos)) if truncates and not whole else None
    kept_by_update: set[str] = set()
    staged = StagedChanges(name, lake.staging_uri(name) if name is not None else None)
    toast: set[str] = set()
    rows = sum(b.num_rows for tw in tgt.parts for b in tw.batches if b.max_lsn >= applied_lsn)
    nbuckets = -(-rows // engine_staged.REDUCE_BUCKET_ROWS) if bucket_key and name is not None else 1
    files = _StagedFiles(lake, staged, name, bucket_key, nbuckets)
    for t in conform_batches(live(tgt, applied_lsn), pl, kept_by_update):
        t = filtered(t, _applied_rows(t, applied_lsn, last))
        if not t.num_rows:
            continue
        for c in pc.value_counts(t.column(OP_COL)).to_pylist():
            staged.ops[c["values"]] += c["counts"]
        marks = pc.list_flatten(t.column(TOAST_COL))
        if len(marks):
            toast.update(x for x in pc.unique(marks).to_pylist() if x is not None)
        staged.rows += t.num_rows
        if soft:
            t = t.append_column(DELETED_FIELD, pc.equal(t.column(OP_COL), "D"))
        if name is not None:
            files.add(t)
    files.flush()
    staged.toast_columns = tuple(sorted(toast))
    return staged, kept_by_update


def _applied_rows(t: pa.Table, applied_lsn: int, last: TruncateEvent | None) -> pa.ChunkedArray:
    """The rows of ``t`` the window applies: not an update's old row, at or after the applied LSN,
    after the window's last truncate ``last`` (None: none)."""
    lsn, pos = t.column(LSN_COL), t.column(POS_COL)
    keep = pc.and_(pc.not_equal(t.column(OP_COL), BEFORE_OP), pc.greater_equal(lsn, applied_lsn))
    if last is not None:
        keep = pc.and_(keep, pc.or_(
            pc.greater(lsn, last.commit_lsn), pc.and_(pc.equal(lsn, last.commit_lsn), pc.greater(pos, last.pos))
        ))
    return keep


class _StagedFiles:
    """The Parquet files of a spilled table's changes under the staging area's ``name``; with
    ``nbuckets`` > 1, in hash buckets of ``bucket_key`` (:attr:`StagedChanges.buckets`), at most
    :data:`BUCKET_BUFFER_BYTES` held before they are written."""

    def __init__(self, lake: Lake, staged: StagedChanges, name: str | None, bucket_key: Sequence[str], nbuckets: int) -> None:
        self.lake, self.staged, self.name = lake, staged, name
        self.bucket_key, self.nbuckets = bucket_key, nbuckets
        self.held: list[list[pa.Table]] = [[] for _ in range(nbuckets)] if nbuckets > 1 else []
        self.held_bytes = 0
        if self.held:
            staged.buckets = [[] for _ in range(nbuckets)]

    def write(self, t: pa.Table) -> str:
        uri = self.lake.stage(t, f"{self.name}/part-{self.staged.files:06d}")
        self.staged.files += 1
        return uri

    def flush(self) -> None:
        for b, parts in enumerate(self.held):
            if parts:
                self.staged.buckets[b].append(self.write(pa.concat_tables(parts)))
                parts.clear()
        self.held_bytes = 0

    def add(self, t: pa.Table) -> None:
        ids = key_buckets(t, self.bucket_key, self.nbuckets) if self.held else None
        if ids is None:
            if self.held:  # a key type not hashed here: the files stay as they are, the engine buckets
                self.flush()
                self.held, self.staged.buckets = [], []
            self.write(t)
            return
        order = np.argsort(ids, kind="stable")
        bounds = np.searchsorted(ids[order], np.arange(self.nbuckets + 1))
        t = t.take(pa.array(order))
        for b in range(self.nbuckets):
            if bounds[b + 1] > bounds[b]:
                self.held[b].append(t.slice(int(bounds[b]), int(bounds[b + 1] - bounds[b])))
        self.held_bytes += t.nbytes
        if self.held_bytes >= BUCKET_BUFFER_BYTES:
            self.flush()


def reduce(
    schema: str, name: str, changes: pa.Table | None, key_names: list[str], data_columns: Sequence[str],
    *, configured_key: bool = True, meta: Sequence[str] = (), soft: bool = False,
) -> tuple[Reduced, list[str], list[str]] | None:
    """``changes`` reduced to one final state per key, with the key and data columns the MERGE
    uses (a table without a key is keyed by commit position); None when there is nothing to merge.
    What the run merges and what ``pg2delta plan`` counts. ``configured_key=False``: the key is
    one PostgreSQL keeps unique (the replica identity, or the commit position), so a window of
    inserts only is kept as it is (:func:`~pg2delta.apply.merge.reduce_changes`). ``meta``: the
    changes' meta columns the table keeps too (its row metadata, pg2delta.apply.rowmeta); ``soft``:
    soft deletes (the final rows hold ``_pg2delta_deleted``, see pg2delta.apply.merge.soft_deleted)."""
    if changes is not None:
        changes = filtered(changes, pc.not_equal(changes.column(OP_COL), BEFORE_OP))  # changelog-only rows
    if changes is None or changes.num_rows == 0:
        return None
    data_columns = [c for c in data_columns if c not in META_NAMES]
    if not key_names:
        # No replica identity: only inserts can be published. Rows are keyed by their
        # commit position, kept in the table, so a replayed window inserts nothing twice.
        if set(changes.column(OP_COL).to_pylist()) - {"I"}:
            raise SchemaError(
                f"table {schema}.{name} has no key but got updates or deletes; "
                f"set [tables.\"{schema}.{name}\"] key = [...] in the config"
            )
        key_names = [LSN_COL, POS_COL]
        data_columns = [*data_columns, LSN_COL, POS_COL]
    data_columns = list(dict.fromkeys([*data_columns, *meta]))
    reduced = reduce_changes(changes, key_names, data_columns, distinct_keys=not configured_key, soft=soft)
    return reduced, key_names, data_columns

def newest_commit_ts(tgt: Target, truncates: Sequence[TruncateEvent], applied_lsn: int) -> int | None:
    """Commit time (microseconds since 1970, UTC) of the newest transaction the window applies to ``tgt``."""
    times = [t.commit_ts for t in truncates if t.commit_ts is not None]
    for tw in tgt.parts:
        for b in tw.batches:
            if b.max_lsn < applied_lsn or not b.num_rows:
                continue
            newest = b.newest_ts if isinstance(b, SpilledBatch) and b.first_lsn >= applied_lsn else newest_ts(b.load(), applied_lsn)
            if newest is not None:
                times.append(newest)
    return max(times) if times else None


__all__ = ["StagedChanges", "filtered", "key_buckets", "newest_commit_ts", "reduce", "stage_changes", "table_changes"]
