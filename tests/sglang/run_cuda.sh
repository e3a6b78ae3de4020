#!/usr/bin/env bash
# The SGLang plugin's tests (tests/sglang) against a real SGLang engine (0.5.17 or 0.5.23) on a CUDA GPU, with SGLang's
# CUDA graphs on: decode graphs (batch sizes up to 8) and its default breakable prefill graphs, triton attention.
#
# Not part of ./test.sh (CI has no GPU). Needs a Python with torch (CUDA), sglang and its Python dependencies
# importable (PYTHON, default python3), and RINGSCOPE_LIB naming a libringscope built with `cargo build --release -p
# ringscope-ffi`. With SGLang's CUDA kernel package (sgl_kernel) installed, its kernels run, and the tests' float32
# model takes the torch path of the ops sgl_kernel has no float32 kernel for (tests/sglang/cuda_hooks; verified with
# SGLang 0.5.17 on an H100, docs/gpu-benchmarks.md session 45). Without it, the stand-in in tests/sglang/stub_cuda is
# used, with every SGLang fused op on its pure-torch path (SGLANG_FORCE_FUSED_OP_BACKEND=torch, read by 0.5.23) and the
# pytorch sampling backend: the model's arithmetic then differs from a production SGLang's, but the engine — its
# scheduler, batching, prefix cache, CUDA graph capture and replay — is SGLang's own.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-python3}
: "${RINGSCOPE_LIB:?set RINGSCOPE_LIB to a built libringscope.so}"
export RINGSCOPE_SGLANG_TEST_DEVICE=cuda RINGSCOPE_SGLANG_EXPERIMENTAL_CUDA=1
if ! "$py" -c 'import sgl_kernel' 2>/dev/null; then
  echo "== sgl_kernel is not installed: using the stand-in in tests/sglang/stub_cuda (fused ops on their torch path)"
  export PYTHONPATH="$PWD/tests/sglang/stub_cuda${PYTHONPATH:+:$PYTHONPATH}"
  export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
else
  # SGLang's real kernels; the tests' float32 model takes the torch path of the ops sgl_kernel has no float32 kernel
  # for (tests/sglang/cuda_hooks, a test-only SGLang plugin).
  echo "== sgl_kernel $("$py" -c 'import sgl_kernel; print(sgl_kernel.__version__)'): SGLang's CUDA kernels"
  export PYTHONPATH="$PWD/tests/sglang/cuda_hooks${PYTHONPATH:+:$PYTHONPATH}" RINGSCOPE_SGLANG_TEST_NATIVE_OPS=1
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
