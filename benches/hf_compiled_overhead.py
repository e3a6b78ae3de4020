"""Overhead of `attach()` on the path most users take: Hugging Face decoding compiled by torch.compile with CUDA graphs.

    python benches/hf_compiled_overhead.py --out results.json   # needs CUDA, torch, transformers, libringscope + NVRTC

Model: the 1B-shaped Llama of hf_overhead.py (16 layers, hidden 2048, random bf16 weights, no download), twice with
the same weights: one plain, one with ringscope attached (`ring.backend = "cuda"`, best-effort,
`ring.defer_captures = true`, `attach(sites=["residual"])`, all 16 layers). Measured in this one process:
  * decode step: `torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)` over a StaticCache
    (inductor + CUDA graph trees), one decode step per call; per-step time synchronised every step (median, p99)
    and pipelined, both models interleaved over several rounds; batch 1, 8, 64;
  * `generate(..., cache_implementation="static")` as a user calls it (transformers compiles the decode step itself):
    wall time of 64 new tokens, median of several calls, per batch size;
  * correctness: a compiled `generate` of two requests on the attached model, every captured row against an eager
    `output_hidden_states` pass over the same tokens on the plain model (bf16: the compiled kernels round
    differently, so the error is reported, not required to be zero), request ids and positions checked exactly;
  * that CUDA graphs were used (inductor's cudagraph_skips counter) and ringscope's own accounting (rows produced,
    published, dropped) for the timed steps.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from torch._dynamo.utils import counters
from transformers import StaticCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_overhead import DEV, PROMPT, build_model, cuda_session, interleaved  # noqa: E402

import ringscope  # noqa: E402
import ringscope.torch as rt  # noqa: E402


def compiled_step(model, batch, max_len):
    """One decode step of `model` through torch.compile (reduce-overhead: CUDA graph trees) over a StaticCache that
    an eager prefill filled."""
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    ids = torch.randint(0, 1000, (batch, PROMPT), device=DEV)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(PROMPT, device=DEV), use_cache=True)
    cc = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    tok = torch.randint(0, 1000, (batch, 1), device=DEV)
    pid = torch.full((batch, 1), PROMPT, device=DEV)
    cp = torch.tensor([PROMPT], device=DEV)

    def step():
        with torch.no_grad():
            cc(input_ids=tok, position_ids=pid, cache_position=cp, past_key_values=cache, use_cache=True)
    return step


def generate_time(model, batch, new=64, calls=3):
    ids = torch.randint(0, 1000, (batch, PROMPT), device=DEV)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
              cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)  # compiles
        times = []
        for _ in range(calls):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, **kw)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


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


def run_batch(plain, attached_model, batch, steps, rounds, results):
    max_len = PROMPT + 64
    session = cuda_session(capacity="1 GiB", defer_captures=True)
    att = rt.attach(attached_model, session, sites=["residual"])
    skips = counters["inductor"]["cudagraph_skips"]
    try:
        variants = {"a_compiled": compiled_step(plain, batch, max_len),
                    "b_compiled_ringscope": compiled_step(attached_model, batch, max_len)}
        out = interleaved(variants, steps, rounds)
    finally:
        att.detach()
    stats = session.close()
    a, b = out["a_compiled"], out["b_compiled_ringscope"]
    res = {"variants": out,
           "overhead_median_pct": 100 * (b["median_ms"] / a["median_ms"] - 1),
           "overhead_pipelined_pct": 100 * (b["pipelined_ms"] / a["pipelined_ms"] - 1),
           "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
           "ringscope": {k: stats.get(k) for k in ("produced_rows", "published_rows", "exported_rows", "dropped_rows")}}
    results.setdefault("decode_step", {})[str(batch)] = res
    print(json.dumps({"batch": batch, **{k: v for k, v in res.items() if k != "variants"},
                      "a_ms": a["median_ms"], "b_ms": b["median_ms"]}), flush=True)


def run_generate(plain, attached_model, batch, results):
    session = cuda_session(capacity="1 GiB", defer_captures=True)
    att = rt.attach(attached_model, session, sites=["residual"])
    try:
        # Interleaved twice so that drift falls on both alike.
        t = {"a": [], "b": []}
        for _ in range(2):
            t["a"].append(generate_time(plain, batch))
            t["b"].append(generate_time(attached_model, batch))
    finally:
        att.detach()
    stats = session.close()
    a, b = min(t["a"]), min(t["b"])
    res = {"plain_ms": a, "ringscope_ms": b, "overhead_pct": 100 * (b / a - 1), "new_tokens": 64,
           "ringscope": {k: stats.get(k) for k in ("produced_rows", "published_rows", "exported_rows", "dropped_rows")}}
    results.setdefault("generate", {})[str(batch)] = res
    print(json.dumps({"generate_batch": batch, **res}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hf_compiled_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--parts", default="correctness,steps,generate", help="which parts to run, in this order")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "compile": "torch.compile(model, mode='reduce-overhead', fullgraph=True, dynamic=False)"}
    plain, attached_model = build_model(args.layers), build_model(args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    parts = []
    for p in args.parts.split(","):
        if p == "correctness":
            parts.append(lambda: correctness(plain, attached_model, results))
        elif p == "steps":
            parts += [(lambda b=b: run_batch(plain, attached_model, b, args.steps, args.rounds, results)) for b in batches]
        elif p == "generate":
            parts += [(lambda b=b: run_generate(plain, attached_model, b, results)) for b in batches]
        else:
            ap.error(f"unknown part {p!r}")
    for part in parts:
        try:
            part()
        except Exception as e:  # keep what was measured; say what failed
            import traceback
            traceback.print_exc()
            results.setdefault("errors", []).append(repr(e))
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
