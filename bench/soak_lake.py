"""The soak's oracle (bench/soak.py): every table of the lake, read back with delta-rs, against the
same table in PostgreSQL, every row.

- A table with a key: a key PostgreSQL has and the lake has not is **lost**; a key the lake has
  and PostgreSQL has not, or holds twice, is **duplicated**; a key in both whose values differ is
  **different**.
- A table without a key (``pgbench_history``): the rows are compared as multisets, so a row applied
  twice is one more copy in the lake (**duplicated**) and a row never applied one copy less
  (**lost**); a row applied with other values counts once in each.
- Each changelog (``<lake>/_pg2delta/changelog/<schema>/<table>``): (``_pg2delta_lsn``,
  ``_pg2delta_pos``) is unique by design, so a change appended twice shows as a pair held twice.

Compared on PostgreSQL's columns by name (the lake keeps a dropped column until the table's next
window, and orders columns as they arrived); a column PostgreSQL has and the lake has not makes
every row of the table different.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
from deltalake import DeltaTable
from psycopg import sql

from lake_read import read_delta

META = "_pg2delta"


@dataclass
class Comparison:
    lost: int = 0
    duplicated: int = 0
    different: int = 0
    changelog_duplicated: int = 0
    rows: int = 0
    notes: list[str] = field(default_factory=list)  # the first few differences, for the log


def _pg_table(conn: psycopg.Connection[Any], qualified: str) -> tuple[list[str], list[str], list[tuple[Any, ...]]]:
    """(columns, key columns, rows) of a PostgreSQL table."""
    names = [str(r[0]) for r in conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
        (qualified,),
    ).fetchall()]
    key = [str(r[0]) for r in conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
        "WHERE i.indrelid = %s::regclass AND i.indisprimary ORDER BY array_position(i.indkey, a.attnum)",
        (qualified,),
    ).fetchall()]
    schema, table = qualified.split(".")
    rows = conn.execute(sql.SQL("SELECT {} FROM {}").format(
        sql.SQL(", ").join(map(sql.Identifier, names)), sql.Identifier(schema, table))).fetchall()
    return names, key, rows


def _lake_table(uri: str, names: list[str], options: dict[str, str]) -> tuple[list[tuple[Any, ...]], list[str]] | None:
    """The lake's rows on PostgreSQL's columns ``names`` (None where the lake lacks the column), and
    the columns it lacks; None when there is no Delta table."""
    if not DeltaTable.is_deltatable(uri, storage_options=options):
        return None
    table = read_delta(uri, storage_options=options)
    missing = [n for n in names if n not in table.column_names]
    cols = [table.column(n).to_pylist() if n in table.column_names else [None] * table.num_rows for n in names]
    return list(zip(*cols, strict=True)) if cols else [], missing


def _keyed(out: Comparison, where: str, idx: list[int], pg: list[tuple[Any, ...]], lake: list[tuple[Any, ...]]) -> None:
    ours = {tuple(r[i] for i in idx): r for r in pg}
    theirs: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for r in lake:
        k = tuple(r[i] for i in idx)
        if k in theirs:
            out.duplicated += 1
            out.notes.append(f"{where}: key {k} twice in the lake")
        theirs[k] = r
    for k, row in ours.items():
        if k not in theirs:
            out.lost += 1
            out.notes.append(f"{where}: key {k} missing from the lake")
        elif theirs[k] != row:
            out.different += 1
            out.notes.append(f"{where}: key {k} differs: PostgreSQL {str(row)[:200]} lake {str(theirs[k])[:200]}")
    extra = set(theirs) - set(ours)
    out.duplicated += len(extra)
    out.notes.extend(f"{where}: key {k} in the lake, not in PostgreSQL" for k in sorted(extra, key=repr)[:5])


def _keyless(out: Comparison, where: str, pg: list[tuple[Any, ...]], lake: list[tuple[Any, ...]]) -> None:
    ours, theirs = Counter(pg), Counter(lake)
    lost, extra = ours - theirs, theirs - ours
    out.lost += sum(lost.values())
    out.duplicated += sum(extra.values())
    if lost or extra:
        out.notes.append(f"{where}: {len(pg)} rows in PostgreSQL, {len(lake)} in the lake; "
                         f"{sum(lost.values())} missing, {sum(extra.values())} extra (e.g. {str(next(iter(extra or lost)))[:200]})")


def _changelog(out: Comparison, root: str, qualified: str, options: dict[str, str]) -> None:
    uri = f"{root}/{META}/changelog/{qualified.replace('.', '/')}"
    if not DeltaTable.is_deltatable(uri, storage_options=options):
        return
    t = read_delta(uri, columns=[f"{META}_lsn", f"{META}_pos"], storage_options=options)
    pairs = Counter(zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True))
    twice = sum(n - 1 for n in pairs.values() if n > 1)
    if twice:
        out.changelog_duplicated += twice
        out.notes.append(f"changelog of {qualified}: {twice} changes appended more than once")


def compare(dsn: str, root: str, tables: tuple[str, ...], options: dict[str, str]) -> Comparison:
    """Every table of ``tables`` in the lake at ``root`` against PostgreSQL at ``dsn``."""
    out = Comparison()
    with psycopg.connect(dsn) as conn:
        for qualified in tables:
            names, key, pg = _pg_table(conn, qualified)
            out.rows += len(pg)
            got = _lake_table(f"{root}/{qualified.replace('.', '/')}", names, options)
            if got is None:
                out.lost += len(pg)
                out.notes.append(f"{qualified}: no Delta table, {len(pg)} rows in PostgreSQL")
                continue
            lake, missing = got
            if missing:
                out.notes.append(f"{qualified}: the lake has no column {missing}")
            if key:
                _keyed(out, qualified, [names.index(k) for k in key], pg, lake)
            else:
                _keyless(out, qualified, pg, lake)
            _changelog(out, root, qualified, options)
    return out


__all__ = ["Comparison", "compare"]
