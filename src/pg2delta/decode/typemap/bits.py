"""bit and varbit as strings of 0 and 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pg2delta.decode.typemap.handler import Bad, Handler, Notes, Printed


class _Bits(Printed):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if len(data) < 4:
            raise Bad("bit string shorter than its header")
        nbits = int.from_bytes(data[:4], "big", signed=True)
        if nbits < 0 or len(data) != 4 + (nbits + 7) // 8:
            raise Bad("bit string length does not match")
        return "".join(f"{b:08b}" for b in data[4:])[:nbits]


BUILTIN: dict[str, Callable[[], Handler]] = {"bit": _Bits, "varbit": _Bits}
