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
    with ringscope.Session('[export]\nparquet = true\ndir = "out"\nrun_id = "demo"') as s:
        hp = s.register("layers.0.resid", site="residual", layer=0, dtype="f32", row_width=4)
        s.begin_step(0, request_ids=[7, 9], positions=[17, 0])
        s.capture(hp, np.ones((2, 4), dtype=np.float32))
        s.end_step()
    dump = ringscope.read_dump("out/demo")            # numpy arrays, one entry per hookpoint
    lost = ringscope.read_events("out/demo")          # what was dropped, when and why (empty: nothing)
"""

# The package's floors (each module's docstring says what it holds): errors.py (RingscopeError and one subclass per
# status), _abi.py (the C ABI: structs, signatures, loading; with session.py the only caller of rs_*), _args.py (value
# checks), dtypes.py, session.py (Session, subscriptions, alerts, TOML), dump.py (read_dump, read_events), attention.py (attention_pattern), probe.py
# (probe files, calibration retention), stream.py, torch.py (PyTorch / Hugging Face), _engine.py with vllm.py and
# sglang.py (the engine plugins). This file only re-exports.

from ._abi import PROBE_MAX_OUTPUTS, library_path
from .attention import AttentionPattern, attention_metadata, attention_pattern
from ._args import MAX_TIMEOUT_S
from .dtypes import DTYPE_CODES, ROWSCALED, as_float32, dequantize_rowscaled
from .dump import EVENT_COLUMNS, EVENTS_DIR, read_dump, read_events
from .errors import (BufferTooSmallError, CaptureError, ClosedError, ConfigError, CudaError, EndedError,
                     InvalidArgumentError, InvalidHandleError, IoError, NotSeenError, PanicError, RingscopeError,
                     SinkError, StateError, StepError, UnbalancedError, WaitTimeoutError)
from .probe import calibration_retention, save_probe
from .session import Alert, Record, Session, Subscription
# Not public, kept where benchmarks and tests reach for them: the library, torch's current stream, the TOML reader.
from ._abi import _load  # noqa: F401
from .session import _current_stream, _toml  # noqa: F401

__all__ = ["Session", "Subscription", "Record", "Alert", "read_dump", "read_events", "attention_pattern",
           "attention_metadata", "AttentionPattern", "save_probe",
           "calibration_retention", "as_float32", "dequantize_rowscaled", "library_path", "EVENTS_DIR",
           "EVENT_COLUMNS", "DTYPE_CODES", "ROWSCALED", "MAX_TIMEOUT_S", "PROBE_MAX_OUTPUTS",
           "RingscopeError", "InvalidArgumentError", "InvalidHandleError", "ConfigError", "ClosedError", "StepError",
           "CaptureError", "CudaError", "IoError", "UnbalancedError", "WaitTimeoutError", "BufferTooSmallError",
           "EndedError", "PanicError", "SinkError", "NotSeenError", "StateError"]
