"""The dtypes of the record format (docs/format.md): codes, numpy types, bf16 and fp8 conversions."""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np


#: dtype codes of the record format (docs/format.md) → (name, numpy dtype of the raw element; bf16 as uint16;
#: f8e4m3_rowscaled as its raw bytes: an f32 scale, then one E4M3 byte per element — :func:`dequantize_rowscaled`).
DTYPE_CODES: Dict[int, Tuple[str, np.dtype]] = {
    1: ("f32", np.dtype("<f4")),
    2: ("f16", np.dtype("<f2")),
    3: ("bf16", np.dtype("<u2")),
    4: ("f64", np.dtype("<f8")),
    5: ("i8", np.dtype("i1")),
    6: ("u8", np.dtype("u1")),
    7: ("i16", np.dtype("<i2")),
    8: ("i32", np.dtype("<i4")),
    9: ("i64", np.dtype("<i8")),
    10: ("f8e4m3", np.dtype("u1")),
    11: ("f8e5m2", np.dtype("u1")),
    12: ("f8e4m3_rowscaled", np.dtype("u1")),
}


#: dtype of rows downcast on capture (``Session.set_downcast``).
ROWSCALED = "f8e4m3_rowscaled"


def _e4m3_table() -> np.ndarray:
    """The float32 value of each of the 256 OCP FP8 E4M3 codes (0x7F and 0xFF are NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    e = (codes >> 3) & 0xF
    m = (codes & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * 2.0 ** (e.astype(np.float64) - 7))
    mag[(e == 15) & ((codes & 7) == 7)] = np.nan
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


_E4M3 = _e4m3_table()


def dequantize_rowscaled(raw: np.ndarray) -> np.ndarray:
    """Rows of dtype ``f8e4m3_rowscaled`` (uint8, shape (rows, 4 + row_width): a little-endian f32 scale, then one
    E4M3 byte per element) → float32 values (rows, row_width): ``e4m3 × scale``."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    scale = raw[:, :4].copy().view("<f4")
    return _E4M3[raw[:, 4:]] * scale


_NUMPY_FOR_DTYPE: Dict[str, np.dtype] = {name: dt for name, dt in DTYPE_CODES.values()}


def element_bytes(name: str) -> int:
    """Bytes of one element of the record-format dtype ``name`` (``"bf16"``: 2)."""
    return _NUMPY_FOR_DTYPE[name].itemsize


#: A row's metadata in a record: its request id and position (docs/format.md, ``RowMeta``).
ROW_META_BYTES = 16


_ALIASES: Dict[str, str] = {"float32": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16", "float64": "f64",
                            "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64"}


def as_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) → float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _as_float32(values: np.ndarray, dtype_name: str) -> np.ndarray:
    """Rows of a float dtype (bf16 as uint16 bit patterns) → float32, exactly."""
    return as_float32(values) if dtype_name == "bf16" else values.astype(np.float32)
