"""Attention sites on a GPU (issue 40): what capturing q/k/v costs a Hugging Face decode step recorded as a CUDA graph,
and whether what the graph captured rebuilds the model's attention.

    python benches/attention_overhead.py --out attention.json   # needs CUDA, torch, transformers, libringscope + NVRTC

Cost: the 1B-shaped Llama of benches/hf_overhead.py (16 layers, hidden 2048, 32 query / 8 KV heads of 64, bf16,
random weights), decode over HF's StaticCache, each step recorded as a CUDA graph and replayed (no host call per
step). Variants, each recorded ``--recordings`` times (3) and timed interleaved in rounds in this one process: (a) no
capture (the plain recordings' spread is the comparison's resolution: recordings of the same step differ); (q) ``attach(sites=["attn_q", "attn_k", "attn_v"], layers=LAYERS)`` — the query and
key after RoPE (the outputs of the model's own apply_rotary_pos_emb, nothing recomputed) and the value of 4 layers; (r) the
residual stream of all 16 layers, for scale. Both capture variants: CUDA ring (2 GiB, best-effort,
``defer_captures``), Parquet files written by the exporter as the steps run. Per batch size (1, 8, 64): median and
p99 of the per-step time synchronised every step, and the pipelined mean. Bytes per token are printed: q/k/v are the
KV cache's size plus the query, so a user sees the rate before turning them on.

Exactness: a small float32 Llama decoding 2 requests (a prefill, 3 eager warm-up steps, then a step recorded as a CUDA
graph and replayed): every ``attn_k`` / ``attn_v`` row equals, bit for bit, the key / value HF wrote into its StaticCache at that
position, and ``ringscope.attention_pattern`` over the prefill and the replayed steps equals HF eager attention's
``output_attentions`` over the same tokens (largest absolute difference printed; goal 1e-3).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import ringscope
import ringscope.torch as rt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_overhead import DEV, PROMPT, Decoder, build_model, interleaved, recorded_with, replay  # noqa: E402

LAYERS = [0, 5, 10, 15]


def session(out_dir, run):
    return ringscope.Session({"ring": {"backend": "cuda", "capacity": "2 GiB", "max_batch_rows": 4096,
                                       "defer_captures": True},
                              "policy": {"mode": "best_effort"},
                              "export": {"parquet": True, "dir": out_dir, "run_id": run}})


def run_batch(model, batch, steps, rounds, out_dir, results, recordings=3):
    """``recordings`` recordings of each variant (plain, q/k/v, residual), made in turn (plain 1, q 1, r 1, plain 2,
    ...) and timed interleaved. Two recordings of the same plain step can differ by more than a capture costs (a
    property of each recorded graph: at batch 1 on the H200 the model's own element-wise kernels ran ~30 µs slower in
    some recordings than in others, profiled), so a variant's cost is its recordings' median against the plain
    recordings' median, and the plain recordings' spread (slowest over fastest) is the resolution."""
    max_len = PROMPT + rounds * (10 + 2 * steps) + 16
    families = {"a_graph": None, "q_attn_qkv_4_layers": (["attn_q", "attn_k", "attn_v"], LAYERS),
                "r_residual_16_layers": (["residual"], None)}
    variants, sessions = {}, {}
    for k in range(1, recordings + 1):
        for fam, spec in families.items():
            name = f"{fam}_{k}"
            if spec is None:
                variants[name] = replay(Decoder(model, batch, max_len))
                continue
            sessions[name] = session(out_dir, f"{name}-b{batch}")
            variants[name] = replay(recorded_with(model, sessions[name], batch, max_len, sites=spec[0],
                                                  layers=spec[1]))
    row = interleaved(variants, steps, rounds)
    for key, s in sessions.items():
        totals = s.close()
        row[key]["totals"] = {k: totals[k] for k in ("produced_rows", "exported_rows", "dropped_rows")}
    metrics = ("median_ms", "p99_ms", "pipelined_ms")
    med = lambda xs: float(np.median(xs))  # noqa: E731
    summary = {}
    for fam in families:
        names = [f"{fam}_{k}" for k in range(1, recordings + 1)]
        summary[fam] = {m: med([row[n][m] for n in names]) for m in metrics}
        summary[fam]["recordings_median_ms"] = [row[n]["median_ms"] for n in names]
        if fam != "a_graph":
            summary[fam]["dropped_rows"] = sum(row[n]["totals"]["dropped_rows"] for n in names)
    base = summary["a_graph"]
    for v in summary.values():
        for m in metrics:
            v[m.replace("_ms", "_overhead")] = v[m] / base[m] - 1
    plains = summary["a_graph"]["recordings_median_ms"]
    summary["resolution_median"] = max(plains) / min(plains) - 1
    summary["resolution_p99"] = max(row[f"a_graph_{k}"]["p99_ms"] for k in range(1, recordings + 1)) / \
        min(row[f"a_graph_{k}"]["p99_ms"] for k in range(1, recordings + 1)) - 1
    row["summary"] = summary
    results[f"batch_{batch}"] = row
    print(json.dumps({f"batch_{batch}": summary}, indent=1), flush=True)


def bytes_per_token(model, layers):
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    per_layer = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d * 2  # bf16
    return {"attn_qkv_per_layer": per_layer, "attn_qkv_layers": len(layers),
            "attn_qkv_per_token": per_layer * len(layers), "residual_per_token_all_layers":
                cfg.hidden_size * 2 * cfg.num_hidden_layers,
            "kv_cache_per_token_per_layer": 2 * cfg.num_key_value_heads * d * 2}


def exactness(results, replays=6):
    """A float32 Llama decoding 2 requests through a recorded CUDA graph: k/v rows against HF's own StaticCache, and
    the rebuilt pattern against HF eager attention."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2)
    # SDPA while the graph is recorded (HF's eager mask is built on the host, which a recording refuses); eager for
    # the reference weights (output_attentions).
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).to(DEV).eval()
    tmp = tempfile.mkdtemp(prefix="attn-exact-")
    s = ringscope.Session({"ring": {"backend": "cuda", "capacity": "256 MiB", "defer_captures": True},
                           "policy": {"mode": "best_effort"},
                           "export": {"parquet": True, "dir": tmp, "run_id": "r"}})
    att = rt.attach(model, s, sites=["attn_q", "attn_k", "attn_v"])
    att.set_request_ids([7, 9])
    # Warm-up steps advance (positions 16, 17, 18: HF's StaticCache writes each call at its next slot, so positions
    # and cache slots agree), then the recorded step is replayed at 19, 20, ...
    d = Decoder(model, 2, PROMPT + replays + 8, advance_warmup=True)
    for k in range(replays):
        d.graph.replay()
        d.advance()
    torch.cuda.synchronize()
    att.detach()
    s.close()
    # The tokens each request was fed: the prompt (Decoder's prefill), then `tok` at every decode position.
    prompt = d.prompt_ids
    dump = ringscope.read_dump(os.path.join(tmp, "r"))
    out = {"kv_rows_checked": 0, "kv_rows_mismatched": 0}
    for i in range(2):
        layer = d.cache.layers[i]
        for name, cache in ((f"layers.{i}.attn_k", layer.keys), (f"layers.{i}.attn_v", layer.values)):
            cols = dump[name]
            for b, rid in enumerate((7, 9)):
                sel = cols["request_id"] == rid
                for p, row in zip(cols["position"][sel], cols["activation"][sel]):
                    want = cache[b, :, int(p), :].reshape(-1).cpu().numpy()
                    out["kv_rows_checked"] += 1
                    out["kv_rows_mismatched"] += not np.array_equal(row.view(np.int32), want.view(np.int32))
    seqs = torch.cat([prompt, d.tok.expand(2, 3 + replays)], dim=1)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(seqs, output_attentions=True, use_cache=False).attentions
    worst = 0.0
    for b, rid in enumerate((7, 9)):
        for i in range(2):
            got = ringscope.attention_pattern(os.path.join(tmp, "r"), rid, i)
            assert list(got.query_positions) == list(range(PROMPT + 3 + replays)), got.query_positions
            worst = max(worst, float(np.abs(got.weights - ref[i][b].float().cpu().numpy()).max()))
    out["pattern_max_abs_diff"] = worst
    out["pattern_peak_weight"] = float(max(a.max() for a in ref))
    out["ok"] = out["kv_rows_mismatched"] == 0 and out["kv_rows_checked"] > 0 and worst < 1e-3
    shutil.rmtree(tmp, ignore_errors=True)
    results["exactness_graph_f32"] = out
    print(json.dumps({"exactness_graph_f32": out}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_overhead.json")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--recordings", type=int, default=3, help="recordings of each variant (at least 2)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "attention-bench"))
    args = ap.parse_args()
    if args.recordings < 2:
        ap.error("--recordings: at least 2 (the plain recordings' spread is the resolution)")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers_captured": LAYERS}
    exactness(results)
    model = build_model(16)
    results["bytes"] = bytes_per_token(model, LAYERS)
    print(json.dumps({"bytes": results["bytes"]}), flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    for b in (int(x) for x in args.batches.split(",")):
        run_batch(model, b, args.steps, args.rounds, args.dir, results, args.recordings)
        shutil.rmtree(args.dir, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
