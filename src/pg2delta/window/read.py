"""Read and decode: one window of the slot, per relation, before anything of it is applied.

:func:`read_window` peeks the slot from its position up to the run's bound (capped by
``--max-changes`` / ``--max-bytes``), feeds every chunk to the :class:`~pg2delta.decode.changes.WindowDecoder`
and gathers the decoded batches and truncates per relation OID (:class:`TableWindow`); past
``window.memory_budget`` the batches go to the :class:`~pg2delta.window.spill.Spiller`'s files. A window
that holds a table's shape change after its first transaction is cut just before that
transaction, so each window merges every table in one shape. It returns a :class:`ReadWindow`:
plain values the run and ``pg2delta plan`` both take from here.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import pyarrow.compute as pc

from pg2delta.config import Config
from pg2delta.decode.changes import (
    LSN_COL,
    ChangeBatch,
    DecodedChunk,
    KeyResolver,
    RelationVersion,
    TruncateEvent,
    WindowDecoder,
)
from pg2delta.faults import fault_point
from pg2delta.lsn import format_lsn
from pg2delta.progress import Progress, percent
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.source.keys import column_rules
from pg2delta.source.slot import SlotSource, WindowRead
from pg2delta.window.shapes import shape_cut
from pg2delta.window.spill import Batch, Spiller

log = logging.getLogger(__name__)


@dataclass
class TableWindow:
    """Everything one window holds for one relation."""

    oid: int
    batches: list[Batch] = field(default_factory=list)
    truncates: list[TruncateEvent] = field(default_factory=list)

    @property
    def latest(self) -> RelationVersion:
        versions = [b.relation for b in self.batches] + [v for t in self.truncates for v in t.relations if v.oid == self.oid]
        return max(versions, key=lambda v: v.version)

    def cut(self, lsn: int) -> None:
        """Keep only the changes of transactions whose commit LSN is before ``lsn``."""
        kept = self.split(lsn)[0]
        self.batches, self.truncates = kept.batches, kept.truncates

    def split(self, lsn: int) -> tuple[TableWindow, TableWindow]:
        """The changes of transactions whose commit LSN is before ``lsn``, and the others."""
        before, after = TableWindow(self.oid), TableWindow(self.oid)
        for b in self.batches:
            if b.max_lsn < lsn:
                before.batches.append(b)
            elif b.first_lsn >= lsn:
                after.batches.append(b)
            else:
                batch = b.load()
                at = batch.column(LSN_COL)
                for part, rows in ((before, batch.filter(pc.less(at, lsn))), (after, batch.filter(pc.greater_equal(at, lsn)))):
                    if rows.num_rows:
                        part.batches.append(ChangeBatch(b.relation, rows))
        before.truncates = [t for t in self.truncates if t.commit_lsn < lsn]
        after.truncates = [t for t in self.truncates if t.commit_lsn >= lsn]
        return before, after


@dataclass(frozen=True)
class ReadWindow:
    """One window as read and decoded, before anything of it is applied."""

    start: int  # where the window starts (the slot's position before it)
    end: int  # where the window ends (the slot's position after it)
    tables: dict[int, TableWindow]
    read: WindowRead
    transactions: int
    capped: bool  # ended by --max-changes / --max-bytes
    shape_cut: bool  # ended before a transaction that changes a table's shape
    spilled_rows: int = 0  # decoded changes spilled past the memory budget


def run_progress(start: int, upper: int, *, bar: bool | None = None) -> Progress:
    """A run's progress through its LSN range [start, upper): a bar on a terminal, log lines otherwise."""

    def line(p: Progress) -> str:
        eta = p.eta()
        return (
            f"reading: {p.rows} rows, {p.rate():.0f} rows/s, {percent(p.position, p.total)} of the LSN range"
            + (f", eta {eta:.0f} s" if eta is not None else "")
        )

    return Progress("run", total=upper - start, unit="B", bytes_unit=True, logger=log, line=line, bar=bar)


@dataclass
class _Gathered:
    """What the decoded chunks of a window add up to, per relation, while it is read."""

    spiller: Spiller
    tables: dict[int, TableWindow] = field(default_factory=dict)
    transactions: int = 0
    notes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def take(self, decoded: DecodedChunk) -> None:
        self.transactions += decoded.transactions
        for name, count in decoded.notes.items():
            self.notes[name] += count
        for batch in decoded.changes:
            self.tables.setdefault(batch.relation.oid, TableWindow(batch.relation.oid)).batches.append(batch)
            self.spiller.add(batch)
        for trunc in decoded.truncates:
            for version in trunc.relations:
                self.tables.setdefault(version.oid, TableWindow(version.oid)).truncates.append(trunc)
        if decoded.retracted is not None:
            # A transaction given out in parts that did not commit in the window (it is the last).
            for tw in self.tables.values():
                tw.cut(decoded.retracted)
        if self.spiller.over():
            self.spiller.spill(tw.batches for tw in self.tables.values())
            fault_point("after_spill")


def read_window(
    src: SlotSource,
    config: Config,
    start: int,
    upper: int,
    catalog: PgTypeCatalog,
    key_resolver: KeyResolver,
    spiller: Spiller,
    progress: tuple[Progress, int] | None = None,
) -> ReadWindow:
    """Peek one window from ``src`` (capped like every window, then cut at a table's shape change)
    and decode it per relation: the part of a window the run and ``pg2delta plan`` share.
    Past the memory budget the decoded batches go to ``spiller``'s files. ``progress``: the run's
    progress and the LSN it counts from (None: log lines for this window alone)."""
    # Old rows of updates are kept (as 'B' rows) only for changelogs; the apply drops them.
    keep_old = config.changelog or any(t.changelog for t in config.tables.values())
    decoder = WindowDecoder(catalog, key_resolver, keep_old=keep_old, split_rows=config.window.split_rows,
                            columns=column_rules(config, catalog.conn))
    bar, base = progress if progress is not None else (run_progress(start, upper, bar=False), start)
    rows_before = bar.rows
    rows_read = 0
    read: WindowRead | None = None
    got = _Gathered(spiller)
    cap = config.window
    for item in src.read_window(upper, max_changes=cap.max_changes, max_bytes=cap.max_bytes):
        if isinstance(item, WindowRead):
            read = item
            continue
        got.take(decoder.feed(item))
        if len(item):
            rows_read += len(item)
            bar.move_to(int(item.lsns[-1]) - base, rows=rows_before + rows_read)
    got.take(decoder.finish())
    assert read is not None
    for name, count in sorted(got.notes.items()):
        log.warning("window note: %s = %d", name, count)
    end = (read.last_commit_end_lsn or start) if read.capped else upper
    tables = got.tables
    cut = shape_cut([tw.batches for tw in tables.values()], [t.commit_lsn for tw in tables.values() for t in tw.truncates])
    if cut is not None and start < cut < end:
        # A table changes shape after the window's first transaction: end the window at that
        # transaction's commit (the slot then stands just before it), so each window merges
        # every table in one shape, on one key.
        log.info("a table changes shape at %s: the window ends there", format_lsn(cut))
        end = cut
        for tw in tables.values():
            tw.cut(cut)
        tables = {oid: tw for oid, tw in tables.items() if tw.batches or tw.truncates}
    return ReadWindow(
        start, end, tables, read, got.transactions, read.capped and end != upper,
        cut is not None and start < cut == end, spiller.spilled_rows,
    )


__all__ = ["ReadWindow", "TableWindow", "read_window", "run_progress"]
