"""Overhead of `attach()` on the path most users take: Hugging Face `generate` with a static cache, whose decode step
transformers compiles with torch.compile (mode "reduce-overhead": inductor + CUDA graph trees).

    python benches/hf_compiled_overhead.py --out results.json   # needs CUDA, torch, transformers, libringscope + NVRTC

Model: the 1B-shaped Llama of hf_overhead.py (16 layers, hidden 2048, random bf16 weights, no download), three times
with the same weights: two plain (the second one's difference from the first is the resolution; the `generate` part
interleaves all three), one with ringscope attached (`ring.backend = "cuda"`, best-effort,
`ring.defer_captures = true`, `attach(sites=["residual"])`, all 16 layers). Measured in this one process:
  * decode step: every call of transformers' compiled step inside `generate(..., max_new_tokens=64)` with a static
    cache, synchronised before and after (median and min over all calls of all rounds), both models interleaved over
    several rounds; batch 1, 8, 64. By default each model keeps one StaticCache per batch size and resets it before
    each `generate`, as a server does (`--cache fresh`: a new one per call, `cache_implementation="static"` -- then
    CUDA graph trees record the step again in every `generate`, with or without ringscope, and the host's time per
    step grows with the number of `generate` calls made so far, which makes A/B comparisons depend on call order). Also: whether any step's ringscope calls ran in
    Python (they must all be replayed from the graph), inductor's cudagraph_skips, ringscope's accounting, and per
    timed `generate` what CUDA graph trees did (graphs recorded, invariant checks per call, why recorded graphs did
    not match: the host-side cost of a compiled step grows with the recorded graphs it checks);
    With `--controls top_hooks,layer_hooks`, two more models are timed in the same rotation: not attached, hooked
    like an attached one with hooks that do nothing — how far they differ from the plain model is how much a compiled
    model's step time varies without any capture (`spread_median_pct`; on an H100 -3% to +5%, more than the
    two plain models' difference alone); `attached_off` adds a model attached like the measured one with every
    hookpoint disabled (nothing published, nothing drained; not part of the spread: compared with the attached model
    too, `vs_ringscope_median_pct`);
  * correctness: a compiled `generate` of two requests on the attached model, every captured row against an eager
    `output_hidden_states` pass over the same tokens on the plain model (bf16: the compiled kernels round
    differently, so the error is reported, not required to be zero), request ids and positions checked exactly;
  * `--parts profile`: where a step's time goes (kernels under torch.profiler, the host's Python under cProfile);
  * `--parts hostapi`: the host's CUDA API calls and aten ops per step under torch.profiler, plain / attached /
    attached with every hookpoint disabled (nothing published: the drain idle).
"""
import argparse
import collections
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import numpy as np
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compiled_host import add_noop_hooks  # noqa: E402
from hf_overhead import DEV, PROMPT, build_model, cuda_session, run_parts  # noqa: E402

import ringscope  # noqa: E402
import ringscope.torch as rt  # noqa: E402


class GraphTreeCounters:
    """What CUDA graph trees did, counted by wrapping two of their methods (torch 2.11's names; without them the
    counts stay empty): graphs recorded, invariant checks of recorded graphs by outcome (each call of a compiled step
    checks the recorded graphs of its function until one matches: more stale recordings, more host time per call),
    and the reasons of mismatches (which input's address changed), most common first."""

    def __init__(self):
        self.recorded = 0
        self.checks = collections.Counter()
        self.reasons = collections.Counter()
        try:
            from torch._inductor import cudagraph_trees as ct
            node, manager = ct.CUDAGraphNode, ct.CUDAGraphTreeManager
            check, record = node.check_invariants, manager.record_function
        except (ImportError, AttributeError):
            return
        counters_ = self

        def check_invariants(node_self, inputs):
            status, logger = check(node_self, inputs)
            counters_.checks[str(status).rsplit(".", 1)[-1]] += 1
            # torch 2.11's statuses print as descriptions ("static input data pointer changed"), not their names
            if getattr(status, "name", str(status)) != "SUCCESS":
                try:
                    counters_.reasons[" ".join(str(logger()).split())[:700]] += 1
                except Exception as e:  # a diagnostic: never fail the benchmark over it
                    counters_.reasons[f"(reason not available: {type(e).__name__})"] += 1
            return status, logger

        def record_function(manager_self, *args, **kwargs):
            counters_.recorded += 1
            return record(manager_self, *args, **kwargs)

        node.check_invariants, manager.record_function = check_invariants, record_function

    def snapshot(self):
        return self.recorded, self.checks.copy()

    def since(self, snap, calls):
        """Counts since `snap`, and invariant checks per call of the compiled step over `calls` calls."""
        recorded, checks = snap
        diff = self.checks - checks
        return {"graphs_recorded": self.recorded - recorded, "invariant_checks": dict(diff),
                "invariant_checks_per_call": round(sum(diff.values()) / calls, 2) if calls else None}


GRAPH_TREES = None  # a GraphTreeCounters once main() has installed it

# "reuse": each model decodes every batch size into one StaticCache of its own, reset before each `generate` (its
# tensors keep their addresses, so CUDA graph trees replay the graphs recorded once). "fresh": `generate` builds a new
# StaticCache per call (`cache_implementation="static"`), whose new addresses make CUDA graph trees record the step
# again in every `generate` -- for any model -- and every later call of the step checks all the stale recordings
# first, so the host's time per step grows with the number of `generate` calls made so far in the process.
CACHE_MODE = "reuse"
SYNC = torch.cuda.synchronize  # what each timed call waits for (--sync)
PARTS = ("correctness", "generate", "profile", "hostapi")
_CACHES = {}


def _cache_kwargs(model, batch, new):
    """`generate` keyword arguments for the cache of `model` at `batch` rows (see CACHE_MODE)."""
    if CACHE_MODE == "fresh":
        return {"cache_implementation": "static"}
    from transformers import StaticCache
    from transformers.generation import utils as gen_utils
    key = (id(model), batch, PROMPT + new)
    cache = _CACHES.get(key)
    if cache is None:
        cache = _CACHES[key] = StaticCache(config=model.config, max_cache_len=PROMPT + new)
    cache.reset()
    # transformers 5.24 renamed generate's `past_key_values` to `cache` (the old name is deprecated)
    name = "cache" if "cache" in getattr(gen_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
    return {name: cache}


NEW = 64  # tokens each timed generate makes: the prefill's first and NEW - 1 compiled decode steps


def decode_step_times(model, batch, new=NEW, gpu_times=None, profiler=None, host_times=None, graph_stats=None,
                      host_profile=None):
    """Per decode step of `generate` with a static cache (see CACHE_MODE) as a user calls it: transformers compiles
    the step (`model.get_compiled_call`: torch.compile, mode "reduce-overhead", CUDA graph trees); each call of that
    compiled step is timed here, synchronised before and after (the prefill, not compiled, is not a step here).
    `gpu_times` (a list): also the GPU's time between CUDA events recorded before and after each call.
    `profiler`: a torch.profiler started before the first timed call and stopped when `generate` returns.
    `host_times` (a list): the GPU is kept busy (a sleep kernel) while the host calls the step, so that the CUDA events
    time the GPU's work alone (into `gpu_times`) and the host's time to return from the call goes into `host_times`.
    `graph_stats` (a list): gets what CUDA graph trees did during the timed `generate` (GraphTreeCounters.since).
    `host_profile` (a cProfile.Profile): enabled around each call of the compiled step from the third on (the Python
    that runs on the host during the call: guards, hooks, CUDA graph trees' replay)."""
    ids = torch.randint(0, 1000, (batch, PROMPT), device=DEV)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0)
    kept_before = {id(k): len(k) for k in (gpu_times, host_times) if k is not None}
    with torch.no_grad():
        model.generate(ids, **kw, **_cache_kwargs(model, batch, new))  # compiles and records
        times = []
        # The timer goes around what `generate` calls each step: the compiled step as `get_compiled_call` hands it
        # out -- in full mode wrapped by the attachment, which admits the step first (that time is counted too).
        had = vars(model).get("get_compiled_call")
        handed_out = model.get_compiled_call

        def get_compiled_call(config=None):
            inner = handed_out(config)

            def timed(*args, **kwargs):
                return _timed_call(inner, args, kwargs)
            return timed

        def _timed_call(inner, args, kwargs):
            SYNC()
            if profiler is not None and len(times) == 2:
                profiler.start()
            t = time.perf_counter()
            if gpu_times is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if host_times is not None:
                    torch.cuda._sleep(5_000_000)  # a few ms: longer than the host takes to launch the step
                start.record()
            h = time.perf_counter()
            if host_profile is not None and len(times) >= 2:
                host_profile.enable()
                out = inner(*args, **kwargs)
                host_profile.disable()
            else:
                out = inner(*args, **kwargs)
            if host_times is not None:
                host_times.append((time.perf_counter() - h) * 1e3)
            if gpu_times is not None:
                end.record()
            SYNC()
            times.append((time.perf_counter() - t) * 1e3)
            if gpu_times is not None:
                gpu_times.append(start.elapsed_time(end))
            return out
        snap = GRAPH_TREES.snapshot() if GRAPH_TREES is not None else None
        model.get_compiled_call = get_compiled_call
        try:
            model.generate(ids, **kw, **_cache_kwargs(model, batch, new))
        finally:
            if had is None:
                del model.get_compiled_call
            else:
                model.get_compiled_call = had
            if graph_stats is not None and snap is not None:
                graph_stats.append(GRAPH_TREES.since(snap, len(times)))
            if profiler is not None and len(times) > 2:  # started at the third call
                torch.cuda.synchronize()
                profiler.stop()
    for kept in (gpu_times, host_times):
        if kept is not None:  # this call's first two, as for `times`
            del kept[kept_before[id(kept)]:kept_before[id(kept)] + 2]
    return times[2:]  # the first calls of a new generate may re-record


def host_functions(prof, calls):
    """Per call: {"file:line(function)": (own time in µs, calls)} of a cProfile run (its own time: without callees;
    built-in calls are entries of their own)."""
    out = {}
    for (path, line, func), (_, ncalls, tottime, _, _) in pstats.Stats(prof).stats.items():
        key = f"{os.path.basename(path)}:{line}({func})"  # (two files of one name: their entries add up)
        was = out.get(key, (0.0, 0.0))
        out[key] = (was[0] + tottime * 1e6 / calls, was[1] + ncalls / calls)
    return out


def profile_steps(plain, attached_model, batches, results, top=14):
    """Where a compiled decode step's time goes: plain, attached at every layer, attached at layer 0 only. For each,
    per call of the compiled step: wall time and GPU time (CUDA events around the call; then again with the GPU kept
    busy while the host launches the step: the GPU's work alone, and the host's time to return), medians; the kernels of
    a `generate` under torch.profiler from its third compiled step on (the eager work `generate` does between steps
    included: the same for all three), as device microseconds per step by kernel name (the largest `top`, and every
    kernel whose time per step differs from the plain model's by more than 2 us); and the Python the host runs during
    each call, under cProfile (another `generate`: the call's own time per function, the largest 25, and every
    function whose time per call differs from the plain model's by more than 3 us — cProfile's own cost, which grows
    with the number of Python calls, is in these numbers: the attached model's differences are inflated by it)."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(prof, steps):
        per = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                was = per.get(e.key[:90], (0.0, 0.0))
                per[e.key[:90]] = (was[0] + t / steps, was[1] + e.count / steps)
        return per

    for batch in batches:
        out = {}
        for variant, layers in (("plain", None), ("all layers", "all"), ("layer 0 only", [0])):
            model, session, att = plain if layers is None else attached_model, None, None
            if layers is not None:
                session = cuda_session(capacity="1 GiB", defer_captures=True)
                att = rt.attach(model, session, sites=["residual"], layers=None if layers == "all" else layers)
            try:
                gpu, wall, gpu_alone, host, graphs = [], [], [], [], []
                for _ in range(2):
                    wall.extend(decode_step_times(model, batch, gpu_times=gpu, graph_stats=graphs))
                    decode_step_times(model, batch, gpu_times=gpu_alone, host_times=host, graph_stats=graphs)
                prof = profile(activities=[ProfilerActivity.CUDA])
                per = kernels(prof, len(decode_step_times(model, batch, profiler=prof)))
                hprof = cProfile.Profile()
                python = host_functions(hprof, len(decode_step_times(model, batch, host_profile=hprof)))
            finally:
                if att is not None:
                    att.detach()
                    session.close()
            out[variant] = {"wall_median_ms": statistics.median(wall), "gpu_median_ms": statistics.median(gpu),
                            "gpu_alone_median_ms": statistics.median(gpu_alone),
                            "host_call_median_ms": statistics.median(host),
                            "graph_trees_per_generate": graphs,
                            "kernel_us_per_step": sum(v[0] for v in per.values()),
                            "kernels_per_step": sum(v[1] for v in per.values()),
                            "top": {k: [round(v[0], 2), round(v[1], 2)]
                                    for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]},
                            "host_python_us_per_call": round(sum(v[0] for v in python.values()), 1),
                            "host_top": {k: [round(v[0], 2), round(v[1], 2)]
                                         for k, v in sorted(python.items(), key=lambda kv: -kv[1][0])[:25]},
                            "_all": per, "_python": python}
            print(json.dumps({"batch": batch, "variant": variant,
                              **{k: v for k, v in out[variant].items() if not k.startswith("_")}}), flush=True)
        base = out["plain"].pop("_all")
        base_python = out["plain"].pop("_python")
        for variant in ("all layers", "layer 0 only"):
            per = out[variant].pop("_all")
            python = out[variant].pop("_python")
            for key, mine, theirs, least in (("differs_from_plain_us", per, base, 2),
                                             ("host_python_differs_from_plain_us", python, base_python, 3)):
                diff = {k: round(mine.get(k, (0, 0))[0] - theirs.get(k, (0, 0))[0], 2) for k in set(mine) | set(theirs)}
                out[variant][key] = {k: v for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1])) if abs(v) > least}
            print(json.dumps({"batch": batch, "variant": variant,
                              "differs_from_plain_us": out[variant]["differs_from_plain_us"],
                              "host_python_differs_from_plain_us": out[variant]["host_python_differs_from_plain_us"]}),
                  flush=True)
        results.setdefault("profile", {})[str(batch)] = out


def disable_all(att):
    """Disables every hookpoint of attachment ``att`` on the device too (steps begun inside a CUDA graph read the
    controls there): its captures run and publish nothing (their rows are counted as produced and sampled out)."""
    for hp in att.hookpoints.values():
        att.session.set_enabled(hp, False)
    att.session.apply_controls()


def host_api(plain, attached_model, batches, results, top=30):
    """Where the host's time per compiled call goes on a GPU machine: plain; attached at every layer; attached at every
    layer with every hookpoint disabled (the capture kernel runs and publishes nothing: the drain has nothing to copy).
    Per variant: the call's wall time (2 `generate`s, as the generate part times it) and, under torch.profiler (CPU
    and CUDA activities), the host time per step of every CUDA runtime / driver API call and aten op (self time,
    from the third compiled call to the end of `generate`: the eager work `generate` does between steps is in all
    variants alike); the differences from plain. The synchronisations (the benchmark's own around each call, and
    `generate`'s) wait for the GPU: listed, but left out of the totals. (The profiler's own per-op cost is in these
    numbers, as cProfile's is in the profile part's.)"""
    from torch.profiler import ProfilerActivity, profile

    def host_events(prof, steps):
        per = {}
        for e in prof.key_averages():
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            t = e.self_cpu_time_total
            if t > 0:
                was = per.get(e.key[:90], (0.0, 0.0))
                per[e.key[:90]] = (was[0] + t / steps, was[1] + e.count / steps)
        return per

    for batch in batches:
        out = {}
        for variant in ("plain", "all layers", "all layers, disabled"):
            model, session, att = plain if variant == "plain" else attached_model, None, None
            if variant != "plain":
                session = cuda_session(capacity="1 GiB", defer_captures=True)
                att = rt.attach(model, session, sites=["residual"])
                if variant.endswith("disabled"):
                    disable_all(att)
            try:
                wall = []
                for _ in range(2):
                    wall.extend(decode_step_times(model, batch))
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                per = host_events(prof, len(decode_step_times(model, batch, profiler=prof)))
                rows = sum(session.stats(hp)["produced_rows"] for hp in att.hookpoints.values()) if att else None
            finally:
                if att is not None:
                    att.detach()
                    session.close()
            api = {k: v for k, v in per.items() if k.startswith("cu")}
            waits = {k for k in per if "Synchronize" in k}
            out[variant] = {"wall_median_ms": statistics.median(wall), "rows_produced": rows,
                            "host_us_per_step": round(sum(v[0] for k, v in per.items() if k not in waits), 1),
                            "cuda_api_us_per_step": round(sum(v[0] for k, v in api.items() if k not in waits), 1),
                            "cuda_api": {k: [round(v[0], 2), round(v[1], 2)]
                                         for k, v in sorted(api.items(), key=lambda kv: -kv[1][0])},
                            "top": {k: [round(v[0], 2), round(v[1], 2)]
                                    for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]},
                            "_all": per}
        base = out["plain"].pop("_all")
        for variant in ("all layers", "all layers, disabled"):
            per = out[variant].pop("_all")
            diff = {k: round(per.get(k, (0, 0))[0] - base.get(k, (0, 0))[0], 2) for k in set(per) | set(base)}
            out[variant]["differs_from_plain_us"] = {k: v for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))
                                                     if abs(v) > 1}
        for variant, r in out.items():
            print(json.dumps({"batch": batch, "variant": variant, **{k: v for k, v in r.items() if k != "top"}}),
                  flush=True)
        results.setdefault("host_api", {})[str(batch)] = out


def correctness(plain, attached_model, results, new=8):
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "256 MiB", "defer_captures": True},
                                 "policy": {"mode": "best_effort"}})
    att = rt.attach(attached_model, session, sites=["residual"])
    att.set_request_ids([7, 9])
    sub = session.subscribe("check")
    ids = torch.randint(0, 1000, (2, PROMPT), device=DEV)
    try:
        with torch.no_grad():
            out = attached_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          min_new_tokens=new, do_sample=False, cache_implementation="static",
                                          pad_token_id=0)
    finally:
        att.detach()
    stats = session.close()
    with torch.no_grad():
        hs = plain(out[:, :-1], output_hidden_states=True).hidden_states
    names = {v: k for k, v in att.hookpoints.items()}
    L = plain.config.num_hidden_layers
    rows = bad_meta = 0
    errs = []
    worst = {}
    steps = set()
    for r in sub:
        layer = int(names[r.hookpoint].split(".")[1])
        for k in range(len(r.rows)):
            rows += 1
            steps.add(r.step)
            req, pos = int(r.request_id[k]), int(r.position[k])
            ok = req in (7, 9) and ((r.step == 0 and pos < PROMPT) or pos == PROMPT + r.step - 1)
            bad_meta += not ok
            if ok and layer < L - 1:
                want = hs[layer + 1][[7, 9].index(req), pos].float().cpu().numpy()
                got = torch.from_numpy(r.rows[k].view(np.int16).copy()).view(torch.bfloat16).float().numpy()
                errs.append(float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)))
                worst[(r.step, layer)] = max(worst.get((r.step, layer), 0.0), errs[-1])
    results["correctness"] = {
        "rows": rows, "expected_rows": (PROMPT + new - 1) * 2 * L, "steps": len(steps), "bad_request_or_position": bad_meta,
        "max_rel_err_vs_eager": max(errs) if errs else None, "median_rel_err_vs_eager": statistics.median(errs) if errs else None,
        "exported_rows": stats.get("exported_rows"), "dropped_rows": stats.get("dropped_rows"),
        "max_rel_err_by_step": {s: max(v for (st, _), v in worst.items() if st == s) for s in sorted(steps)},
        "max_rel_err_by_layer": {l: max(v for (_, ly), v in worst.items() if ly == l) for l in range(L - 1)}}
    print(json.dumps({"correctness": results["correctness"]}), flush=True)


def own_layer_class(model):
    """Gives the decoder layers of ``model`` a class of their own (same name, nothing added), as ``attach`` does for
    the modules it hooks. Dynamo guards a module by its type: without this the second plain model ran the code
    torch.compile compiled for the first (the same class) and CUDA graph trees checked the first model's recording
    at every call before recording its own ("static input data pointer changed": two checks per call, 2.7x the step
    time at batch 1 on an H100) — a resolution of nothing."""
    for layer in model.model.layers:
        cls = type(layer)
        layer.__class__ = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


CONTROLS = ("top_hooks", "layer_hooks", "attached_off")
_CONTROL_SESSIONS = []  # (attachment, session) of the attached_off controls, closed by close_controls()


def control_model(kind, layers, mode="best_effort"):
    """A model that is not attached but is hooked like an attached one, with hooks that do nothing (no ringscope;
    :func:`compiled_host.add_noop_hooks`: ``top_hooks`` on the model, ``layer_hooks`` on every decoder layer). Its
    decoder layers get a class of their own (:func:`own_layer_class`). How far these differ from the plain model is
    what a compiled model's step time varies by without any capture — the resolution the attached model's difference
    must be read against. ``attached_off``: attached like the measured model (residual of every layer, a session of
    its own in the same ``mode``: in full mode its calls are admitted too) with every hookpoint disabled: its graph,
    its inputs and its host call are an attached model's, its capture kernel runs and publishes nothing, so its drain
    has nothing to copy — what it differs from the attached model by is what publishing and draining the rows costs
    the step."""
    model = build_model(layers)
    own_layer_class(model)
    if kind == "attached_off":
        session = cuda_session(capacity="1 GiB", defer_captures=True, mode=mode)
        att = rt.attach(model, session, sites=["residual"])
        _CONTROL_SESSIONS.append((att, session))
        disable_all(att)
    else:
        add_noop_hooks(model, kind)
    return model


def close_controls():
    """Detaches the attached_off controls and closes their sessions; {control: accounting}: none of their rows may
    have been published."""
    out = {}
    while _CONTROL_SESSIONS:
        att, session = _CONTROL_SESSIONS.pop()
        att.detach()
        stats = session.close()
        out[f"attached_off_{len(_CONTROL_SESSIONS)}"] = {k: stats.get(k) for k in
                                                         ("produced_rows", "exported_rows", "dropped_rows")}
    return out


def run_generate(plain, attached_model, batches, rounds, results, mode="best_effort", plain_2=None, controls=None):
    """The compiled decode step of `generate`, plain and attached, interleaved; with `plain_2` (a third model, the same
    weights, never attached, its decoder layers of a class of their own: :func:`own_layer_class`) a second plain
    model too: how far the two plain models differ is the resolution (check `graph_trees` — plain_2's invariant checks
    per call, one as the others' — before reading it). ``controls`` ({name: model}, :func:`control_model`) are timed
    in the same rotation; ``spread_median_pct`` is then the largest difference of any model without ringscope
    (plain_2 and the controls but ``attached_off``, which is attached: reported against the attached model too,
    ``vs_ringscope_*``) from the plain one."""
    session = cuda_session(capacity="1 GiB", defer_captures=True, mode=mode)
    att = rt.attach(attached_model, session, sites=["residual"])
    layers = len(att.hookpoints)

    def produced():
        return sum(session.stats(hp)["produced_rows"] for hp in att.hookpoints.values())
    skips = counters["inductor"]["cudagraph_skips"]
    try:
        for batch in batches:
            order = [("plain", plain), ("ringscope", attached_model)] + ([("plain_2", plain_2)] if plain_2 is not None
                                                                         else []) + list((controls or {}).items())
            t = {name: [] for name, _ in order}
            graphs = {name: [] for name, _ in order}
            produced0 = produced()
            for r in range(rounds):  # interleaved, the order rotating, so that drift falls on all alike
                for name, model in order[r % len(order):] + order[:r % len(order)]:
                    t[name].extend(decode_step_times(model, batch, graph_stats=graphs[name]))
            # The attached model's 2 generates per round: PROMPT prefill positions and NEW - 1 decode steps per row and
            # captured layer. Only the prefills' rows means its compiled steps ran a graph without the hooks (session
            # 35: the plain model's, compiled first; attach now prevents that): these timings would not be of a
            # capturing model. (A row fed the pad token is an ended sequence's and not captured: a few fewer is fine.)
            rows = produced() - produced0
            prefill_only, all_steps = (2 * rounds * batch * n * layers for n in (PROMPT, PROMPT + NEW - 1))
            if rows <= prefill_only:
                raise RuntimeError(f"batch {batch}: the attached model's compiled decode steps captured nothing "
                                   f"({rows} rows produced, {prefill_only} from the prefills alone, {all_steps} "
                                   "expected): these timings are not of a capturing model")
            a, b = statistics.median(t["plain"]), statistics.median(t["ringscope"])
            a_min, b_min = min(t["plain"]), min(t["ringscope"])
            res = {"plain_median_ms": a, "ringscope_median_ms": b, "overhead_median_pct": 100 * (b / a - 1),
                   "plain_min_ms": a_min, "ringscope_min_ms": b_min, "overhead_min_pct": 100 * (b_min / a_min - 1),
                   "steps_timed": len(t["plain"]), "rows_produced": rows, "rows_expected": all_steps,
                   **({"plain_2_median_ms": statistics.median(t["plain_2"]),
                       "resolution_median_pct": 100 * abs(statistics.median(t["plain_2"]) / a - 1),
                       "resolution_min_pct": 100 * abs(min(t["plain_2"]) / a_min - 1)} if "plain_2" in t else {}),
                   **({"controls": {name: {"median_ms": statistics.median(t[name]),
                                           "vs_plain_median_pct": 100 * (statistics.median(t[name]) / a - 1),
                                           "vs_plain_min_pct": 100 * (min(t[name]) / a_min - 1),
                                           # attached_off is attached (not in the spread): against the attached model
                                           **({"vs_ringscope_median_pct": 100 * (statistics.median(t[name]) / b - 1),
                                               "vs_ringscope_min_pct": 100 * (min(t[name]) / b_min - 1)}
                                              if name == "attached_off" else {})}
                                    for name in controls},
                       **({"spread_median_pct": max(100 * abs(statistics.median(t[name]) / a - 1) for name in without)}
                          if (without := [n for n in [*controls, *(["plain_2"] if "plain_2" in t else [])]
                                          if n != "attached_off"]) else {})}
                      if controls else {}),
                   "steps_begun_in_python": att.step,
                   # per timed generate: graphs recorded, invariant checks per call of the compiled step
                   "graph_trees": {k: v for k, v in graphs.items() if v}}
            results.setdefault("generate_decode_step", {})[str(batch)] = res
            print(json.dumps({"batch": batch, **res}), flush=True)
    finally:
        att.detach()
        stats = session.close()
    results["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
    results["ringscope_accounting"] = {k: stats.get(k) for k in ("produced_rows", "exported_rows", "dropped_rows")}
    print(json.dumps({"cudagraph_skips": results["cudagraph_skips"],
                      "ringscope_accounting": results["ringscope_accounting"]}), flush=True)


def make_parts(args, results, plain, attached_model, plain_2, control_models, batches):
    """The parts ``--parts`` names, in its order, as functions of no argument."""
    profile_batches = [int(b) for b in args.profile_batches.split(",")]
    parts = []
    for p in args.parts.split(","):
        if p == "correctness":
            parts.append(lambda: correctness(plain, attached_model, results))
        elif p == "generate":
            parts.append(lambda: run_generate(plain, attached_model, batches, args.rounds, results, args.mode, plain_2,
                                                control_models))
        elif p == "hostapi":
            parts.append(lambda: host_api(plain, attached_model, profile_batches, results))
        elif p == "profile":
            parts.append(lambda: profile_steps(plain, attached_model, profile_batches, results))
    return parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hf_compiled_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3, help="a multiple of the models timed (3, and one more per control model): each goes first "
                    "as often")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--parts", default="correctness,generate",
                    help="which parts to run, in this order: correctness, generate, profile, hostapi")
    ap.add_argument("--profile-batches", default="8", help="batch sizes of the profile and hostapi parts")
    ap.add_argument("--no-second-plain", dest="second_plain", action="store_false",
                    help="generate part: no second plain model (whose difference from the first is the resolution)")
    ap.add_argument("--controls", default="", help="generate part: also time these models hooked like an attached "
                    "one with hooks that do nothing, no ringscope, or attached with every hookpoint disabled "
                    f"(comma-separated: {', '.join(CONTROLS)}); their differences from the plain model are the spread "
                    "a capture's cost is read against")
    ap.add_argument("--mode", choices=("best_effort", "full"), default="best_effort",
                    help="the generate part's policy.mode (full: attach admits every call of the compiled step)")
    ap.add_argument("--sync", choices=("device", "stream"), default="device",
                    help="what each timed call of the compiled step waits for before and after: the whole device "
                         "(every stream: the drain's copies of the step's rows too) or torch's current stream only "
                         "(what `generate` itself waits for each step)")
    ap.add_argument("--cache", choices=("reuse", "fresh"), default="reuse",
                    help="reuse: one StaticCache per model and batch size, reset before each generate (what a server "
                         "does; steady state); fresh: generate(cache_implementation='static') builds a new one per "
                         "call (CUDA graph trees re-record the step in every generate, for any model)")
    args = ap.parse_args()
    controls = [c for c in args.controls.split(",") if c]
    for c in controls:
        if c not in CONTROLS:
            ap.error(f"--controls: no control model {c} (one of {', '.join(CONTROLS)})")
    for p in args.parts.split(","):
        if p not in PARTS:
            ap.error(f"--parts: unknown part {p!r} (one of {', '.join(PARTS)})")
    try:
        batches = [int(b) for b in args.batches.split(",")]
        [int(b) for b in args.profile_batches.split(",")]
    except ValueError:
        ap.error(f"--batches / --profile-batches: comma-separated integers (got {args.batches!r}, "
                 f"{args.profile_batches!r})")
    global CACHE_MODE, SYNC
    CACHE_MODE = args.cache
    if args.sync == "stream":
        SYNC = lambda: torch.cuda.current_stream().synchronize()  # noqa: E731
    torch._dynamo.config.cache_size_limit = 64
    global GRAPH_TREES
    GRAPH_TREES = GraphTreeCounters()
    import transformers
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "transformers": transformers.__version__, "cache": args.cache,
               "mode": args.mode, "sync": args.sync,
               "compile": "transformers' own: generate with a StaticCache -> get_compiled_call"}
    plain, attached_model = build_model(args.layers), build_model(args.layers)
    plain_2 = build_model(args.layers) if args.second_plain and "generate" in args.parts.split(",") else None
    if plain_2 is not None:
        own_layer_class(plain_2)
    try:
        control_models = {c: control_model(c, args.layers, args.mode) for c in controls} \
            if "generate" in args.parts.split(",") else None
        status = run_parts(make_parts(args, results, plain, attached_model, plain_2, control_models, batches),
                           results, args.out)
    finally:
        closed = close_controls()
    if closed:  # the attached_off controls' accounting: every hookpoint was disabled, so nothing may have been
        # exported or dropped (a disabled hookpoint's rows are counted as produced and sampled out)
        results["attached_off_accounting"] = closed
        if any(c["exported_rows"] or c["dropped_rows"] for c in closed.values()):
            results.setdefault("errors", []).append("an attached_off control exported or dropped rows: its "
                                                    "hookpoints were not all disabled, so it is not the control it "
                                                    "should be")
            status = 1
        print(json.dumps({"attached_off_accounting": closed}), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if GRAPH_TREES.reasons:  # why recorded graphs did not match a call (written after the parts' own results)
        results["graph_tree_mismatch_reasons"] = dict(GRAPH_TREES.reasons.most_common(12))
        print(json.dumps({"graph_tree_mismatch_reasons": results["graph_tree_mismatch_reasons"]}), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main())
