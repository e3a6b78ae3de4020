"""Shared pieces of the SGLang plugin tests: engines run in subprocesses (tests/sglang/engine.py, one engine per
process, each started once per test session) and the independent reference — a Hugging Face ``LlamaForCausalLM``
loaded from the checkpoint the engine served, whose own forward hooks give the layer outputs the plugin's rows must
equal."""

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
#: "cpu", or "cuda" (tests/sglang/run_cuda.sh): the engine's device; see engine.py.
DEVICE = os.environ.get("RINGSCOPE_SGLANG_TEST_DEVICE", "cpu")
#: On CUDA the plugin records its steps into SGLang's CUDA graphs: best-effort mode (full mode is refused there).
MODE = "full" if DEVICE == "cpu" else "best_effort"
#: The engine's dtype (RINGSCOPE_SGLANG_TEST_DTYPE): "float32" (default), or "bfloat16" — the checkpoint stays
#: float32, SGLang serves it in bfloat16 (on CUDA with its fused ops: tests/sglang/run_cuda.sh leaves them on then).
DTYPE = os.environ.get("RINGSCOPE_SGLANG_TEST_DTYPE", "float32")
if DTYPE not in ("float32", "bfloat16"):
    raise ValueError(f"RINGSCOPE_SGLANG_TEST_DTYPE must be float32 or bfloat16, not {DTYPE!r}")
#: The captured rows' dtype as ringscope names it.
ROW_DTYPE = "f32" if DTYPE == "float32" else "bf16"
#: Captured rows equal the float32 reference within this (relative): exact float32 on CPU; on CUDA the reference runs
#: on the CPU and SGLang's triton attention multiplies in TF32; a bfloat16 engine rounds every op's inputs and outputs
#: to 8 bits of mantissa, which this small model with large weights amplifies (up to 6e-2 at layer 1 on CPU, and as
#: much against a bfloat16 Hugging Face run); rows of neighbouring positions still differ by over 0.2.
TOLERANCE = (1e-4 if DEVICE == "cpu" else 5e-3) if DTYPE == "float32" else 0.1


def activations(cols: dict) -> np.ndarray:
    """A hookpoint's rows (one entry of ``read_dump``) as float32: bf16 bit patterns converted exactly."""
    import ringscope

    return ringscope.as_float32(cols["activation"]) if cols["dtype"] == "bf16" else cols["activation"]


NO_REQUEST = 2**64 - 1


def _sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return ""


#: SGLang 0.5.17's overlap scheduler runs the next batch before it processes the last one's results: a request that
#: has just finished may get one more forward pass, over its last token (SGLang discards what it computes). The plugin
#: captures what the engine computes, so there a request may have one more row per hookpoint: its last token's.
LAST_TOKEN_PASS = os.environ.get("RINGSCOPE_SGLANG_TEST_OVERLAP") == "1" and _sglang_version() == "0.5.17"


def fed(r: dict, positions=()) -> list:
    """The tokens of request ``r`` (an engine result's request) the engine computed rows for: its prompt and every
    generated token but the last — and the last one too where :data:`LAST_TOKEN_PASS` allows it and ``positions``
    (its captured rows' positions) hold its position."""
    seq = r["prompt"] + r["tokens"][:-1]
    if LAST_TOKEN_PASS and len(seq) in set(int(p) for p in positions):
        seq = seq + r["tokens"][-1:]
    return seq


def positions_of(cols: dict, request_id: int) -> np.ndarray:
    """The positions of a hookpoint's rows of one request (``cols``: one entry of ``read_dump``)."""
    return cols["position"][cols["request_id"] == request_id]


CONFIG = """
[policy]
mode = "MODE"
""".replace("MODE", MODE) + """[export]
parquet = true
dir = "{dir}"
run_id = "run"
[sglang]
sites = ["residual", "attention_output", "mlp_output"]
layers = "all"
requests = "{requests}"
{extra}
"""

_cache = {}


def run_engine(tmp_root: pathlib.Path, name: str, scenario: str, config: "str | None", requests: str = "all",
               extra: str = "", env: "dict | None" = None, timeout: int = 600) -> dict:
    """Runs tests/sglang/engine.py in a subprocess (at most once per name and test session); returns its result."""
    if name in _cache:
        return _cache[name]
    out = tmp_root / name
    out.mkdir(parents=True, exist_ok=True)
    keep = ("RINGSCOPE_SGLANG_TEST_DEVICE", "RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA", "RINGSCOPE_SGLANG_TEST_OVERLAP",
            "RINGSCOPE_SGLANG_TEST_NATIVE_OPS", "RINGSCOPE_SGLANG_TEST_DTYPE")
    e = {k: v for k, v in os.environ.items() if not k.startswith("RINGSCOPE_SGLANG_") or k in keep}
    if config is not None:
        cfg = out / "ringscope.toml"
        cfg.write_text(config.format(dir=out / "dump", requests=requests, extra=extra))
        e["RINGSCOPE_SGLANG_CONFIG"] = str(cfg)
    e.update(env or {})
    p = subprocess.run([sys.executable, str(HERE / "engine.py"), str(out), scenario], env=e, capture_output=True,
                       text=True, timeout=timeout)
    (out / "engine.log").write_text(p.stdout + p.stderr)
    res_file = out / "result.json"
    if not res_file.exists():
        pytest.fail(f"engine {name} wrote no result (exit {p.returncode}); log tail:\n{(p.stdout + p.stderr)[-4000:]}")
    res = json.loads(res_file.read_text())
    res["out"] = str(out)
    res["run_dir"] = str(out / "dump" / "run")
    res["returncode"] = p.returncode
    res["log"] = p.stdout + p.stderr
    _cache[name] = res
    return res


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return lambda name, scenario, config=CONFIG, **kw: run_engine(root, name, scenario, config, **kw)


def side_file(res: dict, name: str) -> list:
    path = pathlib.Path(res["run_dir"]) / "_ringscope_sglang" / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.suffix == ".jsonl" else \
        json.loads(path.read_text())


def request_ids(res: dict) -> list:
    """The ringscope id of each request (None: not captured), from the run's request map, checked against the
    documented mapping (the explicit id, else the hash of SGLang's rid)."""
    from ringscope.sglang import request_id_of

    by_rid = {}
    for x in side_file(res, "requests.jsonl"):
        if "first_step" not in x:
            continue  # a later line about the same request (stopped by a probe)
        assert x["sglang_rid"] not in by_rid
        by_rid[x["sglang_rid"]] = x
        assert x["request_id"] == (x["request_id"] if x["explicit"] else request_id_of(x["sglang_rid"]))
    out = []
    for r in res["requests"]:
        x = by_rid.get(r["rid"])
        e = (r["custom_params"] or {}).get("ringscope")
        if x is not None and isinstance(e, dict) and "request_id" in e:
            assert x["explicit"] and x["request_id"] == e["request_id"]
        out.append(None if x is None else x["request_id"])
    return out


def check_rows(res: dict, dump: dict, rid: list, first: "list[int]"):
    """Every exported row equals the reference's row at its (request, position); each captured request's rows are
    exactly the positions the engine computed for it — ``first[k]`` (its prefix-cache hit) up to its last fed
    token (its prompt and every generated token but the last; see :func:`fed`), the same for every hookpoint."""
    reqs = res["requests"]
    some = next(iter(dump.values()))
    seqs = [fed(r, () if rid[k] is None else positions_of(some, rid[k])) for k, r in enumerate(reqs)]
    ref = reference(pathlib.Path(res["out"]) / "model", seqs)
    worst = 0.0
    for name, cols in dump.items():
        act, req, pos = activations(cols), cols["request_id"], cols["position"]
        assert cols["dtype"] == ROW_DTYPE and act.shape[1] == 64
        # No row of no request: on CUDA the padding rows of SGLang's graph replays and the rows of requests not
        # captured are kept out on the device (the pass's row count and kept rows); on CPU they are never copied.
        none = req.astype(np.uint64) == np.uint64(NO_REQUEST)
        assert not none.any(), (name, int(none.sum()))
        act, req, pos = act[~none], req[~none], pos[~none]
        want = sorted((rid[k], p) for k in range(len(reqs)) if rid[k] is not None
                      for p in range(first[k], len(seqs[k])))
        assert sorted(zip(req.tolist(), pos.tolist())) == want, name
        for k in range(len(reqs)):
            if rid[k] is None:
                continue
            rows = req == rid[k]
            order = np.argsort(pos[rows])
            worst = max(worst, assert_rows_match(act[rows][order], ref[(k, name)][first[k]:], (name, k), TOLERANCE))
    last = sum(len(seqs[k]) == len(r["prompt"]) + len(r["tokens"]) for k, r in enumerate(reqs))
    print(f"check_rows: worst relative error {worst:.2e} (tolerance {TOLERANCE:g}, device {DEVICE}, {DTYPE}); "
          f"{last} of {len(reqs)} requests with their last token's row (LAST_TOKEN_PASS = {LAST_TOKEN_PASS})")
    return worst
