"""The tables a run copies again at a new snapshot in the middle of a window, after its read and
before anything of it is written, where ``on_unfollowable = "resync"`` (else the run stops, exit 78):

* a root published via itself whose leaf partition was truncated alone since the lake's last
  window or copy of it (pgoutput does not send that: pg2delta.source.rewrites),
  :meth:`CopyAgain.truncated_partitions`;
* a table whose plan for the window was refused (pg2delta.apply.tableplan), :meth:`CopyAgain.refused`.

The copy's snapshot is taken now, after the window's end (the window ended at the server's WAL
when the run started), so the table's changes in this window and up to the copy are skipped by
the applied-LSN rule. :class:`CopyAgain` is handed what the copies are made with
(:class:`~pg2delta.copy.copier.CopyInto`), the run's slot, its applied log (read again from the
lake after a copy), the planner's column forms (a copy records its columns' form) and the
window log (the leaves' relfilenodes as last read, the roots to log again), not the run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pg2delta.apply.column_forms import ColumnForms
from pg2delta.apply.targets import Target, rewritten_partitions
from pg2delta.apply.window_log import WindowLog
from pg2delta.copy.copier import DEFAULT_PARALLEL, CopyInto, copy_at_new_snapshot
from pg2delta.errors import SchemaError
from pg2delta.lake.applied_log import Applied, applied_lsns
from pg2delta.source.rewrites import filenodes_of
from pg2delta.source.slot import SlotSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyAgain:
    """The copies again of one run's windows (see the module's docstring)."""

    into: CopyInto
    src: SlotSource
    applied: dict[int, Applied]  # the run's applied log, read again from the lake after a copy
    forms: ColumnForms  # the planner's: reset after a copy
    log: WindowLog

    def truncated_partitions(self) -> None:
        """Stop (exit 78), or copy the root again where ``on_unfollowable = "resync"``, before
        anything of the window is applied, when a leaf partition of a root published via itself
        was truncated alone since the lake's last window or copy of the root (pgoutput does not
        send that: :mod:`pg2delta.source.rewrites`).

        Called after the window's peek returned, so the relfilenodes read now show every rewrite
        committed up to the window's end (the peek reads no further than the run's bound, the
        server's flush position before it), and they are what the window records. One that
        differs from the map read after the previous peek, or recorded by the applied log, comes
        from a rewrite committed after that map was read: for a map read after a peek, after the
        bound of that run, so past the end of every window that run read; for a copy's map (read
        in its snapshot), past the copy's LSN. Either way past the slot's position of then. Where
        the slot has moved since, each window it moved over compared its own read, so a rewrite
        it passed was looked at by the run that passed it (looking again finds nothing). A leaf
        new since the map was read counts too: a TRUNCATE in the transaction that created it
        empties it in place, keeping its relfilenode. So one decode of the slot's backlog, the only
        extra cost, paid only when a relfilenode changed or a partition appeared, finds every
        TRUNCATE of a leaf alone the lake has not seen.
        """
        again: dict[int, str] = {}
        now, changed, refusal = rewritten_partitions(self.into.config, self.src, self.applied, self.log.filenodes, again)
        if changed:
            if refusal is not None:
                raise refusal
            if again:  # copied at a snapshot after the window's end: the window's changes of it are skipped
                copied = copy_at_new_snapshot(self.into, self.src, set(again), parallel=DEFAULT_PARALLEL)
                if {c.relation_oid for c in copied} != set(again):
                    raise SchemaError(f"cannot copy {', '.join(sorted(again.values()))} again: no longer published")
                self._copied()
                now.update({root: nodes for root in again if (nodes := filenodes_of(self.applied[root].filenodes)) is not None})
            self.log.rewritten.update(set(changed) - set(again))
        self.log.filenodes.update(now)

    def refused(self, tgt: Target, refusal: SchemaError) -> None:
        """Copy ``tgt`` again at a new snapshot (``pg2delta resync``) instead of stopping on ``refusal``.

        The run goes on with the window's other tables. Partitions written into their root's
        table (``partitions = "root"``) are copied as the root, ``tgt.owner``.
        """
        log.warning(
            "%s.%s cannot follow by changes alone (%s); on_unfollowable = \"resync\": copying it again",
            tgt.schema, tgt.table, refusal,
        )
        copied = copy_at_new_snapshot(self.into, self.src, {tgt.owner}, parallel=DEFAULT_PARALLEL)
        if not any(c.relation_oid == tgt.owner for c in copied):  # not published any more: nothing to copy it from
            raise refusal
        self._copied()
        if tgt.owner in self.log.filenodes and (nodes := filenodes_of(self.applied[tgt.owner].filenodes)) is not None:
            self.log.filenodes[tgt.owner] = nodes  # the copy's, read in its snapshot

    def _copied(self) -> None:
        """After a copy: the applied log read again, the column forms read again (the copy recorded its columns')."""
        self.applied.update(applied_lsns(self.into.lake, self.into.config.source.slot))
        self.forms.reset()


__all__ = ["CopyAgain"]
