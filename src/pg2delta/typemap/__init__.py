"""PostgreSQL values -> Arrow arrays: the value layer of the decoder.

One :class:`ColumnCodec` per relation column, resolved once per Relation message with
:func:`codec_for`. ``codec.decode(buf, starts, lengths, kinds)`` turns one column of a
whole window chunk into one Arrow array: the values are byte ranges of ``buf``, in
text (``t``) or binary (``b``) wire format, freely mixed. ``n`` (NULL) and ``u``
(unchanged TOAST) become nulls; the caller tracks unchanged TOAST itself. Bytes that
do not form a value of the type raise :class:`~pg2delta.errors.DecodeError` naming the
type and the row index (never another exception). Hot types decode in bulk: byte
gathers, binary numeric (decimal128 or text) and one-dimensional binary arrays in the C
extension ``_tuples.c``, the rest with numpy and Arrow compute; the other types loop per
value. Every type also has a per-value
reference path (``ColumnCodec.decode(..., reference=True)``) that the tests hold the
vectorized path against.

Type mapping (every Arrow type is storable in Delta and readable by Spark):

==========================================  ==========================================================
PostgreSQL                                  Arrow
==========================================  ==========================================================
bool                                        bool
int2 / int4 / int8                          int16 / int32 / int64
oid                                         int64
float4 / float8                             float32 / float64 (NaN, +/-Infinity kept)
numeric(p,s), 0 <= s, p <= 38               decimal128(p, s)
numeric(p,s), s > p                         decimal128(s, s) (precision widened)
numeric(p,-k) (PG15+), p+k <= 38            decimal128(p+k, 0)
numeric unbounded, or wider than 38         string, PostgreSQL's own text ('NaN', 'Infinity', ...)
money                                       decimal128(19, 2) (see below)
text varchar bpchar name "char" json xml    string (bpchar keeps its padding)
jsonb                                       string, byte-identical to ``jsonb::text``
enum, citext and other text-like types      string
bytea                                       binary
date                                        date32 (clamped, see below)
timestamp / timestamptz                     timestamp('us') / timestamp('us', 'UTC') (clamped)
time / timetz / interval                    string, PostgreSQL text ('04:05:06.5', '1 year 2 mons')
uuid                                        string, lowercase canonical
inet / cidr                                 string (inet omits /32 and /128, cidr always has it)
macaddr / macaddr8                          string, lowercase colon form
bit / varbit                                string of 0 and 1
T[] (any element type above)                list<T> (nested lists for ndims > 1, see below)
domain                                      its base type (needs a catalog)
composite, range, multirange, other         string, PostgreSQL text form
==========================================  ==========================================================

Rules for values the lake cannot hold (each application is counted in ``notes``,
never logged with the value):

* **Timestamps and dates are clamped.** Spark and Delta hold 0001-01-01 ..
  9999-12-31 23:59:59.999999. ``infinity``, ``-infinity`` and every value outside
  that range (BC years, years >= 10000, and timestamptz values whose UTC instant
  falls outside) become the nearest bound: ``0001-01-01 00:00:00`` or
  ``9999-12-31 23:59:59.999999`` (date: ``0001-01-01`` or ``9999-12-31``). Counted in
  ``notes['timestamp_clamped']`` / ``notes['date_clamped']``.
* **NaN in a bounded numeric becomes NULL** (decimal128 has no NaN), counted in
  ``notes['numeric_nan_nulled']``. Unbounded numeric columns are strings and keep
  'NaN' and '+/-Infinity' exactly.
* **Money** is the server's int64 count of the smallest currency unit, read as
  decimal128(19, 2). This assumes an ``lc_monetary`` with 2 fractional digits (C,
  en_US, de_DE ...); text-format money is parsed as ``-$1,234.56``-like text, any
  currency symbol or thousands separator ignored.
* **Arrays**: ``codec_for(..., ndims=1)`` (the default) maps ``T[]`` to ``list<T>``;
  ``ndims=k`` maps to k nested lists (``int4[][]`` -> ``list<list<int32>>``), row-major
  (the job passes ``pg_attribute.attndims``, see
  :meth:`pg2delta.catalog.PgTypeCatalog.attndims`). PostgreSQL does not enforce declared
  dimensions, so a value may have more or fewer than the column: more are flattened
  into the outermost list, in order (``{{1,2},{3,4}}`` in an ``int4[]`` column ->
  ``[1, 2, 3, 4]``), counted in ``notes['array_dims_flattened']``; fewer are wrapped in
  single-element outer lists (``{1,2}`` in ``int4[][]`` -> ``[[1, 2]]``), counted in
  ``notes['array_dims_padded']``. Empty arrays are ``[]``. PostgreSQL lower bounds
  other than 1 (``'[0:1]={1,2}'``) are dropped and counted in
  ``notes['array_lower_bound_dropped']``.
* **Text forms** assume the session settings of a logical replication client:
  ``DateStyle=ISO``, ``IntervalStyle=postgres``, ``bytea_output=hex`` (escape is read
  too) and any ``extra_float_digits >= 1``. Binary values rendered to text (time,
  interval, composites, ranges ...) are printed as PostgreSQL prints them with those
  settings and ``TimeZone=UTC``.
* **Types without a decoder here** (extension types such as PostGIS geometry, and
  built-ins such as point, tsvector, pg_lsn) are strings in PostgreSQL's text form.
  Their text format passes through; their binary format (pgoutput sends binary for
  every type that has a send function) is printed by the source server itself: the
  catalog's ``render_binary`` sends the bytes back as binary parameters of that type
  and reads the output function's text (one round trip per column chunk, distinct
  values only). Without a catalog that can do this they raise DecodeError.
"""

from __future__ import annotations

import collections
import decimal
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from pg2delta import _oids, _tuples
from pg2delta.errors import DecodeError

KIND_NULL = ord("n")
KIND_TOAST = ord("u")
KIND_TEXT = ord("t")
KIND_BINARY = ord("b")

Notes = collections.Counter[str]
I64 = NDArray[np.int64]
U8 = NDArray[np.uint8]

# PostgreSQL epoch (2000-01-01) relative to the Unix epoch.
PG_EPOCH_DAYS = 10957
PG_EPOCH_US = PG_EPOCH_DAYS * 86_400_000_000
TS_MIN_US = -62135596800_000_000  # 0001-01-01 00:00:00 UTC, Unix microseconds
TS_MAX_US = 253402300799_999_999  # 9999-12-31 23:59:59.999999
DATE_MIN = -719162  # 0001-01-01, Unix days
DATE_MAX = 2932896  # 9999-12-31
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
DECIMAL128_MAX_PRECISION = 38


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """What the catalog knows about a type OID.

    ``elem_oid`` is set only for true array types (varlena, category 'A').
    ``base_typmod`` is the domain's own typmod (``pg_type.typtypmod``), -1 if none.
    ``send_proc`` is the name of the binary send function (``pg_type.typsend``), used
    to read binary values of extension types whose binary form is their text.
    For a multirange, ``subtype_oid`` is the subtype of its range.
    """

    oid: int
    namespace: str
    name: str
    typtype: str
    base_oid: int = 0
    elem_oid: int = 0
    subtype_oid: int = 0
    base_typmod: int = -1
    send_proc: str = ""


class TypeCatalog(Protocol):
    def type_info(self, oid: int) -> TypeInfo | None: ...


class TextRenderer(Protocol):
    """Optional catalog capability: print binary values of a type as its text output, in order.

    Raises ValueError when the bytes are not a value of the type.
    """

    def render_binary(self, type_oid: int, values: Sequence[bytes]) -> list[str]: ...


_EXACT = decimal.Context(prec=1000, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


def _scaled(units: int, scale: int) -> Decimal:
    """units * 10**-scale, exactly."""
    return Decimal(units).scaleb(-scale, context=_EXACT)


class _Bad(ValueError):
    """A value that is not a valid value of its type (reason only, no value)."""


# --------------------------------------------------------------------------- helpers


_SWAP = sys.byteorder == "little"  # wire values are big-endian


def _fixed(raw: U8, starts: I64, width: int) -> U8:
    """The ``width`` bytes at each start, as an (n, width) C-contiguous array."""
    out = np.empty(len(starts) * width, dtype=np.uint8)
    _tuples.gather_fixed(raw, np.ascontiguousarray(starts, dtype=np.int64), width, out, False)
    return out.reshape(-1, width)


def _be(raw: U8, starts: I64, dtype: str) -> NDArray[Any]:
    """The big-endian numbers of ``dtype`` (e.g. ``>i4``) at each start, in native byte order."""
    native = np.dtype(dtype).newbyteorder("=")
    out = np.empty(len(starts) * native.itemsize, dtype=np.uint8)
    _tuples.gather_fixed(raw, np.ascontiguousarray(starts, dtype=np.int64), native.itemsize, out, _SWAP)
    return out.view(native)


def _strings(raw: U8, starts: I64, lengths: I64, *, binary: bool = False) -> pa.Array:
    """The byte ranges as an Arrow string (not validated) or binary array."""
    offsets = np.empty(len(starts) + 1, dtype=np.int32)
    try:
        data = _tuples.gather_var(
            raw, np.ascontiguousarray(starts, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64), offsets
        )
    except OverflowError:
        raise _Bad("more than 2 GiB of values in one column chunk") from None
    t = pa.binary() if binary else pa.string()
    return pa.Array.from_buffers(t, len(starts), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


def _string_array(data: U8, offsets: I64, *, binary: bool = False) -> pa.Array:
    if offsets[-1] > INT32_MAX:
        raise _Bad("more than 2 GiB of values in one column chunk")
    n = len(offsets) - 1
    t = pa.binary() if binary else pa.string()
    return pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)])


def _utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _Bad("invalid UTF-8") from None


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


def _fmt_float(value: float, single: bool) -> str:
    """float4out / float8out: shortest exact digits, exponent form outside [1e-4, 1e15 | 1e6)."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0:
        return "-0" if str(value).startswith("-") else "0"
    sci = np.format_float_scientific(
        np.float32(value) if single else np.float64(value), unique=True, trim="-"
    )
    mant, exp_s = sci.split("e")
    exp = int(exp_s)
    neg = mant.startswith("-")
    digits = mant.lstrip("-").replace(".", "")
    sign = "-" if neg else ""
    if -4 <= exp < (6 if single else 15):
        if exp < 0:
            body = "0." + "0" * (-exp - 1) + digits
        elif len(digits) <= exp + 1:
            body = digits + "0" * (exp + 1 - len(digits))
        else:
            body = digits[: exp + 1] + "." + digits[exp + 1 :]
        return sign + body
    body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{body}e{'-' if exp < 0 else '+'}{abs(exp):02d}"


_NUMERIC_HEAD = struct.Struct("!hhHh")
_NUMERIC_POS, _NUMERIC_NEG, _NUMERIC_NAN, _NUMERIC_PINF, _NUMERIC_NINF = (
    0x0000,
    0x4000,
    0xC000,
    0xD000,
    0xF000,
)


_DIGIT_STRUCTS: dict[int, struct.Struct] = {}


def _numeric_unpack(data: bytes) -> tuple[int, int, int, tuple[int, ...]]:
    """(weight, sign, dscale, digits) of a binary numeric, validated."""
    if len(data) < 8:
        raise _Bad("numeric shorter than its header")
    ndigits, weight, sign, dscale = _NUMERIC_HEAD.unpack_from(data)
    if ndigits < 0 or len(data) != 8 + 2 * ndigits:
        raise _Bad("numeric length does not match its digit count")
    if sign not in (_NUMERIC_POS, _NUMERIC_NEG, _NUMERIC_NAN, _NUMERIC_PINF, _NUMERIC_NINF):
        raise _Bad("numeric sign word is invalid")
    if dscale < 0:
        raise _Bad("numeric display scale is negative")
    st = _DIGIT_STRUCTS.get(ndigits)
    if st is None:
        st = _DIGIT_STRUCTS.setdefault(ndigits, struct.Struct(f"!{ndigits}H"))
    digits: tuple[int, ...] = st.unpack_from(data, 8)
    if digits and max(digits) >= 10000:
        raise _Bad("numeric digit out of range")
    return weight, sign, dscale, digits


def _numeric_text(data: bytes) -> str:
    """numeric_out of a binary numeric."""
    weight, sign, dscale, digits = _numeric_unpack(data)
    if sign == _NUMERIC_NAN:
        return "NaN"
    if sign == _NUMERIC_PINF:
        return "Infinity"
    if sign == _NUMERIC_NINF:
        return "-Infinity"
    nd = len(digits)
    d = ("%04d" * nd) % digits
    if weight >= 0:
        cut = 4 * (weight + 1)
        int_part = (d[:cut] if nd > weight else d + "0" * (cut - 4 * nd)).lstrip("0") or "0"
        frac = d[cut:]
    else:
        int_part = "0"
        frac = "0" * (4 * (-weight - 1)) + d
    text = "-" + int_part if sign == _NUMERIC_NEG else int_part
    if dscale > 0:
        text += "." + (frac[:dscale] if len(frac) >= dscale else frac + "0" * (dscale - len(frac)))
    return text


# ------------------------------------------------------------------ text parsers

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
        raise _Bad("not an ISO timestamp")
    year = int(m.group(1))
    if m.group(12):
        year = 1 - year
    mon, day, hh, mi, ss = (int(m.group(i)) for i in range(2, 7))
    if not (1 <= mon <= 12 and 1 <= day <= 31 and hh <= 24 and mi < 60 and ss <= 60):
        raise _Bad("timestamp field out of range")
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
        raise _Bad("not an ISO date")
    year = int(m.group(1))
    if m.group(4):
        year = 1 - year
    mon, day = int(m.group(2)), int(m.group(3))
    if not (1 <= mon <= 12 and 1 <= day <= 31):
        raise _Bad("date field out of range")
    days = _days_from_civil(year, mon, day)
    if days < DATE_MIN or days > DATE_MAX:
        notes["date_clamped"] += 1
        return DATE_MIN if days < DATE_MIN else DATE_MAX
    return days


# ----------------------------------------------------------------- type handlers


class _Part:
    """The non-null values of one wire format of one column chunk."""

    __slots__ = ("buf", "lengths", "notes", "raw", "rows", "starts")

    def __init__(self, buf: bytes, raw: U8, starts: I64, lengths: I64, rows: I64, notes: Notes) -> None:
        self.buf = buf
        self.raw = raw
        self.starts = starts
        self.lengths = lengths
        self.rows = rows
        self.notes = notes

    def values(self) -> list[bytes]:
        buf = self.buf
        return [buf[s : s + n] for s, n in zip(self.starts.tolist(), self.lengths.tolist(), strict=True)]


class _BadAt(Exception):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index
        self.reason = reason


class _Handler:
    """How one PostgreSQL type becomes Arrow. Subclasses override what they need."""

    arrow_type: pa.DataType = pa.string()
    binary_ok = True  # has a binary decoder

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        return _utf8(data)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return _utf8(data)

    def pg_text(self, data: bytes) -> str:
        """PostgreSQL's text output of a binary value (for composites, ranges, arrays)."""
        return str(self.ref_binary(data, collections.Counter()))

    def vec_text(self, part: _Part) -> pa.Array | None:
        return None

    def vec_binary(self, part: _Part) -> pa.Array | None:
        return None

    def from_python(self, values: list[Any]) -> pa.Array:
        return pa.array(values, type=self.arrow_type)


def _check_len(part: _Part, width: int) -> None:
    bad = np.flatnonzero(part.lengths != width)
    if len(bad):
        raise _BadAt(int(bad[0]), f"binary value is not {width} bytes long")


def _check_len1(data: bytes, width: int) -> None:
    if len(data) != width:
        raise _Bad(f"binary value is not {width} bytes long")


def _validated_strings(part: _Part, starts: I64, lengths: I64) -> pa.Array:
    arr = _strings(part.raw, starts, lengths)
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:
        for i, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
            try:
                part.buf[start : start + length].decode("utf-8")
            except UnicodeDecodeError:
                raise _BadAt(i, "invalid UTF-8") from None
        raise _BadAt(0, "invalid UTF-8") from None
    return arr


class _TextLike(_Handler):
    """Types whose text and binary forms are the same UTF-8 text."""

    def vec_text(self, part: _Part) -> pa.Array:
        return _validated_strings(part, part.starts, part.lengths)

    def vec_binary(self, part: _Part) -> pa.Array:
        return _validated_strings(part, part.starts, part.lengths)

    def pg_text(self, data: bytes) -> str:
        return _utf8(data)


class _Jsonb(_TextLike):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if not data or data[0] != 1:
            raise _Bad("unsupported jsonb binary version")
        return _utf8(data[1:])

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: _Part) -> pa.Array:
        bad = np.flatnonzero(part.lengths < 1)
        if len(bad):
            raise _BadAt(int(bad[0]), "unsupported jsonb binary version")
        bad = np.flatnonzero(part.raw[part.starts] != 1)
        if len(bad):
            raise _BadAt(int(bad[0]), "unsupported jsonb binary version")
        return _validated_strings(part, part.starts + 1, part.lengths - 1)


class _Char(_TextLike):
    """The one-byte "char" type: binary is the raw byte, text is charout's."""

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 1)
        ch = data[0]
        if ch == 0:
            return ""
        if ch >= 0x80:
            return "\\" + f"{ch:03o}"
        return chr(ch)

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: _Part) -> None:
        return None


class _Bool(_Handler):
    arrow_type = pa.bool_()

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if data == b"t":
            return True
        if data == b"f":
            return False
        raise _Bad("bool text is not t or f")

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 1)
        return data[0] != 0

    def pg_text(self, data: bytes) -> str:
        return "t" if self.ref_binary(data, collections.Counter()) else "f"

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, 1)
        return pa.array(part.raw[part.starts] != 0, type=pa.bool_())

    def vec_text(self, part: _Part) -> pa.Array:
        _check_len(part, 1)
        c = part.raw[part.starts]
        bad = np.flatnonzero((c != ord("t")) & (c != ord("f")))
        if len(bad):
            raise _BadAt(int(bad[0]), "bool text is not t or f")
        return pa.array(c == ord("t"), type=pa.bool_())


_INT_TEXT = re.compile(rb"-?\d+")


class _Int(_Handler):
    def __init__(self, width: int, arrow_type: pa.DataType, unsigned: bool = False) -> None:
        self.width = width
        self.arrow_type = arrow_type
        self.unsigned = unsigned
        self.dtype = f">u{width}" if unsigned else f">i{width}"
        bits = arrow_type.bit_width
        self.lo: int
        self.hi: int
        self.lo, self.hi = (0, 2**32 - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if not _INT_TEXT.fullmatch(data):
            raise _Bad("not an integer")
        v = int(data)
        if not self.lo <= v <= self.hi:
            raise _Bad("integer out of range")
        return v

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, self.width)
        return int.from_bytes(data, "big", signed=not self.unsigned)

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, self.width)
        values = _be(part.raw, part.starts, self.dtype)
        return pa.array(values.astype(self.arrow_type.to_pandas_dtype(), copy=False), type=self.arrow_type)

    def vec_text(self, part: _Part) -> pa.Array | None:
        try:
            return pc.cast(_strings(part.raw, part.starts, part.lengths, binary=True).cast(pa.string()), self.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None  # the reference path finds the bad row


class _Float(_Handler):
    def __init__(self, width: int) -> None:
        self.width = width
        self.arrow_type = pa.float32() if width == 4 else pa.float64()
        self.fmt = "!f" if width == 4 else "!d"

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        try:
            text = data.decode("ascii")
            if text.strip() != text or "_" in text:
                raise ValueError
            v = float(text)
        except (ValueError, UnicodeDecodeError):
            raise _Bad("not a float") from None
        return float(np.float32(v)) if self.width == 4 else v

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, self.width)
        return struct.unpack(self.fmt, data)[0]

    def pg_text(self, data: bytes) -> str:
        return _fmt_float(self.ref_binary(data, collections.Counter()), self.width == 4)

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, self.width)
        return pa.array(_be(part.raw, part.starts, f">f{self.width}"), type=self.arrow_type)

    def vec_text(self, part: _Part) -> pa.Array | None:
        try:
            return pc.cast(_strings(part.raw, part.starts, part.lengths, binary=True).cast(pa.string()), self.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None


def _decimal_from_limbs(
    lo: NDArray[np.uint64], hi: NDArray[np.uint64], valid: NDArray[np.bool_] | None, arrow_type: pa.DataType
) -> pa.Array:
    n = len(lo)
    limbs = np.empty((n, 2), dtype="<u8")
    limbs[:, 0] = lo
    limbs[:, 1] = hi
    validity = None
    if valid is not None and not valid.all():
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(limbs)])


class _Decimal(_Handler):
    """numeric(p, s) that fits decimal128: exact, NaN -> NULL (counted)."""

    def __init__(self, precision: int, scale: int) -> None:
        self.scale = scale
        self.arrow_type = pa.decimal128(precision, scale)
        self.limit = 10**precision

    def _from_decimal(self, d: Decimal, notes: Notes) -> Decimal | None:
        if d.is_nan():
            notes["numeric_nan_nulled"] += 1
            return None
        if d.is_infinite():
            raise _Bad("numeric infinity in a bounded numeric column")
        q = d.scaleb(self.scale, context=_EXACT)
        if q != q.to_integral_value(context=_EXACT):
            raise _Bad("numeric value has more fractional digits than the column scale")
        units = int(q)
        if abs(units) >= self.limit:
            raise _Bad("numeric value exceeds the column precision")
        return _scaled(units, self.scale)

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if data == b"NaN":
            return self._from_decimal(Decimal("NaN"), notes)
        if not re.fullmatch(rb"-?\d+(\.\d+)?|-?Infinity", data):
            raise _Bad("not a numeric")
        return self._from_decimal(Decimal(data.decode("ascii")), notes)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return self._from_decimal(Decimal(_numeric_text(data)), notes)

    def pg_text(self, data: bytes) -> str:
        return _numeric_text(data)

    def vec_text(self, part: _Part) -> pa.Array | None:
        try:
            strings = _strings(part.raw, part.starts, part.lengths, binary=True).cast(pa.string())
        except pa.ArrowInvalid:
            return None
        nan = pc.equal(strings, "NaN")
        n_nan = pc.sum(nan).as_py() or 0
        if n_nan:
            part.notes["numeric_nan_nulled"] += n_nan
            strings = pc.if_else(nan, None, strings)
        try:
            return pc.cast(strings, self.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            if n_nan:
                part.notes["numeric_nan_nulled"] -= n_nan
            return None

    def vec_binary(self, part: _Part) -> pa.Array | None:
        n = len(part.starts)
        precision = self.arrow_type.precision
        if not 0 <= self.scale <= precision <= DECIMAL128_MAX_PRECISION:
            return None
        limbs = np.empty(16 * n, dtype=np.uint8)
        valid = np.empty(n, dtype=np.uint8)
        other = _tuples.numeric_decimal128(
            part.raw, np.ascontiguousarray(part.starts, dtype=np.int64), np.ascontiguousarray(part.lengths, dtype=np.int64),
            self.scale, precision, limbs, valid,
        )
        if other >= 0:
            return None  # infinities, values that do not fit, bad bytes: the reference path says which row
        nan = n - int(np.count_nonzero(valid))
        validity = None
        if nan:
            part.notes["numeric_nan_nulled"] += nan
            validity = pa.py_buffer(np.packbits(valid.view(np.bool_), bitorder="little"))
        return pa.Array.from_buffers(self.arrow_type, n, [validity, pa.py_buffer(limbs)], null_count=nan)


class _NumericText(_TextLike):
    """Unbounded (or wider than 38 digits) numeric -> PostgreSQL's text."""

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if not re.fullmatch(rb"-?\d+(\.\d+)?|NaN|-?Infinity", data):
            raise _Bad("not a numeric")
        return data.decode("ascii")

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return _numeric_text(data)

    def pg_text(self, data: bytes) -> str:
        return _numeric_text(data)

    def vec_binary(self, part: _Part) -> pa.Array | None:
        offsets = np.empty(len(part.starts) + 1, dtype=np.int32)
        try:
            text = _tuples.numeric_texts(
                part.raw, np.ascontiguousarray(part.starts, dtype=np.int64),
                np.ascontiguousarray(part.lengths, dtype=np.int64), offsets,
            )
        except OverflowError:
            raise _Bad("more than 2 GiB of values in one column chunk") from None
        if isinstance(text, int):
            return None  # not a numeric: the reference path says which row and why
        return pa.Array.from_buffers(pa.string(), len(part.starts), [None, pa.py_buffer(offsets), pa.py_buffer(text)])


class _Money(_Handler):
    arrow_type = pa.decimal128(19, 2)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 8)
        return _scaled(int.from_bytes(data, "big", signed=True), 2)

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        text = _utf8(data)
        neg = "-" in text or "(" in text
        body = re.sub(r"[^0-9.]", "", text)
        if not re.fullmatch(r"\d+(\.\d{1,2})?", body):
            raise _Bad("not a money value")
        units = int(Decimal(body).scaleb(2, context=_EXACT))
        return _scaled(-units if neg else units, 2)

    def pg_text(self, data: bytes) -> str:
        _check_len1(data, 8)
        v = int.from_bytes(data, "big", signed=True)
        whole, cents = divmod(abs(v), 100)
        return f"{'-' if v < 0 else ''}${whole:,}.{cents:02d}"

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, 8)
        v = _be(part.raw, part.starts, ">i8")
        return _decimal_from_limbs(
            v.view(np.uint64), np.where(v < 0, np.uint64(2**64 - 1), np.uint64(0)), None, self.arrow_type
        )


class _Bytea(_Handler):
    arrow_type = pa.binary()

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return data

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if data.startswith(b"\\x"):
            try:
                return bytes.fromhex(data[2:].decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                raise _Bad("bad bytea hex") from None
        out = bytearray()
        i = 0
        while i < len(data):
            c = data[i]
            if c != 0x5C:
                out.append(c)
                i += 1
            elif data[i + 1 : i + 2] == b"\\":
                out.append(0x5C)
                i += 2
            elif re.fullmatch(rb"[0-3][0-7][0-7]", data[i + 1 : i + 4]):
                out.append(int(data[i + 1 : i + 4], 8))
                i += 4
            else:
                raise _Bad("bad bytea escape")
        return bytes(out)

    def pg_text(self, data: bytes) -> str:
        return "\\x" + data.hex()

    def vec_binary(self, part: _Part) -> pa.Array:
        return _strings(part.raw, part.starts, part.lengths, binary=True)


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_UUID_POS = np.array([0, 2, 4, 6, 9, 11, 14, 16, 19, 21, 24, 26, 28, 30, 32, 34], dtype=np.int64)


class _Uuid(_TextLike):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 16)
        h = data.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, 16)
        n = len(part.starts)
        b = _fixed(part.raw, part.starts, 16)
        out = np.full((n, 36), ord("-"), dtype=np.uint8)
        out[:, _UUID_POS] = _HEX[b >> 4]
        out[:, _UUID_POS + 1] = _HEX[b & 15]
        offsets = np.arange(0, 36 * (n + 1), 36, dtype=np.int64)
        return _string_array(out.reshape(-1), offsets)


class _Date(_Handler):
    arrow_type = pa.date32()

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        return _parse_date_text(data, notes)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 4)
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
        _check_len1(data, 4)
        v = int.from_bytes(data, "big", signed=True)
        if v in (INT32_MAX, INT32_MIN):
            return "infinity" if v > 0 else "-infinity"
        return _fmt_date_days(v + PG_EPOCH_DAYS)

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, 4)
        v = _be(part.raw, part.starts, ">i4").astype(np.int64) + PG_EPOCH_DAYS
        clamped = (v < DATE_MIN) | (v > DATE_MAX)
        if clamped.any():
            part.notes["date_clamped"] += int(clamped.sum())
            v = np.clip(v, DATE_MIN, DATE_MAX)
        return pa.array(v.astype(np.int32), type=pa.date32())


class _Timestamp(_Handler):
    def __init__(self, tz: bool) -> None:
        self.tz = tz
        self.arrow_type = pa.timestamp("us", tz="UTC") if tz else pa.timestamp("us")

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        return _parse_ts_text(data, self.tz, notes)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 8)
        v = int.from_bytes(data, "big", signed=True)
        if v in (INT64_MAX, INT64_MIN):
            notes["timestamp_clamped"] += 1
            return TS_MAX_US if v > 0 else TS_MIN_US
        return _clamp_us(v + PG_EPOCH_US, notes)

    def pg_text(self, data: bytes) -> str:
        _check_len1(data, 8)
        return _fmt_ts(int.from_bytes(data, "big", signed=True), self.tz)

    def _clamped(self, v: NDArray[np.int64], notes: Notes) -> pa.Array:
        clamped = (v < TS_MIN_US) | (v > TS_MAX_US)
        if clamped.any():
            notes["timestamp_clamped"] += int(clamped.sum())
            v = np.clip(v, TS_MIN_US, TS_MAX_US)
        return pa.array(v, type=self.arrow_type)

    def vec_binary(self, part: _Part) -> pa.Array:
        _check_len(part, 8)
        v = _be(part.raw, part.starts, ">i8")
        inf = (v == INT64_MAX) | (v == INT64_MIN)
        # infinities and anything past the bounds clamp; shifting cannot overflow for finite PG values
        shifted = np.where(inf, np.where(v > 0, TS_MAX_US + 1, TS_MIN_US - 1), v + PG_EPOCH_US)
        return self._clamped(shifted, part.notes)

    _FAST_TS = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?$"
    _FAST_TSTZ = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?[+-]\d\d(:\d\d)?$"

    def vec_text(self, part: _Part) -> pa.Array | None:
        strings = _strings(part.raw, part.starts, part.lengths, binary=True)
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


class _Time(_TextLike):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 8)
        us = int.from_bytes(data, "big", signed=True)
        if not 0 <= us <= 86_400_000_000:
            raise _Bad("time out of range")
        return _fmt_time(us)

    def pg_text(self, data: bytes) -> str:
        return str(self.ref_binary(data, collections.Counter()))

    def vec_binary(self, part: _Part) -> None:
        return None


class _TimeTz(_Time):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 12)
        us, zone = struct.unpack("!qi", data)
        if not 0 <= us <= 86_400_000_000 or abs(zone) > 16 * 3600:
            raise _Bad("timetz out of range")
        return _fmt_time(us) + _fmt_offset(-zone)


class _Interval(_Time):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, 16)
        us, days, months = struct.unpack("!qii", data)
        return _fmt_interval(us, days, months)


class _Inet(_Time):
    def __init__(self, cidr: bool) -> None:
        self.cidr = cidr

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if len(data) < 4:
            raise _Bad("inet shorter than its header")
        family, bits, _is_cidr, nb = data[0], data[1], data[2], data[3]
        size = 4 if family == 2 else 16 if family == 3 else 0
        if size == 0 or nb != size or len(data) != 4 + nb or bits > 8 * size:
            raise _Bad("malformed inet")
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


class _Macaddr(_Time):
    def __init__(self, width: int) -> None:
        self.width = width

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _check_len1(data, self.width)
        return ":".join(f"{b:02x}" for b in data)


class _Bits(_Time):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if len(data) < 4:
            raise _Bad("bit string shorter than its header")
        nbits = int.from_bytes(data[:4], "big", signed=True)
        if nbits < 0 or len(data) != 4 + (nbits + 7) // 8:
            raise _Bad("bit string length does not match")
        return "".join(f"{b:08b}" for b in data[4:])[:nbits]


class _IntVector(_Time):
    """int2vector / oidvector: array_send on the wire, space separated in text."""

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        _ndim, _lb, _elem, items = _parse_binary_array(data)
        return " ".join(str(int.from_bytes(data[s : s + n], "big", signed=True)) for s, n in items if n >= 0)


_OPAQUE_CACHE_BYTES = 16 << 20


class _Opaque(_Time):
    """A type with no binary decoder here: text passes through; binary is printed by the server.

    pgoutput sends every type that has a binary send function in binary, so extension types
    (and a few built-ins such as point or tsvector) arrive as bytes only their own receive
    function understands. The catalog's :meth:`TextRenderer.render_binary` asks the source
    server to read them back and print them with the type's output function: the same text
    the value has in text format. Without such a catalog they raise DecodeError.
    """

    def __init__(self, name: str, oid: int = 0, catalog: object = None) -> None:
        self.name = name
        self.oid = oid
        render = getattr(catalog, "render_binary", None)
        self._render: Callable[[int, Sequence[bytes]], list[str]] | None = render if callable(render) else None
        self._cache: dict[bytes, str] = {}  # recent values (repeat across chunks), bounded
        self._cached_bytes = 0

    def _texts(self, values: Sequence[bytes]) -> list[str]:
        if self._render is None or not self.oid:
            raise _Bad(f"no binary decoder for type {self.name} and no source server to print it")
        cache = self._cache
        todo = [v for v in dict.fromkeys(values) if v not in cache]
        if todo:
            try:
                texts = self._render(self.oid, todo)
            except ValueError as exc:
                raise _Bad(f"the server cannot read this binary value: {exc}") from None
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

    def vec_binary(self, part: _Part) -> pa.Array | None:
        try:
            return pa.array(self._texts(part.values()), type=pa.string())
        except _Bad:
            return None  # the per-value path finds the row and says what is wrong


# -------------------------------------------------------- composite, range, arrays


_ARRAY_HEAD = struct.Struct("!iiI")
_I32 = struct.Struct("!i")
_I32I32 = struct.Struct("!ii")


def _parse_binary_array(
    data: bytes, offset: int = 0
) -> tuple[list[int], list[int], int, list[tuple[int, int]]]:
    """array_recv layout: dims, lower bounds, element oid and (start, length) of each element (-1 NULL)."""
    end = len(data)
    try:
        ndim, _flags, elem = _ARRAY_HEAD.unpack_from(data, offset)
        if ndim < 0 or ndim > 6:
            raise _Bad("array has an invalid dimension count")
        pos = offset + 12
        dims, lbs = [], []
        for _ in range(ndim):
            d, lb = _I32I32.unpack_from(data, pos)
            if d < 0:
                raise _Bad("array has a negative dimension")
            dims.append(d)
            lbs.append(lb)
            pos += 8
        count = 1
        for d in dims:
            count *= d
        if ndim == 0:
            count = 0
        if count > end:
            raise _Bad("array claims more elements than it has bytes")
        items = []
        for _ in range(count):
            (n,) = _I32.unpack_from(data, pos)
            pos += 4
            if n < -1 or pos + max(n, 0) > end:
                raise _Bad("array element overruns the value")
            items.append((pos, n))
            pos += max(n, 0)
    except struct.error:
        raise _Bad("array value is truncated") from None
    if pos != end:
        raise _Bad("array value has trailing bytes")
    return dims, lbs, elem, items


def _array_text(dims: list[int], items: list[str | None], delim: str = ",") -> str:
    if not dims:
        return "{}"

    def quote(v: str | None) -> str:
        if v is None:
            return "NULL"
        if v == "" or v.upper() == "NULL" or any(c in '"\\{}' or c == delim or c.isspace() for c in v):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return v

    it = iter(items)

    def level(k: int) -> str:
        if k == len(dims) - 1:
            return "{" + delim.join(quote(next(it)) for _ in range(dims[k])) + "}"
        return "{" + delim.join(level(k + 1) for _ in range(dims[k])) + "}"

    return level(0)


def _quote_field(v: str, specials: str) -> str:
    if v == "" or any(c in specials or c.isspace() for c in v):
        return '"' + "".join(c + c if c in '"\\' else c for c in v) + '"'
    return v


class _Composite(_Time):
    def __init__(self, catalog: TypeCatalog | None) -> None:
        self.catalog = catalog

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        try:
            (nfields,) = _I32.unpack_from(data, 0)
            pos = 4
            fields = []
            for _ in range(nfields):
                oid, n = struct.unpack_from("!Ii", data, pos)
                pos += 8
                if n < -1 or pos + max(n, 0) > len(data):
                    raise _Bad("record field overruns the value")
                if n == -1:
                    fields.append("")
                else:
                    text = _handler(oid, -1, self.catalog).pg_text(data[pos : pos + n])
                    fields.append(_quote_field(text, '"\\(),'))
                    pos += n
        except struct.error:
            raise _Bad("record value is truncated") from None
        if pos != len(data) or nfields < 0:
            raise _Bad("record value has trailing bytes")
        return "(" + ",".join(fields) + ")"


class _Range(_Time):
    def __init__(self, subtype_oid: int, catalog: TypeCatalog | None) -> None:
        self.subtype_oid = subtype_oid
        self.catalog = catalog

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        if not data:
            raise _Bad("empty range value")
        flags = data[0]
        if flags & 0x01:
            if len(data) != 1:
                raise _Bad("range value has trailing bytes")
            return "empty"
        pos = 1
        sub = _handler(self.subtype_oid, -1, self.catalog)
        bounds = []
        for inf in (0x08, 0x10):
            if flags & inf:
                bounds.append("")
                continue
            if pos + 4 > len(data):
                raise _Bad("range value is truncated")
            (n,) = _I32.unpack_from(data, pos)
            pos += 4
            if n < 0 or pos + n > len(data):
                raise _Bad("range bound overruns the value")
            bounds.append(_quote_field(sub.pg_text(data[pos : pos + n]), '"\\()[],'))
            pos += n
        if pos != len(data):
            raise _Bad("range value has trailing bytes")
        return f"{'[' if flags & 0x02 else '('}{bounds[0]},{bounds[1]}{']' if flags & 0x04 else ')'}"


class _Multirange(_Range):
    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        try:
            (count,) = _I32.unpack_from(data, 0)
            pos = 4
            parts = []
            for _ in range(count):
                (n,) = _I32.unpack_from(data, pos)
                pos += 4
                if n < 0 or pos + n > len(data):
                    raise _Bad("multirange element overruns the value")
                parts.append(super().ref_binary(data[pos : pos + n], notes))
                pos += n
        except struct.error:
            raise _Bad("multirange value is truncated") from None
        if pos != len(data) or count < 0:
            raise _Bad("multirange value has trailing bytes")
        return "{" + ",".join(parts) + "}"


def _parse_text_array(text: str, delim: str = ",") -> tuple[list[int], list[int], list[str | None]]:
    """array_in's syntax: optional '[lb:ub]...=' prefix, nested braces, quoted elements.

    ``delim`` separates elements: the element type's ``pg_type.typdelim`` (``;`` for box).
    """
    pos = 0
    lbs: list[int] = []
    if text.startswith("["):
        m = re.match(r"((?:\[-?\d+:-?\d+\])+)=", text)
        if m is None:
            raise _Bad("bad array dimension prefix")
        lbs = [int(a) for a, _ in re.findall(r"\[(-?\d+):(-?\d+)\]", m.group(1))]
        pos = m.end()
    n = len(text)

    def parse(p: int, depth: int) -> tuple[list[Any], int]:
        if p >= n or text[p] != "{":
            raise _Bad("array text is missing a brace")
        p += 1
        out: list[Any] = []
        if p < n and text[p] == "}":
            return out, p + 1
        while True:
            while p < n and text[p].isspace():
                p += 1
            if p < n and text[p] == "{":
                sub, p = parse(p, depth + 1)
                out.append(sub)
            elif p < n and text[p] == '"':
                p += 1
                buf = []
                while p < n and text[p] != '"':
                    if text[p] == "\\":
                        p += 1
                    if p >= n:
                        raise _Bad("unterminated array element")
                    buf.append(text[p])
                    p += 1
                if p >= n:
                    raise _Bad("unterminated array element")
                p += 1
                out.append("".join(buf))
            else:
                buf = []
                quoted = False
                while p < n and text[p] != delim and text[p] != "}":
                    if text[p] == "\\":
                        p += 1
                        quoted = True
                        if p >= n:
                            raise _Bad("unterminated array element")
                    buf.append(text[p])
                    p += 1
                raw_el = "".join(buf).strip()
                out.append(None if raw_el.upper() == "NULL" and not quoted else raw_el)
            while p < n and text[p].isspace():
                p += 1
            if p >= n:
                raise _Bad("unterminated array")
            if text[p] == delim:
                p += 1
                continue
            if text[p] == "}":
                return out, p + 1
            raise _Bad("bad array text")

    nested, end = parse(pos, 0)
    if text[end:].strip():
        raise _Bad("trailing text after array")
    dims: list[int] = []
    probe: Any = nested
    while isinstance(probe, list):
        dims.append(len(probe))
        if not probe:
            break
        probe = probe[0]
    if dims == [0]:
        return [], [], []
    flat: list[str | None] = []

    def walk(v: Any, k: int) -> None:
        if k == len(dims):
            if isinstance(v, list):
                raise _Bad("array is not rectangular")
            flat.append(v)
            return
        if not isinstance(v, list) or len(v) != dims[k]:
            raise _Bad("array is not rectangular")
        for x in v:
            walk(x, k + 1)

    walk(nested, 0)
    if lbs and len(lbs) != len(dims):
        raise _Bad("array dimension prefix does not match")
    return dims, lbs or [1] * len(dims), flat


class _Array(_Handler):
    def __init__(self, elem: ColumnCodec, ndims: int, elem_oid: int) -> None:
        self.elem = elem
        self.ndims = ndims
        self.elem_oid = elem_oid
        t: pa.DataType = elem.arrow_type
        for _ in range(ndims):
            t = pa.list_(t)
        self.arrow_type = t

    def pg_text(self, data: bytes) -> str:
        dims, _lbs, _elem, items = _parse_binary_array(data)
        h = self.elem._h
        return _array_text(dims, [None if n < 0 else h.pg_text(data[s : s + n]) for s, n in items])

    def _shape(self, dims: list[int], lbs: list[int], notes: Notes) -> list[int]:
        if any(lb != 1 for lb in lbs):
            notes["array_lower_bound_dropped"] += 1
        if not dims or 0 in dims:
            return []
        if len(dims) > self.ndims:  # PostgreSQL does not enforce declared dimensions
            notes["array_dims_flattened"] += 1
            extra = len(dims) - self.ndims
            lead = 1
            for d in dims[: extra + 1]:
                lead *= d
            return [lead, *dims[extra + 1 :]]
        if len(dims) < self.ndims:
            notes["array_dims_padded"] += 1
            return [1] * (self.ndims - len(dims)) + dims
        return dims

    def _build_1d(self, part: _Part) -> pa.Array | None:
        """Binary one-dimensional arrays with lower bound 1 (the usual case), walked in C;
        None when a value is anything else (the general path then handles it)."""
        starts = np.ascontiguousarray(part.starts, dtype=np.int64)
        lengths = np.ascontiguousarray(part.lengths, dtype=np.int64)
        counts = np.empty(len(starts), dtype=np.int64)
        if _tuples.array_counts(part.raw, starts, lengths, self.elem_oid, counts) >= 0:
            return None
        total = int(counts.sum())
        estarts = np.empty(total, dtype=np.int64)
        elens = np.empty(total, dtype=np.int64)
        if _tuples.array_elements(part.raw, starts, lengths, self.elem_oid, estarts, elens) >= 0:
            return None
        kinds = np.where(elens < 0, KIND_NULL, KIND_BINARY).astype(np.uint8)
        try:
            values = self.elem.decode(part.buf, estarts, np.maximum(elens, 0), kinds, part.notes)
        except DecodeError as exc:
            raise _BadAt(0, f"bad array element: {exc.reason}") from None
        offsets = np.zeros(len(starts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        if offsets[-1] > INT32_MAX:
            raise _Bad("more than 2**31 array elements in one column chunk")
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)

    def build(self, part: _Part, binary: bool, reference: bool) -> pa.Array:
        """Decode all arrays of the part: elements in one call of the element codec."""
        if binary and self.ndims == 1 and not reference:
            fast = self._build_1d(part)
            if fast is not None:
                return fast
        shapes: list[list[int]] = []
        if binary:
            ebuf = part.buf
            estarts: list[int] = []
            elens: list[int] = []
            for i, (s, n) in enumerate(zip(part.starts.tolist(), part.lengths.tolist(), strict=True)):
                try:
                    dims, lbs, elem, items = _parse_binary_array(part.buf[s : s + n])
                    if items and elem != self.elem_oid and self.elem_oid:
                        raise _Bad("array element type does not match the column type")
                    shapes.append(self._shape(dims, lbs, part.notes))
                except _Bad as exc:
                    raise _BadAt(i, str(exc)) from None
                for es, en in items:
                    estarts.append(s + es)
                    elens.append(en)
            lens = np.asarray(elens, dtype=np.int64)
            kinds = np.where(lens < 0, KIND_NULL, KIND_BINARY).astype(np.uint8)
            starts = np.asarray(estarts, dtype=np.int64)
        else:
            pieces: list[bytes | None] = []
            for i, data in enumerate(part.values()):
                try:
                    dims, lbs, flat = _parse_text_array(_utf8(data))
                    shapes.append(self._shape(dims, lbs, part.notes))
                except _Bad as exc:
                    raise _BadAt(i, str(exc)) from None
                pieces.extend(None if v is None else v.encode() for v in flat)
            lens = np.asarray([-1 if p is None else len(p) for p in pieces], dtype=np.int64)
            starts = np.zeros(len(pieces), dtype=np.int64)
            if len(pieces):
                np.cumsum(np.maximum(lens, 0)[:-1], out=starts[1:])
            ebuf = b"".join(p for p in pieces if p is not None)
            kinds = np.where(lens < 0, KIND_NULL, KIND_TEXT).astype(np.uint8)
        try:
            values = self.elem.decode(
                ebuf, starts, np.maximum(lens, 0), kinds, part.notes, reference=reference
            )
        except DecodeError as exc:
            raise _BadAt(0, f"bad array element: {exc.reason}") from None
        # nest: innermost level first
        levels: list[list[int]] = [[0] for _ in range(self.ndims)]
        for dims in shapes:
            if not dims:
                levels[0].append(levels[0][-1])
                continue
            count = 1
            for k, d in enumerate(dims):
                for _ in range(count):
                    levels[k].append(levels[k][-1] + d)
                count *= d
        arr: pa.Array = values
        for k in range(self.ndims - 1, -1, -1):
            arr = pa.ListArray.from_arrays(pa.array(levels[k], type=pa.int32()), arr)
        return arr


# ------------------------------------------------------------------- resolution


def _text_like() -> _Handler:
    return _TextLike()


_BUILTIN: dict[str, Callable[[], _Handler]] = {
    "bool": _Bool,
    "int2": lambda: _Int(2, pa.int16()),
    "int4": lambda: _Int(4, pa.int32()),
    "int8": lambda: _Int(8, pa.int64()),
    "oid": lambda: _Int(4, pa.int64(), unsigned=True),
    "xid": lambda: _Int(4, pa.int64(), unsigned=True),
    "cid": lambda: _Int(4, pa.int64(), unsigned=True),
    "regclass": lambda: _Int(4, pa.int64(), unsigned=True),
    "float4": lambda: _Float(4),
    "float8": lambda: _Float(8),
    "money": _Money,
    "text": _text_like,
    "varchar": _text_like,
    "bpchar": _text_like,
    "name": _text_like,
    "json": _text_like,
    "xml": _text_like,
    "unknown": _text_like,
    "refcursor": _text_like,
    "char": _Char,
    "jsonb": _Jsonb,
    "bytea": _Bytea,
    "uuid": _Uuid,
    "date": _Date,
    "timestamp": lambda: _Timestamp(False),
    "timestamptz": lambda: _Timestamp(True),
    "time": _Time,
    "timetz": _TimeTz,
    "interval": _Interval,
    "inet": lambda: _Inet(False),
    "cidr": lambda: _Inet(True),
    "macaddr": lambda: _Macaddr(6),
    "macaddr8": lambda: _Macaddr(8),
    "bit": _Bits,
    "varbit": _Bits,
    "int2vector": _IntVector,
    "oidvector": _IntVector,
}
_TEXT_SENDS = frozenset(
    {"textsend", "varcharsend", "bpcharsend", "enum_send", "namesend", "json_send", "xml_send"}
)


def numeric_typmod(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) of a numeric typmod, None when unbounded (scale may be negative, PG15+)."""
    if typmod < 4:
        return None
    t = typmod - 4
    precision = (t >> 16) & 0xFFFF
    scale = ((t & 0x7FF) ^ 1024) - 1024
    return precision, scale


def _numeric_handler(typmod: int) -> _Handler:
    pm = numeric_typmod(typmod)
    if pm is None:
        return _NumericText()
    p, s = pm
    if s < 0:
        p, s = p - s, 0
    p = max(p, s)
    if p > DECIMAL128_MAX_PRECISION:
        return _NumericText()
    return _Decimal(p, s)


def _handler(oid: int, typmod: int, catalog: TypeCatalog | None, ndims: int = 1) -> _Handler:
    return codec_for(oid, typmod, catalog, ndims=ndims)._h


def _type_label(name: str, typmod: int) -> str:
    if name == "numeric":
        pm = numeric_typmod(typmod)
        return "numeric" if pm is None else f"numeric({pm[0]},{pm[1]})"
    if name in ("varchar", "bpchar") and typmod >= 4:
        return f"{name}({typmod - 4})"
    if name in ("bit", "varbit") and typmod >= 0:
        return f"{name}({typmod})"
    return name


class ColumnCodec:
    """How one relation column decodes: its PostgreSQL type, its Arrow type, and :meth:`decode`."""

    __slots__ = ("_h", "arrow_type", "pg_type")

    def __init__(self, pg_type: str, handler: _Handler) -> None:
        self.pg_type = pg_type
        self._h = handler
        self.arrow_type: pa.DataType = handler.arrow_type

    def __repr__(self) -> str:
        return f"ColumnCodec({self.pg_type!r}, {self.arrow_type})"

    @property
    def server_printed(self) -> bool:
        """True for types pg2delta has no decoder for: their values are stored as the server prints them."""
        return isinstance(self._h, _Opaque)

    def decode(
        self,
        buf: bytes,
        starts: NDArray[np.int64],
        lengths: NDArray[np.int64],
        kinds: NDArray[np.uint8],
        notes: Notes | None = None,
        *,
        reference: bool = False,
    ) -> pa.Array:
        """One Arrow value per row; ``reference=True`` uses the per-value path only (for tests)."""
        if notes is None:
            notes = collections.Counter()
        kinds = np.asarray(kinds, dtype=np.uint8)
        n = len(kinds)
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if len(starts) != n or len(lengths) != n:
            raise DecodeError(f"{self.pg_type}: starts, lengths and kinds differ in length")
        is_b = kinds == KIND_BINARY
        n_b = int(np.count_nonzero(is_b))
        if n_b == n:  # all binary, no NULLs (the usual case with binary replication)
            is_t = valid = np.zeros(0, dtype=bool)
            t_rows, b_rows = np.zeros(0, dtype=np.int64), np.arange(n, dtype=np.int64)
            nvalid = n
        else:
            is_t = kinds == KIND_TEXT
            valid = is_t | is_b
            odd = np.flatnonzero(~valid & (kinds != KIND_NULL) & (kinds != KIND_TOAST))
            if len(odd):
                raise DecodeError(
                    f"{self.pg_type} value at row {int(odd[0])}: unknown value kind {int(kinds[odd[0]])}"
                )
            t_rows, b_rows = np.flatnonzero(is_t), np.flatnonzero(is_b)
            nvalid = len(t_rows) + len(b_rows)
        if nvalid == 0:
            return pa.nulls(n, type=self.arrow_type)
        raw = np.frombuffer(buf, dtype=np.uint8)
        parts = []
        for rows, binary in ((t_rows, False), (b_rows, True)):
            if len(rows):
                rs, rl = (starts, lengths) if len(rows) == n else (starts[rows], lengths[rows])
                if len(rs) and (rs.min() < 0 or rl.min() < 0 or (rs + rl).max() > len(buf)):
                    oob = np.flatnonzero((rs < 0) | (rl < 0) | (rs + rl > len(buf)))
                    raise DecodeError(f"{self.pg_type} value at row {int(rows[oob[0]])}: byte range outside the buffer")
                part = _Part(buf, raw, rs, rl, rows, notes)
                parts.append(self._decode_part(part, binary, reference))
        if len(parts) == 1 and nvalid == n:
            return parts[0]
        values = pa.concat_arrays(parts) if len(parts) > 1 else parts[0]
        index = np.zeros(n, dtype=np.int64)
        index[t_rows] = np.arange(len(t_rows))
        index[b_rows] = len(t_rows) + np.arange(len(b_rows))
        return values.take(pa.array(index, mask=~valid))

    def _decode_part(self, part: _Part, binary: bool, reference: bool) -> pa.Array:
        h = self._h
        try:
            if isinstance(h, _Array):
                return h.build(part, binary, reference)
            if not reference:
                snapshot = collections.Counter(part.notes)
                fast = h.vec_binary(part) if binary else h.vec_text(part)
                if fast is not None:
                    return fast
                part.notes.clear()
                part.notes.update(snapshot)
        except _BadAt as exc:
            row = int(part.rows[exc.index])
            raise DecodeError(f"{self.pg_type} value at row {row}: {exc.reason}") from None
        except _Bad as exc:  # about the whole column chunk, not one value
            raise DecodeError(f"{self.pg_type}: {exc}") from None
        ref = h.ref_binary if binary else h.ref_text
        out = []
        notes = part.notes
        for i, data in enumerate(part.values()):
            try:
                out.append(ref(data, notes))
            except _Bad as exc:
                raise DecodeError(f"{self.pg_type} value at row {int(part.rows[i])}: {exc}") from None
        try:
            return h.from_python(out)
        except (pa.ArrowInvalid, OverflowError, ValueError) as exc:
            raise DecodeError(f"{self.pg_type}: values do not fit {self.arrow_type}") from exc


def codec_for(
    type_oid: int, type_modifier: int, catalog: TypeCatalog | None = None, *, ndims: int = 1
) -> ColumnCodec:
    """The codec of one column. ``ndims`` is the nesting depth used for array columns."""
    builtin = _oids.BY_OID.get(type_oid)
    if builtin is not None:
        return _builtin_codec(builtin, type_modifier, catalog, ndims)
    info = catalog.type_info(type_oid) if catalog is not None else None
    if info is None:
        return ColumnCodec(f"oid {type_oid}", _Opaque(f"oid {type_oid}", type_oid, catalog))
    label = f"{info.namespace}.{info.name}"
    if info.typtype == "d" and info.base_oid:
        base = codec_for(
            info.base_oid, info.base_typmod if type_modifier < 0 else type_modifier, catalog, ndims=ndims
        )
        return ColumnCodec(f"{label} ({base.pg_type})", base._h)
    if info.elem_oid:
        elem = codec_for(info.elem_oid, type_modifier, catalog)
        return ColumnCodec(f"{elem.pg_type}[]", _Array(elem, max(ndims, 1), info.elem_oid))
    if info.typtype == "e":
        return ColumnCodec(label, _TextLike())
    if info.typtype == "c":
        return ColumnCodec(label, _Composite(catalog))
    if info.typtype == "r" and info.subtype_oid:
        return ColumnCodec(label, _Range(info.subtype_oid, catalog))
    if info.typtype == "m" and info.subtype_oid:
        return ColumnCodec(label, _Multirange(info.subtype_oid, catalog))
    if info.send_proc in _TEXT_SENDS:
        return ColumnCodec(label, _TextLike())
    return ColumnCodec(label, _Opaque(label, type_oid, catalog))


def value_of_text_array(codec: ColumnCodec, text: str, *, delim: str = ",", notes: Notes | None = None) -> pa.Scalar:
    """The one element of a one-element array in PostgreSQL's text form, as ``codec`` decodes it.

    For values the catalog holds as such an array, e.g. ``pg_attribute.attmissingval::text``
    (``{7}``, ``{"a b"}``, ``{"{1,2}"}`` for an ``int4[]`` column): the element goes through the
    codec's text path, as a text-format wire value of the column would (same Arrow type, same
    clamping and notes). ``delim`` is the element type's ``pg_type.typdelim``. The text must be
    printed with the settings text forms assume (see the module docstring). Raises
    :class:`~pg2delta.errors.DecodeError` for text that is not a one-element array of the type.
    """
    try:
        dims, _lbs, items = _parse_text_array(text, delim)
    except _Bad as exc:
        raise DecodeError(f"{codec.pg_type}: {exc}") from None
    if dims != [1] or items[0] is None:
        raise DecodeError(f"{codec.pg_type}: expected a one-element array, got {len(items)} elements")
    data = items[0].encode()
    array = codec.decode(
        data,
        np.zeros(1, dtype=np.int64),
        np.array([len(data)], dtype=np.int64),
        np.array([KIND_TEXT], dtype=np.uint8),
        notes,
    )
    return array[0]


def _builtin_codec(t: _oids.BuiltinType, typmod: int, catalog: TypeCatalog | None, ndims: int) -> ColumnCodec:
    if t.typelem and t.typlen == -1 and t.typcategory == "A" and t.name not in ("int2vector", "oidvector"):
        elem = codec_for(t.typelem, typmod, catalog)
        return ColumnCodec(f"{elem.pg_type}[]", _Array(elem, max(ndims, 1), t.typelem))
    label = _type_label(t.name, typmod)
    if t.name == "numeric":
        return ColumnCodec(label, _numeric_handler(typmod))
    make = _BUILTIN.get(t.name)
    if make is not None:
        return ColumnCodec(label, make())
    if t.typtype == "r":
        return ColumnCodec(label, _Range(t.subtype_oid, catalog))
    if t.typtype == "m":
        return ColumnCodec(label, _Multirange(t.subtype_oid, catalog))
    if t.name == "record":
        return ColumnCodec(label, _Composite(catalog))
    return ColumnCodec(label, _Opaque(label, t.oid, catalog))


def arrow_schema(
    columns: Sequence[tuple[str, int, int] | tuple[str, int, int, int]], catalog: TypeCatalog | None = None
) -> pa.Schema:
    """Arrow schema of a relation: (name, type_oid, typmod[, ndims]) per column, all nullable."""
    fields = []
    for col in columns:
        name, oid, typmod = col[0], col[1], col[2]
        ndims = col[3] if len(col) > 3 else 1
        codec = codec_for(oid, typmod, catalog, ndims=ndims)
        fields.append(pa.field(name, codec.arrow_type, nullable=True, metadata={"pg_type": codec.pg_type}))
    return pa.schema(fields)


__all__ = [
    "KIND_BINARY",
    "KIND_NULL",
    "KIND_TEXT",
    "KIND_TOAST",
    "ColumnCodec",
    "TextRenderer",
    "TypeCatalog",
    "TypeInfo",
    "arrow_schema",
    "codec_for",
    "numeric_typmod",
    "value_of_text_array",
]
