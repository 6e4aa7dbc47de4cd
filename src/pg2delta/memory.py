"""Freed memory back to the system: the driver's decoded batches and the embedded engine's queries
share one process, whose peak resident set is what a run needs (``make bench-memory``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import pyarrow as pa


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, None elsewhere (another libc, or none found)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_memory() -> None:
    """Give freed memory back to the system: Arrow's pool and the C heap (which the embedded engine,
    in the same process, uses too) keep what was freed for later allocations, so the batches of a
    spill or of a finished query would otherwise stay in the process's resident set."""
    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


__all__ = ["release_memory"]
