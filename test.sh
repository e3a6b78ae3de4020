#!/usr/bin/env bash
# The test suite, one command that sets itself up (needs only the Rust toolchain, Python 3 with pip and a C compiler):
#
#   ./test.sh           everything: Rust unit, integration and doc tests; the loom model check of the ring protocol;
#                       Miri on the host ring's and the leases' unsafe code; the main example dumping to Parquet and
#                       Arrow IPC, checked by `inspect`; the C ABI example compiled with the system C compiler against
#                       libringscope, both ways, and its dump; the Python package's tests (pyarrow, DuckDB, Polars)
#                       and mypy on it; its PyTorch / Hugging Face tests (eager, CUDA-graph and torch.compile paths);
#                       the vLLM and SGLang plugins against real engines on CPU (tests/engine.sh).
#   ./test.sh --quick   for iteration: the Rust tests, the example and inspect, the C example, the torch-free Python
#                       tests (a few minutes once built).
#
# Everything runs on what `cargo test` builds (one build of the dependency tree, in the dev profile, whose dependencies
# are optimised: Cargo.toml): the example, inspect, the C library and the Python tests use those artifacts. Each stage
# prints its wall time, and the run ends with all of them and the total.
#
# Python: the packages are installed at the versions the requirement files pin into environments cached outside the
# checkout (tests/venv.sh: ${XDG_CACHE_HOME:-~/.cache}/ringscope/NAME-HASH; RINGSCOPE_VENV names another directory for
# the torch-free one), reused only while they hold exactly those pins. The first run downloads a few GB (two torch
# builds with their CUDA wheels, which `import torch` needs even on CPU, one per engine; NVRTC, which lets the Rust tests
# compile the CUDA kernels without a GPU) and takes several minutes more. The GPU tests are `#[ignore]`d without a GPU
# and say so (docs/gpu-benchmarks.md says how to run them on one).
set -euo pipefail
cd "$(dirname "$0")"

quick=0
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "test.sh: unknown argument '$arg' (usage: ./test.sh [--quick])" >&2; exit 2 ;;
  esac
done

# --- Stages and their wall times ------------------------------------------------------------------------------------
run_start=$(date +%s)
stage_name=""
stage_start=$run_start
stage_lines=()
stage() {
  local now
  now=$(date +%s)
  if [ -n "$stage_name" ]; then
    echo "== $stage_name: $((now - stage_start)) s"
    stage_lines+=("$(printf '%6d s  %s' $((now - stage_start)) "$stage_name")")
  fi
  stage_name=$1
  stage_start=$now
  [ -z "$1" ] || echo "== $1"
}
summary() {
  local rc=$?
  # Background jobs (the engines' environments being built, the vLLM suite) end with the run; an environment cut short
  # is recognised as such and built again next time (tests/venv.sh).
  [ -z "$(jobs -p)" ] || kill $(jobs -p) 2>/dev/null || true
  stage ""
  echo "== test.sh stage times"
  printf '%s\n' "${stage_lines[@]}"
  if [ "$rc" = 0 ]; then
    echo "== test.sh$([ $quick = 1 ] && echo " --quick"): passed in $(($(date +%s) - run_start)) s"
  else
    echo "== test.sh$([ $quick = 1 ] && echo " --quick"): FAILED (exit $rc) after $(($(date +%s) - run_start)) s" >&2
  fi
}
trap summary EXIT

# --- The torch-free Python environment ------------------------------------------------------------------------------
stage "python environment"
free_gb=$(df -Pk . 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }') || free_gb=""
if [ -n "$free_gb" ] && [ "$free_gb" -lt 20 ] && [ ! -d target/debug ]; then
  echo "test.sh: warning: ${free_gb} GB free here; a first run needs about 20 GB (the build and three Python" \
       "environments)" >&2
fi
# shellcheck source=tests/venv.sh
. tests/venv.sh
install_test_packages() {
  "$py" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
    -r tests/python/requirements.txt -c tests/python/constraints.txt
}
ensure_cached_venv python "${RINGSCOPE_VENV:-}" install_test_packages tests/python/requirements.txt \
  tests/python/constraints.txt
# NVRTC (CUDA 13) from PyPI, in that environment: the Rust tests compile the CUDA kernels with it, and fail if it is
# missing.
nvrtc_dir=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))')
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RINGSCOPE_REQUIRE_NVRTC=1

# The engines' environments (a few GB of downloads the first time, nothing once cached) are made in the background
# while the Rust tests compile; their output goes to a log, shown if they fail.
engine_setup=()
if [ $quick = 0 ]; then
  mkdir -p ringscope-out
  for engine in vllm sglang; do
    tests/engine.sh $engine --setup > "ringscope-out/setup-$engine.log" 2>&1 &
    engine_setup+=("$engine:$!")
  done
fi
engine_ready() {  # waits for the background setup of one engine's environment
  local e pid
  for e in "${engine_setup[@]}"; do
    [ "${e%%:*}" = "$1" ] || continue
    pid=${e#*:}
    if ! wait "$pid"; then
      cat "ringscope-out/setup-$1.log" >&2
      echo "test.sh: setting up the $1 tests' environment failed (log above)" >&2
      return 1
    fi
    tail -n 3 "ringscope-out/setup-$1.log"
  done
}

# --- Rust -----------------------------------------------------------------------------------------------------------
target="${CARGO_TARGET_DIR:-target}"
stage "rust tests (cargo test --workspace)"
cargo test --workspace

if [ $quick = 0 ]; then
  stage "loom model check of the ring protocol"
  RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
    cargo test -p ringscope-ring --release --test loom --target-dir "$target/loom"

  # Miri (undefined behaviour and data races) on a nightly toolchain with the miri component, installed through rustup
  # the first time. Without rustup this is skipped with a message, unless RINGSCOPE_REQUIRE_MIRI=1 (CI).
  stage "miri on the host ring's and the leases' unsafe code"
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
fi

# The C library (.so and .a), inspect and the examples, from the dependencies `cargo test` built: `--tests` makes cargo
# resolve features as the tests did, so nothing but the workspace's own crates is compiled again (without it the
# dev-dependencies' features differ, and arrow and parquet would be built a second time).
stage "example and inspect (the artifacts cargo test built)"
cargo build --workspace --lib --bins --examples --tests
bin="$target/debug"
rm -rf ringscope-out/ci
"$bin/examples/dump_parquet" --layers 4 --hidden 512 --requests 48 --run-id ci --arrow-ipc
"$bin/inspect" ringscope-out/ci

# --- The C ABI: the C example compiled against the committed header with the system C compiler, linked both ways, run,
# and its dump checked.
stage "C example"
cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c -L "$bin" -lringscope -o "$bin/c_engine"
cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c "$bin/libringscope.a" \
  -lpthread -ldl -lm -o "$bin/c_engine_static"
rm -rf ringscope-out/c-engine ringscope-out/c-engine-static
LD_LIBRARY_PATH="$bin" "$bin/c_engine" ringscope-out c-engine
"$bin/c_engine_static" ringscope-out c-engine-static
"$bin/inspect" ringscope-out/c-engine

# --- Python: the package from the source tree with the library built above.
export RINGSCOPE_LIB="$PWD/$bin/libringscope.so" RINGSCOPE_INSPECT="$PWD/$bin/inspect"
export RINGSCOPE_RUN_DIR=ringscope-out/ci RINGSCOPE_C_RUN_DIR=ringscope-out/c-engine
stage "python tests (torch-free)"
PYTHONPATH="$PWD/ffi/python" "$py" -m pytest -q -p no:cacheprovider tests/python -m "not torch"
[ $quick = 1 ] && exit 0

stage "mypy on the Python package"
MYPYPATH=ffi/python "$py" -m mypy --config-file ffi/python/pyproject.toml -p ringscope

# --- torch / Hugging Face and the engines: each engine pins its own torch (tests/engine.sh). The torch tests of
# tests/python run in the vLLM one (torch and transformers must be there: RINGSCOPE_REQUIRE_TORCH).
stage "python tests with torch and Hugging Face (vLLM's environment)"
engine_ready vllm
RINGSCOPE_REQUIRE_TORCH=1 tests/engine.sh vllm tests/python -m torch

# The two engine suites side by side: each keeps about one core busy (an engine on CPU, its processes mostly waiting on
# one another), so together they take about as long as the longer one. The vLLM suite's output is shown when it ends.
stage "vLLM and SGLang plugins against real engines on CPU (side by side)"
engine_ready sglang
tests/engine.sh vllm tests/vllm > ringscope-out/vllm-tests.log 2>&1 &
vllm_pid=$!
sglang_rc=0
tests/sglang/run.sh || sglang_rc=$?
vllm_rc=0
wait "$vllm_pid" || vllm_rc=$?
echo "== the vLLM suite's output"
cat ringscope-out/vllm-tests.log
[ "$vllm_rc" = 0 ] || { echo "test.sh: the vLLM plugin's tests failed (exit $vllm_rc)" >&2; exit 1; }
[ "$sglang_rc" = 0 ] || { echo "test.sh: the SGLang plugin's tests failed (exit $sglang_rc)" >&2; exit 1; }
