"""Runs one in-process SGLang engine (CPU, a tiny random Llama checkpoint; its scheduler — where the model and the
plugin live — in a process of its own) and writes what the tests check to ``<out>/result.json``: the requests'
prompts, generated tokens, SGLang ids, cached tokens and finish reasons. Run by the tests in a subprocess per engine.
Usage: python engine.py OUT_DIR SCENARIO (SCENARIO: "main", "stop", "plain", or "server-STOP-PLACE[-N]" with STOP
one of ``STOPS`` and PLACE one of ``PLACES``; see the functions below).

SGLang starts its processes with "spawn", which imports this file again in each of them: everything with an effect is
under ``if __name__ == "__main__"``."""

import json
import os
import sys
import time
import traceback

if os.environ.get("RINGSCOPE_SGLANG_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

PREFIX = [(7 * i + 11) % 250 + 3 for i in range(64)]
# Phase 1 of "main" and "plain": three concurrent requests of different lengths; the second names its ringscope id.
PHASE1 = [([(5 * i + 3) % 250 + 3 for i in range(n)], m, extra) for n, m, extra in
          ((5, 6, None), (17, 4, {"ringscope": {"request_id": 7}}), (40, 3, None))]


def make_model(path: str) -> None:
    """A tiny random Llama checkpoint (seeded), saved as safetensors: the engine loads it, and the tests' reference
    loads the same file into Hugging Face's model."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # a larger init than the default, so that each layer visibly changes the stream
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)


#: RINGSCOPE_SGLANG_TEST_OVERLAP=1: with SGLang's overlap scheduler (its default), else without it.
#: "cpu" (CI), or "cuda" (RINGSCOPE_SGLANG_TEST_DEVICE=cuda, tests/sglang/run_cuda.sh): SGLang's CUDA graphs on
#: (decode graphs up to batch 8, and its default breakable prefill graphs), triton attention.
DEVICE = os.environ.get("RINGSCOPE_SGLANG_TEST_DEVICE", "cpu")
#: The dtype SGLang serves the float32 checkpoint in (RINGSCOPE_SGLANG_TEST_DTYPE; checked by conftest.py).
DTYPE = os.environ.get("RINGSCOPE_SGLANG_TEST_DTYPE", "float32")


def start(model_dir: str, chunked: bool):
    import sglang as sgl

    common = dict(model_path=model_dir, load_format="auto", skip_tokenizer_init=True,
                  dtype=DTYPE,
                  disable_overlap_schedule=os.environ.get("RINGSCOPE_SGLANG_TEST_OVERLAP") != "1",
                  max_total_tokens=4096, max_running_requests=8,
                  chunked_prefill_size=16 if chunked else -1, enable_mixed_chunk=chunked, random_seed=0,
                  log_level="warning")
    if DEVICE == "cuda":
        return sgl.Engine(device="cuda", attention_backend="triton", sampling_backend="pytorch",
                          mem_fraction_static=0.2, cuda_graph_max_bs_decode=8, **common)
    return sgl.Engine(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                      mem_fraction_static=0.5, **common)


def sampling_params(reqs) -> list:
    """Greedy sampling parameters of ``reqs`` ((prompt, max_new_tokens, custom_params or None))."""
    return [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True,
             **({"custom_params": extra} if extra is not None else {})} for _, m, extra in reqs]


def record(reqs, outs, result) -> None:
    """Appends the engine's outputs ``outs`` for ``reqs`` to ``result["requests"]``."""
    for (prompt, m, extra), o in zip(reqs, outs):
        meta = o["meta_info"]
        result["requests"].append({"rid": meta["id"], "prompt": prompt, "tokens": list(o["output_ids"]),
                                   "max_new_tokens": m, "custom_params": extra,
                                   "cached_tokens": meta.get("cached_tokens", 0),
                                   "finish_reason": meta.get("finish_reason")})


def generate(engine, reqs, result):
    """Sends ``reqs`` at once through the in-process engine; appends their outputs to ``result["requests"]``."""
    record(reqs, engine.generate(input_ids=[p for p, _, _ in reqs], sampling_params=sampling_params(reqs)), result)


#: How the server scenarios stop the server: the signal, and who gets it.
STOPS = {
    "term": "SIGTERM to the server's process (`kill <pid>`): SGLang drains and asks its scheduler to exit",
    "int": "SIGINT to the server's process (`kill -INT <pid>`): SGLang kills its process tree with SIGKILL",
    "ctrlc": "SIGINT to every process of the group (Ctrl-C in a terminal): the scheduler gets it too",
    "termgroup": "SIGTERM to every process of the group (a service manager stopping its unit)",
}
#: Where the scheduler is when the signal arrives (tests/sglang/stub/ringscope_sglang_testhooks.py holds it there).
PLACES = ("idle", "check", "busy")


def server_port(socket) -> int:
    """A free TCP port for the server, between 12000 and 21000: below the kernel's ephemeral range
    (net.ipv4.ip_local_port_range, 32768 and up by default) and below 22000-29999, where SGLang's engines pick their
    own extra ports. A port from ``bind(0)`` is an ephemeral one, which any process running beside this test (test.sh
    runs other suites at the same time) may be given for a connection between this check and the server's own bind —
    seen once: "[Errno 98] address already in use", and a server that never became ready. Here only a process that asks
    for this very port can take it (SGLang also takes ports up to 1000 above the server's)."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            top = min(21000, int(f.read().split()[0]) - 1000)
    except (OSError, ValueError, IndexError):
        top = 21000
    for _ in range(200):
        port = random.randrange(12000, top)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port between 12000 and {top}")


def serve(out: str, model_dir: str, result: dict, stop: str, place: str) -> None:
    """Scenarios "server-STOP-PLACE": ``python -m sglang.launch_server`` in a process of its own, PHASE1's requests
    through its HTTP API, then the server stopped (``STOPS``) while its scheduler is held at ``PLACE``: idle, inside
    SGLang's own checks, or inside a forward pass of a request still in flight (``PLACES``)."""
    import signal
    import socket
    import subprocess
    import threading
    import urllib.request

    port = server_port(socket)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--skip-tokenizer-init",
           "--device", "cpu", "--dtype", DTYPE, "--attention-backend", "torch_native", "--disable-cuda-graph",
           "--max-total-tokens", "4096", "--max-running-requests", "8", "--mem-fraction-static", "0.5",
           "--random-seed", "0", "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    if os.environ.get("RINGSCOPE_SGLANG_TEST_OVERLAP") != "1":
        cmd.append("--disable-overlap-schedule")
    url = f"http://127.0.0.1:{port}"
    mark = os.path.join(out, "signal.mark")
    env = dict(os.environ, RINGSCOPE_SGLANG_TEST_SIGNAL_AT=place, RINGSCOPE_SGLANG_TEST_MARK=mark)

    def post(reqs, timeout=300):
        body = {"input_ids": [p for p, _, _ in reqs], "sampling_params": sampling_params(reqs)}
        req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    with open(os.path.join(out, "server.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            t = time.time()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
                with open(log.name, errors="replace") as f:
                    if "address already in use" in f.read():
                        raise RuntimeError(f"the server could not bind port {port}: address already in use")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() - t > 240:
                    raise RuntimeError("the server was not ready within 240 s")
                time.sleep(0.5)
            result["start_seconds"] = time.time() - t
            record(PHASE1, post(PHASE1), result)
            if place == "busy":
                # A long request, in flight when the signal arrives (its reply never comes: the server stops).
                result["in_flight"] = {}

                def long_request():
                    try:
                        post([(list(range(3, 20)), 200, None)], timeout=200)  # within the 256 positions
                        result["in_flight"]["finished"] = True
                    except Exception as e:
                        result["in_flight"]["error"] = f"{type(e).__name__}"
                threading.Thread(target=long_request, daemon=True).start()
            open(mark + ".arm", "w").close()
            t = time.time()
            while not os.path.exists(mark):
                if time.time() - t > 60:
                    raise RuntimeError(f"the scheduler did not reach {place!r} within 60 s")
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode} before the signal")
                time.sleep(0.005)
            result["held"] = open(mark).read().split()
        finally:
            t = time.time()
            if stop in ("ctrlc", "termgroup"):  # to every process of the group
                os.killpg(proc.pid, signal.SIGINT if stop == "ctrlc" else signal.SIGTERM)
            else:  # `kill -INT <pid>` / `kill <pid>`: the server's process only
                proc.send_signal(signal.SIGINT if stop == "int" else signal.SIGTERM)
            try:
                result["server_exit"] = proc.wait(timeout=150)
            except subprocess.TimeoutExpired:
                result["server_exit"] = "killed after 150 s"
                # Where each process is stuck, into the server's log (the test hooks register faulthandler).
                subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], stdout=log, stderr=subprocess.STDOUT)
                os.killpg(proc.pid, signal.SIGUSR1)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            result["shutdown_seconds"] = time.time() - t
            # Nothing of the server's may outlive it for long (a scheduler left behind would hold the run open).
            result["left_behind"] = True
            t = time.time()
            while time.time() - t < 30:
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    result["left_behind"] = False
                    break
                time.sleep(0.1)
            if result["left_behind"]:
                subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(proc.pid)], stdout=log, stderr=subprocess.STDOUT)
                os.killpg(proc.pid, signal.SIGKILL)


def run(out: str, scenario: str, result: dict) -> None:
    model_dir = os.path.join(out, "model")
    make_model(model_dir)
    if scenario.startswith("server-"):
        result["requests"] = []
        _, stop, place = scenario.split("-")[:3]
        serve(out, model_dir, result, stop, place)
        return
    t = time.time()
    engine = start(model_dir, chunked=scenario in ("main", "plain"))
    result["start_seconds"] = time.time() - t
    result["requests"] = []
    try:
        if scenario in ("main", "plain"):
            # Concurrent requests of different lengths, prefilled in 16-token chunks mixed with the others' decodes.
            generate(engine, PHASE1, result)
            if scenario == "main":
                # A 64-token prefix warmed by one request, then three requests sharing it: prefix-cache hits.
                generate(engine, [(PREFIX + [100], 2, None)], result)
                generate(engine, [(PREFIX + [200 + i] * (i + 1), 3, None) for i in range(3)], result)
        elif scenario == "stop":
            # The stop probe flags every row it scores, so it ends each captured request after its first forward
            # pass while the others run to their end: with requests = "opt_in" (CPU) only the first is captured,
            # with "all" (CUDA) the first two. The third's ringscope parameter is malformed: counted, warned about,
            # not captured; it runs on.
            generate(engine, [(list(range(3, 13)), 8, {"ringscope": True}), (list(range(20, 32)), 8, None),
                              (list(range(40, 47)), 8, {"ringscope": "yes"})], result)
    finally:
        t = time.time()
        engine.shutdown()  # the plugin closes its session first (the scheduler process is then killed)
        result["shutdown_seconds"] = time.time() - t


def main(out: str, scenario: str) -> None:
    result = {"scenario": scenario}
    t0 = time.time()
    try:
        run(out, scenario, result)
    except Exception as e:  # the tests check the error
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    result["seconds"] = time.time() - t0
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
