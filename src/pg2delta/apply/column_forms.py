"""The form each Delta table's columns were landed in (``[tables."s.t"] hash`` and ``exclude``),
checked before a window writes: a table landed in another form (other settings, another hash key)
is refused, so that no table holds raw and hashed values mixed. The records themselves are
:mod:`pg2delta.lake.column_records`'; this reads them once per run and says which tables a window
creates (their record is written before the window is applied). Nothing here writes.
"""

from __future__ import annotations

import threading

from pg2delta.apply.targets import Target
from pg2delta.errors import SchemaError
from pg2delta.lake.column_records import Record, describe, read_records
from pg2delta.lake.lake_files import Lake


class ColumnForms:
    """The lake's column records, read on first use, and those due for the tables a window creates."""

    def __init__(self, lake: Lake) -> None:
        self.lake = lake
        self._records: dict[tuple[str, str], Record] | None = None
        self._lock = threading.Lock()  # tables are planned concurrently
        self.due: dict[tuple[str, str], Record | None] = {}

    def records(self) -> dict[tuple[str, str], Record]:
        with self._lock:
            if self._records is None:
                self._records = read_records(self.lake)
            return self._records

    def reset(self) -> None:
        """Read the records again when next needed (a copy wrote one)."""
        with self._lock:
            self._records = None

    def check(self, tgt: Target, *, exists: bool, source_name: str) -> None:
        """Refuse (exit 78, or a resync with ``on_unfollowable = "resync"``) a window whose columns
        would land in another form than the Delta table's; a table the window creates gets its
        record due."""
        versions = [b.relation for tw in tgt.parts for b in tw.batches]
        governance = versions[-1].governance if versions else None
        expected = governance.rules.record() if governance is not None else None
        name = (tgt.schema, tgt.table)
        found = self.records().get(name)
        if not exists:
            if expected is not None or found is not None:
                with self._lock:
                    self.due[name] = expected
            return
        if found != expected:
            raise SchemaError(
                f"{tgt.schema}.{tgt.table} was landed with {describe(found)}, and the config now says {describe(expected)}: "
                f"a run would mix both forms in it; copy it again in the new form with pg2delta resync --table {source_name} "
                "(or set on_unfollowable = \"resync\"); its changelog and history keep their rows in the old form (docs: "
                "Column governance). Nothing of this window was applied"
            )

    def take_due(self) -> list[tuple[tuple[str, str], Record | None]]:
        """The records of the tables the window creates (for the run to write before it applies the
        window), taken as the lake's from now on."""
        records = self.records()
        with self._lock:
            due = sorted(self.due.items())
            self.due.clear()
            for name, record in due:
                if record is None:
                    records.pop(name, None)
                else:
                    records[name] = record
        return due


__all__ = ["ColumnForms"]
