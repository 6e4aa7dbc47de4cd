"""Decide: how each Delta table must change for a window's changes, or why it cannot.

:class:`TablePlanner` takes a :class:`~pg2delta.apply.targets.Target` (the window's changes for one
Delta table) and where the applied log left that table, and returns the table's
:class:`~pg2delta.apply.schema.Plan` (columns added, widened, kept; the key; the values rows written
before an ``ADD COLUMN`` hold) or raises the refusal (:class:`SchemaError`, exit 78): a narrowing,
a TRUNCATE of some partitions of a root, a REPLICA IDENTITY FULL table whose key changed, a column
renamed or dropped and added again (told apart by ``pg_attribute.attnum``), a column added with
values PostgreSQL does not keep. Every table is planned before anything of the window is written.
Nothing here writes; the run and ``pg2delta plan`` share it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pg2delta.apply.added_columns import added_column_values
from pg2delta.apply.column_forms import ColumnForms
from pg2delta.apply.parallel import map_tables
from pg2delta.apply.renames import column_renames, renamed_types
from pg2delta.apply.rowmeta import check_row_columns
from pg2delta.apply.schema import Plan, plan
from pg2delta.apply.targets import Target, TargetResolver, live
from pg2delta.config import Config
from pg2delta.errors import SchemaError
from pg2delta.lake.applied_log import Applied
from pg2delta.lake.lake_files import Lake
from pg2delta.lsn import format_lsn
from pg2delta.source.catalog import PgTypeCatalog
from pg2delta.window.shapes import Shape, shape_of

log = logging.getLogger(__name__)


class DeltaShapes(Protocol):
    """The two reads of the engine that planning needs (:class:`pg2delta.lake.engine.Engine` has them)."""

    def table_types(self, uri: str, *, version: int | None = None) -> dict[str, str] | None: ...
    def has_rows(self, uri: str, *, version: int | None = None) -> bool: ...
    def renaming(self, uri: str, renames: Sequence[tuple[str, str]]) -> None: ...


class TablePlanner:
    """Plans each target of a window against its Delta table as the last logged window left it.

    ``config``: the tables' settings; ``lake``: where the Delta tables are; ``engine()``: the engine's
    two reads planning makes (called when first needed: the engine may still be starting).
    ``catalog`` / ``catalog_conn``: the source's catalog (None outside a run or a plan: no
    added-column or attnum checks). ``bootstrapped``: the lake was bootstrapped, tables without
    a copy are skipped. ``planned_types``: ``pg2delta plan``'s columns of each Delta table as the
    windows planned so far would leave them (None in a run: the lake's own). ``attnums``: per
    owner OID, the JSON of its Delta columns' attnums, recorded for the window's log row.
    """

    def __init__(
        self,
        config: Config,
        lake: Lake,
        engine: Callable[[], DeltaShapes],
        targets: TargetResolver,
        catalog: PgTypeCatalog | None,
        catalog_conn: Any,
        *,
        bootstrapped: bool = False,
        planned_types: dict[str, dict[str, str]] | None = None,
        attnums: dict[int, str] | None = None,
    ) -> None:
        self.config, self.lake, self.engine = config, lake, engine
        self.targets = targets
        self.catalog = catalog
        self.catalog_conn = catalog_conn
        self.bootstrapped = bootstrapped
        self.planned_types = planned_types
        self.attnums: dict[int, str] = {} if attnums is None else attnums
        self.forms = ColumnForms(lake)  # the form each Delta table's columns were landed in (hash, exclude)

    def plan_or_refusal(self, tgt: Target, applied: Applied | None, start: int, end: int) -> Plan | SchemaError | None:
        """:meth:`plan`, or the refusal itself for a table whose config says ``on_unfollowable = "resync"``."""
        try:
            return self.plan(tgt, applied, start, end)
        except SchemaError as exc:
            names = {(tgt.schema, tgt.table), *(tw.latest.qualified_name for tw in tgt.parts)}
            if any(self.config.table(*n).on_unfollowable == "resync" for n in names):
                return exc
            raise

    def plan_window(
        self, targets: Sequence[Target], applied: Mapping[int, Applied], start: int, end: int, *, workers: int
    ) -> tuple[dict[tuple[str, str], Plan | None], list[tuple[Target, SchemaError]]]:
        """Every table's shape for the window [``start``, ``end``), checked against its Delta table
        before anything is written, so a change the lake cannot follow stops the run with nothing of
        the window applied (reading each Delta table's schema costs a Spark job on a classic engine:
        up to ``workers`` at once). Returns the plans and, in ``targets``' order, the refusals of the
        tables set to ``on_unfollowable = "resync"`` (no plan: the run copies them again)."""
        planned = map_tables(workers, targets, lambda t: self.plan_or_refusal(t, applied.get(t.owner), start, end))
        pairs = list(zip(targets, planned, strict=True))
        plans = {(t.schema, t.table): (None if isinstance(p, SchemaError) else p) for t, p in pairs}
        return plans, [(t, p) for t, p in pairs if isinstance(p, SchemaError)]

    def _check_partition_truncates(self, tgt: Target, applied_lsn: int) -> None:
        """A TRUNCATE of some partitions of a root that maps them into one Delta table is refused:
        which of its rows were in those partitions is not known (a copy of the root, ``pg2delta
        resync``, is the way out: truncates before the table's applied LSN are the copy's).
        TRUNCATE of the root (every leaf) is fine."""
        if all(tw.oid == tgt.owner for tw in tgt.parts) or not any(tw.truncates for tw in tgt.parts):
            return
        leaves = {
            int(r[0])
            for r in self.catalog_conn.execute(
                "SELECT relid::oid::int8 FROM pg_partition_tree(%s::oid::regclass) WHERE isleaf", (tgt.owner,)
            ).fetchall()
        }
        for tw in tgt.parts:
            for t in tw.truncates:
                truncated = {v.oid for v in t.relations}
                if t.commit_lsn >= applied_lsn and not leaves <= truncated:
                    raise SchemaError(
                        f"TRUNCATE of partition(s) {', '.join('.'.join(v.qualified_name) for v in t.relations)} at "
                        f"{format_lsn(t.commit_lsn)}, whose changes go to the Delta table of {tgt.schema}.{tgt.table} "
                        "(partitions = \"root\"): pg2delta cannot tell which rows of that Delta table were in them; "
                        f"copy it again with pg2delta resync --table {self.targets.source_name(tgt)} (or set "
                        "on_unfollowable = \"resync\"), or use partitions = \"leaf\" for this table"
                    )

    def _check_full_identity_key(self, tgt: Target, key: tuple[str, ...], applied: Applied | None) -> None:
        """REPLICA IDENTITY FULL tables are keyed on the primary key the catalog has *now*; if that is
        not the key the lake was last merged on, the pending changes may predate the change of key."""
        if applied is None or applied.key is None or applied.key == key:
            return
        full = [tw for tw in tgt.parts if any(b.relation.relation.replica_identity == "f" for b in tw.batches)]
        configured = any(self.config.table(*tw.latest.qualified_name).key for tw in tgt.parts)
        if not full or configured:
            return
        name = ".".join(full[0].latest.qualified_name)
        raise SchemaError(
            f"table {name} has REPLICA IDENTITY FULL and its primary key is now ({', '.join(key) or 'none'}), but "
            f"the lake was last merged on ({', '.join(applied.key) or 'none'}): the changes waiting in the slot may "
            "have been made under the old key, and PostgreSQL does not say which. Set [tables.\""
            f"{name}\"] key = [...] to the key they were made under (the old one if the key changed after them, "
            "running up to the change with --until-lsn), run, then remove the setting; nothing of this window was applied"
        )

    def plan(self, tgt: Target, applied: Applied | None, start: int, end: int) -> Plan | None:
        """How the Delta table must change for the window's changes (None when it has none to merge)."""
        if applied is not None and applied.end_lsn >= end:
            return None
        self._check_partition_truncates(tgt, applied.end_lsn if applied is not None else 0)
        shapes: list[Shape] = []
        for batches in live(tgt, applied.end_lsn if applied is not None else 0):
            for b in batches:
                shape = shape_of(b.relation)
                if not shapes or shapes[-1].signature() != shape.signature():
                    shapes.append(shape)
        if not shapes:
            return None
        self._check_full_identity_key(tgt, shapes[0].key, applied)
        uri = self.lake.table_uri(tgt.schema, tgt.table)
        where = f" (in the changes from {format_lsn(start)} to {format_lsn(end)})"
        # The table as the last logged window left it: a replay after a crash plans the same
        # changes the crashed run did (they are idempotent), whatever of them it committed.
        planned = self.planned_types
        types = (planned[uri] if planned is not None and uri in planned
                 else self.engine().table_types(uri, version=applied.delta_version if applied else None))
        self.forms.check(tgt, types, source_name=self.targets.source_name(tgt))
        check_row_columns(self.config, tgt.schema, tgt.table, types, source_name=self.targets.source_name(tgt))
        renames = column_renames(self.config, tgt, types, applied.attnums if applied else None,
                                 self.catalog.attnums(tgt.owner) if self.catalog is not None and types else {},
                                 applied.end_lsn if applied else 0)
        if renames and types is not None:  # column mapping: renamed in place before the MERGE
            types = renamed_types(types, renames)
        if self.planned_types is None and types is not None:
            self.engine().renaming(uri, renames)  # unchanged TOAST of a renamed column: read under its old name
        pl = plan(
            f"{tgt.schema}.{tgt.table}",
            types,
            shapes,
            where=where,
            narrowing=self.config.table(tgt.schema, tgt.table).narrowing,
            pg_type=lambda shape, column: self._pg_type(tgt, shape, column),
        )
        if renames:
            pl = dataclasses.replace(pl, renamed=tuple(renames))
        self._check_column_identity(tgt, pl, applied, uri, where)
        return self._added_column_values(tgt, pl, applied, uri, where)

    def _check_column_identity(self, tgt: Target, pl: Plan, applied: Applied | None, uri: str, where: str) -> None:
        """Refuse columns pgoutput shows as new or unchanged that are neither (it names columns only by
        name, so a rename looks like a drop and an add, and a column dropped and added again under its
        old name looks unchanged); records the columns' ``attnum`` for the window's log row.

        ``pg_attribute.attnum`` tells them apart: ``ADD COLUMN`` takes a number above every column the
        table ever had, a rename keeps the number. Against the numbers logged with the table's last
        window, a column new to the Delta table whose number is not above them all was there before
        under another name (or outside the publication's column list): PostgreSQL holds values for
        the rows the lake has that it never sent. A Delta column whose name has a new number was
        dropped and added again: the lake's rows hold the old column's values. Either is refused
        (exit 78, or ``on_unfollowable = "resync"``). A column renamed before the run read the catalog,
        in the window that brings it to the lake, has no number under its name: :func:`_unnumbered`
        finds it. Tables written from several partitions, whose numbers differ, are not checked."""
        catalog = self.catalog
        if catalog is None or len(tgt.parts) != 1 or tgt.parts[0].oid != tgt.owner:
            return
        now = catalog.attnums(tgt.owner)
        before = applied.attnums if applied is not None else None
        lake_columns = set(pl.existing) | {n for n, _ in pl.columns}
        record = {n: now[n] for n in lake_columns if n in now}
        if before:  # columns gone from the table keep their number while the Delta table keeps them
            record.update({n: k for n, k in before.items() if n in lake_columns and n not in now})
        shapes = [b.relation.column_names for b in tgt.parts[0].batches]
        if any(n in lake_columns and n not in record for names in shapes for n in names):
            # A number an earlier window gave a column the lake has since dropped is that column's.
            seen = applied.seen_attnums if applied is not None else frozenset()
            record.update(_unnumbered(shapes, lake_columns, record, now, catalog.dropped_attnums(tgt.owner) - seen))
        self.attnums[tgt.owner] = json.dumps(record, sort_keys=True)
        if not before:
            return
        highest = max(before.values())
        source = self.targets.source_name(tgt)
        name = f"{tgt.schema}.{tgt.table}"
        for c, _ in pl.columns:
            if c not in now:
                continue
            if c not in pl.existing and now[c] <= highest and self._rows_before(tgt, pl, applied, uri, c):
                raise SchemaError(
                    f"column {c} of {source} is new to the lake but not to PostgreSQL (attnum {now[c]}: renamed "
                    f"from a column the lake has, or added to the publication's column list){where}: PostgreSQL "
                    f"holds values of it for rows it never sent again; copy the table again with pg2delta resync "
                    f"--table {name} (or set on_unfollowable = \"resync\"); nothing of this window was applied"
                )
            if c in pl.existing and c in before and before[c] != now[c]:
                raise SchemaError(
                    f"column {c} of {source} was dropped and added again since the lake's last window of it "
                    f"(attnum {before[c]} then, {now[c]} now){where}: the lake's rows hold the old column's values; "
                    f"copy the table again with pg2delta resync --table {name} (or set on_unfollowable = "
                    f"\"resync\"); nothing of this window was applied"
                )

    def _rows_before(self, tgt: Target, pl: Plan, applied: Applied | None, uri: str, column: str) -> bool:
        """Whether rows need a value of ``column`` that PostgreSQL did not send: rows of the Delta table
        as the last logged window left it, or rows of the window sent in a shape without it."""
        applied_lsn = applied.end_lsn if applied is not None else 0
        for tw in tgt.parts:
            for b in tw.batches:
                if column not in b.relation.column_names and b.num_rows and b.max_lsn >= applied_lsn:
                    return True
        return bool(pl.existing) and self.engine().has_rows(
            uri, version=applied.delta_version if applied is not None else None
        )

    def _added_column_values(self, tgt: Target, pl: Plan, applied: Applied | None, uri: str, where: str) -> Plan:
        """The plan with the values rows written before an ``ADD COLUMN`` hold
        (:func:`pg2delta.apply.added_columns.added_column_values`)."""
        catalog = self.catalog
        if catalog is None or (applied is None and self.bootstrapped):
            return pl  # not a run, or a table the run skips (not copied yet)
        return added_column_values(
            tgt, pl, applied, uri, where, catalog,
            has_rows=lambda uri, version: self.engine().has_rows(uri, version=version),
            source_name=self.targets.source_name,
        )

    def _pg_type(self, tgt: Target, shape: Shape, column: str) -> str | None:
        """The PostgreSQL type of ``column`` as a Relation message of ``tgt`` in ``shape`` declared it."""
        if self.catalog_conn is None:
            return None
        for tw in tgt.parts:
            for b in tw.batches:
                if shape_of(b.relation).signature() == shape.signature():
                    for c in b.relation.relation.columns:
                        if c.name == column:
                            row = self.catalog_conn.execute(
                                "SELECT format_type(%s::oid, %s)", (c.type_oid, c.type_modifier)
                            ).fetchone()
                            return None if row is None else str(row[0])
        return None

    # --- one table ----------------------------------------------------------------------------


def _unnumbered(
    shapes: Sequence[Sequence[str]], lake_columns: set[str], known: Mapping[str, int], now: Mapping[str, int],
    dropped: set[int],
) -> dict[str, int]:
    """Numbers of the window's columns PostgreSQL renamed or dropped after the window and before this
    run read its catalog, that no earlier window numbered: each shape of the window (a Relation
    message, in ``attnum`` order) places such a column after the columns before it; it is given the
    lowest number above theirs (and below the next known one) that is dropped now or held by a
    column the lake does not have, in the shape's order (``ADD COLUMN`` takes a number above every
    other, so a column added after the window has a higher one). Held by a column: the column was
    renamed to it, and that column, new to the lake in a later window, is a rename
    (:meth:`TablePlanner._check_column_identity`, :func:`pg2delta.apply.renames.column_renames`).
    A column added and dropped between the known ones and it, which no window showed, would
    shift it: it is placed as if there was none."""
    free = set(dropped) | {k for n, k in now.items() if n not in lake_columns}
    out: dict[str, int] = {}
    for names in shapes:
        prev = 0
        for i, name in enumerate(names):
            if name in known or name in out:
                prev = known.get(name, out.get(name, prev))
                continue
            if name not in lake_columns:
                continue
            after = min((known[n] for n in names[i + 1:] if n in known), default=None)
            slot = min((k for k in free if k > prev and (after is None or k < after)), default=None)
            if slot is not None:
                out[name] = prev = slot
                free.discard(slot)
    return out


__all__ = ["TablePlanner"]
