"""Log sequence numbers: PostgreSQL's ``X/Y`` text form and the 64-bit integer behind it."""

from __future__ import annotations

import re

from pg2delta.errors import ConfigError

_LSN_RE = re.compile(r"^\s*([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})\s*$")

MAX_LSN = 0xFFFFFFFFFFFFFFFF


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> ``0x16B374D848``. Raises :class:`ConfigError` on anything else."""
    m = _LSN_RE.match(text)
    if not m:
        raise ConfigError(f"not an LSN: {text!r} (expected the X/Y form, e.g. 0/16B3748)")
    return (int(m.group(1), 16) << 32) | int(m.group(2), 16)


def format_lsn(value: int) -> str:
    """``0x16B374D848`` -> ``'16/B374D848'``."""
    if not 0 <= value <= MAX_LSN:
        raise ValueError(f"LSN out of range: {value}")
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
