"""json and jsonb as strings.

json is its text; jsonb's binary form is a version byte (1) and the text, so the string is
byte-identical to ``jsonb::text``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from pg2delta.decode.typemap.handler import (
    Bad,
    BadAt,
    Handler,
    Notes,
    Part,
    TextLike,
    utf8,
    validated_strings,
)


class _Jsonb(TextLike):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if not data or data[0] != 1:
            raise Bad("unsupported jsonb binary version")
        return utf8(data[1:])

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: Part) -> pa.Array:
        bad = np.flatnonzero(part.lengths < 1)
        if len(bad):
            raise BadAt(int(bad[0]), "unsupported jsonb binary version")
        bad = np.flatnonzero(part.raw[part.starts] != 1)
        if len(bad):
            raise BadAt(int(bad[0]), "unsupported jsonb binary version")
        return validated_strings(part, part.starts + 1, part.lengths - 1)


BUILTIN: dict[str, Callable[[], Handler]] = {"json": TextLike, "jsonb": _Jsonb}
