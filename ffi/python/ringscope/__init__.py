"""ringscope: make an LLM's internal state observable while it serves.

Python bindings (ctypes) over ``libringscope``, the library's C ABI (``ffi/include/ringscope.h``). Every failure of
the library raises :class:`RingscopeError` with the library's message; nothing here can crash the interpreter
through bad input (null pointers, stale handles and panics are all turned into errors by the C ABI).

Every argument is checked before it reaches C, and a bad one is a :class:`RingscopeError` (``RS_ERR_INVALID_ARGUMENT``)
naming it — never a value silently wrapped, truncated or cut short: integers must be ints (or numpy integers; not
floats, not bools) in the C type's range; strings must be encodable as UTF-8 and hold no NUL; timeouts are seconds
in 0..=4294967.295 (the C ABI waits at most ``2**32 - 1`` ms, about 49.7 days), never negative or NaN; arrays must
be C-contiguous and little-endian (or single-byte), of the hookpoint's dtype, with rows of the hookpoint's width.

    import numpy as np, ringscope
    with ringscope.Session('[export]\\nparquet = true\\ndir = "out"\\nrun_id = "demo"') as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="f32", row_width=4)
        s.begin_step(0, request_ids=[7, 9], positions=[17, 0])
        s.capture(hp, np.ones((2, 4), dtype=np.float32))
        s.end_step()
    dump = ringscope.read_dump("out/demo")            # numpy arrays, one entry per hookpoint
    lost = ringscope.read_events("out/demo")          # what was dropped, when and why (empty: nothing)
"""

from __future__ import annotations

import ctypes
import json
import numbers
import operator
import os
import pathlib
import sys
from collections.abc import Mapping
from typing import Dict, Iterable, NamedTuple, Optional, Sequence

import numpy as np

from ._abi import (PROBE_MAX_OUTPUTS, _CODE, _NO_HOOKPOINT, _PROBE_ACTIONS, _PROBE_MODES,
                   _PROBE_NAME_LEN, _Alert, _check, _Counts, _DestinationSnapshot,
                   _HookPointSnapshot, _lib_with, _load, _ProbeReport, _ProbeSnapshot, _probes_lib, _RecordInfo,
                   _SessionSnapshot, _SinkFailureInfo, _SinkHealth, _sized, _stats_lib, library_path)
from .errors import (BufferTooSmallError, CaptureError, ClosedError, ConfigError, CudaError, EndedError,
                     InvalidArgumentError, InvalidHandleError, IoError, NotSeenError, PanicError, RingscopeError,
                     SinkError, StateError, StepError, UnbalancedError, WaitTimeoutError)

__all__ = ["RingscopeError", "Session", "Subscription", "Record", "Alert", "read_dump", "read_events", "save_probe",
           "library_path", "EVENTS_DIR", "EVENT_COLUMNS", "DTYPE_CODES", "MAX_TIMEOUT_S", "PROBE_MAX_OUTPUTS",
           "InvalidArgumentError", "InvalidHandleError", "ConfigError", "ClosedError", "StepError", "CaptureError",
           "CudaError", "IoError", "UnbalancedError", "WaitTimeoutError", "BufferTooSmallError", "EndedError",
           "PanicError", "SinkError", "NotSeenError", "StateError"]

#: dtype codes of the record format (docs/format.md) → (name, numpy dtype of the raw element; bf16 as uint16;
#: f8e4m3_rowscaled as its raw bytes: an f32 scale, then one E4M3 byte per element — :func:`dequantize_rowscaled`).
DTYPE_CODES = {
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

_NUMPY_FOR_DTYPE = {name: dt for name, dt in DTYPE_CODES.values()}
_ALIASES = {"float32": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16", "float64": "f64", "int8": "i8",
            "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64"}


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


class Alert(NamedTuple):
    """A probe's aggregated score for a request reached its threshold (:meth:`Session.alerts`). Raised once per
    request, probe and output. ``action`` is ``"alert"`` or ``"stop"`` (then the request's stop flag was raised
    before the alert was queued: :meth:`Session.is_flagged` is already true). ``step`` and ``position`` are those of
    the token whose score made the aggregate (``score``) reach ``threshold``; ``token_score`` is that token's own
    score. ``label`` is the output's label (its index as text when the probe names none); a label of 64 bytes or
    more is cut (at a character boundary) and ``label_cut`` is then true."""

    probe: str
    output: int
    label: str
    request_id: int
    step: int
    position: int
    score: float
    token_score: float
    threshold: float
    action: str
    label_cut: bool = False

    def to_dict(self) -> dict:
        return dict(self._asdict())


def _current_stream(device: Optional[int] = None) -> int:
    """torch's current CUDA stream on ``device`` (an index; default the current device), as a ``CUstream``: through
    the raw-stream call torch's own compiler uses where it exists (a fraction of a microsecond, where building a
    ``torch.cuda.Stream`` takes several — this is called before every graph replay in full mode)."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device)
    return torch.cuda.current_stream(device).cuda_stream


class Record:
    """One record delivered to a subscription: ``hookpoint`` (id), ``step``, ``seq``, ``dtype`` (name),
    ``request_id`` / ``position`` / ``batch_row`` (numpy arrays, one per row) and ``rows`` (numpy array of shape
    (rows, row_width); bf16 as uint16 bit patterns, see :func:`as_float32`)."""

    def __init__(self, info: _RecordInfo, buf: bytes):
        n = info.rows
        meta = np.frombuffer(buf, dtype=np.dtype([("request_id", "<u8"), ("position", "<u4"), ("batch_row", "<u4")]),
                             count=n)
        name, dt = DTYPE_CODES[info.dtype]
        self.hookpoint = info.hookpoint
        self.step = info.step
        self.seq = info.seq
        self.dtype = name
        self.request_id = meta["request_id"].copy()
        self.position = meta["position"].copy()
        self.batch_row = meta["batch_row"].copy()
        self.rows = np.frombuffer(buf, dtype=dt, offset=16 * n).reshape(n, info.row_bytes // dt.itemsize).copy()

    def __repr__(self):
        return f"Record(hookpoint={self.hookpoint}, step={self.step}, rows={len(self.rows)}, dtype={self.dtype})"


def as_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) → float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class Subscription:
    """An online consumer: every record captured after :meth:`Session.subscribe` returned, in stream order."""

    def __init__(self, handle: int):
        self._h = handle
        self._buf = ctypes.create_string_buffer(1 << 16)

    def poll(self, timeout: float = 1.0) -> Optional[Record]:
        """The next record, waiting up to ``timeout`` seconds; ``None`` on timeout. Raises ``RS_ERR_ENDED`` once
        the session is closed and everything was delivered. ``timeout``: seconds in 0..=:data:`MAX_TIMEOUT_S`."""
        ms = _timeout_ms("timeout", timeout)
        lib = _load()
        info = _RecordInfo()
        while True:
            st = lib.rs_poll(self._h, ms, ctypes.byref(info), self._buf, len(self._buf))
            if st == _CODE["RS_ERR_TIMEOUT"]:
                return None
            if st == _CODE["RS_ERR_BUFFER_TOO_SMALL"]:  # grow and take the same record again
                self._buf = ctypes.create_string_buffer(int(info.needed))
                continue
            _check(st)
            return Record(info, self._buf.raw[: info.needed])

    def __iter__(self):
        while True:
            try:
                r = self.poll(1.0)
            except RingscopeError as e:
                if e.status == "RS_ERR_ENDED":
                    return
                raise
            if r is not None:
                yield r

    def close(self) -> None:
        _check(_load().rs_subscription_close(self._h))


def _hookpoint_spec(hp: "_HookPointSnapshot") -> dict:
    """``dtype`` (name) and ``row_width`` of a hookpoint snapshot; None from a library before C ABI 4."""
    if hp.struct_size < ctypes.sizeof(_HookPointSnapshot) or hp.dtype not in DTYPE_CODES:
        return {"dtype": None, "row_width": None}
    return {"dtype": DTYPE_CODES[hp.dtype][0], "row_width": hp.row_width}


def _text_of(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class Session:
    """A ringscope session. ``config`` is TOML text (``str``, or UTF-8 ``bytes``; docs/configuration.md is
    the reference) or a dict (any mapping) of TOML sections, each a mapping (``hookpoints``: a list of mappings); or give
    ``config_file``, a path. Use as a context manager, or call :meth:`close`."""

    def __init__(self, config: "str | bytes | Mapping | None" = None, *,
                 config_file: "str | os.PathLike | None" = None):
        if config_file is not None:
            if config is not None:
                raise _invalid("give config or config_file, not both")
            arg, opener = _path("config_file", config_file), "rs_session_open_file"
        else:
            arg, opener = _config_text(config), "rs_session_open"
        lib = _load()
        h = ctypes.c_uint64(0)
        _check(getattr(lib, opener)(arg, ctypes.byref(h)))
        self._h = h.value
        self._row_bytes: Dict[int, tuple] = {}
        self.totals: Optional[dict] = None

    # -- hookpoints ----------------------------------------------------------------------------------------------
    def register(self, name: str, *, site: str = "residual", layer: Optional[int] = None, dtype: str = "bf16",
                 row_width: int) -> int:
        """Registers a hookpoint; returns its id. ``layer``: None (no layer) or 0..=2**32-1; ``row_width``:
        elements per row, 1..=2**32-1."""
        name_b, site_b, dtype_b = _text("name", name), _text("site", site), _text("dtype", dtype)
        layer_c = -1 if layer is None else _int("layer", layer, 0, _U32_MAX, " (None for no layer)")
        width = _u32("row_width", row_width, lo=1)
        out = ctypes.c_uint32()
        _check(_load().rs_register_hookpoint(self._h, name_b, site_b, layer_c, dtype_b, width, ctypes.byref(out)))
        self._row_bytes[out.value] = (_ALIASES.get(dtype, dtype), width)
        return out.value

    def hookpoint_id(self, name: str) -> int:
        out = ctypes.c_uint32()
        _check(_load().rs_hookpoint_id(self._h, _text("name", name), ctypes.byref(out)))
        return out.value

    def set_enabled(self, hookpoint: int, enabled: bool) -> None:
        _check(_load().rs_set_enabled(self._h, _u32("hookpoint", hookpoint), _flag("enabled", enabled)))

    def set_downcast(self, hookpoint: int, downcast: bool) -> None:
        """Turns the downcast on capture of a bf16 / f16 / f32 hookpoint on or off: its rows are then stored as
        row-scaled FP8 E4M3 (``f8e4m3_rowscaled``: a scale per row, one byte per element), in a file series of their
        own that :func:`read_dump` and :func:`ringscope.stream.iter_batches` read back dequantized. Takes effect like
        :meth:`set_enabled`; another dtype raises ``RS_ERR_INVALID_ARGUMENT``."""
        _check(_load().rs_set_downcast(self._h, _u32("hookpoint", hookpoint), _flag("downcast", downcast)))

    def set_every_n_steps(self, hookpoint: int, n: int) -> None:
        """Captures only steps that are multiples of ``n`` (1..=2**32-1)."""
        _check(_load().rs_set_every_n_steps(self._h, _u32("hookpoint", hookpoint), _u32("n", n, lo=1)))

    def set_rows(self, hookpoint: int, rows: "str | Sequence[int]") -> None:
        """``"all"``, ``"last_per_request"``, or a list of batch rows."""
        hp = _u32("hookpoint", hookpoint)
        lib = _load()
        if isinstance(rows, str):
            modes = {"all": 0, "last_per_request": 1}
            if rows not in modes:
                raise _invalid(f"rows must be \"all\", \"last_per_request\" or a list of batch rows, got {_show(rows)}")
            _check(lib.rs_set_rows(self._h, hp, modes[rows], None, 0))
        else:
            a = _int_array("rows", rows, np.uint32)
            _check(lib.rs_set_rows(self._h, hp, 2, a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), a.size))

    # -- steps and captures --------------------------------------------------------------------------------------
    def begin_step(self, step: int, request_ids: Sequence[int], positions: Sequence[int],
                   stream: Optional[int] = None) -> None:
        """Starts a step: row i of every tensor captured in it belongs to ``request_ids[i]`` at ``positions[i]``.
        With the CUDA backend pass the engine's ``stream`` (a ``CUstream`` handle as an int, e.g.
        ``torch.cuda.current_stream().cuda_stream``)."""
        step = _u64("step", step)
        stream = None if stream is None else _u64("stream", stream)
        ids = _int_array("request_ids", request_ids, np.uint64)
        pos = _int_array("positions", positions, np.uint32)
        if pos.shape != ids.shape:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"{ids.size} request ids but {pos.size} positions: give one of each per batch row")
        lib = _load()
        pids = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        ppos = pos.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
        if stream is None:
            _check(lib.rs_begin_step(self._h, step, pids, ppos, ids.size))
        else:
            _check(lib.rs_begin_step_on_stream(self._h, step, pids, ppos, ids.size, stream))

    def begin_step_graph(self, request_ids, positions, stream: Optional[int] = None) -> None:
        """CUDA backend: starts a step from inside a CUDA graph being recorded (or eagerly). The recorded kernel reads
        the batch from the engine's own device tensors at every replay, so best-effort replays need no Python call:
        ``request_ids`` is an int64 CUDA tensor ``[batch]`` (one request per batch row), ``positions`` an int64 CUDA
        tensor ``[batch, seq]`` (e.g. ``position_ids``) or ``[seq]`` shared by every row (e.g. ``cache_position``).
        Their addresses are fixed into the graph: update them in place. Record the step's captures and
        :meth:`end_step` in the same graph. Full mode: call :meth:`admit_graph_step` before every replay."""
        def check(t, what):
            if not (hasattr(t, "is_cuda") and t.is_cuda and str(t.dtype) == "torch.int64" and t.is_contiguous()):
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"begin_step_graph: {what} must be a contiguous int64 CUDA tensor; got "
                                     f"{getattr(t, 'dtype', type(t).__name__)} on "
                                     f"{getattr(t, 'device', 'the host')}")
        check(request_ids, "request_ids")
        check(positions, "positions")
        if request_ids.dim() != 1 or positions.dim() not in (1, 2):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"begin_step_graph: request_ids must be [batch] and positions [batch, seq] or [seq]; "
                                 f"got {tuple(request_ids.shape)} and {tuple(positions.shape)}")
        batch = request_ids.shape[0]
        seq = positions.shape[-1]
        if positions.dim() == 2 and positions.shape[0] != batch:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"begin_step_graph: {batch} request ids but positions for {positions.shape[0]} rows")
        stride = seq if positions.dim() == 2 else 0
        if stream is None:
            import torch
            stream = torch.cuda.current_stream(request_ids.device).cuda_stream
        _check(_load().rs_begin_step_graph(self._h, request_ids.data_ptr(), positions.data_ptr(),
                                           _u32("the batch size", batch), _u32("the sequence length", seq),
                                           _u32("the positions' row stride", stride), _u64("stream", stream)))

    def admit_graph_step(self, rows: Optional[int] = None, stream: Optional[int] = None) -> None:
        """Full mode (CUDA backend): admits the next replay of a CUDA graph whose step begins inside it
        (:meth:`begin_step_graph`). Call it before every replay, on the replay's ``stream`` (default: torch's current
        stream), outside graph recording: it waits (up to the step's wait budget) until the drain has room for
        everything such a step can capture and reserves it — a check of two host counters when there is room, so a
        lossless replay costs what a best-effort one does. ``rows`` bounds the replay's batch rows (default: the
        largest graph-begun step recorded in this session). Past the budget it raises ``RingscopeError`` naming the
        deadline (nothing with ``policy.on_deadline = "degrade"``) and the replay's captures are dropped and counted
        as ``deadline``. Also uploads control changes, as :meth:`apply_controls` does. Best-effort sessions: returns
        at once."""
        lib = _lib_with("rs_admit_graph_step")
        n = 0 if rows is None else _u32("admit_graph_step: rows", rows, 1)
        _check(lib.rs_admit_graph_step(self._h, n, _u64("stream", _current_stream() if stream is None else stream)))

    def apply_controls(self, stream: Optional[int] = None) -> None:
        """CUDA backend: uploads control changes (enable, every-N, rows) on ``stream`` (default: torch's current
        stream) for CUDA graphs whose steps begin inside them (:meth:`begin_step_graph`; their replays make no host
        call). Call between replays."""
        if stream is None:
            stream = _current_stream()
        _check(_load().rs_apply_controls(self._h, _u64("stream", stream)))

    def submit_captures(self) -> None:
        """With ``ring.defer_captures`` (CUDA backend): starts copying the step's captures noted so far now, on a side
        stream, overlapping the rest of the step; :meth:`end_step` joins it back. A no-op otherwise."""
        _check(_load().rs_submit_captures(self._h))

    def end_step(self) -> None:
        _check(_load().rs_end_step(self._h))

    def capture(self, hookpoint: int, array) -> str:
        """Captures a host array (numpy, or anything exposing the buffer protocol) holding the step's batch rows ×
        row width, C-contiguous, little-endian, of the hookpoint's dtype (bf16: uint16 bit patterns): shape
        (rows, row_width), or (row_width,) for one row, or any shape whose last dimension is the row width (leading
        dimensions are rows in row-major order, e.g. (batch, seq, hidden)). A big-endian array is refused, not
        converted. Returns ``"published"``, ``"sampled_out"`` or ``"dropped"``."""
        hp = _u32("hookpoint", hookpoint)
        dtype, width = self._row_bytes.get(hp, (None, None))
        a = _host_array(f"the array for hookpoint {hp}", array, dtype, width)
        outcome = ctypes.c_int32(-1)
        _check(_load().rs_capture_host(self._h, hp, a.ctypes.data, a.nbytes, ctypes.byref(outcome)))
        return {0: "published", 1: "sampled_out", 2: "dropped"}[outcome.value]

    def capture_device(self, hookpoint: int, device_ptr: int, rows: int, stream: int) -> None:
        """CUDA backend: launches the capture of ``rows`` contiguous rows at ``device_ptr`` on ``stream``."""
        _check(_load().rs_capture_device(self._h, _u32("hookpoint", hookpoint), _u64("device_ptr", device_ptr),
                                         _u32("rows", rows), _u64("stream", stream)))

    def capture_device_last_rows(self, hookpoint: int, device_ptr: int, rows: int, stream: int) -> None:
        """CUDA backend: like :meth:`capture_device`, from a source holding one row per request — the step's last
        row of each request, in batch order (what a model computes for each request's last token only, such as a
        prefill's logits): row ``k`` is captured, and scored by fused probes, as the step's ``k``-th last row."""
        _check(_load().rs_capture_device_last_rows(self._h, _u32("hookpoint", hookpoint),
                                                   _u64("device_ptr", device_ptr), _u32("rows", rows),
                                                   _u64("stream", stream)))

    # -- state ---------------------------------------------------------------------------------------------------
    def stats(self, hookpoint: int) -> dict:
        """Counters of one hookpoint (records and rows): ``produced``, ``sampled_out``, ``exported`` — *committed*:
        delivered to every destination, which for a file sink means in a committed file —, ``dropped`` (by reason),
        and ``in_flight``: captured but not committed yet (in the ring, queued, or in a file still being written;
        ``flush()`` commits it). Mid-run, rows in an open file are ``in_flight``, not ``exported``."""
        c = _Counts()
        _check(_load().rs_stats(self._h, _u32("hookpoint", hookpoint), ctypes.byref(c)))
        return c.to_dict()

    def stats_all(self) -> dict:
        """The session's numbers now, as a dict mirroring the Rust ``SessionStats``: ``unix_ns``, ``uptime_s``,
        ``mode``, ``backend``, ``steps``, ``last_step`` (None before the first step), ``step_time_s`` and
        ``step_interval_s`` (mean over the last 16 steps of begin→end and begin→next begin; None when unknown),
        ``ring`` (``capacity_bytes``, ``used_bytes``, ``held_bytes``), ``drain`` (``records``, ``rows``, ``bytes``,
        ``data_bytes``), ``destinations`` (a list of dicts: ``name``, ``kind`` "sink" or "consumer",
        ``delivered_records``, ``delivered_bytes``, ``queued_records``, ``queued_bytes``, ``dropped_records``,
        ``failed``) and ``hookpoints`` (a list of dicts: ``id``, ``name``, ``row_bytes``, ``counters`` as
        :meth:`stats` returns them, ``produced_bytes``, ``published_bytes``, ``exported_bytes``, ``rung`` — the user's
        controls and the policy manager's rung together —, ``downcast_records`` and ``downcast_rows``), and ``stalls``
        / ``stall_time_s`` (full mode's waits for room), and ``cached_rows`` (token rows the engine took from its
        prefix cache, :meth:`note_cached`).

        Counters are cumulative: difference two calls for rates. Cheap enough to call every step; no device call
        (CUDA backend: the device-counted hookpoint counters are those of the last :meth:`stats` or :meth:`flush`).
        """
        lib = _stats_lib()
        st = _sized(_SessionSnapshot)
        _check(lib.rs_session_stats(self._h, ctypes.byref(st)))
        hookpoints = []
        for hp_id in range(st.hookpoints):
            hp = _sized(_HookPointSnapshot)
            name = ctypes.create_string_buffer(257)  # hookpoint names are at most 256 bytes
            _check(lib.rs_hookpoint_stats(self._h, hp_id, ctypes.byref(hp), name, len(name)))
            hookpoints.append({
                "id": hp.id, "name": name.raw[:hp.name_len].decode("utf-8", "replace"), "row_bytes": hp.row_bytes, "counters": hp.counts.to_dict(),
                "produced_bytes": hp.produced_bytes, "published_bytes": hp.published_bytes,
                "exported_bytes": hp.exported_bytes, "rung": hp.rung.decode("ascii", "replace"),
                "downcast_records": hp.downcast_records, "downcast_rows": hp.downcast_rows,
                **_hookpoint_spec(hp),
            })
        destinations = []
        for i in range(st.destinations):
            d = _sized(_DestinationSnapshot)
            name = ctypes.create_string_buffer(256)
            status = lib.rs_destination_stats(self._h, i, ctypes.byref(d), name, len(name))
            if status == _CODE["RS_ERR_BUFFER_TOO_SMALL"]:
                name = ctypes.create_string_buffer(d.name_len + 1)
                status = lib.rs_destination_stats(self._h, i, ctypes.byref(d), name, len(name))
            _check(status)
            destinations.append({
                "name": name.raw[:d.name_len].decode("utf-8", "replace"),
                "kind": "consumer" if d.kind == 1 else "sink",
                "delivered_records": d.delivered_records, "delivered_bytes": d.delivered_bytes,
                "queued_records": d.queued_records, "queued_bytes": d.queued_bytes,
                "dropped_records": d.dropped_records, "failed": bool(d.failed),
            })
        seconds = (lambda ns: ns / 1e9 if ns else None)
        return {
            "unix_ns": st.unix_ns, "uptime_s": st.uptime_ns / 1e9,
            "mode": "best_effort" if st.mode == 1 else "full", "backend": "cuda" if st.backend == 1 else "host",
            "steps": st.steps, "last_step": st.last_step if st.steps else None,
            "step_time_s": seconds(st.step_time_ns), "step_interval_s": seconds(st.step_interval_ns),
            "ring": {"capacity_bytes": st.ring_capacity_bytes, "used_bytes": st.ring_used_bytes,
                     "held_bytes": st.ring_held_bytes},
            "drain": {"records": st.drain_records, "rows": st.drain_rows, "bytes": st.drain_bytes,
                      "data_bytes": st.drain_data_bytes},
            "stalls": st.stalls, "stall_time_s": st.stall_ns / 1e9, "cached_rows": st.cached_rows,
            "destinations": destinations,
            "hookpoints": hookpoints,
        }

    def metrics_text(self) -> str:
        """The session's statistics in the Prometheus text exposition format (0.0.4), for an engine that serves its
        own ``/metrics``."""
        lib = _stats_lib()
        needed = ctypes.c_size_t(0)
        buf = ctypes.create_string_buffer(64 << 10)
        for _ in range(8):
            status = lib.rs_metrics_text(self._h, buf, len(buf), ctypes.byref(needed))
            if status != _CODE["RS_ERR_BUFFER_TOO_SMALL"]:
                break
            # The text may grow a little between calls (a new destination, larger numbers): leave room.
            buf = ctypes.create_string_buffer(needed.value + 4096)
        _check(status)
        return buf.value.decode("utf-8", "replace")

    def metrics_port(self) -> int:
        """The TCP port the metrics endpoint (``[metrics] listen``) listens on — the one the system chose for port 0 —
        or 0 when the session serves none."""
        lib = _lib_with("rs_metrics_port")
        out = ctypes.c_uint16(0)
        _check(lib.rs_metrics_port(self._h, ctypes.byref(out)))
        return out.value

    def sink_failures(self) -> list:
        """The sinks that have failed so far, in the order they failed: a list of dicts with ``sink`` (its name),
        ``message`` (the error, naming the file or cause) and ``unix_ns`` (when, nanoseconds since the Unix epoch);
        empty while every sink is healthy. Cheap enough to call every step; answers after :meth:`close` too.

        In full mode a failed sink also makes ``begin_step`` and captures raise ``RS_ERR_SINK`` (its records would be
        lost); in best-effort mode they go on and its records are counted as ``sink_error``."""
        lib = _load()
        health = _SinkHealth()
        _check(lib.rs_sink_status(self._h, ctypes.byref(health)))
        out = []
        for i in range(health.failed_sinks):
            info = _SinkFailureInfo()
            buf = ctypes.create_string_buffer(512)
            st = lib.rs_sink_failure(self._h, i, ctypes.byref(info), buf, len(buf))
            if st == _CODE["RS_ERR_BUFFER_TOO_SMALL"]:
                buf = ctypes.create_string_buffer(info.needed)
                st = lib.rs_sink_failure(self._h, i, ctypes.byref(info), buf, len(buf))
            _check(st)
            raw = buf.raw
            sink = raw[:info.sink_len].decode("utf-8", "replace")
            start = info.sink_len + 1
            message = raw[start:start + info.message_len].decode("utf-8", "replace")
            out.append({"sink": sink, "message": message, "unix_ns": info.unix_ns})
        return out

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until everything captured so far is exported or dropped, up to ``timeout`` seconds
        (0..=:data:`MAX_TIMEOUT_S`); ``RS_ERR_TIMEOUT`` if that did not happen. With Parquet or Arrow IPC export the
        sinks then commit their open files: everything captured so far can be read (:func:`read_dump`) before the
        session closes, and later captures go to new files. Meant for a pause in capture (while captures go on, new
        records are always in flight and this waits until the timeout)."""
        _check(_load().rs_flush(self._h, _timeout_ms("timeout", timeout)))

    # -- probes --------------------------------------------------------------------------------------------------
    def _alert(self, a: "_Alert") -> Alert:
        probe = _text_of(a.probe)
        if a.probe_len >= _PROBE_NAME_LEN:  # cut to fit the C struct: the whole name is in the probes' list
            whole = [p["name"] for p in self.probe_stats()
                     if len(p["name"].encode()) == a.probe_len and p["name"].startswith(probe)]
            probe = whole[0] if len(whole) == 1 else probe
        return Alert(probe=probe, output=a.output, label=_text_of(a.label), request_id=a.request_id, step=a.step,
                     position=a.position, score=a.score, token_score=a.token_score, threshold=a.threshold,
                     action=_PROBE_ACTIONS.get(a.action, str(a.action)), label_cut=a.label_len >= _PROBE_NAME_LEN)

    def poll_alert(self, timeout: float = 0.0) -> Optional[Alert]:
        """The next probe alert (:class:`Alert`), waiting up to ``timeout`` seconds (0..=:data:`MAX_TIMEOUT_S`);
        ``None`` when none came in time. Alerts come in the order they were raised, from one queue
        (``alerts.queue`` long; alerts that find it full are counted by :meth:`alerts_dropped`). After
        :meth:`close` it returns the alerts not yet taken (those raised while the session drained its last records
        included), then raises ``RS_ERR_ENDED``. ``RS_ERR_CONFIG`` when the session has no probes."""
        ms = _timeout_ms("timeout", timeout)
        lib = _probes_lib()
        a = _sized(_Alert)
        st = lib.rs_alert_poll(self._h, ms, ctypes.byref(a))
        if st == _CODE["RS_ERR_TIMEOUT"]:
            return None
        _check(st)
        return self._alert(a)

    def alerts(self, timeout: Optional[float] = 0.0):
        """Iterates over the probes' alerts (:class:`Alert`) as they come, and stops when none came for
        ``timeout`` seconds (default 0: the alerts queued now; ``None``: never — until the session is closed and
        every alert was delivered, e.g. from a monitoring thread). Checked before the first alert is taken."""
        if timeout is not None:
            _timeout_ms("timeout", timeout)
        _probes_lib()

        def gen():
            while True:
                try:
                    a = self.poll_alert(1.0 if timeout is None else timeout)
                except RingscopeError as e:
                    if e.status == "RS_ERR_ENDED":
                        return
                    raise
                if a is not None:
                    yield a
                elif timeout is not None:
                    return

        return gen()

    def alerts_dropped(self) -> int:
        """Alerts that found the alerts queue (``alerts.queue``) full and were not queued (their requests' reports
        still say they alerted, their stop flags were raised). 0 without probes; answers after :meth:`close` too."""
        out = ctypes.c_uint64()
        _check(_probes_lib().rs_alerts_dropped(self._h, ctypes.byref(out)))
        return out.value

    def probe_request(self, probe: str, request_id: int) -> Optional[dict]:
        """What probe ``probe`` has seen of request ``request_id`` so far, or ``None`` when it has no record of it
        (never seen, finished, or evicted past ``alerts.max_requests``): a dict with ``probe``, ``request_id``,
        ``scores`` (the aggregated score per output; NaN while no row was scored), ``alerted`` (per output),
        ``coverage`` (``scored``: rows scored; ``nan``: of those, rows with a NaN score; ``expected``: rows the engine
        ran for it, per its step batches; ``unobserved``: rows the probe never saw — sampled out, dropped, not
        selected: never read them as safe; ``cached``: rows the engine took from its prefix cache and never computed,
        see :meth:`note_cached` — not seen either) and ``last_step`` (None when no row was scored). Probes score on their
        own thread: call :meth:`wait_probes` first to count every row captured so far. ``RS_ERR_INVALID_ARGUMENT``
        names an unknown probe; ``RS_ERR_CONFIG``: the session has no probes."""
        name = _text("probe", probe)
        rid = _u64("request_id", request_id)
        r = _sized(_ProbeReport)
        st = _probes_lib().rs_probe_request(self._h, name, rid, ctypes.byref(r))
        if st == _CODE["RS_NOT_SEEN"]:
            return None
        _check(st)
        k = r.outputs
        return {
            "probe": probe, "request_id": r.request_id, "scores": [float(v) for v in r.scores[:k]],
            "alerted": [bool(r.alerted >> j & 1) for j in range(k)],
            "coverage": {"scored": r.scored, "nan": r.nan, "expected": r.expected, "unobserved": r.unobserved,
                         "cached": r.cached},
            "last_step": r.last_step if r.scored else None,
        }

    def note_cached(self, step: int, request_id: int, first_position: int, rows: int) -> None:
        """The engine did not compute ``rows`` token rows of request ``request_id`` (positions ``first_position`` ..
        ``first_position + rows - 1``) because its prefix cache held them; ``step`` is the step of the request's first
        computed rows. No hookpoint or probe sees such rows: this records them — a ``cached`` row in the run's
        events table (:func:`read_events`), ``coverage["cached"]`` of every probe's report on the request, and the
        session.s ``cached_rows`` (:meth:`stats_all`) — so that a prefix-cache hit is never read as "safe"."""
        _check(_load().rs_note_cached(self._h, _u64("step", step), _u64("request_id", request_id),
                                      _u32("first_position", first_position), _u64("rows", rows)))

    def finish_request(self, request_id: int) -> dict:
        """The engine has finished request ``request_id``: returns each probe's last report on it (``{probe name:
        report}`` as :meth:`probe_request` gives them; probes that never saw it are left out), then every probe
        forgets it and its stop flag is lowered. Call :meth:`wait_probes` first so that every row counts. Without
        probes: ``{}``."""
        rid = _u64("request_id", request_id)
        lib = _probes_lib()
        reports = {}
        for p in self.probe_stats():
            r = self.probe_request(p["name"], rid)
            if r is not None:
                reports[p["name"]] = r
        _check(lib.rs_request_finish(self._h, rid))
        return reports

    def is_flagged(self, request_id: int) -> bool:
        """Whether a probe with ``action = "stop"`` has raised request ``request_id``'s stop flag (until
        :meth:`finish_request`). False for a session without probes."""
        out = ctypes.c_bool(False)
        _check(_probes_lib().rs_is_flagged(self._h, _u64("request_id", request_id), ctypes.byref(out)))
        return out.value

    def probe_flags(self) -> np.ndarray:
        """The stop-flag table itself, as a read-only numpy ``uint64`` view (``alerts.flag_slots`` long, no copy):
        request ``R`` is flagged when ``flags[R % len(flags)] == R + 1`` — vectorised, ``flags[ids % n] == ids + 1``
        checks a whole batch at once. It changes as probes raise flags. After :meth:`close` it holds the last flags
        (the library keeps the table with the closed session). ``RS_ERR_CONFIG`` without probes."""
        slots = ctypes.POINTER(ctypes.c_uint64)()
        n = ctypes.c_size_t(0)
        _check(_probes_lib().rs_probe_flags(self._h, ctypes.byref(slots), ctypes.byref(n)))
        view = np.ctypeslib.as_array(slots, shape=(n.value,)).view(np.dtype("<u8"))
        view.flags.writeable = False
        return view

    def _hookpoint_info(self, hookpoint: int) -> dict:
        """``name``, ``dtype`` and ``row_width`` of hookpoint ``hookpoint`` (dtype and width None from a library
        before C ABI 4)."""
        hp = _sized(_HookPointSnapshot)
        name = ctypes.create_string_buffer(257)  # hookpoint names are at most 256 bytes
        _check(_stats_lib().rs_hookpoint_stats(self._h, _u32("hookpoint", hookpoint), ctypes.byref(hp), name,
                                               len(name)))
        return {"name": name.raw[:hp.name_len].decode("utf-8", "replace"), **_hookpoint_spec(hp)}

    def _hookpoint_name(self, hookpoint: int) -> Optional[str]:
        return None if hookpoint == _NO_HOOKPOINT else self._hookpoint_info(hookpoint)["name"]

    def probe_stats(self) -> list:
        """Each probe's totals, in configuration order: a list of dicts with ``name``, ``mode`` (``"consumer"`` or
        ``"fused"``), ``hookpoint`` (the hookpoint it reads), ``scores_hookpoint`` (a fused probe's scores,
        ``probes.<name>``, exported like any hookpoint; None for a consumer probe), ``rows`` (rows scored),
        ``nan_rows``, ``alerts`` (raised, dropped ones included), ``evicted_requests`` and ``no_request_rows`` (rows
        of no request — request id 2**64-1, sequences that ended in steps recorded as CUDA graphs — left unscored).
        Empty without probes;
        after :meth:`close` the final totals (hookpoint names are then None)."""
        lib = _probes_lib()
        n = ctypes.c_uint32()
        _check(lib.rs_probe_count(self._h, ctypes.byref(n)))
        out = []
        for i in range(n.value):
            ps = _sized(_ProbeSnapshot)
            name = ctypes.create_string_buffer(256)
            st = lib.rs_probe_stats(self._h, i, ctypes.byref(ps), name, len(name))
            if st == _CODE["RS_ERR_BUFFER_TOO_SMALL"]:
                name = ctypes.create_string_buffer(ps.name_len + 1)
                st = lib.rs_probe_stats(self._h, i, ctypes.byref(ps), name, len(name))
            _check(st)
            names = {"hookpoint": None, "scores_hookpoint": None}
            if self.totals is None:  # hookpoints are named by an open session only
                names = {"hookpoint": self._hookpoint_name(ps.hookpoint),
                         "scores_hookpoint": self._hookpoint_name(ps.scores_hookpoint)}
            out.append({"name": name.raw[:ps.name_len].decode("utf-8", "replace"),
                        "mode": _PROBE_MODES.get(ps.mode, str(ps.mode)), **names, "rows": ps.rows,
                        "nan_rows": ps.nan_rows, "alerts": ps.alerts, "evicted_requests": ps.evicted_requests,
                        "no_request_rows": ps.no_request_rows})
        return out

    def wait_probes(self, timeout: float = 10.0) -> None:
        """Waits until every record captured so far has left the ring (offered to every sink and consumer) and the
        probes have scored every row delivered to them, up to ``timeout`` seconds (0..=:data:`MAX_TIMEOUT_S`): then
        reports, flags and alerts reflect every step that has ended. ``RS_ERR_TIMEOUT`` if that did not happen in
        time; ``RS_ERR_CONFIG`` without probes. Unlike :meth:`flush`, it does not wait for file sinks to commit
        what they hold."""
        _check(_probes_lib().rs_probes_wait(self._h, _timeout_ms("timeout", timeout)))

    def subscribe(self, name: str, layers: Optional[Iterable[int]] = None) -> Subscription:
        """An online consumer of the records of ``layers`` (all when None) captured from now on."""
        name_b = _text("name", name)
        a = _int_array("layers", [] if layers is None else layers, np.uint32)
        h = ctypes.c_uint64()
        _check(_load().rs_subscribe(self._h, name_b, a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), a.size,
                                    ctypes.byref(h)))
        return Subscription(h.value)

    def close(self) -> dict:
        """Drains, finishes the files, checks the accounting; returns the totals over all hookpoints. Closing again
        is harmless (returns the same totals)."""
        if self.totals is None:
            c = _Counts()
            _check(_load().rs_session_close(self._h, ctypes.byref(c)))
            self.totals = c.to_dict()
        return self.totals

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _toml():
    """The TOML reader: ``tomllib`` (Python 3.11+), or its backport ``tomli`` before 3.11 (a dependency of this
    package there)."""
    try:
        import tomllib
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise RingscopeError("RS_ERR_CONFIG", "reading TOML before Python 3.11 needs the tomli package "
                                                  "(pip install tomli)") from None
    return tomllib


def _config_text(config) -> bytes:
    """``Session``'s ``config`` → NUL-free UTF-8 TOML text."""
    if config is None:
        return b""
    if isinstance(config, str):
        return _text("config", config)
    if isinstance(config, (bytes, bytearray)):
        data = bytes(config)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _invalid(f"config is not UTF-8 text ({e.reason} at byte {e.start})") from None
        return _no_nul("config", data, data.find(b"\0"))
    if isinstance(config, Mapping):
        return _text("config", _to_toml(config))
    raise _invalid(f"config must be TOML text (str or bytes) or a dict of TOML sections, got {type(config).__name__} "
                   f"{_show(config)}; for a file use Session(config_file=...)")


_BARE_KEY = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def _to_toml(d: Mapping) -> str:
    def key(k, where):
        if not isinstance(k, str):
            raise _invalid(f"{where}: keys must be strings, got {type(k).__name__} {_show(k)}")
        _text(where, k)
        return k if k and set(k) <= _BARE_KEY else string(k)

    def string(v):
        # TOML basic string: backslash, quote and every control character escaped (NULs were refused before).
        out = []
        for ch in v:
            if ch in '\\"':
                out.append("\\" + ch)
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04X}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'

    def value(v, where):
        if isinstance(v, (bool, np.bool_)):
            return "true" if v else "false"
        if isinstance(v, numbers.Integral):
            return str(int(v))
        if isinstance(v, numbers.Real):
            return repr(float(v))  # nan, inf and -inf are TOML too
        if isinstance(v, str):
            _text(where, v)
            return string(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{key(k, where)} = {value(x, f'{where}[{k!r}]')}" for k, x in v.items()) + "}"
        raise _invalid(f"{where}: cannot write {type(v).__name__} {_show(v)} as TOML")

    def table(body, where):
        if not isinstance(body, Mapping):
            raise _invalid(f"{where} must be a table (a dict of settings), got {type(body).__name__} {_show(body)}")
        return [f"{key(k, where)} = {value(v, f'{where}[{k!r}]')}" for k, v in body.items()]

    out = []
    for section, body in d.items():
        where = f"config[{section!r}]"
        if section in ("hookpoints", "probes"):
            if not isinstance(body, (list, tuple)):
                raise _invalid(f"{where} must be a list of tables (one dict per {section[:-1]}), got "
                               f"{type(body).__name__} {_show(body)}")
            for i, entry in enumerate(body):
                out.append(f"[[{section}]]")
                out += table(entry, f"{where}[{i}]")
        else:
            out.append(f"[{key(section, 'config')}]")
            out += table(body, where)
    return "\n".join(out) + "\n"


def _probe_matrix(name: str, values, shape_hint: str) -> np.ndarray:
    """A numpy array, torch tensor or nested list of finite numbers → float32 (C order)."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor: no grad, on the host, as float32
        values = values.detach().cpu().float().numpy()
    try:
        a = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise _invalid(f"{name} must be an array of numbers {shape_hint}, got {type(values).__name__}: {e}") from None
    if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
        raise _invalid(f"{name} must hold numbers {shape_hint}, got an array of {a.dtype}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    bad = np.argwhere(~np.isfinite(a))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise _invalid(f"{name}{list(at)} is {a[at]} ({name} must be finite; {len(bad)} value(s) are not)")
    return a


def save_probe(path: "str | os.PathLike", weights, bias=None) -> dict:
    """Writes a linear probe trained elsewhere (numpy, torch) as a file a ``[[probes]]`` entry reads: ``weights``
    of shape ``[K, d]`` (``K`` outputs, 1..=:data:`PROBE_MAX_OUTPUTS`, over rows of ``d`` elements — the
    hookpoint's row width) or ``[d]`` (one output), and optionally ``bias`` (``K`` numbers). Scores are
    ``weights @ x + bias``, in float32 (what the file holds). ``path`` ending in ``.safetensors``: tensors ``weight``
    and, given a bias, ``bias`` in one file; ending in ``.npy``: the weights (the bias then goes inline in the
    configuration). Every value must be finite. Returns the entry's keys to use: ``{"weights": <absolute path>}``,
    plus ``"bias": [...]`` for a ``.npy`` with a bias — e.g. ``Session({"probes": [{"name": "p", "hookpoint": "h",
    "threshold": 0.5, **ringscope.save_probe("p.npy", w, b)}], ...})``."""
    raw = _path("path", path)
    target = pathlib.Path(os.fsdecode(raw)).absolute()
    suffix = target.suffix.lower()
    if suffix not in (".npy", ".safetensors"):
        raise _invalid(f"path must end in .npy or .safetensors (the formats probes read), got {str(target)!r}")
    w = _probe_matrix("weights", weights, "of shape [K, d] or [d]")
    if w.ndim not in (1, 2) or w.size == 0:
        raise _invalid(f"weights must have shape [K, d] or [d] with K, d >= 1, got shape {w.shape}")
    k = 1 if w.ndim == 1 else w.shape[0]
    if k > PROBE_MAX_OUTPUTS:
        raise _invalid(f"weights have {k} outputs (rows); a probe has 1..={PROBE_MAX_OUTPUTS}")
    b = None
    if bias is not None:
        b = _probe_matrix("bias", bias, f"of shape [{k}]").reshape(-1) if np.ndim(bias) <= 1 else None
        if b is None or b.shape != (k,):
            raise _invalid(f"bias must have one number per output: shape [{k}], got shape {np.shape(bias)}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".npy":
            with open(target, "wb") as f:
                np.save(f, w.astype("<f4"), allow_pickle=False)
        else:
            tensors = [("weight", w)] + ([("bias", b)] if b is not None else [])
            header, offset = {}, 0
            for name, t in tensors:
                header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
                offset += t.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
            with open(target, "wb") as f:
                f.write(len(text).to_bytes(8, "little") + text)
                for _, t in tensors:
                    f.write(t.astype("<f4").tobytes())
    except OSError as e:
        raise RingscopeError("RS_ERR_IO", f"cannot write the probe to {target}: {e}") from e
    entry = {"weights": str(target)}
    if b is not None and suffix == ".npy":
        entry["bias"] = [float(v) for v in b]
    return entry


_COMMIT_HINT = ("a file is committed when it reaches export.max_file_size or when the session is closed, so read "
                "after Session.close()")


def _read_checked(part: "pathlib.Path | list"):
    """The table of one hookpoint's Parquet files (its partition directory, whose `_`-prefixed downcast series pyarrow
    skips; or a list of files), each page's CRC checked (the writer puts one in every page header); a file whose bytes
    are not as written is a RingscopeError naming it."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    checked = ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True))
    if isinstance(part, list):
        dataset = ds.dataset([str(p) for p in part], format=checked)
    else:
        dataset = ds.dataset(str(part), format=checked, partitioning="hive")
    try:
        return dataset.to_table()
    except (OSError, pa.ArrowException) as e:
        failure = e
    # pyarrow does not say which file failed: read them one by one to name it.
    for fragment in dataset.get_fragments():
        try:
            fragment.to_table()
        except (OSError, pa.ArrowException) as e:
            raise RingscopeError("RS_ERR_IO", f"{fragment.path} is corrupt (its bytes are not as written): {e}") from e
    raise RingscopeError("RS_ERR_IO", f"cannot read {part}: {failure}") from failure


def _read_ipc_checked(files: list):
    """The table of Arrow IPC files (read, not memory-mapped), every record batch checked against its CRC-32 in the file's
    footer; a file whose bytes are not as written is a RingscopeError naming it."""
    import pyarrow as pa

    from .stream import _record_batches

    batches = []
    for f in files:
        try:
            batches += list(_record_batches("arrow", f, None, verify=True))
        except (OSError, pa.ArrowInvalid) as e:
            raise RingscopeError("RS_ERR_IO", f"{f} is corrupt (its bytes are not as written): {e}") from e
    return pa.Table.from_batches(batches)


def _activation_bytes(t) -> np.ndarray:
    """The activation column of table ``t`` as uint8 rows (rows, row bytes), without a copy."""
    flat = t.column("activation").combine_chunks()
    width = flat.type.byte_width
    raw = np.frombuffer(flat.buffers()[1], dtype=np.uint8)[flat.offset * width:]
    return raw[: t.num_rows * width].reshape(t.num_rows, width)


def _as_float32(values: np.ndarray, dtype_name: str) -> np.ndarray:
    """Rows of a float dtype (bf16 as uint16 bit patterns) → float32, exactly."""
    return as_float32(values) if dtype_name == "bf16" else values.astype(np.float32)


def read_dump(path: "str | os.PathLike", hookpoint: Optional[str] = None, as_torch: bool = False) -> dict:
    """Reads a dump (a run directory: its Parquet files, or its Arrow IPC files when it has no Parquet) into ``{hookpoint name: {column: array}}``: ``step``, ``request_id``,
    ``position``, ``layer``, ``rank`` as numpy arrays, and ``activation`` as an array of shape (rows, row_width)
    with the right dtype — bf16 as ``torch.bfloat16`` when ``as_torch`` (every column becomes a torch tensor then;
    ``step``, ``request_id`` and ``position`` as int64, which torch indexes and counts with: a request id or step
    above 2**63-1 is a :class:`RingscopeError`, read such a run with ``as_torch=False``), else as uint16 bit patterns
    (:func:`as_float32` converts). Rows are sorted by (step, request_id, position).
    ``downcast`` (bool per row) marks rows that were downcast on capture (``Session.set_downcast``): a hookpoint
    with any has its ``activation`` as float32 for every row (full-precision rows converted exactly, downcast rows
    dequantized: E4M3 × the row's scale), and ``dtype`` ``"f32"``; ``source_dtype`` is the hookpoint's own dtype.
    Only committed files are read; hookpoints without one yet are left out. ``hookpoint``: read only that one. Raises
    :class:`RingscopeError` when ``path`` does not exist or is not a run directory, when ``hookpoint`` is not in the
    run, when the run (or that hookpoint) holds no committed file yet, and (``RS_ERR_IO``, naming the file) when a
    file's bytes are not as written — every Parquet page's CRC, every Arrow IPC record batch's CRC-32 is checked as it
    is read; a file cut short is found too — or when a file does not belong in its partition (another hookpoint's
    file, or rows of another width or dtype). Needs pyarrow."""
    root = pathlib.Path(os.fsdecode(_path("path", path)))
    if hookpoint is not None:
        _text("hookpoint", hookpoint)
    if not root.exists():
        raise RingscopeError("RS_ERR_IO", f"{root} does not exist: give the run directory (<export.dir>/<run_id>)")
    if not root.is_dir():
        raise RingscopeError("RS_ERR_IO", f"{root} is not a directory: give the run directory "
                                          "(<export.dir>/<run_id>), not one of its files")
    base, ext = root, "parquet"
    ipc = root / "_arrow_ipc"
    if not any(p.is_dir() for p in root.glob("hookpoint=*")) and any(p.is_dir() for p in ipc.glob("hookpoint=*")):
        base, ext = ipc, "arrow"  # a run dumped to Arrow IPC only
    parts = sorted(p for p in base.glob("hookpoint=*") if p.is_dir())
    if not parts:
        runs = sorted(p.name for p in root.iterdir()
                      if p.is_dir() and (any(p.glob("hookpoint=*")) or any(p.glob("_arrow_ipc/hookpoint=*"))))
        if runs:
            raise RingscopeError("RS_ERR_IO", f"{root} is not a run directory but holds runs ({', '.join(runs)}): "
                                              f"give one, e.g. read_dump({str(root / runs[0])!r})")
        raise RingscopeError("RS_ERR_IO", f"{root} holds no committed files yet (no hookpoint=... partitions): "
                                          f"{_COMMIT_HINT}; or it is not a ringscope run directory "
                                          "(<export.dir>/<run_id>)")
    names = [p.name[len("hookpoint="):] for p in parts]
    if hookpoint is not None and hookpoint not in names:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                             f"hookpoint {hookpoint!r} is not in {root}; it holds {', '.join(map(repr, names))}")
    # Committed files only: in-progress ones are hidden (.part-*.inprogress) and pyarrow skips them.
    # Downcast rows are a series of their own in each partition (rank=*/_f8e4m3_rowscaled/).
    from .stream import _part_files, _Series

    files = {p: _part_files(p, ext) for p in parts if hookpoint is None or p.name == f"hookpoint={hookpoint}"}
    committed = {p: full + downcast for p, (full, downcast) in files.items()}
    if not any(committed.values()):
        what = f"hookpoint {hookpoint!r} of {root}" if hookpoint is not None else f"the run {root}"
        raise RingscopeError("RS_ERR_IO", f"{what} holds no committed files yet: {_COMMIT_HINT}")
    parts = [p for p in parts if committed.get(p)]
    out = {}
    for part in parts:
        # One dataset per hookpoint: hookpoints differ in row width, so they do not share one Arrow schema.
        name = part.name[len("hookpoint="):]
        full_files, downcast_files = files[part]
        # Each file belongs where it lies (its footer names this hookpoint; one row width and dtype per series): a
        # file of another hookpoint copied into the partition is an error naming it, not a pyarrow or numpy error.
        _Series(name, False).check_files(ext, full_files)
        _Series(name, True).check_files(ext, downcast_files)
        pieces = []  # (table, dtype name) of the full-precision rows, then of the downcast rows
        if full_files:
            t = _read_checked(part) if ext == "parquet" else _read_ipc_checked(full_files)
            meta = t.schema.field("activation").metadata or {}
            pieces.append((t, meta.get(b"ringscope.dtype", b"").decode() or t.column("dtype")[0].as_py()))
        if downcast_files:
            t = _read_checked(downcast_files) if ext == "parquet" else _read_ipc_checked(downcast_files)
            pieces.append((t, ROWSCALED))
        pieces = [(t, d) for t, d in pieces if t.num_rows > 0]
        if not pieces:
            continue
        names = ("step", "request_id", "position", "layer", "rank")
        if len(pieces) == 1 and pieces[0][1] != ROWSCALED:
            t, dtype_name = pieces[0]
            t = t.sort_by([("step", "ascending"), ("request_id", "ascending"), ("position", "ascending")])
            np_dtype = _NUMPY_FOR_DTYPE[dtype_name]
            raw = _activation_bytes(t)
            act = raw.reshape(-1).view(np_dtype).reshape(t.num_rows, raw.shape[1] // np_dtype.itemsize)
            cols = {c: t.column(c).to_numpy() for c in names if c in t.column_names}
            cols["downcast"] = np.zeros(t.num_rows, dtype=bool)
            source = dtype_name
        else:
            # Downcast rows: every row as float32, sorted together.
            source = next((d for _, d in pieces if d != ROWSCALED), None)
            acts, flags = [], []
            for t, d in pieces:
                raw = _activation_bytes(t)
                if d == ROWSCALED:
                    acts.append(dequantize_rowscaled(raw))
                else:
                    np_dtype = _NUMPY_FOR_DTYPE[d]
                    acts.append(_as_float32(raw.reshape(-1).view(np_dtype).reshape(t.num_rows, -1), d))
                flags.append(np.full(t.num_rows, d == ROWSCALED))
            cols = {c: np.concatenate([t.column(c).to_numpy() for t, _ in pieces]) for c in names
                    if all(c in t.column_names for t, _ in pieces)}
            order = np.lexsort((cols["position"], cols["request_id"], cols["step"]))
            cols = {c: v[order] for c, v in cols.items()}
            act = np.concatenate(acts)[order]
            cols["downcast"] = np.concatenate(flags)[order]
            dtype_name = "f32"
        if as_torch:
            import torch

            from .stream import _int64

            act_t = torch.from_numpy(act.copy())
            if dtype_name == "bf16":
                act_t = act_t.view(torch.bfloat16)
            # Own, writable copies; unsigned id columns as int64, what torch indexes and counts with (ids above
            # 2**63-1 are refused, not wrapped).
            cols = {k: torch.from_numpy(np.array(_int64(k, v) if v.dtype.kind == "u" else v)) for k, v in cols.items()}
            cols["activation"] = act_t
        else:
            cols["activation"] = act
        cols["dtype"] = dtype_name
        # The hookpoint's own dtype (None when every row read was downcast: the downcast files do not say it).
        cols["source_dtype"] = source
        out[name] = cols
    return out


# -- calibration retention (ProbeX) --------------------------------------------------------------------------------
# `inspect retention` in Python, over read_dump (Parquet dumps): the same rows, the same arithmetic (f64 means of the
# rows as float32, rows with a non-finite element skipped; weights as float32), the same fields.

__all__.append("calibration_retention")


class _Ids:
    """A calibration group: request ids as sorted, disjoint, inclusive ranges."""

    def __init__(self, name: str, value):
        self.name = name
        if isinstance(value, str):
            self.text = value
            ranges = self._parse(name, value)
        elif isinstance(value, range) and value.step == 1:
            self.text = f"{value.start}-{value.stop - 1}" if len(value) else ""
            if len(value) and not (0 <= value.start and value.stop - 1 <= _U64_MAX):
                raise _invalid(f"{name} must hold request ids in 0..={_U64_MAX}, got {value!r}")
            ranges = [(value.start, value.stop - 1)] if len(value) else []
        else:
            ids = np.unique(_int_array(name, value, np.uint64))
            self.text = _show(value)
            ranges = [(int(i), int(i)) for i in ids]
        if not ranges:
            raise _invalid(f"{name} is empty: give the request ids of a calibration group")
        merged: list = []
        for lo, hi in sorted(ranges):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.ranges = merged
        self._lo = np.array([r[0] for r in merged], dtype=np.uint64)
        self._hi = np.array([r[1] for r in merged], dtype=np.uint64)

    @staticmethod
    def _parse(name: str, text: str) -> list:
        """inspect's syntax: ``0-49,60,70-79``, or ``@FILE`` with one id or range a line (``#`` comments)."""
        body = text
        if text.startswith("@"):
            try:
                lines = pathlib.Path(text[1:]).read_text().splitlines()
            except OSError as e:
                raise _invalid(f"{name}: cannot read {text[1:]}: {e}") from None
            body = ",".join(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))

        def one(s: str) -> int:
            s = s.strip()
            if not s.isdigit() or int(s) > _U64_MAX:
                raise _invalid(f"{name}: {s!r} is not a request id (an unsigned 64-bit integer) in {text!r}")
            return int(s)

        ranges = []
        for item in body.split(","):
            if not item.strip():
                raise _invalid(f"{name}: an empty item in {text!r}: give ids and ranges like '0-49,60'")
            lo, sep, hi = item.partition("-")
            lo, hi = (one(lo), one(hi)) if sep else (one(item), one(item))
            if lo > hi:
                raise _invalid(f"{name}: the range {item.strip()} is empty (its start is past its end)")
            ranges.append((lo, hi))
        return ranges

    def count(self) -> int:
        return sum(hi - lo + 1 for lo, hi in self.ranges)

    def mask(self, request_id: np.ndarray) -> np.ndarray:
        rid = np.asarray(request_id, dtype=np.uint64)
        i = np.searchsorted(self._hi, rid, side="left")
        inside = i < len(self._hi)
        return inside & (self._lo[np.minimum(i, len(self._lo) - 1)] <= rid)

    def common(self, other: "_Ids"):
        i = j = 0
        while i < len(self.ranges) and j < len(other.ranges):
            (a0, a1), (b0, b1) = self.ranges[i], other.ranges[j]
            if max(a0, b0) <= min(a1, b1):
                return max(a0, b0)
            if a1 < b1:
                i += 1
            else:
                j += 1
        return None


_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}


def _load_safetensors(path: pathlib.Path, tensor: str) -> np.ndarray:
    import json

    data = path.read_bytes()
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise _invalid(f"weights: {path}: not a safetensors file: {e}") from None
    entry = header.get(tensor) if tensor != "__metadata__" else None
    if not isinstance(entry, dict):
        names = ", ".join(sorted(k for k in header if k != "__metadata__"))
        raise _invalid(f"weights: {path}: no tensor {tensor!r} (it has {names}); name the weights with tensor=")
    dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise _invalid(f"weights: {path}: tensor {tensor!r} is {entry.get('dtype')}; use F32, F16, BF16 or F64")
    try:
        start, end = entry["data_offsets"]
        values = np.frombuffer(data[8 + n + start:8 + n + end], dtype=dtype).reshape(entry["shape"])
    except (KeyError, TypeError, ValueError) as e:
        raise _invalid(f"weights: {path}: tensor {tensor!r} is malformed: {e}") from None
    return as_float32(values) if entry["dtype"] == "BF16" else values


def _retention_weights(weights, tensor: str) -> np.ndarray:
    """[K, d] float32 weights from an array ([K, d] or [d]) or a .npy / .safetensors file."""
    if isinstance(weights, (str, bytes, os.PathLike)):
        path = pathlib.Path(os.fsdecode(_path("weights", weights)))
        suffix = path.suffix.lower()
        if not path.is_file():
            raise _invalid(f"weights: {path} is not a file")
        if suffix == ".npy":
            try:
                w = np.load(path, allow_pickle=False)
            except (ValueError, OSError) as e:
                raise _invalid(f"weights: {path}: not a .npy file: {e}") from None
        elif suffix == ".safetensors":
            w = _load_safetensors(path, _text("tensor", tensor).decode())
        else:
            raise _invalid(f"weights: {path}: unknown file type: use a .safetensors or a .npy file (or an array)")
        what = str(path)
    else:
        w = np.asarray(weights)
        what = "the array"
    if w.dtype.kind != "f" and w.dtype.name != "bfloat16":
        raise _invalid(f"weights: {what} holds {w.dtype}; weights are floats")
    if w.ndim == 1:
        w = w[None, :]
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise _invalid(f"weights: {what} has shape {w.shape}; weights are [K, d] or [d]")
    w = np.ascontiguousarray(w, dtype=np.float32)
    bad = np.argwhere(~np.isfinite(w))
    if len(bad):
        k, j = bad[0]
        raise _invalid(f"weights: {what}: weight [{k}, {j}] is {w[k, j]} (weights must be finite)")
    return w


def _retention_side(run, which: str, hookpoint: str, groups, width: int, last_token: bool, rank):
    """(rows per group, μ_a − μ_b or None) of one run."""
    cols = read_dump(run, hookpoint=hookpoint)[hookpoint]
    if cols["dtype"] not in ("f32", "f16", "bf16"):
        raise _invalid(f"hookpoint {hookpoint!r} holds rows of dtype {cols['dtype']}: retention reads float rows")
    act = cols["activation"]
    if act.shape[1] != width:
        raise _invalid(f"weights are [*, {width}] but rows of hookpoint {hookpoint!r} in {which}{run} have "
                       f"{act.shape[1]} elements: the probe does not read this hookpoint")
    rid, pos = cols["request_id"], cols["position"]
    keep = np.ones(len(rid), dtype=bool) if rank is None else cols["rank"] == rank
    rows, means = [], []
    for g in groups:
        sel = np.flatnonzero(keep & g.mask(rid))
        if len(sel) == 0:
            raise _invalid(f"{g.name} ({g.text}) has no rows at hookpoint {hookpoint!r} in {which}{run}: none of "
                           f"its {g.count()} request ids was captured there")
        if last_token:
            # Each request's highest position: the last row of each request once sorted by (request, position).
            order = sel[np.lexsort((pos[sel], rid[sel]))]
            last = np.r_[rid[order][1:] != rid[order][:-1], True]
            sel = order[last]
        x = _as_float32(act[sel], cols["dtype"]).astype(np.float64)
        x = x[np.isfinite(x).all(axis=1)]
        rows.append(len(x))
        means.append(x.mean(axis=0) if len(x) else None)
    diff = None if any(m is None for m in means) else means[0] - means[1]
    return rows, diff


def _cosine(w: np.ndarray, v) -> float:
    if v is None:
        return float("nan")
    w = w.astype(np.float64)
    ww, vv = float(w @ w), float(v @ v)
    return float("nan") if ww == 0.0 or vv == 0.0 else float(w @ v) / (np.sqrt(ww) * np.sqrt(vv))


def calibration_retention(run: "str | os.PathLike", weights, hookpoint: str, group_a, group_b,
                          reference: "str | os.PathLike | None" = None, min: Optional[float] = None,
                          last_token: bool = False, *, tensor: str = "weight", rank: Optional[int] = None) -> list:
    """ProbeX's calibration retention of a probe over Parquet dumps (what ``inspect retention`` reports).

    For each probe output k (weights ``w_k``), the alignment is ``cos(w_k, μ_a − μ_b)``: μ_a and μ_b are the means
    of the rows the run ``run`` captured at ``hookpoint`` for the requests of ``group_a`` and ``group_b`` (every row of
    those requests; with ``last_token``, only each request's highest captured position). The retention is that
    alignment divided by the alignment in ``reference`` (the same request ids there): ≈ 1 while the probe's direction
    still separates the groups as it did, ≈ 0 where the representation it reads is gone.

    ``weights``: a float array of shape [K, d] or [d], or a path to a ``.npy`` or ``.safetensors`` file (the tensor
    ``tensor``). ``group_a``/``group_b``: request ids — a sequence of ints, a ``range``, or a string in inspect's
    syntax (``"0-49,60"``, ``"@ids.txt"``); disjoint. ``min``: flag outputs whose retention (without a reference:
    alignment) is below it or not a number. ``rank``: read only that rank's rows.

    Returns one dict per output: ``output``, ``rows_a``, ``rows_b``, ``alignment``, ``reference_rows_a``,
    ``reference_rows_b``, ``reference_alignment``, ``retention`` (the reference fields None without a reference; NaN
    where a value is not a number), ``flagged``. Rows with a NaN or infinite element are not counted. Raises
    :class:`RingscopeError` naming the argument for bad input (an unknown hookpoint, weights whose width is not the
    hookpoint's, an empty group, ...) and as :func:`read_dump` does for the dumps. Needs pyarrow."""
    _text("hookpoint", hookpoint)
    if not isinstance(tensor, str):
        _text("tensor", tensor)
    last_token = _flag("last_token", last_token)
    if min is not None:
        ok = isinstance(min, numbers.Real) and not isinstance(min, (bool, np.bool_)) and np.isfinite(float(min))
        if not ok:
            raise _invalid(f"min must be a finite number or None, got {_show(min)}")
        min = float(min)
    if rank is not None:
        rank = _int("rank", rank, 0, 2**31 - 1)
    groups = (_Ids("group_a", group_a), _Ids("group_b", group_b))
    common = groups[0].common(groups[1])
    if common is not None:
        raise _invalid(f"request {common} is in both group_a and group_b: the groups must be disjoint")
    w = _retention_weights(weights, tensor)
    rows, diff = _retention_side(run, "", hookpoint, groups, w.shape[1], last_token, rank)
    ref_rows, ref_diff = (None, None) if reference is None else \
        _retention_side(reference, "the reference run ", hookpoint, groups, w.shape[1], last_token, rank)
    out = []
    for k in range(w.shape[0]):
        alignment = _cosine(w[k], diff)
        ref_alignment = None if reference is None else _cosine(w[k], ref_diff)
        retention = None if ref_alignment is None else \
            (float("nan") if ref_alignment == 0.0 else alignment / ref_alignment)
        value = alignment if retention is None else retention
        out.append({
            "output": k,
            "rows_a": rows[0],
            "rows_b": rows[1],
            "alignment": alignment,
            "reference_rows_a": None if ref_rows is None else ref_rows[0],
            "reference_rows_b": None if ref_rows is None else ref_rows[1],
            "reference_alignment": ref_alignment,
            "retention": retention,
            "flagged": min is not None and not value >= min,
        })
    return out


#: The events table's directory in a run directory, and its columns in order (docs/format.md, "The events table").
EVENTS_DIR = "_ringscope_events"
EVENT_COLUMNS = ("unix_ns", "hookpoint", "first_step", "last_step", "kind", "rung", "reason", "records_lost",
                 "rows_lost", "detail", "request_id", "first_position", "end_position")
#: Columns an events file written before they existed lacks: read as None.
_LATER_EVENT_COLUMNS = ("request_id", "first_position", "end_position")


def read_events(path: "str | os.PathLike") -> list:
    """Reads the events table of a run directory (``<run dir>/_ringscope_events/part-*.parquet``, written for
    Parquet and Arrow IPC dumps alike): a list of dicts, one per event, with the keys of :data:`EVENT_COLUMNS` —
    ``kind`` is ``"drop"`` (records of ``hookpoint`` dropped somewhere in steps ``first_step..=last_step`` for
    ``reason``, e.g. ``"ring_full"`` or ``"sink_error"``: ``records_lost`` records, ``rows_lost`` token rows),
    ``"rung"`` (the hookpoint moved to rung ``rung``; ``reason`` and ``detail`` say why), ``"stall"`` or ``"cached"``
    (the engine took request ``request_id``'s positions ``first_position..end_position`` from its prefix cache;
    these three are None for events about no one request). Events are in
    the order they were logged (file by file, in commit order). After a run has shut down, ``rows_lost`` summed per
    (hookpoint, reason) over the drops equals the manifest's dropped rows. A run that never lost anything has no
    events directory: that reads as ``[]``. Every Parquet page's CRC is checked (``RS_ERR_IO`` naming a corrupt
    file). Raises :class:`RingscopeError` when ``path`` is not a directory. Needs pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = pathlib.Path(os.fsdecode(_path("path", path)))
    if not root.is_dir():
        raise RingscopeError("RS_ERR_IO", f"{root} is not a directory: give the run directory (<export.dir>/<run_id>)")
    # Committed files only: in-progress ones are hidden (.part-*.inprogress).
    files = sorted((root / EVENTS_DIR).glob("part-*.parquet"))
    events = []
    for f in files:
        try:
            table = pq.read_table(f, page_checksum_verification=True)
        except (OSError, pa.ArrowException) as e:
            raise RingscopeError("RS_ERR_IO", f"{f} is corrupt (its bytes are not as written): {e}") from e
        missing = [c for c in EVENT_COLUMNS if c not in table.column_names and c not in _LATER_EVENT_COLUMNS]
        if missing:
            raise RingscopeError("RS_ERR_IO", f"{f} is not a ringscope events file: no column(s) {', '.join(missing)}")
        for c in _LATER_EVENT_COLUMNS:
            if c not in table.column_names:
                table = table.append_column(c, pa.nulls(table.num_rows, pa.uint64()))
        events += table.select(list(EVENT_COLUMNS)).to_pylist()
    return events
