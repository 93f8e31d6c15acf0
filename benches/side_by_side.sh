#!/usr/bin/env bash
# mlxcel and mlx-lm (stock mlx-cpu wheel, no OpenBLAS preload) on the same
# checkpoint and prompt, in one run. Usage: benches/side_by_side.sh [MODEL_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p mlxcel
model="${1:-$(./target/release/mlxcel inspect | sed -n 's/^checkpoint: *//p')}"
prompt="The capital of France is"
tokens=16
echo "model: $model"
echo "mlxcel:"
./target/release/mlxcel generate --model "$model" --prompt "$prompt" --max-tokens "$tokens" 2>&1 >/dev/null | sed 's/^/  /'
echo "mlx-lm (stock wheel):"
MLXCEL_OPENBLAS=none tests/reference/run.sh benches/mlx_lm_generate.py --model "$model" --prompt "$prompt" --max-tokens "$tokens" | sed 's/^/  /'
