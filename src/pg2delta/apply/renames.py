"""Column renames a Delta table with column mapping follows in place.

pgoutput names columns only by name, so a ``RENAME COLUMN`` looks like a drop and an add;
``pg_attribute.attnum`` tells them apart (a rename keeps the number, see
:meth:`pg2delta.apply.tableplan.TablePlanner._check_column_identity`). Without column mapping the
lake cannot rename a column in place, and a rename is refused (exit 78, or copied again with
``on_unfollowable = "resync"``). A table configured with ``column_mapping = "name"`` (Apache
Spark) is renamed instead: ``ALTER TABLE ... RENAME COLUMN``, a commit that rewrites no file,
before the window's ``MERGE`` (:meth:`pg2delta.lake.engine_features.TableFeatures.rename_columns`).

Pure: names and numbers in, the renames out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pg2delta.apply.targets import Target, live
from pg2delta.config import Config


def column_renames(
    config: Config, tgt: Target, delta_types: Mapping[str, str] | None, before: Mapping[str, int] | None,
    now: Mapping[str, int], applied_lsn: int,
) -> list[tuple[str, str]]:
    """``(old, new)`` for each column of the Delta table (``delta_types``) that PostgreSQL renamed
    since the lake's last window of ``tgt`` (its attnums then, ``before``; now, ``now``), where
    the table maps columns by name and the lake can follow it: the table is written from its own
    relation (not partitions), on Apache Spark, and no change of the window still carries the old
    name (changes made before the rename, in the same window, are refused as before)."""
    if not delta_types or not before or len(tgt.parts) != 1 or tgt.parts[0].oid != tgt.owner:
        return []
    if config.engine.kind == "embedded" or not config.delta_features(tgt.schema, tgt.table).column_mapping:
        return []
    by_number = {num: name for name, num in now.items()}
    carried: set[str] = set()
    for batches in live(tgt, applied_lsn):
        for b in batches:
            carried.update(b.relation.column_names)
    out = []
    for old, num in before.items():
        new = by_number.get(num)
        if new is not None and new != old and old in delta_types and old not in now and new not in delta_types \
                and old not in carried:
            out.append((old, new))
    return out


def renamed_types(delta_types: Mapping[str, str], renames: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The Delta table's column types with the ``renames`` applied, in the table's order."""
    names = dict(renames)
    return {names.get(n, n): t for n, t in delta_types.items()}


__all__ = ["column_renames", "renamed_types"]
