"""Shared pieces of the vLLM plugin tests: engines run in subprocesses (tests/vllm/engine.py, one engine per process,
each started once per test session and shared by the modules that read it) and the independent reference — a Hugging
Face ``LlamaForCausalLM`` loaded from the checkpoint the engine served, whose own forward hooks give the layer outputs the plugin's rows
must equal."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from engine_reference import assert_rows_match, hf_model, mixed_step, reference  # noqa: E402,F401
SITES = {"resid": "residual", "attn_out": "attention_output", "mlp_out": "mlp_output"}
CONFIG = """
[policy]
mode = "full"
[export]
parquet = true
dir = "{dir}"
run_id = "run"
[vllm]
sites = ["residual", "attention_output", "mlp_output"]
layers = "all"
requests = "{requests}"
"""
#: Only the residual: every capture of a pass is made by the end op, from the tensors it receives.
RESIDUAL_CONFIG = CONFIG.replace('sites = ["residual", "attention_output", "mlp_output"]', 'sites = ["residual"]')


def work_between_submit_and_end(log: str) -> "list[int]":
    """For each ``submit_capturing`` op in the compiled graphs of an engine's log (run with ``TORCH_LOGS=output_code``):
    how many matrix products the compiled code runs between it and the ``end`` op that follows it in the same graph —
    the model's work a side stream's copy can overlap (vLLM's CPU engines call ``torch.ops._C.onednn_mm`` for their
    linear layers); -1 for a submit whose graph ends (or another submit comes) before an ``end``: in a GPU engine's
    recording the fork would be left unjoined."""
    def code(line, what):
        return what in line and "#" not in line.split("torch.ops")[0]

    counts, inside = [], False
    for line in log.splitlines():
        if "def call(" in line or code(line, "torch.ops.ringscope_engine.submit_capturing.default("):
            if inside:
                counts[-1] = -1
            inside = "def call(" not in line
            if inside:
                counts.append(0)
        elif inside and code(line, "torch.ops.ringscope_engine.end.default("):
            inside = False
        elif inside and code(line, "onednn_mm.default("):
            counts[-1] += 1
    if inside:
        counts[-1] = -1
    return counts


def check_overlap_sources(res: dict, per_step: int):
    """With vllm.overlap_copy: each step submitted once, with its ``per_step`` captures before it; the end op received
    the captured buffers, holding the captured values (tests/vllm/engine.py watch_sources)."""
    src = res["sources"]
    assert src["submits"] >= len(res["requests"]) and src["submits"] == src["ends_keeping"], src
    assert src["captures"] == per_step * src["submits"], src
    assert src["captured_after_submit"] == 0 and src["captured_not_kept"] == 0, src
    assert src["changed_before_end"] == 0, src


def overlap_config(sites: str, layers: str) -> str:
    """``vllm.overlap_copy = true`` with these sites and layers (TOML values)."""
    return CONFIG.replace('sites = ["residual", "attention_output", "mlp_output"]', f"sites = {sites}").replace(
        'layers = "all"', f"layers = {layers}\noverlap_copy = true")


_cache = {}


def run_engine(tmp_root: pathlib.Path, name: str, mode: str, scenario: str, config: "str | None",
               env: "dict | None" = None, timeout: int = 600) -> dict:
    """Runs tests/vllm/engine.py in a subprocess (at most once per name and test session); returns its result."""
    if name in _cache:
        return _cache[name]
    out = tmp_root / name
    out.mkdir(parents=True, exist_ok=True)
    e = {k: v for k, v in os.environ.items() if not k.startswith("RINGSCOPE_VLLM_")}
    e["VLLM_DISABLE_COMPILE_CACHE"] = "1"  # a cold compile each run: what the plugin installs is what runs
    if config is not None:
        cfg = out / "ringscope.toml"
        cfg.write_text(config.format(dir=out / "dump", requests="opt_in" if scenario == "opt_in" else "all"))
        e["RINGSCOPE_VLLM_CONFIG"] = str(cfg)
    e.update(env or {})
    p = subprocess.run([sys.executable, str(HERE / "engine.py"), str(out), mode, scenario], env=e,
                       capture_output=True, text=True, timeout=timeout)
    (out / "engine.log").write_text(p.stdout + p.stderr)
    res_file = out / "result.json"
    if not res_file.exists():
        pytest.fail(f"engine {name} wrote no result (exit {p.returncode}); log tail:\n{(p.stdout + p.stderr)[-4000:]}")
    res = json.loads(res_file.read_text())
    res["out"] = str(out)
    res["returncode"] = p.returncode
    res["log"] = p.stdout + p.stderr
    _cache[name] = res
    return res


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return lambda name, mode, scenario, config=CONFIG, env=None: run_engine(root, name, mode, scenario, config, env)


@pytest.fixture(scope="session")
def eager_all(engines):
    """The eager engine with the plugin capturing every request (shared by test_eager and test_off)."""
    return engines("eager_all", "eager", "all")


# -- the independent reference (tests/engine_reference.py, shared with the SGLang tests) -----------------------------

def check_capture(res: dict, captured_requests: "list[int]", sites: int = 3, layers: int = 2):
    """Every exported row equals the reference's row of its (request, position); the rows are exactly those of the
    captured requests (every position each one was fed through the model: its prompt and every generated token but
    the last); request ids and positions right; the session's accounting balances. Returns the dump."""
    import ringscope

    assert res.get("error") is None, res.get("traceback")
    assert res["plugin_installed"]
    dump = ringscope.read_dump(res["run_dir"])
    reqs = res["requests"]
    rid = request_ids(res)
    assert all(rid[k] is not None for k in captured_requests)
    assert not any(rid[k] is not None for k in range(len(reqs)) if k not in captured_requests)
    seqs = [r["prompt"] + r["tokens"][:-1] for r in reqs]
    ref = reference(pathlib.Path(res["out"]) / "model", seqs)
    assert sorted(dump) == sorted(res["hookpoints"])
    assert len(dump) == layers * sites
    for name, cols in dump.items():
        act, req, pos = cols["activation"], cols["request_id"], cols["position"]
        assert cols["dtype"] == "f32" and act.shape[1] == 128
        want = sorted((rid[k], p) for k in captured_requests for p in range(len(seqs[k])))
        assert sorted(zip(req.tolist(), pos.tolist())) == want, name
        for k in captured_requests:
            rows = req == rid[k]
            order = np.argsort(pos[rows])
            assert_rows_match(act[rows][order], ref[(k, name)], (name, k))
    # Accounting: every row produced was exported or counted as dropped.
    (closed,) = res["closed"]
    s = closed["session"]
    total_rows = sum(len(c["request_id"]) for c in dump.values())
    assert s["exported_rows"] == total_rows == closed["plugin"]["rows_exported_requested"]
    assert s["produced_rows"] == s["exported_rows"] + s["dropped_rows"] + s["sampled_out_rows"]
    assert s["dropped_rows"] == sum(s["dropped_by_reason"].values())
    assert closed["plugin"]["lost_rows"] == 0 and closed["plugin"]["disabled"] is None
    return dump


def request_ids(res: dict) -> list:
    """The ringscope id of each request (None: not captured), from the run's request map, checked against the
    documented mapping (the explicit id, else the hash of the engine's request id)."""
    from ringscope.vllm import request_id_of

    lines = [json.loads(x) for x in
             (pathlib.Path(res["run_dir"]) / "_ringscope_vllm" / "requests.jsonl").read_text().splitlines()]
    by_ext = {}
    for x in lines:
        assert x["external_request_id"] not in by_ext
        by_ext[x["external_request_id"]] = x
        assert x["request_id"] == (x["request_id"] if x["explicit"] else request_id_of(x["vllm_request_id"]))
    out = []
    for r in res["requests"]:
        x = by_ext.get(r["vllm_request_id"])  # RequestOutput.request_id: the submitted id
        e = (r["extra_args"] or {}).get("ringscope")
        if x is not None and isinstance(e, dict) and "request_id" in e:
            assert x["explicit"] and x["request_id"] == e["request_id"]
        out.append(None if x is None else x["request_id"])
    return out
