"""ringscope's SGLang plugin on a GPU: what its CUDA path costs per decode step against plain SGLang, measured in the
same call (numbers: docs/gpu-benchmarks.md, session 46).

    python benches/sglang_gpu.py cost OUT_DIR                  # plain, resid16, resid16_now, plain (see below)
    python benches/sglang_gpu.py one KIND OUT_DIR RESULT_JSON  # one engine (what `cost` runs, each in a process of
                                                               # its own)

RINGSCOPE_SGLANG_BENCH_KINDS=plain,resid1,resid16,plain (say) runs other engines in that order.
RINGSCOPE_SGLANG_BENCH_SMOKE=1 runs the same code on the CPU with a tiny model, two small batches and short
generations (SGLANG_USE_CPU_ENGINE=1 and tests/sglang/stub on the path, as tests/engine.sh sets them): a check of
the script, not a measurement.

Needs SGLang with its CUDA kernels (written for 0.5.17, the GPU machine's), a CUDA GPU, and the ringscope package
importable (the source tree's ``ffi/python`` with RINGSCOPE_LIB naming a built library, or the installed package). The
model: the Llama-3.2-1B shape (16 layers, hidden 2048, bf16) with SGLang's dummy weights, 16-token prompts, greedy,
``ignore_eos``; SGLang's defaults otherwise (its overlap scheduler, its fused CUDA ops), triton attention, the pytorch
sampler, decode CUDA graphs recorded for exactly the batch sizes measured and none for prefill (the engine starts in
seconds, and only decode steps are timed). One decode step = (time of 160 new tokens - time of 32) / 128 for B
requests at once, the median of ``REPS`` (host time around ``Engine.generate``: everything a user waits for). Engines:

- ``plain``: no ringscope (run before and after the others: the two give the comparison's resolution);
- ``resid16``: the plugin's CUDA path (``RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA=1``) capturing the residual stream after
  each of the 16 layers into Parquet with its CUDA defaults: best-effort, deferred captures (one copy kernel per
  forward pass); its summary's counters (rows produced, exported, dropped) are reported beside its times;
- ``resid16_now``: the same with ``ring.defer_captures = false`` (one copy kernel per capture). Both served the same
  calls: every row of layers 0, 7 and 15 is compared between the two runs, bit for bit, by (request, position);
- ``resid1``: the residual after layer 7 only (not run by default).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from vllm_gpu import make_1b  # noqa: E402  (stdlib only at import)
from vllm_tp import plugin_entry_point  # noqa: E402
SMOKE = os.environ.get("RINGSCOPE_SGLANG_BENCH_SMOKE") == "1"
REPS = 1 if SMOKE else 3
BATCHES = (1, 2) if SMOKE else (1, 8, 64)
SHORT, LONG = (4, 8) if SMOKE else (32, 160)
RESID = '[export]\nparquet = true\ndir = "{{dump}}"\nrun_id = "run"\n[sglang]\nsites = ["residual"]\nlayers = {layers}\n'
KINDS = {
    "plain": None,
    "resid16": RESID.format(layers='"all"'),
    # The same capture with one copy kernel per capture instead of one per forward pass (the plugin's default on CUDA):
    # what deferring saves, and its rows compared with resid16's (the same requests, bit for bit).
    "resid16_now": RESID.format(layers='"all"') + '[ring]\ndefer_captures = false\n',
    "resid1": RESID.format(layers="[1]" if SMOKE else "[7]"),
}
ORDER = os.environ.get("RINGSCOPE_SGLANG_BENCH_KINDS", "plain,resid16,resid16_now,plain").split(",")
#: Hookpoints whose rows `cost` compares between resid16 and resid16_now (every row of each).
COMPARED = ("layers.0.resid", "layers.1.resid") if SMOKE else ("layers.0.resid", "layers.7.resid", "layers.15.resid")


def make_model(path: str) -> None:
    """config.json of the Llama-3.2-1B shape (served with load_format="dummy"); a tiny one for the smoke check."""
    make_1b(path)
    if SMOKE:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)


def one(kind: str, out: str) -> dict:
    """One engine of ``kind``: its decode step at each batch size (and the plugin's counters)."""
    import sglang as sgl

    model = os.path.join(out, "model-1b")
    make_model(model)
    device = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True, dtype="float32") if SMOKE \
        else dict(attention_backend="triton", sampling_backend="pytorch", dtype="bfloat16",
                  cuda_graph_bs_decode=list(BATCHES), cuda_graph_backend_prefill="disabled")
    engine = sgl.Engine(model_path=model, load_format="dummy", skip_tokenizer_init=True, mem_fraction_static=0.5,
                        random_seed=0, log_level="warning", **device)
    res: dict = {"kind": kind, "decode_ms": {}, "rounds_ms": {}}
    try:
        prompt = list(range(100, 116))
        for b in BATCHES:
            def timed(n: int) -> float:
                t = time.perf_counter()
                outs = engine.generate(input_ids=[prompt] * b, sampling_params={
                    "max_new_tokens": n, "temperature": 0, "ignore_eos": True})
                dt = time.perf_counter() - t
                assert all(len(o["output_ids"]) == n for o in outs), [len(o["output_ids"]) for o in outs]
                return dt
            timed(LONG)  # warm-up: graphs replayed, allocator settled
            steps = []
            for _ in range(REPS):
                steps.append((timed(LONG) - timed(SHORT)) / (LONG - SHORT) * 1e3)
            res["rounds_ms"][str(b)] = steps
            res["decode_ms"][str(b)] = statistics.median(steps)
            rounds = ", ".join(f"{s:.3f}" for s in steps)
            print(f"{kind}: B={b} decode step {res['decode_ms'][str(b)]:.3f} ms ({rounds})", flush=True)
    finally:
        engine.shutdown()
    if KINDS[kind] is not None:
        side = os.path.join(out, f"dump-{kind}", "run", "_ringscope_sglang", "summary.json")
        with open(side) as f:
            summary = json.load(f)
        s = summary["session"]
        res["session"] = {k: s.get(k) for k in ("produced_rows", "exported_rows", "dropped_rows", "sampled_out_rows")}
        res["plugin"] = {k: summary["plugin"].get(k) for k in ("steps", "steps_captured", "padding_rows", "lost_rows",
                                                               "disabled")}
    return res


def _rows_by_request(run: str, hookpoint: str) -> dict:
    """``{(the request's ordinal in the run, position): sorted row bytes}`` of one hookpoint (the ordinal: the request's
    place in the plugin's requests.jsonl, the same in two engines served the same calls; its id is a hash of SGLang's
    random rid). A position may have two rows: 0.5.17's overlap scheduler runs a finished request's last token again."""
    try:
        import ringscope
    except ImportError:  # the source tree's package (as the engines' processes have it)
        sys.path.insert(0, os.path.join(ROOT, "ffi", "python"))
        import ringscope

    ordinal = {}
    with open(os.path.join(run, "_ringscope_sglang", "requests.jsonl")) as f:
        for line in f:
            ordinal.setdefault(json.loads(line)["request_id"], len(ordinal))
    d = ringscope.read_dump(run, hookpoint=hookpoint)[hookpoint]
    rows: dict = {}
    for rid, pos, act in zip(d["request_id"].tolist(), d["position"].tolist(), d["activation"]):
        if rid in ordinal:  # rows of no request (a graph's padding) are left out
            rows.setdefault((ordinal[rid], pos), []).append(act.tobytes())
    return {k: sorted(v) for k, v in rows.items()}


def compare_rows(out: str, a: str, b: str) -> dict:
    """Every row of :data:`COMPARED` in engine ``a``'s run against engine ``b``'s: rows, rows that differ (bit for bit),
    (request, position) keys found in one run only."""
    res = {"hookpoints": list(COMPARED), "rows": 0, "differ": 0, "keys_in_one_only": 0}
    for h in COMPARED:
        ra, rb = (_rows_by_request(os.path.join(out, f"dump-{k}", "run"), h) for k in (a, b))
        res["keys_in_one_only"] += len(ra.keys() ^ rb.keys())
        for k in ra.keys() & rb.keys():
            res["rows"] += len(ra[k])
            res["differ"] += sum(x != y for x, y in zip(ra[k], rb[k])) + abs(len(ra[k]) - len(rb[k]))
    return res


def cost(out: str) -> dict:
    """The engines of :data:`ORDER` (plain, resid16, resid16_now, plain), each in a process of its own; a report with
    each one's ratio to the plain ones', and resid16's rows compared with resid16_now's."""
    report: dict = {"engines": []}
    tmp = tempfile.mkdtemp(prefix="ringscope-sglang-bench-")
    for i, kind in enumerate(ORDER):
        env = dict(os.environ)
        env.pop("RINGSCOPE_SGLANG_CONFIG", None)
        if KINDS[kind] is not None:
            cfg = os.path.join(out, f"{kind}.toml")
            with open(cfg, "w") as f:
                f.write(KINDS[kind].format(dump=os.path.join(out, f"dump-{kind}")))
            env["RINGSCOPE_SGLANG_CONFIG"] = cfg
            env["RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA"] = "1"
        ep = plugin_entry_point(tmp, "sglang", "sglang.srt.plugins")
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(ROOT, "ffi", "python")] + [x for x in (ep, env.get("PYTHONPATH")) if x])
        res_file = os.path.join(out, f"{i}-{kind}.json")
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "one", kind, out, res_file], env=env,
                           capture_output=True, text=True)
        with open(os.path.join(out, f"{i}-{kind}.log"), "w") as f:
            f.write(p.stdout + p.stderr)
        if p.returncode != 0 or not os.path.exists(res_file):
            report["engines"].append({"kind": kind, "error": (p.stdout + p.stderr)[-3000:]})
            print(f"{kind}: failed (exit {p.returncode}); log tail:\n{(p.stdout + p.stderr)[-3000:]}", flush=True)
            continue
        with open(res_file) as f:
            report["engines"].append(json.load(f))
    plains = [e for e in report["engines"] if e["kind"] == "plain" and "decode_ms" in e]
    for e in report["engines"]:
        if "decode_ms" not in e or not plains:
            continue
        e["vs_plain_pct"] = {b: [round((e["decode_ms"][b] / p["decode_ms"][b] - 1) * 100, 2) for p in plains]
                             for b in e["decode_ms"]}
        print(f"{e['kind']}: against each plain engine, % per decode step: {e['vs_plain_pct']}", flush=True)
    done = {e["kind"] for e in report["engines"] if "decode_ms" in e}
    if {"resid16", "resid16_now"} <= done:
        report["deferred_vs_immediate_rows"] = compare_rows(out, "resid16", "resid16_now")
        print(f"rows of resid16 (deferred) against resid16_now: {report['deferred_vs_immediate_rows']}", flush=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv) -> int:
    unknown = [k for k in ORDER if k not in KINDS]
    if unknown:
        print(f"RINGSCOPE_SGLANG_BENCH_KINDS: unknown engine(s) {', '.join(map(repr, unknown))} (known: "
              f"{', '.join(KINDS)})", file=sys.stderr)
        return 2
    if len(argv) >= 3 and argv[1] == "cost":
        os.makedirs(argv[2], exist_ok=True)
        cost(argv[2])
        return 0
    if len(argv) == 5 and argv[1] == "one" and argv[2] in KINDS:
        res = one(argv[2], argv[3])
        with open(argv[4], "w") as f:
            json.dump(res, f, indent=1)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
