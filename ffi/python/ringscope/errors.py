"""ringscope's exceptions: :class:`RingscopeError`, and one subclass per status of the C ABI (``rs_status`` in
``ffi/include/ringscope.h``), so that a caller can catch what it can handle::

    try:
        session = ringscope.Session(text)
    except ringscope.ConfigError as e:       # RS_ERR_CONFIG: the configuration was refused
        print(e.message)

``RingscopeError(status, message)`` builds the subclass of ``status`` (``RingscopeError("RS_ERR_IO", ...)`` is an
:class:`IoError`), so ``except RingscopeError`` and ``e.status`` keep working everywhere, whoever raised it.
"""

from typing import Dict, Type

__all__ = ["RingscopeError", "InvalidArgumentError", "InvalidHandleError", "ConfigError", "ClosedError", "StepError",
           "CaptureError", "CudaError", "IoError", "UnbalancedError", "WaitTimeoutError", "BufferTooSmallError",
           "EndedError", "PanicError", "SinkError", "NotSeenError", "StateError", "ERROR_FOR_STATUS"]


class RingscopeError(Exception):
    """A ringscope call failed. ``status`` is the C status name (e.g. ``RS_ERR_CAPTURE``), ``message`` says why.
    Constructed with a known status, it is an instance of that status's subclass (:data:`ERROR_FOR_STATUS`)."""

    status: str
    message: str

    def __new__(cls, status: str = "", message: str = "", *args, **kwargs):
        if cls is RingscopeError:
            cls = ERROR_FOR_STATUS.get(status, RingscopeError)
        return super().__new__(cls, status, message, *args, **kwargs)

    def __init__(self, status: str, message: str):
        super().__init__(f"{message} [{status}]")
        self.status = status
        self.message = message

    def __reduce__(self):
        # Pickled (multiprocessing, an engine's worker) as the arguments it was built from, not its formatted text.
        return (type(self), (self.status, self.message))


class InvalidArgumentError(RingscopeError):
    """``RS_ERR_INVALID_ARGUMENT``: an argument is unusable (bad value, wrong length or type); the message says
    which."""


class InvalidHandleError(RingscopeError):
    """``RS_ERR_INVALID_HANDLE``: the handle is zero, unknown, or of the wrong kind."""


class ConfigError(RingscopeError):
    """``RS_ERR_CONFIG``: the configuration is invalid (the message names the key), or what it needs is missing."""


class ClosedError(RingscopeError):
    """``RS_ERR_CLOSED``: the session is closed, or the subscription was."""


class StepError(RingscopeError):
    """``RS_ERR_STEP``: a capture or ``end_step`` outside a step, or ``begin_step`` while one is open."""


class CaptureError(RingscopeError):
    """``RS_ERR_CAPTURE``: a capture was refused or failed (wrong size, unknown hookpoint, ring full past the
    deadline in full mode, drain gone); counted where the message says so."""


class CudaError(RingscopeError):
    """``RS_ERR_CUDA``: the CUDA backend failed or was given bad device input (also full mode's deadline there; the
    message says)."""


class IoError(RingscopeError):
    """``RS_ERR_IO``: writing (or reading) files failed."""


class UnbalancedError(RingscopeError):
    """``RS_ERR_UNBALANCED``: at close, some records were neither exported nor counted as dropped."""


class WaitTimeoutError(RingscopeError):
    """``RS_ERR_TIMEOUT``: a wait (``flush``, ``probes_wait``, ...) ran out of time."""


class BufferTooSmallError(RingscopeError):
    """``RS_ERR_BUFFER_TOO_SMALL``: an output buffer is too small (the package sizes its own buffers)."""


class EndedError(RingscopeError):
    """``RS_ERR_ENDED``: a subscription's stream has ended (the session is closed and everything was delivered)."""


class PanicError(RingscopeError):
    """``RS_ERR_PANIC``: the library panicked (a bug; please report it); close the session."""


class SinkError(RingscopeError):
    """``RS_ERR_SINK``: full mode, a sink has failed (the message names it and the cause): captures and new steps
    are refused, since its records would be lost."""


class NotSeenError(RingscopeError):
    """``RS_NOT_SEEN``: a probe has no record of the request (none of its rows scored yet, or forgotten)."""


class StateError(RingscopeError):
    """``RS_ERR_STATE``: the handle belongs to another process (opened by the parent of a forked process)."""


#: The subclass raised for each status name.
ERROR_FOR_STATUS: Dict[str, Type[RingscopeError]] = {
    "RS_ERR_INVALID_ARGUMENT": InvalidArgumentError,
    "RS_ERR_INVALID_HANDLE": InvalidHandleError,
    "RS_ERR_CONFIG": ConfigError,
    "RS_ERR_CLOSED": ClosedError,
    "RS_ERR_STEP": StepError,
    "RS_ERR_CAPTURE": CaptureError,
    "RS_ERR_CUDA": CudaError,
    "RS_ERR_IO": IoError,
    "RS_ERR_UNBALANCED": UnbalancedError,
    "RS_ERR_TIMEOUT": WaitTimeoutError,
    "RS_ERR_BUFFER_TOO_SMALL": BufferTooSmallError,
    "RS_ERR_ENDED": EndedError,
    "RS_ERR_PANIC": PanicError,
    "RS_ERR_SINK": SinkError,
    "RS_NOT_SEEN": NotSeenError,
    "RS_ERR_STATE": StateError,
}
