#!/usr/bin/env bash
# Runs every test: the Rust workspace (unit tests, tiny-model parity against
# mlx-lm goldens, the real SmolLM2 model, the command line).
set -euo pipefail
cd "$(dirname "$0")"
command -v dpkg-query >/dev/null && scripts/install-system-deps
cargo test --release --workspace --locked "$@"
