#!/usr/bin/env bash
# The test suite: Rust unit, integration and doc tests; the loom model check of the ring protocol; the main example
# dumping to Parquet, checked by `inspect` and read back bit for bit from Python (pyarrow, DuckDB, Polars).
# Needs the Python packages in tests/python/requirements.txt.
set -euo pipefail
cd "$(dirname "$0")"

cargo test --workspace

RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 \
  cargo test -p ringscope-ring --release --test loom --target-dir target/loom

rm -rf ringscope-out/ci
cargo run --release --example dump_parquet -- --layers 4 --hidden 256 --requests 48 --run-id ci --arrow-ipc
cargo run --release --bin inspect -- ringscope-out/ci
RINGSCOPE_RUN_DIR=ringscope-out/ci python3 -m pytest -q tests/python
