"""A committed window logged, then the slot advanced past it: the durable-then-advance rule, in
the one place the slot moves (:meth:`WindowLog.log_and_advance`).

The window's entries in the applied log (:class:`pg2delta.lake.applied_log.LoggedTable`,
:meth:`WindowLog.entries`): one per table the window applied, and one without changes per root
whose leaves were rewritten without a TRUNCATE or detached and that the window did not change (so
that the next run need not decode the backlog again).

:class:`WindowLog` is handed what the entries record besides the window's own reports: the
publication's memberships and leaves, the leaves detached from a ``partitions = "root"`` root, the
Delta columns' attnums the plans read, and the run's applied log as it has it; and what it logs
and advances with: the lake and its engine, the changelog's writer, the run's slot. It keeps, from
window to window, the leaves' relfilenodes as last read and the roots to log again, which the
copies again tell it of (pg2delta.copy.again: pg2delta.apply.targets.rewritten_partitions, a copy
at a new snapshot).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pg2delta.apply.changelog import ChangelogWriter
from pg2delta.apply.commits import Committed
from pg2delta.apply.lakeside import LakeWriter
from pg2delta.apply.schema import Plan
from pg2delta.apply.table import TableReport
from pg2delta.apply.targets import PublicationState, Target
from pg2delta.faults import fault_point
from pg2delta.lake import applied_log
from pg2delta.lake.applied_log import Applied, LoggedTable, after_window, window_rows
from pg2delta.source.rewrites import filenodes_json
from pg2delta.source.slot import SlotSource


@dataclass
class WindowLog:
    """The log of each window of one run (:meth:`entries`) and the slot's advance past it (:meth:`log_and_advance`)."""

    publication: PublicationState
    detached: Mapping[int, tuple[int, int]]  # leaf -> (its root, where its DETACH committed): TargetResolver.detached
    attnums: Mapping[int, str]  # owner OID -> the JSON of its Delta columns' attnums (TablePlanner.attnums)
    applied: dict[int, Applied]  # the run's applied log, updated window by window (log_and_advance)
    to: LakeWriter  # the lake and its engine: the applied log's appends
    changelog: ChangelogWriter  # the changelog's log
    src: SlotSource  # the run's slot, advanced
    # Per root published via itself, its leaves' relfilenodes as last read after a peek (or as the
    # applied log has them; None: not recorded), to notice a partition truncated alone.
    filenodes: dict[int, dict[int, int] | None] = field(default_factory=dict)
    # Roots whose leaves were rewritten without a TRUNCATE (VACUUM FULL, CLUSTER), or detached, to be
    # logged with the next window even if it has no changes of them: else every run would decode the
    # backlog again.
    rewritten: set[int] = field(default_factory=set)

    def log_and_advance(
        self, run_id: str, targets: Sequence[Target], committed: Committed, plans: Mapping[tuple[str, str], Plan | None],
        start: int, end: int,
    ) -> None:
        """The durable-then-advance rule, in the one place the slot moves: called once every Delta
        commit of the window [``start``, ``end``) (changelog, histories, tables: ``committed``, of
        ``targets`` planned as ``plans``) has succeeded, it records them in the changelog's log and
        the applied log, and only then advances the slot to the window's end. A crash before the
        advance replays the window; the applied log makes that harmless."""
        logged = self.entries(targets, committed.tables, plans, end)
        if committed.changelog_log:
            self.changelog.log(self.to.engine, committed.changelog_log)
        if logged:
            rows = window_rows(self.src.slot, run_id, start, end, logged)
            # No idempotent-write id (Delta 3.3 would first rebuild the log's state: three Spark jobs); a replay
            # logs no table twice: one the log holds at the window's end is skipped (TableApplier.apply).
            applied_log.append(self.to.engine, self.to.lake, rows)
        fault_point("before_advance")
        if end > start:
            self.src.advance(end)
        for t in logged:
            self.applied[t.oid] = after_window(self.applied.get(t.oid), end, t)

    def entries(
        self, targets: Sequence[Target], reports: Sequence[TableReport], plans: Mapping[tuple[str, str], Plan | None], end: int
    ) -> list[LoggedTable]:
        """The entries of the window ending at ``end``: its tables' (``targets``, with their
        ``reports`` in the same order and their ``plans``) but the skipped ones, then the roots to
        log without changes."""
        logged = [
            self._logged(tgt, rep, plans[(tgt.schema, tgt.table)], end)
            for tgt, rep in zip(targets, reports, strict=True)
            if not rep.skipped
        ]
        self.rewritten.update(self._detached_roots(end))
        return logged + self._rewritten_roots({t.oid for t in logged}, end)

    def _leaves(self, owner: int, end: int) -> str | None:
        """The leaves the applied log records for ``owner`` after the window ending at ``end``: as
        the run read them at its start, and those detached (see
        :func:`pg2delta.apply.targets.detached_published`) past the window's end, whose changes up to
        their DETACH are still the root's."""
        leaves = self.publication.leaves.get(owner)
        pending = {str(leaf) for leaf, (root, at) in self.detached.items() if root == owner and at > end}
        if leaves is None or not pending:
            return leaves
        return ",".join(sorted({*leaves.split(","), *pending} - {""}, key=int))

    def _detached_roots(self, end: int) -> set[int]:
        """The roots whose leaves' DETACH the window ending at ``end`` passed while the applied log
        still records them as the root's: logged with the window even if it has no changes of them
        (:meth:`_rewritten_roots`), so that the next run need not decode the backlog again."""
        return {root for leaf, (root, at) in self.detached.items()
                if at <= end and (a := self.applied.get(root)) is not None and str(leaf) in (a.partitions or "").split(",")}

    def _rewritten_roots(self, logged: set[int], end: int) -> list[LoggedTable]:
        """Applied-log entries, without changes, of the roots whose leaves were rewritten without a
        TRUNCATE (:attr:`rewritten`, from :meth:`pg2delta.copy.again.CopyAgain.truncated_partitions`), or
        detached (:meth:`_detached_roots`), and that this window did not change: they record the
        relfilenodes read after its peek, which the next run compares with, and the leaves of now.
        The root stands at the window's end (it has nothing in the window) with its Delta version,
        key, membership, partitions and attnums as before."""
        out = []
        for root in sorted(self.rewritten - logged):
            a = self.applied.get(root)
            if a is None or not a.table or a.end_lsn >= end:  # a copy past this window logged it already
                continue
            out.append(LoggedTable(
                root, a.schema, a.table, a.delta_version, 0, 0, 0, False, None, a.key,
                self.publication.memberships.get(root), self._leaves(root, end),
                json.dumps(a.attnums) if a.attnums else None, filenodes_json(self.filenodes.get(root)),
            ))
        self.rewritten.clear()
        return out

    def _logged(self, tgt: Target, rep: TableReport, pl: Plan | None, end: int) -> LoggedTable:
        """The applied-log entry of a table the window applied."""
        return LoggedTable(
            tgt.owner, rep.schema, rep.table, rep.delta_version, rep.inserts, rep.updates, rep.deletes,
            rep.truncated, rep.commit_ts, pl.key if pl is not None else None,
            self.publication.memberships.get(tgt.owner), self._leaves(tgt.owner, end),
            self.attnums.get(tgt.owner), filenodes_json(self.filenodes.get(tgt.owner)),
        )


__all__ = ["WindowLog"]
