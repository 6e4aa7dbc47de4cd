"""The value the rows written before an ``ADD COLUMN`` hold in PostgreSQL, for the columns a
window adds to the Delta table (or adds inside its first transaction, after rows of it).

PostgreSQL sends nothing for those rows. Which rows need a value: every row of the Delta table as
the last logged window left it (unless the window truncates the table), and the rows the window
itself sent in a shape from before the column was added. For them, the catalog *as it is now*
(``pg_attribute`` of the table, or of each leaf partition of a partitioned one) decides:

* ``atthasmissing``: the column was added with a non-volatile default (a constant, ``now()``,
  a domain's default ...) and PostgreSQL reads ``attmissingval`` for every row written before.
  That value, converted by the column's codec from its text form, is set on every row of the
  Delta table (one rewrite before the window's MERGE, see :meth:`Engine.rewrite`) and given to
  the window's rows sent before the column (:func:`~pg2delta.apply.schema.conform`).
* no ``atthasmissing`` and no default of any kind (no ``pg_attrdef`` row, not generated, not
  an identity, no type default): the column was added without a default, those rows read
  NULL in PostgreSQL too. Nothing to do (as before).
* no ``atthasmissing`` but some default: PostgreSQL computed the rows' values and wrote them
  in a rewrite that logical decoding does not send (a volatile default such as
  ``clock_timestamp()`` or ``gen_random_uuid()``, an identity, a ``STORED`` generated column,
  a domain default with constraints), or a rewrite since the column was added (``VACUUM
  FULL``, ``CLUSTER``, ``ALTER … TYPE``) cleared ``attmissingval``. The values are not known
  here: refused (:class:`SchemaError`, exit 78, nothing of the window applied) asking for
  ``pg2delta resync --table s.t``. Only when rows need a value: a table that was empty in
  the lake and got no rows before the column in the window goes on.
* partitions that disagree (different missing values, or some without one) are refused the
  same way: the Delta table mixes their rows.
* a column the table no longer has under that name (dropped or renamed since): not knowable
  either, but nothing is lost that PostgreSQL still shows; logged, NULL as before.

The catalog can only show the present, so some cases look alike and are refused although the
rows do read NULL in PostgreSQL: a column added without a default and given one later
(``ADD COLUMN c int, ALTER c SET DEFAULT 5``), or a default that evaluates to NULL. A column
that is new to the lake without being new in PostgreSQL (renamed, or added to the
publication's column list) was refused before this, by :meth:`_check_column_identity`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from pg2delta.apply.schema import Plan
from pg2delta.apply.targets import Target
from pg2delta.decode.changes import LSN_COL, OP_COL, POS_COL
from pg2delta.decode.governance import hash_values
from pg2delta.decode.typemap import ColumnCodec, value_of_text_array
from pg2delta.errors import DataError, DecodeError, SchemaError
from pg2delta.lake.applied_log import Applied
from pg2delta.source.catalog import AddedColumn, PgTypeCatalog

log = logging.getLogger("pg2delta.apply.tableplan")  # the plan stage's, as before this module was apart


def added_column_values(
    tgt: Target,
    pl: Plan,
    applied: Applied | None,
    uri: str,
    where: str,
    catalog: PgTypeCatalog,
    *,
    has_rows: Callable[[str, int | None], bool],
    source_name: Callable[[Target], str],
) -> Plan:
    """``pl`` with the values (:attr:`Plan.fills`) that the rows of ``tgt`` written before its added
    columns hold, as this module says; ``has_rows(uri, version)``: the Delta table holds rows."""
    # The Delta table as the last logged window left it (a table a crashed run created is new).
    before = pl.existing if applied is not None else frozenset()
    candidates = [n for n, _ in pl.columns if n not in before]
    if not candidates:
        return pl
    applied_lsn = applied.end_lsn if applied is not None else 0
    truncates = [(t.commit_lsn, t.pos) for tw in tgt.parts for t in tw.truncates if t.commit_lsn >= applied_lsn]
    last_truncate = max(truncates) if truncates else None
    early, codecs, keys = _early_rows(tgt, candidates, applied_lsn, last_truncate)
    lake_rows = bool(before) and last_truncate is None and has_rows(uri, applied.delta_version if applied is not None else None)
    needed = [c for c in candidates if lake_rows or early[c]]
    if not needed:
        return pl
    found = catalog.added_columns(tgt.owner, needed)
    source = source_name(tgt)
    types = dict(pl.columns)
    fills: list[tuple[str, pa.Scalar]] = []
    for c in needed:
        entries = found.get(c, [])
        if not entries:
            log.warning(
                "column %s of %s is no longer in the source table (dropped or renamed since): pg2delta cannot "
                "tell the value rows written before it was added had there; they hold NULL in the lake", c, source,
            )
            continue
        if all(e.missing is None and not e.has_default for e in entries):
            continue  # added without a default: NULL, as PostgreSQL reads those rows
        missing = {e.missing for e in entries}
        if len(missing) != 1 or None in missing:
            raise SchemaError(_unknown_values_message(c, source, entries, where))
        fills.append((c, _missing_value(source, c, entries[0], codecs[c], types[c], keys.get(c))))
        log.info(
            "column %s of %s was added with a default: the rows written before hold PostgreSQL's "
            "attmissingval (%s in the lake, %d in this window)",
            c, source, "every row" if lake_rows else "none", early[c],
        )
    if not fills:
        return pl
    return dataclasses.replace(pl, fills=tuple(fills), fill_table=lake_rows)


def _missing_value(
    source: str, column: str, entry: AddedColumn, codec: ColumnCodec, arrow_type: pa.DataType, key: bytes | None
) -> pa.Scalar:
    """``attmissingval`` of ``column`` as the decoder would give its text form, in the plan's type
    (hashed under ``key`` for a hashed column, as the decoder lands its values)."""
    assert entry.missing is not None
    notes: collections.Counter[str] = collections.Counter()
    try:
        value = value_of_text_array(codec, entry.missing, delim=entry.delim, notes=notes)
        if key is not None:
            value = hash_values(pa.array([value.as_py()], type=value.type), key)[0]
        value = value.cast(arrow_type)
    except (DecodeError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(
            f"cannot convert the default of column {column} of {source} (pg_attribute.attmissingval, "
            f"{codec.pg_type}) to {arrow_type}: {exc}"
        ) from exc
    for name, count in sorted(notes.items()):
        log.warning("window note: %s = %d (the default of column %s of %s)", name, count, column, source)
    return value


def _early_rows(
    tgt: Target, candidates: Sequence[str], applied_lsn: int, last_truncate: tuple[int, int] | None
) -> tuple[dict[str, int], dict[str, ColumnCodec], dict[str, bytes]]:
    """Per column of ``candidates``, the rows the window wrote to ``tgt`` in a shape from before the
    column appeared (inserts and updates it applies), the codec of the column where it appears, and
    the hash key of the hashed ones (``[tables."s.t"] hash``)."""
    early: dict[str, int] = defaultdict(int)
    codecs: dict[str, ColumnCodec] = {}
    keys: dict[str, bytes] = {}
    for tw in tgt.parts:
        appeared: set[str] = set()
        for b in tw.batches:
            names = b.relation.column_names
            rules = b.relation.governance.rules if b.relation.governance is not None else None
            for c in candidates:
                if c in names:
                    codecs.setdefault(c, b.relation.codecs[names.index(c)])
                    if rules is not None and c in rules.hashed:
                        keys[c] = rules.key
            lacking = [c for c in candidates if c not in names and c not in appeared]
            if lacking:
                rows = _rows_written(b.load(), applied_lsn, last_truncate)
                for c in lacking:
                    early[c] += rows
            appeared.update(names)
    return early, codecs, keys


def _rows_written(batch: pa.RecordBatch, applied_lsn: int, last_truncate: tuple[int, int] | None) -> int:
    """Inserts and updates of ``batch`` that the window applies (at or after the applied LSN, after its last truncate)."""
    lsn, pos, op = batch.column(LSN_COL), batch.column(POS_COL), batch.column(OP_COL)
    keep = pc.and_(pc.is_in(op, value_set=pa.array(["I", "U"])), pc.greater_equal(lsn, applied_lsn))
    if last_truncate is not None:
        t_lsn, t_pos = last_truncate
        keep = pc.and_(keep, pc.or_(pc.greater(lsn, t_lsn), pc.and_(pc.equal(lsn, t_lsn), pc.greater(pos, t_pos))))
    return int(pc.sum(pc.cast(keep, pa.int64())).as_py() or 0)


def _unknown_values_message(column: str, source: str, entries: Sequence[AddedColumn], where: str) -> str:
    if len({e.missing for e in entries}) > 1:
        why = (
            "its partitions hold different values for the rows written before it was added "
            "(a partition created or rewritten since, or added with its own default)"
        )
    else:
        why = (
            "PostgreSQL computed its value in the rows written before it was added and keeps no record of it "
            "(no pg_attribute.attmissingval: a volatile default such as clock_timestamp() or gen_random_uuid(), "
            "an identity or STORED generated column, a domain default with constraints, or a table rewrite "
            "since the column was added)"
        )
    return (
        f"column {column} of {source} was added with a default{where}, but {why}; pg2delta cannot know what "
        f"those rows hold there: make the lake's copy of the table again with pg2delta resync --table {source}; "
        "nothing of this window was applied"
    )
