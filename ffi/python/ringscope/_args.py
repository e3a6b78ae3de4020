"""Value checks for everything that crosses into C: ctypes wraps an out-of-range integer, truncates a
float, and C stops reading a string at its first NUL, all without a word; so each value is checked here
first and refused with an error that names the argument."""

from __future__ import annotations

import numbers
import operator
import os
import sys

import numpy as np

from .errors import RingscopeError
from .dtypes import _NUMPY_FOR_DTYPE


# -- argument checks ----------------------------------------------------------------------------------------------
# Every value that crosses into C goes through one of these. ctypes wraps an out-of-range integer, truncates a
# float, and C stops reading a string at its first NUL, all without a word: so each value is checked here first and
# refused with an error that names the argument. Integers are ints or numpy integers (anything with __index__);
# bools and floats are refused, so a flag or a computed 4.7 never passes for a count.

_U32_MAX = 2**32 - 1


_U64_MAX = 2**64 - 1


#: The longest wait the C ABI can express: a u32 of milliseconds, about 49.7 days.
MAX_TIMEOUT_S = _U32_MAX / 1000


def _invalid(message: str) -> RingscopeError:
    return RingscopeError("RS_ERR_INVALID_ARGUMENT", message)


def _show(value) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _int(name: str, value, lo: int, hi: int, hint: str = "") -> int:
    if not isinstance(value, (bool, np.bool_)):
        try:
            v = operator.index(value)
        except TypeError:
            v = None
        if v is not None and lo <= v <= hi:
            return v
    raise _invalid(f"{name} must be an integer in {lo}..={hi}, got {_show(value)}{hint}")


def _u32(name: str, value, lo: int = 0) -> int:
    return _int(name, value, lo, _U32_MAX)


def _u64(name: str, value) -> int:
    return _int(name, value, 0, _U64_MAX)


def _flag(name: str, value) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise _invalid(f"{name} must be True or False, got {_show(value)}")


def _timeout_ms(name: str, seconds) -> int:
    """Seconds → the C ABI's u32 milliseconds, rounded to the nearest millisecond."""
    ok = isinstance(seconds, numbers.Real) and not isinstance(seconds, (bool, np.bool_))
    if ok:
        try:
            s = float(seconds)
        except OverflowError:
            s = float("inf")
        ok = 0.0 <= s <= MAX_TIMEOUT_S  # False for NaN too
    if not ok:
        raise _invalid(f"{name} must be a number of seconds in 0..={MAX_TIMEOUT_S} (the library waits at most "
                       f"2**32 - 1 ms, about 49.7 days), got {_show(seconds)}")
    return min(round(s * 1000), _U32_MAX)


def _text(name: str, value) -> bytes:
    """A string → UTF-8 bytes for a NUL-terminated C string."""
    if not isinstance(value, str):
        raise _invalid(f"{name} must be a string, got {type(value).__name__} {_show(value)}")
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _invalid(f"{name} is not encodable as UTF-8 ({e.reason} at index {e.start}): {_show(value)}") from None
    return _no_nul(name, data, value.find("\0"))


def _no_nul(name: str, data: bytes, at: int) -> bytes:
    if b"\0" in data:
        raise _invalid(f"{name} contains a NUL character (at index {at}): C would ignore everything after it")
    return data


def _path(name: str, value) -> bytes:
    try:
        data = os.fsencode(value)
    except TypeError:
        raise _invalid(f"{name} must be a path (str, bytes or os.PathLike), got {type(value).__name__} "
                       f"{_show(value)}") from None
    except UnicodeEncodeError as e:
        raise _invalid(f"{name} is not encodable for the file system ({e.reason}): {_show(value)}") from None
    return _no_nul(name, data, data.find(b"\0"))


def _int_array(name: str, values, dtype) -> np.ndarray:
    """A one-dimensional sequence of integers → a C-contiguous array of ``dtype`` (uint32 or uint64), every element
    range-checked. Lists are checked element by element (numpy would turn ``[1, 2**64 - 1]`` into floats)."""
    dtype = np.dtype(dtype)
    hi = int(np.iinfo(dtype).max)
    if isinstance(values, (str, bytes)) or values is None:
        raise _invalid(f"{name} must be a sequence of integers, got {type(values).__name__} {_show(values)}")
    if not isinstance(values, np.ndarray) and hasattr(values, "__array__") and not isinstance(values, (list, tuple)):
        values = np.asarray(values)  # torch tensors and other array-likes
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise _invalid(f"{name} must be one-dimensional, got an array of shape {values.shape}")
        if values.dtype.kind in "iu":
            if values.size:
                lo_i, hi_i = int(values.argmin()), int(values.argmax())
                for i in (lo_i, hi_i):
                    if not 0 <= int(values[i]) <= hi:
                        raise _invalid(f"{name}[{i}] must be an integer in 0..={hi}, got {int(values[i])}")
            return np.ascontiguousarray(values, dtype=dtype)  # converts values (and byte order), never reinterprets
        if values.dtype.kind != "O":
            raise _invalid(f"{name} must hold integers, got an array of {values.dtype}")
        values = values.tolist()
    try:
        items = list(values)
    except TypeError:
        raise _invalid(f"{name} must be a sequence of integers, got {type(values).__name__} {_show(values)}") from None
    return np.array([_int(f"{name}[{i}]", v, 0, hi) for i, v in enumerate(items)], dtype=dtype)


def _host_array(name: str, array, dtype: "str | None", row_width: "int | None") -> np.ndarray:
    """The array a host capture reads: C-contiguous, little-endian (the record format's byte order; a big-endian
    array is refused, not converted, like a non-contiguous one: the copy is the caller's to make), of ``dtype``
    (bf16: uint16/int16 bit patterns or ml_dtypes' bfloat16) and with rows of ``row_width`` elements (its last
    dimension; leading dimensions are rows in row-major order). ``dtype``/``row_width`` None: not known here."""
    a = np.asarray(array)
    if not a.flags["C_CONTIGUOUS"]:
        raise _invalid(f"{name} is not C-contiguous: pass np.ascontiguousarray(x) (a copy) explicitly")
    dt = a.dtype
    if dt.kind not in "iuf" and dt.name != "bfloat16":
        raise _invalid(f"{name} must be a numeric array, got an array of {dt}")
    if dt.itemsize > 1 and (dt.byteorder == ">" or dt.byteorder == "=" and sys.byteorder == "big"):
        raise _invalid(f"{name} is big-endian ({dt.str}) but records are little-endian: pass "
                       f"x.astype('{dt.newbyteorder('<').str}') (a copy) explicitly")
    if dtype is not None:
        want = _NUMPY_FOR_DTYPE.get(dtype)
        # bf16 has no numpy dtype: its bit patterns as (u)int16, or ml_dtypes' bfloat16 — never float16, whose
        # bits mean something else.
        bf16_bits = dtype == "bf16" and (dt.kind in "ui" and dt.itemsize == 2 or dt.name == "bfloat16")
        if want is not None and dt.newbyteorder("<") != want and not bf16_bits:
            hint = " (bf16: pass its bit patterns as uint16, e.g. tensor.view(torch.uint16).numpy())" \
                if dtype == "bf16" else ""
            raise _invalid(f"{name} holds {dtype}; got an array of {dt}{hint}")
    if row_width is not None and (a.ndim == 0 or a.shape[-1] != row_width):
        raise _invalid(f"{name} has rows of {row_width} elements: the array must be (rows, {row_width}); got shape "
                       f"{a.shape}")
    return a
