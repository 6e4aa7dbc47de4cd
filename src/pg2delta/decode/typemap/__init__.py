"""PostgreSQL values -> Arrow arrays: the value layer of the decoder, one module per type family.

**How a column's conversion is resolved.** When the window decoder meets a Relation message
it calls :func:`codec_for` once per column (type OID, typmod, declared array dimensions, the
catalog): :mod:`~pg2delta.decode.typemap.resolve` picks the column's handler from the generated
built-in type table (:mod:`pg2delta.decode._oids`) and the families' ``BUILTIN`` handlers, or from
the catalog for other types (domains take their base type's handler, arrays wrap their
element's codec, enums are strings, composites and ranges print through the handlers of their
fields' types, anything else is printed by the source server). The result, a
:class:`ColumnCodec` (:mod:`~pg2delta.decode.typemap.codec`), is kept with the relation's version
and used for every row until the next Relation message: nothing is looked up per row.

``codec.decode(buf, starts, lengths, kinds)`` turns one column of a whole window chunk into
one Arrow array: the values are byte ranges of ``buf``, in text (``t``) or binary (``b``) wire
format, freely mixed. ``n`` (NULL) and ``u`` (unchanged TOAST) become nulls; the caller tracks
unchanged TOAST itself. Bytes that do not form a value of the type raise
:class:`~pg2delta.errors.DecodeError` naming the type and the row index (never another
exception). Hot types decode in bulk: byte gathers, binary numeric (decimal128 or text) and
one-dimensional binary arrays in the C extension ``_tuples.c``, the rest with numpy and Arrow
compute; the other types loop per value. Every type also has a per-value reference path
(``ColumnCodec.decode(..., reference=True)``) that the tests hold the vectorized path against.

The modules:

* :mod:`~pg2delta.decode.typemap.resolve`: :func:`codec_for`, :func:`arrow_schema`, the catalog
  protocol (:class:`TypeInfo`, :class:`TypeCatalog`).
* :mod:`~pg2delta.decode.typemap.codec`: :class:`ColumnCodec` and the value kinds (``KIND_*``).
* :mod:`~pg2delta.decode.typemap.handler`: the handler contract every family implements, a column
  chunk's values (``Part``), the byte gathers and the string-typed bases they share.
* the families: :mod:`~pg2delta.decode.typemap.boolean`, :mod:`~pg2delta.decode.typemap.numeric`
  (integers, OID types, floats, numeric, money), :mod:`~pg2delta.decode.typemap.text` (text types,
  "char", bytea), :mod:`~pg2delta.decode.typemap.json`, :mod:`~pg2delta.decode.typemap.uuid`,
  :mod:`~pg2delta.decode.typemap.datetime`, :mod:`~pg2delta.decode.typemap.network`,
  :mod:`~pg2delta.decode.typemap.bits`, :mod:`~pg2delta.decode.typemap.array` (arrays, int2vector,
  oidvector), :mod:`~pg2delta.decode.typemap.composite`, :mod:`~pg2delta.decode.typemap.range` (ranges,
  multiranges), :mod:`~pg2delta.decode.typemap.opaque` (types printed by the server,
  :class:`TextRenderer`).

Type mapping (every Arrow type is storable in Delta and readable by Spark):

==========================================  ==========================================================
PostgreSQL                                  Arrow
==========================================  ==========================================================
bool                                        bool
int2 / int4 / int8                          int16 / int32 / int64
oid                                         int64
float4 / float8                             float32 / float64 (NaN, +/-Infinity kept)
numeric(p,s), 0 <= s, p <= 38               decimal128(p, s)
numeric(p,s), s > p                         decimal128(s, s) (precision widened)
numeric(p,-k) (PG15+), p+k <= 38            decimal128(p+k, 0)
numeric unbounded, or wider than 38         string, PostgreSQL's own text ('NaN', 'Infinity', ...)
money                                       decimal128(19, 2) (see below)
text varchar bpchar name "char" json xml    string (bpchar keeps its padding)
jsonb                                       string, byte-identical to ``jsonb::text``
enum, citext and other text-like types      string
bytea                                       binary
date                                        date32 (clamped, see below)
timestamp / timestamptz                     timestamp('us') / timestamp('us', 'UTC') (clamped)
time / timetz / interval                    string, PostgreSQL text ('04:05:06.5', '1 year 2 mons')
uuid                                        string, lowercase canonical
inet / cidr                                 string (inet omits /32 and /128, cidr always has it)
macaddr / macaddr8                          string, lowercase colon form
bit / varbit                                string of 0 and 1
T[] (any element type above)                list<T> (nested lists for ndims > 1, see below)
domain                                      its base type (needs a catalog)
composite, range, multirange, other         string, PostgreSQL text form
==========================================  ==========================================================

Rules for values the lake cannot hold (each application is counted in ``notes``,
never logged with the value):

* **Timestamps and dates are clamped.** Spark and Delta hold 0001-01-01 ..
  9999-12-31 23:59:59.999999. ``infinity``, ``-infinity`` and every value outside
  that range (BC years, years >= 10000, and timestamptz values whose UTC instant
  falls outside) become the nearest bound: ``0001-01-01 00:00:00`` or
  ``9999-12-31 23:59:59.999999`` (date: ``0001-01-01`` or ``9999-12-31``). Counted in
  ``notes['timestamp_clamped']`` / ``notes['date_clamped']``.
* **NaN in a bounded numeric becomes NULL** (decimal128 has no NaN), counted in
  ``notes['numeric_nan_nulled']``. Unbounded numeric columns are strings and keep
  'NaN' and '+/-Infinity' exactly.
* **Money** is the server's int64 count of the smallest currency unit, read as
  decimal128(19, 2). This assumes an ``lc_monetary`` with 2 fractional digits (C,
  en_US, de_DE ...); text-format money is parsed as ``-$1,234.56``-like text, any
  currency symbol or thousands separator ignored.
* **Arrays**: ``codec_for(..., ndims=1)`` (the default) maps ``T[]`` to ``list<T>``;
  ``ndims=k`` maps to k nested lists (``int4[][]`` -> ``list<list<int32>>``), row-major
  (the job passes ``pg_attribute.attndims``, see
  :meth:`pg2delta.source.catalog.PgTypeCatalog.attndims`). PostgreSQL does not enforce declared
  dimensions, so a value may have more or fewer than the column: more are flattened
  into the outermost list, in order (``{{1,2},{3,4}}`` in an ``int4[]`` column ->
  ``[1, 2, 3, 4]``), counted in ``notes['array_dims_flattened']``; fewer are wrapped in
  single-element outer lists (``{1,2}`` in ``int4[][]`` -> ``[[1, 2]]``), counted in
  ``notes['array_dims_padded']``. Empty arrays are ``[]``. PostgreSQL lower bounds
  other than 1 (``'[0:1]={1,2}'``) are dropped and counted in
  ``notes['array_lower_bound_dropped']``.
* **Text forms** assume the session settings of a logical replication client:
  ``DateStyle=ISO``, ``IntervalStyle=postgres``, ``bytea_output=hex`` (escape is read
  too) and any ``extra_float_digits >= 1``. Binary values rendered to text (time,
  interval, composites, ranges ...) are printed as PostgreSQL prints them with those
  settings and ``TimeZone=UTC``.
* **Types without a decoder here** (extension types such as PostGIS geometry, and
  built-ins such as point, tsvector, pg_lsn) are strings in PostgreSQL's text form.
  Their text format passes through; their binary format (pgoutput sends binary for
  every type that has a send function) is printed by the source server itself: the
  catalog's ``render_binary`` sends the bytes back as binary parameters of that type
  and reads the output function's text (one round trip per column chunk, distinct
  values only). Without a catalog that can do this they raise DecodeError.
"""

from pg2delta.decode.typemap.array import value_of_text_array
from pg2delta.decode.typemap.codec import KIND_BINARY, KIND_NULL, KIND_TEXT, KIND_TOAST, ColumnCodec
from pg2delta.decode.typemap.numeric import numeric_typmod
from pg2delta.decode.typemap.opaque import TextRenderer
from pg2delta.decode.typemap.resolve import TypeCatalog, TypeInfo, arrow_schema, codec_for

__all__ = [
    "KIND_BINARY",
    "KIND_NULL",
    "KIND_TEXT",
    "KIND_TOAST",
    "ColumnCodec",
    "TextRenderer",
    "TypeCatalog",
    "TypeInfo",
    "arrow_schema",
    "codec_for",
    "numeric_typmod",
    "value_of_text_array",
]
