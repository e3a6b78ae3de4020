"""What ``attach`` costs a Hugging Face model run eagerly (no CUDA graph, no torch.compile): the decode step of the
1B-shaped Llama of benches/hf_overhead.py over a StaticCache, plain and attached, in one process.

    python benches/eager_overhead.py --out eager.json   # needs CUDA, torch, transformers, libringscope + NVRTC

Eagerly the hooks run on the host at every step (begin the step, one capture call per hooked module, end it), and
at small batches the step is host-bound, so their host time is the cost. Variants, each timed twice in the order
plain, attached, attached, plain (each attached run its own session): ``attach(sites=["residual"])`` on all 16
layers, CUDA ring 2 GiB, best-effort, deferred captures, no sink. Per batch size: the median of ``--steps`` steps, each
synchronised, then the mean of as many pipelined (one sync at the end; hf_overhead.time_steps); and a fifth,
instrumented run: the host time per step of attach's begin, captures and end
(``host_ms_per_step``).
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_overhead import PROMPT, Decoder, build_model, time_steps  # noqa: E402

import ringscope  # noqa: E402
import ringscope.torch as rt  # noqa: E402


class HostParts:
    """Host time of attach's parts during eager steps, by wrapping them (perf_counter around each call; the wrappers'
    own cost, ~1 µs a call, is in the numbers): the step's begin (the model's pre-forward hook), each capture (the
    hooks' ``_capture``; of it, the call into ringscope ``_capture_now``) and the end (the model's forward hook). What
    the step costs beyond these is torch's hook dispatch and what the GPU does differently."""

    PARTS = (("begin", rt.Attachment, "_begin"), ("capture", rt.Attachment, "_capture"),
             ("end", rt.Attachment, "_end"), ("capture_now", rt, "_capture_now"))

    def __init__(self):
        self.ms = {name: 0.0 for name, *_ in self.PARTS}
        self.saved = []

    def __enter__(self):
        for name, owner, attr in self.PARTS:
            orig = getattr(owner, attr)
            self.saved.append((owner, attr, orig))
            setattr(owner, attr, self._timed(name, orig))
        return self

    def __exit__(self, *exc):
        for owner, attr, orig in reversed(self.saved):
            setattr(owner, attr, orig)

    def reset(self):
        for k in self.ms:  # in place: the wrappers hold this dict
            self.ms[k] = 0.0

    def _timed(self, name, fn):
        ms = self.ms

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                ms[name] += (time.perf_counter() - t) * 1e3
        return timed


class _Attached:
    """A best-effort CUDA session (2 GiB ring, deferred captures, no sink) with ``attach(sites=["residual"])`` on
    ``model`` while the block runs; ``totals``: the session's accounting once closed."""

    def __init__(self, model):
        self.model, self.totals = model, None

    def __enter__(self):
        self.session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "2 GiB", "defer_captures": True},
                                          "policy": {"mode": "best_effort"}})
        self.att = rt.attach(self.model, self.session, sites=["residual"])
        return self

    def __exit__(self, *exc):
        self.att.detach()
        self.totals = self.session.close()


def attached(model, on):
    """``_Attached(model)`` if ``on``, else a block without ringscope (``as`` gives None)."""
    return _Attached(model) if on else contextlib.nullcontext()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="eager_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches: comma-separated batch sizes, got {args.batches!r}")
    if not batches or min(batches) < 1:
        ap.error(f"--batches: batch sizes of at least 1, got {args.batches!r}")
    if args.steps < 2:
        ap.error(f"--steps: at least 2 steps per run, got {args.steps}")
    model = build_model(16)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    warm = 5
    for batch in batches:
        # Five runs of warm-up, synchronised and pipelined steps, each at the next position (and the decoder's three
        # warm-up passes, which a StaticCache counts too).
        d = Decoder(model, batch, PROMPT + 3 + 5 * (warm + 2 * args.steps) + 8, record=False)

        def step():
            with torch.no_grad():
                d._forward()
            d.advance()
        row = {}
        for name in ("plain", "attached", "attached_2", "plain_2"):  # ABBA: a linear drift falls on both alike
            with attached(model, name.startswith("attached")) as s:
                synced, pipelined = time_steps(step, args.steps, warm=warm, raw=True)
                row[name] = {"median_ms": statistics.median(synced), "pipelined_ms": pipelined}
            if s is not None:
                row[name]["totals"] = {k: s.totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
        # Where the attached step's host time goes (a fifth run, instrumented; attach after the wrappers are in).
        # The synchronised steps' parts: from the start of that phase to the start of the next.
        synced_ms = {}
        with HostParts() as parts, attached(model, True):
            def on_phase(phase):
                if phase == "synced":
                    parts.reset()
                elif phase == "pipelined":
                    synced_ms.update(parts.ms)
            time_steps(step, args.steps, warm=warm, on_phase=on_phase)
        row["host_ms_per_step"] = {k: v / args.steps for k, v in synced_ms.items()}
        plain = statistics.mean(row[k]["median_ms"] for k in ("plain", "plain_2"))
        row["overhead"] = statistics.mean(row[k]["median_ms"] for k in ("attached", "attached_2")) / plain - 1
        row["resolution"] = abs(row["plain_2"]["median_ms"] / row["plain"]["median_ms"] - 1)
        results[f"batch_{batch}"] = row
        print(json.dumps({f"batch_{batch}": row}), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
