"""The C ABI as Python sees it: the status codes, the structs and every ``rs_*`` signature of
``ffi/include/ringscope.h`` in one table (:data:`SIGNATURES`), loading the library and checking a call's status.
This module and the session's are the only ones that call ``rs_*``; tests/python/test_abi.py checks every signature,
struct size and field offset here against the header (compiled with the system C compiler).
"""

import ctypes
import glob
import os
import pathlib
from typing import Any, ClassVar, Dict, List, Tuple

from .errors import RingscopeError

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
    14: "RS_ERR_SINK",
    15: "RS_NOT_SEEN",
    16: "RS_ERR_STATE",
}
_CODE = {name: code for code, name in _STATUS.items()}
_DROP_REASONS = ("ring_full", "deadline", "too_large", "disconnected", "sink_backpressure", "sink_error", "corrupt")


class _Counts(ctypes.Structure):
    # (name, ctypes type) pairs, no bit widths: to_dict unpacks them.
    _fields_: ClassVar[List[Tuple[str, Any]]] = [(n, ctypes.c_uint64) for n in (
        "produced_records", "produced_rows", "sampled_out_records", "sampled_out_rows", "exported_records",
        "exported_rows", "dropped_records", "dropped_rows")] + [("dropped_by_reason", ctypes.c_uint64 * 7)]

    def to_dict(self) -> dict:
        d = {n: getattr(self, n) for n, _ in self._fields_[:-1]}
        d["dropped_by_reason"] = dict(zip(_DROP_REASONS, list(self.dropped_by_reason)))
        # Captured, neither exported (committed) nor dropped yet: in the ring, queued for a destination, or written
        # into a file that is not committed yet (flush() or close() commits it). 0 once the session is closed.
        for unit in ("records", "rows"):
            d[f"in_flight_{unit}"] = max(0, d[f"produced_{unit}"] - d[f"sampled_out_{unit}"] - d[f"exported_{unit}"]
                                         - d[f"dropped_{unit}"])
        return d


class _RecordInfo(ctypes.Structure):
    _fields_ = [("hookpoint", ctypes.c_uint32), ("rows", ctypes.c_uint32), ("step", ctypes.c_uint64),
                ("seq", ctypes.c_uint64), ("row_bytes", ctypes.c_uint32), ("dtype", ctypes.c_uint32),
                ("needed", ctypes.c_uint64)]


class _SinkHealth(ctypes.Structure):
    _fields_ = [("failed_sinks", ctypes.c_uint32), ("first_failure_unix_ns", ctypes.c_uint64)]


class _SinkFailureInfo(ctypes.Structure):
    _fields_ = [("unix_ns", ctypes.c_uint64), ("sink_len", ctypes.c_uint32), ("message_len", ctypes.c_uint32),
                ("needed", ctypes.c_uint64)]


class _SessionSnapshot(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in (
        "struct_size", "mode", "backend", "hookpoints", "destinations", "reserved")] + [(n, ctypes.c_uint64) for n in (
        "unix_ns", "uptime_ns", "steps", "last_step", "step_time_ns", "step_interval_ns", "ring_capacity_bytes",
        "ring_used_bytes", "ring_held_bytes", "drain_records", "drain_rows", "drain_bytes", "drain_data_bytes",
        "stalls", "stall_ns", "cached_rows")]


_RUNG_LEN = 32
#: Most token ids ``rs_begin_step_graph_ended`` takes (``RS_MAX_ENDED_TOKENS``).
MAX_ENDED_TOKENS = 8
#: ``kept[0]`` of :meth:`ringscope.Session.begin_step_graph` for a step that keeps every row (``RS_KEEP_ALL``).
KEEP_ALL = 0xFFFF_FFFF


class _HookPointSnapshot(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("id", ctypes.c_uint32), ("row_bytes", ctypes.c_uint64),
                ("name_len", ctypes.c_uint64), ("counts", _Counts), ("produced_bytes", ctypes.c_uint64), ("published_bytes", ctypes.c_uint64),
                ("exported_bytes", ctypes.c_uint64), ("rung", ctypes.c_char * _RUNG_LEN),
                ("downcast_records", ctypes.c_uint64), ("downcast_rows", ctypes.c_uint64),
                ("dtype", ctypes.c_uint32), ("row_width", ctypes.c_uint32)]


class _DestinationSnapshot(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("kind", ctypes.c_uint32)] + [(n, ctypes.c_uint64) for n in (
        "delivered_records", "delivered_bytes", "queued_records", "queued_bytes", "dropped_records")] + [
        ("failed", ctypes.c_uint32), ("name_len", ctypes.c_uint32)]


# Probes (C ABI 4): `rs_alert`, `rs_probe_report`, `rs_probe_snapshot`.
_PROBE_NAME_LEN = 64
#: The most outputs (weight rows) a probe may have.
PROBE_MAX_OUTPUTS = 64
_PROBE_ACTIONS = {0: "alert", 1: "stop"}
_PROBE_MODES = {0: "consumer", 1: "fused"}
_NO_HOOKPOINT = 2**32 - 1


class _Alert(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("struct_size", "action", "output", "position")] + [
        ("request_id", ctypes.c_uint64), ("step", ctypes.c_uint64)] + [
        (n, ctypes.c_float) for n in ("score", "token_score", "threshold")] + [
        (n, ctypes.c_uint32) for n in ("probe_len", "label_len", "reserved")] + [
        ("probe", ctypes.c_char * _PROBE_NAME_LEN), ("label", ctypes.c_char * _PROBE_NAME_LEN)]


class _ProbeReport(ctypes.Structure):
    # (name, ctypes type) pairs (mypy would join an array's pair and a scalar's to (str, object)).
    _fields_: ClassVar[List[Tuple[str, Any]]] = [
        ("struct_size", ctypes.c_uint32), ("outputs", ctypes.c_uint32)] + [(n, ctypes.c_uint64) for n in (
        "request_id", "alerted", "last_step", "scored", "nan", "expected", "unobserved")] + [
        ("scores", ctypes.c_float * PROBE_MAX_OUTPUTS), ("cached", ctypes.c_uint64)]


class _ProbeSnapshot(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in (
        "struct_size", "mode", "hookpoint", "scores_hookpoint", "name_len", "reserved")] + [
        (n, ctypes.c_uint64) for n in ("rows", "nan_rows", "alerts", "evicted_requests", "no_request_rows")]

# -- every call, with the C ABI version that added it ----------------------------------------------------------------
_u64, _u32, _i32, _i64, _sz, _cp = (ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t,
                                    ctypes.c_char_p)
_p = ctypes.POINTER

#: ``name: (ABI version that added it, argument types, result type)``; ``rs_status`` is an ``int32_t``.
SIGNATURES: Dict[str, Tuple[int, List, type]] = {
    "rs_last_error": (1, [], ctypes.c_char_p),
    "ringscope_format_version": (1, [], ctypes.c_uint16),
    "rs_session_open": (1, [_cp, _p(_u64)], _i32),
    "rs_session_open_file": (1, [_cp, _p(_u64)], _i32),
    "rs_session_close": (1, [_u64, _p(_Counts)], _i32),
    "rs_register_hookpoint": (1, [_u64, _cp, _cp, _i64, _cp, _u32, _p(_u32)], _i32),
    "rs_hookpoint_id": (1, [_u64, _cp, _p(_u32)], _i32),
    "rs_set_enabled": (1, [_u64, _u32, ctypes.c_bool], _i32),
    "rs_set_downcast": (1, [_u64, _u32, ctypes.c_bool], _i32),
    "rs_set_every_n_steps": (1, [_u64, _u32, _u32], _i32),
    "rs_set_rows": (1, [_u64, _u32, _i32, _p(_u32), _sz], _i32),
    "rs_begin_step": (1, [_u64, _u64, _p(_u64), _p(_u32), _sz], _i32),
    "rs_begin_step_on_stream": (1, [_u64, _u64, _p(_u64), _p(_u32), _sz, _u64], _i32),
    "rs_begin_step_graph": (1, [_u64, _u64, _u64, _u32, _u32, _u32, _u64], _i32),
    "rs_apply_controls": (1, [_u64, _u64], _i32),
    "rs_submit_captures": (1, [_u64], _i32),
    "rs_end_step": (1, [_u64], _i32),
    "rs_capture_host": (1, [_u64, _u32, ctypes.c_void_p, _sz, _p(_i32)], _i32),
    "rs_capture_device": (1, [_u64, _u32, _u64, _u32, _u64], _i32),
    "rs_capture_device_last_rows": (1, [_u64, _u32, _u64, _u32, _u64], _i32),
    "rs_set_valid_rows_device": (1, [_u64, _u32, _u64], _i32),
    "rs_stats": (1, [_u64, _u32, _p(_Counts)], _i32),
    "rs_flush": (1, [_u64, _u32], _i32),
    "rs_sink_status": (1, [_u64, _p(_SinkHealth)], _i32),
    "rs_sink_failure": (1, [_u64, _u32, _p(_SinkFailureInfo), ctypes.c_char_p, _sz], _i32),
    "rs_subscribe": (1, [_u64, _cp, _p(_u32), _sz, _p(_u64)], _i32),
    "rs_poll": (1, [_u64, _u32, _p(_RecordInfo), ctypes.c_void_p, _sz], _i32),
    "rs_subscription_close": (1, [_u64], _i32),
    # ABI 2: statistics.
    "rs_abi_version": (2, [], _u32),
    "rs_session_stats": (2, [_u64, _p(_SessionSnapshot)], _i32),
    "rs_hookpoint_stats": (2, [_u64, _u32, _p(_HookPointSnapshot), ctypes.c_char_p, _sz], _i32),
    "rs_destination_stats": (2, [_u64, _u32, _p(_DestinationSnapshot), ctypes.c_char_p, _sz], _i32),
    "rs_metrics_text": (2, [_u64, ctypes.c_char_p, _sz, _p(_sz)], _i32),
    "rs_metrics_port": (2, [_u64, _p(ctypes.c_uint16)], _i32),
    # ABI 4: probes.
    "rs_alert_poll": (4, [_u64, _u32, _p(_Alert)], _i32),
    "rs_alerts_dropped": (4, [_u64, _p(_u64)], _i32),
    "rs_probe_request": (4, [_u64, _cp, _u64, _p(_ProbeReport)], _i32),
    "rs_request_finish": (4, [_u64, _u64], _i32),
    "rs_note_cached": (4, [_u64, _u64, _u64, _u32, _u64], _i32),
    "rs_is_flagged": (4, [_u64, _u64, _p(ctypes.c_bool)], _i32),
    "rs_probe_flags": (4, [_u64, _p(_p(_u64)), _p(_sz)], _i32),
    "rs_probes_wait": (4, [_u64, _u32], _i32),
    "rs_probe_count": (4, [_u64, _p(_u32)], _i32),
    "rs_probe_stats": (4, [_u64, _u32, _p(_ProbeSnapshot), ctypes.c_char_p, _sz], _i32),
    # ABI 7: full mode for steps begun inside CUDA graphs.
    "rs_admit_graph_step": (7, [_u64, _u32, _u64], _i32),
    # ABI 8: the manifest's metadata.
    "rs_session_set_metadata": (8, [_u64, _cp, _cp], _i32),
    # ABI 9: rows of ended sequences in steps begun inside CUDA graphs.
    "rs_begin_step_graph_ended": (9, [_u64, _u64, _u64, _u32, _u32, _u32, _u64, _u32, _p(_i64), _u32, _u64], _i32),
    # ABI 10: the rows each request ran in a step begun inside a CUDA graph (the probes' coverage).
    "rs_note_step_rows": (10, [_u64, _p(_u64), _sz], _i32),
    # ABI 11: a step begun inside a CUDA graph that keeps some of its rows only.
    "rs_begin_step_graph_kept": (11, [_u64, _u64, _u64, _u32, _u32, _u32, _u64, _u64], _i32),
    # ABI 12: a graph-begun step's copy held out of the graph, launched after each replay.
    "rs_hold_step": (12, [_u64, _u32], _i32),
    "rs_launch_held": (12, [_u64, _u32, _u64], _i32),
    "rs_join_held": (12, [_u64, _u64], _i32),
}

#: The header's struct name of each ctypes struct.
STRUCTS = {"rs_counts": _Counts, "rs_record_info": _RecordInfo, "rs_sink_health": _SinkHealth,
           "rs_sink_failure_info": _SinkFailureInfo, "rs_session_snapshot": _SessionSnapshot,
           "rs_hookpoint_snapshot": _HookPointSnapshot, "rs_destination_snapshot": _DestinationSnapshot,
           "rs_alert": _Alert, "rs_probe_report": _ProbeReport, "rs_probe_snapshot": _ProbeSnapshot}


def _sized(struct_type):
    """A snapshot struct with ``struct_size`` set, as the C ABI asks."""
    v = struct_type()
    v.struct_size = ctypes.sizeof(struct_type)
    return v


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
    for name, (abi, args, res) in SIGNATURES.items():
        # A library older than the C ABI version that added a call lacks it: only the calls that need it fail
        # (_stats_lib, _probes_lib, ...); the first version's calls must all be there.
        f = getattr(lib, name) if abi == 1 else getattr(lib, name, None)
        if f is not None:
            f.argtypes = args
            f.restype = res
    _lib = lib
    return lib


def _lib_with(call: str):
    """The library, checked to have ``call``: one built before the C ABI version that added it (:data:`SIGNATURES`)
    lacks it, and only the calls that need it fail, naming what to do."""
    lib = _load()
    if not hasattr(lib, call):
        raise RingscopeError("RS_ERR_CONFIG", f"{library_path()} predates {call} (C ABI {SIGNATURES[call][0]}): rebuild "
                                              "it with `cargo build --release -p ringscope-ffi`")
    return lib


# The largest Python int an untyped call (`_untyped`) may pass for a 32-bit argument (ctypes passes it as a C int).
_I32_MAX = 2**31 - 1


def _untyped(call: str):
    """``call`` of the library as a ctypes function without ``argtypes``, or ``None`` where the library lacks it. For
    the calls made before every forward pass or graph replay: with ``argtypes``, ctypes converts each argument through
    its type's ``from_param`` — ~0.6 µs of the call's ~1.1 µs in a loop on a 2-core x86-64 machine, more when called
    cold. The caller must pass a ``ctypes.c_uint64`` for every 64-bit argument, and a Python ``int`` in
    0..=``_I32_MAX`` only for 32-bit ones (ctypes passes it as a C ``int``: the same bits as the ``u32`` the call
    takes)."""
    lib = _load()
    if not hasattr(lib, call):
        return None
    f = lib[call]  # a new function object: the library's own attribute keeps its argtypes
    f.restype = ctypes.c_int32
    return f


def _has_call(call: str) -> bool:
    """Whether the library has ``call`` (one built before the C ABI version that added it does not)."""
    return hasattr(_load(), call)


def _stats_lib():
    """The library, checked to have the statistics calls (C ABI 2)."""
    return _lib_with("rs_session_stats")


def _probes_lib():
    """The library, checked to have the probe calls (C ABI 4)."""
    return _lib_with("rs_alert_poll")


def _check(status: int) -> None:
    if status != 0:
        msg = _load().rs_last_error().decode("utf-8", "replace")
        raise RingscopeError(_STATUS.get(status, f"status {status}"), msg)
