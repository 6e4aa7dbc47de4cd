"""bool: ``t`` / ``f`` in text, one byte in binary, Arrow bool."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from pg2delta.decode.typemap.handler import Bad, BadAt, Handler, Notes, Part, check_len, check_len1


class _Bool(Handler):
    arrow_type = pa.bool_()

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if data == b"t":
            return True
        if data == b"f":
            return False
        raise Bad("bool text is not t or f")

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 1)
        return data[0] != 0

    def pg_text(self, data: bytes) -> str:
        return "t" if self.ref_binary(data, collections.Counter()) else "f"

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, 1)
        return pa.array(part.raw[part.starts] != 0, type=pa.bool_())

    def vec_text(self, part: Part) -> pa.Array:
        check_len(part, 1)
        c = part.raw[part.starts]
        bad = np.flatnonzero((c != ord("t")) & (c != ord("f")))
        if len(bad):
            raise BadAt(int(bad[0]), "bool text is not t or f")
        return pa.array(c == ord("t"), type=pa.bool_())


BUILTIN: dict[str, Callable[[], Handler]] = {"bool": _Bool}
