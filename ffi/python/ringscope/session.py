"""A ringscope session from Python (:class:`Session`), its subscriptions, records and alerts, and TOML."""

from __future__ import annotations

import ctypes
import numbers
import os
from collections.abc import Mapping
from typing import Callable, Dict, Iterable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from ._abi import (MAX_ENDED_TOKENS, _Alert, _check, _CODE, _Counts, _DestinationSnapshot, _HookPointSnapshot, _I32_MAX,
                   _lib_with, _load, _NO_HOOKPOINT, _PROBE_ACTIONS, _PROBE_MODES, _PROBE_NAME_LEN, _ProbeReport, _probes_lib,
                   _ProbeSnapshot, _RecordInfo, _SessionSnapshot, _SinkFailureInfo, _SinkHealth, _sized, _stats_lib,
                   _untyped)
from .errors import RingscopeError
from ._args import (_flag, _host_array, _int, _int_array, _invalid, _no_nul, _path, _show, _text, _timeout_ms, _u32,
                    _U32_MAX, _u64)
from .dtypes import _ALIASES, DTYPE_CODES


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


def _stream_getter(device: Optional[int]) -> Callable[[], int]:
    """A function of no arguments giving torch's current CUDA stream on ``device`` (an index; ``None``: the current
    device at each call) as a ``CUstream``. Where torch has the raw-stream call, a ``functools.partial`` of it: no
    Python frame per call (an engine plugin asks before every forward pass)."""
    import functools

    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None and device is not None:
        return functools.partial(raw, device)
    return functools.partial(_current_stream, device)


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

    def __repr__(self) -> str:
        return f"Record(hookpoint={self.hookpoint}, step={self.step}, rows={len(self.rows)}, dtype={self.dtype})"


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

    def __iter__(self) -> Iterator[Record]:
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


def _named_snapshot(call, handle: int, index: int, struct_type) -> tuple:
    """``(snapshot, name)`` from a call that writes a snapshot struct and a name (``rs_hookpoint_stats``,
    ``rs_destination_stats``, ``rs_probe_stats``): the name buffer is grown once if the library says it is too small."""
    out = _sized(struct_type)
    name = ctypes.create_string_buffer(257)
    status = call(handle, index, ctypes.byref(out), name, len(name))
    if status == _CODE["RS_ERR_BUFFER_TOO_SMALL"]:
        name = ctypes.create_string_buffer(out.name_len + 1)
        status = call(handle, index, ctypes.byref(out), name, len(name))
    _check(status)
    return out, name.raw[:out.name_len].decode("utf-8", "replace")


def _text_of(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# -- captures by C handle and raw pointer: for the torch custom ops and the engine plugins, which hold a session's
# handle (custom ops take ints, not Python objects) and a tensor's address; the caller has checked the values.

def _capture_host_raw(handle: int, hookpoint: int, ptr: int, nbytes: int) -> None:
    """``nbytes`` of rows in host memory at ``ptr`` into ``hookpoint`` of the session whose handle is ``handle``."""
    outcome = ctypes.c_int32(-1)
    _check(_load().rs_capture_host(handle, hookpoint, ctypes.c_void_p(ptr), nbytes, ctypes.byref(outcome)))


def _capture_device_raw(handle: int, hookpoint: int, ptr: int, rows: int, stream: int) -> None:
    """``rows`` rows in device memory at ``ptr`` into ``hookpoint``, on ``stream`` (CUDA backend)."""
    _check(_load().rs_capture_device(handle, hookpoint, ptr, rows, stream))


def _submit_captures_raw(handle: int) -> None:
    """Starts copying the open step's deferred captures now (:meth:`Session.submit_captures`)."""
    _check(_load().rs_submit_captures(handle))


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
        # admit_graph_step's and apply_controls' C calls (_hot_call), once made: engines call them before every replay.
        self._admit: Optional[Callable[[int, int], None]] = None
        self._apply: Optional[Callable[[int, int], None]] = None
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
    def begin_step(self, step: int, request_ids: "Sequence[int] | np.ndarray",
                   positions: "Sequence[int] | np.ndarray", stream: Optional[int] = None) -> None:
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

    def begin_step_graph(self, request_ids, positions, stream: Optional[int] = None, tokens=None,
                         ended_tokens: Sequence[int] = (), kept=None) -> None:
        """CUDA backend: starts a step from inside a CUDA graph being recorded (or eagerly). The recorded kernel reads
        the batch from the engine's own device tensors at every replay, so best-effort replays need no Python call:
        ``request_ids`` is an int64 CUDA tensor ``[batch]`` (one request per batch row), ``positions`` an int64 CUDA
        tensor ``[batch, seq]`` (e.g. ``position_ids``) or ``[seq]`` shared by every row (e.g. ``cache_position``).
        Their addresses are fixed into the graph: update them in place. Record the step's captures and
        :meth:`end_step` in the same graph. Full mode: call :meth:`admit_graph_step` before every replay.

        ``tokens`` and ``ended_tokens`` (1 to 8 token ids: end-of-sequence and padding tokens): a batch row whose
        token — ``tokens[b]``, an int64 CUDA tensor ``[batch]`` (e.g. ``input_ids[:, -1]`` of a decode step; any row
        stride) — is one of ``ended_tokens`` at a replay belongs to no request then (its rows carry request id -1,
        :data:`ringscope.torch.NO_REQUEST`), decided by ringscope's kernels on the device.

        ``kept`` (one token per batch row): an int32 CUDA tensor ``[1 + batch]`` the engine writes before each pass,
        as it writes the request ids — element 0 the number of rows the step keeps, or ``KEEP_ALL`` (``0xFFFFFFFF``,
        -1 as int32) for every row, then the kept batch rows in ascending order. The other rows are neither captured
        nor scored (requests an engine serves but does not capture leave nothing in the output). Every capture takes
        the kept rows where it would take all rows or each request's last row; a hookpoint's row list is taken as
        given. Not with ``tokens``."""
        def check(t, what, contiguous=True):
            if not (hasattr(t, "is_cuda") and t.is_cuda and str(t.dtype) == "torch.int64"
                    and (t.is_contiguous() or not contiguous)):
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"begin_step_graph: {what} must be a {'contiguous ' if contiguous else ''}int64 "
                                     f"CUDA tensor; got {getattr(t, 'dtype', type(t).__name__)} on "
                                     f"{getattr(t, 'device', 'the host')}")
        if isinstance(ended_tokens, (str, bytes)) or not isinstance(ended_tokens, Iterable):
            raise _invalid(f"begin_step_graph: ended_tokens must be a sequence of token ids, got {_show(ended_tokens)}")
        ended = [_int("begin_step_graph: ended_tokens", t, -2**63, 2**63 - 1) for t in ended_tokens]
        if (tokens is None) != (not ended):
            raise _invalid("begin_step_graph: give tokens and ended_tokens together (the token each batch row is fed "
                           "and the ids that mark an ended sequence), or neither")
        if len(ended) > MAX_ENDED_TOKENS:
            raise _invalid(f"begin_step_graph: {len(ended)} ended_tokens, at most {MAX_ENDED_TOKENS} (end-of-sequence "
                           "and padding tokens)")
        if kept is not None:
            if tokens is not None:
                raise _invalid("begin_step_graph: give kept or tokens, not both")
            if not (hasattr(kept, "is_cuda") and kept.is_cuda and str(kept.dtype) == "torch.int32"
                    and kept.is_contiguous() and kept.dim() == 1):
                raise _invalid(f"begin_step_graph: kept must be a contiguous one-dimensional int32 CUDA tensor (the "
                               f"count, then a row per batch row); got {getattr(kept, 'dtype', type(kept).__name__)} "
                               f"{tuple(getattr(kept, 'shape', ()))} on {getattr(kept, 'device', 'the host')}")
        check(request_ids, "request_ids")
        check(positions, "positions")
        if request_ids.dim() != 1 or positions.dim() not in (1, 2):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"begin_step_graph: request_ids must be [batch] and positions [batch, seq] or [seq]; "
                                 f"got {tuple(request_ids.shape)} and {tuple(positions.shape)}")
        if tokens is not None:
            check(tokens, "tokens", contiguous=False)
            if tokens.dim() != 1 or tokens.shape[0] != request_ids.shape[0]:
                raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                     f"begin_step_graph: tokens must be [batch] ({request_ids.shape[0]} rows), one token "
                                     f"per batch row; got {tuple(tokens.shape)}")
        batch = request_ids.shape[0]
        seq = positions.shape[-1]
        if positions.dim() == 2 and positions.shape[0] != batch:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT",
                                 f"begin_step_graph: {batch} request ids but positions for {positions.shape[0]} rows")
        stride = seq if positions.dim() == 2 else 0
        if stream is None:
            import torch
            stream = torch.cuda.current_stream(request_ids.device).cuda_stream
        if kept is not None:
            if kept.shape[0] < batch + 1:
                raise _invalid(f"begin_step_graph: kept holds {kept.shape[0]} elements; {batch} batch rows need "
                               f"{batch + 1} (the count, then a row per batch row)")
            _check(_lib_with("rs_begin_step_graph_kept").rs_begin_step_graph_kept(
                self._h, request_ids.data_ptr(), positions.data_ptr(), _u32("the batch size", batch),
                _u32("the sequence length", seq), _u32("the positions' row stride", stride), kept.data_ptr(),
                _u64("stream", stream)))
            return
        if tokens is None:
            _check(_load().rs_begin_step_graph(self._h, request_ids.data_ptr(), positions.data_ptr(),
                                               _u32("the batch size", batch), _u32("the sequence length", seq),
                                               _u32("the positions' row stride", stride), _u64("stream", stream)))
            return
        ids = (ctypes.c_int64 * len(ended))(*ended)
        _check(_lib_with("rs_begin_step_graph_ended").rs_begin_step_graph_ended(
            self._h, request_ids.data_ptr(), positions.data_ptr(), _u32("the batch size", batch),
            _u32("the sequence length", seq), _u32("the positions' row stride", stride), tokens.data_ptr(),
            _u32("the tokens' row stride", tokens.stride(0)), ids, len(ended), _u64("stream", stream)))

    def admit_graph_step(self, rows: Optional[int] = None, stream: Optional[int] = None) -> None:
        """Full mode (CUDA backend): admits the next replay of a CUDA graph whose step begins inside it
        (:meth:`begin_step_graph`). Call it before every replay, on the replay's ``stream`` (default: torch's current
        stream), outside graph recording: it waits (up to the step's wait budget) until the drain has room for
        everything such a step can capture and reserves it — a check of two host counters when there is room, so a
        lossless replay costs what a best-effort one does. ``rows`` bounds the replay's batch rows (default: the
        largest graph-begun step recorded in this session). Past the budget it raises ``RingscopeError`` naming the
        deadline (nothing with ``policy.on_deadline = "degrade"``) and the replay's captures are dropped and counted
        as ``deadline``. Also uploads control changes, as :meth:`apply_controls` does. One call per graph-begun step,
        replayed or eager: an eager :meth:`begin_step_graph` takes the admission made since the last eager step as its
        own (ringscope does not see replays). Best-effort sessions: returns at once."""
        admit = self._admit
        if admit is None:
            _lib_with("rs_admit_graph_step")  # names a library that predates it
            admit = self._admit = self._hot_call("rs_admit_graph_step")
        admit(0 if rows is None else _u32("admit_graph_step: rows", rows, 1),
              _current_stream() if stream is None else stream)

    def apply_controls(self, stream: Optional[int] = None) -> None:
        """CUDA backend: uploads control changes (enable, every-N, rows) on ``stream`` (default: torch's current
        stream) for CUDA graphs whose steps begin inside them (:meth:`begin_step_graph`; their replays make no host
        call). Call between replays. Returns at once when no control changed since its last upload (and no policy
        manager runs)."""
        apply = self._apply
        if apply is None:
            apply = self._apply = self._hot_call("rs_apply_controls")
        apply(0, _current_stream() if stream is None else stream)

    def _hot_call(self, name: str, lo: int = 0) -> Callable[[int, int], None]:
        """``call(n, stream)``: the C call ``name(handle, u32 n, u64 stream)`` (``rs_admit_graph_step``; without ``n``:
        ``rs_apply_controls``) made the cheap way (:func:`_untyped`): the handle as a prebuilt ``c_uint64``; the stream
        checked and converted only when it is not a plain ``int`` or differs from the last one converted; no other
        Python frame. ``lo = 0`` (:meth:`admit_graph_step`, which checked ``n``): an ``n`` past ``_I32_MAX`` goes
        through the typed call. ``lo = 1`` (the plugins, which do not check): an ``n`` that is not an ``int`` in
        1..=``_I32_MAX`` goes to :meth:`admit_graph_step` (with the stream checked), whose checks raise or which makes
        the call. Safe to call from several threads: the last stream and its conversion are one tuple, replaced
        whole."""
        f = _untyped(name)
        typed = getattr(_load(), name)
        h = self._h
        hc = ctypes.c_uint64(h)
        # The last stream converted (an int), and it as a c_uint64.
        last: "list[tuple[Optional[int], Optional[ctypes.c_uint64]]]" = [(None, None)]
        if name == "rs_apply_controls":
            def apply(n: int, stream: int) -> None:
                c = last[0]
                if type(stream) is not int or stream != c[0]:
                    v = _u64("stream", stream)
                    c = last[0] = (v, ctypes.c_uint64(v))
                st = f(hc, c[1])
                if st:
                    _check(st)
            return apply

        def admit(n: int, stream: int) -> None:
            if type(n) is not int or not lo <= n <= _I32_MAX:
                if lo:  # the plugins' call: admit_graph_step checks n (and comes back here with lo = 0)
                    self.admit_graph_step(n, _u64("stream", stream))
                    return
                st = typed(h, n, _u64("stream", stream))  # a checked u32 past the C int range
            else:
                c = last[0]
                if type(stream) is not int or stream != c[0]:
                    v = _u64("stream", stream)
                    c = last[0] = (v, ctypes.c_uint64(v))
                st = f(hc, n, c[1])
            if st:
                _check(st)
        return admit

    def _before_pass(self, full: bool) -> Callable[[int, int], None]:
        """For an engine plugin, which calls it before every forward pass: ``call(rows, stream)`` admits the pass
        (``full``: :meth:`admit_graph_step`) or uploads control changes (:meth:`apply_controls`) through the C call
        alone — one Python frame, the C call without ctypes' per-argument conversion (:meth:`_hot_call`: the stream
        checked when it changes, ``rows`` when it is not an int in 1..=2**31 - 1), since at every pass, cold, each
        Python frame counts. ``rows``: the pass's padded token rows, at least 1 (full mode; 0 is refused as
        :meth:`admit_graph_step` refuses it). A library that predates the admission fails the first call, naming
        what to do (as :meth:`admit_graph_step`)."""
        if not full:
            return self._hot_call("rs_apply_controls")
        if _untyped("rs_admit_graph_step") is None:
            return lambda rows, stream: self.admit_graph_step(rows, stream)  # raises, naming the library and the call
        return self._hot_call("rs_admit_graph_step", lo=1)

    def _step_rows_noter(self) -> "Callable[[np.ndarray], None]":
        """For an engine plugin, which calls it before every forward pass on CUDA when probes are configured:
        ``note(ids)`` is :meth:`note_step_rows` for ``ids`` the plugin made itself — a C-contiguous one-dimensional
        uint64 array, not checked again — through the C call alone (:func:`_untyped`, the handle prebuilt), since at
        every pass each Python frame and ctypes conversion counts. A library that predates the call: None."""
        f = _untyped("rs_note_step_rows")
        if f is None:
            return None  # type: ignore[return-value]
        hc = ctypes.c_uint64(self._h)

        def note(ids: np.ndarray) -> None:
            st = f(hc, ctypes.c_void_p(ids.ctypes.data), ctypes.c_size_t(ids.size))
            if st:
                _check(st)
        return note

    def submit_captures(self) -> None:
        """With ``ring.defer_captures`` (CUDA backend): starts copying the step's captures noted so far now, on a side
        stream, overlapping the rest of the step; :meth:`end_step` joins it back. A no-op otherwise."""
        _check(_load().rs_submit_captures(self._h))

    def end_step(self) -> None:
        _check(_load().rs_end_step(self._h))

    def hold_step(self, slot: int) -> None:
        """With ``ring.defer_captures`` (CUDA backend), while a CUDA graph is being recorded: ends the step begun inside
        it (:meth:`begin_step_graph`) without putting its copy into the graph — the copy is held as ``slot`` (a number
        the engine picks per recorded graph; recording again replaces it) and :meth:`launch_held` launches it after
        each replay, so the graph runs none of ringscope's kernels. The captured tensors must keep their values from
        the end of each replay until the held copy has run (:meth:`join_held`)."""
        _check(_lib_with("rs_hold_step").rs_hold_step(self._h, _u32("hold_step: slot", slot)))

    def launch_held(self, slot: int, stream: Optional[int] = None) -> None:
        """CUDA backend: launches held copy ``slot`` (:meth:`hold_step`) on a side stream after everything ``stream``
        (default: torch's current stream) was given so far — right after each replay of the graph that held it, on the
        stream that replayed it, between steps. Full mode: admit each replay first (:meth:`admit_graph_step`)."""
        _check(_lib_with("rs_launch_held").rs_launch_held(
            self._h, _u32("launch_held: slot", slot), _current_stream() if stream is None else _u64("stream", stream)))

    def join_held(self, stream: Optional[int] = None) -> None:
        """CUDA backend: ``stream`` (default: torch's current stream) waits, in stream order, for the held copies
        launched so far — before the engine reuses the memory they read (before its next replay at the latest).
        Returns at once when none is pending."""
        _check(_lib_with("rs_join_held").rs_join_held(
            self._h, _current_stream() if stream is None else _u64("stream", stream)))

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

    def set_valid_rows_device(self, hookpoint: int, device_ptr: "int | None") -> None:
        """CUDA backend: rows of ``hookpoint`` at or past the ``uint32`` at ``device_ptr`` are padding — neither
        captured nor scored by its fused probes —, read when each capture runs (graph replays included): what an
        engine whose CUDA graphs were recorded at a padded batch size writes before each pass. ``None`` (or 0) removes
        it. Takes effect at the next step (after :meth:`apply_controls`). The memory must stay allocated while
        captures of the hookpoint may run."""
        _check(_load().rs_set_valid_rows_device(self._h, _u32("hookpoint", hookpoint),
                                                _u64("device_ptr", device_ptr or 0)))

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
            hp, name = _named_snapshot(lib.rs_hookpoint_stats, self._h, hp_id, _HookPointSnapshot)
            hookpoints.append({
                "id": hp.id, "name": name, "row_bytes": hp.row_bytes, "counters": hp.counts.to_dict(),
                "produced_bytes": hp.produced_bytes, "published_bytes": hp.published_bytes,
                "exported_bytes": hp.exported_bytes, "rung": hp.rung.decode("ascii", "replace"),
                "downcast_records": hp.downcast_records, "downcast_rows": hp.downcast_rows,
                **_hookpoint_spec(hp),
            })
        destinations = []
        for i in range(st.destinations):
            d, name = _named_snapshot(lib.rs_destination_stats, self._h, i, _DestinationSnapshot)
            destinations.append({
                "name": name,
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

    def alerts(self, timeout: Optional[float] = 0.0) -> Iterator[Alert]:
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

    def note_step_rows(self, request_ids: "Sequence[int] | np.ndarray") -> None:
        """The request of each token row of a step begun on the device (:meth:`begin_step_graph`), in batch order
        (``2**64 - 1``, :data:`ringscope.torch.NO_REQUEST`, for padding and rows of no request): the engine's own account of what the step ran, which a
        step begun inside a CUDA graph cannot give the probes. It is their coverage denominator
        (``coverage["expected"]`` of :meth:`probe_request`: rows the engine ran for the request, so that rows lost at a
        request's start or end count as ``unobserved``), as :meth:`begin_step`'s batch is. Call it once per forward
        pass (a graph replay or an eager pass); the engine plugins do on CUDA. Does nothing without probes."""
        ids = _int_array("request_ids", request_ids, np.uint64)
        _check(_lib_with("rs_note_step_rows").rs_note_step_rows(
            self._h, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)), ids.size))

    def set_metadata(self, key: str, value) -> None:
        """Sets entry ``key`` of the run manifest's ``metadata`` object to ``value`` (anything ``json.dumps`` takes:
        dicts, lists, strings, numbers, booleans, None; NaN and infinities are refused), replacing an earlier value of
        the key; written with the manifest when the session closes. :func:`ringscope.torch.attach` and the engine
        plugins write ``attention`` there (what :func:`ringscope.attention_pattern` needs). Keys: 1 to 64 characters
        of ``A-Z a-z 0-9 _ . -``; a value: at most 4 MiB of JSON; at most 64 keys."""
        import json

        if not isinstance(key, str):
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"set_metadata: key must be a str, not {type(key).__name__}")
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"set_metadata: the value of {key!r} is not JSON: "
                                                            f"{type(e).__name__}: {e}") from None
        try:
            k = key.encode("utf-8")
        except UnicodeEncodeError:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"set_metadata: key {key!r} is not valid UTF-8") from None
        if b"\0" in k:
            raise RingscopeError("RS_ERR_INVALID_ARGUMENT", f"set_metadata: key {key!r} contains a NUL character")
        _check(_lib_with("rs_session_set_metadata").rs_session_set_metadata(self._h, k, text.encode("utf-8")))

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
        hp, name = _named_snapshot(_stats_lib().rs_hookpoint_stats, self._h, _u32("hookpoint", hookpoint),
                                   _HookPointSnapshot)
        return {"name": name, **_hookpoint_spec(hp)}

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
            ps, name = _named_snapshot(lib.rs_probe_stats, self._h, i, _ProbeSnapshot)
            names: Dict[str, Optional[str]] = {"hookpoint": None, "scores_hookpoint": None}
            if self.totals is None:  # hookpoints are named by an open session only
                names = {"hookpoint": self._hookpoint_name(ps.hookpoint),
                         "scores_hookpoint": self._hookpoint_name(ps.scores_hookpoint)}
            out.append({"name": name,
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

    def __enter__(self) -> Session:
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
