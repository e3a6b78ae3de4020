"""Bad arguments to the GPU benchmarks are refused by name before anything touches a GPU (so this runs without one):
argparse's usage error, exit status 2, the flag and the value named."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.torch  # the benchmarks import torch and transformers

if not os.environ.get("RINGSCOPE_REQUIRE_TORCH"):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

BENCHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benches")


@pytest.mark.parametrize("script, args, named", [
    ("full_mode_decode.py", ["--only-prefill", "--prefill-variants", "full_no_sink,nope"],
     "--prefill-variants: no variant nope"),
    ("eager_overhead.py", ["--batches", "1,x"], "--batches"),
    ("eager_overhead.py", ["--batches", "0"], "--batches"),
    ("eager_overhead.py", ["--steps", "1"], "--steps"),
    ("hf_compiled_overhead.py", ["--controls", "top_hooks,nope"], "--controls: no control model nope"),
    ("hf_compiled_overhead.py", ["--parts", "generate,nope"], "--parts: unknown part 'nope'"),
    ("hf_compiled_overhead.py", ["--sync", "host"], "--sync: invalid choice"),
    ("hf_compiled_overhead.py", ["--batches", "1,x"], "--batches / --profile-batches: comma-separated integers"),
    ("hf_compiled_overhead.py", ["--profile-batches", "8,"], "--batches / --profile-batches: comma-separated integers"),
    ("compiled_host.py", ["--variants", "plain,nope"], "--variants: no variant nope"),
    ("compiled_host.py", ["--repeats", "0"], "--layers and --repeats must be at least 1"),
    ("compiled_host.py", ["--backend", "inductor"], "--backend: invalid choice"),
])
def test_a_bad_argument_is_refused_by_name_before_the_gpu(script, args, named):
    run = subprocess.run([sys.executable, os.path.join(BENCHES, script), *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert named in run.stderr, run.stderr[-2000:]


def test_an_unknown_sglang_bench_engine_is_refused_by_name():
    """benches/sglang_gpu.py takes its engines from RINGSCOPE_SGLANG_BENCH_KINDS: an unknown one is named, exit 2."""
    env = dict(os.environ, RINGSCOPE_SGLANG_BENCH_KINDS="plain,resid16,nope")
    run = subprocess.run([sys.executable, os.path.join(BENCHES, "sglang_gpu.py"), "cost", os.devnull], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "unknown engine(s) 'nope' (known: plain, resid16, resid16_now, resid1)" in run.stderr, run.stderr[-2000:]
