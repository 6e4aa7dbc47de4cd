"""The form each Delta table's columns were landed in (``[tables."s.t"] hash`` and ``exclude``),
checked before a window writes: a table landed in another form (other settings, another hash key)
is refused, so that no table holds raw and hashed values mixed. The records themselves are
:mod:`pg2delta.lake.column_records`'; this reads them once per run and says which tables a window
creates (their record is written before the window is applied). Nothing here writes.
"""

from __future__ import annotations

import threading
from collections.abc import Collection

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

    def check(self, tgt: Target, lake_columns: Collection[str] | None, *, source_name: str) -> None:
        """Refuse (exit 78, or a resync with ``on_unfollowable = "resync"``) a window that would land
        a column the Delta table has (``lake_columns``; None: no table yet) in another form than the
        table holds it; the record of a table the window creates or whose record changes (a new
        column hashed, say) becomes due."""
        versions = [b.relation for tw in tgt.parts for b in tw.batches]
        if not versions:
            return
        governance = versions[-1].governance
        expected = governance.rules.record() if governance is not None else None
        name = (tgt.schema, tgt.table)
        found = self.records().get(name)
        if lake_columns is not None:
            conflicts = _conflicts(found or {}, expected or {}, set(lake_columns), set(versions[-1].column_names))
            if conflicts:
                raise SchemaError(
                    f"{tgt.schema}.{tgt.table} would mix forms: {'; '.join(conflicts)} (the lake: {describe(found)}; the "
                    f"config: {describe(expected)}); copy it again in the new form with pg2delta resync --table {source_name} "
                    "(or set on_unfollowable = \"resync\"); its changelog and history keep their rows in the old form "
                    "(docs: Hashed and excluded columns). Nothing of this window was applied"
                )
        if expected != found:
            with self._lock:
                self.due[name] = expected

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


def _conflicts(found: Record, expected: Record, lake: set[str], published: set[str]) -> list[str]:
    """How landing as ``expected`` says would differ from what the lake holds as ``found`` says:
    a column of the lake hashed then and not now (or the reverse), excluded now, excluded then but
    published now, or hashed under another key."""
    fh, fe = set(found.get("hash") or ()), set(found.get("exclude") or ())
    eh, ee = set(expected.get("hash") or ()), set(expected.get("exclude") or ())
    out = []
    for c in sorted(lake):
        if c in ee:
            out.append(f"{c}: in the lake, excluded now")
        elif (c in fh) != (c in eh):
            out.append(f"{c}: {'hashed' if c in fh else 'in clear'} in the lake, {'hashed' if c in eh else 'in clear'} now")
    out += [f"{c}: excluded from the lake, landed now" for c in sorted((fe - ee) & published)]
    if found.get("key") and expected.get("key") and found["key"] != expected["key"] and fh & eh & lake:
        out.append(f"another hash key (fingerprint {found['key']} in the lake, {expected['key']} now)")
    return out


__all__ = ["ColumnForms"]
