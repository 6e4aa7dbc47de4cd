"""Column governance: columns landed as a keyed hash, and columns never landed.

``[tables."s.t"] hash = [...]`` and ``exclude = [...]`` (see ``docs/concepts/column-governance.md``)
are applied where decoded values become Arrow columns: the change path's batches
(:func:`pg2delta.decode.rowbatch.build_batch`) and the copies' (:class:`pg2delta.source.copy.CopyPlan`)
go through :meth:`Governance.apply`, so nothing downstream (spill and staging files, the MERGE,
the changelog, the history, the copies) ever holds a raw value of such a column.

The hash is HMAC-SHA-256 under the lake's key, landed as 64 lowercase hex digits; NULL stays NULL.
What is hashed (:func:`hash_input`): the UTF-8 bytes of a string column's value (text, varchar,
citext, uuid, jsonb, inet ... land as strings: PostgreSQL's own text of the value), a binary
column's bytes (bytea), any other scalar's text as Arrow casts it (integers and dates: the same
text as PostgreSQL's). Equal values give equal hashes in every table and run under one key.

Pure: Arrow arrays in, Arrow arrays out.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.decode import pgoutput as po
from pg2delta.errors import ConfigError

HASH_TYPE = pa.string()  # what a hashed column lands as: 64 lowercase hex digits
_CHECK_MESSAGE = b"pg2delta hash key check"


def key_fingerprint(key: bytes) -> str:
    """A short, one-way token of the key (an HMAC of a fixed message): kept with a table's record
    so that a run under another key is refused; it tells nothing about the key."""
    return hmac.new(key, _CHECK_MESSAGE, hashlib.sha256).hexdigest()[:16]


def hashable(arrow_type: pa.DataType) -> bool:
    """Whether a column of ``arrow_type`` can be hashed: scalars (not lists, structs, maps)."""
    return not pa.types.is_nested(arrow_type)


def hash_input(values: pa.Array) -> pa.Array:
    """The values whose bytes are hashed: strings and binaries as they are, other scalars as Arrow's text."""
    t = values.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return values
    return pc.cast(values, pa.string())


def hash_values(values: pa.Array | pa.ChunkedArray, key: bytes) -> pa.Array:
    """HMAC-SHA-256 of each value under ``key``, as lowercase hex; NULL stays NULL. Each distinct
    value is hashed once."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks else pa.array([], type=values.type)
    encoded = pc.dictionary_encode(hash_input(values))
    inner, outer = _pads(key)
    digests = []
    for v in encoded.dictionary.to_pylist():
        h = inner.copy()
        h.update(v.encode() if isinstance(v, str) else v)
        o = outer.copy()
        o.update(h.digest())
        digests.append(o.hexdigest())
    return pc.take(pa.array(digests, type=HASH_TYPE), encoded.indices)


def _pads(key: bytes) -> tuple[Any, Any]:
    """HMAC-SHA-256 (RFC 2104) as two SHA-256 states, the inner and outer padded keys already
    taken in: a value then costs two copies and two updates (about 3x faster here than
    ``hmac.digest`` a value; the tests hold it to :mod:`hmac`)."""
    block = hashlib.sha256(key).digest() if len(key) > 64 else key
    block = block.ljust(64, b"\0")
    return (hashlib.sha256(bytes(b ^ 0x36 for b in block)), hashlib.sha256(bytes(b ^ 0x5C for b in block)))


@dataclass(frozen=True, slots=True)
class ColumnRules:
    """What a table's config says of its columns: hashed and excluded names, and the lake's hash key."""

    hashed: frozenset[str]
    excluded: frozenset[str]
    key: bytes = field(default=b"", repr=False)

    def __bool__(self) -> bool:
        return bool(self.hashed or self.excluded)

    def record(self) -> dict[str, Any]:
        """What the lake keeps of these rules (:mod:`pg2delta.lake.column_records`): the names and,
        when something is hashed, the key's fingerprint (never the key)."""
        return {"hash": sorted(self.hashed), "exclude": sorted(self.excluded),
                "key": key_fingerprint(self.key) if self.hashed else None}


# Given a Relation message, the rules of its table (its own and its partition ancestors'), or None.
ColumnRuler = Callable[[po.Relation], ColumnRules | None]


@dataclass(frozen=True, slots=True)
class Governance:
    """The rules resolved against one relation's columns: per landed column, its index among the
    relation's columns and whether it is hashed."""

    plan: tuple[tuple[int, bool], ...]
    rules: ColumnRules

    @classmethod
    def resolve(cls, table: str, names: Sequence[str], types: Sequence[pa.DataType], key_names: Sequence[str],
                rules: ColumnRules) -> Governance:
        """Check ``rules`` against the relation's columns (a ConfigError names what is wrong)."""
        unknown = sorted((rules.hashed | rules.excluded) - set(names))
        if unknown:
            raise ConfigError(
                f"[tables.\"{table}\"] hash/exclude name(s) {unknown} that are not published columns of {table} "
                f"(columns: {', '.join(names)}); fix a misspelt name (it would land its column in clear), or add the "
                "column to the table (its first values are then hashed or left out)"
            )
        excluded_key = sorted(rules.excluded & set(key_names))
        if excluded_key:
            raise ConfigError(
                f"[tables.\"{table}\"] exclude names key column(s) {excluded_key}: the lake finds a row's updates "
                "and deletes by its key; hash them instead (hash = [...]), or set another key = [...]"
            )
        nested = sorted(n for n, t in zip(names, types, strict=True) if n in rules.hashed and not hashable(t))
        if nested:
            raise ConfigError(f"[tables.\"{table}\"] hash names column(s) {nested} of {table} that are arrays or "
                              "composites: only scalar columns can be hashed (exclude them instead)")
        if rules.hashed and not rules.key:
            raise ConfigError(f"[tables.\"{table}\"] hash is set but no hash key was loaded")
        plan = tuple((i, n in rules.hashed) for i, n in enumerate(names) if n not in rules.excluded)
        return cls(plan, rules)

    def fields(self, fields: Sequence[pa.Field]) -> list[pa.Field]:
        """The landed fields of the relation's ``fields``."""
        return [fields[i].with_type(HASH_TYPE) if hashed else fields[i] for i, hashed in self.plan]

    def kept(self, index: int) -> bool:
        return any(i == index for i, _ in self.plan)

    def apply(self, arrays: Sequence[pa.Array]) -> list[pa.Array]:
        """The landed arrays of the relation's decoded ``arrays``: excluded ones left out, hashed ones hashed."""
        return [hash_values(arrays[i], self.rules.key) if hashed else arrays[i] for i, hashed in self.plan]


__all__ = [
    "HASH_TYPE", "ColumnRuler", "ColumnRules", "Governance", "hash_input", "hash_values", "hashable", "key_fingerprint",
]
