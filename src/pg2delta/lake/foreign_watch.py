"""A run's watch over another writer's commits, window by window (pg2delta.lake.foreign).

Before a window writes its tables, :meth:`ForeignWatch.look` stops the run (exit 21) when one of
them has commits another writer made since pg2delta's last one, or had before; after the window's
commits, :meth:`ForeignWatch.landed` stops it when such a commit landed under them. ``on_foreign =
"remember"`` (verify's run) records what it finds instead, so that the runs after still refuse.
The watch is handed the lake, the slot and what to do; the run hands it each window's tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pg2delta.lake.applied_log import Applied, log_rows
from pg2delta.lake.foreign import (
    Damaged,
    ForeignCommit,
    damaged_tables,
    landed_between,
    last_logged_versions,
    refuse,
    remember,
    remembered,
    with_known,
)
from pg2delta.lake.lake_files import Lake


@dataclass(frozen=True, slots=True)
class Written:
    """A Delta table a window committed to: its name, its path and its version after the commit."""

    schema: str
    table: str
    path: str
    delta_version: int | None


@dataclass
class ForeignWatch:
    """The commits of other writers on the tables of one run's windows: refused (``on_foreign =
    "refuse"``) or remembered (``"remember"``, verify's run)."""

    lake: Lake
    slot: str
    on_foreign: str = "refuse"
    # Per Delta table (schema, table), the newest version the applied log records: commits after it
    # are looked at before the table is written (read once per run).
    logged: dict[tuple[str, str], int] | None = None
    damaged: dict[tuple[str, str], Damaged] | None = None  # remembered from before (foreign.remember)
    # Per Delta table the window writes, its latest version when the window looked at it (None: no
    # table yet), and the version the applied log records: what its commits are compared with.
    checked: dict[tuple[str, str], tuple[int | None, int | None]] = field(default_factory=dict)

    def look(self, tables: Mapping[tuple[str, str], Applied | None]) -> None:
        """Stop (exit 21) before anything of the window is written when a table it writes
        (``tables``: (schema, table) -> the applied log's entry, as the run has it, of the relation
        it is written from) has commits another writer made since pg2delta's last one, or had
        before: merging over them would bury the damage under pg2delta's own commits. ``on_foreign
        = "remember"`` (verify) records them instead, so that the runs after still refuse."""
        self.lake.commits_read.clear()  # the window's first look reads the logs afresh; its later looks share its reads
        if self.logged is None or self.damaged is None:  # once per run
            self.logged = last_logged_versions(log_rows(self.lake), self.slot)
            self.damaged = remembered(self.lake, self.slot)
        versions: dict[tuple[str, str], int | None] = {}
        latest: dict[tuple[str, str], int | None] = {}
        for name, a in tables.items():
            # The entry's version counts where it is of this Delta table (a relation's entry can name another).
            applied = a.delta_version if a is not None and (a.schema, a.table) == name else None
            known = [v for v in (self.logged.get(name), applied) if v is not None]
            versions[name] = max(known, default=None)
            latest[name] = self.lake.delta_version(self.lake.table_uri(*name))
        self.checked = {k: (latest[k], versions[k]) for k in versions}
        found = damaged_tables(self.lake, versions, self.damaged, latest=latest)
        if self.on_foreign == "refuse":
            refuse(found)
        else:  # and a commit that meets another writer's to one of these tables is made again over it
            self.lake.remember_foreign = self._remember_landed
        self._remember(found)

    def landed(self, written: Iterable[Written]) -> None:
        """After the window's commits, before they are logged: stop (exit 21) when another writer's
        commit that changes rows landed on a table between the window's look at it (:meth:`look`)
        and the version read after pg2delta's commit (Apache Spark's Delta commits a ``MERGE`` on
        top of a blind append by itself; a commit before the ``MERGE`` began is no conflict at all).
        The window's commits are over it already, which would hide it from the next look: it is
        remembered first (pg2delta.lake.foreign.remember), so the runs after refuse too until a
        resync, ``status`` flags it and ``verify`` names it. Usually the one new version is the
        window's own commit, one small read; the commits a failed commit met were read then
        (pg2delta.lake.conflicts) and are not read again (pg2delta.lake.foreign.read_commit)."""
        found = []
        for w in written:
            key = (w.schema, w.table)
            if key not in self.checked:
                continue
            seen, logged = self.checked[key]
            commits = landed_between(self.lake, w.path, seen, w.delta_version)
            if commits:
                found.append(Damaged(w.schema, w.table, logged, with_known(commits, (self.damaged or {}).get(key))))
        if not found:
            return
        self._remember(found)
        if self.on_foreign == "refuse":
            refuse(found, during=True)

    def _remember_landed(self, uri: str, commits: Sequence[ForeignCommit]) -> bool:
        """``on_foreign = "remember"`` (pg2delta.lake.lake_files.Lake.remember_foreign): another
        writer's ``commits`` that change rows landed on the Delta table at ``uri`` while the window
        committed to it. Remembered, as :meth:`look` remembers what it finds, when the table is one
        the window writes (True: the commit is made again over them, pg2delta.lake.conflicts); False
        for the others (a changelog, a history, the applied log: the run stops with exit 21)."""
        for (schema, table), (_, logged) in self.checked.items():
            if self.lake.table_uri(schema, table) == uri:
                known = (self.damaged or {}).get((schema, table))
                self._remember([Damaged(schema, table, logged, with_known(commits, known))])
                return True
        return False

    def _remember(self, found: Sequence[Damaged]) -> None:
        """Keep ``found`` (pg2delta.lake.foreign.remember) where it is news."""
        assert self.damaged is not None
        fresh = [d for d in found if (k := self.damaged.get((d.schema, d.table))) is None or k.commits != d.commits]
        remember(self.lake, self.slot, fresh)
        self.damaged.update(((d.schema, d.table), d) for d in fresh)


__all__ = ["ForeignWatch", "Written"]
