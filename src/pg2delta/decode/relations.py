"""Which version of a relation each change of a chunk was sent with.

A Relation message takes effect where :class:`pg2delta.decode.transactions.TransactionScan` says (its own
row, or the commit of the streamed transaction that sent it). :class:`RelationTimeline` resolves
the chunk's Relation messages in that order and answers, for a change at some row, the version in
force there: the latest one taking effect before the row, the one its own streamed transaction
sent, or the one known before the chunk.

Pure: no database, no Spark.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pg2delta.decode import pgoutput as po
from pg2delta.errors import DecodeError

if TYPE_CHECKING:
    from pg2delta.decode.events import RelationVersion
    from pg2delta.decode.transactions import TransactionScan

I64 = npt.NDArray[np.int64]


class RelationTimeline:
    """The relation versions of one chunk, by the row where they take effect.

    Building it resolves every Relation message of the chunk that takes effect (codecs, key,
    schema) through ``add_relation``, in the order they take effect.
    """

    def __init__(
        self,
        scan: TransactionScan,
        at_start: dict[int, RelationVersion],
        add_relation: Callable[[po.Relation], RelationVersion],
    ) -> None:
        self._scan = scan
        self._at_start = at_start  # versions in force before this chunk's Relation messages
        # Per OID, (row where it takes effect, version), in that order.
        self._versions_of: dict[int, list[tuple[int, RelationVersion]]] = collections.defaultdict(list)
        # Per (streamed xid, OID), (row of the Relation message, version), in row order.
        self._own: dict[tuple[int, int], list[tuple[int, RelationVersion]]] = collections.defaultdict(list)
        effect_row, stream_of_row, lsns = scan.effect_row, scan.stream_of_row, scan.rows.lsns
        effective = sorted((int(effect_row[i]), i) for i in scan.relation_rows if effect_row[i] >= 0)
        for eff, i in effective:
            rel = scan.parsed[i]
            assert isinstance(rel, po.Relation)
            try:
                version = add_relation(rel)
            except DecodeError as exc:
                raise exc.with_lsn(int(lsns[i])) from exc
            self._versions_of[rel.oid].append((eff, version))
            if stream_of_row[i] >= 0:
                self._own[(int(stream_of_row[i]), rel.oid)].append((i, version))
        for lst in self._own.values():
            lst.sort(key=lambda x: x[0])

    def version_at(self, oid: int, row: int) -> RelationVersion | None:
        """The version a change at ``row`` was sent with, None if never described."""
        stream_of_row = self._scan.stream_of_row
        if stream_of_row[row] >= 0:
            # A streamed transaction describes its relations itself.
            mine = self._own.get((int(stream_of_row[row]), oid), [])
            k = bisect.bisect_left(mine, row, key=lambda x: x[0]) - 1
            if k >= 0:
                return mine[k][1]
        known = self._versions_of.get(oid, [])
        k = bisect.bisect_left(known, row, key=lambda x: x[0]) - 1
        return known[k][1] if k >= 0 else self._at_start.get(oid)

    def versions(self, oid: int, sel: I64) -> tuple[list[RelationVersion | None], I64]:
        """For the changes of relation ``oid`` at rows ``sel``: the candidate versions and the index of
        each row's version among them (an index naming None raises: never described)."""
        known = self._versions_of.get(oid, [])
        vers: list[RelationVersion | None] = [self._at_start.get(oid), *(v for _, v in known)]
        index_of = {id(v): k for k, v in enumerate(vers)}
        vidx = np.empty(len(sel), dtype=np.int64)
        plain = self._scan.stream_of_row[sel] < 0
        if plain.any():
            bounds = np.array([r for r, _ in known], dtype=np.int64)
            vidx[plain] = np.searchsorted(bounds, sel[plain], side="left")
        for j in np.flatnonzero(~plain).tolist():
            v = self.version_at(oid, int(sel[j]))
            vidx[j] = 0 if v is None else index_of[id(v)]
        if vers[0] is None and (vidx == 0).any():
            raise self.undescribed(oid, int(sel[np.flatnonzero(vidx == 0)[0]]))
        return vers, vidx

    def undescribed(self, oid: int, row: int) -> DecodeError:
        """The error for a change at ``row`` of a relation no Relation message described."""
        scan = self._scan
        return DecodeError(
            f"change for relation {oid} that was never described by a Relation message",
            tag=chr(int(scan.tags[row])), offset=1, lsn=int(scan.rows.lsns[row]),
        )
