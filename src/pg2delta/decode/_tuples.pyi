"""Types of the C extension ``_tuples.c`` (see its header comment for the contracts)."""

import numpy as np
import numpy.typing as npt

_Bytes = bytes | npt.NDArray[np.uint8]

def walk_changes(
    buf: _Bytes,
    tags: npt.NDArray[np.uint8],
    offs: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    ncols: int,
    new_kinds: npt.NDArray[np.uint8],
    new_starts: npt.NDArray[np.int64],
    new_lengths: npt.NDArray[np.int64],
    old_kinds: npt.NDArray[np.uint8],
    old_starts: npt.NDArray[np.int64],
    old_lengths: npt.NDArray[np.int64],
    markers: npt.NDArray[np.uint8],
    /,
) -> tuple[int, str, int] | None: ...
def walk_copy(
    buf: _Bytes,
    pos: int,
    ncols: int,
    value_kinds: bytes,
    kinds: npt.NDArray[np.uint8],
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    /,
) -> tuple[int, int, int, str | None]: ...
def gather_fixed(
    buf: _Bytes, starts: npt.NDArray[np.int64], width: int, out: npt.NDArray[np.uint8], swap: bool, /
) -> None: ...
def gather_var(
    buf: _Bytes, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], offsets: npt.NDArray[np.int32], /
) -> bytes: ...
def numeric_decimal128(
    buf: _Bytes,
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    scale: int,
    precision: int,
    out: npt.NDArray[np.uint8],
    valid: npt.NDArray[np.uint8],
    /,
) -> int: ...
def numeric_texts(
    buf: _Bytes, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], offsets: npt.NDArray[np.int32], /
) -> bytes | int: ...
def array_counts(
    buf: _Bytes,
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    elem_oid: int,
    counts: npt.NDArray[np.int64],
    /,
) -> int: ...
def array_elements(
    buf: _Bytes,
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    elem_oid: int,
    estarts: npt.NDArray[np.int64],
    elens: npt.NDArray[np.int64],
    /,
) -> int: ...
def drain_copy(
    get_copy_data: int, freemem: int, consume_input: int, conn: int, limit: int, /
) -> tuple[int, bytes]: ...
def hash_ranges(
    buf: _Bytes, starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], out: npt.NDArray[np.uint64], /
) -> None: ...
