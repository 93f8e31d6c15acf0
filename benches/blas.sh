#!/usr/bin/env bash
# Float32 GEMM through MLX with Debian's OpenBLAS (the default build) and with
# the reference BLAS bundled in the mlx-cpu wheel (MLXCEL_BLAS=bundled), in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --release --quiet -p mlx-sys --example gemm_bench
MLXCEL_BLAS=bundled CARGO_TARGET_DIR=target/blas-bundled cargo run --release --quiet -p mlx-sys --example gemm_bench
