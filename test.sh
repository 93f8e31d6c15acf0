#!/usr/bin/env bash
# Runs every test: the Rust workspace (unit tests, tiny-model parity against
# mlx-lm goldens, the real SmolLM2 model, the command line, the C ABI with its
# C/C++ examples, `mlxcel serve` over HTTP), the aarch64 cross-compile check
# (which also runs the kernels under qemu-user), the Python and Node
# bindings, then the server with the official openai Python SDK and its chat
# page in headless Chromium.
set -euo pipefail
cd "$(dirname "$0")"
command -v dpkg-query >/dev/null && scripts/install-system-deps
cargo test --release --workspace --locked --exclude mlxcel-python --exclude mlxcel-node "$@"
scripts/check-aarch64
bindings/python/test.sh
bindings/node/test.sh
tests/server/run.sh
tests/ui/run.sh
tests/same_answer.sh
