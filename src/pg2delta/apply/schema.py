"""Schema evolution: how a Delta table follows the shapes its source table takes.

Pure: Arrow types, names and change batches in, plans, cut points and conformed tables (or a
:class:`SchemaError`) out; no database, no Spark.

PostgreSQL sends a new Relation message whenever a table's shape changes. The job compares
every shape a window holds for a Delta table with the columns the Delta table already has
(as Spark type names, the form both Spark and pysail report) and gets back a :class:`Plan`:

* columns no shape had before are **added** (nullable; earlier rows hold NULL);
* columns the Delta table has and a shape lacks (dropped, or the old name of a renamed
  column) are **kept**: they are left alone by updates and NULL in new rows;
* a column whose type changed to one Delta can hold every old value of (int2 -> int4 ->
  int8, float4 -> float8, int -> float8, int -> decimal wide enough, decimal precision and
  scale growing together) is **widened**;
* any other change (a narrowing, or a type of another kind) is refused with a
  :class:`SchemaError` naming the table, the column, both types and what to do, before
  anything of the window is applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from pg2delta.decode.changes import (
    LSN_COL,
    META_NAMES,
    OP_COL,
    POS_COL,
    TOAST_COL,
    BatchLike,
)
from pg2delta.errors import SchemaError
from pg2delta.lake.types import arrow_type, spark_type, widens
from pg2delta.window.shapes import Shape

META_PREFIX = "_pg2delta_"  # pg2delta's own columns (changes.META_FIELDS, the keyless position columns)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one window needs done to a Delta table before its changes can be merged."""

    columns: tuple[tuple[str, pa.DataType], ...]  # every column the window's changes carry, in order, final types
    added: tuple[str, ...]  # not yet in the Delta table
    widened: tuple[tuple[str, str, str], ...]  # (column, Delta type now, wider type)
    kept: tuple[str, ...]  # in the Delta table, in no shape of the window: left alone
    key: tuple[str, ...]
    existing: frozenset[str] = frozenset()  # the Delta table's columns before the window
    # Added columns whose value in rows written before the ADD COLUMN is known (PostgreSQL's
    # attmissingval, as an Arrow scalar of the column's type in ``columns``): rows of the window sent
    # before the column appeared hold it (see conform), and with ``fill_table`` every row already in
    # the Delta table is set to it before the window's changes are merged.
    fills: tuple[tuple[str, pa.Scalar], ...] = ()
    fill_table: bool = False
    # Columns renamed in PostgreSQL that the Delta table (column mapping by name) renames in place
    # before the window's changes are merged: (old, new); ``existing`` has the new names.
    renamed: tuple[tuple[str, str], ...] = ()


def plan(
    table: str,
    delta_types: Mapping[str, str] | None,
    shapes: Sequence[Shape],
    *,
    where: str = "",
    narrowing: str = "refuse",
    pg_type: Callable[[Shape, str], str | None] | None = None,
) -> Plan:
    """The evolution of the Delta table of ``table`` (its columns ``delta_types``, None if there is
    none yet) that lets it hold changes of every shape in ``shapes`` (in the order they came).

    ``pg_type(shape, column)`` names the PostgreSQL type of a column for messages.
    ``narrowing = "keep"`` lets a column whose type became narrower keep its wider Delta type
    (every new value fits); by default a narrowing is refused like any other change Delta cannot
    follow. Raises :class:`SchemaError` for a type change Delta cannot follow, or for shapes with
    different keys (the job cuts windows at key changes; only changes inside one transaction
    can still meet here).
    """
    if not shapes:
        raise ValueError("plan needs at least one shape")
    current: dict[str, str] = dict(delta_types or {})
    arrow: dict[str, pa.DataType] = {}
    order: list[str] = []
    keys = {s.key for s in shapes}
    if len(keys) > 1:
        a, b = shapes[0].key, shapes[-1].key
        raise SchemaError(
            f"table {table} changed its key from ({', '.join(a) or 'none'}) to ({', '.join(b) or 'none'}) "
            f"inside one transaction that also changed its rows{where}; pg2delta cannot tell which rows each key "
            f"identifies: copy the table again with pg2delta resync --table {table} (the changes before the "
            "copy are then skipped)"
        )
    for shape in shapes:
        for name, t in shape.columns:
            new = spark_type(t)
            old = current.get(name)
            pg = pg_type(shape, name) if pg_type is not None and old not in (None, new) else None
            shown = f"{new} (PostgreSQL {pg})" if pg else new
            if name not in arrow:
                order.append(name)
            if old is None or widens(old, new):
                current[name] = new
                arrow[name] = t
            elif widens(new, old) and narrowing == "keep" and (wide := arrow_type(old)) is not None:
                arrow[name] = wide
            else:
                raise _type_change_refused(table, name, old, new, shown, where)
    before = dict(delta_types or {})
    added = tuple(n for n in order if n not in before)
    widened = tuple((n, before[n], current[n]) for n in order if n in before and before[n] != current[n])
    kept = tuple(n for n in before if n not in arrow and not n.startswith(META_PREFIX))
    return Plan(tuple((n, arrow[n]) for n in order), added, widened, kept, shapes[0].key, frozenset(before))


def _type_change_refused(table: str, name: str, old: str, new: str, shown: str, where: str) -> SchemaError:
    """The refusal of column ``name`` changing type from ``old`` to ``new`` (``shown``: with its PostgreSQL type)."""
    if widens(new, old):
        return SchemaError(
            f"table {table} column {name} changed type from {old} to {shown}{where}, a narrowing "
            f"that pg2delta does not apply to the lake: to keep the Delta column {old} and store the "
            f"narrower values in it, set [tables.\"{table}\"] narrowing = \"keep\" in the config; or copy the "
            f"table again with pg2delta resync --table {table}; nothing of this window was applied"
        )
    return SchemaError(
        f"table {table} column {name} changed type from {old} to {shown}{where}, which Delta cannot "
        f"follow in place: copy the table again with pg2delta resync --table {table} (the lake then holds "
        f"the new type), or, before the next such change, add a new column of type {new} instead of "
        "changing this one; nothing of this window was applied"
    )


def conform(parts: Sequence[Sequence[BatchLike]], pl: Plan) -> tuple[pa.Table | None, set[str]]:
    """A window's changes of one Delta table as one table with the plan's columns and types, in commit
    order; ``parts`` holds the batches of each relation writing to it (several: partitions to a root).

    Rows sent in a shape without a column the Delta table (or an earlier shape in the window)
    has: inserts hold NULL there, updates keep the value (marked like unchanged TOAST). Rows sent
    before a column of ``pl.fills`` appeared (a shape from before its ADD COLUMN) hold its value.
    """
    marked_columns: set[str] = set()
    tables = list(conform_batches(parts, pl, marked_columns))
    if not tables:
        return None, marked_columns
    changes = pa.concat_tables(tables)
    if len(parts) > 1:
        changes = changes.sort_by([(LSN_COL, "ascending"), (POS_COL, "ascending")])
    return changes, marked_columns


def conform_batches(
    parts: Sequence[Sequence[BatchLike]], pl: Plan, marked_columns: set[str]
) -> Iterator[pa.Table]:
    """:func:`conform` batch by batch (each part's in commit order, parts one after the other), for
    windows too large to hold at once; the columns kept by updates are added to ``marked_columns``."""
    schema = pa.schema([*(pa.field(n, t) for n, t in pl.columns)])
    fills = dict(pl.fills)
    for batches in parts:
        seen = set(pl.existing)
        appeared: set[str] = set()  # columns some batch of this relation has had so far
        for b in batches:
            t = pa.Table.from_batches([b.load()])
            names = set(t.column_names)
            cols = []
            before_add = {n for n in fills if n not in names and n not in appeared}
            for f in schema:
                if f.name in names:
                    col = t.column(f.name)
                    cols.append(col if col.type == f.type else col.cast(f.type))
                elif f.name in before_add:
                    cols.append(pa.repeat(fills[f.name].cast(f.type), t.num_rows))
                else:
                    cols.append(pa.nulls(t.num_rows, f.type))
            keep = [n for n, _ in pl.columns if n not in names and n in seen and n not in before_add]
            meta = [t.column(m) for m in t.column_names if m in META_NAMES]
            out = pa.Table.from_arrays([*cols, *meta], names=[*schema.names, *(m for m in t.column_names if m in META_NAMES)])
            if keep:
                marked_columns.update(keep)
                ops = out.column(OP_COL).to_pylist()
                toast = out.column(TOAST_COL).to_pylist()
                marked = [[*(old or []), *keep] if op == "U" else old for op, old in zip(ops, toast, strict=True)]
                out = out.set_column(
                    out.column_names.index(TOAST_COL), TOAST_COL, pa.array(marked, type=out.schema.field(TOAST_COL).type)
                )
            seen |= names
            appeared |= names
            yield out
