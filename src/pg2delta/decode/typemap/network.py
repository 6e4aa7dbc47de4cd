"""Network addresses as strings: inet, cidr, macaddr, macaddr8.

inet omits /32 and /128, cidr always has its mask; MAC addresses are in lowercase colon form.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from pg2delta.decode.typemap.handler import Bad, Handler, Notes, Printed, check_len1


class _Inet(Printed):
    def __init__(self, cidr: bool) -> None:
        self.cidr = cidr

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if len(data) < 4:
            raise Bad("inet shorter than its header")
        family, bits, _is_cidr, nb = data[0], data[1], data[2], data[3]
        size = 4 if family == 2 else 16 if family == 3 else 0
        if size == 0 or nb != size or len(data) != 4 + nb or bits > 8 * size:
            raise Bad("malformed inet")
        addr = data[4:]
        text = ".".join(str(b) for b in addr) if size == 4 else _ipv6_text(addr)
        if bits != 8 * size or self.cidr:
            text += f"/{bits}"
        return text


def _ipv6_text(addr: bytes) -> str:
    """inet_net_ntop_ipv6 as PostgreSQL has it (longest zero run, embedded IPv4)."""
    words = struct.unpack("!8H", addr)
    best_base, best_len, cur_base, cur_len = -1, 0, -1, 0
    for i, w in enumerate(words):
        if w == 0:
            if cur_base == -1:
                cur_base, cur_len = i, 1
            else:
                cur_len += 1
        elif cur_base != -1:
            if best_base == -1 or cur_len > best_len:
                best_base, best_len = cur_base, cur_len
            cur_base = -1
    if cur_base != -1 and (best_base == -1 or cur_len > best_len):
        best_base, best_len = cur_base, cur_len
    if best_base != -1 and best_len < 2:
        best_base = -1
    out = ""
    i = 0
    while i < 8:
        if best_base != -1 and best_base <= i < best_base + best_len:
            if i == best_base:
                out += ":"
            i += 1
            continue
        if i != 0:
            out += ":"
        if (
            i == 6
            and best_base == 0
            and (
                best_len == 6
                or (best_len == 7 and words[7] != 0x0001)
                or (best_len == 5 and words[5] == 0xFFFF)
            )
        ):
            out += ".".join(str(b) for b in addr[12:])
            break
        out += f"{words[i]:x}"
        i += 1
    if best_base != -1 and best_base + best_len == 8:
        out += ":"
    return out


class _Macaddr(Printed):
    def __init__(self, width: int) -> None:
        self.width = width

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, self.width)
        return ":".join(f"{b:02x}" for b in data)


BUILTIN: dict[str, Callable[[], Handler]] = {
    "inet": lambda: _Inet(False),
    "cidr": lambda: _Inet(True),
    "macaddr": lambda: _Macaddr(6),
    "macaddr8": lambda: _Macaddr(8),
}
