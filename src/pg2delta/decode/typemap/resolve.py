"""Resolution: which handler decodes a column, from its type OID, typmod and the catalog.

Built-in types come from the generated :mod:`pg2delta.decode._oids` table and each family's
``BUILTIN`` handlers; others from the catalog (:class:`TypeCatalog`): domains take their base
type's handler, arrays wrap their element's codec, enums are strings, composites, ranges and
multiranges print through their fields' handlers, and anything else is printed by the server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from pg2delta.decode import _oids
from pg2delta.decode.typemap import array, bits, boolean, datetime, json, network, numeric, text, uuid
from pg2delta.decode.typemap.array import PgArray
from pg2delta.decode.typemap.codec import ColumnCodec
from pg2delta.decode.typemap.composite import Composite
from pg2delta.decode.typemap.handler import Handler, TextLike
from pg2delta.decode.typemap.numeric import numeric_handler, numeric_typmod
from pg2delta.decode.typemap.opaque import Opaque
from pg2delta.decode.typemap.range import Multirange, Range


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """What the catalog knows about a type OID.

    ``elem_oid`` is set only for true array types (varlena, category 'A').
    ``base_typmod`` is the domain's own typmod (``pg_type.typtypmod``), -1 if none.
    ``send_proc`` is the name of the binary send function (``pg_type.typsend``), used
    to read binary values of extension types whose binary form is their text.
    For a multirange, ``subtype_oid`` is the subtype of its range.
    """

    oid: int
    namespace: str
    name: str
    typtype: str
    base_oid: int = 0
    elem_oid: int = 0
    subtype_oid: int = 0
    base_typmod: int = -1
    send_proc: str = ""


class TypeCatalog(Protocol):
    def type_info(self, oid: int) -> TypeInfo | None: ...


_BUILTIN: dict[str, Callable[[], Handler]] = {
    **boolean.BUILTIN,
    **numeric.BUILTIN,
    **text.BUILTIN,
    **json.BUILTIN,
    **uuid.BUILTIN,
    **datetime.BUILTIN,
    **network.BUILTIN,
    **bits.BUILTIN,
    **array.BUILTIN,
}
# Catalog types sent with a text type's send function: their binary form is their UTF-8 text.
_TEXT_SENDS = frozenset(
    {"textsend", "varcharsend", "bpcharsend", "enum_send", "namesend", "json_send", "xml_send"}
)


def _field_handler(catalog: TypeCatalog | None) -> Callable[[int], Handler]:
    """The handler of a composite's field type or a range's subtype, resolved when a value is printed."""
    return lambda oid: codec_for(oid, -1, catalog).handler


def _type_label(name: str, typmod: int) -> str:
    if name == "numeric":
        pm = numeric_typmod(typmod)
        return "numeric" if pm is None else f"numeric({pm[0]},{pm[1]})"
    if name in ("varchar", "bpchar") and typmod >= 4:
        return f"{name}({typmod - 4})"
    if name in ("bit", "varbit") and typmod >= 0:
        return f"{name}({typmod})"
    return name


def codec_for(
    type_oid: int, type_modifier: int, catalog: TypeCatalog | None = None, *, ndims: int = 1
) -> ColumnCodec:
    """The codec of one column. ``ndims`` is the nesting depth used for array columns."""
    builtin = _oids.BY_OID.get(type_oid)
    if builtin is not None:
        return _builtin_codec(builtin, type_modifier, catalog, ndims)
    info = catalog.type_info(type_oid) if catalog is not None else None
    if info is None:
        return ColumnCodec(f"oid {type_oid}", Opaque(f"oid {type_oid}", type_oid, catalog))
    label = f"{info.namespace}.{info.name}"
    if info.typtype == "d" and info.base_oid:
        base = codec_for(
            info.base_oid, info.base_typmod if type_modifier < 0 else type_modifier, catalog, ndims=ndims
        )
        return ColumnCodec(f"{label} ({base.pg_type})", base.handler)
    if info.elem_oid:
        elem = codec_for(info.elem_oid, type_modifier, catalog)
        return ColumnCodec(f"{elem.pg_type}[]", PgArray(elem, max(ndims, 1), info.elem_oid))
    if info.typtype == "e":
        return ColumnCodec(label, TextLike())
    if info.typtype == "c":
        return ColumnCodec(label, Composite(_field_handler(catalog)))
    if info.typtype == "r" and info.subtype_oid:
        return ColumnCodec(label, Range(info.subtype_oid, _field_handler(catalog)))
    if info.typtype == "m" and info.subtype_oid:
        return ColumnCodec(label, Multirange(info.subtype_oid, _field_handler(catalog)))
    if info.send_proc in _TEXT_SENDS:
        return ColumnCodec(label, TextLike())
    return ColumnCodec(label, Opaque(label, type_oid, catalog))


def _builtin_codec(t: _oids.BuiltinType, typmod: int, catalog: TypeCatalog | None, ndims: int) -> ColumnCodec:
    if t.typelem and t.typlen == -1 and t.typcategory == "A" and t.name not in ("int2vector", "oidvector"):
        elem = codec_for(t.typelem, typmod, catalog)
        return ColumnCodec(f"{elem.pg_type}[]", PgArray(elem, max(ndims, 1), t.typelem))
    label = _type_label(t.name, typmod)
    if t.name == "numeric":
        return ColumnCodec(label, numeric_handler(typmod))
    make = _BUILTIN.get(t.name)
    if make is not None:
        return ColumnCodec(label, make())
    if t.typtype == "r":
        return ColumnCodec(label, Range(t.subtype_oid, _field_handler(catalog)))
    if t.typtype == "m":
        return ColumnCodec(label, Multirange(t.subtype_oid, _field_handler(catalog)))
    if t.name == "record":
        return ColumnCodec(label, Composite(_field_handler(catalog)))
    return ColumnCodec(label, Opaque(label, t.oid, catalog))


def arrow_schema(
    columns: Sequence[tuple[str, int, int] | tuple[str, int, int, int]], catalog: TypeCatalog | None = None
) -> pa.Schema:
    """Arrow schema of a relation: (name, type_oid, typmod[, ndims]) per column, all nullable."""
    fields = []
    for col in columns:
        name, oid, typmod = col[0], col[1], col[2]
        ndims = col[3] if len(col) > 3 else 1
        codec = codec_for(oid, typmod, catalog, ndims=ndims)
        fields.append(pa.field(name, codec.arrow_type, nullable=True, metadata={"pg_type": codec.pg_type}))
    return pa.schema(fields)
