"""Runs one in-process vLLM engine (CPU, a tiny random Llama checkpoint) and writes what the tests check to
``<out>/result.json``: the requests' prompts and generated tokens, and — when the ringscope plugin is active in this
process — its counters, the session's totals. Run by the tests in a subprocess per engine (a vLLM engine per process), so that each test module starts
one engine. Usage: python engine.py OUT_DIR MODE SCENARIO (MODE: eager | compiled; SCENARIO: see REQUESTS, or
"attention" (the "all" requests on a model whose attention is far from uniform; "attention_window": the same on a
Mistral attending to 8 keys), "multiprocess", or "tp": two tensor-parallel ranks, each in a worker process of its own)."""

import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# "multiprocess": the engine core (and the plugin's worker) in a process of its own, as `vllm serve` runs it; the
# dump must then be complete once this process has exited. Else in-process, where the tests can look inside.
MULTIPROCESS = len(sys.argv) > 3 and sys.argv[3] == "multiprocess"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if MULTIPROCESS else "0"
# "tp": tensor_parallel_size=2 with the multiprocessing executor (the engine core stays in this process, each rank is a
# worker process, and the ranks all-reduce over gloo / shared memory). vLLM binds each worker's OpenMP threads to the
# CPUs of a NUMA node of its own unless told which CPUs each rank gets: one CPU each ("0|1") fits a 2-CPU machine.
# "tp_attention" / "tp_attention_mqa": the same with attention far from uniform, the latter with one KV head (fewer than
# the ranks: each rank holds a copy of it).
TP = len(sys.argv) > 3 and sys.argv[3] in ("tp", "tp_attention", "tp_attention_mqa")
if TP:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

# (prompt length, max_tokens, extra_args or None): 5 requests, at most 3 at once, 24 tokens a step — the long prompts
# are prefilled in chunks while the others decode, and requests join as others finish (continuous batching).
REQUESTS = {
    "all": [(3, 6, None), (7, 4, {"ringscope": {"request_id": 7}}), (12, 5, None), (20, 3, None), (40, 4, None)],
    "opt_in": [(3, 6, {"ringscope": True}), (7, 4, {"ringscope": {"request_id": 7}}), (12, 5, {"ringscope": "yes"}),
               (20, 3, {"ringscope": {"capture": False}}), (40, 4, {"ringscope": {"capture": True}})],
}


def make_model(path: str, initializer_range: float = 0.02, sliding_window: "int | None" = None,
               kv_heads: int = 2) -> None:
    """A tiny random Llama checkpoint (seeded: every engine of the tests loads the same weights), saved as
    safetensors: the engine loads it, and the tests' reference loads the same file into Hugging Face's model.
    ``initializer_range``: larger weights make attention far from uniform (the "attention" scenarios);
    ``sliding_window``: a Mistral instead, every layer attending to that many keys (the "attention_window" scenario);
    ``kv_heads``: of the 4 query heads' keys and values (1: MQA)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=256, initializer_range=initializer_range)
    if sliding_window:
        cfg = MistralConfig(architectures=["MistralForCausalLM"], sliding_window=sliding_window, **common)
        MistralForCausalLM(cfg).save_pretrained(path)
        return
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    LlamaForCausalLM(cfg).save_pretrained(path)


def main(out: str, mode: str, scenario: str) -> None:
    result = {"mode": mode, "scenario": scenario}
    t0 = time.time()
    try:
        run(out, mode, scenario, result)
    except Exception as e:  # the tests check the error
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.time() - t0
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


def run(out, mode, scenario, result):
    from vllm import LLM, SamplingParams

    model_dir = os.path.join(out, "model")
    make_model(model_dir, 0.3 if scenario.startswith(("attention", "tp_attention")) else 0.02,
               sliding_window=8 if scenario == "attention_window" else None,
               kv_heads=1 if scenario == "tp_attention_mqa" else 2)
    if TP:
        return run_tp(model_dir, mode, result)
    if scenario == "prefix":
        return run_prefix(model_dir, mode, result)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              max_num_seqs=3, max_num_batched_tokens=24, enable_chunked_prefill=True, enforce_eager=(mode == "eager"),
              distributed_executor_backend=None if MULTIPROCESS else "uni", seed=0)
    if MULTIPROCESS:
        outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        result["requests"] = [{"vllm_request_id": o.request_id, "prompt": list(o.prompt_token_ids),
                               "tokens": list(o.outputs[0].token_ids), "extra_args": None} for o in outs]
        return
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.get_model()
    result["compiled"] = bool(getattr(model.model, "compiled", False))
    result["compilation_mode"] = str(runner.vllm_config.compilation_config.mode)
    result["plugin_installed"] = getattr(runner, "_ringscope", None) is not None
    result["sink_buffer"] = hasattr(model.model, "_ringscope_sink")
    result["additional_config"] = dict(runner.vllm_config.additional_config) \
        if isinstance(runner.vllm_config.additional_config, dict) else None
    if os.environ.get("ENGINE_CHECK_SOURCES") and result["plugin_installed"]:
        watch_sources(runner._ringscope, result)

    reqs = REQUESTS["opt_in" if scenario == "opt_in" else "all"]  # "attention" too: the "all" requests
    prompts = [{"prompt_token_ids": [(7 * k + 3 * i) % 500 + 1 for i in range(n)]} for k, (n, _, _) in enumerate(reqs)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, extra_args=x) for _, m, x in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["requests"] = [{"vllm_request_id": o.request_id, "prompt": list(o.prompt_token_ids),
                           "tokens": list(o.outputs[0].token_ids), "extra_args": x}
                          for o, (_, _, x) in zip(outs, reqs)]

    if result["plugin_installed"]:
        import ringscope.vllm as rv

        cap = runner._ringscope
        result["run_dir"] = str(cap.run_dir)
        result["hookpoints"] = cap.hookpoints
        result["overlap"] = getattr(cap, "overlap", None)
        if scenario == "fault":
            # A plugin error while serving: the capture op fails from now on; the engine must go on.
            def broken(*args):
                raise RuntimeError("injected fault")
            before = dict(cap.counters())
            cap._capture = broken
            outs2 = llm.generate(prompts[:2], params[:2], use_tqdm=False)
            again = llm.generate(prompts[:2], params[:2], use_tqdm=False)
            result["fault"] = {"tokens": [list(o.outputs[0].token_ids) for o in outs2],
                               "tokens_after": [list(o.outputs[0].token_ids) for o in again],
                               "before": before, "after": cap.counters()}
        result["closed"] = rv.close_all()
    else:
        mod = sys.modules.get("ringscope")
        abi = sys.modules.get("ringscope._abi")  # where the package keeps the loaded library
        result["ringscope_imported"] = mod is not None
        result["ringscope_library_loaded"] = abi is not None and abi._lib is not None


def watch_sources(cap, result):
    """Whether every captured tensor still holds the captured values when its step ends — where a CUDA engine's
    deferred copy reads it (on the CPU the plugin copies at once, so a tensor overwritten before the end of the pass
    would not show in the rows): each capture's tensor is held (so its memory stays allocated) with a copy of its
    values, and compared with them when the step ends."""
    import torch

    seen = []
    stats = result["sources"] = {"captures": 0, "changed_before_end": 0, "changed": [], "submits": 0,
                                 "captured_after_submit": 0, "ends_keeping": 0, "captured_not_kept": 0}
    capture, end, submit, end_keeping = cap._capture, cap._end, cap._submit, cap._end_keeping
    submitted = [False]

    def watched_capture(x, hookpoint):
        if cap._open:
            seen.append((x, x.clone(), hookpoint))
            stats["captured_after_submit"] += submitted[0]
        capture(x, hookpoint)

    # overlap_copy: the captures are submitted before the step ends; the end op must then receive every captured
    # tensor's own buffer (the submitted copy reads those buffers until the step ends).
    def watched_submit():
        if cap._open:
            stats["submits"] += 1
            submitted[0] = True
        submit()

    def watched_end_keeping(keep):
        if cap._open and submitted[0]:
            stats["ends_keeping"] += 1
            kept = {t.data_ptr() for t in keep}
            stats["captured_not_kept"] += sum(x.data_ptr() not in kept for x, _, _ in seen)
        end_keeping(keep)

    def watched_end():
        for x, was, hookpoint in seen:
            stats["captures"] += 1
            if not torch.equal(x, was):
                stats["changed_before_end"] += 1
                if len(stats["changed"]) < 8:
                    stats["changed"].append({"hookpoint": hookpoint, "step": cap.step})
        seen.clear()
        submitted[0] = False
        end()

    cap._capture = watched_capture
    cap._end = watched_end
    cap._submit = watched_submit
    cap._end_keeping = watched_end_keeping


def run_prefix(model_dir, mode, result):
    """Prefix caching (vLLM's default) with 32-token blocks: a first request of 70 tokens, then three at once — one
    sharing its first 64 tokens, one its first 40 (one whole block: 32 cached), one sharing nothing. The plugin's
    probe reports on every request are read before the session closes."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, block_size=32,
              enable_prefix_caching=True, max_num_seqs=3, max_num_batched_tokens=64, enable_chunked_prefill=True,
              enforce_eager=(mode == "eager"), distributed_executor_backend="uni", seed=0)
    base = [(11 * i) % 500 + 1 for i in range(70)]
    calls = [[base], [base[:64] + [(13 * i) % 500 + 2 for i in range(6)], base[:40] + [(17 * i) % 500 + 3 for i in
                                                                                       range(14)],
                      [(19 * i) % 500 + 4 for i in range(20)]]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    result["requests"] = []
    for prompts in calls:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result["requests"] += [{"vllm_request_id": o.request_id, "prompt": list(o.prompt_token_ids),
                                "tokens": list(o.outputs[0].token_ids), "extra_args": None,
                                "num_cached_tokens": o.num_cached_tokens} for o in outs]
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    result["plugin_installed"] = getattr(runner, "_ringscope", None) is not None
    if result["plugin_installed"]:
        import ringscope.vllm as rv
        from ringscope.vllm import external_id

        cap = runner._ringscope
        result["run_dir"] = str(cap.run_dir)
        result["hookpoints"] = cap.hookpoints
        result["overlap"] = getattr(cap, "overlap", None)
        cap.session.wait_probes(30)
        result["coverage"] = {}
        for r in result["requests"]:
            (rid,) = [v[0] for k, v in cap._ids.items() if external_id(k) == r["vllm_request_id"]]
            rep = cap.session.probe_request("p", rid)
            result["coverage"][r["vllm_request_id"]] = None if rep is None else rep["coverage"]
        result["closed"] = rv.close_all()


def run_tp(model_dir, mode, result):
    """Two tensor-parallel ranks serving the "all" requests. The plugin runs in the worker processes, so this process
    sees only the outputs; the dump is complete once the engine has shut down (each worker closes its session as it
    exits)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              max_num_seqs=3, max_num_batched_tokens=24, enable_chunked_prefill=True, enforce_eager=(mode == "eager"),
              tensor_parallel_size=2, distributed_executor_backend="mp", seed=0)
    result["tensor_parallel_size"] = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    reqs = REQUESTS["all"]
    prompts = [{"prompt_token_ids": [(7 * k + 3 * i) % 500 + 1 for i in range(n)]} for k, (n, _, _) in enumerate(reqs)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, extra_args=x) for _, m, x in reqs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["requests"] = [{"vllm_request_id": o.request_id, "prompt": list(o.prompt_token_ids),
                           "tokens": list(o.outputs[0].token_ids), "extra_args": x}
                          for o, (_, _, x) in zip(outs, reqs)]
    t = time.time()
    llm.llm_engine.engine_core.shutdown()  # the workers exit (and close their sessions) before this returns
    result["shutdown_seconds"] = time.time() - t


if __name__ == "__main__":
    main(*sys.argv[1:4])
