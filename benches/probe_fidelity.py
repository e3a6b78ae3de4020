"""Fused probe scores against an independent reference, in a real decode step recorded as a CUDA graph (issue 28).

    python benches/probe_fidelity.py --out fidelity.json     # needs CUDA, torch, transformers, libringscope + NVRTC

Two model shapes with random bf16 weights (no download): Qwen2-1.5B (28 layers, hidden 1536) and a 1B-shape Llama
(16 layers, hidden 2048). For each, several sessions in a row, with `ring.defer_captures` false and true: HF StaticCache,
the decode step recorded once as a CUDA graph with `attach(model, config, sites=["residual"])`, batch 8; fused probes
on every layer (one per layer plus one more on every other layer; K cycling through 1, 3, 8, 16, 17, 33, 64), each
saved with `save_probe` as safetensors with a bias; best-effort; Parquet export; 4 replays. The same residual rows are
copied by plain torch ops recorded in the same graph (forward hooks on the decoder layers), and every score of every
probe and replay read back from the Parquet dump (`probes.<name>`) is compared with `W @ x + b` computed by torch in
f64 from those rows: an error above (d + 1) * 2^-24 of the sum of the terms' magnitudes (the bound of f32
accumulation) marks the probe wrong.

Before each session opens, the default stream is given ~50 ms of work (matrix products), as a serving engine's is:
with `--no-busy` it is idle. The first version of the probes' upload raced that stream (issue 28: the tables were
zeroed by a memset ordered on the legacy default stream, after their upload on a non-blocking stream).

Options: `--k 8 --per-layer 1` (the issue's 28 probes of K = 8), `--raw 0` (scores only: the residual hookpoints
disabled), `--capacity` (ring.capacity; default the library's), `--defer 0,1`, `--sessions N`, `--no-busy`. Every
session also checks that all hookpoints' rows of one replay carry one step number and, with `--raw 1`, that the
exported residual rows equal the torch copies bit for bit.

Exit status 1 when any probe is wrong, any step number disagrees or any raw row differs, in any session.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_overhead import DEV, PROMPT  # noqa: E402

import ringscope  # noqa: E402
import ringscope.torch as rt  # noqa: E402

KS = (1, 3, 8, 16, 17, 33, 64)
BATCH = 8
REPLAYS = 4


def build(shape):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if shape == "qwen2-1.5b":
        cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096)
        cls = Qwen2ForCausalLM
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
        cls = LlamaForCausalLM
    with torch.device(DEV):
        return cls(cfg).to(torch.bfloat16).eval()


def busy_default_stream():
    """~50 ms of matrix products on the current (default) stream, left running."""
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    for _ in range(50):
        a = a @ a
        a /= a.abs().amax().clamp(min=1)


def one_session(model, tmp, session_no, defer, busy, rng, args):
    L, H = model.config.num_hidden_layers, model.config.hidden_size
    layers = model.model.layers
    probes = []
    for l in range(L):
        for extra in range(args.per_layer if args.per_layer else 1 + (l % 2 == 0 or L < 28)):
            k = args.k or KS[(l + 3 * extra + session_no) % len(KS)]
            w = (rng.standard_normal((k, H)) / np.sqrt(H)).astype(np.float32)
            b = rng.standard_normal(k).astype(np.float32)
            name = f"p{l}_{extra}"
            entry = ringscope.save_probe(os.path.join(tmp, f"s{session_no}_{name}.safetensors"), w, b)
            probes.append({"name": name, "layer": l, "k": k, "w": w, "b": b, "entry": entry})
    run_id = f"s{session_no}"
    ring = {"backend": "cuda", "defer_captures": defer}
    if args.capacity:
        ring["capacity"] = args.capacity
    config = {
        "ring": ring,
        "policy": {"mode": "best_effort"},
        "export": {"parquet": True, "dir": tmp, "run_id": run_id},
        "probes": [{"name": p["name"], "hookpoint": f"layers.{p['layer']}.resid", "threshold": 1e30,
                    "aggregate": "mean", "mode": "fused", **p["entry"]} for p in probes],
        # The raw rows go to the ring or not: the probes must not depend on it.
        "hookpoints": [{"name": f"layers.{i}.resid", "site": "residual", "layer": i, "dtype": "bf16",
                        "row_width": H, "enabled": bool(args.raw)} for i in range(L)],
    }
    if busy:
        busy_default_stream()
    att = rt.attach(model, config, sites=args.sites.split(","))
    session = att.session
    # The reference rows: plain torch copies of each layer's output, recorded into the same graph.
    copies = torch.zeros(L, BATCH, H, dtype=torch.bfloat16, device=DEV)
    handles = []
    for i, layer in enumerate(layers):
        def hook(m, a, out, i=i):
            x = (out[0] if isinstance(out, (tuple, list)) else out).reshape(-1, H)
            if x.shape[0] == BATCH:
                copies[i].copy_(x)
        handles.append(layer.register_forward_hook(hook))
    from hf_overhead import Decoder

    try:
        d = Decoder(model, BATCH, PROMPT + REPLAYS + 8)
    finally:
        att.detach()
        for h in handles:
            h.remove()
    rows, fed = [], []
    for _ in range(REPLAYS):
        d.advance()  # replay r decodes position PROMPT + 1 + r (the warm-up passes were at PROMPT)
        d.tok.copy_(torch.randint(0, 1000, (BATCH, 1), device=DEV))
        d.graph.replay()
        torch.cuda.synchronize()
        rows.append(copies.clone())
        fed.append(d.tok.reshape(-1).cpu().numpy().copy())
    totals = session.close()
    dump = ringscope.read_dump(os.path.join(tmp, run_id))
    # Every hookpoint's rows of one replay carry the same step number (the rows are keyed by position below).
    step_problems = []
    replay_steps = []
    for r in range(REPLAYS):
        pos = PROMPT + 1 + r
        seen = {}
        for name, cols in dump.items():
            st = set(np.unique(cols["step"][cols["position"] == pos]).tolist())
            if len(st) != 1:
                step_problems.append(f"{name}: replay {r} rows carry steps {sorted(st)}")
            seen[name] = tuple(sorted(st))
        values = set(seen.values())
        if len(values) > 1:
            step_problems.append(f"replay {r}: steps differ across hookpoints: {sorted(values)[:6]}")
        replay_steps.append(sorted(values)[0] if values else None)
    # The `tokens` site, captured inside the graph: every replay's rows carry the tokens fed to it.
    token_mismatch = 0
    if "tokens" in args.sites.split(","):
        got = dump["tokens"]
        for r in range(REPLAYS):
            sel = got["position"] == PROMPT + 1 + r
            order = np.argsort(got["request_id"][sel], kind="stable")
            token_mismatch += int((got["activation"][sel][order].view(np.int64).reshape(-1) != fed[r]).sum())
    raw_mismatch = 0
    if args.raw:
        for i in range(L):
            got = dump[f"layers.{i}.resid"]
            for r, x_all in enumerate(rows):
                sel = got["position"] == PROMPT + 1 + r
                order = np.argsort(got["request_id"][sel], kind="stable")
                a = got["activation"][sel][order]
                b = x_all[i].view(torch.int16).cpu().numpy().view(np.uint16)
                raw_mismatch += int((a != b).any(axis=1).sum())
    bound = (H + 1) * 2.0 ** -24
    wrong, worst, checked = [], 0.0, 0
    for p in probes:
        got = dump.get(f"probes.{p['name']}")
        if got is None:
            wrong.append({"probe": p["name"], "k": p["k"], "why": "no scores in the dump"})
            continue
        w = torch.from_numpy(p["w"]).to(DEV, torch.float64)
        b = torch.from_numpy(p["b"]).to(DEV, torch.float64)
        bad, probe_worst = 0, 0.0
        for r, x_all in enumerate(rows):
            x = x_all[p["layer"]].to(torch.float64)
            want = x @ w.T + b
            mag = x.abs() @ w.abs().T + b.abs()
            pos = PROMPT + 1 + r
            sel = got["position"] == pos
            if int(sel.sum()) != BATCH:
                wrong.append({"probe": p["name"], "k": p["k"], "why": f"{int(sel.sum())} rows at position {pos}"})
                bad += 1
                continue
            req = got["request_id"][sel].astype(np.int64)
            row = torch.from_numpy(req - req.min()).to(DEV)
            scores = torch.from_numpy(got["activation"][sel].astype(np.float64)).to(DEV)
            err = (scores - want[row]).abs() / mag[row]
            probe_worst = max(probe_worst, float(err.max()))
            bad += int((err > bound).sum())
            checked += err.numel()
        worst = max(worst, probe_worst)
        if bad:
            wrong.append({"probe": p["name"], "k": p["k"], "wrong_scores": bad, "max_error_over_magnitude": probe_worst})
    return {"session": session_no, "defer_captures": defer, "busy_default_stream": busy, "raw": args.raw,
            "probes": len(probes), "step_problems": step_problems[:20], "replay_steps": replay_steps,
            "raw_rows_differing": raw_mismatch, "token_rows_differing": token_mismatch,
            "scores_checked": checked, "wrong_probes": wrong, "max_error_over_magnitude": worst,
            "bound": bound, "exported_rows": totals["exported_rows"], "dropped_rows": totals["dropped_rows"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_fidelity.json")
    ap.add_argument("--shapes", default="qwen2-1.5b,llama-1b")
    ap.add_argument("--sessions", type=int, default=4, help="sessions per shape and defer setting")
    ap.add_argument("--no-busy", action="store_true")
    ap.add_argument("--k", type=int, default=0, help="every probe's outputs (default: cycling through KS)")
    ap.add_argument("--per-layer", type=int, default=0, help="probes per layer (default: 1, 2 on every other)")
    ap.add_argument("--raw", type=int, default=1, help="1: the residual hookpoints enabled too; 0: scores only")
    ap.add_argument("--capacity", default="", help="ring.capacity (default: the library's)")
    ap.add_argument("--defer", default="0,1", help="ring.defer_captures settings to run")
    ap.add_argument("--sites", default="residual", help="attach's sites (add tokens to check the token ids too)")
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "library": ringscope.library_path(),
               "shapes": {}}
    rng = np.random.default_rng(28)
    failed = False
    session_no = 0
    for shape in args.shapes.split(","):
        model = build(shape)
        out = results["shapes"][shape] = []
        tmp = tempfile.mkdtemp(prefix=f"fidelity-{shape}-")
        for defer in [bool(int(v)) for v in args.defer.split(",")]:
            for _ in range(args.sessions):
                t = time.perf_counter()
                r = one_session(model, tmp, session_no, defer, not args.no_busy, rng, args)
                r["seconds"] = round(time.perf_counter() - t, 2)
                session_no += 1
                out.append(r)
                failed |= bool(r["wrong_probes"]) or bool(r["step_problems"]) or r["raw_rows_differing"] > 0 \
                    or r["token_rows_differing"] > 0
                print(json.dumps({"shape": shape, **{k: v for k, v in r.items() if k != "wrong_probes"},
                                  "wrong": [w["probe"] for w in r["wrong_probes"]]}), flush=True)
        del model
        torch.cuda.empty_cache()
    sessions = [r for v in results["shapes"].values() for r in v]
    results["summary"] = {
        "sessions": len(sessions),
        "sessions_with_wrong_probes": sum(bool(r["wrong_probes"]) for r in sessions),
        "sessions_with_step_problems": sum(bool(r["step_problems"]) for r in sessions),
        "raw_rows_differing": sum(r["raw_rows_differing"] for r in sessions),
        "probes_checked": sum(r["probes"] for r in sessions),
        "scores_checked": sum(r["scores_checked"] for r in sessions),
        "max_error_over_magnitude": max(r["max_error_over_magnitude"] for r in sessions),
    }
    print(json.dumps({"summary": results["summary"]}), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
