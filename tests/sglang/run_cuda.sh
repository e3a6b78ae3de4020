#!/usr/bin/env bash
# The SGLang plugin's tests (tests/sglang) against a real SGLang engine on a CUDA GPU, with SGLang's CUDA graphs on:
# decode graphs (batch sizes up to 8) and its default breakable prefill graphs, triton attention.
#
# Not part of ./test.sh (CI has no GPU). Needs a Python with torch (CUDA), sglang and its Python dependencies
# importable (PYTHON, default python3), and RINGSCOPE_LIB naming a libringscope built with `cargo build --release -p
# ringscope-ffi`. The tests' model is float32 (its rows are compared with a float32 Hugging Face reference): every
# SGLang op that has a pure-torch path takes it (SGLang 0.5.17: tests/sglang/cuda_hooks, a test-only SGLang plugin;
# 0.5.23: SGLANG_FORCE_FUSED_OP_BACKEND=torch), since some of SGLang's fused CUDA ops have no float32 kernel; with the
# pytorch sampling backend. RINGSCOPE_SGLANG_TEST_DTYPE=bfloat16 serves the same checkpoint in bfloat16 on SGLang's
# own fused ops instead (rows against the float32 reference within 0.1 relative; on CPU they are within 6e-2, and
# neighbouring positions' rows over 0.2 apart). Where SGLang's CUDA kernel package (sgl_kernel) is not installed, the
# stand-in in tests/sglang/stub_cuda is used. Run so far: SGLang 0.5.17 with sgl_kernel 0.4.5 on an H100, every test
# passing in float32 (docs/gpu-benchmarks.md, sessions 45 and 46; bfloat16 not yet run on a GPU); SGLang 0.5.23 with
# the stand-in on an H200 reached the graph capture (session 20).
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
: "${RINGSCOPE_LIB:?set RINGSCOPE_LIB to a built libringscope.so}"
export RINGSCOPE_SGLANG_TEST_DEVICE=cuda RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA=1
if ! "$py" -c 'import sgl_kernel' 2>/dev/null; then
  echo "== sgl_kernel is not installed: using the stand-in in tests/sglang/stub_cuda"
  export PYTHONPATH="$PWD/tests/sglang/stub_cuda${PYTHONPATH:+:$PYTHONPATH}" SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
else
  echo "== sgl_kernel $("$py" -c 'import sgl_kernel; print(sgl_kernel.__version__)') (SGLang's CUDA kernel package)"
fi
if [ "${RINGSCOPE_SGLANG_TEST_DTYPE:-float32}" = float32 ]; then
  # The float32 model's ops on their torch path (see above), whichever SGLang this is.
  export PYTHONPATH="$PWD/tests/sglang/cuda_hooks${PYTHONPATH:+:$PYTHONPATH}" RINGSCOPE_SGLANG_TEST_NATIVE_OPS=1
  export SGLANG_FORCE_FUSED_OP_BACKEND=torch
else
  echo "== served in $RINGSCOPE_SGLANG_TEST_DTYPE on SGLang's fused CUDA ops"
fi
ep=$(mktemp -d)
trap 'rm -rf "$ep"' EXIT
# shellcheck source=tests/venv.sh
. tests/venv.sh
plugin_entry_point "$ep" sglang sglang.srt.plugins
# SGLang imports IPython.display somewhere on its path: the stand-in of tests/sglang/stub where IPython is missing.
"$py" -c 'import IPython' 2>/dev/null || cp -r tests/sglang/stub/IPython "$ep/"
export PYTHONPATH="$PWD/ffi/python:$ep${PYTHONPATH:+:$PYTHONPATH}"
"$py" -m pytest -q -s -p no:cacheprovider tests/sglang "$@"
