"""A test-only SGLang plugin (tests/sglang, on the engine processes' path): makes a stop signal land in a chosen
place of the scheduler on purpose instead of by luck. Off unless ``RINGSCOPE_SGLANG_TEST_SIGNAL_AT`` names a place:

- ``idle``: the scheduler's idle housekeeping (``Scheduler.on_idle``), outside SGLang's checks;
- ``check``: inside SGLang's own memory checks (``SchedulerInvariantChecker._check_all_pools``, run when idle);
- ``busy``: inside a forward pass of the model (``LlamaForCausalLM.forward``), with a request in flight.

Once the test driver creates ``<mark>.arm`` (``RINGSCOPE_SGLANG_TEST_MARK`` = mark), the first time the scheduler
reaches the place it writes ``<mark>`` (its pid) and stays there for ``HOLD_S`` seconds: the driver, polling for the
mark, sends its signal while the scheduler is inside."""

import os
import time

PLACES = ("idle", "check", "busy")
HOLD_S = 3.0


def _hold(place: str) -> None:
    mark = os.environ.get("RINGSCOPE_SGLANG_TEST_MARK", "")
    if os.environ.get("RINGSCOPE_SGLANG_TEST_SIGNAL_AT") != place or not os.path.exists(mark + ".arm") \
            or os.path.exists(mark):
        return
    with open(mark + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {place}\n")
    os.replace(mark + ".tmp", mark)
    end = time.monotonic() + HOLD_S
    while time.monotonic() < end:  # the signal's handler runs in here
        time.sleep(0.005)


def _before(cls, name: str, place: str) -> None:
    orig = cls.__dict__[name]

    def wrapped(*args, **kwargs):
        _hold(place)
        return orig(*args, **kwargs)

    wrapped.__wrapped__ = orig
    setattr(cls, name, wrapped)


def register() -> None:
    place = os.environ.get("RINGSCOPE_SGLANG_TEST_SIGNAL_AT")
    if not place:
        return
    if place not in PLACES:
        raise ValueError(f"RINGSCOPE_SGLANG_TEST_SIGNAL_AT={place!r}: give one of {PLACES}")
    if getattr(register, "done", False):
        return
    register.done = True
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where a stuck process is
    if place == "idle":
        from sglang.srt.managers.scheduler import Scheduler

        _before(Scheduler, "on_idle", "idle")
    elif place == "check":
        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

        _before(SchedulerInvariantChecker, "_check_all_pools", "check")
    else:
        from sglang.srt.models.llama import LlamaForCausalLM

        _before(LlamaForCausalLM, "forward", "busy")
