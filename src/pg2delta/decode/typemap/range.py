"""Ranges and multiranges as PostgreSQL's text of them (``[1,5)``, ``{[1,2),[4,5)}``).

Each bound is printed by the handler of the range's subtype.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pg2delta.decode.typemap.composite import quote_field
from pg2delta.decode.typemap.handler import Bad, Handler, Notes, Printed

_I32 = struct.Struct("!i")


class Range(Printed):
    def __init__(self, subtype_oid: int, field_handler: Callable[[int], Handler]) -> None:
        self.subtype_oid = subtype_oid
        self.field_handler = field_handler  # the handler of a type OID

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if not data:
            raise Bad("empty range value")
        flags = data[0]
        if flags & 0x01:
            if len(data) != 1:
                raise Bad("range value has trailing bytes")
            return "empty"
        pos = 1
        sub = self.field_handler(self.subtype_oid)
        bounds = []
        for inf in (0x08, 0x10):
            if flags & inf:
                bounds.append("")
                continue
            if pos + 4 > len(data):
                raise Bad("range value is truncated")
            (n,) = _I32.unpack_from(data, pos)
            pos += 4
            if n < 0 or pos + n > len(data):
                raise Bad("range bound overruns the value")
            bounds.append(quote_field(sub.pg_text(data[pos : pos + n]), '"\\()[],'))
            pos += n
        if pos != len(data):
            raise Bad("range value has trailing bytes")
        return f"{'[' if flags & 0x02 else '('}{bounds[0]},{bounds[1]}{']' if flags & 0x04 else ')'}"


class Multirange(Range):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        try:
            (count,) = _I32.unpack_from(data, 0)
            pos = 4
            parts = []
            for _ in range(count):
                (n,) = _I32.unpack_from(data, pos)
                pos += 4
                if n < 0 or pos + n > len(data):
                    raise Bad("multirange element overruns the value")
                parts.append(super().ref_binary(data[pos : pos + n], notes))
                pos += n
        except struct.error:
            raise Bad("multirange value is truncated") from None
        if pos != len(data) or count < 0:
            raise Bad("multirange value has trailing bytes")
        return "{" + ",".join(parts) + "}"
