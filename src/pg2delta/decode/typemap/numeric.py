"""Numbers: int2/int4/int8 and the 4-byte unsigned OID types, float4/float8, numeric, money.

numeric(p, s) that fits decimal128 is exact (NaN becomes NULL, counted); unbounded or wider
numerics are PostgreSQL's own text. Binary numerics go through the C extension in bulk
(``numeric_decimal128``, ``numeric_texts``); ``_numeric_text`` is the reference printer.
"""

from __future__ import annotations

import collections
import decimal
import re
import struct
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from numpy.typing import NDArray

from pg2delta.decode import _tuples
from pg2delta.decode.typemap.handler import (
    Bad,
    Handler,
    Notes,
    Part,
    TextLike,
    check_len,
    check_len1,
    gather_be,
    gather_strings,
    utf8,
)

DECIMAL128_MAX_PRECISION = 38


_EXACT = decimal.Context(prec=1000, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


def _scaled(units: int, scale: int) -> Decimal:
    """units * 10**-scale, exactly."""
    return Decimal(units).scaleb(-scale, context=_EXACT)


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
        raise Bad("numeric shorter than its header")
    ndigits, weight, sign, dscale = _NUMERIC_HEAD.unpack_from(data)
    if ndigits < 0 or len(data) != 8 + 2 * ndigits:
        raise Bad("numeric length does not match its digit count")
    if sign not in (_NUMERIC_POS, _NUMERIC_NEG, _NUMERIC_NAN, _NUMERIC_PINF, _NUMERIC_NINF):
        raise Bad("numeric sign word is invalid")
    if dscale < 0:
        raise Bad("numeric display scale is negative")
    st = _DIGIT_STRUCTS.get(ndigits)
    if st is None:
        st = _DIGIT_STRUCTS.setdefault(ndigits, struct.Struct(f"!{ndigits}H"))
    digits: tuple[int, ...] = st.unpack_from(data, 8)
    if digits and max(digits) >= 10000:
        raise Bad("numeric digit out of range")
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


_INT_TEXT = re.compile(rb"-?\d+")


class _Int(Handler):
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
            raise Bad("not an integer")
        v = int(data)
        if not self.lo <= v <= self.hi:
            raise Bad("integer out of range")
        return v

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, self.width)
        return int.from_bytes(data, "big", signed=not self.unsigned)

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, self.width)
        values = gather_be(part.raw, part.starts, self.dtype)
        return pa.array(values.astype(self.arrow_type.to_pandas_dtype(), copy=False), type=self.arrow_type)

    def vec_text(self, part: Part) -> pa.Array | None:
        try:
            return pc.cast(gather_strings(part.raw, part.starts, part.lengths, binary=True).cast(pa.string()), self.arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None  # the reference path finds the bad row


class _Float(Handler):
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
            raise Bad("not a float") from None
        return float(np.float32(v)) if self.width == 4 else v

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, self.width)
        return struct.unpack(self.fmt, data)[0]

    def pg_text(self, data: bytes) -> str:
        return _fmt_float(self.ref_binary(data, collections.Counter()), self.width == 4)

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, self.width)
        return pa.array(gather_be(part.raw, part.starts, f">f{self.width}"), type=self.arrow_type)

    def vec_text(self, part: Part) -> pa.Array | None:
        try:
            return pc.cast(gather_strings(part.raw, part.starts, part.lengths, binary=True).cast(pa.string()), self.arrow_type)
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


class _Decimal(Handler):
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
            raise Bad("numeric infinity in a bounded numeric column")
        q = d.scaleb(self.scale, context=_EXACT)
        if q != q.to_integral_value(context=_EXACT):
            raise Bad("numeric value has more fractional digits than the column scale")
        units = int(q)
        if abs(units) >= self.limit:
            raise Bad("numeric value exceeds the column precision")
        return _scaled(units, self.scale)

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if data == b"NaN":
            return self._from_decimal(Decimal("NaN"), notes)
        if not re.fullmatch(rb"-?\d+(\.\d+)?|-?Infinity", data):
            raise Bad("not a numeric")
        return self._from_decimal(Decimal(data.decode("ascii")), notes)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return self._from_decimal(Decimal(_numeric_text(data)), notes)

    def pg_text(self, data: bytes) -> str:
        return _numeric_text(data)

    def vec_text(self, part: Part) -> pa.Array | None:
        try:
            strings = gather_strings(part.raw, part.starts, part.lengths, binary=True).cast(pa.string())
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

    def vec_binary(self, part: Part) -> pa.Array | None:
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


class _NumericText(TextLike):
    """Unbounded (or wider than 38 digits) numeric -> PostgreSQL's text."""

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        if not re.fullmatch(rb"-?\d+(\.\d+)?|NaN|-?Infinity", data):
            raise Bad("not a numeric")
        return data.decode("ascii")

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        return _numeric_text(data)

    def pg_text(self, data: bytes) -> str:
        return _numeric_text(data)

    def vec_binary(self, part: Part) -> pa.Array | None:
        offsets = np.empty(len(part.starts) + 1, dtype=np.int32)
        try:
            text = _tuples.numeric_texts(
                part.raw, np.ascontiguousarray(part.starts, dtype=np.int64),
                np.ascontiguousarray(part.lengths, dtype=np.int64), offsets,
            )
        except OverflowError:
            raise Bad("more than 2 GiB of values in one column chunk") from None
        if isinstance(text, int):
            return None  # not a numeric: the reference path says which row and why
        return pa.Array.from_buffers(pa.string(), len(part.starts), [None, pa.py_buffer(offsets), pa.py_buffer(text)])


class _Money(Handler):
    arrow_type = pa.decimal128(19, 2)

    def ref_binary(self, data: bytes, notes: Notes) -> Any:
        check_len1(data, 8)
        return _scaled(int.from_bytes(data, "big", signed=True), 2)

    def ref_text(self, data: bytes, notes: Notes) -> Any:
        text = utf8(data)
        neg = "-" in text or "(" in text
        body = re.sub(r"[^0-9.]", "", text)
        if not re.fullmatch(r"\d+(\.\d{1,2})?", body):
            raise Bad("not a money value")
        units = int(Decimal(body).scaleb(2, context=_EXACT))
        return _scaled(-units if neg else units, 2)

    def pg_text(self, data: bytes) -> str:
        check_len1(data, 8)
        v = int.from_bytes(data, "big", signed=True)
        whole, cents = divmod(abs(v), 100)
        return f"{'-' if v < 0 else ''}${whole:,}.{cents:02d}"

    def vec_binary(self, part: Part) -> pa.Array:
        check_len(part, 8)
        v = gather_be(part.raw, part.starts, ">i8")
        return _decimal_from_limbs(
            v.view(np.uint64), np.where(v < 0, np.uint64(2**64 - 1), np.uint64(0)), None, self.arrow_type
        )


def numeric_typmod(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) of a numeric typmod, None when unbounded (scale may be negative, PG15+)."""
    if typmod < 4:
        return None
    t = typmod - 4
    precision = (t >> 16) & 0xFFFF
    scale = ((t & 0x7FF) ^ 1024) - 1024
    return precision, scale


def numeric_handler(typmod: int) -> Handler:
    """decimal128 when the typmod's precision (negative scales folded in, PG15+) fits 38 digits, else text."""
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


BUILTIN: dict[str, Callable[[], Handler]] = {
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
}
