#!/usr/bin/env bash
# The test suite: Rust unit, integration and doc tests; the loom model check of the ring protocol; the main example
# dumping to Parquet, checked by `inspect` and read back bit for bit from Python (pyarrow, DuckDB, Polars).
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
cargo run --release --example dump_parquet -- --layers 4 --hidden 256 --requests 48 --run-id ci --arrow-ipc
cargo run --release --bin inspect -- ringscope-out/ci
RINGSCOPE_RUN_DIR=ringscope-out/ci python3 -m pytest -q tests/python
