"""What a call costs at every forward pass of a real vLLM engine, cold (between two passes vLLM runs far more code than
the CPU's caches hold), against the same call in a loop: a Python call that does nothing, five nested Python calls,
and a C call through ctypes that does nothing (``getpid``). Why the engine plugins' few lines per pass cost tens of
microseconds under vLLM (docs/gpu-benchmarks.md, "Full (lossless) mode in vLLM", session 32).

With ``RINGSCOPE_LIB`` set (and ``ffi/python`` importable), also ringscope's own C calls, on a best-effort host
session: ``rs_abi_version`` (a call into the library that does nothing), ``rs_admit_graph_step`` through the typed
ctypes function (the C ABI's handle lookup and the session's capture lock, nothing else in best-effort mode) — what
the C ABI itself costs per call, cold — and the engine plugins' per-pass call in full mode (``Session._before_pass``:
the same C call as the plugins make it).

Runs vLLM's CPU build in-process on a tiny random Llama (tests/vllm/engine.py's); in the vLLM test environment:

    tests/engine.sh vllm --setup
    VENV/bin/python benches/vllm_cold_calls.py [--out cold.json]
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, its passes in this thread
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "vllm"))

_getpid = ctypes.CDLL(None).getpid


def _e():
    return None


def _d():
    return _e()


def _c():
    return _d()


def _b():
    return _c()


def _a():
    return _b()


def _noop():
    return None


_rs = {}


def open_ringscope() -> None:
    """A best-effort host session and the two C functions timed on it, if a ringscope library is given."""
    if not os.environ.get("RINGSCOPE_LIB"):
        return
    import ringscope
    from ringscope import _abi

    lib = _abi._load()
    session = ringscope.Session({"ring": {"backend": "host", "capacity": "1 MiB"}, "policy": {"mode": "best_effort"}})
    _rs.update(session=session, version=lib.rs_abi_version, admit=lib.rs_admit_graph_step, h=session._h,
               before_pass=session._before_pass(True))


def probe_ringscope(into: dict) -> None:
    """One of the three calls per probe, in turn, so that each runs as cold as the engine leaves it (a call right
    after another into the library would find the handle table and the library's code warm)."""
    k = _rs["turn"] = (_rs.get("turn", -1) + 1) % 3
    version, admit, h, before_pass = _rs["version"], _rs["admit"], _rs["h"], _rs["before_pass"]
    st = 0
    if k == 0:
        t0 = time.perf_counter()
        version()
        t1 = time.perf_counter()
    elif k == 1:
        t0 = time.perf_counter()
        st = admit(h, 1, 0)
        t1 = time.perf_counter()
    else:
        t0 = time.perf_counter()
        before_pass(8, 0)
        t1 = time.perf_counter()
    if st:
        raise RuntimeError(f"rs_admit_graph_step returned {st}")
    key = ("rs_abi_version_us", "rs_admit_graph_step_best_effort_us", "plugin_before_pass_full_us")[k]
    into[key].append((t1 - t0) * 1e6)


def probe(into: dict) -> None:
    if _rs:
        probe_ringscope(into)
    t0 = time.perf_counter()
    _noop()
    t1 = time.perf_counter()
    _a()
    t2 = time.perf_counter()
    _getpid()
    t3 = time.perf_counter()
    into["python_noop_us"].append((t1 - t0) * 1e6)
    into["python_5_nested_us"].append((t2 - t1) * 1e6)
    into["ctypes_noop_us"].append((t3 - t2) * 1e6)


def summary(d: dict) -> dict:
    return {k: {"p50": round(statistics.median(v), 3), "p90": round(sorted(v)[int(0.9 * len(v))], 3), "n": len(v)}
            for k, v in d.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="vllm_cold_calls.json")
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    keys = ("python_noop_us", "python_5_nested_us", "ctypes_noop_us")
    open_ringscope()
    if _rs:
        keys += ("rs_abi_version_us", "rs_admit_graph_step_best_effort_us", "plugin_before_pass_full_us")
    loop = {k: [] for k in keys}
    for _ in range(2000):
        probe(loop)
    import engine
    from vllm import LLM, SamplingParams
    from vllm.v1.worker import gpu_model_runner

    inside = {k: [] for k in keys}
    orig = gpu_model_runner.GPUModelRunner._model_forward

    def model_forward(self, *a, **k):
        probe(inside)
        return orig(self, *a, **k)
    gpu_model_runner.GPUModelRunner._model_forward = model_forward
    with tempfile.TemporaryDirectory() as tmp:
        engine.make_model(os.path.join(tmp, "model"))
        llm = LLM(model=os.path.join(tmp, "model"), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                  max_num_seqs=8)
        prompts = [{"prompt_token_ids": [1, 2, 3, 4]}] * 4
        llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
        for v in inside.values():
            v.clear()
        llm.generate(prompts, SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    import vllm

    out = {"vllm": vllm.__version__, "ringscope_lib": os.environ.get("RINGSCOPE_LIB"), "in_a_loop": summary(loop), "before_each_forward_pass": summary(inside)}
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if _rs:
        _rs["session"].close()


if __name__ == "__main__":
    main()
