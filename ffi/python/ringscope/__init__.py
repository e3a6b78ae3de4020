"""ringscope: make an LLM's internal state observable while it serves.

Python bindings (ctypes) over ``libringscope``, the library's C ABI (``ffi/include/ringscope.h``). Every failure of
the library raises :class:`RingscopeError` with the library's message; nothing here can crash the interpreter
through bad input (null pointers, stale handles and panics are all turned into errors by the C ABI).

    import numpy as np, ringscope
    with ringscope.Session('[export]\\nparquet = true\\ndir = "out"\\nrun_id = "demo"') as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="f32", row_width=4)
        s.begin_step(0, request_ids=[7, 9], positions=[17, 0])
        s.capture(hp, np.ones((2, 4), dtype=np.float32))
        s.end_step()
    dump = ringscope.read_dump("out/demo")            # numpy arrays, one entry per hookpoint
"""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib
from typing import Dict, Iterable, Optional, Sequence

import numpy as np

__all__ = ["RingscopeError", "Session", "Subscription", "Record", "read_dump", "library_path", "DTYPE_CODES"]

# Status codes (ffi/include/ringscope.h, `rs_status`).
_STATUS = {
    0: "RS_OK",
    1: "RS_ERR_INVALID_ARGUMENT",
    2: "RS_ERR_INVALID_HANDLE",
    3: "RS_ERR_CONFIG",
    4: "RS_ERR_CLOSED",
    5: "RS_ERR_STEP",
    6: "RS_ERR_CAPTURE",
    7: "RS_ERR_CUDA",
    8: "RS_ERR_IO",
    9: "RS_ERR_UNBALANCED",
    10: "RS_ERR_TIMEOUT",
    11: "RS_ERR_BUFFER_TOO_SMALL",
    12: "RS_ERR_ENDED",
    13: "RS_ERR_PANIC",
}
_CODE = {name: code for code, name in _STATUS.items()}
_DROP_REASONS = ("ring_full", "deadline", "too_large", "disconnected", "sink_backpressure", "sink_error", "corrupt")

#: dtype codes of the record format (docs/format.md) → (name, numpy dtype of the raw element; bf16 as uint16).
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
}
_NUMPY_FOR_DTYPE = {name: dt for name, dt in DTYPE_CODES.values()}
_ALIASES = {"float32": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16", "float64": "f64", "int8": "i8",
            "uint8": "u8", "int16": "i16", "int32": "i32", "int64": "i64"}


class RingscopeError(Exception):
    """A ringscope call failed. ``status`` is the C status name (e.g. ``RS_ERR_CAPTURE``), ``message`` says why."""

    def __init__(self, status: str, message: str):
        super().__init__(f"{message} [{status}]")
        self.status = status
        self.message = message


class _Counts(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "produced_records", "produced_rows", "sampled_out_records", "sampled_out_rows", "exported_records",
        "exported_rows", "dropped_records", "dropped_rows")] + [("dropped_by_reason", ctypes.c_uint64 * 7)]

    def to_dict(self) -> dict:
        d = {n: getattr(self, n) for n, _ in self._fields_[:-1]}
        d["dropped_by_reason"] = dict(zip(_DROP_REASONS, list(self.dropped_by_reason)))
        return d


class _RecordInfo(ctypes.Structure):
    _fields_ = [("hookpoint", ctypes.c_uint32), ("rows", ctypes.c_uint32), ("step", ctypes.c_uint64),
                ("seq", ctypes.c_uint64), ("row_bytes", ctypes.c_uint32), ("dtype", ctypes.c_uint32),
                ("needed", ctypes.c_uint64)]


def library_path() -> str:
    """Where libringscope is loaded from: ``$RINGSCOPE_LIB``, else the copy inside this package, else a cargo
    build of the checkout this package sits in (``target/release``)."""
    env = os.environ.get("RINGSCOPE_LIB")
    if env:
        return env
    here = pathlib.Path(__file__).resolve().parent
    found = sorted(glob.glob(str(here / "libringscope*.so"))) + sorted(glob.glob(str(here / "libringscope*.dylib")))
    if found:
        return found[0]
    for parent in here.parents:
        candidate = parent / "target" / "release" / "libringscope.so"
        if candidate.exists():
            return str(candidate)
    raise RingscopeError("RS_ERR_CONFIG", "libringscope not found: install with `pip install ./ffi/python`, or set "
                                          "RINGSCOPE_LIB to the library built by `cargo build --release -p ringscope-ffi`")


_lib = None


def _load():
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(library_path())
    u64, u32, i32, i64, sz, cp = (ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t,
                                  ctypes.c_char_p)
    p = ctypes.POINTER
    sigs = {
        "rs_last_error": ([], ctypes.c_char_p),
        "ringscope_format_version": ([], ctypes.c_uint16),
        "rs_session_open": ([cp, p(u64)], i32),
        "rs_session_open_file": ([cp, p(u64)], i32),
        "rs_session_close": ([u64, p(_Counts)], i32),
        "rs_register_hookpoint": ([u64, cp, cp, i64, cp, u32, p(u32)], i32),
        "rs_hookpoint_id": ([u64, cp, p(u32)], i32),
        "rs_set_enabled": ([u64, u32, ctypes.c_bool], i32),
        "rs_set_every_n_steps": ([u64, u32, u32], i32),
        "rs_set_rows": ([u64, u32, i32, p(u32), sz], i32),
        "rs_begin_step": ([u64, u64, p(u64), p(u32), sz], i32),
        "rs_begin_step_on_stream": ([u64, u64, p(u64), p(u32), sz, u64], i32),
        "rs_begin_step_graph": ([u64, u64, u64, u32, u32, u32, u64], i32),
        "rs_apply_controls": ([u64, u64], i32),
        "rs_submit_captures": ([u64], i32),
        "rs_end_step": ([u64], i32),
        "rs_capture_host": ([u64, u32, ctypes.c_void_p, sz, p(i32)], i32),
        "rs_capture_device": ([u64, u32, u64, u32, u64], i32),
        "rs_set_valid_rows_device": ([u64, u32, u64], i32),
        "rs_stats": ([u64, u32, p(_Counts)], i32),
        "rs_flush": ([u64, u32], i32),
        "rs_subscribe": ([u64, cp, p(u32), sz, p(u64)], i32),
        "rs_poll": ([u64, u32, p(_RecordInfo), ctypes.c_void_p, sz], i32),
        "rs_subscription_close": ([u64], i32),
    }
    for name, (args, res) in sigs.items():
        f = getattr(lib, name)
        f.argtypes = args
        f.restype = res
    _lib = lib
    return lib


def _check(status: int) -> None:
    if status != 0:
        msg = _load().rs_last_error().decode("utf-8", "replace")
        raise RingscopeError(_STATUS.get(status, f"status {status}"), msg)


def _u64_array(values: Sequence[int], what: str) -> np.ndarray:
    a = np.ascontiguousarray(values, dtype=np.uint64)
    if a.ndim != 1:
        raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"{what} must be one-dimensional")
    return a


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
        the session is closed and everything was delivered."""
        lib = _load()
        info = _RecordInfo()
        while True:
            st = lib.rs_poll(self._h, int(timeout * 1000), ctypes.byref(info), self._buf, len(self._buf))
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


class Session:
    """A ringscope session. ``config`` is TOML text (the README's configuration reference) or a dict of TOML
    sections; or give ``config_file``. Use as a context manager, or call :meth:`close`."""

    def __init__(self, config: "str | dict | None" = None, *, config_file: "str | os.PathLike | None" = None):
        lib = _load()
        h = ctypes.c_uint64(0)
        if config_file is not None:
            _check(lib.rs_session_open_file(os.fsencode(config_file), ctypes.byref(h)))
        else:
            text = _to_toml(config) if isinstance(config, dict) else (config or "")
            _check(lib.rs_session_open(text.encode("utf-8"), ctypes.byref(h)))
        self._h = h.value
        self._row_bytes: Dict[int, tuple] = {}
        self.totals: Optional[dict] = None

    # -- hookpoints ----------------------------------------------------------------------------------------------
    def register(self, name: str, *, site: str = "residual", layer: Optional[int] = None, dtype: str = "bf16",
                 row_width: int) -> int:
        """Registers a hookpoint; returns its id."""
        out = ctypes.c_uint32()
        _check(_load().rs_register_hookpoint(self._h, name.encode(), site.encode(), -1 if layer is None else layer,
                                             dtype.encode(), int(row_width), ctypes.byref(out)))
        self._row_bytes[out.value] = (_ALIASES.get(dtype, dtype), int(row_width))
        return out.value

    def hookpoint_id(self, name: str) -> int:
        out = ctypes.c_uint32()
        _check(_load().rs_hookpoint_id(self._h, name.encode(), ctypes.byref(out)))
        return out.value

    def set_enabled(self, hookpoint: int, enabled: bool) -> None:
        _check(_load().rs_set_enabled(self._h, hookpoint, bool(enabled)))

    def set_every_n_steps(self, hookpoint: int, n: int) -> None:
        _check(_load().rs_set_every_n_steps(self._h, hookpoint, int(n)))

    def set_rows(self, hookpoint: int, rows: "str | Sequence[int]") -> None:
        """``"all"``, ``"last_per_request"``, or a list of batch rows."""
        lib = _load()
        if rows == "all":
            _check(lib.rs_set_rows(self._h, hookpoint, 0, None, 0))
        elif rows == "last_per_request":
            _check(lib.rs_set_rows(self._h, hookpoint, 1, None, 0))
        else:
            a = np.ascontiguousarray(rows, dtype=np.uint32)
            _check(lib.rs_set_rows(self._h, hookpoint, 2, a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), a.size))

    # -- steps and captures --------------------------------------------------------------------------------------
    def begin_step(self, step: int, request_ids: Sequence[int], positions: Sequence[int],
                   stream: Optional[int] = None) -> None:
        """Starts a step: row i of every tensor captured in it belongs to ``request_ids[i]`` at ``positions[i]``.
        With the CUDA backend pass the engine's ``stream`` (a ``CUstream`` handle as an int, e.g.
        ``torch.cuda.current_stream().cuda_stream``)."""
        ids = _u64_array(request_ids, "request_ids")
        pos = np.ascontiguousarray(positions, dtype=np.uint32)
        if pos.shape != ids.shape:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"{ids.size} request ids but {pos.size} positions: give one of each per batch row")
        lib = _load()
        pids = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64))
        ppos = pos.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))
        if stream is None:
            _check(lib.rs_begin_step(self._h, int(step), pids, ppos, ids.size))
        else:
            _check(lib.rs_begin_step_on_stream(self._h, int(step), pids, ppos, ids.size, int(stream)))

    def begin_step_graph(self, request_ids, positions, stream: Optional[int] = None) -> None:
        """CUDA backend, best-effort mode: starts a step from inside a CUDA graph being recorded (or eagerly). The
        recorded kernel reads the batch from the engine's own device tensors at every replay, so replays need no
        Python call: ``request_ids`` is an int64 CUDA tensor ``[batch]`` (one request per batch row), ``positions``
        an int64 CUDA tensor ``[batch, seq]`` (e.g. ``position_ids``) or ``[seq]`` shared by every row (e.g.
        ``cache_position``). Their addresses are fixed into the graph: update them in place. Record the step's
        captures and :meth:`end_step` in the same graph."""
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
        _check(_load().rs_begin_step_graph(self._h, request_ids.data_ptr(), positions.data_ptr(), batch, seq, stride,
                                           int(stream)))

    def apply_controls(self, stream: Optional[int] = None) -> None:
        """CUDA backend: uploads control changes (enable, every-N, rows) on ``stream`` (default: torch's current
        stream) for CUDA graphs whose steps begin inside them (:meth:`begin_step_graph`; their replays make no host
        call). Call between replays."""
        if stream is None:
            import torch
            stream = torch.cuda.current_stream().cuda_stream
        _check(_load().rs_apply_controls(self._h, int(stream)))

    def submit_captures(self) -> None:
        """With ``ring.defer_captures`` (CUDA backend): starts copying the step's captures noted so far now, on a side
        stream, overlapping the rest of the step; :meth:`end_step` joins it back. A no-op otherwise."""
        _check(_load().rs_submit_captures(self._h))

    def end_step(self) -> None:
        _check(_load().rs_end_step(self._h))

    def capture(self, hookpoint: int, array) -> str:
        """Captures a host array (numpy, or anything exposing the buffer protocol) holding the step's batch rows ×
        row width, C-contiguous, of the hookpoint's dtype (bf16: uint16 bit patterns). Returns ``"published"``,
        ``"sampled_out"`` or ``"dropped"``."""
        a = np.asarray(array)
        if not a.flags["C_CONTIGUOUS"]:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 "the array is not C-contiguous: pass np.ascontiguousarray(x) (a copy) explicitly")
        known = self._row_bytes.get(hookpoint)
        if known is not None:
            name, width = known
            want = _NUMPY_FOR_DTYPE.get(name)
            # bf16 has no numpy dtype: its bit patterns as (u)int16, or ml_dtypes' bfloat16 — never float16, whose
            # bits mean something else.
            bf16_bits = name == "bf16" and (a.dtype.kind in "ui" and a.dtype.itemsize == 2
                                            or a.dtype.name == "bfloat16")
            if want is not None and a.dtype.newbyteorder("<") != want and not bf16_bits:
                hint = " (bf16: pass its bit patterns as uint16, e.g. tensor.view(torch.uint16).numpy())" \
                    if name == "bf16" else ""
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"hookpoint {hookpoint} holds {name}; got an array of {a.dtype}{hint}")
            if a.ndim == 0 or a.shape[-1] != width and a.size % width != 0:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"hookpoint {hookpoint} has rows of {width} elements; got shape {a.shape}")
        outcome = ctypes.c_int32(-1)
        _check(_load().rs_capture_host(self._h, hookpoint, a.ctypes.data, a.nbytes, ctypes.byref(outcome)))
        return {0: "published", 1: "sampled_out", 2: "dropped"}[outcome.value]

    def capture_device(self, hookpoint: int, device_ptr: int, rows: int, stream: int) -> None:
        """CUDA backend: launches the capture of ``rows`` contiguous rows at ``device_ptr`` on ``stream``."""
        _check(_load().rs_capture_device(self._h, hookpoint, int(device_ptr), int(rows), int(stream)))

    # -- state ---------------------------------------------------------------------------------------------------
    def stats(self, hookpoint: int) -> dict:
        """Counters of one hookpoint (records and rows): produced, sampled out, exported, dropped (by reason)."""
        c = _Counts()
        _check(_load().rs_stats(self._h, hookpoint, ctypes.byref(c)))
        return c.to_dict()

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until everything captured so far is exported or dropped (file sinks export at file commit)."""
        _check(_load().rs_flush(self._h, int(timeout * 1000)))

    def subscribe(self, name: str, layers: Optional[Iterable[int]] = None) -> Subscription:
        """An online consumer of the records of ``layers`` (all when None) captured from now on."""
        a = np.ascontiguousarray(list(layers) if layers is not None else [], dtype=np.uint32)
        h = ctypes.c_uint64()
        _check(_load().rs_subscribe(self._h, name.encode(), a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), a.size,
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


def _to_toml(d: dict) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise RingscopeError("RS_ERR_CONFIG", f"cannot write {v!r} as TOML")

    out = []
    for section, body in d.items():
        if section == "hookpoints":
            for hp in body:
                out.append("[[hookpoints]]")
                out += [f"{k} = {value(v)}" for k, v in hp.items()]
        else:
            out.append(f"[{section}]")
            out += [f"{k} = {value(v)}" for k, v in body.items()]
    return "\n".join(out) + "\n"


def read_dump(path: "str | os.PathLike", hookpoint: Optional[str] = None, as_torch: bool = False) -> dict:
    """Reads a Parquet dump (a run directory) into ``{hookpoint name: {column: array}}``: ``step``, ``request_id``,
    ``position``, ``layer``, ``rank`` as numpy arrays, and ``activation`` as an array of shape (rows, row_width)
    with the right dtype — bf16 as ``torch.bfloat16`` when ``as_torch`` (every dtype becomes a torch tensor then),
    else as uint16 bit patterns (:func:`as_float32` converts). Rows are sorted by (step, request_id, position).
    Needs pyarrow."""
    import pyarrow.dataset as ds

    root = pathlib.Path(path)
    parts = sorted(p for p in root.glob("hookpoint=*") if p.is_dir())
    if not parts:
        raise RingscopeError("RS_ERR_IO", f"{root} holds no hookpoint=... partitions: not a ringscope Parquet dump")
    out = {}
    for part in parts:
        # One dataset per hookpoint: hookpoints differ in row width, so they do not share one Arrow schema.
        name = part.name[len("hookpoint="):]
        if hookpoint is not None and name != hookpoint:
            continue
        t = ds.dataset(str(part), format="parquet", partitioning="hive").to_table()
        if t.num_rows == 0:
            continue
        t = t.sort_by([("step", "ascending"), ("request_id", "ascending"), ("position", "ascending")])
        meta = t.schema.field("activation").metadata or {}
        dtype_name = meta.get(b"ringscope.dtype", b"").decode() or t.column("dtype")[0].as_py()
        np_dtype = _NUMPY_FOR_DTYPE[dtype_name]
        flat = t.column("activation").combine_chunks()
        raw = np.frombuffer(flat.buffers()[1], dtype=np.uint8)[flat.offset * flat.type.byte_width:]
        raw = raw[: t.num_rows * flat.type.byte_width]
        act = raw.view(np_dtype).reshape(t.num_rows, flat.type.byte_width // np_dtype.itemsize)
        cols = {c: t.column(c).to_numpy() for c in ("step", "request_id", "position", "layer", "rank")
                if c in t.column_names}
        if as_torch:
            import torch

            act_t = torch.from_numpy(act.copy())
            if dtype_name == "bf16":
                act_t = act_t.view(torch.bfloat16)
            cols = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in cols.items()}
            cols["activation"] = act_t
        else:
            cols["activation"] = act
        cols["dtype"] = dtype_name
        out[name] = cols
    return out
