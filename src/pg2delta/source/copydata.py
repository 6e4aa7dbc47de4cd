"""Binary COPY streams read from libpq: ``COPY … TO STDOUT (FORMAT binary)`` taken in blocks of
CopyData straight from libpq (:func:`copy_blocks`), and their rows walked in C (:class:`CopyWalk`).
The window read (:meth:`pg2delta.source.slot.SlotSource.read_window`) and a table's copy
(:mod:`pg2delta.source.copy`, the bootstrap's staging) both read their COPY through them.
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import psycopg
from psycopg import pq as libpq
from psycopg import sql

from pg2delta.decode import _tuples
from pg2delta.errors import DecodeError

_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_COPY_HEADER_LEN = 19  # signature (11) + flags (4) + extension length (4)
TRAILER = b"\xff\xff"  # the end of binary COPY data


class CopyWalk:
    """Binary COPY data (``COPY … TO STDOUT (FORMAT binary)``), walked in C: the file header, then
    rows of ``ncols`` fields (``_tuples.walk_copy``: field count, per field its length, -1 for NULL,
    and the bytes, every read bounds-checked), then the trailer. The window read and the
    bootstrap's copy both read their COPY through it. ``subject`` names the stream in errors
    (``COPY of public.t``); ``malformed`` is the message of a bad row, with ``{row}`` and ``{reason}``."""

    def __init__(self, ncols: int, value_kinds: bytes, cap: int, subject: str, malformed: str) -> None:
        self.ncols, self.value_kinds, self.cap = ncols, value_kinds, cap
        self.subject, self.malformed = subject, malformed
        self.rows = 0  # rows walked so far
        self.header_seen = False
        self.ended = False

    def walk(self, buf: bytes, take: Callable[[Any, Any, Any], bool], *, last: bool = False) -> int:
        """Hand the whole rows of ``buf`` to ``take(kinds, starts, lengths)`` (per column, at most
        ``cap`` rows a call; ``take`` returns False to stop there). Returns the offset of the rest: a
        row cut at the end of ``buf``, to be completed by the next blocks. ``last``: no more come."""
        pos = 0
        if not self.header_seen:
            if len(buf) < _COPY_HEADER_LEN:
                if last:
                    raise DecodeError(f"{self.subject} ends in its header", offset=0)
                return 0
            if not buf.startswith(_COPY_SIGNATURE):
                raise DecodeError(f"{self.subject} without binary signature", offset=0)
            pos = _COPY_HEADER_LEN + int.from_bytes(buf[_COPY_HEADER_LEN - 4:_COPY_HEADER_LEN], "big")
            if len(buf) < pos:
                if last:
                    raise DecodeError(f"{self.subject} ends in its header", offset=0)
                return 0
            self.header_seen = True
        while pos < len(buf):
            if self.ended:
                raise DecodeError(f"{self.subject}: bytes after the trailer (after the end of the data)", offset=pos)
            kinds = np.empty((self.ncols, self.cap), dtype=np.uint8)
            starts = np.empty((self.ncols, self.cap), dtype=np.int64)
            lengths = np.empty((self.ncols, self.cap), dtype=np.int64)
            n, nxt, status, reason = _tuples.walk_copy(buf, pos, self.ncols, self.value_kinds, kinds, starts, lengths)
            if status == 2:
                raise DecodeError(self.malformed.format(row=self.rows + n, reason=reason), offset=nxt)
            go_on = True
            if n:
                go_on = take(kinds[:, :n], starts[:, :n], lengths[:, :n])
                self.rows += n
            pos = nxt
            if status == 1:
                self.ended = True
            if not go_on:
                return pos
            if status != 1 and n < self.cap:
                break  # the rest is a row cut at the end of buf
        if last and not self.ended:
            raise DecodeError(f"{self.subject} ends without its trailer (a row cut short?)", offset=pos)
        return pos


# Bytes of CopyData taken from libpq per call of _tuples.drain_copy.
DRAIN_BYTES = 1 << 20
# When libpq has drained everything, wait for the socket, then this long more before draining
# again: the server sends a COPY in packets of a few KB, so without the pause each wake-up took
# about 125 rows (8,000 wake-ups per 1,000,000 rows, each a system call and a Python loop turn);
# with it each takes what arrived meanwhile (measured, bench/README.md: the bootstrap's staging
# uses less CPU, the bench's bootstrap 3.4-3.6 s against 3.7 s; the window read, which waits for
# the server, unchanged). The server does not wait for it: the kernel's receive buffer holds
# what arrives in the meantime.
DRAIN_PAUSE = 0.001
_DRAIN_WAIT = 0.1  # the longest wait for the socket before libpq is asked again


@functools.cache
def libpq_copy_functions() -> tuple[int, int, int] | None:
    """The addresses of PQgetCopyData, PQfreemem and PQconsumeInput in the libpq psycopg uses, for
    :func:`copy_blocks` to call from C; None where that library cannot be told for sure (not Linux,
    more than one libpq loaded, another version than psycopg's), and the copy reads through psycopg."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {
                path
                for fields in (line.split(maxsplit=5) for line in maps)
                if len(fields) == 6 and (path := fields[5].strip())
                and os.path.basename(path).startswith("libpq") and ".so" in path
            }
    except OSError:
        return None
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths.pop())  # loaded already: the very library psycopg calls
        lib.PQlibVersion.restype = ctypes.c_int
        if lib.PQlibVersion() != libpq.version():
            return None
        return tuple(  # type: ignore[return-value]
            ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
            for name in ("PQgetCopyData", "PQfreemem", "PQconsumeInput")
        )
    except (OSError, AttributeError):
        return None


def copy_blocks(
    conn: psycopg.Connection[Any], statement: sql.Composed, *, direct: bool = True
) -> Generator[bytes | memoryview, None, None]:
    """The data of ``COPY … TO STDOUT`` on ``conn``, in blocks of one or more whole CopyData messages.

    Whatever libpq holds, or can read from the socket without waiting, is taken from it in C
    (:func:`_tuples.drain_copy`, given libpq's functions by :func:`libpq_copy_functions`), up to
    :data:`DRAIN_BYTES` per block: no Python work per row. Without those functions (or ``direct``
    False) each CopyData message is taken straight from psycopg's ``PGconn.get_copy_data``, a block
    each. When libpq has nothing whole buffered, the C path waits for the socket and
    :data:`DRAIN_PAUSE` more, then drains again; the per-message path lets psycopg's ``Copy.read``
    wait (and read the end of the copy, when it comes there). When the end comes in a direct read,
    its final result is read here, as psycopg would, and an error raised as psycopg raises it.
    """
    pgconn = conn.pgconn
    # (pgconn_ptr: the PGconn's address, in every psycopg 3 implementation; not in its type stubs)
    address: int | None = getattr(pgconn, "pgconn_ptr", None)
    drain = None
    if direct and address is not None and (functions := libpq_copy_functions()) is not None:
        drain = functools.partial(_tuples.drain_copy, *functions, address, DRAIN_BYTES)
    with conn.cursor() as cur, cur.copy(statement) as copy:
        while True:
            if drain is not None:
                status, data = drain()
                if data:
                    yield data
                if status == 1:
                    continue
                if status == 0:
                    # Nothing whole is buffered: wait for the socket (the GIL released), pause so
                    # that more arrives, and drain again. A timeout, not a wait for ever: a
                    # message already inside the SSL layer leaves the socket quiet.
                    select.select([pgconn.socket], [], [], _DRAIN_WAIT)
                    time.sleep(DRAIN_PAUSE)
                    continue
                nbytes = status
            else:
                nbytes, block = pgconn.get_copy_data(1)  # 1: never block
                if nbytes > 0:
                    yield block
                    continue
            if nbytes == 0:
                if not (waited := copy.read()):
                    return
                yield memoryview(waited)
            elif nbytes == -1:  # the end of the copy: its final result (an error, if the server failed)
                failed = None
                while (res := pgconn.get_result()) is not None:
                    if res.status != libpq.ExecStatus.COMMAND_OK and failed is None:
                        failed = res
                if failed is not None:
                    raise psycopg.errors.error_from_result(failed, encoding=conn.info.encoding)
                return
            else:
                raise psycopg.OperationalError(pgconn.get_error_message(conn.info.encoding))


__all__ = ["DRAIN_BYTES", "DRAIN_PAUSE", "TRAILER", "CopyWalk", "copy_blocks", "libpq_copy_functions"]
