"""The applied log: the Delta table under the lake root that says what the lake holds.

Every window a run applies appends one row per Delta table it wrote (``kind = 'window'``), after
all of the window's Delta commits and before the slot advances; a copy (bootstrap, resync) appends
``kind = 'bootstrap'`` rows, a backfill ``kind = 'backfill'`` rows. Reading it back (:func:`applied_lsns`) gives, per
relation OID, where the lake's table stands: the window's end, the Delta version it made, the key
it was merged on, its publication membership, partitions and column numbers as last logged. A
change at or before a table's applied LSN is not applied again: that is what makes a replayed
window harmless.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from pg2delta.lake.digests import Digest
from pg2delta.lake.engine import Engine, Lake, Txn
from pg2delta.lsn import format_lsn

LOG_TABLE = "_pg2delta/applied_log"

# Which run, slot, window and table a row of the applied log (and of the changelog's log) is about.
WINDOW_TABLE_FIELDS: list[tuple[str, pa.DataType]] = [
    ("run_id", pa.string()),
    ("slot", pa.string()),
    ("window_start", pa.int64()),
    ("window_end", pa.int64()),
    ("window_end_lsn", pa.string()),
    ("relation_oid", pa.int64()),
    ("schema_name", pa.string()),
    ("table_name", pa.string()),
]

LOG_SCHEMA = pa.schema(
    [
        *WINDOW_TABLE_FIELDS,
        ("delta_version", pa.int64()),
        ("inserts", pa.int64()),
        ("updates", pa.int64()),
        ("deletes", pa.int64()),
        ("truncated", pa.bool_()),
        ("applied_at", pa.timestamp("us", tz="UTC")),
        ("key_columns", pa.string()),  # JSON list of the columns the window merged on
        ("kind", pa.string()),  # KIND_WINDOW, KIND_BOOTSTRAP or KIND_BACKFILL (below)
        # Commit time of the newest transaction the window applied to the table (null for bootstrap
        # and backfill rows, and in lakes written before pg2delta recorded it): pg2delta status's lag
        # in time. Appended with mergeSchema, so an older applied log gains the column.
        ("commit_ts", pa.timestamp("us", tz="UTC")),
        # What put the table in the publication when the window was applied or the copy made
        # (catalog row OIDs; bootstrap._MEMBERSHIP), to notice a table removed from it and added back.
        ("publication", pa.string()),
        # A partitioned table's leaf partitions (OIDs) then, to notice one attached with rows.
        ("partitions", pa.string()),
        # JSON {column: pg_attribute.attnum} of the Delta table's columns, to tell a renamed column,
        # or one dropped and added again under its old name, from a new one.
        ("attnums", pa.string()),
        # JSON {leaf OID: pg_class.relfilenode} of a root published via itself, read after the
        # window's peek (or in a copy's snapshot), to notice a TRUNCATE of one partition, which
        # pgoutput does not send (source/rewrites.py). Appended with mergeSchema like commit_ts.
        ("filenodes", pa.string()),
    ]
)


@dataclass(frozen=True, slots=True)
class Applied:
    """Where a table's last logged window left it: the window's end and the Delta version it made."""

    end_lsn: int
    delta_version: int | None
    schema: str = ""  # the Delta table the relation's changes go to (kept across renames)
    table: str = ""
    key: tuple[str, ...] | None = None  # the columns it was last merged on (None: not logged)
    publication: str | None = None  # its publication membership as last logged (None: not logged)
    partitions: str | None = None  # a partitioned table's leaf partitions as last logged
    attnums: dict[str, int] | None = None  # its columns' attnums as last logged
    filenodes: str | None = None  # a root's leaves' relfilenodes as last logged (JSON; None: not logged)
    seen_attnums: frozenset[int] = frozenset()  # every attnum its logged windows numbered, columns dropped since too


@dataclass(frozen=True, slots=True)
class LoggedTable:
    """One Delta table a window wrote, as its applied-log row records it."""

    oid: int  # the relation OID the Delta table belongs to
    schema: str
    table: str
    delta_version: int | None
    inserts: int
    updates: int
    deletes: int
    truncated: bool
    commit_ts: int | None  # microseconds since 1970 (UTC) of the newest transaction applied
    key: tuple[str, ...] | None
    publication: str | None
    partitions: str | None
    attnums: str | None  # JSON {column: attnum}
    filenodes: str | None = None  # JSON {leaf OID: relfilenode} of a root published via itself


def utc_now() -> Any:
    """The current time as the log's ``applied_at`` holds it (microseconds, UTC)."""
    return pa.scalar(int(time.time() * 1_000_000), type=pa.int64()).cast(pa.timestamp("us", tz="UTC")).as_py()


def applied_lsns(lake: Lake, slot: str) -> dict[int, Applied]:
    """Per relation OID, the last window logged for its Delta table by ``slot``'s runs (see :func:`applied_of`)."""
    return applied_of(log_rows(lake), slot)


def log_rows(lake: Lake) -> list[dict[str, Any]]:
    """The rows of the applied log that decide what :func:`applied_of`,
    ``pg2delta.copy.copier.lake_state``, ``pg2delta.lake.foreign.last_logged_versions`` and
    ``pg2delta.versions.applied_through`` make of it (:func:`deciding_rows`), in the log's order:
    each gives the same as from every row. Read from its files with pyarrow (no engine: a run reads
    it before its engine has started); the log is only appended to and compacted, never deleted
    from, so the files its Delta log lists are its rows. A run asks several times (its plan, the
    copier, the foreign-commit watch): :meth:`Lake.made_of` reads and reduces only when the log's
    files changed."""
    return list(lake.made_of(lake.table_uri(LOG_TABLE), deciding_rows, DIGEST) or [])


def deciding_rows(table: pa.Table) -> list[dict[str, Any]]:
    """The rows of the applied log ``table`` its readers above decide by (:func:`deciding_at`), as
    dicts in the table's order."""
    at = deciding_at(table)
    if len(at) <= _SLICED_ROWS:  # a few rows of a long log: a take would copy its columns whole
        return [table.slice(int(i), 1).to_pylist()[0] for i in at]
    kept: list[dict[str, Any]] = table.take(pa.array(at, type=pa.int64())).to_pylist()
    return kept


def deciding_table(table: pa.Table) -> pa.Table:
    """The rows of the applied log ``table`` its readers decide by, as a table in its order: what a
    digest of one of its files keeps (:data:`DIGEST`)."""
    return table.take(pa.array(deciding_at(table), type=pa.int64()))


def deciding_at(table: pa.Table) -> Any:
    """Where (a numpy array of row numbers, ascending) the rows of the applied log ``table`` are
    that its readers above decide by. The log gains a row per window and table (about 105,000 a year for a table on a
    five-minute schedule); they read the newest rows, by ``window_end``, of a group with a given
    field set, so kept here are, all tied rows included:

    - per slot and relation: the newest rows, and the newest with each of ``key_columns``,
      ``publication``, ``partitions``, ``filenodes`` and ``attnums`` set; one row of each distinct
      ``attnums`` (:func:`applied_of` gathers every column number a relation had);
    - per slot and relation, and per slot alone, the newest ``bootstrap`` rows (``lake_state``);
    - per slot and Delta table (schema, table), the newest rows with a ``delta_version``;
    - per slot, the newest window rows and lake starts (``applied_through``).

    Each row is looked up in its group's maxima (one aggregation per grouping) rather than joined
    with them: a year's log took 0.10 s a run with joins, most of it theirs.

    Kept are the newest rows of groups, ties included, and each group's first: the rows kept of
    the rows kept of each part of the log, in its order, are the rows kept of it whole. So a run
    reads what :data:`DIGEST` kept of the log's big files (one compacted file holds most of a
    year) rather than the files."""
    import numpy as np
    import pyarrow.compute as pc

    if table.num_rows == 0 or "slot" not in table.column_names:
        return np.zeros(0, dtype=np.int64)
    n = table.num_rows

    def has(name: str, empty: bool = False) -> Any:  # set (and not "", unless ``empty``)
        if name not in table.column_names:
            return pa.array(np.zeros(n, dtype=bool))
        col = table.column(name)
        return pc.is_valid(col) if empty else pc.fill_null(pc.and_(pc.is_valid(col), pc.not_equal(col, "")), False)

    every = pa.array(np.ones(n, dtype=bool))
    slot, oid = pc.is_valid(table.column("slot")), pc.is_valid(table.column("relation_oid"))
    kind = table.column("kind") if "kind" in table.column_names else pa.nulls(n, pa.string())
    boot = pc.fill_null(pc.equal(kind, KIND_BOOTSTRAP), False)
    schema = pc.fill_null(table.column("schema_name"), "")
    # Per grouping, the fields whose newest rows count: a row is kept where its window_end is the
    # newest of its group among the rows with that field set.
    either = pc.or_(pc.and_(oid, pc.invert(boot)), pc.and_(pc.invert(oid), boot))  # applied_through's
    groupings: list[tuple[list[Any], Any, dict[str, Any]]] = [
        ([table.column("slot"), table.column("relation_oid")], pc.and_(slot, oid), {
            "all": every, "boot": boot,
            **{c: has(c) for c in ("key_columns", "publication", "partitions", "filenodes", "attnums")},
        }),
        ([table.column("slot"), schema, table.column("table_name")], pc.and_(slot, has("table_name")),
         {"version": has("delta_version", empty=True)}),
        ([table.column("slot")], slot, {"start": pc.and_(pc.invert(oid), boot), "through": either}),
    ]
    keep = np.zeros(n, dtype=bool)
    for keys, rows, fields in groupings:
        keep |= _newest_of_groups(table.column("window_end"), keys, rows, fields)
    if "attnums" in table.column_names:  # the first row of each (slot, relation, attnums)
        mask = pc.and_(pc.and_(slot, oid), has("attnums"))
        row = pc.if_else(mask, pa.array(np.arange(n, dtype=np.int64)), pa.scalar(None, pa.int64()))
        some = pa.table({"slot": table.column("slot"), "relation_oid": table.column("relation_oid"), "attnums": table.column("attnums"), "_row": row})
        firsts = some.group_by(["slot", "relation_oid", "attnums"]).aggregate([("_row", "min")]).column("_row_min")
        keep[np.asarray(firsts.drop_null().to_numpy(), dtype=np.int64)] = True
    return np.flatnonzero(keep)


# What a digest of one of the applied log's big files keeps (pg2delta.lake.digests): its rows
# deciding_at keeps. A new version of the name when deciding_at comes to keep rows it did not.
DIGEST = Digest("applied_log-1", deciding_table)

# Kept rows up to which deciding_rows reads them one slice each (about 0.1 ms a row) rather than
# with one take (5-25 ms on a year's log, whatever it takes).
_SLICED_ROWS = 200


def _newest_of_groups(end: Any, keys: Sequence[Any], rows: Any, fields: dict[str, Any]) -> Any:
    """Which rows (a numpy mask) are, among the ``rows`` of their group of the key columns ``keys``,
    the newest by ``end`` with one of the ``fields`` (name -> mask) set, ties included."""
    import numpy as np
    import pyarrow.compute as pc

    rows = pc.and_(rows, pc.is_valid(end))
    group = _group_key(keys)
    ends = {name: pc.if_else(pc.and_(rows, mask), end, pa.scalar(None, end.type)) for name, mask in fields.items()}
    newest = pa.table({"_group": group, **ends}).group_by("_group").aggregate([(name, "max") for name in fields])
    at = pc.index_in(group, value_set=newest.column("_group"))  # each row's group among the maxima
    hit = np.zeros(len(end), dtype=bool)
    for name in fields:
        this = pc.fill_null(pc.equal(ends[name], pc.take(newest.column(f"{name}_max"), at)), False)
        hit |= np.asarray(this.to_numpy(zero_copy_only=False), dtype=bool)
    return hit


def _group_key(columns: Sequence[Any]) -> Any:
    """One string per row naming its group of the key ``columns`` (null where one of them is):
    what :func:`deciding_rows` aggregates and looks rows up by."""
    import pyarrow.compute as pc

    parts = [pc.cast(c, pa.string()) for c in columns]
    joined = parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, "\x1f")
    return joined.combine_chunks() if isinstance(joined, pa.ChunkedArray) else joined


def newest(table: pa.Table, keys: list[str]) -> pa.Table:
    """The rows of ``table`` (with a ``window_end`` column) whose ``window_end`` is the newest of
    their group of ``keys``, ties included, with Arrow: the log is some 105,000 rows a table a year."""
    import pyarrow.compute as pc

    ends = table.select([*keys, "window_end"]).group_by(keys).aggregate([("window_end", "max")])
    both = table.join(ends, keys)
    return both.filter(pc.equal(both.column("window_end"), both.column("window_end_max"))).drop_columns(["window_end_max"])


def table_names(table: pa.Table) -> list[tuple[Any, Any]]:
    """The distinct (``schema_name``, ``table_name``) of the log rows ``table``."""
    named = table.select(["schema_name", "table_name"]).group_by(["schema_name", "table_name"]).aggregate([])
    return list(zip(named.column("schema_name").to_pylist(), named.column("table_name").to_pylist(), strict=True))


def applied_of(rows: Iterable[dict[str, Any]], slot: str) -> dict[int, Applied]:
    """Per relation OID, the last window logged for its Delta table, the version it made, and the
    key the table was last merged on (and its membership, partitions, attnums and relfilenodes as
    last logged)."""
    out: dict[int, Applied] = {}
    keys: dict[int, tuple[int, tuple[str, ...]]] = {}
    memberships: dict[int, tuple[int, str]] = {}
    leaves: dict[int, tuple[int, str]] = {}
    attnums: dict[int, tuple[int, str]] = {}
    filenodes: dict[int, tuple[int, str]] = {}
    seen: dict[int, set[int]] = {}
    for r in rows:
        if r.get("slot") != slot or r.get("relation_oid") is None:
            continue
        oid, end = int(r["relation_oid"]), int(r["window_end"])
        if oid not in out or end > out[oid].end_lsn:
            version = r.get("delta_version")
            out[oid] = Applied(
                end, None if version is None else int(version),
                str(r.get("schema_name") or ""), str(r.get("table_name") or ""),
            )
        key = r.get("key_columns")
        if key and (oid not in keys or end > keys[oid][0]):
            keys[oid] = (end, tuple(json.loads(key)))
        member = r.get("publication")
        if member and (oid not in memberships or end >= memberships[oid][0]):
            memberships[oid] = (end, str(member))
        parts = r.get("partitions")
        if parts and (oid not in leaves or end >= leaves[oid][0]):
            leaves[oid] = (end, str(parts))
        nodes = r.get("filenodes")
        if nodes and (oid not in filenodes or end >= filenodes[oid][0]):
            filenodes[oid] = (end, str(nodes))
        # The newest row's, null included (a backfill's rows, or rows of older pg2delta versions,
        # carry none): numbers from before a row that did not record them judge nothing.
        nums = r.get("attnums")
        if nums:
            seen.setdefault(oid, set()).update(int(v) for v in json.loads(nums).values())
        if oid not in attnums or end > attnums[oid][0] or (end == attnums[oid][0] and nums):
            attnums[oid] = (end, str(nums) if nums else "")
    for oid, (_, key_columns) in keys.items():
        out[oid] = dataclasses.replace(out[oid], key=key_columns)
    for oid, (_, member) in memberships.items():
        out[oid] = dataclasses.replace(out[oid], publication=member)
    for oid, (_, parts) in leaves.items():
        out[oid] = dataclasses.replace(out[oid], partitions=parts)
    for oid, (_, nodes) in filenodes.items():
        out[oid] = dataclasses.replace(out[oid], filenodes=nodes)
    for oid, (_, nums) in attnums.items():
        if nums:
            out[oid] = dataclasses.replace(out[oid], attnums={str(k): int(v) for k, v in json.loads(nums).items()})
    for oid, numbers in seen.items():
        out[oid] = dataclasses.replace(out[oid], seen_attnums=frozenset(numbers))
    return out


KIND_WINDOW = "window"  # a run's window
KIND_BOOTSTRAP = "bootstrap"  # a copy (bootstrap, resync): a table as of its snapshot, or the lake's start
KIND_BACKFILL = "backfill"  # a chunk of ``pg2delta backfill`` (rows of older versions carry none)


def log_row(slot: str, run_id: str, start: int, end: int, t: LoggedTable | None, *, kind: str) -> dict[str, Any]:
    """One applied-log row: the Delta table ``t`` stands at ``end`` (no table: the lake's start)."""
    return {
        "run_id": run_id,
        "slot": slot,
        "window_start": start,
        "window_end": end,
        "window_end_lsn": format_lsn(end),
        "relation_oid": t.oid if t else None,
        "schema_name": t.schema if t else None,
        "table_name": t.table if t else None,
        "delta_version": t.delta_version if t else None,
        "inserts": t.inserts if t else 0,
        "updates": t.updates if t else 0,
        "deletes": t.deletes if t else 0,
        "truncated": t.truncated if t else False,
        "applied_at": utc_now(),
        "key_columns": None if t is None or t.key is None else json.dumps(list(t.key)),
        "kind": kind,
        "commit_ts": t.commit_ts if t else None,
        "publication": t.publication if t else None,
        "partitions": t.partitions if t else None,
        "attnums": t.attnums if t else None,
        "filenodes": t.filenodes if t else None,
    }


def window_rows(slot: str, run_id: str, start: int, end: int, tables: Sequence[LoggedTable]) -> pa.Table:
    """The ``kind = 'window'`` rows of one window: one per Delta table it wrote."""
    return pa.Table.from_pylist([log_row(slot, run_id, start, end, t, kind=KIND_WINDOW) for t in tables],
                                schema=LOG_SCHEMA)


def append(engine: Engine, lake: Lake, rows: pa.Table | Sequence[dict[str, Any]], *, txn: Txn | None = None) -> None:
    """Append ``rows`` (a table in :data:`LOG_SCHEMA`, or dicts of its columns) to ``lake``'s
    applied log (without ``txn``, as :meth:`pg2delta.lake.engine.Engine.append_log_rows` appends a
    log's rows: by delta-rs on the embedded engine)."""
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows), schema=LOG_SCHEMA)
    if txn is None:
        engine.append_log_rows(lake.table_uri(LOG_TABLE), table)
    else:
        engine.append(lake.table_uri(LOG_TABLE), table, txn=txn)


def after_window(before: Applied | None, end: int, t: LoggedTable) -> Applied:
    """Where a table stands once the window logged as ``t`` is applied (what :func:`applied_lsns`
    would read back): the window's key, membership, partitions, attnums and relfilenodes, else the
    ones before."""
    key = t.key if t.key is not None else (before.key if before is not None else None)
    nums: dict[str, int] | None = json.loads(t.attnums) if t.attnums else None
    return Applied(
        end, t.delta_version, t.schema, t.table, key,
        publication=t.publication or (before.publication if before else None),
        partitions=t.partitions or (before.partitions if before else None),
        attnums=nums if nums is not None else (before.attnums if before else None),
        filenodes=t.filenodes or (before.filenodes if before else None),
        seen_attnums=(before.seen_attnums if before else frozenset()) | {int(v) for v in (nums or {}).values()},
    )


__all__ = [
    "DIGEST", "KIND_BACKFILL", "KIND_BOOTSTRAP", "KIND_WINDOW", "LOG_SCHEMA", "LOG_TABLE", "Applied", "LoggedTable",
    "after_window", "append", "applied_lsns", "applied_of", "log_row", "log_rows", "newest", "table_names", "utc_now",
    "window_rows",
]
