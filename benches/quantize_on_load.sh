#!/usr/bin/env bash
# Quantizing at load against converting ahead of time, side by side: a dense
# SmolLM2-135M-Instruct (the default model's weights dequantized to f16 with
# mx.dequantize, tests/reference/make_quantize_on_load_goldens.py's
# `smollm2_tensors`) loaded with `--q-bits B --q-group-size G`, and the same
# dense checkpoint converted by `mlx_lm.convert -q --q-bits B --q-group-size G`
# (the reference venv). Both are bit-identical (tests/quantize_on_load.rs), so
# decode speed must match. R interleaved rounds of `mlxcel bench --json`
# (alternating which goes first; each the median of 3 runs after a warm-up),
# with the process's RSS once loaded and its wall time (load and runs).
#
# Usage: benches/quantize_on_load.sh [--q-bits B] [--q-group-size G] [--rounds R]
#            [--prompt-tokens N] [--gen-tokens N] [--out FILE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BITS=4 GROUP=64 ROUNDS=3 PROMPT=128 GEN=128 OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --q-bits) BITS="$2"; shift 2 ;;
        --q-group-size) GROUP="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --prompt-tokens) PROMPT="$2"; shift 2 ;;
        --gen-tokens) GEN="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "quantize_on_load.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
MLXCEL="${MLXCEL:-${CARGO_TARGET_DIR:-$ROOT/target}/release/mlxcel}"
[[ -x "$MLXCEL" ]] || (cd "$ROOT" && cargo build --release -p mlxcel)
SMOLLM2="$("$MLXCEL" pull SmolLM2-135M-Instruct)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$ROOT/tests/reference/run.sh" - "$SMOLLM2" "$work" "$BITS" "$GROUP" "$ROOT/tests/reference" <<'PY' >&2
import json, shutil, sys
from pathlib import Path
import mlx.core as mx
sys.path.insert(0, sys.argv[5])
from make_quantize_on_load_goldens import TOKENIZER_FILES, smollm2_tensors
from mlx_lm.convert import convert
src, work, bits, group = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
config, tensors = smollm2_tensors(src)
dense = work / "dense"
dense.mkdir()
mx.save_safetensors(str(dense / "model.safetensors"), tensors, metadata={"format": "mlx"})
(dense / "config.json").write_text(json.dumps(config, indent=2))
for f in TOKENIZER_FILES + ["chat_template.jinja", "generation_config.json"]:
    if (src / f).exists():
        shutil.copy(src / f, dense / f)
convert(str(dense), str(work / "converted"), quantize=True, q_bits=bits, q_group_size=group)
PY

bench() { "$MLXCEL" bench --prompt-tokens "$PROMPT" --gen-tokens "$GEN" --repeat 3 --json "$@"; }
results="$work/results.jsonl"
for ((r = 0; r < ROUNDS; r++)); do
    order=(converted at_load)
    ((r % 2)) && order=(at_load converted)
    for which in "${order[@]}"; do
        start=$(date +%s.%N)
        if [[ $which == converted ]]; then
            out=$(bench --model "$work/converted")
        else
            out=$(bench --model "$work/dense" --q-bits "$BITS" --q-group-size "$GROUP")
        fi
        wall=$(echo "$(date +%s.%N) - $start" | bc)
        echo "$out" | python3 -c 'import json,sys; d=json.load(sys.stdin); d["which"]=sys.argv[1]; d["round"]=int(sys.argv[2]); d["wall_s"]=float(sys.argv[3]); print(json.dumps(d))' "$which" "$r" "$wall" >> "$results"
    done
done

# Load alone: the process's peak RSS while loading (mlxcel inspect: the network, no generation).
peak_load() { /usr/bin/time -f %M "$MLXCEL" inspect "$@" 2>&1 >/dev/null | tail -1; }
load_peaks="converted=$(peak_load "$work/converted") at_load=$(peak_load "$work/dense" --q-bits "$BITS" --q-group-size "$GROUP")"

python3 - "$results" "$BITS" "$GROUP" "$(du -sb "$work/dense/model.safetensors" | cut -f1)" "$(du -sb "$work/converted/model.safetensors" | cut -f1)" "$load_peaks" <<'PY' | tee ${OUT:+"$OUT"}
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
bits, group, dense_bytes, conv_bytes = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
peaks = dict(kv.split("=") for kv in sys.argv[6].split())
print(f"SmolLM2-135M-Instruct, {bits}-bit group {group}; cpu: {rows[0]['cpu']}; {rows[0]['kernel_threads']} kernel threads")
print(f"files: dense f16 {dense_bytes / 2**20:.1f} MiB, converted {conv_bytes / 2**20:.1f} MiB; "
      f"peak RSS while loading (mlxcel inspect): converted {int(peaks['converted']) / 1024:.0f} MiB, "
      f"dense quantized at load {int(peaks['at_load']) / 1024:.0f} MiB")
print(f"{'round':>5}  {'checkpoint':<28} {'decode tok/s':>12} {'prefill tok/s':>13} {'loaded RSS MiB':>14} {'peak RSS MiB':>12} {'wall s':>7}")
for r in rows:
    name = "converted (mlx_lm.convert -q)" if r["which"] == "converted" else f"dense, --q-bits {bits} at load"
    print(f"{r['round']:>5}  {name:<28} {r['decode_tps']:>12.1f} {r['prompt_tps']:>13.1f} "
          f"{r['loaded_rss_bytes'] / 2**20:>14.0f} {r['peak_rss_bytes'] / 2**20:>12.0f} {r['wall_s']:>7.2f}")
med = {w: statistics.median(r["decode_tps"] for r in rows if r["which"] == w) for w in ("converted", "at_load")}
print(f"median decode: converted {med['converted']:.1f} tok/s, quantized at load {med['at_load']:.1f} tok/s "
      f"(ratio {med['at_load'] / med['converted']:.3f})")
PY
