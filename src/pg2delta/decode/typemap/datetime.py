"""Dates and times: date, timestamp, timestamptz, time, timetz, interval.

date, timestamp and timestamptz become Arrow dates and timestamps, clamped to what Spark and
Delta hold (0001-01-01 .. 9999-12-31, counted in notes); time, timetz and interval are
PostgreSQL's text of them.

The text parsers read DateStyle=ISO; the printers (``_fmt_*``) write what PostgreSQL's output
functions write with DateStyle=ISO, IntervalStyle=postgres and TimeZone=UTC.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from pg2delta.decode.typemap.handler import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    Bad,
    Handler,
    Notes,
    Part,
    Printed,
    check_len,
    check_len1,
    gather_be,
    gather_strings,
)

# PostgreSQL epoch (2000-01-01) relative to the Unix epoch.
PG_EPOCH_DAYS = 10957
PG_EPOCH_US = PG_EPOCH_DAYS * 86_400_000_000
TS_MIN_US = -62135596800_000_000  # 0001-01-01 00:00:00 UTC, Unix microseconds
TS_MAX_US = 253402300799_999_999  # 9999-12-31 23:59:59.999999
DATE_MIN = -719162  # 0001-01-01, Unix days
DATE_MAX = 2932896  # 9999-12-31


def _days_from_civil(y: int, m: int, d: int) -> int:
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


def _civil_from_days(z: int) -> tuple[int, int, int]:
    z += 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    y = yoe + era * 400
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    m = mp + (3 if mp < 10 else -9)
    return y + (m <= 2), m, d


def _frac(us: int) -> str:
    return "" if us == 0 else "." + f"{us:06d}".rstrip("0")


def _fmt_date_days(days: int) -> str:
    y, m, d = _civil_from_days(days)
    return f"{y:04d}-{m:02d}-{d:02d}" if y > 0 else f"{1 - y:04d}-{m:02d}-{d:02d} BC"


def _fmt_ts(us_pg: int, tz: bool) -> str:
    """timestamp_out / timestamptz_out (DateStyle ISO, TimeZone UTC) of PostgreSQL microseconds."""
    if us_pg == INT64_MAX:
        return "infinity"
    if us_pg == INT64_MIN:
        return "-infinity"
    days, rem = divmod(us_pg + PG_EPOCH_US, 86_400_000_000)
    y, m, d = _civil_from_days(days)
    secs, us = divmod(rem, 1_000_000)
    text = f"{(y if y > 0 else 1 - y):04d}-{m:02d}-{d:02d} {secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}"
    text += _frac(us)
    if tz:
        text += "+00"
    return text if y > 0 else text + " BC"


def _fmt_time(us: int) -> str:
    secs, frac = divmod(us, 1_000_000)
    return f"{secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}" + _frac(frac)


def _fmt_offset(east: int) -> str:
    sign = "-" if east < 0 else "+"
    a = abs(east)
    text = f"{sign}{a // 3600:02d}"
    if a % 3600:
        text += f":{a // 60 % 60:02d}"
        if a % 60:
            text += f":{a % 60:02d}"
    return text


def _ctrunc(a: int, b: int) -> int:
    """C integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _fmt_interval(time_us: int, days: int, months: int) -> str:
    """interval_out with IntervalStyle=postgres."""
    if months == INT32_MAX and days == INT32_MAX and time_us == INT64_MAX:
        return "infinity"
    if months == INT32_MIN and days == INT32_MIN and time_us == INT64_MIN:
        return "-infinity"
    year = _ctrunc(months, 12)
    mon = months - year * 12
    hour = _ctrunc(time_us, 3_600_000_000)
    t = time_us - hour * 3_600_000_000
    minute = _ctrunc(t, 60_000_000)
    t -= minute * 60_000_000
    sec = _ctrunc(t, 1_000_000)
    fsec = t - sec * 1_000_000
    parts: list[str] = []
    is_zero = True
    is_before = False
    for value, unit in ((year, "year"), (mon, "mon"), (days, "day")):
        if value == 0:
            continue
        plus = "+" if is_before and value > 0 else ""
        parts.append(f"{'' if is_zero else ' '}{plus}{value} {unit}{'' if value == 1 else 's'}")
        is_before = value < 0
        is_zero = False
    if is_zero or hour or minute or sec or fsec:
        minus = hour < 0 or minute < 0 or sec < 0 or fsec < 0
        sign = "-" if minus else ("+" if is_before else "")
        parts.append(
            f"{'' if is_zero else ' '}{sign}{abs(hour):02d}:{abs(minute):02d}:{abs(sec):02d}{_frac(abs(fsec))}"
        )
    return "".join(parts)


_TS_RE = re.compile(
    rb"(\d{4,})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    rb"(?:([+-])(\d\d)(?::(\d\d)(?::(\d\d))?)?)?( BC)?"
)
_DATE_RE = re.compile(rb"(\d{4,})-(\d\d)-(\d\d)( BC)?")


def _clamp_us(us: int, notes: Notes) -> int:
    if us < TS_MIN_US:
        notes["timestamp_clamped"] += 1
        return TS_MIN_US
    if us > TS_MAX_US:
        notes["timestamp_clamped"] += 1
        return TS_MAX_US
    return us


def _parse_ts_text(data: bytes, tz: bool, notes: Notes) -> int:
    if data == b"infinity":
        notes["timestamp_clamped"] += 1
        return TS_MAX_US
    if data == b"-infinity":
        notes["timestamp_clamped"] += 1
        return TS_MIN_US
    m = _TS_RE.fullmatch(data)
    if m is None or (m.group(8) is not None) != tz:
        raise Bad("not an ISO timestamp")
    year = int(m.group(1))
    if m.group(12):
        year = 1 - year
    mon, day, hh, mi, ss = (int(m.group(i)) for i in range(2, 7))
    if not (1 <= mon <= 12 and 1 <= day <= 31 and hh <= 24 and mi < 60 and ss <= 60):
        raise Bad("timestamp field out of range")
    frac = int((m.group(7) or b"").ljust(6, b"0"))
    us = ((_days_from_civil(year, mon, day) * 24 + hh) * 60 + mi) * 60 + ss
    if tz:
        off = int(m.group(9)) * 3600 + int(m.group(10) or 0) * 60 + int(m.group(11) or 0)
        us -= off if m.group(8) == b"+" else -off
    return _clamp_us(us * 1_000_000 + frac, notes)


def _parse_date_text(data: bytes, notes: Notes) -> int:
    if data in (b"infinity", b"-infinity"):
        notes["date_clamped"] += 1
        return DATE_MAX if data == b"infinity" else DATE_MIN
    m = _DATE_RE.fullmatch(data)
    if m is None:
        raise Bad("not an ISO date")
    year = int(m.group(1))
    if m.group(4):
        year = 1 - year
    mon, day = int(m.group(2)), int(m.group(3))
    if not (1 <= mon <= 12 and 1 <= day <= 31):
        raise Bad("date field out of range")
    days = _days_from_civil(year, mon, day)
    if days < DATE_MIN or days > DATE_MAX:
        notes["date_clamped"] += 1
        return DATE_MIN if days < DATE_MIN else DATE_MAX
    return days


class _Date(Handler):
    arrow_type = pa.date32()

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        return _parse_date_text(data, notes)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 4)
        v = int.from_bytes(data, "big", signed=True)
        if v == INT32_MAX:
            notes["date_clamped"] += 1
            return DATE_MAX
        if v == INT32_MIN:
            notes["date_clamped"] += 1
            return DATE_MIN
        days = v + PG_EPOCH_DAYS
        if not DATE_MIN <= days <= DATE_MAX:
            notes["date_clamped"] += 1
            return min(max(days, DATE_MIN), DATE_MAX)
        return days

    def pg_text(self, data: bytes) -> str:
        check_len1(data, 4)
        v = int.from_bytes(data, "big", signed=True)
        if v in (INT32_MAX, INT32_MIN):
            return "infinity" if v > 0 else "-infinity"
        return _fmt_date_days(v + PG_EPOCH_DAYS)

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, 4)
        v = gather_be(part.raw, part.starts, ">i4").astype(np.int64) + PG_EPOCH_DAYS
        clamped = (v < DATE_MIN) | (v > DATE_MAX)
        if clamped.any():
            part.notes["date_clamped"] += int(clamped.sum())
            v = np.clip(v, DATE_MIN, DATE_MAX)
        return pa.array(v.astype(np.int32), type=pa.date32())


class _Timestamp(Handler):
    def __init__(self, tz: bool) -> None:
        self.tz = tz
        self.arrow_type = pa.timestamp("us", tz="UTC") if tz else pa.timestamp("us")

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        return _parse_ts_text(data, self.tz, notes)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 8)
        v = int.from_bytes(data, "big", signed=True)
        if v in (INT64_MAX, INT64_MIN):
            notes["timestamp_clamped"] += 1
            return TS_MAX_US if v > 0 else TS_MIN_US
        return _clamp_us(v + PG_EPOCH_US, notes)

    def pg_text(self, data: bytes) -> str:
        check_len1(data, 8)
        return _fmt_ts(int.from_bytes(data, "big", signed=True), self.tz)

    def _clamped(self, v: NDArray[np.int64], notes: Notes) -> pa.Array:
        clamped = (v < TS_MIN_US) | (v > TS_MAX_US)
        if clamped.any():
            notes["timestamp_clamped"] += int(clamped.sum())
            v = np.clip(v, TS_MIN_US, TS_MAX_US)
        return pa.array(v, type=self.arrow_type)

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, 8)
        v = gather_be(part.raw, part.starts, ">i8")
        inf = (v == INT64_MAX) | (v == INT64_MIN)
        # infinities and anything past the bounds clamp; shifting cannot overflow for finite PG values
        shifted = np.where(inf, np.where(v > 0, TS_MAX_US + 1, TS_MIN_US - 1), v + PG_EPOCH_US)
        return self._clamped(shifted, part.notes)

    _FAST_TS = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?$"
    _FAST_TSTZ = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?[+-]\d\d(:\d\d)?$"

    def vec_text(self, part: Part) -> pa.Array | None:
        strings = gather_strings(part.raw, part.starts, part.lengths, binary=True)
        try:
            strings = strings.cast(pa.string())
        except pa.ArrowInvalid:
            return None
        if not pc.all(
            pc.match_substring_regex(strings, self._FAST_TSTZ if self.tz else self._FAST_TS)
        ).as_py():
            return None
        try:
            cast = pc.cast(strings, self.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        return self._clamped(cast.cast(pa.int64()).to_numpy(), part.notes)


class _Time(Printed):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 8)
        us = int.from_bytes(data, "big", signed=True)
        if not 0 <= us <= 86_400_000_000:
            raise Bad("time out of range")
        return _fmt_time(us)


class _TimeTz(_Time):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 12)
        us, zone = struct.unpack("!qi", data)
        if not 0 <= us <= 86_400_000_000 or abs(zone) > 16 * 3600:
            raise Bad("timetz out of range")
        return _fmt_time(us) + _fmt_offset(-zone)


class _Interval(_Time):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 16)
        us, days, months = struct.unpack("!qii", data)
        return _fmt_interval(us, days, months)


BUILTIN: dict[str, Callable[[], Handler]] = {
    "date": _Date,
    "timestamp": lambda: _Timestamp(False),
    "timestamptz": lambda: _Timestamp(True),
    "time": _Time,
    "timetz": _TimeTz,
    "interval": _Interval,
}
