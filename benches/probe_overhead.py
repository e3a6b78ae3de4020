"""Fused probes inside a real decode step: a 1B-shaped Llama on one GPU, 16 probes (one per layer, K = 1 and K = 16)
computed in the capture path, against no capture and raw capture of the same 16 residual streams.

    python benches/probe_overhead.py --out results.json      # needs CUDA, torch, transformers, libringscope + NVRTC

The model, the decode loop (HF StaticCache, each step recorded once as a CUDA graph and replayed) and the timing
(interleaved rounds, per-step synchronised median and p99, and pipelined) are those of benches/hf_overhead.py. Every
ringscope variant is `ring.backend = "cuda"`, best-effort, `ring.defer_captures = true`, the step and its captures
recorded into the graph (a replay makes no host call):
  (a) no capture;
  (b) raw capture of the 16 residual streams (16 × batch × 2048 bf16 per step);
  (c) 16 fused probes, K = 1 (`mode = "fused"`, the residual hookpoints disabled: only the scores enter the ring);
  (d) 16 fused probes, K = 16.
Reported per batch size (1, 8, 64): step time and overhead against (a), ring bytes per step (what crosses PCIe),
and rows scored. Then the agreement of the fused scores with consumer probes scoring the raw rows of the same steps
(max relative difference of the per-request mean scores).
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_overhead import Decoder, build_model, interleaved, recorded_with, replay, run_parts  # noqa: E402

import ringscope  # noqa: E402

H = 2048


def probes_config(layers, weights, mode="fused", prefix="p", aggregate="mean"):
    return [{"name": f"{prefix}{i}", "hookpoint": f"layers.{i}.resid", "weights": weights, "aggregate": aggregate,
             "threshold": 1e9, "mode": mode} for i in range(layers)]


def session(layers, probes=(), raw=True):
    cfg = {"ring": {"backend": "cuda", "capacity": "1 GiB", "max_batch_rows": 4096, "defer_captures": True},
           "policy": {"mode": "best_effort"},
           "hookpoints": [{"name": f"layers.{i}.resid", "site": "residual", "layer": i, "dtype": "bf16",
                           "row_width": H, "enabled": raw} for i in range(layers)]}
    if probes:
        cfg["probes"] = list(probes)
    return ringscope.Session(cfg)


def run_batch(model, batch, steps, rounds, weights, results):
    L = model.config.num_hidden_layers
    max_len = 16 + rounds * (10 + 2 * steps) + 16
    variants, sessions = {}, {}
    variants["a_graph"] = replay(Decoder(model, batch, max_len))
    for key, probes, raw in (("b_raw_16_layers", (), True),
                             ("c_fused_k1", probes_config(L, weights[1]), False),
                             ("d_fused_k16", probes_config(L, weights[16]), False)):
        s = sessions[key] = session(L, probes, raw)
        variants[key] = replay(recorded_with(model, s, batch, max_len))
    variants["a_graph_2"] = replay(Decoder(model, batch, max_len))
    row = interleaved(variants, steps, rounds)
    base = row["a_graph"]
    for key, s in sessions.items():
        s.flush(timeout=60)
        # Every replay captures layer 0's rows (or counts them sampled out, when disabled): its produced rows / batch
        # is the number of steps the session saw.
        steps_seen = s.stats(s.hookpoint_id("layers.0.resid"))["produced_rows"] // batch
        ring_bytes = s.stats_all()["drain"]["bytes"]
        totals = s.close()
        row[key]["totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
        row[key]["steps"] = steps_seen
        row[key]["ring_bytes_per_step"] = ring_bytes / max(1, steps_seen)
    for k, v in row.items():
        for m in ("median_ms", "p99_ms", "pipelined_ms"):
            v[m.replace("_ms", "_overhead")] = v[m] / base[m] - 1
    results[f"batch_{batch}"] = row
    print(json.dumps({f"batch_{batch}": row}, indent=1), flush=True)


def agreement(model, weights, results, replays=20):
    """Fused probes (K = 16) and consumer probes on the raw rows of the same replays: per-request mean scores."""
    L = model.config.num_hidden_layers
    batch = 8
    s = session(L, probes_config(L, weights[16], "fused", "f") + probes_config(L, weights[16], "consumer", "c"))
    d = recorded_with(model, s, batch, 16 + replays + 16)
    for _ in range(replays):
        d.graph.replay()
        d.advance()
    torch.cuda.synchronize()
    s.flush(timeout=60)
    s.wait_probes(60)  # flush waits for the drain; the consumer probes may still be scoring
    worst, worst_abs, scale, compared = 0.0, 0.0, 0.0, 0
    for i in range(L):
        # attach numbers the rows' requests 0..batch-1 unless told otherwise.
        pairs = []
        for r in range(batch):
            f, c = s.probe_request(f"f{i}", r), s.probe_request(f"c{i}", r)
            if f is None or c is None:
                raise RuntimeError(f"layer {i}, request {r}: a probe saw nothing (fused {f}, consumer {c})")
            if f["coverage"]["scored"] != c["coverage"]["scored"]:
                raise RuntimeError(f"layer {i}, request {r}: fused scored {f['coverage']}, consumer {c['coverage']}")
            pairs += list(zip(f["scores"], c["scores"]))
        # Relative to the layer's score scale (the RMS of its mean scores): means of residual-stream scores can sit
        # near zero, where a plain relative difference measures f32 summation order, not agreement.
        rms = (sum(b * b for _, b in pairs) / len(pairs)) ** 0.5
        scale = max(scale, rms)
        for a, b in pairs:
            worst = max(worst, abs(a - b) / max(rms, 1e-30))
            worst_abs = max(worst_abs, abs(a - b))
            compared += 1
    s.close()
    results["agreement"] = {"compared_mean_scores": compared, "max_diff_over_layer_rms": worst,
                            "max_abs_diff": worst_abs, "largest_layer_rms": scale}
    print(json.dumps({"agreement": results["agreement"]}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = build_model(args.layers)
    tmp = tempfile.mkdtemp()
    rng = np.random.default_rng(0)
    weights = {}
    for k in (1, 16):
        weights[k] = os.path.join(tmp, f"w{k}.npy")
        np.save(weights[k], (rng.standard_normal((k, H)) / np.sqrt(H)).astype(np.float32))
    parts = [lambda b=b: run_batch(model, b, args.steps, args.rounds, weights, results)
             for b in map(int, args.batches.split(","))] + [lambda: agreement(model, weights, results)]
    return run_parts(parts, results, args.out)


if __name__ == "__main__":
    sys.exit(main())
