"""Decode-step overhead of capturing the residual stream of every layer of a 1B-shaped Llama on one GPU.

    python benches/hf_overhead.py --out results.json       # needs CUDA, torch, transformers, libringscope + NVRTC

Model: Llama architecture, 16 layers, hidden 2048, 32 heads (8 KV), MLP 8192, vocab 128256, random bf16 weights
(no download). Decode with HF's StaticCache, each step recorded once as a CUDA graph (`torch.cuda.graph`) and
replayed. Variants, all measured in this one process:
  (a) no capture;
  (b) ringscope (`ring.backend = "cuda"`, attach(sites=["residual"]), all 16 layers): the captures are inside the
      graph; `begin_step` hands over the batch descriptor before each replay;
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
    model = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    return model


class Decoder:
    """A decode step recorded as a CUDA graph over a StaticCache, with static inputs updated between replays."""

    def __init__(self, model, batch, max_len, before_record=None, after_record=None, record=True):
        self.model, self.batch = model, batch
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        ids = torch.randint(0, 1000, (batch, PROMPT), device=DEV)
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


def time_steps(step_fn, n, warm=10):
    for _ in range(warm):
        step_fn()
    torch.cuda.synchronize()
    synced = []
    for _ in range(n):
        t = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t) * 1e3)
    t = time.perf_counter()
    for _ in range(n):
        step_fn()
    torch.cuda.synchronize()
    pipelined = (time.perf_counter() - t) * 1e3 / n
    synced.sort()
    return {"median_ms": statistics.median(synced), "p99_ms": synced[int(0.99 * (len(synced) - 1))],
            "pipelined_ms": pipelined}


def plain_graph(model, batch, max_len, steps):
    d = Decoder(model, batch, max_len)

    def step():
        d.graph.replay()
        d.advance()
    return time_steps(step, steps)


def run_batch(model, batch, steps, results):
    max_len = PROMPT + 40 + 2 * (steps + 20) + 8
    L = model.config.num_hidden_layers
    H = model.config.hidden_size
    row = {}

    # (a) plain graph.
    row["a_graph"] = plain_graph(model, batch, max_len, steps)

    # (b0) diagnostic: ringscope's per-step calls (begin_step / end_step, the descriptor kernel) around the plain
    # graph, no captures in it — the host and begin-kernel part of (b)'s cost.
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "64 MiB", "max_batch_rows": 4096},
                                 "policy": {"mode": "full", "full_deadline_ms": 20000}})
    session.register("unused", dtype="bf16", row_width=H)
    d = Decoder(model, batch, max_len)
    req0 = np.arange(batch, dtype=np.uint64)
    stream0 = torch.cuda.current_stream().cuda_stream
    n0 = [0]

    def step_b0():
        session.begin_step(n0[0], req0, np.full(batch, d.pos, dtype=np.uint32), stream=stream0)
        d.graph.replay()
        session.end_step()
        n0[0] += 1
        d.advance()
    row["b0_begin_step_only"] = time_steps(step_b0, steps)
    del d
    session.close()

    # (b) ringscope inside the graph.
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "1 GiB", "max_batch_rows": 4096},
                                 "policy": {"mode": "full", "full_deadline_ms": 20000}})
    att = rt.attach(model, session, sites=["residual"])
    try:
        _run_b(model, batch, steps, max_len, session, att, row)
    finally:
        att.detach()
    totals = session.close()
    row["b_totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
    _run_d_c(model, batch, steps, max_len, row, results)


def _run_b(model, batch, steps, max_len, session, att, row):
    req = np.arange(batch, dtype=np.uint64)

    def begin(dec):
        att.begin_step(req, np.full(batch, dec.pos, dtype=np.uint32), stream=torch.cuda.current_stream().cuda_stream)

    d = Decoder(model, batch, max_len, before_record=begin, after_record=lambda dec: att.end_step())
    stream = torch.cuda.current_stream().cuda_stream

    def step_b():
        att.begin_step(req, np.full(batch, d.pos, dtype=np.uint32), stream=stream)
        d.graph.replay()
        att.end_step()
        d.advance()
    row["b_ringscope"] = time_steps(step_b, steps)


def _run_d_c(model, batch, steps, max_len, row, results):
    L = model.config.num_hidden_layers
    H = model.config.hidden_size
    # (d) torch index_copy_ ring inside the graph.
    R = 4096
    rings = torch.empty(L, R, H, dtype=torch.bfloat16, device=DEV)
    slot = torch.arange(batch, device=DEV)
    handles = []
    layers = model.model.layers
    for i, layer in enumerate(layers):
        def hook(m, a, out, i=i):
            x = (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1, H)
            if x.shape[0] == batch:  # decode steps (the prefill that fills the cache is not captured)
                rings[i].index_copy_(0, slot, x)
        handles.append(layer.register_forward_hook(hook))
    try:
        d = Decoder(model, batch, max_len)

        def step_d():
            slot.add_(batch).remainder_(R)
            d.graph.replay()
            d.advance()
        row["d_torch_ring"] = time_steps(step_d, steps)
        del d
    finally:
        for h in handles:
            h.remove()

    # (c) eager with hooks copying to the CPU.
    handles = []
    for layer in layers:
        def hook(m, a, out):
            x = out[0] if isinstance(out, (tuple, list)) else out
            x.to("cpu")
        handles.append(layer.register_forward_hook(hook))
    try:
        d = Decoder(model, batch, max_len, record=False)  # eager: hooks that copy to the CPU cannot be in a graph

        def step_c():
            with torch.no_grad():
                d._forward()
            d.advance()
        row["c_eager_cpu_hooks"] = time_steps(step_c, max(steps // 4, 20))
        del d
    finally:
        for h in handles:
            h.remove()
    # (a) again, last: the spread between the two (a) runs is the drift of this machine during the batch.
    row["a_graph_again"] = plain_graph(model, batch, max_len, steps)
    base = row["a_graph"]
    for k in ("b0_begin_step_only", "b_ringscope", "c_eager_cpu_hooks", "d_torch_ring", "a_graph_again"):
        for m in ("median_ms", "p99_ms", "pipelined_ms"):
            row[k][m.replace("_ms", "_overhead")] = row[k][m] / base[m] - 1
    results[f"batch_{batch}"] = row
    print(json.dumps({f"batch_{batch}": row}, indent=1), flush=True)


def prefill(model, results, n=2048):
    ids = torch.randint(0, 1000, (1, n), device=DEV)

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    out = {"a_no_capture": time_steps(run, 10, warm=3)}
    session = ringscope.Session({"ring": {"backend": "cuda", "capacity": "1 GiB", "max_batch_rows": 4096},
                                 "policy": {"mode": "full", "full_deadline_ms": 20000}})
    att = rt.attach(model, session, sites=["residual"])
    out["b_ringscope"] = time_steps(run, 10, warm=3)
    att.detach()
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="hf_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "graphs": "torch.cuda.graph (manual capture of one decode step over StaticCache)"}
    model = build_model(args.layers)
    for part in (lambda: bit_exact(model, results),
                 *[(lambda b=b: run_batch(model, b, args.steps, results)) for b in map(int, args.batches.split(","))],
                 lambda: prefill(model, results)):
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
