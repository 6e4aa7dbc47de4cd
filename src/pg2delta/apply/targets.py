"""Targets: which Delta table each relation's changes of a window go to, and whether the lake
can still follow the publication's tables by changes alone.

:class:`TargetResolver` groups a window's relations (:class:`~pg2delta.window.read.TableWindow`) by
their Delta table (:class:`Target`): named after the relation the first time and kept for its
OID (renames keep their table), partitions of a ``partitions = "root"`` table into the root's.
:func:`publication_state` reads what holds each published table in the publication (and a
partitioned table's leaves) at a run's start, and :func:`added_back_tables` compares it with the
applied log: a table removed from the publication and added back, a partition attached with rows
in it, or one detached, cannot be followed by changes; those are copied again
(``on_unfollowable = "resync"``) or refused. :func:`truncated_partitions` does the same for a
leaf truncated alone under a root published via itself, where a leaf's relfilenode changed
(:func:`rewritten_partitions`). The run and ``pg2delta plan`` both call these.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pg2delta.config import Config
from pg2delta.errors import SchemaError
from pg2delta.lake.applied_log import LOG_TABLE, Applied
from pg2delta.lake.engine import Lake
from pg2delta.source.detaches import detach_positions
from pg2delta.source.publication import (
    partition_leaves,
    publication_memberships,
    relation_name,
    rows_before_attach,
)
from pg2delta.source.rewrites import (
    DecodeUnavailable,
    Truncated,
    filenodes_of,
    fresh_leaves,
    leaf_filenodes,
    rewritten_leaves,
    truncated_alone,
)
from pg2delta.source.slot import SlotSource
from pg2delta.window.read import TableWindow
from pg2delta.window.spill import Batch

log = logging.getLogger(__name__)


@dataclass
class Target:
    """The changes one window holds for one Delta table: of one relation, or of several partitions."""

    owner: int  # the relation OID the applied log records for this Delta table
    schema: str
    table: str
    parts: list[TableWindow] = field(default_factory=list)




def live(tgt: Target, lsn: int) -> list[list[Batch]]:
    """The batches of each part of ``tgt`` that hold changes at or after the table's applied LSN.

    Normally all of them (a window starts where the last applied one ended); after a resync the
    table is applied through the copy's snapshot, and changes before it, in whatever shape they
    were made, are not the lake's concern any more.
    """
    return [
        [b for b in tw.batches if b.num_rows and b.max_lsn >= lsn]
        for tw in tgt.parts
    ]



@dataclass(frozen=True)
class PublicationState:
    """What holds each published table in the publication at a run's start (catalog row OIDs,
    per table OID), and the leaf partitions of each partitioned table the lake writes as one."""

    memberships: dict[int, str | None] = field(default_factory=dict)
    leaves: dict[int, str | None] = field(default_factory=dict)
    partitioned: frozenset[int] = frozenset()  # the published partitioned tables (published via themselves)


def publication_state(config: Config, conn: Any) -> PublicationState:
    """The publication's tables as the catalog holds them now (see :class:`PublicationState`)."""
    published = publication_memberships(conn, config.source.publication)
    leaves: dict[int, str | None] = {oid: parts for oid, (_, parts, _) in published.items() if parts is not None}
    leaves.update(partition_leaves(conn, [n for n, t in config.tables.items() if t.partitions == "root"]))
    return PublicationState(
        {oid: m for oid, (m, _, _) in published.items()}, leaves, frozenset(oid for oid, (_, _, p) in published.items() if p)
    )


def added_back_tables(
    config: Config, src: SlotSource, applied: dict[int, Applied], state: PublicationState
) -> tuple[dict[int, str], SchemaError | None]:
    """Published tables none of whose publication entries of their last logged window or copy
    holds them now (what puts a table in the publication is catalog rows: a table dropped from
    it and added again has new ones): the changes made while they were out were never
    published, so the lake cannot follow them by changes alone. Returns the ones to copy again
    (``on_unfollowable = "resync"``; OID -> name) and the refusal for the others."""
    cfg = config
    again: dict[int, str] = {}
    refused: list[str] = []
    for oid, now in state.memberships.items():
        then = applied[oid].publication if oid in applied else None
        # Still held by one of the catalog rows that held it then (say an explicit entry, and
        # its schema added since): it never left.
        if then is None or now is None or set(then.split(",")) & set(now.split(",")):
            continue
        a = applied[oid]
        name = f"{a.schema}.{a.table}"
        if cfg.table(a.schema, a.table).on_unfollowable == "resync":
            again[oid] = name
        else:
            refused.append(name)
    if refused:
        return again, SchemaError(
            f"{', '.join(refused)} left publication {cfg.source.publication!r} and came back since the lake's "
            f"last window of {'it' if len(refused) == 1 else 'them'}: changes made in between were never "
            f"published, so the lake cannot follow by changes alone; copy again with pg2delta resync "
            f"{' '.join(f'--table {n}' for n in refused)} (or set on_unfollowable = \"resync\")"
        )
    return again, _attached_with_rows(config, src, applied, state, again) or _detached(config, src, applied, state, again)



def _attached_with_rows(
    config: Config, src: SlotSource, applied: dict[int, Applied], state: PublicationState, again: dict[int, str]
) -> SchemaError | None:
    """Partitions attached, with rows in them, to a partitioned table the lake writes as one
    Delta table (published via its root, or ``partitions = "root"``) since its last logged
    window or copy: PostgreSQL never sends the rows a partition had when it was attached. The
    root is added to ``again`` where ``on_unfollowable = "resync"``; otherwise the refusal. Each new partition is read once (it is logged with the root's next
    window)."""
    for root, now in state.leaves.items():
        a = applied.get(root)
        if a is None or a.partitions is None or now is None or root in again:
            continue
        new = sorted(set(now.split(",")) - set(a.partitions.split(",")))
        holding = [name for leaf in new if (name := rows_before_attach(src.conn, int(leaf))) is not None]
        if not holding:
            continue
        name = f"{a.schema}.{a.table}"
        if config.table(a.schema, a.table).on_unfollowable == "resync":
            log.warning(
                "%s was attached to %s with rows in it; on_unfollowable = \"resync\": copying %s again",
                ", ".join(holding), name, name,
            )
            again[root] = name
            continue
        what = f"{', '.join(holding)} {'was' if len(holding) == 1 else 'were'} attached to {name} with rows in it"
        return SchemaError(
            f"{what} since the lake's last window of it, and PostgreSQL does not send the rows a partition "
            f"has when it is attached: copy it again with pg2delta resync --table {name} "
            f"(or set on_unfollowable = \"resync\")"
        )
    return None



def _detached(
    config: Config, src: SlotSource, applied: dict[int, Applied], state: PublicationState, again: dict[int, str]
) -> SchemaError | None:
    """Partitions detached or dropped, since its last logged window or copy, from a partitioned
    table the lake writes as one Delta table: PostgreSQL sends nothing for their rows, so the
    lake still holds them. ``detached_partitions = "keep"`` keeps them; the root is added to
    ``again`` where ``on_unfollowable = "resync"``; otherwise the refusal."""
    for root, now in state.leaves.items():
        a = applied.get(root)
        if a is None or a.partitions is None or now is None or root in again:
            continue
        gone = sorted(set(a.partitions.split(",")) - set(now.split(",")) - {""}, key=int)
        tc = config.table(a.schema, a.table)
        if not gone or tc.detached_partitions == "keep":
            continue
        names = [".".join(n) if (n := relation_name(src.conn, int(oid))) else f"a dropped partition (OID {oid})"
                 for oid in gone]
        name = f"{a.schema}.{a.table}"
        what = f"{', '.join(names)} left {name} (DETACH PARTITION or DROP) since the lake's last window of it"
        if tc.on_unfollowable == "resync":
            log.warning("%s; on_unfollowable = \"resync\": copying %s again", what, name)
            again[root] = name
            continue
        keep = f"or set [tables.\"{name}\"] detached_partitions = \"keep\" to keep its rows in the lake"
        return SchemaError(
            f"{what}, and PostgreSQL sends nothing for the rows that leave with it: copy it again with "
            f"pg2delta resync --table {name} (or set on_unfollowable = \"resync\"), {keep}"
        )
    return None



def detached_published(
    config: Config, src: SlotSource, applied: dict[int, Applied], state: PublicationState
) -> tuple[dict[int, tuple[int, int]], SchemaError | None]:
    """Leaves gone, since its last logged window or copy, from a ``partitions = "root"`` root that
    keeps the rows of its detached partitions (``detached_partitions = "keep"``), and published
    on their own now: their changes in the slot are the root's up to their ``DETACH`` and their
    own after it. Per such leaf, its root and where its DETACH committed in the backlog
    (:func:`pg2delta.source.detaches.detach_positions`; :meth:`TargetResolver.group` splits its
    changes there), or the refusal where that cannot be told."""
    gone: dict[int, int] = {}
    for root, now in state.leaves.items():
        a = applied.get(root)
        if a is None or a.partitions is None or now is None or not a.table:
            continue
        tc = config.table(a.schema, a.table)
        if tc.partitions == "root" and tc.detached_partitions == "keep":
            gone.update((int(leaf), root) for leaf in set(a.partitions.split(",")) - set(now.split(",")) - {""}
                        if int(leaf) in state.memberships)
    if not gone:
        return {}, None
    try:
        found = detach_positions(config.source.dsn, config.source.slot, gone, connect_timeout=config.source.connect_timeout)
        unknown = {leaf: d.why for leaf, d in found.items() if d.lsn is None}
    except DecodeUnavailable as exc:
        found, unknown = {}, dict.fromkeys(gone, f"the test_decoding plugin it decodes the slot's backlog with is unavailable ({exc})")
    if not unknown:
        return {leaf: (root, found[leaf].lsn or 0) for leaf, root in gone.items()}, None
    leaf, why = min(unknown.items())
    name = f"{applied[gone[leaf]].schema}.{applied[gone[leaf]].table}"
    return {}, SchemaError(
        f"{_name(src, leaf)} left {name} (DETACH PARTITION) and is published on its own, and pg2delta cannot tell which "
        f"of its changes in the slot came before the DETACH (the root's) and which after (its own): {why}; copy them "
        f"again with pg2delta resync --table {name} --table {_name(src, leaf)} (the rows it had leave {name}'s Delta table)"
    )


def recorded_filenodes(state: PublicationState, applied: dict[int, Applied]) -> dict[int, dict[int, int] | None]:
    """Per root published via itself, its leaves' relfilenodes as the applied log last recorded
    them (None: not recorded; ``{}`` for a root that had no partitions)."""
    return {oid: filenodes_of(applied[oid].filenodes) if oid in applied else None for oid in state.partitioned}


def rewritten_partitions(
    config: Config, src: SlotSource, applied: dict[int, Applied], known: dict[int, dict[int, int] | None],
    again: dict[int, str],
) -> tuple[dict[int, dict[int, int]], dict[int, list[int]], SchemaError | None]:
    """The relfilenodes of the leaves of the roots ``known`` has now; per root, the leaves that may
    have been truncated since ``known`` (:func:`pg2delta.source.rewrites.rewritten_leaves`); and,
    where any, what :func:`truncated_partitions` makes of them (the refusal; ``again`` filled)."""
    now = leaf_filenodes(src.conn, known) if known else {}
    changed = {root: leaves for root, nodes in now.items() if (leaves := rewritten_leaves(known.get(root), nodes))}
    if not changed:
        return now, changed, None
    fresh = {leaf for root, nodes in now.items() for leaf in fresh_leaves(known.get(root), nodes)}
    return now, changed, truncated_partitions(config, src, applied, changed, again, fresh=fresh)


def truncated_partitions(
    config: Config, src: SlotSource, applied: dict[int, Applied], changed: dict[int, list[int]], again: dict[int, str],
    *, fresh: set[int] | frozenset[int] = frozenset(),
) -> SchemaError | None:
    """Roots published via themselves whose leaves ``changed`` (relfilenodes not the ones last
    recorded, or leaves new since: :func:`pg2delta.source.rewrites.rewritten_leaves`): a leaf
    truncated alone, which pgoutput does not send, leaves its rows in the lake. The backlog tells
    a ``TRUNCATE`` from a ``VACUUM FULL``, a ``CLUSTER`` or a new partition
    (:func:`pg2delta.source.rewrites.truncated_alone`); where it cannot be decoded, any rewrite
    counts, and so does a leaf only new since (``fresh``: never rewritten), which a TRUNCATE in
    the transaction that created it would have emptied unseen. A root truncated so, or that
    cannot be told, is added to ``again`` where ``on_unfollowable = "resync"``; otherwise the
    refusal."""
    roots = {root: (applied[root].end_lsn if root in applied else 0, leaves) for root, leaves in changed.items()}
    unavailable: str | None = None
    try:
        found = truncated_alone(config.source.dsn, config.source.slot, roots, connect_timeout=config.source.connect_timeout)
    except DecodeUnavailable as exc:
        unavailable, found = str(exc), {root: Truncated([], []) for root in changed}
    for root, truncated in sorted(found.items()):
        if not truncated.leaves and set(changed[root]) <= fresh and unavailable is None:
            continue  # only new partitions, none found truncated
        a = applied.get(root)
        schema, table = (a.schema, a.table) if a is not None and a.table else (relation_name(src.conn, root) or ("", ""))
        name = f"{schema}.{table}"
        rewritten = ", ".join(_name(src, oid) for oid in changed[root] if oid not in fresh)
        new = ", ".join(_name(src, oid) for oid in changed[root] if oid in fresh)
        if truncated.leaves:
            what = (f"{', '.join(truncated.leaves)} {'was' if len(truncated.leaves) == 1 else 'were'} truncated alone "
                    f"since the lake's last window of {name}, and PostgreSQL does not send a TRUNCATE of a partition "
                    f"when the root is published via itself, so the lake would keep those rows")
        elif truncated.unknown:
            what = (f"a partition of {name} ({rewritten}) was rewritten since the lake's last window of it, and the "
                    f"slot's backlog truncates {', '.join(truncated.unknown)}, a name no relation has now (renamed or "
                    f"dropped since): pg2delta cannot tell whether that was the partition")
        elif rewritten:
            what = (f"a partition of {name} ({rewritten}) was rewritten (TRUNCATE, VACUUM FULL or CLUSTER) since the "
                    f"lake's last window of it, and pg2delta cannot tell which: the test_decoding plugin it decodes "
                    f"the slot's backlog with is unavailable ({unavailable})")
        else:
            what = (f"{new} became a partition of {name} since the lake's last window of it, and pg2delta cannot tell "
                    f"whether it was truncated in the transaction that created it (PostgreSQL then sends its rows "
                    f"through the root, not the TRUNCATE): the test_decoding plugin it decodes the slot's backlog "
                    f"with is unavailable ({unavailable})")
        if config.table(schema, table).on_unfollowable == "resync":
            log.warning("%s; on_unfollowable = \"resync\": copying %s again", what, name)
            again[root] = name
            continue
        return SchemaError(f"{what}; copy it again with pg2delta resync --table {name} (or set on_unfollowable = \"resync\")")
    return None


def _name(src: SlotSource, oid: int) -> str:
    return ".".join(n) if (n := relation_name(src.conn, oid)) else f"OID {oid}"


class TargetResolver:
    """Maps a window's relations to Delta tables; caches each relation's partition root."""

    def __init__(
        self, config: Config, lake: Lake, catalog_conn: Any, *, detached: Mapping[int, tuple[int, int]] | None = None
    ) -> None:
        self.config = config
        self.lake = lake
        self.catalog_conn = catalog_conn  # None: no partition roots are looked up
        # Leaves detached from a partitions = "root" root, published on their own: (root, where
        # their DETACH committed) (see detached_published).
        self.detached = dict(detached or {})
        self._roots: dict[int, tuple[int, str, str] | None] = {}
        self._rooted = any(t.partitions == "root" for t in config.tables.values())  # any partitions = "root"

    def partition_root(self, oid: int) -> tuple[int, str, str] | None:
        """The top partitioned table ``oid`` belongs to, when its config asks for ``partitions = "root"``."""
        if oid not in self._roots:
            self._roots[oid] = None
            if self._rooted and self.catalog_conn is not None:
                row = self.catalog_conn.execute(
                    "SELECT r.oid::int8, n.nspname, r.relname FROM pg_class r JOIN pg_namespace n ON n.oid = r.relnamespace "
                    "WHERE r.oid = pg_partition_root(%s::oid) AND r.oid <> %s::oid",
                    (oid, oid),
                ).fetchone()
                if row is not None and self.config.table(str(row[1]), str(row[2])).partitions == "root":
                    self._roots[oid] = (int(row[0]), str(row[1]), str(row[2]))
        return self._roots[oid]

    def logged_root(self, oid: int, applied: dict[int, Applied]) -> tuple[int, str, str] | None:
        """The ``partitions = "root"`` root whose leaves, as the applied log last recorded them,
        include ``oid``, a relation that is no partition now: a partition detached (or dropped)
        since, whose changes from while it was attached may still be in the slot. Those go to the
        root's Delta table, as they would have before the detach (``detached_partitions`` decides
        what becomes of its rows there)."""
        if not self._rooted:
            return None
        for root, a in applied.items():
            leaves = a.partitions.split(",") if a.partitions and a.table else []
            if str(oid) in leaves and self.config.table(a.schema, a.table).partitions == "root":
                return root, a.schema, a.table
        return None

    def group(self, tables: dict[int, TableWindow], applied: dict[int, Applied]) -> list[Target]:
        """Group the window's relations by the Delta table their changes go to.

        A relation's Delta table is named after it the first time pg2delta writes it and stays the
        same for its OID afterwards (the applied log records it): a table renamed or moved to another
        schema keeps its Delta table. Partitions of a table configured with ``partitions = "root"`` go
        to the root's Delta table. A Delta table already written for another relation OID (a table
        dropped and created again under the same name) is refused rather than mixed.
        """
        owners = {(a.schema, a.table): oid for oid, a in applied.items() if a.table}
        out: dict[tuple[str, str], Target] = {}
        for oid, whole in tables.items():
            for tw, root in self._parts(oid, whole, applied):
                owner, (schema, name) = oid, tw.latest.qualified_name
                if root is not None:
                    owner, schema, name = root
                known = applied.get(owner)
                if known is not None and known.table:
                    if (known.schema, known.table) != (schema, name):
                        log.info("%s.%s (relation %d) keeps its Delta table %s.%s", schema, name, owner, known.schema, known.table)
                    schema, name = known.schema, known.table
                elif owners.get((schema, name), owner) != owner:
                    raise SchemaError(
                        f"the Delta table {self.lake.table_uri(schema, name)} holds relation OID {owners[(schema, name)]}, "
                        f"but {schema}.{name} is now relation OID {owner} (was the table dropped and created again, or "
                        "renamed and another created under its name?): move or delete that Delta table (and its rows in "
                        f"{self.lake.table_uri(LOG_TABLE)}), or name the new table differently, then run again"
                    )
                tgt = out.setdefault((schema, name), Target(owner, schema, name))
                if tgt.owner != owner:
                    raise SchemaError(f"relations {tgt.owner} and {owner} both map to the Delta table {schema}.{name}")
                tgt.parts.append(tw)
        return list(out.values())

    def _parts(
        self, oid: int, tw: TableWindow, applied: dict[int, Applied]
    ) -> list[tuple[TableWindow, tuple[int, str, str] | None]]:
        """``tw`` with the root whose Delta table its changes go to (None: its own). A leaf detached
        in the slot's backlog and published on its own (``self.detached``) in two: its changes
        committed before its DETACH to the root's Delta table, the others to its own."""
        if oid not in self.detached or (a := applied.get(self.detached[oid][0])) is None or not a.table:
            return [(tw, self.partition_root(oid) or self.logged_root(oid, applied))]
        root, at = self.detached[oid]
        before, after = tw.split(at)
        now = self.partition_root(oid)  # None, unless attached to another root since
        return [(p, r) for p, r in ((before, (root, a.schema, a.table)), (after, now)) if p.batches or p.truncates]


    def source_name(self, tgt: Target) -> str:
        """The source table whose rows ``tgt``'s Delta table holds, as PostgreSQL names it now."""
        for tw in tgt.parts:
            if tw.oid == tgt.owner:
                return ".".join(tw.latest.qualified_name)
        root = self.partition_root(tgt.parts[0].oid) if tgt.parts else None
        return f"{root[1]}.{root[2]}" if root is not None else f"{tgt.schema}.{tgt.table}"



__all__ = [
    "PublicationState", "Target", "TargetResolver", "added_back_tables", "detached_published", "live", "publication_state",
    "recorded_filenodes", "rewritten_partitions", "truncated_partitions",
]
