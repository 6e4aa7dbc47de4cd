"""Types without a decoder here, printed by the source server.

Extension types such as PostGIS geometry, and built-ins such as point, tsvector or pg_lsn: their
text passes through, their binary values are printed by the source server
(:class:`TextRenderer`, a capability of the catalog).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import pyarrow as pa

from pg2delta.decode.typemap.handler import Bad, Notes, Part, Printed


class TextRenderer(Protocol):
    """Optional catalog capability: print binary values of a type as its text output, in order.

    Raises ValueError when the bytes are not a value of the type.
    """

    def render_binary(self, type_oid: int, values: Sequence[bytes]) -> list[str]: ...


_OPAQUE_CACHE_BYTES = 16 << 20


class Opaque(Printed):
    """A type with no binary decoder here: text passes through; binary is printed by the server.

    pgoutput sends every type that has a binary send function in binary, so extension types
    (and a few built-ins such as point or tsvector) arrive as bytes only their own receive
    function understands. The catalog's :meth:`TextRenderer.render_binary` asks the source
    server to read them back and print them with the type's output function: the same text
    the value has in text format. Without such a catalog they raise DecodeError.
    """

    server_printed = True

    def __init__(self, name: str, oid: int = 0, catalog: object = None) -> None:
        self.name = name
        self.oid = oid
        render = getattr(catalog, "render_binary", None)
        self._render: Callable[[int, Sequence[bytes]], list[str]] | None = render if callable(render) else None
        self._cache: dict[bytes, str] = {}  # recent values (repeat across chunks), bounded
        self._cached_bytes = 0

    def _texts(self, values: Sequence[bytes]) -> list[str]:
        if self._render is None or not self.oid:
            raise Bad(f"no binary decoder for type {self.name} and no source server to print it")
        cache = self._cache
        todo = [v for v in dict.fromkeys(values) if v not in cache]
        if todo:
            try:
                texts = self._render(self.oid, todo)
            except ValueError as exc:
                raise Bad(f"the server cannot read this binary value: {exc}") from None
            found = dict(zip(todo, texts, strict=True))
            out = [cache[v] if v in cache else found[v] for v in values]
            if self._cached_bytes > _OPAQUE_CACHE_BYTES:
                cache.clear()
                self._cached_bytes = 0
            cache.update(found)
            self._cached_bytes += sum(len(v) + len(t) for v, t in found.items())
            return out
        return [cache[v] for v in values]

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return self._texts([data])[0]

    def vec_binary(self, part: Part) -> pa.Array | None:
        try:
            return pa.array(self._texts(part.values()), type=pa.string())
        except Bad:
            return None  # the per-value path finds the row and says what is wrong
