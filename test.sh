#!/usr/bin/env bash
# The test suite: Rust unit, integration and doc tests; the loom model check of the ring protocol; the main example
# dumping to Parquet, checked by `inspect` and read back bit for bit from Python (pyarrow, DuckDB, Polars); the C ABI
# example compiled with the system C compiler against libringscope and its dump read back.
# Needs the Python packages in tests/python/requirements.txt. The GPU tests skip without a GPU
# (docs/gpu-benchmarks.md says how to run them on one).
set -euo pipefail
cd "$(dirname "$0")"

# NVRTC from PyPI (`pip install nvidia-cuda-nvrtc`), if installed, lets the tests compile the CUDA kernels without a
# GPU; with a CUDA toolkit or driver already on the loader path this changes nothing.
nvrtc_dir=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)
if [ -n "$nvrtc_dir" ] && [ -e "$nvrtc_dir/libnvrtc.so.13" ]; then
  export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

cargo test --workspace

RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
  cargo test -p ringscope-ring --release --test loom --target-dir target/loom

rm -rf ringscope-out/ci
cargo run --release --example dump_parquet -- --layers 4 --hidden 512 --requests 48 --run-id ci --arrow-ipc
cargo run --release -p ringscope-inspect -- ringscope-out/ci

# The C ABI: build libringscope (.so and .a), compile the C example against the committed header with the system C
# compiler, run it both ways, and check its dump.
cargo build --release -p ringscope-ffi
cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c -L target/release -lringscope -o target/c_engine
cc -std=c11 -Wall -Wextra -Werror -I ffi/include examples/c/engine.c target/release/libringscope.a \
  -lpthread -ldl -lm -o target/c_engine_static
rm -rf ringscope-out/c-engine ringscope-out/c-engine-static
LD_LIBRARY_PATH=target/release ./target/c_engine ringscope-out c-engine
./target/c_engine_static ringscope-out c-engine-static
cargo run --release -p ringscope-inspect -- ringscope-out/c-engine

RINGSCOPE_RUN_DIR=ringscope-out/ci RINGSCOPE_C_RUN_DIR=ringscope-out/c-engine python3 -m pytest -q tests/python
