"""Composite types and ``record`` as PostgreSQL's text of them, ``(a,b,...)``.

Each field is printed by the handler of its own type (resolved through the catalog when the
value is printed); :func:`quote_field` is record_out's quoting, which range_out shares.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pg2delta.decode.typemap.handler import Bad, Handler, Notes, Printed

_I32 = struct.Struct("!i")


def quote_field(v: str, specials: str) -> str:
    if v == "" or any(c in specials or c.isspace() for c in v):
        return '"' + "".join(c + c if c in '"\\' else c for c in v) + '"'
    return v


class Composite(Printed):
    def __init__(self, field_handler: Callable[[int], Handler]) -> None:
        self.field_handler = field_handler  # the handler of a field's type OID

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        try:
            (nfields,) = _I32.unpack_from(data, 0)
            pos = 4
            fields = []
            for _ in range(nfields):
                oid, n = struct.unpack_from("!Ii", data, pos)
                pos += 8
                if n < -1 or pos + max(n, 0) > len(data):
                    raise Bad("record field overruns the value")
                if n == -1:
                    fields.append("")
                else:
                    text = self.field_handler(oid).pg_text(data[pos : pos + n])
                    fields.append(quote_field(text, '"\\(),'))
                    pos += n
        except struct.error:
            raise Bad("record value is truncated") from None
        if pos != len(data) or nfields < 0:
            raise Bad("record value has trailing bytes")
        return "(" + ",".join(fields) + ")"
