"""uuid as a string in the lowercase canonical form (binary values formatted in bulk)."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from pg2delta.decode.typemap.handler import (
    Handler,
    Notes,
    Part,
    TextLike,
    check_len,
    check_len1,
    gather_fixed,
    string_array,
)

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_UUID_POS = np.array([0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34], dtype=np.int64)


class _Uuid(TextLike):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 16)
        h = data.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, 16)
        n = len(part.starts)
        b = gather_fixed(part.raw, part.starts, 16)
        out = np.full((n, 36), ord("-"), dtype=np.uint8)
        out[:, _UUID_POS] = _HEX[b >> 4]
        out[:, _UUID_POS + 1] = _HEX[b & 15]
        offsets = np.arange(0, 36 * (n + 1), 36, dtype=np.int64)
        return string_array(out.reshape(-1), offsets)


BUILTIN: dict[str, Callable[[], Handler]] = {"uuid": _Uuid}
