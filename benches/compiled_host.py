"""The host's own work per call of a compiled Hugging Face decode step, plain and attached (runs on a CPU).

    python benches/compiled_host.py --out compiled_host.json     # needs torch, transformers, libringscope (no GPU)

`generate` with a static cache compiles the model's `__call__`. On a GPU that replays CUDA graphs, what a call costs
the host besides launching the graph is Python and dynamo's work around it: the guards of the cache entry (is this
the same model, tensor shapes, the StaticCache's attributes, ...), the module's call path, any frames compiled apart
(each hook on the model itself is one, with guards of its own), the side effects dynamo replays after the graph. This
measures it without a GPU and without the model's compute: the step is compiled with a backend that runs the graph
once and returns that output at every later call (as a replayed CUDA graph runs no Python), for a plain model, one
with no-op hooks on the model (`top_hooks`, where `attach` put its begin and end until session 38), one with a
no-op forward hook on every decoder layer (`layer_hooks`, where `attach` puts its residual captures) and an attached
one (residual of every layer, best-effort, host backend). Per variant: the time of a call of the compiled step
(`call_us`) and of one check of each compiled frame's guards on the step's own arguments (`check_us`), both the
median of `--repeats` rounds with the variants interleaved, and the differences from the plain model. Model: a
small Llama (hidden 64) with `--layers` decoder layers (what is measured depends on the module structure, not on
the widths). `--backend aot_replay` puts the replay behind AOTAutograd, whose runtime wrappers run around inductor's
compiled code at every call too (what is left then of a GPU call's host work is CUDA graph trees' replay and the
launch).
"""
import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import ringscope
import ringscope.torch as rt

VARIANTS = ("plain", "top_hooks", "layer_hooks", "attached")


def build(layers, variant):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    session = None
    if variant == "attached":
        session = ringscope.Session({"policy": {"mode": "best_effort"}})
        rt.attach(model, session, sites=("residual",))
    elif variant != "plain":
        add_noop_hooks(model, variant)
    return model, session


def add_noop_hooks(model, kind):
    """Hooks that do nothing where `attach` puts (or put) its own: ``top_hooks`` a forward pre-hook and hook (with
    kwargs) on the model, where attach put its begin and end until session 38; ``layer_hooks`` a forward hook on
    every decoder layer, as attach's residual captures. (Also hf_compiled_overhead.py's control models.)"""
    if kind == "top_hooks":
        model.register_forward_pre_hook(lambda module, args, kwargs: None, with_kwargs=True)
        model.register_forward_hook(lambda module, args, kwargs, output: None, with_kwargs=True)
    elif kind == "layer_hooks":
        for layer in model.model.layers:
            layer.register_forward_hook(lambda module, args, output: None)
    else:
        raise ValueError(f"no no-op hooks {kind!r} (top_hooks or layer_hooks)")


def replaying_backend(gm, example_inputs, **_):
    """A torch.compile backend that runs the graph once and returns that output at every later call: what is left of
    a call is the host's own work around the graph (dynamo's guards, the frames, the side effects it replays, hooks)
    — as when a GPU replays a recorded CUDA graph, whose kernels run no Python."""
    out = gm(*example_inputs)

    def replay(*args):
        return out
    return replay


def aot_replaying_backend(gm, example_inputs, **_):
    """:func:`replaying_backend` behind AOTAutograd, as inductor's code is: the functionalized graph (input mutations
    kept in it, as inductor keeps them) runs at the first call and its output is returned at every later call, and
    AOTAutograd's runtime wrappers — what a call of inductor's compiled code runs on the host around the graph besides
    CUDA graph trees' replay: the outputs that alias inputs made anew, the subclass and mutation handling — run at
    every call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw(graph, inputs):  # (called with fake tensors: the graph runs at the first real call)
        first = []

        def run(*args):
            if not first:
                first.append(graph(*args))
            return first[0]
        return make_boxed_func(run)
    return aot_autograd(fw_compiler=fw, keep_inference_input_mutations=True)(gm, example_inputs)


BACKENDS = {"replay": replaying_backend, "aot_replay": aot_replaying_backend}


def compiled_generate(model, backend=replaying_backend):
    """Runs a static-cache `generate` whose decode step is compiled with ``backend`` (:func:`replaying_backend`,
    :func:`aot_replaying_backend`) and returns the compiled step (as transformers made it), and the keyword arguments
    and output of its last call."""
    calls, compiled = [], []
    handed_out = model.get_compiled_call

    def get_compiled_call(config=None):
        inner = handed_out(config)
        compiled.append(inner)

        def call(*args, **kwargs):
            out = inner(*args, **kwargs)
            calls.append((kwargs, out))
            return out
        return call
    model.get_compiled_call = get_compiled_call
    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    gc = transformers.GenerationConfig(
        max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static",
        compile_config=transformers.CompileConfig(fullgraph=True, backend=backend))
    gc.compile_config._compile_all_devices = True
    try:
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    finally:
        del model.get_compiled_call
    if not calls:
        raise RuntimeError("generate made no call of a compiled step")
    return compiled[-1], calls[-1][0], calls[-1][1]


def check_passes(manager, frame_locals):
    """The guards must pass on these arguments (those the compiled step was called with)."""
    if not manager.check(frame_locals):
        raise RuntimeError(f"guards fail on the step's own arguments: {manager.check_verbose(frame_locals)}")


def time_checks(frames, repeats, per=200):
    """{variant: {frame: µs per check}}: every frame's check timed in turn, `per` checks at a time, `repeats` rounds
    (the variants interleaved, so that the machine's drift falls on all alike); the median over the rounds."""
    times = {v: {name: [] for name in fs} for v, fs in frames.items()}
    torch.set_grad_enabled(False)  # as generate calls the step (the guards check the grad mode)
    try:
        for _ in range(repeats):
            for v, fs in frames.items():
                for name, (manager, loc) in fs.items():
                    t = time.perf_counter()
                    for _ in range(per):
                        manager.check(loc)
                    times[v][name].append((time.perf_counter() - t) / per * 1e6)
    finally:
        torch.set_grad_enabled(True)
    return {v: {name: statistics.median(ts) for name, ts in fs.items()} for v, fs in times.items()}


def frame_locals(fn, values):
    code = fn.__code__
    loc = dict(zip(code.co_varnames[:code.co_argcount + (code.co_flags & 0x04 != 0) + (code.co_flags & 0x08 != 0)],
                   values))
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        loc[name] = cell.cell_contents
    return loc


def frames_of(layers, variant, backend=replaying_backend):
    """Compiles a `generate` of the variant's model and returns ({frame: (guard manager, frame arguments)}, the
    session to close). The variants' models are of one class, so their forward passes share a code object: each
    compiles an entry of its own (the model is guarded by identity), the newest first in its cache — and dynamo's
    caches are not reset in between, which would leave the earlier variants' managers checking nothing."""
    model, session = build(layers, variant)
    step, kwargs, output = compiled_generate(model, backend)
    frames = {}
    forward = getattr(model.forward, "__func__", model.forward)  # the class's, or an instance attribute (attach's)
    entries = _debug_get_cache_entry_list(forward.__code__)
    if not entries:
        raise RuntimeError(f"{variant}: no compiled entry of the forward pass")
    frames["forward"] = entries[0].guard_manager, frame_locals(forward, (model, (), kwargs))  # the last one used
    hooks = [("pre_hook", h, (model, (), kwargs)) for h in model._forward_pre_hooks.values()] + \
            [("hook", h, (model, (), kwargs, output)) for h in model._forward_hooks.values()]
    for kind, hook, args in hooks:
        fn = getattr(hook, "__func__", hook)
        values = ((hook.__self__,) if hasattr(hook, "__self__") else ()) + args
        entries = _debug_get_cache_entry_list(fn.__code__)
        if entries:
            frames[f"{kind} {fn.__name__}"] = entries[0].guard_manager, frame_locals(fn, values)
    torch.set_grad_enabled(False)
    try:
        for manager, loc in frames.values():
            check_passes(manager, loc)
    finally:
        torch.set_grad_enabled(True)
    return frames, (step, kwargs), session


def time_calls(steps, repeats, per=200):
    """{variant: µs per call of the compiled step}: `per` calls at a time after one untimed call (which puts the
    variant's cache entry first where the variants' models share a forward pass), the variants interleaved, `repeats`
    rounds, the median."""
    times = {v: [] for v in steps}
    with torch.no_grad():
        for _ in range(repeats):
            for v, (step, kwargs) in steps.items():
                step(**kwargs)
                t = time.perf_counter()
                for _ in range(per):
                    step(**kwargs)
                times[v].append((time.perf_counter() - t) / per * 1e6)
    return {v: statistics.median(ts) for v, ts in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="compiled_host.json")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=50, help="rounds of the interleaved timing")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--backend", choices=tuple(BACKENDS), default="replay",
                    help="replay: the graph's output returned at every call (dynamo's own work only); aot_replay: the "
                         "same behind AOTAutograd's runtime wrappers, as inductor's compiled code runs")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: no variant {v} (one of {', '.join(VARIANTS)})")
    if args.layers < 1 or args.repeats < 1:
        ap.error("--layers and --repeats must be at least 1")
    results = {"torch": torch.__version__, "transformers": transformers.__version__, "layers": args.layers,
               "backend": args.backend}
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(variants))
    torch._dynamo.reset()
    frames, steps, sessions = {}, {}, []
    try:
        for v in variants:
            frames[v], steps[v], session = frames_of(args.layers, v, BACKENDS[args.backend])
            sessions.append(session)
        timed = time_checks(frames, args.repeats)
        calls = time_calls(steps, args.repeats)
    finally:
        for session in sessions:
            if session is not None:
                session.close()
    for v in variants:
        results[v] = {name: {"check_us": round(us, 2)} for name, us in timed[v].items()}
        results[v]["total_check_us"] = round(sum(timed[v].values()), 2)
        results[v]["frames"] = len(timed[v])
        results[v]["call_us"] = round(calls[v], 2)
    if "plain" in timed:
        for v in variants:
            results[v]["check_more_than_plain_us"] = round(results[v]["total_check_us"]
                                                           - results["plain"]["total_check_us"], 2)
            results[v]["call_more_than_plain_us"] = round(results[v]["call_us"] - results["plain"]["call_us"], 2)
    for v in variants:
        print(json.dumps({v: results[v]}), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
