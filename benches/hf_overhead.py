"""Decode-step overhead of capturing the residual stream of every layer of a 1B-shaped Llama on one GPU.

    python benches/hf_overhead.py --out results.json       # needs CUDA, torch, transformers, libringscope + NVRTC

Model: Llama architecture, 16 layers, hidden 2048, 32 heads (8 KV), MLP 8192, vocab 128256, random bf16 weights
(no download). Decode with HF's StaticCache, each step recorded once as a CUDA graph (`torch.cuda.graph`) and
replayed. Variants, all measured in this one process:
  (a) no capture;
  (b) ringscope (`ring.backend = "cuda"`, best-effort, `ring.defer_captures = true`, attach(sites=["residual"]),
      all 16 layers): the step (its batch read from the model's position_ids and a request-id tensor) and the
      captures are recorded into the graph; the 16 captures are copied by one kernel at the end of the forward
      pass; a replay needs no host call. Diagnostics: (b1) the same with one capture kernel per layer (and a
      descriptor kernel per step); (b2) the first design — full mode, `begin_step` from Python before each replay,
      one capture kernel per layer; (b0) b2's per-step calls around the plain graph with no captures;
  (c) forward hooks copying each layer's output to the CPU (the vLLM-Lens / nnsight pattern; eager, no graph);
  (d) the same capture with plain torch ops inside the graph: `index_copy_` into a preallocated GPU ring per layer.
Per batch size (1, 8, 64): per-step time synchronised every step (median, p99) and pipelined (many steps, one
sync). Plus prefill of 2048 tokens for (a) and (b), and a bit-exactness check of (b) against output_hidden_states.
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

import ringscope
import ringscope.torch as rt

DEV = torch.device("cuda")
PROMPT = 16


def build_model(layers):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rope_theta=500000.0)
    with torch.device(DEV):  # random init on the GPU: seconds, where the CPU took most of a minute
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


class Decoder:
    """A decode step recorded as a CUDA graph over a StaticCache, with static inputs updated between replays."""

    def __init__(self, model, batch, max_len, before_record=None, after_record=None, record=True,
                 advance_warmup=False):
        self.model, self.batch = model, batch
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        ids = self.prompt_ids = torch.randint(0, 1000, (batch, PROMPT), device=DEV)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=self.cache, cache_position=torch.arange(PROMPT, device=DEV),
                  use_cache=True)
        self.pos = PROMPT
        self.tok = torch.randint(0, 1000, (batch, 1), device=DEV)
        self.cp = torch.tensor([PROMPT], device=DEV)
        self.pid = torch.full((batch, 1), PROMPT, device=DEV)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            for _ in range(3):
                self._forward()
                if advance_warmup:
                    # Each warm-up step at the next position: HF's StaticCache writes every call at its own next
                    # slot (a device counter), so positions that repeat would disagree with the cache.
                    self.advance()
        torch.cuda.current_stream().wait_stream(s)
        if not record:
            return
        self.graph = torch.cuda.CUDAGraph()
        if before_record:
            before_record(self)
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.out = self._forward()
        if after_record:
            after_record(self)

    def _forward(self):
        return self.model(input_ids=self.tok, position_ids=self.pid, cache_position=self.cp,
                          past_key_values=self.cache, use_cache=True).logits

    def advance(self):
        self.cp.add_(1)
        self.pid.add_(1)
        self.pos += 1


def recorded_with(model, session, batch, max_len, **attach):
    """A :class:`Decoder` whose step was recorded with ringscope attached to ``session`` (``attach``'s keywords;
    ``sites=["residual"]`` unless given). The graph keeps what the hooks recorded, so they are removed once it is."""
    attach.setdefault("sites", ["residual"])
    att = rt.attach(model, session, **attach)
    try:
        return Decoder(model, batch, max_len)
    finally:
        att.detach()


def time_steps(step_fn, n, warm=10, raw=False, on_phase=None):
    """Per-step time of `step_fn` (which replays one step): n steps each followed by a sync ("synced"), then n steps
    and one sync ("pipelined"). `on_phase`, if given, is called with "warm", "synced" and "pipelined" as each part
    begins (for a step function that times parts of its own work per phase)."""
    phase = on_phase or (lambda name: None)
    phase("warm")
    for _ in range(warm):
        step_fn()
    torch.cuda.synchronize()
    phase("synced")
    synced = []
    for _ in range(n):
        t = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t) * 1e3)
    phase("pipelined")
    t = time.perf_counter()
    for _ in range(n):
        step_fn()
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t) * 1e3 / n
    if raw:
        return synced, pipelined
    return summarize(synced, [pipelined])


def summarize(synced, pipelined):
    synced = sorted(synced)
    return {"median_ms": statistics.median(synced), "p99_ms": synced[int(0.99 * (len(synced) - 1))],
            "pipelined_ms": statistics.mean(pipelined), "synced_steps": len(synced)}


def interleaved(variants, steps, rounds, on_phase=None):
    """Times every variant in `rounds` rounds, the order rotating each round, so that drift of the machine during
    the run falls on all variants alike. `on_phase`: as :func:`time_steps`'s."""
    samples = {k: ([], []) for k in variants}
    names = list(variants)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            synced, pipelined = time_steps(variants[k], steps, raw=True, on_phase=on_phase)
            samples[k][0].extend(synced)
            samples[k][1].append(pipelined)
    return {k: summarize(*v) for k, v in samples.items()}


def replay(d):
    def step():
        d.graph.replay()
        d.advance()
    return step


def host_begun_replay(model, session, batch, max_len):
    """A decode step recorded inside a step begun by hand, and a step function that begins the step from Python
    (``begin_step``: batch rows as request ids, the decoder's position), replays it and ends it — the full-mode design
    before graph-begun steps could be admitted."""
    att = rt.attach(model, session, sites=["residual"])
    req = np.arange(batch, dtype=np.uint64)
    stream = torch.cuda.current_stream().cuda_stream
    begin = lambda dec: att.begin_step(req, np.full(batch, dec.pos, dtype=np.uint32), stream=stream)
    try:
        d = Decoder(model, batch, max_len, before_record=begin, after_record=lambda dec: att.end_step())
    finally:
        att.detach()

    def step():
        begin(d)
        d.graph.replay()
        att.end_step()
        d.advance()
    return step


def cuda_session(**ring):
    mode = ring.pop("mode", "best_effort")
    policy = {"mode": mode, "full_deadline_ms": 20000} if mode == "full" else {"mode": mode}
    return ringscope.Session({"ring": {"backend": "cuda", "max_batch_rows": 4096, **ring}, "policy": policy})


def run_batch(model, batch, steps, rounds, results):
    max_len = PROMPT + rounds * (10 + 2 * steps) + 16
    H = model.config.hidden_size
    L = model.config.num_hidden_layers
    variants, sessions = {}, {}

    # (a) plain graph.
    variants["a_graph"] = replay(Decoder(model, batch, max_len))

    # (b) and (b1): the step and the captures recorded into the graph; replays make no host call. The hooks are only
    # needed while recording: they are removed afterwards (the graph keeps what they recorded).
    for key, defer in (("b_ringscope", True), ("b1_graph_step_per_layer_kernels", False)):
        sessions[key] = cuda_session(capacity="1 GiB", defer_captures=defer)
        variants[key] = replay(recorded_with(model, sessions[key], batch, max_len))

    # (b2) the first design: full mode, begin_step from Python before each replay, one capture kernel per layer.
    sessions["b2_host_step_full"] = cuda_session(capacity="1 GiB", mode="full")
    variants["b2_host_step_full"] = host_begun_replay(model, sessions["b2_host_step_full"], batch, max_len)
    req = np.arange(batch, dtype=np.uint64)
    stream = torch.cuda.current_stream().cuda_stream

    # (b0) diagnostic: b2's per-step host calls around the plain graph, no captures in it.
    s0 = sessions["b0_begin_step_only"] = cuda_session(capacity="64 MiB", mode="full")
    s0.register("unused", dtype="bf16", row_width=H)
    d0 = Decoder(model, batch, max_len)
    n0 = [0]

    def step_b0():
        s0.begin_step(n0[0], req, np.full(batch, d0.pos, dtype=np.uint32), stream=stream)
        d0.graph.replay()
        s0.end_step()
        n0[0] += 1
        d0.advance()
    variants["b0_begin_step_only"] = step_b0

    # (d) the same capture with plain torch ops in the graph: index_copy_ into a preallocated ring per layer.
    R = 4096
    rings = torch.empty(L, R, H, dtype=torch.bfloat16, device=DEV)
    slot = torch.arange(batch, device=DEV)
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(m, a, out, i=i):
            x = (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1, H)
            if x.shape[0] == batch:  # decode steps (the prefill that fills the cache is not captured)
                rings[i].index_copy_(0, slot, x)
        handles.append(layer.register_forward_hook(hook))
    try:
        dd = Decoder(model, batch, max_len)
    finally:
        for h in handles:
            h.remove()

    def step_d():
        slot.add_(batch).remainder_(R)
        dd.graph.replay()
        dd.advance()
    variants["d_torch_ring"] = step_d

    # (a) again, a second graph recorded last: how much two recordings of the same plain step differ (memory
    # placement of the cache and of the graph's buffers) — the resolution of this comparison.
    variants["a_graph_2"] = replay(Decoder(model, batch, max_len))

    row = interleaved(variants, steps, rounds)
    for key, session in sessions.items():
        totals = session.close()
        row[key]["totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}

    # (c) eager with forward hooks copying each layer's output to the CPU (cannot be in a graph).
    handles = []
    for layer in model.model.layers:
        def hook(m, a, out):
            x = out[0] if isinstance(out, (tuple, list)) else out
            x.to("cpu")
        handles.append(layer.register_forward_hook(hook))
    try:
        dc = Decoder(model, batch, PROMPT + 2 * steps + 32, record=False)

        def step_c():
            with torch.no_grad():
                dc._forward()
            dc.advance()
        row["c_eager_cpu_hooks"] = time_steps(step_c, max(steps // 2, 20))
    finally:
        for h in handles:
            h.remove()
    base = row["a_graph"]
    for k, v in row.items():
        for m in ("median_ms", "p99_ms", "pipelined_ms"):
            v[m.replace("_ms", "_overhead")] = v[m] / base[m] - 1
    results[f"batch_{batch}"] = row
    print(json.dumps({f"batch_{batch}": row}, indent=1), flush=True)


def prefill(model, results, n=2048):
    ids = torch.randint(0, 1000, (1, n), device=DEV)

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    out = {"a_no_capture": time_steps(run, 10, warm=3)}
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "1 GiB", "max_batch_rows": 4096,
                                          "defer_captures": True},
                                 "policy": {"mode": "full", "full_deadline_ms": 20000}})
    att = rt.attach(model, session, sites=["residual"])
    out["b_ringscope"] = time_steps(run, 10, warm=3)
    att.detach()
    out["a_no_capture_again"] = time_steps(run, 10, warm=3)
    out["b_totals"] = session.close()["exported_rows"]
    for m in ("median_ms", "p99_ms", "pipelined_ms"):
        out["b_ringscope"][m.replace("_ms", "_overhead")] = out["b_ringscope"][m] / out["a_no_capture"][m] - 1
    results["prefill_2048"] = out
    print(json.dumps({"prefill_2048": out}, indent=1), flush=True)


def bit_exact(model, results):
    """Eager forward of a 2-request batch with ringscope attached: every captured row equals output_hidden_states."""
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "256 MiB"}, "policy": {"mode": "full"}})
    att = rt.attach(model, session, sites=["residual"])
    sub = session.subscribe("check")
    att.request_ids = [7, 9]
    ids = torch.randint(0, 1000, (2, 12), device=DEV)
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.cuda.synchronize()
    att.detach()
    session.close()
    L = len(hs) - 1
    names = {v: k for k, v in att.hookpoints.items()}
    checked = mismatched = 0
    for r in sub:
        layer = int(names[r.hookpoint].split(".")[1])
        if layer == L - 1:
            continue  # hidden_states[-1] is after the final norm
        want = hs[layer + 1].view(torch.int16).cpu().numpy()
        for k in range(len(r.rows)):
            b = 0 if r.request_id[k] == 7 else 1
            ok = np.array_equal(r.rows[k].view(np.int16), want[b, r.position[k]])
            checked += 1
            mismatched += not ok
    results["bit_exact"] = {"rows_checked": checked, "mismatched": mismatched}
    print(json.dumps({"bit_exact": results["bit_exact"]}), flush=True)


def bit_exact_graph(model, results, replays=5):
    """Decode steps recorded as a CUDA graph with the step and the deferred captures inside it: after every replay,
    every captured row equals the layer output the same replay copied into a static buffer (plain torch copies
    recorded in the same graph), with the right request id and position."""
    batch = 2
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "256 MiB", "defer_captures": True},
                                 "policy": {"mode": "best_effort"}})
    att = rt.attach(model, session, sites=["residual"])
    att.set_request_ids([7, 9])
    sub = session.subscribe("check")
    H = model.config.hidden_size
    L = model.config.num_hidden_layers
    ref = torch.zeros(L, batch, H, dtype=torch.bfloat16, device=DEV)
    handles = []
    for i, layer in enumerate(model.model.layers):
        def hook(m, a, out, i=i):
            x = out[0] if isinstance(out, (tuple, list)) else out
            if x.shape[1] == 1:
                ref[i].copy_(x.reshape(batch, H))
        handles.append(layer.register_forward_hook(hook))
    want = {}
    try:
        d = Decoder(model, batch, PROMPT + replays + 16)
        for k in range(replays):
            d.graph.replay()
            torch.cuda.synchronize()
            want[k] = (d.pos, ref.view(torch.int16).cpu().numpy().copy())
            d.advance()
    finally:
        for h in handles:
            h.remove()
        att.detach()
    session.close()
    names = {v: k for k, v in att.hookpoints.items()}
    recs = [r for r in sub if len(r.rows) == batch and int(r.position[0]) >= PROMPT + 0 and r.step >= 0]
    graph_steps = sorted({r.step for r in recs})[-replays:]
    checked = mismatched = 0
    for r in recs:
        if r.step not in graph_steps:
            continue
        k = graph_steps.index(r.step)
        pos, ref_k = want[k]
        layer = int(names[r.hookpoint].split(".")[1])
        for j in range(batch):
            b = [7, 9].index(int(r.request_id[j]))
            ok = int(r.position[j]) == pos and np.array_equal(r.rows[j].view(np.int16), ref_k[layer, b])
            checked += 1
            mismatched += not ok
    results["bit_exact_graph"] = {"rows_checked": checked, "mismatched": mismatched, "steps": graph_steps}
    print(json.dumps({"bit_exact_graph": results["bit_exact_graph"]}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hf_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=60, help="synced steps per variant per round (and as many pipelined)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "graphs": "torch.cuda.graph (manual capture of one decode step over StaticCache)"}
    model = build_model(args.layers)
    return run_parts([lambda: bit_exact(model, results), lambda: bit_exact_graph(model, results),
                      *[(lambda b=b: run_batch(model, b, args.steps, args.rounds, results))
                        for b in map(int, args.batches.split(","))],
                      lambda: prefill(model, results)], results, args.out)


def run_parts(parts, results, out):
    """Runs each part in turn, keeping what was measured when one fails (its error goes into ``results["errors"]``),
    and writes ``results`` to ``out`` after each; the exit status: 1 if any part failed."""
    for part in parts:
        try:
            part()
        except Exception as e:  # keep what was measured; say what failed
            import traceback
            traceback.print_exc()
            results.setdefault("errors", []).append(repr(e))
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
