#!/usr/bin/env bash
# The SGLang plugin's tests (ringscope/sglang.py) against a real SGLang engine on CPU: sglang 0.5.23, in-process
# engines (their scheduler in a process of their own) serving a tiny random Llama (tests/sglang/*.py).
#
# Sets itself up like test.sh: the first run creates a virtual environment in .venv-sglang (or
# $RINGSCOPE_SGLANG_VENV) and installs torch 2.14.1 from PyPI (~2.7 GB with its CUDA wheels, which `import torch`
# needs even on CPU), sglang 0.5.23 without its dependencies (they pull CUDA kernels PyPI has no CPU build of), then
# what its CPU path imports (tests/sglang/requirements-sglang-cpu.txt, also --no-deps) and the tests' own packages
# (tests/sglang/requirements.txt) — a few minutes; later runs reuse it only while it holds exactly what they pin (tests/venv.sh). SGLang's CUDA
# kernel package has no CPU build on PyPI: tests/sglang/stub holds a stand-in `sgl_kernel` (the one function the CPU
# path calls, in torch) and `IPython`, put on the path of the engine's processes.
#
# The ringscope package is installed into it the way the README says (`pip install ./ffi/python`, which builds
# libringscope with cargo), unless RINGSCOPE_LIB names a library built already: then the tests import the package from
# the source tree with that library, and its SGLang entry point is declared in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=${RINGSCOPE_SGLANG_VENV:-.venv-sglang}
pip=(-m pip install --quiet --disable-pip-version-check --no-cache-dir)
install_sglang_packages() {
  "$py" "${pip[@]}" torch==2.14.1
  "$py" "${pip[@]}" --no-deps sglang==0.5.23
  "$py" "${pip[@]}" --no-deps -r tests/sglang/requirements-sglang-cpu.txt
  "$py" "${pip[@]}" -r tests/sglang/requirements.txt
}
# shellcheck source=tests/venv.sh
. tests/venv.sh
ensure_venv "$venv" install_sglang_packages tests/sglang/requirements.txt \
  tests/sglang/requirements-sglang-cpu.txt

export SGLANG_USE_CPU_ENGINE=1
stub="$PWD/tests/sglang/stub"
if [ -n "${RINGSCOPE_LIB:-}" ]; then
  # A prebuilt library: the package from the source tree, and the entry point SGLang looks for, declared by a
  # distribution's metadata in a temporary directory on the path.
  ep=$(mktemp -d)
  trap 'rm -rf "$ep"' EXIT
  mkdir -p "$ep/ringscope_sglang_tests-0.dist-info"
  printf 'Metadata-Version: 2.1\nName: ringscope-sglang-tests\nVersion: 0\n' \
    > "$ep/ringscope_sglang_tests-0.dist-info/METADATA"
  printf '[sglang.srt.plugins]\nringscope = ringscope.sglang:register\n' \
    > "$ep/ringscope_sglang_tests-0.dist-info/entry_points.txt"
  export PYTHONPATH="$PWD/ffi/python:$ep:$stub${PYTHONPATH:+:$PYTHONPATH}"
else
  "$py" "${pip[@]}" ./ffi/python
  export PYTHONPATH="$stub${PYTHONPATH:+:$PYTHONPATH}"
fi
"$py" -m pytest -q -p no:cacheprovider tests/sglang "$@"
# Again with SGLang's overlap scheduler (its default: the next batch is scheduled while the current one runs); the
# first pass runs without it.
echo "== again with SGLang's overlap scheduler"
RINGSCOPE_SGLANG_TEST_OVERLAP=1 "$py" -m pytest -q -p no:cacheprovider tests/sglang -k "not unsupported and not launch_server" "$@"
