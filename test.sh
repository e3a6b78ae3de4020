#!/usr/bin/env bash
# The test suite, one command that sets itself up (needs only the Rust toolchain, Python 3 with pip and a C compiler):
#
#   ./test.sh           everything: Rust unit, integration and doc tests; the loom model check of the ring protocol;
#                       Miri on the host ring's and the leases' unsafe code; the main example dumping to Parquet and
#                       Arrow IPC, checked by `inspect`; the C ABI example compiled with the system C compiler against
#                       libringscope, both ways, and its dump; the Python package's tests (pyarrow, DuckDB, Polars;
#                       dumps to a real S3 server on loopback, SeaweedFS, read back there and by Ray Data) and mypy on
#                       it; its PyTorch / Hugging Face tests (eager, CUDA-graph and torch.compile paths); the vLLM
#                       and SGLang plugins against real engines on CPU (tests/engine.sh).
#   ./test.sh --quick   for iteration: the Rust tests, the example and inspect, the C example, the torch-free Python
#                       tests (a few minutes once built).
#
# Everything runs on what `cargo test` builds (one build of the dependency tree, in the dev profile, whose dependencies
# are optimised: Cargo.toml): the example, inspect, the C library and the Python tests use those artifacts. Each stage
# prints its wall time, and the run ends with all of them and the total.
#
# Python: the packages are installed at the versions the requirement files pin into environments cached outside the
# checkout (tests/venv.sh: ${XDG_CACHE_HOME:-~/.cache}/ringscope/NAME-HASH; RINGSCOPE_VENV names another directory for
# the torch-free one), reused only while they hold exactly those pins. The first run downloads a few GB (three torch
# builds with their CUDA wheels, which `import torch` needs even on CPU, one per engine environment; NVRTC, which lets
# the Rust tests compile the CUDA kernels without a GPU) and takes several minutes more. The GPU tests are `#[ignore]`d
# without a GPU and say so (docs/gpu-benchmarks.md says how to run them on one).
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

# --- Background jobs: the machine has few cores and several parts of the suite keep only one of them busy (an engine
# on CPU, Miri, downloads), so those run beside others. Each one's output goes to ringscope-out/logs/NAME.log and is
# shown whole when it is joined; a job that failed fails the run there.
mkdir -p ringscope-out/logs
background=()
start_job() {  # start_job NAME COMMAND...
  local name=$1
  shift
  rm -f "ringscope-out/logs/$name.end"
  { "$@" && rc=0 || rc=$?; date +%s > "ringscope-out/logs/$name.end"; exit $rc; } > "ringscope-out/logs/$name.log" 2>&1 &
  background+=("$name:$!:$(date +%s)")
  echo "== $name: started beside the rest (ringscope-out/logs/$name.log)"
}
join_job() {  # join_job NAME: waits for it, shows its output, fails if it failed
  local job name pid started rc
  for job in "${background[@]}"; do
    IFS=: read -r name pid started <<< "$job"
    [ "$name" = "$1" ] || continue
    rc=0
    wait "$pid" || rc=$?
    local took=$(($(cat "ringscope-out/logs/$name.end" 2>/dev/null || date +%s) - started))
    echo "== $name (ran beside the rest for $took s): $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)")"
    sed 's/^/   | /' "ringscope-out/logs/$name.log"
    stage_lines+=("$(printf '%6d s  %s (beside the rest)' "$took" "$name")")
    [ $rc = 0 ] || { echo "test.sh: $name failed (its output above)" >&2; return 1; }
    return 0
  done
  echo "test.sh: no background job named $1" >&2
  return 1
}

# --- The torch-free Python environment ------------------------------------------------------------------------------
stage "python environment"
free_gb=$(df -Pk . 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }') || free_gb=""
if [ -n "$free_gb" ] && [ "$free_gb" -lt 20 ] && [ ! -d target/debug ]; then
  echo "test.sh: warning: ${free_gb} GB free here; a first run needs about 25 GB (the build and four Python" \
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

# The engines' environments (a few GB of downloads the first time, nothing once cached) are made while the Rust tests
# compile.
if [ $quick = 0 ]; then
  start_job vllm-env tests/engine.sh vllm --setup
  start_job sglang-env tests/engine.sh sglang --setup
  start_job sglang-0.5.17-env tests/engine.sh sglang-0.5.17 --setup
fi

# --- Rust -----------------------------------------------------------------------------------------------------------
target="${CARGO_TARGET_DIR:-target}"
bin="$target/debug"
stage "rust tests (cargo test --workspace)"
cargo test --workspace

# The C library (.so and .a), inspect and the examples, from the dependencies `cargo test` built: `--tests` makes cargo
# resolve features as the tests did, so nothing but the workspace's own crates is linked again (without it the
# dev-dependencies' features differ, and arrow and parquet would be built a second time).
stage "the library, inspect and the examples (linked from what cargo test built)"
cargo build --workspace --lib --bins --examples --tests
# The Python tests (and the engines') use the package from the source tree with this library.
export RINGSCOPE_LIB="$PWD/$bin/libringscope.so" RINGSCOPE_INSPECT="$PWD/$bin/inspect"

if [ $quick = 0 ]; then
  # The SGLang plugin's tests against a real SGLang engine on CPU, first pass (its launch_server runs, stopped eight
  # ways, twice each: the longest part of the suite, about one core busy) from here on, beside everything below.
  join_job sglang-env
  start_job sglang-tests tests/engine.sh sglang tests/sglang

  # Miri on the host ring's and the leases' unsafe code (undefined behaviour and data races), on a nightly toolchain
  # with the miri component, installed through rustup the first time; it interprets the tests on one core, beside the
  # rest. Without rustup it is skipped with a message, unless RINGSCOPE_REQUIRE_MIRI=1 (CI).
  if command -v rustup >/dev/null; then
    if ! cargo +nightly miri --version >/dev/null 2>&1; then
      stage "installing a nightly toolchain with Miri (first run only)"
      rustup toolchain install nightly --profile minimal --component miri,rust-src
    fi
    start_job miri env MIRIFLAGS="-Zmiri-disable-isolation" \
      cargo +nightly miri test -p ringscope-ring --lib --target-dir "$target/miri" -- host:: lease:: space::
  elif [ "${RINGSCOPE_REQUIRE_MIRI:-0}" = 1 ]; then
    echo "test.sh: Miri needs rustup (to install a nightly toolchain with the miri component)" >&2
    exit 1
  else
    echo "== skipping Miri: no rustup to install a nightly toolchain with it"
  fi

  stage "loom model check of the ring protocol"
  RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
    cargo test -p ringscope-ring --release --test loom --target-dir "$target/loom"
fi

stage "example and inspect"
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

# --- Python: the package from the source tree with the library built above, reading back both dumps; the object
# storage tests run the example and the C example against a real S3 server (SeaweedFS, from that environment).
export RINGSCOPE_RUN_DIR=ringscope-out/ci RINGSCOPE_C_RUN_DIR=ringscope-out/c-engine
export RINGSCOPE_EXAMPLE="$PWD/$bin/examples/dump_parquet" RINGSCOPE_C_ENGINE="$PWD/$bin/c_engine"
export RINGSCOPE_REQUIRE_S3=1
stage "python tests (torch-free)"
PYTHONPATH="$PWD/ffi/python" "$py" -m pytest -q -p no:cacheprovider tests/python -m "not torch"
[ $quick = 1 ] && exit 0

stage "mypy on the Python package"
MYPYPATH=ffi/python "$py" -m mypy --config-file ffi/python/pyproject.toml -p ringscope
if command -v rustup >/dev/null; then
  join_job miri
fi

# --- torch / Hugging Face and the engines: each engine pins its own torch (tests/engine.sh); the torch tests of
# tests/python run in the vLLM one (torch and transformers must be there: RINGSCOPE_REQUIRE_TORCH).
stage "python tests with torch and Hugging Face (the vLLM tests' environment)"
join_job vllm-env
RINGSCOPE_REQUIRE_TORCH=1 tests/engine.sh vllm tests/python -m torch

stage "vLLM plugin against a real vLLM engine on CPU"
tests/engine.sh vllm tests/vllm

stage "SGLang plugin again, with SGLang's overlap scheduler (its default; the server runs only in the first pass)"
RINGSCOPE_SGLANG_TEST_OVERLAP=1 tests/engine.sh sglang tests/sglang -k "not unsupported and not launch_server"

stage "SGLang plugin, first pass (started after the Rust tests)"
join_job sglang-tests

# SGLang 0.5.17: the newest release that pins the torch of the GPU machine docs/sglang.md names; the same two passes
# (the server's eight ways of stopping once each here, twice against 0.5.23).
stage "SGLang plugin against SGLang 0.5.17"
join_job sglang-0.5.17-env
RINGSCOPE_SGLANG_STOP_REPEATS=1 tests/engine.sh sglang-0.5.17 tests/sglang
stage "SGLang plugin against SGLang 0.5.17, with its overlap scheduler"
RINGSCOPE_SGLANG_TEST_OVERLAP=1 tests/engine.sh sglang-0.5.17 tests/sglang -k "not unsupported and not launch_server"
stage "SGLang plugin against SGLang 0.5.17, the model served in bfloat16 (rows as bf16, against the float32 reference)"
RINGSCOPE_SGLANG_TEST_DTYPE=bfloat16 tests/engine.sh sglang-0.5.17 tests/sglang -k "not unsupported and not launch_server"
