#!/usr/bin/env bash
# Runs every test: the Rust workspace (unit tests, tiny-model parity against
# mlx-lm goldens, the real SmolLM2 model, the command line, the C ABI with its
# C/C++ examples), the aarch64 cross-compile check (which also runs the
# kernels under qemu-user), then the Python and Node bindings.
set -euo pipefail
cd "$(dirname "$0")"
command -v dpkg-query >/dev/null && scripts/install-system-deps
cargo test --release --workspace --locked --exclude mlxcel-python --exclude mlxcel-node "$@"
scripts/check-aarch64
bindings/python/test.sh
bindings/node/test.sh
tests/same_answer.sh
