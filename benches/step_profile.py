"""Where a capture's cost goes, measured on the GPU's own clock: the PyTorch profiler's trace (CUPTI) of Hugging Face
decode steps recorded as CUDA graphs, with and without ringscope, cut into steps (benches/gpu_trace.py).

    python benches/step_profile.py --out profile.json   # needs CUDA, torch, transformers, libringscope + NVRTC

Comparing step times between variants resolves ~0.1–2% (docs/gpu-benchmarks.md: two recordings of the same plain
step differ that much). The GPU's own record of each step does not drift with the host: per step, the GPU time of
the step's kernels (``kernel_us``), the union of their intervals (``busy_us``), the first start to the last end
(``span_us``) and the host's wall time of the step (``wall_us``, synchronised every step), and per kernel name what
a variant adds to the plain step. So a capture's cost splits into what it adds on the GPU (its kernels, and whether
the model's own kernels got slower beside the drain's copies) and what it adds elsewhere (host, driver).

Decode (1B-shape Llama of hf_overhead.py, 16 layers, bf16, StaticCache, one step recorded as a CUDA graph; batch 1, 8,
64): (plain) no capture; (resid) the residual of all 16 layers, best-effort, Parquet; (resid_copy_at_end) the same
with the step's copy at its end instead of beside the LM head on a side stream; (plain_keep) no capture, but the
recording keeps every layer's output alive to its end as deferred captures do (the graph's memory layout alone);
(full) the same as resid in full mode,
``admit_graph_step`` before every replay; (attn) q/k/v of layers 0, 5, 10, 15, best-effort, Parquet. CUDA ring 2 GiB,
``defer_captures``; the variants are profiled interleaved, in blocks of steps (``profile_interleaved``). Prefill
(eager, 8 × 512 tokens, the residual of all 16 layers, ring 8 GiB, 8 sink threads): plain, full mode without a sink,
best-effort into Parquet, best-effort into Arrow IPC — whether the IPC sink's slowdown of the model is on the GPU (its kernels slower) or on the
host (the GPU waiting for launches).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_trace  # noqa: E402
from full_mode_decode import session as full_mode_session  # noqa: E402
from hf_overhead import DEV, Decoder, build_model  # noqa: E402

import ringscope.torch as rt  # noqa: E402

ATTN_LAYERS = [0, 5, 10, 15]


def session(root, name, mode="best_effort", export="parquet", capacity="2 GiB"):
    """full_mode_decode.py's session (CUDA ring, deferred captures, 8 sink threads), best-effort unless said."""
    return full_mode_session(root, name, mode, export=export, capacity=capacity)


def decoder_with(model, s, batch, max_len, early_copy=True, **attach):
    """A Decoder recorded with ``attach(model, s, **attach)``; ``early_copy=False``: the step's deferred copy at the
    step's end on the engine's stream instead of early on a side stream (``attach`` submits it after the last captured
    layer, so it runs beside the LM head)."""
    att = rt.attach(model, s, **attach)
    submit = rt._submit_captures_raw  # what attach's hook after the last captured layer calls (not compiled)
    if not early_copy:
        rt._submit_captures_raw = lambda *args: None
    try:
        return Decoder(model, batch, max_len)
    finally:
        rt._submit_captures_raw = submit
        att.detach()


def decoder_keeping(model, batch, max_len):
    """A plain Decoder (no capture) whose recording keeps every decoder layer's output alive until it ends, as deferred
    captures keep the tensors their copy reads at the step's end: whether the model's own kernels run slower in the
    capture graphs because of the graph's memory layout alone."""
    kept = []
    hooks = [layer.register_forward_hook(lambda m, a, o: kept.append(o[0] if isinstance(o, tuple) else o))
             for layer in model.model.layers]
    try:
        return Decoder(model, batch, max_len)
    finally:
        for h in hooks:
            h.remove()
        kept.clear()


def profile_steps(step, n, warm=10):
    """``n`` steps of ``step`` (each synchronised) under the profiler; the summary of the trace's steps."""
    for _ in range(warm):
        step()
    torch.cuda.synchronize()

    def one():
        step()
        torch.cuda.synchronize()
    marked = gpu_trace.marked(one)

    def run():
        for _ in range(n + 2):
            marked()
    return gpu_trace.summary(gpu_trace.steps_of(gpu_trace.profiled(run)))


def profile_interleaved(steppers, n, block=5, warm=10):
    """``n`` steps (at least) of each of ``steppers`` (name: step function; each step synchronised) in one profiler
    trace: blocks of ``block`` steps per variant, the variants' order rotated every round, so that a drift of the GPU
    or the host during the run falls on every variant alike. (Profiled one after another, session 31 saw every
    variant after the first, a second plain recording included, run 20–29 µs slower per step at B = 1.) Each block's
    first step is left out: the drain may still be copying the previous variant's captures. The summary of each
    variant's steps, by name."""
    assert block >= 2 and not any(n == "end" or n.endswith("/first") for n in steppers), "labels of its own"
    for step in steppers.values():
        for _ in range(warm):
            step()
    torch.cuda.synchronize()

    def synced(step):
        def one():
            step()
            torch.cuda.synchronize()
        return one
    names = list(steppers)
    kept = {name: gpu_trace.marked(synced(steppers[name]), label=name) for name in names}
    first = {name: gpu_trace.marked(synced(steppers[name]), label=name + "/first") for name in names}
    end = gpu_trace.marked(lambda: None, label="end")  # the last step's window ends here
    rounds = -(-n // (block - 1))

    def run():
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                first[name]()
                for _ in range(block - 1):
                    kept[name]()
        end()
    events = gpu_trace.profiled(run)
    return {name: gpu_trace.summary(gpu_trace.steps_of(events, skip_first=0, label=name)) for name in names}


def decode(model, batch, steps, root, results):
    max_len = 16 + 4 * (steps + 20) + 16
    sessions = {"resid": session(root, f"b{batch}-resid"), "full": session(root, f"b{batch}-full", mode="full"),
                "attn": session(root, f"b{batch}-attn"), "resid_copy_at_end": session(root, f"b{batch}-resid-end")}
    decs = {"plain": Decoder(model, batch, max_len),
            "resid": decoder_with(model, sessions["resid"], batch, max_len, sites=["residual"]),
            "resid_copy_at_end": decoder_with(model, sessions["resid_copy_at_end"], batch, max_len, early_copy=False,
                                              sites=["residual"]),
            "full": decoder_with(model, sessions["full"], batch, max_len, sites=["residual"]),
            "attn": decoder_with(model, sessions["attn"], batch, max_len, sites=["attn_q", "attn_k", "attn_v"],
                                 layers=ATTN_LAYERS),
            "plain_keep": decoder_keeping(model, batch, max_len),
            "plain_2": Decoder(model, batch, max_len)}

    def stepper(name):
        d = decs[name]
        admit = sessions["full"].admit_graph_step if name == "full" else None

        def step():
            if admit is not None:
                admit()
            d.graph.replay()
            d.advance()
        return step
    row = profile_interleaved({name: stepper(name) for name in decs}, steps)
    for name, s in sessions.items():
        s.flush(timeout=600)
        totals = s.close()
        row[name]["totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
    row["diff"] = {name: gpu_trace.diff(row["plain"], row[name]) for name in decs if name != "plain"}
    results[f"decode_b{batch}"] = row
    brief = {name: {k: round(v, 2) for k, v in d.items() if k != "by_name"} for name, d in row["diff"].items()}
    print(json.dumps({f"decode_b{batch}": {"plain": {k: row["plain"][k] for k in ("wall_us", "busy_us", "n")},
                                          "diff_p50": brief}}, indent=1), flush=True)


def prefill(model, root, results, batch=8, tokens=512, n=8):
    ids = torch.randint(0, 1000, (batch, tokens), device=DEV)

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    row = {}
    variants = (("plain", None, None), ("full_no_sink", "full", None), ("parquet", "best_effort", "parquet"),
                ("arrow_ipc", "best_effort", "arrow_ipc"), ("plain_2", None, None))
    for name, mode, fmt in variants:
        s = session(root, f"prefill-{name}", mode=mode, export=fmt, capacity="8 GiB") if mode else None
        att = rt.attach(model, s, sites=["residual"]) if s is not None else None
        row[name] = profile_steps(run, n, warm=2)
        if s is not None:
            att.detach()
            s.flush(timeout=600)
            totals = s.close()
            row[name]["totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
    row["diff"] = {name: gpu_trace.diff(row["plain"], row[name]) for name, *_ in variants if name != "plain"}
    results["prefill"] = row
    brief = {name: {k: round(v, 1) for k, v in d.items() if k != "by_name"} for name, d in row["diff"].items()}
    print(json.dumps({"prefill": {"plain": {k: row["plain"][k] for k in ("wall_us", "busy_us", "n")},
                                  "diff_p50": brief}}, indent=1), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="step_profile.json")
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes; empty: no decode")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "step-profile"))
    ap.add_argument("--no-prefill", action="store_true")
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = build_model(16)
    for b in (int(x) for x in args.batches.split(",") if x):
        decode(model, b, args.steps, args.dir, results)
        shutil.rmtree(args.dir, ignore_errors=True)
    if not args.no_prefill:
        prefill(model, args.dir, results)
        shutil.rmtree(args.dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
