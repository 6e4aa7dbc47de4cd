"""Character and byte strings: text, varchar, bpchar, name, xml, "char", bytea.

The text types' text and binary forms are the same UTF-8 (:class:`TextLike`, validated in
bulk); bpchar keeps its padding. "char" is one raw byte in binary, printed as charout does.
bytea is Arrow binary: raw bytes in binary, hex or escape form in text.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from pg2delta.decode.typemap.handler import Bad, Handler, Notes, Part, TextLike, check_len1, gather_strings


class _Char(TextLike):
    """The one-byte "char" type: binary is the raw byte, text is charout's."""

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 1)
        ch = data[0]
        if ch == 0:
            return ""
        if ch >= 0x80:
            return "\\" + f"{ch:03o}"
        return chr(ch)

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: Part) -> None:
        return None


class _Bytea(Handler):
    arrow_type = pa.binary()

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return data

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if data.startswith(b"\\x"):
            try:
                return bytes.fromhex(data[2:].decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                raise Bad("bad bytea hex") from None
        out = bytearray()
        i = 0
        while i < len(data):
            c = data[i]
            if c != 0x5C:
                out.append(c)
                i += 1
            elif data[i + 1 : i + 2] == b"\\":
                out.append(0x5C)
                i += 2
            elif re.fullmatch(rb"[0-3][0-7][0-7]", data[i + 1 : i + 4]):
                out.append(int(data[i + 1 : i + 4], 8))
                i += 4
            else:
                raise Bad("bad bytea escape")
        return bytes(out)

    def pg_text(self, data: bytes) -> str:
        return "\\x" + data.hex()

    def vec_binary(self, part: Part) -> pa.Array:
        return gather_strings(part.raw, part.starts, part.lengths, binary=True)


def _text_like() -> Handler:
    return TextLike()


BUILTIN: dict[str, Callable[[], Handler]] = {
    "text": _text_like,
    "varchar": _text_like,
    "bpchar": _text_like,
    "name": _text_like,
    "xml": _text_like,
    "unknown": _text_like,
    "refcursor": _text_like,
    "char": _Char,
    "bytea": _Bytea,
}
