"""Tensor parallelism on GPUs (issue 39): vLLM with ``tensor_parallel_size=2`` (the multiprocessing executor: a worker
process per rank, each on its own GPU), CUDA graphs on (vLLM's default: torch.compile + FULL_AND_PIECEWISE graphs),
ringscope's plugin in every rank's worker.

    python benches/vllm_tp.py correct OUT_DIR   # vllm.ranks = "all" and [0]: one run directory, rank=R partitions,
                                                # each rank's rows against Hugging Face, the ranks' rows bit-identical,
                                                # read_dump and inspect --verify over the run
    python benches/vllm_tp.py cost OUT_DIR      # decode steps at B = 1 / 8 / 64: plain TP=2 against ranks [0] and
                                                # "all" (residual of all 16 layers), interleaved, each engine its own
                                                # process: per step on the host clock and on each rank's GPU clock
    python benches/vllm_tp.py all OUT_DIR       # both
    python benches/vllm_tp.py correct OUT_DIR --cpu-check   # the same script on vLLM's CPU build (two CPU ranks
                                                # over gloo): checks the script, not the GPU path

The plugin reaches the worker processes through vLLM's ``vllm.general_plugins`` entry point: installed with the
package (``pip install ./ffi/python``) or, when only the source tree and a built library are there (RINGSCOPE_LIB),
declared here by a distribution's metadata in OUT_DIR put on the workers' PYTHONPATH (as tests/engine.sh does).
``inspect --verify`` is found through RINGSCOPE_INSPECT or the cargo target directory. NVLink multicast stays off in
every process started here (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set).

Correctness ("correct-*"): the scenario of benches/vllm_gpu.py (a small random bf16 Llama checkpoint, 19 requests,
chunked prefill in 64-token chunks, prefix caching) with the residual of every layer captured. After the all-reduce
every rank holds the same residual stream, so the ranks' rows must be equal bit for bit, and each rank's rows must
be exactly its requests' computed positions with values within ``vllm_gpu.TOLERANCE`` of a float32 Hugging Face
forward pass of the same checkpoint.

Cost ("cost-*"): the Llama-3.2-1B shape with dummy weights (benches/vllm_gpu.py's), 16-token prompts, greedy,
``ignore_eos``. Per batch size: every decode step timed on its own (the time between two starts of the engine
core's ``execute_model``; the first 8 steps of a call left out; ``REPS`` calls of 160 tokens), then a 72-token call
profiled in each worker (PyTorch profiler, benches/gpu_trace.py: each rank's GPU busy time per engine step), and the
rows each rank dropped in that batch size's phase. Step times of engines in different processes differ by more than
the effect measured here (benches/vllm_gpu.py found 15-90% between plain engines on one GPU), so each configuration
runs twice, interleaved with the plain engine, and the GPU clock is the finer measure.
"""

import json
import os
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vllm_gpu  # noqa: E402

ROOT = os.path.dirname(HERE)
BATCHES = (1, 8, 64)
REPS = 3
CPU_CHECK = "--cpu-check" in sys.argv
NCCL_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RANKS = {"all": 'ranks = "all"', "rank0": "ranks = [0]"}


def plugin_config(out: str, ranks: str, cost: bool) -> str:
    """The residual of every layer into Parquet. Cost runs: a 2 GiB ring and 8 sink threads per rank (B = 64 brings
    ~4 MiB of rows per step and rank; a drop at B = 1 or 8 fails issue 39's goal)."""
    big = cost and not CPU_CHECK
    ring = '[ring]\ncapacity = "2 GiB"\n' if big else '[ring]\ncapacity = "256 MiB"\n'
    threads = "threads = 8\n" if big else ""
    return (f'[export]\nparquet = true\ndir = "{out}/dump"\nrun_id = "run"\n{threads}{ring}'
            f'[vllm]\nsites = ["residual"]\nlayers = "all"\n{RANKS[ranks]}\n')


def engine_args() -> dict:
    """What every engine here shares: two tensor-parallel ranks in worker processes of their own."""
    args = dict(tensor_parallel_size=2, distributed_executor_backend="mp", skip_tokenizer_init=True, seed=0)
    if not CPU_CHECK:
        args["gpu_memory_utilization"] = 0.5
    return args


def facts(llm) -> dict:
    cfg = llm.llm_engine.vllm_config
    cc = cfg.compilation_config
    return {"vllm": __import__("vllm").__version__, "tensor_parallel_size": cfg.parallel_config.tensor_parallel_size,
            "compilation_mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode)}


def shutdown(llm) -> float:
    """Stops the engine's workers (each closes its ringscope session as it exits); returns the seconds it took."""
    t = time.time()
    llm.llm_engine.engine_core.shutdown()
    return time.time() - t


# -- in the workers (through LLM.collective_rpc; each receives its worker) ----------------------------------------

def _w_mark(worker) -> int:
    """Each engine step of this rank one step of a trace (benches/gpu_trace.py); returns the rank."""
    import gpu_trace

    runner = worker.model_runner
    if not getattr(runner, "_bench_marked", False):
        runner.execute_model = gpu_trace.marked(runner.execute_model)
        runner._bench_marked = True
    return worker.rank


def _w_start(worker) -> None:
    import gpu_trace

    worker._bench_prof = gpu_trace.start()


def _w_stop(worker, skip_first: int) -> dict:
    """This rank's GPU time per engine step since :func:`_w_start` (benches/gpu_trace.py's summary, kernel lists
    trimmed)."""
    import gpu_trace

    events = gpu_trace.stop(worker._bench_prof)
    s = gpu_trace.summary(gpu_trace.steps_of(events, skip_first=skip_first))
    s.pop("by_name", None)
    # The engine steps the trace marked (steps with no GPU activity, as on a CPU, are not in the summary).
    marks = sum(1 for e in events if e.get("cat") == "user_annotation" and e.get("name") == gpu_trace.MARKER)
    return dict(s, rank=worker.rank, marked_steps=marks)


def _w_dropped(worker) -> dict:
    """This rank's ringscope counters: rows exported and dropped so far (after a flush), or none without a capture."""
    import ringscope.vllm as rv

    caps = rv.captures()
    if not caps:
        return {"rank": worker.rank, "capturing": False}
    dropped = vllm_gpu.dropped_rows(caps[0])  # flushes first
    exported = sum(caps[0].session.stats(h)["exported_rows"] for h in caps[0].hookpoints.values())
    return {"rank": worker.rank, "capturing": True, "dropped_rows": dropped, "exported_rows": exported}


# -- correctness ---------------------------------------------------------------------------------------------------

def run_correct(out: str, ranks: str, result: dict) -> None:
    from vllm import LLM

    model_dir = os.path.join(out, "model")
    vllm_gpu.make_checkpoint(model_dir, "llama")
    dtype = "f32" if CPU_CHECK else "bf16"
    result["dtype"] = dtype
    os.environ["RINGSCOPE_VLLM_CONFIG"] = vllm_gpu.write_config(out, plugin_config(out, ranks, cost=False))
    llm = LLM(model=model_dir, dtype="float32" if CPU_CHECK else "bfloat16", max_model_len=1024, max_num_seqs=16,
              max_num_batched_tokens=64, enable_chunked_prefill=True, enable_prefix_caching=True, **engine_args())
    result["engine"] = facts(llm)
    result["requests"] = vllm_gpu.serve_correctness_requests(llm, "llama")
    result["dropped"] = llm.collective_rpc(_w_dropped)
    result["shutdown_s"] = shutdown(llm)
    result["run_dir"] = os.path.join(out, "dump", "run")


def inspect_binary() -> "str | None":
    candidates = [os.environ.get("RINGSCOPE_INSPECT")]
    for target in (os.environ.get("CARGO_TARGET_DIR"), os.path.join(ROOT, "target")):
        if target:
            candidates += [os.path.join(target, "release", "inspect"), os.path.join(target, "debug", "inspect")]
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def check_tp(out: str, ranks: str, result: dict) -> dict:
    """The run's layout (rank partitions, a manifest and side files per rank), each rank's rows against Hugging Face
    (vllm_gpu.check_correct), the ranks' rows bit-identical, and ``inspect --verify``."""
    import numpy as np

    import ringscope

    run = result["run_dir"]
    want_ranks = [0, 1] if ranks == "all" else [0]
    bad = []
    dump = ringscope.read_dump(run)
    for name, cols in dump.items():
        parts = sorted(p for p in os.listdir(os.path.join(run, f"hookpoint={name}")))
        if parts != [f"rank={r}" for r in want_ranks]:
            bad.append(f"{name}: partitions {parts}")
        if sorted(set(cols["rank"].tolist())) != want_ranks:
            bad.append(f"{name}: rows of ranks {sorted(set(cols['rank'].tolist()))}")
    manifests = sorted(f for f in os.listdir(run) if f.startswith("_ringscope_run"))
    want_manifests = ["_ringscope_run.json"] + [f"_ringscope_run.rank={r}.json" for r in want_ranks if r]
    if manifests != want_manifests:
        bad.append(f"manifests {manifests}, expected {want_manifests}")
    per_rank = {}
    for r in want_ranks:
        c = vllm_gpu.check_correct(out, result, rank=r)
        per_rank[r] = {k: c[k] for k in ("rows_checked", "no_request_rows", "worst_relative_error", "tolerance")}
        bad += [f"rank {r}: {p}" for p in c["problems"]]
    identical = None
    if len(want_ranks) == 2:
        identical = True
        for name, cols in dump.items():
            keys, acts = [], []
            for r in (0, 1):
                m = cols["rank"] == r
                order = np.lexsort((cols["position"][m], cols["request_id"][m], cols["step"][m]))
                keys.append(np.stack([cols["step"][m][order], cols["request_id"][m][order],
                                      cols["position"][m][order]], axis=1))
                acts.append(np.asarray(cols["activation"][m][order]))
            if not (len(keys[0]) and np.array_equal(keys[0], keys[1]) and np.array_equal(acts[0], acts[1])):
                identical = False
                bad.append(f"{name}: the ranks' rows differ ({len(keys[0])} and {len(keys[1])} rows)")
    inspect = inspect_binary()
    verify = None
    if inspect is None:
        bad.append("no inspect binary (cargo build --release -p ringscope-inspect, or set RINGSCOPE_INSPECT)")
    else:
        p = subprocess.run([inspect, "--verify", run], capture_output=True, text=True)
        verify = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-1500:]}
        if p.returncode != 0:
            bad.append(f"inspect --verify exited {p.returncode}")
    return {"ranks": want_ranks, "per_rank": per_rank, "ranks_bit_identical": identical, "verify": verify,
            "problems": bad, "ok": not bad}


# -- cost ----------------------------------------------------------------------------------------------------------

def step_clock(llm) -> list:
    """The start time of every ``execute_model`` call of the engine core's executor from now on: in a decode-only
    stretch the time between two starts is one whole engine step (both ranks' forward passes, sampling, output)."""
    return vllm_gpu.start_times(llm.llm_engine.engine_core.engine_core.model_executor)


def run_cost(out: str, kind: str, result: dict) -> None:
    from vllm import LLM, SamplingParams

    model_dir = os.path.join(out, "model")
    if CPU_CHECK:
        vllm_gpu.make_checkpoint(model_dir, "llama")
    else:
        vllm_gpu.make_1b(model_dir)
    if kind != "plain":
        os.environ["RINGSCOPE_VLLM_CONFIG"] = vllm_gpu.write_config(out, plugin_config(out, kind, cost=True))
    t0 = time.time()
    llm = LLM(model=model_dir, load_format="dummy", dtype="float32" if CPU_CHECK else "bfloat16",
              max_model_len=1024 if CPU_CHECK else 4096, max_num_seqs=64, max_num_batched_tokens=8192,
              **engine_args())
    result["start_s"] = time.time() - t0
    result["engine"] = facts(llm)
    result["ranks_marked"] = llm.collective_rpc(_w_mark)
    starts = step_clock(llm)
    new = 16 if CPU_CHECK else 160
    result["batches"] = {}
    for b in (1, 2) if CPU_CHECK else BATCHES:
        prompts = vllm_gpu.decode_prompts(b)
        before = llm.collective_rpc(_w_dropped)

        def gen(n):
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        gen(8)
        gen(48 if not CPU_CHECK else 8)
        steps = []
        for _ in range(REPS):
            starts.clear()
            gen(new)
            steps += [(y - x) * 1e3 for x, y in zip(starts[8:], starts[9:])]
        llm.collective_rpc(_w_start)
        gen(24 if CPU_CHECK else 72)
        gpu = llm.collective_rpc(_w_stop, args=(8,))
        after = llm.collective_rpc(_w_dropped)
        steps.sort()
        result["batches"][b] = {
            "step_ms": {"p50": statistics.median(steps), "p99": steps[min(len(steps) - 1, (99 * len(steps)) // 100)],
                        "n": len(steps)},
            "gpu": gpu,
            "dropped_rows": [a.get("dropped_rows", 0) - w.get("dropped_rows", 0) for w, a in zip(before, after)],
            "exported_rows": [a.get("exported_rows", 0) for a in after]}
    result["shutdown_s"] = shutdown(llm)


# -- driver --------------------------------------------------------------------------------------------------------

def child(out: str, what: str) -> None:
    result = {"what": what, "cpu_check": CPU_CHECK}
    try:
        kind = what.split("-", 1)[1].split("#")[0]
        (run_correct if what.startswith("correct-") else run_cost)(out, kind, result)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def plugin_entry_point(root: str, engine: str = "vllm", group: str = "vllm.general_plugins") -> "str | None":
    """A directory declaring the ``engine`` plugin's entry point (``group``: ``vllm.general_plugins``,
    ``sglang.srt.plugins``), for the engine's processes' PYTHONPATH — unless an installed distribution declares it
    already (``pip install ./ffi/python``)."""
    from importlib.metadata import entry_points

    if any(ep.value.startswith(f"ringscope.{engine}") for ep in entry_points(group=group)):
        return None
    d = os.path.join(root, f"entry-point-{engine}")
    dist = os.path.join(d, f"ringscope_{engine}_bench-0.dist-info")
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: ringscope-{engine}-bench\nVersion: 0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w") as f:
        f.write(f"[{group}]\nringscope = ringscope.{engine}:register\n")
    return d


def run_child(root: str, what: str) -> dict:
    """One engine in a process of its own (vllm_gpu.run_child), with the plugin's entry point on the workers' path and
    NVLink multicast off."""
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    for k, v in NCCL_NO_MULTICAST.items():
        env.setdefault(k, v)
    paths = [os.path.join(ROOT, "ffi", "python"), HERE]
    ep = plugin_entry_point(root)
    if ep:
        paths.append(ep)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    if CPU_CHECK:
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "0|1"))
    return vllm_gpu.run_child(root, what, script=__file__, env=env,
                              extra_args=("--cpu-check",) if CPU_CHECK else (), drop_dump="cost-")


def _mean(xs):
    """The mean of the values that are there (None: a run with no GPU activity, as on a CPU), else None."""
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else None


def summarize(report: dict) -> dict:
    """Per batch size: each configuration's step p50 (per engine) and each rank's GPU busy time per step, beside the
    plain engines' own (their spread is the comparison's resolution) and against their mean."""
    rows = {}
    for what, res in report.items():
        if not what.startswith("cost-") or not isinstance(res, dict) or res.get("error"):
            continue
        kind = what.split("-", 1)[1].split("#")[0]
        for b, x in res.get("batches", {}).items():
            r = rows.setdefault(str(b), {}).setdefault(kind, {"step_ms": [], "gpu_busy_us": [], "dropped": []})
            r["step_ms"].append(x["step_ms"]["p50"])
            r["gpu_busy_us"].append([g.get("busy_us", {}).get("p50") for g in x["gpu"]])
            r["dropped"].append(x["dropped_rows"])
    out = {}
    for b, kinds in rows.items():
        plain = kinds.get("plain")
        if not plain:
            continue
        base = statistics.mean(plain["step_ms"])
        gbase = [_mean(busy) for busy in zip(*plain["gpu_busy_us"])]  # per rank
        out[b] = {"plain_step_ms": plain["step_ms"], "plain_gpu_busy_us": plain["gpu_busy_us"]}
        for kind, r in kinds.items():
            if kind == "plain":
                continue
            out[b][kind] = {
                "step_ms": r["step_ms"], "step_vs_plain_mean": [round(x / base - 1, 4) for x in r["step_ms"]],
                "gpu_busy_us": r["gpu_busy_us"],
                "gpu_busy_vs_plain_mean": [[None if v is None or g is None else round(v - g, 2)
                                            for v, g in zip(busy, gbase)] for busy in r["gpu_busy_us"]],
                "dropped_rows_per_rank": r["dropped"]}
    return out


def main(cmd: str, root: str) -> None:
    os.makedirs(root, exist_ok=True)
    if not CPU_CHECK:
        import torch

        if torch.cuda.device_count() < 2:
            sys.exit(f"vllm_tp.py needs 2 GPUs (tensor_parallel_size=2); this machine has {torch.cuda.device_count()}"
                     " (--cpu-check runs the script on vLLM's CPU build)")
    path = os.path.join(root, "report.json")
    report = json.load(open(path)) if os.path.exists(path) else {}
    report.setdefault("started", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    correct = ["correct-all", "correct-rank0"]
    cost = ["cost-plain#1", "cost-rank0#1", "cost-all#1", "cost-plain#2", "cost-rank0#2", "cost-all#2"]
    todo = {"correct": correct, "cost": cost, "all": correct + cost}[cmd]
    for what in todo:
        if isinstance(report.get(what), dict) and not report[what].get("error"):
            continue  # done in an earlier call cut short by a time limit
        res = run_child(root, what)
        if what.startswith("correct-") and not res.get("error"):
            try:
                res["check"] = check_tp(res["out"], what.split("-", 1)[1].split("#")[0], res)
            except Exception as e:
                res["check"] = {"ok": False, "problems": [f"{type(e).__name__}: {e}"],
                                "traceback": traceback.format_exc()}
        report[what] = {k: v for k, v in res.items() if k != "requests"}
        brief = res.get("check") if what.startswith("correct-") else \
            {b: {"step_ms": x["step_ms"]["p50"], "gpu_busy_us": [g.get("busy_us", {}).get("p50") for g in x["gpu"]],
                 "dropped": x["dropped_rows"]} for b, x in res.get("batches", {}).items()}
        print(f"== {what} ({res['seconds']:.0f} s): {json.dumps(brief, default=str)[:1500]}", flush=True)
        report["summary"] = summarize(report)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print(json.dumps(report.get("summary", {}), indent=1))


if __name__ == "__main__":
    argv = [a for a in sys.argv[1:] if a != "--cpu-check"]
    if argv and argv[0] == "child":
        child(argv[1], argv[2])
    elif len(argv) == 2 and argv[0] in ("correct", "cost", "all"):
        main(argv[0], argv[1])
    else:
        sys.exit(__doc__)
