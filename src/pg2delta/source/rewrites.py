"""Leaf partitions rewritten under a root published via itself, and which of them were truncated.

With ``publish_via_partition_root = true`` pgoutput sends a ``TRUNCATE`` of the root but not of a
single leaf partition (``TRUNCATE m2``), so the lake would keep that partition's rows. A leaf's
``pg_class.relfilenode`` changes with every ``TRUNCATE`` (and with ``VACUUM FULL``, ``CLUSTER``,
a rewriting ``ALTER TABLE``, which send nothing and need nothing): :func:`leaf_filenodes` reads
them, the applied log records them per root, and :func:`rewritten_leaves` compares. Only when one
changed does :func:`truncated_alone` decode the slot's backlog once more, from a temporary copy of
the slot with the ``test_decoding`` plugin, to tell a ``TRUNCATE`` of the leaf alone (the root not
in it) from the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from pg2delta.errors import ConnectionFailed
from pg2delta.lsn import parse_lsn
from pg2delta.source.slot import connect

log = logging.getLogger(__name__)


def filenodes_sql(rel: str) -> str:
    """SQL: the leaf partitions of the partitioned table ``rel`` (an OID expression) and their
    relfilenodes, as the JSON text :func:`filenodes_of` reads (``'{}'``: no leaves, or gone). The
    bootstrap reads it in its copy's snapshot, each window after its peek."""
    return (
        "coalesce((SELECT json_object_agg(l.relid::int8, k.relfilenode::int8) "
        f"FROM pg_partition_tree({rel}) l JOIN pg_class k ON k.oid = l.relid WHERE l.isleaf), '{{}}')::text"
    )


# Per root, its leaf partitions and their relfilenodes, read now (each statement its own snapshot).
_FILENODES_QUERY = "SELECT r.root::int8, " + filenodes_sql("r.root") + " FROM unnest(%s::oid[]) AS r(root)"

# The relations (quoted as test_decoding quotes them) by OID; missing ones left out.
_QUOTED_QUERY = """
SELECT c.oid::int8, quote_ident(n.nspname) || '.' || quote_ident(c.relname)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = ANY(%s::oid[])
"""

# The names (as test_decoding wrote them) no relation has now.
_GONE_QUERY = "SELECT n FROM unnest(%s::text[]) AS n WHERE to_regclass(n) IS NULL"

# The backlog's TRUNCATE lines with the commit position of their transactions (test_decoding
# writes ``table s.a, s.b: TRUNCATE: <flags>``, one line per TRUNCATE, and ``COMMIT <xid>`` at the
# commit's end): one decode, the other changes filtered out on the server.
_TRUNCATES_QUERY = """
WITH c AS (
    SELECT lsn, xid, data FROM pg_logical_slot_peek_changes(%s, NULL, NULL, 'include-xids', '1', 'skip-empty-xacts', '1')
    WHERE data LIKE 'table %%: TRUNCATE:%%' OR data LIKE 'COMMIT %%'
)
SELECT t.data, max(k.lsn)::text FROM c t JOIN c k ON k.xid = t.xid AND k.data LIKE 'COMMIT %%'
WHERE t.data LIKE 'table %%: TRUNCATE:%%'
GROUP BY t.data, t.xid
"""


def leaf_filenodes(conn: Any, roots: Iterable[int]) -> dict[int, dict[int, int]]:
    """Per partitioned table of ``roots``, ``{leaf OID: relfilenode}`` (empty: no leaves, or gone)."""
    return {int(root): filenodes_of(str(nodes)) or {} for root, nodes in conn.execute(_FILENODES_QUERY, (list(roots),)).fetchall()}


def filenodes_json(nodes: Mapping[int, int] | None) -> str | None:
    """The applied log's form of :func:`leaf_filenodes`'s map for one root (JSON, keys sorted)."""
    return None if nodes is None else json.dumps({str(k): v for k, v in sorted(nodes.items())})


def filenodes_of(text: str | None) -> dict[int, int] | None:
    """The map :func:`filenodes_json` wrote (None: not recorded)."""
    return None if not text else {int(k): int(v) for k, v in json.loads(text).items()}


def rewritten_leaves(before: Mapping[int, int] | None, now: Mapping[int, int]) -> list[int]:
    """Leaves of ``now`` that may have been truncated since ``before``: those whose relfilenode is
    not the one ``before`` recorded (rewritten since), and those ``before`` does not know (created
    or attached since). A ``TRUNCATE`` in the transaction that created the table empties it in
    place, keeping its relfilenode, while its rows were sent through the root: only the backlog
    tells. Nothing recorded (a lake from before pg2delta recorded relfilenodes): nothing to
    compare, the next window records them.
    """
    if before is None:
        return []
    return sorted(leaf for leaf, node in now.items() if before.get(leaf) != node)


def fresh_leaves(before: Mapping[int, int] | None, now: Mapping[int, int]) -> set[int]:
    """Leaves of ``now`` that ``before`` does not know and that were never rewritten (a table's
    relfilenode starts as its OID): new since, and only a TRUNCATE in the transaction that created
    them would have emptied them unseen."""
    return set() if before is None else {leaf for leaf, node in now.items() if leaf not in before and node == leaf}


def truncate_names(line: str) -> list[str] | None:
    """The relations (``schema.name``, quoted as ``quote_ident`` quotes) of a test_decoding TRUNCATE
    line, ``table public.m1, public."M 2": TRUNCATE: (no-flags)``; None for any other line (an
    INSERT whose value holds ``: TRUNCATE:`` too)."""
    if not line.startswith("table "):
        return None
    names: list[str] = []
    i, cur, quoted = len("table "), [], False
    while i < len(line):
        ch = line[i]
        if quoted:
            if ch == '"' and line.startswith('""', i):
                cur.append('""')
                i += 2
                continue
            quoted = ch != '"'
            cur.append(ch)
        elif ch == '"':
            quoted = True
            cur.append(ch)
        elif line.startswith(", ", i):
            names.append("".join(cur))
            cur = []
            i += 2
            continue
        elif line.startswith(": TRUNCATE:", i):
            names.append("".join(cur))
            return names if all(names) else None
        elif ch in ":,":
            return None
        else:
            cur.append(ch)
        i += 1
    return None


class DecodeUnavailable(Exception):
    """The backlog could not be decoded with test_decoding (not installed, no free slot, ...)."""


@dataclass(frozen=True, slots=True)
class Truncated:
    """What the backlog holds for one root: its leaves truncated without it (names as they are
    now), and relations truncated without it that no longer go by the name they had then
    (renamed or dropped since: maybe a leaf of it)."""

    leaves: list[str]
    unknown: list[str]


def match_truncates(
    truncates: Sequence[tuple[set[str], int]], roots: Mapping[int, tuple[int, Sequence[int]]],
    names: Mapping[int, str], gone: set[str],
) -> dict[int, Truncated]:
    """Per root of ``roots`` (``{root: (its applied LSN, leaves)}``), the TRUNCATEs of
    ``truncates`` (relation names, commit LSN) after its applied LSN that do not name it (those
    are sent) and name one of its leaves (``names``: relations by OID, quoted) or a relation of
    ``gone`` (names that resolve to nothing now)."""
    out: dict[int, Truncated] = {}
    for root, (applied, leaves) in roots.items():
        alone = [t for t, lsn in truncates if lsn > applied and names.get(root) not in t]
        found = [names[leaf] for leaf in leaves if leaf in names and any(names[leaf] in t for t in alone)]
        unknown = sorted({n for t in alone for n in t & gone})
        if found or unknown:
            out[root] = Truncated(found, unknown)
    return out


def _connection_lost(exc: psycopg.OperationalError) -> bool:
    """The connection failed or the server is going away (no SQLSTATE, classes 08 and 57): not
    the server's answer that test_decoding cannot be loaded (58P01) or that no replication slot
    is free (53400), which psycopg raises as OperationalError too."""
    state = exc.sqlstate or ""
    return state[:2] in ("", "08", "57")


def truncated_alone(
    dsn: str, slot: str, roots: Mapping[int, tuple[int, Sequence[int]]], *, connect_timeout: int = 10
) -> dict[int, Truncated]:
    """Per root of ``roots`` (``{root: (its applied LSN, leaves to look for)}``), the TRUNCATEs in
    the slot's backlog of its leaves without it (:func:`match_truncates`), in transactions that
    commit after the root's applied LSN (before it, a copy of the root holds them already).

    The backlog is decoded from a temporary copy of ``slot`` made with the ``test_decoding``
    plugin on a connection of its own (same confirmed position; dropped at the end, and by the
    server if we die), up to the end of the WAL, not the run's bound: the relfilenodes that sent
    us here may show a rewrite committed past it. test_decoding names relations as they were
    then: a name that resolves to nothing now is reported as unknown rather than taken for
    another table. Raises :class:`DecodeUnavailable` when the copy or the decode fails.
    """
    with connect(dsn, application_name="pg2delta truncates", connect_timeout=connect_timeout) as conn:
        wanted = {oid for root, (_, leaves) in roots.items() for oid in (root, *leaves)}
        names = {int(str(o)): str(q) for o, q in conn.execute(_QUOTED_QUERY, (sorted(wanted),)).fetchall()}
        lines = [(str(d), parse_lsn(str(c))) for d, c in decode_backlog(conn, slot, _TRUNCATES_QUERY)]
        truncates = [(set(t), lsn) for line, lsn in lines if (t := truncate_names(line)) is not None]
        every = sorted({n for t, _ in truncates for n in t})
        gone = {str(n) for (n,) in conn.execute(_GONE_QUERY, (every,)).fetchall()} if every else set()
        out = match_truncates(truncates, roots, names, gone)
        log.info("decoded the backlog of slot %s for TRUNCATEs of %d partition(s): %d found, %d unknown",
                 slot, sum(len(v) for _, v in roots.values()), sum(len(v.leaves) for v in out.values()),
                 sum(len(v.unknown) for v in out.values()))
        return out


def decode_backlog(conn: Any, slot: str, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    """The rows of ``query`` (its first parameter: the name of the slot to peek) over the backlog
    of ``slot`` decoded with the ``test_decoding`` plugin, from a temporary copy of the slot made
    on ``conn`` (same confirmed position; dropped at the end, and by the server if we die).
    Raises :class:`DecodeUnavailable` where the server cannot (test_decoding not installed, no
    free replication slot, ...), ConnectionFailed where the connection is lost."""
    tmp = f"pg2delta_decode_{uuid.uuid4().hex[:16]}"
    try:
        conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s, true, 'test_decoding')", (slot, tmp))
        return list(conn.execute(query, (tmp, *params)).fetchall())
    except psycopg.OperationalError as exc:
        if _connection_lost(exc):
            raise ConnectionFailed(f"lost the connection while decoding the backlog: {' '.join(str(exc).split())}") from exc
        raise DecodeUnavailable(" ".join(str(exc).split())) from exc
    except psycopg.Error as exc:
        raise DecodeUnavailable(" ".join(str(exc).split())) from exc
    finally:
        with contextlib.suppress(psycopg.Error):  # (it would go with the session, a moment after)
            conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (tmp,))


__all__ = [
    "DecodeUnavailable", "Truncated", "decode_backlog", "filenodes_json", "filenodes_of", "filenodes_sql", "fresh_leaves", "leaf_filenodes", "match_truncates",
    "rewritten_leaves", "truncate_names", "truncated_alone",
]
