"""ringscope's vLLM plugin on a GPU, through vLLM's public API: correctness against Hugging Face and decode/prefill
cost against plain vLLM measured in the same call (docs/gpu-benchmarks.md has the numbers and the recipe).

    python benches/vllm_gpu.py all OUT_DIR        # every check and benchmark below, one engine per process
    python benches/vllm_gpu.py correct OUT_DIR    # only the correctness runs
    python benches/vllm_gpu.py full OUT_DIR       # full (lossless) mode: correctness with a 16 MiB ring, then plain
                                                  # and full engines interleaved, three of each
    python benches/vllm_gpu.py host OUT_DIR       # the plugin's host time per forward pass, full and best-effort
    python benches/vllm_gpu.py parts OUT_DIR      # the same, split into its parts (no prefill phase)
    python benches/vllm_gpu.py attention OUT_DIR  # attn_q/k/v: rebuilt patterns against Hugging Face (f32), then
                                                  # q/k/v of 4 layers against plain vLLM, interleaved
    python benches/vllm_gpu.py profile OUT_DIR    # each engine step on the GPU's clock (PyTorch profiler): plain,
                                                  # q/k/v of 4 layers, residual of 16 (benches/gpu_trace.py)
    python benches/vllm_gpu.py off_profiles OUT_DIR  # the same clock: q/k/v of 4 layers, the residual of 16, each
                                                  # next to the same engine with its hookpoints disabled
    python benches/vllm_gpu.py cut_profiles_attn4 OUT_DIR  # the same clock: a capture, the plugin's structure
    python benches/vllm_gpu.py cut_profiles_resid OUT_DIR  # before session 42, disabled, disabled with no tensor
                                                  # kept (see change_capture_ops)
    python benches/vllm_gpu.py keep_profiles_attn4 OUT_DIR  # the same clock: disabled with the tensors kept and no
                                                  # copy kernel, beside the capture, disabled and nothing kept
    python benches/vllm_gpu.py overlap OUT_DIR    # vllm.overlap_copy: q/k/v rebuilt against Hugging Face (run with
                                                  # NVIDIA_TF32_OVERRIDE=0), then its cost beside the capture without it
    python benches/vllm_gpu.py overlap_cost OUT_DIR  # its cost alone: plain, with it, without it, plain again
    python benches/vllm_gpu.py full_overlap_cost OUT_DIR  # the same in full mode

(vLLM 0.26 serves a Llama with its V2 model runner unless VLLM_USE_V2_MODEL_RUNNER=0, which the plugin needs.)
Every bench run times each decode step on its own (``step_ms``: p50/p99 of the time between two ``execute_model``
calls) besides the generate-call average (``decode_ms``), and with the plugin its host time per forward pass
(``host_us``).

Correctness ("correct-llama", "correct-qwen2"): a small random checkpoint of each family (bf16, saved with
save_pretrained), vLLM's default mode (torch.compile + FULL_AND_PIECEWISE CUDA graphs), continuous batching of many
requests of different lengths with chunked prefill (64-token chunks) and prefix caching (requests sharing a 256-token
prefix), the plugin capturing the residual, attention and MLP outputs of every layer. Every exported row is compared
with a Hugging Face forward pass of the same checkpoint (float32 on the CPU): request ids and positions exact (each
request's rows are exactly its computed positions, from its prefix-cache hit on), values within ``TOLERANCE``
relative (bf16 engine against an f32 reference), cached rows counted, accounting balanced. Run twice (two engines).

Cost ("bench-*"): a Llama-3.2-1B-shaped model (16 layers, hidden 2048, bf16, dummy weights), 16-token prompts,
greedy, ``ignore_eos``; one decode step = (time of 160 new tokens - time of 32) / 128 for B requests at once, median of
``REPS``; prefill = 8 prompts of 2048 tokens, one new token each. Configurations, each in a process of its own:
plain vLLM (three recordings: the comparison's resolution), (b) every layer's residual to Parquet (best-effort),
(c) residual + attention + MLP outputs of every layer, (d) 16 fused probes on the residuals with the residual
hookpoints off (scores only), (e) ``enforce_eager`` with a PyTorch forward hook per layer copying to the CPU.
"""

import json
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NO_REQUEST = 2**64 - 1
#: Engine rows against the f32 Hugging Face reference, relative L2 error per row: a bf16 engine (bf16 rounding of
#: differently fused kernels, growing over the layers), and an f32 one (Triton attention's dots in TF32).
TOLERANCE = {"bf16": 0.1, "f32": 5e-3}
REPS = 5
BATCHES = (1, 8, 64)


# -- models ------------------------------------------------------------------------------------------------------

def make_checkpoint(path: str, family: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"], **common)
    else:
        cfg = AutoConfig.for_model("qwen2", architectures=["Qwen2ForCausalLM"], **common)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # larger than the default init, so that every layer visibly changes the stream
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path)


def make_1b(path: str) -> None:
    """config.json of the Llama-3.2-1B shape (vLLM serves it with load_format="dummy")."""
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2, "hidden_act": "silu"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_config(out: str, body: str) -> str:
    path = os.path.join(out, "ringscope.toml")
    with open(path, "w") as f:
        f.write(body)
    return path


def register_plugin() -> None:
    """The plugin, registered in this process (where the in-process engine's model runner lives): what vLLM's
    plugin loader does when the package is installed (`pip install ./ffi/python`); here it may be used from the source
    tree with a prebuilt library (RINGSCOPE_LIB)."""
    import ringscope.vllm as rv

    rv.register()


def runner_of(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def engine_facts(llm) -> dict:
    r = runner_of(llm)
    cc = r.vllm_config.compilation_config
    return {"vllm": __import__("vllm").__version__, "runner": f"{type(r).__module__}.{type(r).__name__}",
            "compilation_mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
            "attention_backend": str(getattr(r, "attn_backends", None) or
                                     [type(g.backend).__name__ for g in getattr(r, "attn_groups", [[]])[0]][:1]),
            "plugin": getattr(r, "_ringscope", None) is not None}


# -- correctness -------------------------------------------------------------------------------------------------

ATTN_SITES = '["attn_q", "attn_k", "attn_v"]'


def run_correct(out: str, family: str, dtype: str, result: dict, full: bool = False, attn: bool = False,
                eager: bool = False, overlap: str = "false", layers: str = '"all"', opt_in: bool = False,
                sites: "str | None" = None) -> None:
    import torch
    from vllm import LLM

    model_dir = os.path.join(out, "model")
    make_checkpoint(model_dir, family)
    result["dtype"] = dtype
    result["mode"] = "full" if full else "best_effort"
    result["attention"] = attn
    # Eager (enforce_eager): vLLM's own CUDA kernels instead of compiled code — its fused add-norm overwrites the
    # attention and MLP outputs in place (which is why the plugin does not defer captures of those sites).
    result["eager"] = eager
    # vllm.overlap_copy (TOML): true — the captures submitted on a side stream after the last layer's attention;
    # "lm_head" — the copy held out of vLLM's graphs, launched after each replay beside the LM head.
    result["overlap_copy"] = overlap
    # requests = "opt_in": every other request opts in; the others' rows must leave nothing in the files.
    result["opt_in"] = opt_in
    # Full mode: every forward pass admitted, and no row lost. The run's rows (~21.5k hookpoint rows of 512 B, ~11 MB)
    # pass through a 1 MiB ring (a pass is at most 12 hookpoints x 64 rows, ~0.4 MB): the ring laps about ten times
    # and passes wait for the exporter to make room.
    policy = '[policy]\nmode = "full"\nfull_deadline_ms = 60000\n' if full else ""
    ring = "512 KiB" if full else "256 MiB"
    extra = {}
    if dtype == "f32" and torch.cuda.is_available():
        extra["attention_backend"] = "TRITON_ATTN"  # FlashAttention has no float32
    os.environ["RINGSCOPE_VLLM_CONFIG"] = write_config(out, f"""
[export]
parquet = true
dir = "{out}/dump"
run_id = "run"
{policy}[ring]
capacity = "{ring}"
[vllm]
sites = {sites or (ATTN_SITES if attn else '["residual", "attention_output", "mlp_output"]')}
layers = {layers}
overlap_copy = {overlap}
requests = "{"opt_in" if opt_in else "all"}"
""")
    register_plugin()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16" if dtype == "bf16" else "float32",
              max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=64, enable_chunked_prefill=True,
              enable_prefix_caching=True, seed=0, gpu_memory_utilization=0.3, enforce_eager=eager, **extra)
    result["engine"] = engine_facts(llm)
    result["requests"] = serve_correctness_requests(llm, family, opt_in)
    import ringscope.vllm as rv

    # Full mode's waits for room (how often a pass found the ring full and waited for the exporter), read before close.
    st = [c.session.stats_all() for c in rv.captures()]
    result["stalls"] = [{"stalls": s["stalls"], "stall_time_s": s["stall_time_s"]} for s in st]
    result["closed"] = rv.close_all()
    result["run_dir"] = os.path.join(out, "dump", "run")


def serve_correctness_requests(llm, family: str, opt_in: bool = False) -> list:
    """The correctness scenario's requests, served by ``llm``: 14 requests of different lengths at once (continuous
    batching, chunked prefill), then requests sharing a 256-token prefix (prefix-cache hits). Returns each request's
    vLLM id, prompt, generated tokens, cached prompt tokens and whether it asked to be captured (``opt_in``: every
    other request, in the same batches as the rest)."""
    import random

    from vllm import SamplingParams

    rng = random.Random(1 if family == "llama" else 2)
    reqs = [([rng.randrange(3, 1000) for _ in range(rng.randrange(3, 200))], rng.randrange(2, 24))
            for _ in range(14)]
    # A prefix of whole KV-cache blocks (16 tokens on the GPU, 128 on vLLM's CPU build), shared by later requests.
    prefix = [rng.randrange(3, 1000) for _ in range(256)]
    phases = [reqs, [(prefix + [5], 3)], [(prefix + [6 + i] * (i + 1), 4 + i) for i in range(4)]]
    served = []
    for phase in phases:
        asks = [not opt_in or (len(served) + i) % 2 == 0 for i in range(len(phase))]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in phase],
                            [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True,
                                            extra_args={"ringscope": True} if opt_in and ask else None)
                             for (_, m), ask in zip(phase, asks)],
                            use_tqdm=False)
        for o, ask in zip(outs, asks):
            served.append({"request_id": o.request_id, "prompt": list(o.prompt_token_ids),
                           "tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
                           "captured": ask})
    return served


def side_file(run: str, name: str, ext: str, rank: int = 0) -> str:
    """The plugin's side file ``name`` of tensor-parallel ``rank`` in ``run`` (rank 0: ``requests.jsonl``, rank R:
    ``requests.rank=R.jsonl``)."""
    return os.path.join(run, "_ringscope_vllm", f"{name}.{ext}" if rank == 0 else f"{name}.rank={rank}.{ext}")


def check_correct(out: str, result: dict, rank: int = 0) -> dict:
    """Every exported row (of tensor-parallel ``rank``: its request map, summary and rows) against the Hugging Face
    reference; returns what was found."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import ringscope

    run = result["run_dir"]
    by_ext = {}
    for line in open(side_file(run, "requests", "jsonl", rank)):
        x = json.loads(line)
        by_ext[x["external_request_id"]] = x
    summary = json.load(open(side_file(run, "summary", "json", rank)))
    dump = ringscope.read_dump(run)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ref = {}
    cur = {}

    def hook(name):
        def f(mod, args, o):
            cur[name] = (o[0] if isinstance(o, tuple) else o)[0].detach().float().numpy().copy()
        return f
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(hook(f"layers.{i}.resid"))
        layer.self_attn.register_forward_hook(hook(f"layers.{i}.attn_out"))
        layer.mlp.register_forward_hook(hook(f"layers.{i}.mlp_out"))
    rid = []
    bad = []
    for k, r in enumerate(result["requests"]):
        if not r.get("captured", True):
            # A request that did not opt in: unknown to the run (no ringscope id), and none of its rows in the files.
            rid.append(None)
            if r["request_id"] in by_ext:
                bad.append(f"request {k} did not opt in but is in the run's request map")
            continue
        seq = r["prompt"] + r["tokens"][:-1]
        with torch.no_grad():
            model(torch.tensor([seq]))
        for name, v in cur.items():
            ref[(k, name)] = v
        rid.append(by_ext[r["request_id"]]["request_id"])
    worst, rows, none_rows = 0.0, 0, 0
    tol = TOLERANCE[result["dtype"]]
    for name, cols in dump.items():
        mine = cols["rank"] == rank
        act = cols["activation"][mine]
        act = ringscope.as_float32(act) if cols["dtype"] == "bf16" else np.asarray(act, dtype=np.float32)
        req = cols["request_id"][mine].astype(np.uint64)
        pos = cols["position"][mine].astype(np.int64)
        none = req == np.uint64(NO_REQUEST)
        none_rows += int(none.sum())
        act, req, pos = act[~none], req[~none], pos[~none]
        want = sorted((rid[k], p) for k, r in enumerate(result["requests"]) if rid[k] is not None
                      for p in range(r["cached"], len(r["prompt"]) + len(r["tokens"]) - 1))
        got = sorted(zip(req.tolist(), pos.tolist()))
        if got != want:
            bad.append(f"{name}: (request, position) pairs differ: {len(got)} exported, {len(want)} expected; "
                       f"missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}")
            continue
        for k, r in enumerate(result["requests"]):
            if rid[k] is None:
                continue
            sel = req == np.uint64(rid[k])
            order = np.argsort(pos[sel])
            a = act[sel][order]
            b = ref[(k, name)][r["cached"]:]
            err = np.linalg.norm(a - b, axis=1) / np.maximum(np.linalg.norm(b, axis=1), 1e-30)
            worst = max(worst, float(err.max()))
            if err.max() > tol:
                bad.append(f"{name} request {k}: relative error {err.max():.3g} at position "
                           f"{int(np.argmax(err)) + r['cached']}")
            if len(b) > 1:  # the check tells neighbouring positions apart
                off = np.linalg.norm(a[1:] - b[:-1], axis=1) / np.linalg.norm(b[:-1], axis=1)
                if off.min() < 2 * tol:
                    bad.append(f"{name} request {k}: neighbouring positions too close to tell apart")
            rows += len(a)
    s = summary["session"]
    cached = [r["cached"] for k, r in enumerate(result["requests"]) if rid[k] is not None]
    p = summary["plugin"]
    if s["produced_rows"] != s["exported_rows"] + s["dropped_rows"] + s["sampled_out_rows"]:
        bad.append(f"accounting does not balance: {s}")
    if s["dropped_rows"]:
        bad.append(f"{s['dropped_rows']} rows dropped")
    if none_rows:
        # A graph's padding rows and the rows of requests that did not opt in are kept out on the device.
        bad.append(f"{none_rows} rows of no request exported ({p['padding_rows']} padding rows, "
                   f"{p['opted_out_rows']} rows of requests not captured in the passes)")
    if result.get("opt_in") and not p["opted_out_rows"]:
        bad.append("requests = \"opt_in\" with no row of a request that did not opt in: the scenario tests nothing")
    if (p["cached_requests"], p["cached_rows"]) != (sum(1 for c in cached if c), sum(cached)):
        bad.append(f"cached counters {p['cached_requests']}/{p['cached_rows']} vs vLLM's {cached}")
    if not any(cached):
        bad.append("no prefix-cache hit: the scenario does not test prefix caching")
    if p["disabled"] is not None or p["lost_rows"]:
        bad.append(f"plugin disabled: {p['disabled']}")
    return {"rows_checked": rows, "no_request_rows": none_rows, "worst_relative_error": worst,
            "tolerance": tol, "cached_tokens": cached, "session": s, "plugin": p, "problems": bad,
            "ok": not bad}


def check_attention(out: str, result: dict) -> dict:
    """The attention sites' run ("correct-*-attn"): ``ringscope.attention_pattern`` of every request and layer
    against Hugging Face eager attention (float32, CPU) over the same tokens — from the request's first computed
    position (a prefix-cache hit's positions have no query), the cached key positions named and their columns left
    out (``allow_missing``) — and every ``attn_v`` row against Hugging Face's ``v_proj`` output."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import ringscope

    run = result["run_dir"]
    by_ext = {}
    for line in open(side_file(run, "requests", "jsonl")):
        x = json.loads(line)
        by_ext[x["external_request_id"]] = x
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    meta = ringscope.attention_metadata(run)
    vs = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.v_proj.register_forward_hook(
            lambda mod, a, o, i=i: vs.__setitem__(i, o[0].detach().float().numpy().copy()))
    dump = ringscope.read_dump(run)
    captured = sorted(int(name.split(".")[1]) for name in dump if name.endswith(".attn_q"))
    worst_exact = worst_cached = worst_v = 0.0
    bad, exact_n, cached_n = [], 0, 0
    for k, r in enumerate(result["requests"]):
        rid = by_ext[r["request_id"]]["request_id"]
        seq = r["prompt"] + r["tokens"][:-1]
        c = r["cached"]
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_attentions=True).attentions
        for i in captured:
            want = ref[i][0].float().numpy()[:, c:, :]
            try:
                got = ringscope.attention_pattern(run, rid, i, allow_missing=bool(c))
            except ringscope.RingscopeError as e:
                bad.append(f"request {k} layer {i}: {e}")
                continue
            if list(got.query_positions) != list(range(c, len(seq))):
                bad.append(f"request {k} layer {i}: query positions {got.query_positions[:4]}... not {c}..")
                continue
            if c:
                # Keys 0..c-1 were never computed for this request: named, and the rebuild over the rest is a
                # softmax over fewer keys — compare it with eager's weights renormalised over the same keys.
                if list(got.missing_key_positions) != list(range(c)):
                    bad.append(f"request {k} layer {i}: missing keys {got.missing_key_positions[:4]}... not 0..{c - 1}")
                sub = want[:, :, c:]
                sub = sub / sub.sum(axis=2, keepdims=True)
                worst_cached = max(worst_cached, float(np.abs(got.weights[:, :, c:] - sub).max()))
                cached_n += 1
            else:
                err = float(np.abs(got.weights - want).max())
                worst_exact = max(worst_exact, err)
                exact_n += 1
                if not err <= 1e-3:  # NaN too
                    bad.append(f"request {k} layer {i}: attention weights differ by {err:.3g}")
            cols = dump[f"layers.{i}.attn_v"]
            sel = cols["request_id"].astype(np.uint64) == np.uint64(rid)
            v = np.asarray(cols["activation"][sel][np.argsort(cols["position"][sel])], dtype=np.float32)
            b = vs[i][c:]
            rel = np.linalg.norm(v - b, axis=1) / np.linalg.norm(b, axis=1)
            if not np.isfinite(rel).all():
                bad.append(f"request {k} layer {i}: attn_v rows not finite")
            worst_v = max(worst_v, float(np.nanmax(rel)) if np.isfinite(rel).any() else 0.0)
    if worst_v > TOLERANCE[result["dtype"]]:
        bad.append(f"attn_v rows differ from v_proj by {worst_v:.3g} relative (bound {TOLERANCE[result['dtype']]})")
    summary = json.load(open(side_file(run, "summary", "json")))
    s = summary["session"]
    if s["dropped_rows"]:
        bad.append(f"{s['dropped_rows']} rows dropped")
    # Every request is captured, a graph's padding rows are bounded away on the device: no row of no request.
    none_rows = sum(int((cols["request_id"].astype(np.uint64) == np.uint64(NO_REQUEST)).sum())
                    for cols in dump.values())
    if none_rows:
        bad.append(f"{none_rows} rows of no request exported ({summary['plugin']['padding_rows']} padding rows)")
    if not cached_n:
        bad.append("no prefix-cache hit: the scenario does not test missing keys")
    return {"requests_layers_exact": exact_n, "requests_layers_cached": cached_n,
            "worst_abs_diff_exact": worst_exact, "worst_abs_diff_cached_renormalised": worst_cached,
            "worst_relative_v": worst_v, "metadata_rank0": meta.get(0, {}).get(0), "session": s,
            "problems": bad, "ok": not bad}


# -- cost --------------------------------------------------------------------------------------------------------

BENCH_CONFIGS = {
    "plain": None,
    # The residual of every layer, the copy at the pass's end (overlap_copy has nothing to overlap after the last
    # layer's residual; false says so whatever "auto" would decide).
    "resid": '[vllm]\nsites = ["residual"]\noverlap_copy = false\n',
    # Full (lossless) mode: the plugin admits every forward pass (Session.admit_graph_step); 8 Parquet sink threads
    # (what benches/full_mode_decode.py uses for Hugging Face), and a wait budget long enough that a prefill of 1 GiB
    # of residuals waits for the drain instead of being degraded.
    "full_resid": '[policy]\nmode = "full"\nfull_deadline_ms = 60000\n[vllm]\nsites = ["residual"]\n'
                  'overlap_copy = false\n',
    # Both with vllm.overlap_copy = "lm_head": the pass's copy held out of vLLM's graphs and launched after each replay,
    # beside the LM head (session 50).
    "resid_lmhead": '[vllm]\nsites = ["residual"]\noverlap_copy = "lm_head"\n',
    "attn4_lmhead": '[vllm]\nsites = ["attn_q", "attn_k", "attn_v"]\nlayers = [0, 5, 10, 15]\n'
                    'overlap_copy = "lm_head"\n',
    "full_resid_lmhead": '[policy]\nmode = "full"\nfull_deadline_ms = 60000\n[vllm]\nsites = ["residual"]\n'
                         'overlap_copy = "lm_head"\n',
    "resid_attn_mlp": '[vllm]\nsites = ["residual", "attention_output", "mlp_output"]\n',
    # Issue 40: the query and key after RoPE and the value of 4 of the 16 layers, the copy after the last layer (what
    # vllm.overlap_copy = "auto", the default since session 48, does instead is attn4_overlap).
    "attn4": '[vllm]\nsites = ["attn_q", "attn_k", "attn_v"]\nlayers = [0, 5, 10, 15]\noverlap_copy = false\n',
    # The same with vllm.overlap_copy: the copy submitted on a side stream after layer 15's attention, beside its
    # output projection and MLP (session 43).
    "attn4_overlap": '[vllm]\nsites = ["attn_q", "attn_k", "attn_v"]\nlayers = [0, 5, 10, 15]\noverlap_copy = true\n',
    # Both in full mode (session 49).
    "full_attn4": '[policy]\nmode = "full"\nfull_deadline_ms = 60000\n[vllm]\nsites = ["attn_q", "attn_k", "attn_v"]\n'
                  'layers = [0, 5, 10, 15]\noverlap_copy = false\n',
    "full_attn4_overlap": '[policy]\nmode = "full"\nfull_deadline_ms = 60000\n[vllm]\n'
                          'sites = ["attn_q", "attn_k", "attn_v"]\nlayers = [0, 5, 10, 15]\noverlap_copy = true\n',
    # The same engine and graphs with every hookpoint disabled (the copy kernel runs, publishes nothing, the drain and
    # sink stay idle): what having the capture in the graph costs, apart from moving the rows.
    "attn4_off": '[vllm]\nsites = ["attn_q", "attn_k", "attn_v"]\nlayers = [0, 5, 10, 15]\noverlap_copy = false\n' +
    "".join(
        f'[[hookpoints]]\nname = "layers.{i}.{site}"\nenabled = false\n'
        for i in (0, 5, 10, 15) for site in ("attn_q", "attn_k", "attn_v")),
    "resid_off": '[vllm]\nsites = ["residual"]\noverlap_copy = false\n' + "".join(
        f'[[hookpoints]]\nname = "layers.{i}.resid"\nenabled = false\n' for i in range(16)),
    # Where a capture's cost in the compiled graph comes from (session 42: a disabled capture cost the model's kernels
    # as much as an enabled one), bench only (bench_engine): "_sites", the plugin's structure before session 42 (a
    # capture op at each site noting its tensor, the end op keeping them alive); "_off_nokeep", every hookpoint
    # disabled and the end op given no tensor — compiled code need not compute or keep them, and with no capture the
    # pass launches no copy kernel either (only the step's begin; first run on a GPU in session 43); "_off_keeponly",
    # every hookpoint disabled and the end op keeping the tensors alive without a capture (no copy kernel): whether
    # keeping them or the copy kernel shifts the model's kernels (session 43).
    "attn4_sites": None, "resid_sites": None, "attn4_off_nokeep": None, "resid_off_nokeep": None,
    "attn4_off_keeponly": None, "resid_off_keeponly": None,
    "probes16": None,  # written by bench_config (weights files)
    "eager_hooks": None,
}


def bench_config(out: str, kind: str) -> "str | None":
    head = f'[export]\nparquet = true\ndir = "{out}/dump"\nrun_id = "run"\n[ring]\ncapacity = "2 GiB"\n'
    if kind in ("full_resid", "full_resid_lmhead"):
        head = head.replace("[ring]", "threads = 8\n[ring]")
    if BENCH_CONFIGS.get(kind) is not None:
        return head + BENCH_CONFIGS[kind]
    if kind.endswith(("_off_nokeep", "_off_keeponly", "_sites")):
        return head + BENCH_CONFIGS[kind.rsplit("_", 1)[0]]
    if kind == "probes16":
        import numpy as np

        import ringscope

        body = head + '[vllm]\nsites = ["residual"]\n'
        rng = np.random.default_rng(0)
        for i in range(16):
            w = ringscope.save_probe(os.path.join(out, f"p{i}.npy"),
                                     rng.standard_normal((1, 2048)).astype(np.float32) / 45)["weights"]
            body += (f'[[hookpoints]]\nname = "layers.{i}.resid"\nenabled = false\n'
                     f'[[probes]]\nname = "p{i}"\nhookpoint = "layers.{i}.resid"\nweights = "{w}"\n'
                     f'thresholds = [1e30]\nmode = "fused"\n')
        return body
    return None


def bench_engine(out: str, kind: str):
    """The cost runs' engine: the Llama-3.2-1B shape with dummy weights, the plugin configured for ``kind`` (none for
    "plain"). Returns ``(llm, capture or None)``."""
    from vllm import LLM

    model_dir = os.path.join(out, "model")
    make_1b(model_dir)
    cfg = bench_config(out, kind)
    if cfg is not None:
        os.environ["RINGSCOPE_VLLM_CONFIG"] = write_config(out, cfg)
        if kind.endswith(("_nokeep", "_keeponly", "_sites")):
            change_capture_ops(kind.rsplit("_", 1)[1])
        register_plugin()
    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=64, seed=0, gpu_memory_utilization=0.5, enforce_eager=(kind == "eager_hooks"),
              max_num_batched_tokens=8192)
    if cfg is None:
        return llm, None
    import ringscope.vllm as rv

    return llm, rv.captures()[0]


def change_capture_ops(change: str) -> None:
    """Bench only, before the plugin wraps its model: ``sites`` — the structure before session 42 (a capture op at each
    site, the end op keeping the tensors alive); ``nokeep`` (every hookpoint disabled) — the end op given no tensor;
    ``keeponly`` (every hookpoint disabled) — the end op keeps the tensors alive and makes no capture."""
    import ringscope.vllm as rv
    from ringscope import _engine

    if change == "sites":
        rv._captures_at_end = lambda planned: False
        return
    begin, capture, end, end_capturing, submit_capturing, end_holding = _engine.ops()
    if change == "keeponly":
        # The tensors kept alive to the pass's end as in the capture, no capture made (no copy kernel).
        _engine._OPS = (begin, capture, end, lambda sink, tensors, hookpoints, key: end(sink, tensors, key),
                        submit_capturing, end_holding)
        return
    _engine._OPS = (begin, capture, end, lambda sink, tensors, hookpoints, key: end_capturing(sink, [], [], key),
                    submit_capturing, end_holding)


def decode_prompts(batch: int) -> list:
    """B 16-token prompts, different from each other."""
    return [{"prompt_token_ids": [(31 * b + 7 * i) % 30000 + 10 for i in range(16)]} for b in range(batch)]


def dropped_rows(cap) -> int:
    """Rows the capture dropped so far (every hookpoint; the session flushed first, so that nothing is still on its
    way); 0 without one."""
    if cap is None:
        return 0
    cap.session.flush()
    return sum(cap.session.stats(h)["dropped_rows"] for h in cap.hookpoints.values())


def close_capture(cap, result: dict) -> None:
    """The plugin's counters and the closed sessions' totals into ``result``."""
    if cap is None:
        return
    import ringscope.vllm as rv

    result["counters"] = cap.counters()
    result["closed"] = rv.close_all()


def step_clock(llm) -> list:
    """The start time of every ``execute_model`` call of the engine's model runner from now on (the list returned):
    in a decode-only stretch the time between two starts is one whole engine step — scheduling, the forward pass,
    sampling and output processing — so each decode step is timed on its own (median and p99), not only a
    generate call's average."""
    return start_times(runner_of(llm))


def start_times(obj) -> list:
    """The start time of every call of ``obj.execute_model`` from now on (the list returned; the same list for every
    call on one object)."""
    starts = getattr(obj, "_bench_starts", None)
    if starts is None:
        starts = obj._bench_starts = []
        inner = obj.execute_model

        def timed(*args, **kwargs):
            starts.append(time.perf_counter())
            return inner(*args, **kwargs)
        obj.execute_model = timed  # the instance's attribute: what its caller calls
    return starts


def decode_step_ms(llm, batch: int) -> dict:
    """B requests decoding together: ``avg`` = (time of 160 new tokens - time of 32) / 128 per generate call (ms,
    ``REPS`` values), ``steps`` = every decode step of the 160-token calls timed on its own (ms; the first 8 steps
    of each call, the prefill and the batch filling up, left out)."""
    from vllm import SamplingParams

    prompts = decode_prompts(batch)
    starts = step_clock(llm)
    steps = []

    def t(n):
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        starts.clear()
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        if n == 160:
            steps.extend((b - a) * 1e3 for a, b in zip(starts[8:], starts[9:]))
        return dt
    t(8)  # warm
    avg = [(t(160) - t(32)) / 128 * 1e3 for _ in range(REPS)]
    return {"avg": avg, "steps": steps}


def prefill_s(llm) -> list:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(13 * b + 5 * i) % 30000 + 10 for i in range(2048)]} for b in range(8)]
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = []
    for k in range(REPS + 1):
        # Distinct prompts each time: no prefix-cache hit.
        ps = [{"prompt_token_ids": [x + k + 1 for x in p["prompt_token_ids"]]} for p in prompts]
        t0 = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        out.append(time.perf_counter() - t0)
    return out[1:]


def timed_into(fn, into: list):
    """``fn``, appending the microseconds of every call to ``into``."""
    def f(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append((time.perf_counter() - t0) * 1e6)
    return f


def run_bench(out: str, kind: str, result: dict) -> None:
    t0 = time.time()
    llm, cap = bench_engine(out, kind)
    result["start_s"] = time.time() - t0
    result["engine"] = engine_facts(llm)
    if kind == "eager_hooks":
        model = runner_of(llm).get_model()
        sink = []

        def hook(mod, args, o):
            sink.append((o[0] + o[1]).to("cpu"))  # what a forward-hook tool does: a copy to the host per layer
            if len(sink) > 64:
                sink.clear()
        for layer in model.model.layers:
            layer.register_forward_hook(hook)
    # The plugin's host work before each forward pass (request map, request-id upload, and in full mode the
    # admission), timed in this process: vLLM's decode is host-bound here, so this is on every step's critical path,
    # and unlike a comparison between processes it is measured to the microsecond.
    host = {"prepare": [], "admit": []}
    if os.environ.get("BENCH_HOST_PARTS") and cap is not None:
        # Where the plugin's host time goes, part by part (each wrapper adds ~0.5 us to its part).
        host.update({"arm": [], "upload": [], "request": []})
        cap._arm = timed_into(cap._arm, host["arm"])
        cap._upload = timed_into(cap._upload, host["upload"])
        cap._request = timed_into(cap._request, host["request"])
    if cap is not None:
        cap._prepare = timed_into(cap._prepare, host["prepare"])
        # The admission (full mode) or the control upload (best-effort: returns at once when nothing changed).
        if hasattr(cap, "_before_pass"):
            cap._before_pass = timed_into(cap._before_pass, host["admit"])
        else:  # the plugin before session 32 (for a comparison in one machine): the Session methods
            cap.session.admit_graph_step = timed_into(cap.session.admit_graph_step, host["admit"])
            cap.session.apply_controls = timed_into(cap.session.apply_controls, host["admit"])
    if os.environ.get("BENCH_HOST_PARTS") and cap is not None:
        # What a call costs in this thread, at every pass, cold: before every pass a C call that does nothing
        # (rs_abi_version) and a Python call that does nothing (the ~20 us of the admission / control call against
        # 1-2 us in an idle process, session 25: the library's work, or the calls themselves?).
        import threading

        from ringscope import _abi

        host.update({"ffi_noop": [], "py_noop": []})
        noop_c, noop_py, prepare = _abi._load().rs_abi_version, (lambda: None), cap._prepare

        def probed(*args, **kwargs):
            t0 = time.perf_counter()
            noop_c()
            t1 = time.perf_counter()
            noop_py()
            host["py_noop"].append((time.perf_counter() - t1) * 1e6)
            host["ffi_noop"].append((t1 - t0) * 1e6)
            return prepare(*args, **kwargs)
        cap._prepare = probed
        result["python_threads"] = [t.name for t in threading.enumerate()]
        result["switch_interval_s"] = sys.getswitchinterval()
    result["host_us"] = {}

    # Each phase's drops on their own (the goal is zero at batch 1 and 8).
    result["decode_ms"], result["step_ms"], result["dropped_rows"] = {}, {}, {}
    for b in BATCHES:
        before = dropped_rows(cap)
        for xs in host.values():
            xs.clear()
        d = decode_step_ms(llm, b)
        result["host_us"][b] = {k: {"p50": statistics.median(xs), "p99": sorted(xs)[int(0.99 * len(xs))],
                                    "n": len(xs)} for k, xs in host.items() if xs}
        result["decode_ms"][b] = d["avg"]
        xs = sorted(d["steps"])
        result["step_ms"][b] = {"p50": statistics.median(xs), "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
                                "mean": statistics.fmean(xs), "n": len(xs), "all": [round(x, 4) for x in d["steps"]]}
        result["dropped_rows"][f"decode B={b}"] = dropped_rows(cap) - before
    before = dropped_rows(cap)
    result["prefill_s"] = prefill_s(llm) if not os.environ.get("BENCH_HOST_PARTS") else [float("nan")]
    result["dropped_rows"]["prefill"] = dropped_rows(cap) - before
    close_capture(cap, result)


def run_profile(out: str, kind: str, result: dict) -> None:
    """One engine (``kind`` as in the bench runs), each decode batch size profiled with the PyTorch profiler (CUPTI):
    per engine step, what ran on the GPU and for how long (benches/gpu_trace.py), so that configurations compare on
    the GPU's own clock instead of host-bound step times that differ by 15-90% between processes."""
    import gpu_trace
    from vllm import SamplingParams

    llm, cap = bench_engine(out, kind)
    result["engine"] = engine_facts(llm)
    runner = runner_of(llm)
    runner.execute_model = gpu_trace.marked(runner.execute_model)  # one trace step per engine step
    result["profile"] = {}
    for b in BATCHES:
        prompts = decode_prompts(b)
        for n in (8, 48):  # warm: this batch size's graphs, then a whole call
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        events = gpu_trace.profiled(lambda: llm.generate(
            prompts, SamplingParams(max_tokens=72, temperature=0, ignore_eos=True), use_tqdm=False))
        # The prefill and the first decode steps left out (the same cut as decode_step_ms).
        result["profile"][b] = gpu_trace.summary(gpu_trace.steps_of(events, skip_first=8))
    result["dropped_rows"] = dropped_rows(cap)
    close_capture(cap, result)


# -- driver ------------------------------------------------------------------------------------------------------

def child(out: str, what: str) -> None:
    result = {"what": what}
    try:
        if what.startswith("correct-"):
            # correct-FAMILY[-DTYPE[-VARIANT[-full]]]: "full" as the variant or after it is full mode.
            parts = what.split("#")[0].split("-")
            variant = parts[3] if len(parts) > 3 else ""
            run_correct(out, parts[1], parts[2] if len(parts) > 2 else "bf16", result,
                        full="full" in parts[3:],
                        attn=variant in ("attn", "attnov", "attnovmid", "attnheld"),
                        eager=variant == "eager",
                        opt_in=variant in ("optin", "optinresid"),
                        # optinresid: the residual alone, whose captures are deferred (one copy kernel per pass);
                        # heldresid: the same, its copy held out of vLLM's graphs (overlap_copy = "lm_head").
                        sites='["residual"]' if variant in ("optinresid", "heldresid") else None,
                        overlap=("true" if variant in ("attnov", "attnovmid") else
                                 '"lm_head"' if variant in ("heldresid", "attnheld") else "false"),
                        # q/k/v of layers 0-2 of 4: the step ends before layer 3's attention.
                        layers="[0, 1, 2]" if variant == "attnovmid" else '"all"')
        elif what.startswith("prof-"):
            run_profile(out, what.split("-", 1)[1].rsplit("#", 1)[0], result)
        else:
            run_bench(out, what.split("-", 1)[1].rsplit("#", 1)[0], result)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def run_child(root: str, what: str, timeout: int = 900, script: str = __file__, env: "dict | None" = None,
              extra_args: tuple = (), drop_dump: str = "bench-") -> dict:
    """Runs ``script child OUT WHAT`` (this file's, or another bench script's) in a process of its own with an
    in-process engine core (``env``: the environment, default this one's), its output in ``ROOT/WHAT/engine.log``;
    returns its ``result.json``. The dump of a run whose name starts with ``drop_dump`` is removed after it."""
    out = os.path.join(root, what.replace("#", "_"))
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    env = dict(os.environ if env is None else env, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("RINGSCOPE_VLLM_CONFIG", None)
    with open(os.path.join(out, "engine.log"), "w") as log:
        p = subprocess.run([sys.executable, script, "child", out, what, *extra_args], stdout=log,
                           stderr=subprocess.STDOUT, env=env, timeout=timeout)
    try:
        res = json.load(open(os.path.join(out, "result.json")))
    except OSError:
        res = {"error": f"no result (exit {p.returncode})"}
    res["seconds"] = time.time() - t0
    res["out"] = out
    if what.startswith(drop_dump):
        import shutil

        shutil.rmtree(os.path.join(out, "dump"), ignore_errors=True)  # gigabytes of rows nobody reads
    if res.get("error"):
        print(f"== {what}: ERROR {res['error']}\n{res.get('traceback', '')[-3000:]}", flush=True)
        print(open(os.path.join(out, "engine.log")).read()[-4000:], flush=True)
    return res


def main(cmd: str, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    # A report already in ROOT (an earlier call cut short by a time limit) is continued: what it holds is not run again.
    path = os.path.join(root, "report.json")
    report = json.load(open(path)) if os.path.exists(path) else {}
    report.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    correct = ["correct-llama", "correct-qwen2", "correct-llama-f32", "correct-llama#2"]
    bench = ["bench-plain#1", "bench-resid", "bench-plain#2", "bench-resid_attn_mlp", "bench-probes16",
             "bench-plain#3", "bench-eager_hooks"]
    # Full mode (issue 36): correctness with a small ring, then plain and full interleaved, three recordings each.
    full = ["correct-llama-bf16-full", "bench-plain#1", "bench-full_resid#1", "bench-plain#2", "bench-full_resid#2",
            "bench-plain#3", "bench-full_resid#3"]
    # The plugin's own host time per forward pass, full and best-effort mode (recorded by every bench run with the
    # plugin; this runs only those two).
    host = ["bench-full_resid#4", "bench-resid#4"]
    todo = {"all": correct[:1] + bench[:5] + correct[1:2] + bench[5:] + correct[2:], "correct": correct,
            "bench": bench, "full": full, "host": host, "fullcorrect": full[:1],
            # The same, with the plugin's host time split into its parts and no prefill phase (BENCH_HOST_PARTS=1).
            "parts": ["bench-full_resid#5", "bench-resid#5"],
            # Issue 40: attention sites against Hugging Face (f32), then their cost with plain recordings around.
            "attention": ["correct-llama-f32-attn", "bench-plain#1", "bench-attn4#1", "bench-plain#2",
                          "bench-attn4#2", "bench-plain#3"],
            # The correctness run alone, again (run with NVIDIA_TF32_OVERRIDE=0: vLLM's float32 GEMMs then run in full
            # float32 on the GPU, as Hugging Face's reference on the CPU does, instead of TF32).
            "attention_correct": ["correct-llama-f32-attn#2"],
            # Per engine step on the GPU's clock (PyTorch profiler): plain, q/k/v of 4 layers, the residual of all 16.
            "profile": ["prof-plain#1", "prof-attn4", "prof-resid", "prof-plain#2"],
            # Deferred captures (one copy kernel per pass): correctness (compiled, eager, q/k/v rebuilt against
            # Hugging Face, full mode with a ring that laps), then the profiles with a second plain engine (the GPU
            # clock's resolution).
            "deferred": ["correct-llama", "correct-llama-bf16-eager", "correct-llama-f32-attn",
                         "correct-llama-bf16-full", "prof-plain#1",
                         "prof-attn4", "prof-resid", "prof-resid_attn_mlp", "prof-plain#2"],
            # The profiles alone, full mode included (issue 36): two plain engines around the captures.
            "profiles": ["prof-plain#1", "prof-attn4", "prof-resid", "prof-full_resid", "prof-plain#2"],
            # The q/k/v profile alone between two plain engines (issue 40's cost, again).
            "attn_profiles": ["prof-plain#1", "prof-attn4", "prof-plain#2"],
            # Where the model's kernels' extra time in a capturing engine comes from (session 41): each capture next to
            # the same engine with its hookpoints disabled (same graphs, nothing published), between two plain engines.
            "off_profiles": ["prof-plain#1", "prof-attn4", "prof-attn4_off", "prof-resid", "prof-resid_off",
                             "prof-plain#2"],
            # Where a capture's cost in the compiled graph comes from (session 42), q/k/v of 4 layers and the residual
            # of 16 each in a call of their own (~5 minutes): the capture, the same with the structure before session
            # 42, disabled (kept tensors and the copy kernel), disabled with nothing kept and no copy kernel, between
            # two plain engines.
            **{f"cut_profiles_{c}": ["prof-plain#1", f"prof-{c}", f"prof-{c}_sites", f"prof-{c}_off",
                                     f"prof-{c}_off_nokeep", "prof-plain#2"] for c in ("attn4", "resid")},
            # vllm.overlap_copy's cost alone (a short call): beside plain, then beside the capture without it.
            "overlap_cost": ["prof-plain#1", "prof-attn4_overlap", "prof-attn4", "prof-plain#2"],
            # The same in full mode (session 49).
            "full_overlap_cost": ["prof-plain#1", "prof-full_attn4_overlap", "prof-full_attn4", "prof-plain#2"],
            # Session 50, vllm.overlap_copy = "lm_head": the residual of every layer against Hugging Face with the copy
            # held out of the graphs (best-effort; full mode with a ring that laps), q/k/v rebuilt the same way; then
            # the residual's cost in full mode with it and without, and in best-effort mode with it, between two plain
            # engines.
            "lmhead_correct": ["correct-llama-bf16-heldresid", "correct-llama-bf16-heldresid-full",
                               "correct-llama-f32-attnheld"],
            # The full-mode pair again, alone (a second sample of the same comparison).
            "lmhead_full_cost": ["prof-plain#1", "prof-full_resid_lmhead", "prof-full_resid", "prof-plain#2"],
            "lmhead_qkv_cost": ["prof-plain#1", "prof-attn4_lmhead", "prof-attn4_overlap", "prof-plain#2"],
            "lmhead_cost": ["prof-plain#1", "prof-full_resid_lmhead", "prof-full_resid", "prof-resid_lmhead",
                            "prof-plain#2"],
            # The overlap_copy rebuilds alone (session 47: on the H200; session 48: full mode too).
            # The third: the same in full mode, its 512 KiB ring lapping (each pass admitted before its copy is
            # submitted on the side stream; first run in session 49, on an H100).
            "overlap_correct": ["correct-llama-f32-attnov", "correct-llama-f32-attnovmid",
                                "correct-llama-f32-attnov-full"],
            # Session 47: neither a graph's padding rows nor the rows of requests that did not opt in are exported —
            # rows copied at their sites (best-effort; opt-in; full mode with a ring that laps) and deferred (q/k/v,
            # with overlap_copy).
            "padding": ["correct-llama", "correct-llama-bf16-optin", "correct-llama-bf16-optinresid",
                        "correct-llama-bf16-full", "correct-llama-f32-attnovmid"],
            # The same, short (a call with little device time left): opt-in, rows copied at their sites and deferred.
            "padding_short": ["correct-llama-bf16-optin", "correct-llama-bf16-optinresid"],
            # Session 43: vllm.overlap_copy — q/k/v rebuilt against Hugging Face with the copy on a side stream, then
            # its cost beside the same capture without it, between two plain engines, then the middle layer's rebuild
            # (last: what a call cut short by a time limit still has is the main answers).
            "overlap": ["correct-llama-f32-attnov", "prof-plain#1", "prof-attn4_overlap", "prof-attn4", "prof-plain#2",
                        "correct-llama-f32-attnovmid"],
            # Session 43: the capture and, disabled, keeping the tensors without a copy kernel between two plain
            # engines, then disabled with the copy kernel and with neither (~5 minutes a call; what comes first is
            # what a call cut short by a time limit still has).
            **{f"keep_profiles_{c}": ["prof-plain#1", f"prof-{c}", f"prof-{c}_off_keeponly", "prof-plain#2",
                                      f"prof-{c}_off", f"prof-{c}_off_nokeep"] for c in ("attn4", "resid")}}[cmd]
    if cmd == "parts":
        os.environ["BENCH_HOST_PARTS"] = "1"
    for what in todo:
        if isinstance(report.get(what), dict) and not report[what].get("error"):
            continue
        res = run_child(root, what)
        if what.startswith("correct-") and not res.get("error"):
            try:
                res["check"] = (check_attention if res.get("attention") else check_correct)(res["out"], res)
            except Exception as e:
                res["check"] = {"ok": False, "problems": [f"{type(e).__name__}: {e}"],
                                "traceback": traceback.format_exc()}
        report[what] = {k: v for k, v in res.items() if k not in ("requests",)}
        brief = dict(res.get("check", {}), stalls=res.get("stalls")) if what.startswith("correct-") else \
            {b: {k: p.get(k) for k in ("wall_us", "busy_us", "kernel_us", "n", "other_us")}
             for b, p in res.get("profile", {}).items()} if what.startswith("prof-") else \
            {k: res.get(k) for k in ("decode_ms", "prefill_s", "start_s", "engine")}
        print(f"== {what} ({res['seconds']:.0f} s): {json.dumps(brief, default=str)[:1500]}", flush=True)
        summarize(report, quiet=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    summarize(report)


def summarize_profiles(report: dict, quiet: bool = False) -> None:
    """Each profiled configuration against the first plain one, per batch size: the medians' differences per engine
    step (wall, GPU busy, kernel time, activity count) and the kernels it adds (benches/gpu_trace.py)."""
    import gpu_trace

    base = report.get("prof-plain#1", {}).get("profile")
    if not base:
        return
    out = {}
    for k, v in report.items():
        if k.startswith("prof-") and k != "prof-plain#1" and isinstance(v, dict) and v.get("profile"):
            out[k] = {b: gpu_trace.diff(base[b], v["profile"][b]) for b in base if b in v["profile"]}
    report["profile_diff"] = out
    for k, per_b in ({} if quiet else out).items():
        for b, d in per_b.items():
            print(f"{k} B={b}: " + ", ".join(f"{m} {d[m]:+.1f}" for m in ("wall_us", "busy_us", "kernel_us", "n",
                                                                          "other_us") if m in d)
                  + "; added: " + json.dumps(dict(list(d["by_name"].items())[:8]))[:1200], flush=True)


def summarize(report: dict, quiet: bool = False) -> None:
    summarize_profiles(report, quiet)
    plains = [v for k, v in report.items() if k.startswith("bench-plain") and isinstance(v, dict) and "decode_ms" in v]
    if not plains:
        return
    lines = []
    base = {b: statistics.median([statistics.median(p["decode_ms"][str(b)] if str(b) in p["decode_ms"]
                                                    else p["decode_ms"][b]) for p in plains]) for b in BATCHES}
    spread = {b: (max(statistics.median(p["decode_ms"].get(str(b), p["decode_ms"].get(b))) for p in plains) /
                  min(statistics.median(p["decode_ms"].get(str(b), p["decode_ms"].get(b))) for p in plains) - 1)
              for b in BATCHES}
    pbase = statistics.median([statistics.median(p["prefill_s"]) for p in plains])
    lines.append("decode step, median ms (ratio to the median of the plain recordings); prefill 8x2048 s (ratio)")
    lines.append("plain spread (max/min of the plain recordings - 1): " +
                 ", ".join(f"B={b}: {spread[b] * 100:.1f}%" for b in BATCHES))
    for k, v in report.items():
        if not k.startswith("bench-") or not isinstance(v, dict) or "decode_ms" not in v:
            continue
        cells = []
        for b in BATCHES:
            xs = v["decode_ms"].get(str(b), v["decode_ms"].get(b))
            m = statistics.median(xs)
            cells.append(f"B={b}: {m:.3f} ({(m / base[b] - 1) * 100:+.1f}%)")
        pm = statistics.median(v["prefill_s"])
        cells.append(f"prefill {pm:.3f} s ({(pm / pbase - 1) * 100:+.1f}%)")
        cells.append(f"dropped rows {v.get('dropped_rows')}")
        lines.append(f"{k}: " + "; ".join(cells))
    # Per-step decode times (step_ms): each configuration's p50 and p99 against the median of the plain recordings',
    # with the plain recordings' own spread (max/min - 1) as the comparison's resolution.
    plains = [p for p in plains if "step_ms" in p]
    if plains:
        def stat(v, b, q):
            return (v["step_ms"].get(str(b)) or v["step_ms"].get(b))[q]
        lines.append("decode step timed per step (ms): p50 / p99 (ratio to the plain recordings' median); "
                     "resolution = plain spread")
        lines.append("plain spread p50 / p99: " + ", ".join(
            f"B={b}: {(max(stat(p, b, 'p50') for p in plains) / min(stat(p, b, 'p50') for p in plains) - 1) * 100:.2f}%"
            f" / {(max(stat(p, b, 'p99') for p in plains) / min(stat(p, b, 'p99') for p in plains) - 1) * 100:.2f}%"
            for b in BATCHES))
        for k, v in report.items():
            if not k.startswith("bench-") or not isinstance(v, dict) or "step_ms" not in v:
                continue
            cells = []
            for b in BATCHES:
                p50, p99 = stat(v, b, "p50"), stat(v, b, "p99")
                b50 = statistics.median([stat(p, b, "p50") for p in plains])
                b99 = statistics.median([stat(p, b, "p99") for p in plains])
                cells.append(f"B={b}: {p50:.3f} ({(p50 / b50 - 1) * 100:+.2f}%) / {p99:.3f} ({(p99 / b99 - 1) * 100:+.2f}%)")
            lines.append(f"{k} steps: " + "; ".join(cells))
    for k, v in report.items():
        if k.startswith("bench-") and isinstance(v, dict) and v.get("host_us"):
            lines.append(f"{k} plugin host time per forward pass, us p50/p99: " + "; ".join(
                f"B={b}: " + ", ".join(f"{name} {x['p50']:.1f}/{x['p99']:.1f}" for name, x in h.items())
                for b, h in v["host_us"].items()))
    report["summary"] = lines
    if not quiet:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
