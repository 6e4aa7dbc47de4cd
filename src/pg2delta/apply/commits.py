"""Apply: a planned window's commits, in the order a crash anywhere among them can replay.

:class:`WindowCommits` takes the window's tables (:class:`~pg2delta.apply.targets.Target`, planned
by pg2delta.apply.tableplan) and makes every Delta commit of the window: the column records of the
tables it creates, the changelog, the SCD2 histories, then one MERGE per table
(:class:`~pg2delta.apply.table.TableApplier`), with a fault point between each. It is handed what
it writes with (the lake and its engine, the changelog and the tables' applier), not the run, and
returns what was committed (:class:`Committed`). Nothing here logs a window or moves the slot:
pg2delta.apply.window_log does, once every commit here has succeeded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pg2delta.apply.changelog import ChangelogWriter
from pg2delta.apply.column_forms import ColumnForms
from pg2delta.apply.lakeside import LakeWriter
from pg2delta.apply.parallel import apply_tables, map_tables
from pg2delta.apply.schema import Plan
from pg2delta.apply.table import TableApplier, TableReport
from pg2delta.apply.targets import Target
from pg2delta.faults import fault_point
from pg2delta.lake.applied_log import Applied
from pg2delta.lake.column_records import write_record
from pg2delta.window.read import TableWindow


@dataclass(frozen=True)
class Committed:
    """What a window committed: the changelog's log rows (for pg2delta.apply.changelog's log) and,
    per table in the targets' order, its report."""

    changelog_log: list[dict[str, Any]]
    tables: list[TableReport]


@dataclass(frozen=True)
class WindowCommits:
    """The commits of each window of a run. ``workers``: ``window.parallel_tables``; ``forms``: the
    planner's column forms (the records of the tables a window creates)."""

    to: LakeWriter
    changelog: ChangelogWriter
    applier: TableApplier
    forms: ColumnForms
    workers: int

    def commit(
        self, run_id: str, relations: Mapping[int, TableWindow], targets: Sequence[Target],
        plans: Mapping[tuple[str, str], Plan | None], applied: Mapping[int, Applied], start: int, end: int,
    ) -> Committed:
        """Every commit of the window [``start``, ``end``): ``relations`` are its decoded changes per
        relation OID, ``targets`` its Delta tables in commit order, planned as ``plans``;
        ``applied``: where the applied log left each table."""
        for (schema, table), record in self.forms.take_due():  # tables the window creates
            write_record(self.to.lake, schema, table, record)
        # The changelog next: a crash before the tables' MERGEs replays the window, and the
        # changelog takes only rows past its end (changelog.py).
        ordered = sorted(relations.values(), key=lambda t: t.latest.qualified_name)
        with_log = [(tw.latest, tw.batches, tw.truncates) for tw in ordered if self.changelog.enabled(tw.latest)]
        changelog_log = self.changelog.append(self.to.engine, run_id, start, end, with_log) if with_log else []  # no engine else
        fault_point("after_changelog")
        # The history next, before the tables' MERGEs: a replay takes only changes past its end (history.py).
        kept = [t for t in targets if self.applier.histories.enabled(t.schema, t.table)]
        map_tables(self.workers, kept, lambda t: self.applier.history(run_id, t, plans[(t.schema, t.table)], applied.get(t.owner), end))
        fault_point("after_history")
        reports = apply_tables(
            self.workers, targets,
            lambda t: self.applier.apply(run_id, t, plans[(t.schema, t.table)], applied.get(t.owner), end),
        )
        fault_point("after_commits")
        return Committed(changelog_log, reports)


__all__ = ["Committed", "WindowCommits"]
